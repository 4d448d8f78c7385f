#!/usr/bin/env bash
# train.phase_offload on one GPU, one command: grpo_train --config configs/retool.yaml on a random Qwen2.5
# checkpoint (RANDOM_QWEN, default 1.5b; scripts/gpu/random_qwen.sh), tools off, the boxed reward, PROMPTS x
# SAMPLES x NEW_TOKENS a step, STEPS steps, with the optimizer state resident and then parked in host memory
# while the rollout runs (--set train.phase_offload=optimizer). Per run, from metrics.jsonl: each phase's
# allocated peak over its start (peak_memory_{rollout,update}_mib; parked, the rollout's phase starts with
# the state out, its moves are phases of their own), the rollout's absolute peak beside the plan's, the
# step's peak beside the plan's total, the moves' seconds and the step time (means
# over the steps after the first), and the memory plan's lines; $OUT/summary.json. Also runs test_parking
# (its CUDA test). DEMOS="1 2": the PPO CPU demo (configs/ppo_tiny.yaml), shared head and a critic of its
# own, at each of those seeds on the host's cores beside the GPU runs (each run's log and metrics.jsonl in
# $OUT/demo_<kind>_<seed>; DEMO_TIMEOUT seconds at most). The GPU runs' metrics: $OUT/<mode>.metrics.jsonl.
# MODES (default "none optimizer") picks the runs.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=$(realpath -m "${OUT:-runs/gpu_phase_offload}")
prompts=${PROMPTS:-32}
samples=${SAMPLES:-8}
new_tokens=${NEW_TOKENS:-512}
steps=${STEPS:-3}
mkdir -p "$out"
export RLT_BUILD_TARGETS=${RLT_BUILD_TARGETS:-"grpo_train ppo_train test_parking"}
export PYTHONUNBUFFERED=1
start=$(date +%s)
source scripts/gpu/build.sh
echo "build done at $(($(date +%s) - start)) s"
pids=()
for seed in ${DEMOS:-}; do
  for kind in shared own; do
    set_critic=()
    [ "$kind" = own ] && set_critic=(--set critic.shared=false)
    d="$out/demo_${kind}_$seed"
    mkdir -p "$d"
    (OMP_NUM_THREADS=2 timeout "${DEMO_TIMEOUT:-600}" build-gpu/bin/ppo_train --config configs/ppo_tiny.yaml \
      --set train.seed="$seed" "${set_critic[@]}" --out "/tmp/demo_${kind}_$seed" > "$d/train.log" 2>&1
     echo "rc $?" >> "$d/train.log"; cp "/tmp/demo_${kind}_$seed/metrics.jsonl" "$d/") &
    pids+=($!)
  done
done
build-gpu/bin/test_parking > "$out/test_parking.log" 2>&1
grep -E "PASSED|FAILED|SKIPPED" "$out/test_parking.log"
RANDOM_QWEN=${RANDOM_QWEN:-1.5b} source scripts/gpu/random_qwen.sh
system='Solve the math problem step by step. Put the final answer as \boxed{...}.'
for mode in ${MODES:-none optimizer}; do
  build-gpu/bin/grpo_train --config configs/retool.yaml --set model.path="$ckpt" --set data.path="$out/math.jsonl" \
    --set data.prompt_key=prompt --set data.answer_key=answer --set rollout.tools=false --set reward.kind=boxed \
    --set "chat.system=$system" --set sampling.max_new_tokens="$new_tokens" \
    --set sampling.samples_per_prompt="$samples" --set train.prompts_per_step="$prompts" \
    --set train.steps="$steps" --set train.checkpoint_every=0 --set data.eval_path= --set train.eval_prompts=0 \
    --set logging.tensorboard=false --set train.log_samples=0 \
    --set train.phase_offload=$mode --out "/tmp/phase_offload_$mode" > "$out/$mode.log" 2>&1
  echo "$mode: exit $?"
  cp "/tmp/phase_offload_$mode/metrics.jsonl" "$out/$mode.metrics.jsonl"
done
python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
summary = {}
for mode in ("none", "optimizer"):
    path = os.path.join(out, mode + ".metrics.jsonl")
    if not os.path.exists(path):
        continue
    rows = [json.loads(line) for line in open(path)]
    later = rows[1:] or rows
    mean = lambda k: sum(r.get(k, 0.0) for r in later) / len(later)
    keys = ["memory_allocated_peak_mib", "memory_reserved_peak_mib", "peak_memory_rollout_mib",
            "peak_memory_update_mib", "memory_allocated_peak_rollout_mib", "memory_plan_rollout_mib",
            "memory_plan_mib", "time_phase_moves_s", "time_rollout_s", "time_update_s", "time_step_s"]
    summary[mode] = {k: mean(k) for k in keys}
    summary[mode]["plan"] = [l.rstrip() for l in open(os.path.join(out, mode + ".log")) if "GiB" in l]
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(json.dumps({m: {k: round(v, 3) for k, v in s.items() if k != "plan"} for m, s in summary.items()}, indent=1))
PY
for p in "${pids[@]}"; do wait "$p"; done
for d in "$out"/demo_*; do
  [ -d "$d" ] && echo "$(basename "$d"): $(grep -E '^eval after|^rc' "$d/train.log" | tr '\n' ' ')"
done
echo "total $(($(date +%s) - start)) s"
