set -uo pipefail
out=$OUT
source scripts/gpu_build.sh
(cd build-gpu && ctest --no-tests=error -R 'Cce|Logprob' --output-on-failure) > $OUT/ctest.log 2>&1
grep -E "tests passed|tests failed|Skipped|\*\*\*Failed|Failed  " $OUT/ctest.log
grep -E "Actual|trace|Failure" $OUT/ctest.log | head -20
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader -lms 100 > "$out/clocks.csv" &
smi=$!
timeout 120 build-gpu/bin/bench_loss --device cuda --case seed002 --impl cce cce_nofilter cce_tiles_all cce_blockwise --reps 10 --json $OUT/seed002.json > $OUT/seed002.log 2>&1
cat $OUT/seed002.log
timeout 100 build-gpu/bin/bench_loss --device cuda --case peaked --reps 10 --json $OUT/peaked.json > $OUT/peaked.log 2>&1
cat $OUT/peaked.log
timeout 120 build-gpu/bin/bench_loss --device cuda --case heads --impl cce cce_nofilter --reps 10 --json $OUT/heads.json > $OUT/heads.log 2>&1
cat $OUT/heads.log
kill $smi
