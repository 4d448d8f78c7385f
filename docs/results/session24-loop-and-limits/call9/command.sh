set -uo pipefail
out=$OUT
source scripts/gpu_build.sh
nvidia-smi --query-gpu=name --format=csv > "$out/gpu.txt" 2>&1
run_gpu_ctest; echo "ctest rc=$?"
model=configs/models/qwen2.5-0.5b
for r in 1 2; do
build-gpu/bin/bench_rollout --model $model --tokenizer .gpu/fixtures/tokenizers/qwen3 --device cuda \
  --dtype bfloat16 --batch 64 --prompt-len 256 --new-tokens 512 --tool-every 96 --workers 16 \
  --modes tools_eager,tools_kept,spread_kept --json "$out/loop_$r.json" 2>&1 | tee -a "$out/loop.log"
done
python3 - "$out" <<'PY'
import json, glob, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "loop_*.json"))):
    for r in json.load(open(f)):
        n = r["decode_steps"] + r["feed_steps"]
        print(os.path.basename(f), f'{r["mode"]:12s} ratio {r["ratio_to_plain"]:.3f} draws {n} sample ms/draw {1e3 * r["sample_s"] / n:.3f} '
              f'of it turn parsing {1e3 * r["turn_s"] / n:.3f} (total turn_s {r["turn_s"]:.3f})')
PY
