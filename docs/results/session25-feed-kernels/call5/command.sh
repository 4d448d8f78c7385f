set -uo pipefail
out=$OUT
source scripts/gpu_build.sh
nvidia-smi --query-gpu=name --format=csv > "$out/gpu.txt" 2>&1
build-gpu/bin/test_decode_kernels --gtest_filter='*CacheAttention*' 2>&1 | grep -E "OK|FAIL|variants" | head
model=configs/models/qwen2.5-0.5b
for r in 1 2; do
  for w in 4 2; do
  build-gpu/bin/bench_rollout --model $model --tokenizer .gpu/fixtures/tokenizers/qwen3 --device cuda \
    --dtype bfloat16 --batch 64 --prompt-len 256 --new-tokens 512 --tool-every 96 --workers 16 --feed-wait $w \
    --modes tools_eager,spread_eager,spread_kept --json "$out/loop_w${w}_$r.json" 2>&1 | tee -a "$out/loop.log"
  done
done
build-gpu/bin/bench_sandbox --help 2>&1 | head -30 > "$out/bench_sandbox_help.txt"
