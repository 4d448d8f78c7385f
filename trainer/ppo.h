// PPO (Schulman et al. 2017) with the ReTool rollout and a value head: see ppo.cpp, readable top to bottom.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "loss/policy_loss.h"
#include "trainer/batch.h"
#include "trainer/run.h"

namespace rlt {

// Generalised advantage estimation (Schulman et al. 2016) over the actions of each sequence.
// rewards, values, mask: (S, R). Only tokens with mask != 0 are actions (sampled by the policy); tool
// output and padding (mask 0) are the environment's part of a transition, so the recursion steps from
// one action to the next over them:
//   delta_j = r_j + gamma V_next(j) - V_j,   A_j = delta_j + gamma lambda A_next(j)
// with next(j) the following action of the same sequence (V = A = 0 past the last one). Rewards on
// non-action tokens are not allowed (checked). Returns (advantages, returns = advantages + values),
// float32 (S, R), zero off the mask. Computed in float64 on the CPU, then moved to rewards' device.
std::pair<at::Tensor, at::Tensor> gae_advantages(const at::Tensor& rewards, const at::Tensor& values,
                                                 const at::Tensor& mask, double gamma, double lam);

// Per-token rewards (S_m, R) of trajectories [begin, end): each one's reward on its last sampled token (a
// trajectory with none has no action to credit).
at::Tensor terminal_rewards(const std::vector<Trajectory>& trajs, int64_t begin, int64_t end, int64_t R);

// PPO's clipped value loss, of either critic: per token 0.5 max((V - G)^2, (V_old + clip(V - V_old, +-c) - G)^2)
// with c = ppo.value_clip (0: the plain square), aggregated over the loss mask as the policy loss is
// (objective.agg, the mini-batch's global denominator). `clipped` (S, R): 1 where the clipped square is the
// larger.
struct ValueLoss {
  at::Tensor loss, clipped;
};
ValueLoss value_loss(const at::Tensor& values, const at::Tensor& values_old, const at::Tensor& returns,
                     const at::Tensor& mask, const PpoOptions& ppo, const PolicyLossOptions& objective,
                     double denominator);

// The value head: V(state before response token j) = w . h + b from the decoder's hidden state at the
// row that predicts token j. Named tensors for ModelState::extra ("value_head.weight" (1, D), "value_head.bias"
// (1)), float32, zero-initialised so every first value is 0.
ExtraParams value_head_params();

// Values (S, R) float32 of a batch's sampled response tokens (loss_mask = 1: the actions GAE credits)
// from hidden (S, L, D), read at the batch's row index; 0 on every other slot.
at::Tensor value_head(const Run& run, const at::Tensor& hidden, const PackedBatch& batch);

// Trains run.config.train.steps - run.counters.step PPO steps, like train_grpo, with GAE advantages from the
// value head instead of group-relative ones.
std::map<std::string, double> train_ppo(Run& run);

}  // namespace rlt
