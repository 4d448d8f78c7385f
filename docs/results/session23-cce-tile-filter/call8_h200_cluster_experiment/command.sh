set -uo pipefail
out=$OUT
source scripts/gpu_build.sh
nvidia-smi --query-gpu=name --format=csv > "$out/gpu.txt" 2>&1
(cd build-gpu && ctest --no-tests=error -R 'Cce|Logprob' --output-on-failure) > $OUT/ctest.log 2>&1
grep -E "tests passed|tests failed|\*\*\*Failed|Failed  " $OUT/ctest.log
grep -E "Actual|trace|Failure|error" $OUT/ctest.log | head -20
timeout 80 build-gpu/bin/bench_loss --device cuda --case seed002 --impl cce cce_nofilter cce_tiles_all --reps 10 --json $OUT/cpp_seed002.json 2>&1 | tee -a $OUT/bench.log
timeout 70 build-gpu/bin/bench_loss --device cuda --case peaked --impl cce cce_nofilter --reps 10 --json $OUT/cpp_peaked.json 2>&1 | tee -a $OUT/bench.log
timeout 70 build-gpu/bin/bench_loss --device cuda --case heads --impl cce cce_nofilter --reps 10 --json $OUT/cpp_heads.json 2>&1 | tee -a $OUT/bench.log
