set -uo pipefail
out=$OUT
source scripts/gpu_build.sh
nvidia-smi --query-gpu=name --format=csv > "$out/gpu.txt" 2>&1
(cd build-gpu && ctest -R 'DecodeKernels|ModelPolicy|StepSpans|KeepCache|ReservedRows|AdmitInto|Compaction|ReTool|Transformer' --output-on-failure) > "$out/ctest_policy.log" 2>&1; grep -E 'tests passed|Failed|Skipped' "$out/ctest_policy.log" | head
model=configs/models/qwen2.5-0.5b
build-gpu/bin/bench_rollout --model $model --tokenizer .gpu/fixtures/tokenizers/qwen3 --device cuda \
    --dtype bfloat16 --batch 64 --prompt-len 256 --new-tokens 512 --tool-every 96 --workers 16 \
    --modes tools_eager,spread_kept,spread_merged_kept --json "$out/loop_1.json" 2>&1 | tee -a "$out/loop.log"
