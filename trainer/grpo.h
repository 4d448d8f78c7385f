// GRPO (Shao et al. 2024) with the ReTool rollout: see grpo.cpp, readable top to bottom.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "trainer/async_rollout.h"
#include "trainer/rollout_ranks.h"
#include "trainer/run.h"

namespace rlt {

// Group-relative advantages. rewards (P, G): A = r - mean over the group's G samples, then divided by
// the std of the group (group), of the whole batch (batch), or not at all (none). A std below 1e-6
// divides by 1 (a group whose rewards are all equal has A = 0 either way).
at::Tensor group_advantages(const at::Tensor& rewards, ScaleRewards scale);

// The advantages of train.advantage from the step's rewards (P, G), every rank's, float64 in, same shape
// out. grpo: group_advantages(rewards, scale). rloo: A_i = r_i - mean_{j != i} r_j within the group
// (G >= 2). reinforce_pp: (r - mean) / std over all P * G rewards. reinforce_pp_baseline: c = r - mean of
// the group, then (c - mean c) / std c over all P * G. Batch std is unbiased, and one below 1e-6 divides
// by 1, as in group_advantages.
at::Tensor estimate_advantages(const at::Tensor& rewards, Advantage kind, ScaleRewards scale);

// train.mask_truncated: zeroes the loss mask of every truncated trajectory, so it adds nothing to the loss
// and no token to any denominator.
void mask_truncated(std::vector<Trajectory>& trajs);

// reward.overlong_*: the overlong penalty of a trajectory with prompt_tokens prompt tokens and
// sampled_tokens sampled ones, against the budget overlong_budget() sets from the rollout's limits.
double overlong_shaping(const Config& config, int64_t prompt_tokens, int64_t sampled_tokens);

// Trains run.config.train.steps - run.counters.step RL steps (after the warm-up when sft.steps > 0 and the run is
// new). Writes metrics.jsonl, plot.svg and checkpoints into run.out_dir. Returns the last step's metrics.
// What the tests change in train_grpo: train.async's rollout on the calling thread (the schedule without
// the concurrency, the reference of the threaded run), and its wrong twins.
struct GrpoHooks {
  bool async_threaded = true;
  AsyncFault async_fault = AsyncFault::kNone;
  PlacementFault placement_fault = PlacementFault::kNone;
  // train.rollout_ranks: run on the training ranks before each publish, and on the rollout ranks before each
  // batch's sampling (a long phase's stand-ins).
  std::function<void()> before_publish, before_sample;
};
std::map<std::string, double> train_grpo(Run& run, const GrpoHooks& hooks = {});

}  // namespace rlt
