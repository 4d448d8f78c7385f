set -uo pipefail
out=$OUT
source scripts/gpu_build.sh
nvidia-smi --query-gpu=name --format=csv > "$out/gpu.txt" 2>&1
(cd build-gpu && ctest -R 'DecodeKernels|ModelPolicy|StepSpans|KeepCache|ReservedRows|AdmitInto|Compaction|ReTool|Transformer' --output-on-failure) > "$out/ctest_policy.log" 2>&1; grep -E 'tests passed|Failed|Skipped' "$out/ctest_policy.log" | head
build-gpu/bin/test_decode_kernels --gtest_filter='*CacheAttention*' 2>&1 | tail -15
build-gpu/bin/test_retool --gtest_filter='*FusedFeeds*' 2>&1 | grep -E "OK|FAIL|Failure|fused|rror" | head
model=configs/models/qwen2.5-0.5b
build-gpu/bin/bench_model --model $model --device cuda --dtype bfloat16 --batch 64 --prompt-len 256 \
  --new-tokens 16 --reps 1 --modes decode_greedy --trace "$out/trace.json" > "$out/bench_model.log" 2>&1 || tail -20 "$out/bench_model.log"
python3 scripts/trace_summary.py "$out/trace.json" --top 25 > "$out/trace_summary.txt"; rm -f "$out/trace.json"
awk '/^== extend_fixed/,0' "$out/trace_summary.txt" | head -40
for r in 1 2; do
  build-gpu/bin/bench_rollout --model $model --tokenizer .gpu/fixtures/tokenizers/qwen3 --device cuda \
    --dtype bfloat16 --batch 64 --prompt-len 256 --new-tokens 512 --tool-every 96 --workers 16 \
    --modes tools_eager,spread_eager,tools_kept,spread_kept --json "$out/loop_$r.json" 2>&1 | tee -a "$out/loop.log"
done
