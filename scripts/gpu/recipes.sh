#!/usr/bin/env bash
# The RL recipes' learning table: the GPU learning check (configs/retool_gpu.yaml through learn.sh) once
# per recipe, every run at once on the one GPU, sharing its host cores (the rollouts' tool calls are what
# the host runs). Each run's curve summary is in $OUT/<recipe>/, all of them in $OUT/recipes.json.
# Usage: OUT=... [STEPS=40] [EVAL_EVERY=10] [WORKERS=12] [RECIPES="grpo drgrpo ..."] [DEADLINE=<epoch s>]
#        bash scripts/gpu/recipes.sh
# DEADLINE: every run is stopped then (what it logged comes back), e.g. a call's limit after the build.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
out=${OUT:?set OUT}
steps=${STEPS:-40}
export RLT_BUILD_TARGETS=${RLT_BUILD_TARGETS:-grpo_train}
source scripts/gpu/build.sh
mkdir -p "$out"
[ -n "${DEADLINE:-}" ] && export LEARN_TIMEOUT=$((DEADLINE - $(date +%s)))

# Each recipe's keys on top of retool_gpu.yaml (docs/training.md, "RL recipes").
declare -A recipe=(
  [grpo]=""
  [drgrpo]="--set objective.agg=seq-mean-token-sum-norm --set objective.agg_norm=160 --set train.scale_rewards=none"
  [rloo]="--set train.advantage=rloo"
  [reinforce_pp]="--set train.advantage=reinforce_pp"
  [gspo]="--set objective.ratio_level=sequence --set objective.clip_eps_low=0.0003 --set objective.clip_eps_high=0.0004"
  [cispo]="--set objective.loss=cispo --set objective.clip_eps_low=1.0 --set objective.clip_eps_high=2.0"
  [dapo]="--set train.dynamic_sampling=true --set train.max_sampling_rounds=3 --set reward.overlong_buffer=64
          --set reward.overlong_penalty=1.0"
  [grpo_async]="--set train.async=one_step"
  [grpo_partial]="--set train.async=one_step --set rollout.partial=true"
  [grpo_spec]="--set rollout.speculative=suffix"
  [grpo_kept]="--set rollout.keep_cache=true"
  [grpo_spec_kept]="--set rollout.speculative=suffix --set rollout.keep_cache=true"
)
names=${RECIPES:-grpo drgrpo rloo reinforce_pp gspo cispo dapo grpo_async}
for name in $names; do
  # shellcheck disable=SC2086  # the recipe's keys are words
  GPU_REBUILD=0 OUT=$out RUN_NAME=$name bash scripts/gpu/learn.sh --set train.steps="$steps" \
    --set train.eval_every="${EVAL_EVERY:-10}" --set sandbox.workers="${WORKERS:-12}" ${recipe[$name]} > "$out/$name.console" 2>&1 &
done
wait
python3 - "$out" $names <<'PY'
import json, os, sys
out, names = sys.argv[1], sys.argv[2:]
res = {}
for n in names:
    path = f"{out}/{n}/metrics.jsonl"
    rows = [json.loads(l) for l in open(path)] if os.path.exists(path) else []
    acc = [r["accuracy"] for r in rows]
    wall = None
    for line in open(f"{out}/{n}.console", errors="replace"):
        if "grpo_train rc=" in line:
            wall = int(line.split("wall ")[1].split()[0])
    filtered = [r.get("groups_filtered", 0) for r in rows]
    res[n] = {"steps": len(rows), "accuracy_step1": acc[0] if acc else None,
              "accuracy_last5_mean": sum(acc[-5:]) / len(acc[-5:]) if acc else None,
              "eval_pass1": {int(r["step"]): r["eval_pass@1"] for r in rows if "eval_pass@1" in r},
              "eval_pass1_before_rl": rows[0].get("eval_accuracy_start") if rows else None,
              "equal_reward_groups_trained": sum(r.get("groups_equal_reward", 0) for r in rows),
              "reward_std_mean": sum(r.get("reward_std", 0) for r in rows) / max(1, len(rows)),
              "groups_filtered_total": sum(filtered), "wall_s": wall,
              "step_s_last": rows[-1]["time_step_s"] if rows else None}
    for k in ("staleness_mean", "overlap_s", "sampling_rounds", "prompts_sampled", "overlong_penalty_mean"):
        vals = [r[k] for r in rows if k in r]
        if vals:
            res[n][k + "_mean"] = sum(vals) / len(vals)
    # The rollout late in training (steps 36-40): its time, its tail's, and speculation's figures.
    for k in ("time_rollout_s", "time_rollout_decode_s", "time_rollout_tail_s", "rollout_decode_steps",
              "rollout_tail_passes", "rollout_tail_tokens_per_pass", "rollout_verify_passes",
              "rollout_speculative_share", "rollout_draft_acceptance", "rollout_tokens_per_verify_row"):
        vals = [r[k] for r in rows[-5:] if k in r]
        if vals:
            res[n][k + "_last5"] = sum(vals) / len(vals)
    print(n, json.dumps(res[n]))
json.dump(res, open(f"{out}/recipes.json", "w"), indent=1)
PY
# shellcheck disable=SC2086  # one folder per recipe
(cd "$out" && tar czf raw.tgz --remove-files $names ./*.console)
