// A rollout's rewards, by reward.kind: the built-in boxed matchers (assign_rewards), or reward.script's
// function in the sandbox (rollout/python_reward.h), with its per-step metrics reward_errors and
// reward/<field>. The overlong shaping is the caller's (trainer/grpo.h).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "rollout/python_reward.h"
#include "rollout/retool.h"

namespace rlt {

struct Run;

// reward.kind python: the script and its interpreter pool, made at the run's first scoring and kept.
struct ScriptRewards {
  ScriptRewards(const RewardOptions& reward, const SandboxOptions& sandbox) : script(reward, sandbox) {}
  PythonReward script;
};

// Fills reward and correct of each trajectory; examples[t.prompt_index] is its prompt and answer. Returns
// the script's tally of these trajectories (reward.kind python; empty for the other kinds): a training
// rollout keeps it with its batch (RolloutBatch::rewards), so the step that trains on the batch reports it,
// even when the batch was scored on train.async's rollout thread beside another step. The first failure
// of the run is shown on stderr with the script's traceback.
RewardTally score_rewards(Run& run, std::vector<Trajectory>& trajectories, const std::vector<PromptExample>& examples);

// reward.kind python: over every rank, reward_errors (the failed calls of `tally`, the step's batch) and
// reward/<field> (each field's mean over the trajectories that returned it). Empty for the other kinds.
// Every rank calls it, at the end of every step.
std::map<std::string, double> reward_metrics(Run& run, const RewardTally& tally);

}  // namespace rlt
