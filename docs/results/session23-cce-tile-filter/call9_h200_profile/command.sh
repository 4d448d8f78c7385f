set -uo pipefail
out=$OUT
source scripts/gpu_build.sh
export PATH=$PATH:/usr/local/cuda/bin
nvidia-smi --query-gpu=name --format=csv > "$out/gpu.txt" 2>&1
timeout 200 ncu --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second --csv --page raw --clock-control none --cache-control none \
    --log-file "$out/ncu_seed002_cce.csv" build-gpu/bin/bench_loss --device cuda --case seed002 --impl cce --reps 1 > /dev/null 2>&1
python3 - "$out" <<'PY' | tee $OUT/ncu_summary.txt
import csv, glob, os, sys, collections
num = lambda s: float(s.replace(",", ""))
for path in sorted(glob.glob(os.path.join(sys.argv[1], "ncu_*.csv"))):
    rows = [r for r in csv.reader(open(path)) if r]
    head = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    cols = rows[head]
    k, t, c = cols.index("Kernel Name"), cols.index("gpu__time_duration.sum"), cols.index("sm__cycles_elapsed.avg.per_second")
    data = [r for r in rows[head + 2:] if len(r) == len(cols)]
    agg = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for r in data:
        a = agg[r[k][:90]]
        a[0] += 1; a[1] += num(r[t]) / 1e6; a[2] += num(r[c]) * num(r[t])
    print(f"== {os.path.basename(path)}: {len(data)} kernels, {sum(a[1] for a in agg.values()):.1f} ms")
    for name, (n, ms, cw) in sorted(agg.items(), key=lambda x: -x[1][1])[:20]:
        print(f"{ms:10.2f} ms {n:6d}x  {cw / (ms * 1e6) / 1e6:7.0f} MHz  {name}")
PY
rm -f $OUT/ncu_seed002_cce.csv
