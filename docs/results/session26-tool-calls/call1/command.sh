set -uo pipefail
out=$OUT
{
  echo "== python"; which python3; python3 -c 'import sys; print(sys.executable, sys.prefix, sys.version)'
  python3 -c 'import site,glob; [print(p, len(glob.glob(p+"/*.pth")), glob.glob(p+"/*.pth")) for p in site.getsitepackages()]'
  python3 -I -c 'import sys; print("modules with site:", len(sys.modules))'
  nproc; uptime
} > "$out/host.txt" 2>&1
python3 .gpu/fin.py >> "$out/host.txt" 2>&1
python3 -I -X importtime -c pass 2> "$out/importtime.txt"
source scripts/gpu_build.sh
nvidia-smi --query-gpu=name --format=csv > "$out/gpu.txt" 2>&1
build-gpu/bin/bench_sandbox --resident-gb 2 --calls 40 --workers 16 --load-s 10 --json > "$out/sandbox.json" 2> "$out/sandbox.log"
model=configs/models/qwen2.5-0.5b
for w in 16 64 32; do
  build-gpu/bin/bench_rollout --model $model --tokenizer .gpu/fixtures/tokenizers/qwen3 --device cuda \
    --dtype bfloat16 --batch 64 --prompt-len 256 --new-tokens 512 --tool-every 96 --workers $w \
    --modes tools_eager,spread_kept,spread_merged_kept --json "$out/loop_w$w.json" 2>&1 | tee -a "$out/loop.log"
done
