set -uo pipefail
out=$OUT
source scripts/gpu_build.sh
nvidia-smi --query-gpu=name --format=csv > "$out/gpu.txt" 2>&1
model=configs/models/qwen2.5-0.5b
common=(--model $model --tokenizer .gpu/fixtures/tokenizers/qwen3 --device cuda --dtype bfloat16)
for r in 1 2; do
  build-gpu/bin/bench_rollout "${common[@]}" --batch 64 --prompt-len 256 --new-tokens 512 --tool-every 96 --workers 16 --nice 0 \
    --modes tools_eager,spread_kept,spread_merged_kept --json "$out/loop64_w16n0_$r.json" 2>&1 | tee -a "$out/loop.log"
  build-gpu/bin/bench_rollout "${common[@]}" --batch 64 --prompt-len 256 --new-tokens 512 --tool-every 96 --workers 32 --nice 10 \
    --modes tools_eager,spread_kept,spread_merged_kept --json "$out/loop64_w32n10_$r.json" 2>&1 | tee -a "$out/loop.log"
done
build-gpu/bin/bench_rollout "${common[@]}" --batch 256 --prompt-len 256 --new-tokens 1024 --tool-every 256 --workers 32 --nice 10 \
  --modes tools_eager,spread_kept,spread_merged_kept --json "$out/loop256_w32n10.json" 2>&1 | tee -a "$out/loop.log"
build-gpu/bin/bench_rollout "${common[@]}" --batch 256 --prompt-len 256 --new-tokens 1024 --tool-every 256 --workers 16 --nice 0 \
  --modes tools_eager,spread_kept,spread_merged_kept --json "$out/loop256_w16n0.json" 2>&1 | tee -a "$out/loop.log"
