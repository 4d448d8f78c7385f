#!/usr/bin/env bash
# The GPU learning check on one GPU: grpo_train --config configs/retool_gpu.yaml, wrapped in
# `time`, its metrics.jsonl and log brought back in $OUT, and a summary of the curve: sampled accuracy at
# the first RL step and over the last five, the greedy evaluations, the wall time. Extra arguments are
# passed to grpo_train (--set ...). GPU_REBUILD=0 reuses an existing build-gpu/.
# Usage: OUT=... [RUN_NAME=learn] [LEARN_TIMEOUT=570] bash scripts/gpu/learn.sh [--set key=value...]
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:?set OUT}
name=${RUN_NAME:-learn}
source scripts/gpu/build.sh
mkdir -p "$out/$name"
start=$(date +%s)
timeout "${LEARN_TIMEOUT:-570}" build-gpu/bin/grpo_train --config configs/retool_gpu.yaml --out "$out/run_$name" "$@" \
  > "$out/$name/train.log" 2>&1
rc=$?
end=$(date +%s)
cp "$out/run_$name/metrics.jsonl" "$out/$name/" 2>/dev/null
rm -rf "$out/run_$name"
echo "[$name] grpo_train rc=$rc, wall $((end - start)) s"
grep -E "^eval|warm-up .*/.*done|error" "$out/$name/train.log" | tail -n 12
python3 - "$out/$name/metrics.jsonl" <<'PY'
import json, sys
try:
    rows = [json.loads(l) for l in open(sys.argv[1])]
except OSError:
    sys.exit("no metrics.jsonl")
acc = [r["accuracy"] for r in rows]
print("steps", len(rows), "accuracy first", round(acc[0], 3) if acc else None,
      "last5", [round(a, 3) for a in acc[-5:]], "mean last5", round(sum(acc[-5:]) / max(1, len(acc[-5:])), 3))
print("evals", [(r["step"], round(r["eval_pass@1"], 3)) for r in rows if "eval_pass@1" in r])
print("step time s (last)", round(rows[-1]["time_step_s"], 2) if rows else None,
      "loss == pg_loss in every row:", all(abs(r["loss"] - r["pg_loss"]) <= 1e-6 * max(1, abs(r["loss"])) for r in rows))
PY
exit $rc
