#!/usr/bin/env bash
# The sandbox on the GPU host (16 cores, a quiet machine): build; what the host offers (kernel, cgroups,
# namespaces, bubblewrap); the sandbox tests; bench_sandbox from an 8 GiB caller at 1 and 16 workers
# beside bare python and bubblewrap, then 60 s of the demo's tool calls on 16 workers. Every test when
# CTEST=1. Results land in $OUT (or runs/gpu_sandbox).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-runs/gpu_sandbox}
mkdir -p "$out"
source scripts/gpu/build.sh
# bubblewrap for the peer row: the host's, else the one unpacked from .gpu/debs.
command -v bwrap > /dev/null || export PATH="$PATH:${RLT_DEPS_DIR:-$PWD/build-gpu/deps}/usr/bin"
{
  uname -a
  nproc
  cat /proc/self/cgroup
  grep cgroup /proc/self/mountinfo
  id
  command -v bwrap python3
  python3 -c "import sys; print(sys.version, sys.executable)"
} > "$out/host.txt" 2>&1
build-gpu/bin/test_sandbox > "$out/test_sandbox.log" 2>&1
echo "test_sandbox rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$out/test_sandbox.log" | tr '\n' ' ')"
grep -E "isolation on this host|^(Namespaces|NoNamespaces|DroppedUid):|SKIPPED \]|FAILED \]" "$out/test_sandbox.log" | sort -u | head -20
build-gpu/bin/bench_sandbox --resident-gb 8 --calls 200 --workers 16 --load-s "${LOAD_S:-60}" --json > "$out/bench_sandbox.json" 2> "$out/bench_sandbox.err"
echo "bench_sandbox rc=$?"
python3 -c "import json; d = json.load(open('$out/bench_sandbox.json')); print(json.dumps(d, indent=1))" | head -80
if [ "${CTEST:-0}" = 1 ]; then
  run_gpu_ctest || ctest_failed=1
fi
exit "${ctest_failed:-0}"
