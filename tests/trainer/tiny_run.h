// The tiny GRPO/PPO run the trainer tests share: a 2-layer model on one-digit multiplications with tool
// calls, warmed up so that rewards vary, 4 steps of 2 prompts x 4 samples; and its metrics.jsonl rows.
#pragma once

#include <nlohmann/json.hpp>

#include <fstream>
#include <string>
#include <vector>

#include "trainer/config.h"

namespace rlt::testing {

// The task and its shapes: a trained tokenizer, a 2-layer model, one-digit multiplications with real
// sandboxed tool calls, 2 prompts x 4 samples a step, two off-policy iterations over mini-batches of 4 in
// micro-batches of 2. The LoRA tests build on this alone.
inline Config tiny_task_config() {
  Config c = load_config("", {});
  c.model.tokenizer_vocab = 320;
  c.model.init_hidden = 32;
  c.model.init_layers = 2;
  c.model.init_heads = 2;
  c.model.init_kv_heads = 1;
  c.model.init_intermediate = 64;
  c.chat.prompt = "{question}\n";
  c.synthetic.digits_a = 1;
  c.synthetic.digits_b = 1;
  c.synthetic.count = 200;
  c.sampling.max_new_tokens = 24;
  c.sampling.samples_per_prompt = 4;
  c.rollout.max_turns = 3;
  c.rollout.max_tool_calls = 2;
  c.rollout.max_context = 96;
  c.rollout.max_tool_output_tokens = 16;
  c.sandbox.timeout_s = 5;
  c.sandbox.workers = 2;
  c.reward.kind = RewardKind::kBoxedToolShaping;
  c.objective.agg = LossAgg::kSeqMeanTokenMean;
  c.train.prompts_per_step = 2;
  c.train.num_iterations = 2;
  c.train.mini_batch_size = 4;
  c.train.micro_batch_size = 2;
  return c;
}

// The trainer tests' run of that task: 4 steps with a KL penalty, the entropy as a value, a cosine schedule,
// checkpoints every 2 steps, and enough warm-up that completions are in format and some are right, so
// rewards (and advantages) vary.
inline Config tiny_config() {
  Config c = tiny_task_config();
  c.loss.entropy = EntropyMode::kValue;
  c.loss.loss_mask_only = true;
  c.objective.kl_coef = 0.01;
  c.train.steps = 4;
  c.train.lr = 3e-3;
  c.train.weight_decay = 0.01;
  c.train.lr_schedule = LrSchedule::kCosine;
  c.train.warmup_steps = 2;
  c.train.checkpoint_every = 2;
  c.sft.steps = 40;
  c.sft.batch_size = 16;
  c.sft.lr = 1e-2;
  c.sft.warmup_steps = 4;
  c.sft.tool_fraction = 0.5;
  c.ppo.value_lr = 1e-2;
  return c;
}

inline std::vector<nlohmann::json> read_metrics(const std::string& dir) {
  std::ifstream f(dir + "/metrics.jsonl");
  std::vector<nlohmann::json> rows;
  std::string line;
  while (std::getline(f, line)) rows.push_back(nlohmann::json::parse(line));
  return rows;
}

}  // namespace rlt::testing
