set -uo pipefail
out=$OUT
mkdir -p /tmp/rlt_peer_wheels
for w in .gpu/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/rlt_peer_wheels; done
export PYTHONPATH=/tmp/rlt_peer_wheels${PYTHONPATH:+:$PYTHONPATH}
source scripts/gpu_build.sh
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv > "$out/gpu.txt" 2>&1
(cd build-gpu && ctest --no-tests=error -R 'Cce|Logprob' --output-on-failure) > $OUT/ctest.log 2>&1
grep -E "tests passed|tests failed|Skipped|\*\*\*Failed|Failed  " $OUT/ctest.log
for c in seed002 heads peaked; do
  timeout 100 build-gpu/bin/bench_loss --device cuda --case $c --impl cce cce_nofilter --reps 10 --json $OUT/cpp_$c.json 2>&1 | tee -a $OUT/bench.log
done
for c in seed002 heads peaked; do
  timeout 130 python3 scripts/bench_peers.py --device cuda --case $c --reps 10 --json $OUT/peers_$c.json 2>&1 | tee -a $OUT/bench.log
done
