#!/usr/bin/env bash
# train.rollout_ranks on two GPUs of one host, one command; results in $OUT (or runs/gpu_placement):
#   1. the placement tests (thread ranks on the CPU, and the launched CPU runs of check_dist_launch.py);
#   2. the weights' broadcast alone (bench_weight_sync, GPU 0 to GPU 1) for the Qwen2.5-0.5B and 7B shapes,
#      in buckets of 25, 100 and 400 MiB (train.rollout_sync_mb; 400 by default);
#   3. configs/retool.yaml on a random Qwen2.5-0.5B-shaped checkpoint (scripts/gpu/random_qwen.sh), tools off
#      and the boxed reward as in e2e_peer.sh, STEPS steps on both GPUs: colocated one_step (each GPU samples
#      and trains half the step), rollout_ranks 1 one_step (GPU 1 samples, GPU 0 trains), and rollout_ranks 1
#      in turn. Per run the steady-state means (the steps after the second: the first two sample the initial
#      weights) and each GPU's peak memory.used (nvidia-smi every 200 ms); summary.json holds them.
# Usage: OUT=... [STEPS=6] [NEW_TOKENS=1024] [RUNS=...] [BENCH=0] bash scripts/gpu/placement.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
out=${OUT:-runs/gpu_placement}
steps=${STEPS:-6}
new_tokens=${NEW_TOKENS:-1024}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export RLT_BUILD_TARGETS=${RLT_BUILD_TARGETS:-"grpo_train bench_weight_sync test_placement"}
start=$(date +%s)
source scripts/gpu/build.sh
echo "build done at $(($(date +%s) - start)) s"
mkdir -p "$out/raw"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$out/gpu.txt" 2>&1
nvidia-smi topo -m >> "$out/gpu.txt" 2>&1
if [ "$(nvidia-smi -L | wc -l)" -lt 2 ]; then
  echo "placement.sh: needs two GPUs"
  exit 1
fi
rc=0

# 1. The tests. 2. The broadcast alone. (BENCH=0: neither.)
[ "${BENCH:-1}" = 1 ] || shapes=""
[ "${BENCH:-1}" = 0 ] || build-gpu/bin/test_placement > "$out/raw/test_placement.log" 2>&1 || rc=1
grep -E "PASSED|FAILED" "$out/raw/test_placement.log" 2>/dev/null
for shape in ${shapes-0.5b 7b}; do
  python3 -m torch.distributed.run --nproc-per-node 2 --no-python build-gpu/bin/bench_weight_sync \
    --model configs/models/qwen2.5-$shape > "$out/raw/sync_$shape.json" 2> "$out/raw/sync_$shape.log" || rc=1
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], [(r['bucket_mb'], round(r['seconds_median'], 4), round(r['gbps'], 1), r['receivers_hold_rank0_weights']) for r in d['runs']])" \
    "$out/raw/sync_$shape.json" "$shape" || tail -n 5 "$out/raw/sync_$shape.log"
done

# 3. The placements.
source scripts/gpu/random_qwen.sh
system='Solve the math problem step by step. Put the final answer as \boxed{...}.'
common=(build-gpu/bin/grpo_train --config configs/retool.yaml --set model.path="$ckpt" --set data.path="$out/math.jsonl"
        --set data.answer_key=answer --set rollout.tools=false --set reward.kind=boxed --set "chat.system=$system"
        --set sampling.max_new_tokens="$new_tokens" --set train.steps="$steps" --set train.checkpoint_every=0
        --set data.eval_path= --set train.eval_prompts=0 --nproc 2)
measure() {
  local name=$1
  shift
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 200 > "$out/raw/mem_$name.csv" &
  local watcher=$!
  timeout "${RUN_TIMEOUT:-240}" "$@" --out "$out/$name" > "$out/raw/$name.log" 2>&1
  echo "$name: exit $?"
  kill $watcher
  cp "$out/$name/metrics.jsonl" "$out/raw/metrics_$name.jsonl" 2>/dev/null
  rm -rf "${out:?}/$name"
}
# RUNS: which of colocated_async placed_async placed_in_turn (default: all).
for r in ${RUNS:-colocated_async placed_async placed_in_turn}; do
  case $r in
    colocated_async) measure colocated_async "${common[@]}" --set train.async=one_step ;;
    placed_async) measure placed_async "${common[@]}" --set train.async=one_step --set train.rollout_ranks=1 ;;
    placed_in_turn) measure placed_in_turn "${common[@]}" --set train.async=off --set train.rollout_ranks=1 ;;
  esac
done
python3 - "$out" <<'PY' | tee "$out/summary.txt"
import json, os, sys
out = sys.argv[1]
raw = f"{out}/raw"
keys = ["time_step_s", "time_rollout_s", "time_update_s", "time_rollout_wall_s", "wait_rollout_s", "wait_update_s",
        "overlap_s", "time_weight_sync_s", "weight_sync_gbps", "transfer_mb", "staleness_mean", "sampled_tokens"]
res = {"sync": {}}
for shape in ("0.5b", "7b"):
    try:
        res["sync"][shape] = json.load(open(f"{raw}/sync_{shape}.json"))
    except (OSError, ValueError):
        pass
for name in ("colocated_async", "placed_async", "placed_in_turn"):
    path = f"{raw}/metrics_{name}.jsonl"
    rows = [json.loads(l) for l in open(path)] if os.path.exists(path) else []
    steady = rows[2:] or rows
    r = {"steps_run": len(rows)}
    for k in keys:
        vals = [row[k] for row in steady if isinstance(row.get(k), (int, float))]
        if vals:
            r[k] = sum(vals) / len(vals)
    if "sampled_tokens" in r and "time_step_s" in r:
        r["sampled_tokens_per_s"] = r["sampled_tokens"] / r["time_step_s"]
    peaks = {}
    try:
        for line in open(f"{raw}/mem_{name}.csv"):
            i, m = [x.strip() for x in line.split(",")]
            peaks[i] = max(peaks.get(i, 0), float(m))
    except (OSError, ValueError):
        pass
    r["gpu_peak_mib"] = peaks
    res[name] = r
    print(name, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))
json.dump(res, open(f"{out}/summary.json", "w"), indent=1)
PY
(cd "$out" && tar czf raw.tgz --remove-files raw math.jsonl 2>/dev/null)
echo "placement: done in $(($(date +%s) - start)) s"
exit $rc
