// A rollout's rewards, by reward.kind: the built-in boxed matchers (assign_rewards), or reward.script's
// function in the sandbox (rollout/python_reward.h), with its per-step metrics reward_errors and
// reward/<field>. The overlong shaping is the caller's (trainer/grpo.h).
#pragma once

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "rollout/python_reward.h"
#include "rollout/retool.h"

namespace rlt {

struct Run;

// reward.kind python: the script and its interpreter pool, made at the run's first scoring and kept, and
// the totals of the training scorings since the step's metrics last read them.
struct ScriptRewards {
  ScriptRewards(const RewardOptions& reward, const SandboxOptions& sandbox) : script(reward, sandbox) {}
  PythonReward script;
  std::mutex mutex;  // guards pending: with train.async the rollout scores on its own thread while a step reads
  RewardTally pending;
};

// Fills reward and correct of each trajectory; examples[t.prompt_index] is its prompt and answer. training:
// the step's rollouts, whose script failures and fields the step's metrics report (an evaluation's are only
// shown, the first of the run on stderr).
void score_rewards(Run& run, std::vector<Trajectory>& trajectories, const std::vector<PromptExample>& examples,
                   bool training = true);

// reward.kind python: over every rank, reward_errors (the training scorings' failed calls since the last
// read) and reward/<field> (each field's mean over the trajectories that returned it); then starts the next
// count. Empty for the other kinds. Every rank calls it, at the end of every step. With train.async
// one_step a step's figures may include the scoring of the rollout that ran beside it (the next step's);
// summed over the run they count every training trajectory once.
std::map<std::string, double> reward_metrics(Run& run);

}  // namespace rlt
