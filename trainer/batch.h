// Trajectories -> a padded training batch, and per-token log-probs of its responses through the loss
// module: the one function the old-policy, reference and update passes of GRPO and PPO all call.
//
// Layout: S sequences right-padded to L tokens (prompt + response), flattened to T = S * L rows. Row t
// scores ids[t + 1], so sequence s's response token j (at position P_s + j) is scored by row
// s * L + P_s - 1 + j; its response window is [s * L + P_s - 1, s * L + P_s + R_s - 1). Right padding
// keeps every real token's causal context free of padding, so the forward needs no attention mask.
// Response-aligned tensors are (S, R) with R the longest response.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "loss/logprob.h"
#include "model/transformer.h"
#include "rollout/retool.h"

namespace rlt {

struct PackedBatch {
  at::Tensor ids;               // (S, L) int64, right-padded
  at::Tensor positions;         // (S, L) int64
  at::Tensor targets;           // (T) int64: ids shifted left by one (padding scores the pad id)
  RowSelection rows;            // response windows (S, 2) and loss mask (T) over the flattened rows
  at::Tensor gather;            // (S, R) int64: row of response token j of sequence s (padding -> row 0)
  at::Tensor loss_mask;         // (S, R) float: 1 = a sampled token that counts in the loss
  at::Tensor resp_valid;        // (S, R) float: 1 = a response token (sampled or tool output)
  at::Tensor logprobs_sampled;  // (S, R) float: the rollout's sampling log-probs (0 on tool tokens)
  int64_t S = 0, L = 0, R = 0;
};

// Packs trajectories [begin, end) of `trajs`; tensors on `device`.
PackedBatch pack(const std::vector<Trajectory>& trajs, int64_t begin, int64_t end, at::Device device);

struct ResponseLogprobs {
  at::Tensor logprobs;  // (S, R) float32, differentiable when grad mode is on; 0 on rows not computed
  at::Tensor entropy;   // (S, R) float32 when options.entropy != none
  at::Tensor hidden;    // (S, L, D) the decoder's output (PPO's value head reads it)
};

// One forward of `model` over the batch and the loss module on its response rows.
ResponseLogprobs response_logprobs(const Transformer& model, const PackedBatch& batch, const LossOptions& options);

}  // namespace rlt
