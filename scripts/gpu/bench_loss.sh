#!/usr/bin/env bash
# The loss benchmark on the GPU host: build (scripts/gpu/build.sh), run every test (the CUDA ones
# included), then bench_loss on CUDA for every case beside the PyTorch peers (scripts/bench_peers.py) in
# the same command on the same GPU. Results land in $OUT (or runs/gpu).
# Usage: [SKIP_CTEST=1] bash scripts/gpu/bench_loss.sh [cases...]   (default: seed000 seed001 seed002 heads;
# also: peaked, seed002's shape on a trained-model-like softmax, for gradient filtering)
# The fused peers (apple CCE, Liger) come from their pure-Python wheels in .gpu/wheels
# (scripts/gpu/fetch_deps.sh downloads them), unpacked onto PYTHONPATH; triton comes with torch.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-runs/gpu}
mkdir -p "$out"
cases=("${@:-seed000 seed001 seed002 heads}")
if ls .gpu/wheels/*.whl > /dev/null 2>&1; then
  mkdir -p /tmp/rlt_peer_wheels
  for w in .gpu/wheels/*.whl; do python3 -m zipfile -e "$w" /tmp/rlt_peer_wheels; done
  export PYTHONPATH=/tmp/rlt_peer_wheels${PYTHONPATH:+:$PYTHONPATH}
fi
source scripts/gpu/build.sh
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv > "$out/gpu.txt" 2>&1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' >> "$out/gpu.txt" 2>&1
# SKIP_CTEST=1: the benchmarks alone (when the same tree's tests have run already).
if [ "${SKIP_CTEST:-0}" != 1 ]; then run_gpu_ctest || ctest_failed=1; fi
for c in ${cases[*]}; do
  reps=10
  [ "$c" = seed001 ] && reps=2  # each seed001 cce call is several seconds of fp32 GEMMs
  build-gpu/bin/bench_loss --device cuda --case "$c" --reps "$reps" --json "$out/cpp_$c.json" 2>&1 | tee -a "$out/bench.log"
  python3 scripts/bench_peers.py --device cuda --case "$c" --reps "$reps" --json "$out/peers_$c.json" 2>&1 | tee -a "$out/bench.log"
done
python3 - "$out" <<'PY'
import json, glob, os, sys
out = sys.argv[1]
for kind in ("cpp", "peers"):
    recs = []
    for f in sorted(glob.glob(os.path.join(out, f"{kind}_*.json"))):
        recs += json.load(open(f))
        os.remove(f)
    json.dump(recs, open(os.path.join(out, f"bench_{kind}.json"), "w"), indent=1)
PY
ls -la "$out"
# The script's status: a failed or skipped test fails the script, after the benchmarks have run.
exit "${ctest_failed:-0}"
