// The tiny GRPO/PPO run the trainer tests share: a 2-layer model on one-digit multiplications with tool
// calls, warmed up so that rewards vary, 4 steps of 2 prompts x 4 samples; and its metrics.jsonl rows.
#pragma once

#include <nlohmann/json.hpp>

#include <fstream>
#include <string>
#include <vector>

#include "trainer/config.h"

namespace rlt::testing {

inline Config tiny_config() {
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
  c.loss.entropy = EntropyMode::kValue;
  c.loss.loss_mask_only = true;
  c.policy.kl_coef = 0.01;
  c.policy.agg = LossAgg::kSeqMeanTokenMean;
  c.train.steps = 4;
  c.train.prompts_per_step = 2;
  c.train.num_iterations = 2;
  c.train.mini_batch_size = 4;
  c.train.micro_batch_size = 2;
  c.train.lr = 3e-3;
  c.train.weight_decay = 0.01;
  c.train.lr_schedule = LrSchedule::kCosine;
  c.train.warmup_steps = 2;
  c.train.checkpoint_every = 2;
  // Enough warm-up that completions are in format and some are right, so rewards (and advantages) vary.
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
