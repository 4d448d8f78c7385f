// PPO's separate critic (critic.shared false): a value model of its own, beside the policy.
//
// The critic is a decoder with a token-classification head of one output (Transformer::value_model):
// V(state before response token j) = score(h) at the row that predicts token j, the row the policy's
// log-prob of that token comes from, in fp32. It starts from the policy as RL starts (its trunk, the head at
// zero: every first value is 0), from the reward model (reward.model_path: its trunk and score weight, a
// zero bias), or from a folder (critic.path). It has its own AdamW, learning rate (critic.lr on
// train.lr's schedule) and shard stage (critic.shard), and trains on the value loss alone: the policy's
// gradient carries no value term, and ppo.vf_coef weighs only the shared head's.
//
// A checkpoint keeps it as critic/, a Hugging Face folder that transformers'
// AutoModelForTokenClassification loads (num_labels 1), and critic_optimizer/, its optimizer state as
// per-parameter pieces (parallel/shard.h), so a resumed run continues it exactly, at any rank count or
// stage.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>

#include "parallel/grad_reducer.h"
#include "trainer/batch.h"
#include "trainer/run.h"

namespace rlt {

struct Critic {
  ModelState state;                      // state.policy: the critic; state.extra: none
  StepCounters counters;                 // its optimizer steps (the learning rate's schedule, AdamW's) and skipped ones
  std::unique_ptr<GradReducer> reducer;  // several ranks, unsharded: its gradients summed over them
  std::string from;                      // where it started, for the console
};

// The critic's shape: the policy's with a one-output token-classification head (critic.init policy), or
// reward.model_path's / critic.path's; the memory plan reads it before anything loads.
ModelConfig critic_model_config(const Config& config, const ModelConfig& policy);

// Makes run.model.critic when config.critic.shared is false, after the warm-up (begin_training): on a
// resumed run from the checkpoint it loaded (critic/, critic_optimizer/, its counters in state.json), else
// from critic.init. Nothing when it is shared or already made.
void ensure_critic(Run& run);

// Values (S, R) float32 of a batch's sampled response tokens (loss_mask = 1) from one forward of `critic`,
// read at the batch's row index and placed in the response layout; 0 on every other slot. Differentiable
// with grad mode on.
at::Tensor critic_values(const Transformer& critic, const PackedBatch& batch);

// One micro-batch's backward of the value loss into the critic's gradients (summed over the ranks at
// ends_step), and the end of its optimizer step: apply_gradients' clip, finite check and AdamW at the
// critic's learning rate. Returns the gradient norm.
void critic_backward(Critic& critic, const at::Tensor& loss, bool ends_step);
// The critic's learning rate at its optimizer step `step` of `total`: train.lr's schedule (warm-up, decay,
// floor) peaking at critic.lr (0: train.lr).
double critic_learning_rate(const Config& config, int64_t step, int64_t total);
double critic_step(Run& run, Critic& critic, const at::Tensor& loss, int64_t total_optimizer_steps);

// Into a checkpoint being written at dir (save_checkpoint, on every rank that writes it): critic/ and
// critic_optimizer/, and the counters into state["critic"].
void save_critic(Run& run, const std::string& dir, nlohmann::json& state);

}  // namespace rlt
