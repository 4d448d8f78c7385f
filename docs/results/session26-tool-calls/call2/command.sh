set -uo pipefail
out=$OUT
source scripts/gpu_build.sh
nvidia-smi --query-gpu=name --format=csv > "$out/gpu.txt" 2>&1
(cd build-gpu && ctest -R 'Sandbox|Containment|Tools' --output-on-failure -j 4) > "$out/ctest_sandbox.log" 2>&1; grep -E 'tests passed|Failed|\*\*\*' "$out/ctest_sandbox.log" | head
build-gpu/bin/bench_sandbox --resident-gb 2 --calls 40 --workers 16 --load-s 10 --json > "$out/sandbox.json" 2> /dev/null
python3 -c "import json; d=json.load(open('$out/sandbox.json')); print(json.dumps(d['pool'])); print(json.dumps(d['load']))"
model=configs/models/qwen2.5-0.5b
for r in 1 2; do for w in 16 32; do
  build-gpu/bin/bench_rollout --model $model --tokenizer .gpu/fixtures/tokenizers/qwen3 --device cuda \
    --dtype bfloat16 --batch 64 --prompt-len 256 --new-tokens 512 --tool-every 96 --workers $w \
    --modes tools_eager,spread_kept,spread_merged_kept --json "$out/loop_w${w}_$r.json" 2>&1 | tee -a "$out/loop.log"
done; done
