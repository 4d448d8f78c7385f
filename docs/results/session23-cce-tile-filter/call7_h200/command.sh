set -uo pipefail
out=$OUT
source scripts/gpu_build.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
timeout 330 bash -c 'out=$OUT; GPU_REBUILD=0; source scripts/gpu_build.sh; run_gpu_ctest' ; echo "full ctest rc=$?"
grep -E "Cce|Logprob" $OUT/ctest.log | grep -E "Test +#" | head -30
for c in seed002 peaked; do
  timeout 60 build-gpu/bin/bench_loss --device cuda --case $c --impl cce cce_nofilter --reps 10 --json $OUT/cpp_$c.json 2>&1 | tee -a $OUT/bench.log
done
