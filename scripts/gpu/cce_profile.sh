#!/usr/bin/env bash
# Where a CCE forward+backward's time goes, on the GPU host. In one command:
#   1. bench_loss's cce rows (fw, fw+bw filtered and unfiltered) with the SM clock and power sampled
#      every 50 ms (clocks.csv), so a figure can be read against the clock it ran at;
#   2. every kernel of one timed cce fw and one fw+bw (the filtered row: with random inputs no block is
#      skipped), by duration and clock (Nsight Compute, timing metrics only, no cache flush and no clock
#      lock: ncu_*.csv);
#   3. cuBLAS's time for the same GEMM shapes (scripts/dev/gemm_ceiling.py): the ceiling of a recompute-based
#      fw+bw.
# At most 7 files land in $OUT.
# Usage: OUT=... [CTEST=regex] bash scripts/gpu/cce_profile.sh [case: seed002 | heads]
#   (prints a per-kernel summary; CTEST first runs the tests matching the regex and stops if one fails)
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-runs/gpu}
mkdir -p "$out"
case=${1:-seed002}
source scripts/gpu/build.sh
export PATH=$PATH:/usr/local/cuda/bin
if [ -n "${CTEST:-}" ]; then
  (cd build-gpu && ctest --output-on-failure --no-tests=error -R "$CTEST") > "$out/ctest.log" 2>&1 ||
    { tail -n 80 "$out/ctest.log"; exit 1; }
  grep -E "tests passed|Skipped" "$out/ctest.log"
fi
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 50 > "$out/clocks.csv" &
smi=$!
build-gpu/bin/bench_loss --device cuda --case "$case" --impl cce cce_nofilter cce_blockwise --reps 10 \
  --json "$out/bench_$case.json" 2>&1 | tee "$out/bench_$case.log"
kill "$smi"
python3 scripts/dev/gemm_ceiling.py --json "$out/gemm_ceiling.json" 2>&1
metrics=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second
for impl in cce; do
  ncu --metrics "$metrics" --csv --page raw --clock-control none --cache-control none \
    --log-file "$out/ncu_${case}_$impl.csv" \
    build-gpu/bin/bench_loss --device cuda --case "$case" --impl "$impl" --reps 1 > /dev/null 2>&1
done
python3 - "$out" <<'PY'
import csv, glob, os, sys, collections
num = lambda s: float(s.replace(",", ""))
for path in sorted(glob.glob(os.path.join(sys.argv[1], "ncu_*.csv"))):
    rows = [r for r in csv.reader(open(path)) if r]
    head = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    cols = rows[head]
    k, t, c = cols.index("Kernel Name"), cols.index("gpu__time_duration.sum"), cols.index("sm__cycles_elapsed.avg.per_second")
    data = [r for r in rows[head + 2:] if len(r) == len(cols)]  # the row after the names holds the units
    agg = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for r in data:
        a = agg[r[k][:90]]
        a[0] += 1; a[1] += num(r[t]) / 1e6; a[2] += num(r[c]) * num(r[t])
    print(f"== {os.path.basename(path)}: {len(data)} kernels, {sum(a[1] for a in agg.values()):.1f} ms")
    for name, (n, ms, cw) in sorted(agg.items(), key=lambda x: -x[1][1])[:25]:
        print(f"{ms:10.2f} ms {n:6d}x  {cw / (ms * 1e6) / 1e6:7.0f} MHz  {name}")
PY
ls -la "$out"
