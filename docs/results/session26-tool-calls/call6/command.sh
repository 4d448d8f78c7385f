set -uo pipefail
out=$OUT
source scripts/gpu_build.sh
nvidia-smi --query-gpu=name --format=csv > "$out/gpu.txt" 2>&1
model=configs/models/qwen2.5-0.5b
common=(--model $model --tokenizer .gpu/fixtures/tokenizers/qwen3 --device cuda --dtype bfloat16 --workers 16)
build-gpu/bin/bench_rollout "${common[@]}" --batch 256 --prompt-len 256 --new-tokens 1024 --tool-every 256 \
  --modes spread_eager,spread_graphs,spread_merged,spread_merged_kept --json "$out/loop256.json" 2>&1 | tee -a "$out/loop.log"
build-gpu/bin/bench_rollout "${common[@]}" --batch 64 --prompt-len 256 --new-tokens 512 --tool-every 96 \
  --modes spread_eager,spread_graphs,spread_merged,spread_merged_kept --json "$out/loop64.json" 2>&1 | tee -a "$out/loop.log"
