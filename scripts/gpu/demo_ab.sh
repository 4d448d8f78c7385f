#!/usr/bin/env bash
# The CPU demo (configs/retool_tiny.yaml, 40 GRPO steps with real sandboxed tool calls) on the GPU host's
# 16 cores, run by this tree and, when .gpu/old.tar holds an older tree (git archive <commit>), by that
# tree too, one after the other in the same command: the A/B for a change that should only move time.
# Each run: its folder (metrics.jsonl), train.log and time.txt (elapsed, user and system seconds of the
# run and its children) in $OUT/<name>/.
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
out=$(realpath -m "${OUT:-runs/gpu_demo_ab}")
mkdir -p "$out"
source scripts/gpu/build.sh
run_demo() {  # name, tree
  mkdir -p "$out/$1"
  local TIMEFORMAT="elapsed %R s, user %U s, system %S s"
  { time (cd "$2" && build-gpu/bin/grpo_train --config configs/retool_tiny.yaml --out "$out/$1/run" \
      > "$out/$1/train.log" 2>&1); } 2> "$out/$1/time.txt"
  echo "$1: $(cat "$out/$1/time.txt")"
}
if [ -f .gpu/old.tar ]; then
  rm -rf /tmp/old && mkdir -p /tmp/old && tar -xf .gpu/old.tar -C /tmp/old
  (cd /tmp/old && bash "$root/scripts/gpu/deps_build.sh" > "$out/old_build.log" 2>&1) || { tail -30 "$out/old_build.log"; exit 1; }
  run_demo old /tmp/old
fi
run_demo new "$root"
