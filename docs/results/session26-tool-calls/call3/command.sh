set -uo pipefail
out=$OUT
source scripts/gpu_build.sh
nvidia-smi --query-gpu=name --format=csv > "$out/gpu.txt" 2>&1
(cd build-gpu && ctest -R 'DecodeKernels|ModelPolicy|StepSpans|KeepCache|ReservedRows|AdmitInto|Compaction|ReTool|Transformer' --output-on-failure -j 4) > "$out/ctest_policy.log" 2>&1; grep -E 'tests passed|Failed|\*\*\*' "$out/ctest_policy.log" | head
model=configs/models/qwen2.5-0.5b
for r in 1 2; do for nice in 0 10; do
  build-gpu/bin/bench_rollout --model $model --tokenizer .gpu/fixtures/tokenizers/qwen3 --device cuda \
    --dtype bfloat16 --batch 64 --prompt-len 256 --new-tokens 512 --tool-every 96 --workers 32 --nice $nice \
    --modes tools_eager,spread_kept,spread_merged_kept --json "$out/loop_n${nice}_$r.json" 2>&1 | tee -a "$out/loop.log"
done; done
