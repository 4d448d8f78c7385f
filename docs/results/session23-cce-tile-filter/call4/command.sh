set -uo pipefail
out=$OUT
source scripts/gpu_build.sh
(cd build-gpu && ctest --no-tests=error -R 'Cce|Logprob' --output-on-failure) > $OUT/ctest.log 2>&1
grep -E "tests passed|tests failed|Skipped|\*\*\*Failed|Failed  " $OUT/ctest.log
grep -E -A30 "BackwardFlagsMarkTheTilesToKeep" $OUT/ctest.log | grep -v "^\[" | head -60
timeout 120 build-gpu/bin/bench_loss --device cuda --case seed002 --impl cce --reps 5 > $OUT/seed002.log 2>&1
cat $OUT/seed002.log
timeout 120 build-gpu/bin/bench_loss --device cuda --case peaked --impl cce --reps 5 > $OUT/peaked.log 2>&1
cat $OUT/peaked.log
