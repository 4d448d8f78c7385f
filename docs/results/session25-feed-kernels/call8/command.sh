set -uo pipefail
out=$OUT
source scripts/gpu_build.sh
nvidia-smi --query-gpu=name --format=csv > "$out/gpu.txt" 2>&1
run_gpu_ctest; echo "ctest rc=$?"
model=configs/models/qwen2.5-0.5b
for r in 1 2; do
  build-gpu/bin/bench_rollout --model $model --tokenizer .gpu/fixtures/tokenizers/qwen3 --device cuda \
    --dtype bfloat16 --batch 64 --prompt-len 256 --new-tokens 512 --tool-every 96 --workers 16 \
    --modes tools_eager,spread_eager,spread_kept,spread_merged_kept,spread_merged_now_kept --json "$out/loop_$r.json" 2>&1 | tee -a "$out/loop.log"
done
