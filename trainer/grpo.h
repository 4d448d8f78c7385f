// GRPO (Shao et al. 2024) with the ReTool rollout: see grpo.cpp, readable top to bottom.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <string>

#include "trainer/run.h"

namespace rlt {

// Group-relative advantages. rewards (P, G): A = r - mean over the group's G samples, then divided by
// the std of the group (group), of the whole batch (batch), or not at all (none). A std below 1e-6
// divides by 1 (a group whose rewards are all equal has A = 0 either way).
at::Tensor group_advantages(const at::Tensor& rewards, ScaleRewards scale);

// Trains run.config.train.steps - run.step RL steps (after the warm-up when sft.steps > 0 and the run is
// new). Writes metrics.jsonl, plot.svg and checkpoints into run.out_dir. Returns the last step's metrics.
std::map<std::string, double> train_grpo(Run& run);

}  // namespace rlt
