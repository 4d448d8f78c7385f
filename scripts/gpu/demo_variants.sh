#!/usr/bin/env bash
# The CPU demo (configs/retool_tiny.yaml) under several settings at once on the GPU host's cores, each run
# pinned to its own pair of cores (taskset, sandbox workers included), as a 2-core laptop would run it.
# A run's curve is the same on any machine (the demo is deterministic), so this compares settings'
# accuracy; time each one on the 2-core machine itself. VARIANTS holds one run a line: a name, then
# --set arguments (default: the config as it is). Each run leaves <name>/metrics.jsonl and train.log in
# $OUT/variants.tar, and a line in $OUT/summary.txt (first step, last five, evaluations, warm-up).
# LIMIT_S (default 480) stops the runs still going; their metrics so far are kept.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=$(realpath -m "${OUT:-runs/gpu_demo_variants}")
mkdir -p "$out"
RLT_BUILD_TARGETS=${RLT_BUILD_TARGETS:-grpo_train} source scripts/gpu/build.sh
variants=${VARIANTS:-default}
cores=$(nproc)
count=$(grep -c . <<< "$variants")
if [ $((2 * count)) -gt "$cores" ]; then
  echo "demo_variants: $count runs need $((2 * count)) cores, this host has $cores" >&2
  exit 2
fi
i=0
pids=()
while IFS= read -r line; do
  [ -z "$line" ] && continue
  read -r name args <<< "$line"
  first=$((2 * i))
  mkdir -p "$out/$name"
  # shellcheck disable=SC2086
  (cd "$out/$name" && timeout "${LIMIT_S:-480}" taskset -c "$first,$((first + 1))" \
     "$OLDPWD/build-gpu/bin/grpo_train" --config "$OLDPWD/configs/retool_tiny.yaml" --out run $args \
     > train.log 2>&1; echo "rc $?" >> train.log; cp run/metrics.jsonl . 2>/dev/null; rm -rf run) &
  pids+=($!)
  i=$((i + 1))
done <<< "$variants"
wait "${pids[@]}"
for d in "$out"/*/; do
  n=$(basename "$d")
  [ -f "$d/train.log" ] || continue
  python3 - "$d" "$n" <<'EOF'
import json, sys, pathlib
d, name = pathlib.Path(sys.argv[1]), sys.argv[2]
rows = [json.loads(l) for l in open(d / "metrics.jsonl")] if (d / "metrics.jsonl").exists() else []
acc = [r["accuracy"] for r in rows if "accuracy" in r and "step" in r]
log = (d / "train.log").read_text().splitlines()
ev = [l for l in log if l.startswith("eval")]
warm = [l for l in log if "warm-up" in l and "done" in l]
print(f"{name}: steps {len(acc)}, first {acc[0] if acc else None}, last5 "
      f"{sum(acc[-5:]) / max(1, len(acc[-5:])):.4f}; {' | '.join(ev)}; {' '.join(warm)}; {log[-1] if log else ''}")
EOF
done | tee "$out/summary.txt"
(cd "$out" && tar -cf variants.tar --exclude=build.log --exclude=summary.txt --exclude=variants.tar ./*/ && \
  find . -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +)
