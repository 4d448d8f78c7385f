set -uo pipefail
out=$OUT
source scripts/gpu_build.sh
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$out/gpu.txt" 2>&1
model=configs/models/qwen2.5-0.5b
# issue 14: where the tools loop's step time goes (device time per replay, by span)
(cd build-gpu && ctest -R 'ModelPolicy|StepSpans|KeepCache' --output-on-failure) > "$out/ctest_policy.log" 2>&1; grep -E 'tests passed|Failed' "$out/ctest_policy.log"
for r in 1 2; do
  build-gpu/bin/bench_rollout --model $model --tokenizer .gpu/fixtures/tokenizers/qwen3 --device cuda \
    --dtype bfloat16 --batch 64 --prompt-len 256 --new-tokens 512 --tool-every 96 --workers 16 \
    --modes tools_eager,tools_kept,spread_kept --json "$out/loop_$r.json" 2>&1 | tee -a "$out/loop.log"
done
# issue 15: seed002 fw against cuBLAS's bare logits GEMM on this GPU, with the clock sampled; selective seed000
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 20 > "$out/clocks.csv" &
smi=$!
echo "fw start $(date +%T.%N)" >> "$out/marks.txt"
build-gpu/bin/bench_loss --device cuda --case seed002 --impl cce --reps 20 --json "$out/seed002.json" 2>&1 | tee -a "$out/bench.log"
echo "gemm start $(date +%T.%N)" >> "$out/marks.txt"
python3 scripts/gemm_ceiling.py --shape seed002 --reps 20 2>&1 | tee -a "$out/bench.log"
echo "sel start $(date +%T.%N)" >> "$out/marks.txt"
build-gpu/bin/bench_loss --device cuda --case seed000 --impl selective selective_inplace --reps 20 --json "$out/seed000.json" 2>&1 | tee -a "$out/bench.log"
echo "end $(date +%T.%N)" >> "$out/marks.txt"
kill $smi
python3 scripts/bench_peers.py --device cuda --case seed000 --reps 10 2>&1 | tee -a "$out/bench.log"
cat "$out/marks.txt" >> "$out/bench.log"
ls -la $out
