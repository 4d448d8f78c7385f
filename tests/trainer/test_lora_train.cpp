// GRPO with LoRA adapters (lora.rank 4) on a tiny model with real sandboxed tool calls: the adapters
// train and the base does not, the rollout decodes the merged policy (its log-probs are the trainer's), the
// checkpoint holds a PEFT adapter folder, a resumed run reproduces the uninterrupted one bit for bit
// (adapter dropout under activation checkpointing included), the merged export loads as a whole model,
// and a checkpoint resumed with another lora section is refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "model/config.h"
#include "model/peft.h"
#include "tests/common/tmpdir.h"
#include "tests/trainer/tiny_run.h"
#include "trainer/checkpoint.h"
#include "trainer/config.h"
#include "trainer/grpo.h"
#include "trainer/run.h"

namespace rlt {
namespace {

namespace fs = std::filesystem;
using rlt::testing::TempDir;

// The tiny task of the trainer tests, one prompt's samples at a time, and old log-probs recomputed: bit for
// bit needs them (see test_trainer.cpp).
Config tiny_config() {
  Config c = testing::tiny_task_config();
  c.rollout.max_batch = 4;
  c.train.old_logprobs = OldLogprobs::kRecompute;
  return c;
}

// LoRA adapts a trained base: a random one's frozen LM head (std 0.02) bounds every logit below ~1, which
// no adapter can lift. The base: the tiny model after test_trainer.cpp's supervised warm-up (completions in
// format, some right, so rewards vary), saved as the Hugging Face folder of its checkpoint.
std::string warmed_up_base(const fs::path& dir) {
  Config c = tiny_config();
  c.sft.steps = 40;
  c.sft.batch_size = 16;
  c.sft.lr = 1e-2;
  c.sft.warmup_steps = 4;
  c.sft.tool_fraction = 0.5;
  c.train.steps = 1;
  c.train.lr = 0;
  rlt::Run run = make_run(c, (dir / "base_run").string(), /*resume=*/false);
  train_grpo(run);
  return (dir / "base_run" / "checkpoint" / "model").string();
}

// GRPO on `base` with adapters of rank 4 on every projection, dropout on their inputs and activation
// checkpointing.
Config lora_config(const std::string& base) {
  Config c = tiny_config();
  c.model.path = base;
  c.model.activation_checkpointing = true;
  c.lora.rank = 4;
  c.lora.alpha = 8;
  c.lora.dropout = 0.1;
  c.objective.kl_coef = 0.01;
  c.train.steps = 4;
  c.train.lr = 1e-2;
  c.train.checkpoint_every = 2;
  return c;
}

std::vector<nlohmann::json> read_metrics(const std::string& dir) {
  std::ifstream f(dir + "/metrics.jsonl");
  std::vector<nlohmann::json> rows;
  std::string line;
  while (std::getline(f, line)) rows.push_back(nlohmann::json::parse(line));
  return rows;
}

TEST(LoraRun, TrainsTheAdaptersAloneAndAResumedRunReproducesIt) {
  TempDir tmp("lora_train");
  const Config c = lora_config(warmed_up_base(tmp.path()));
  const std::string full = (tmp.path() / "full").string(), part = (tmp.path() / "part").string();
  rlt::Run run = make_run(c, full, /*resume=*/false);
  train_grpo(run);
  const auto a = read_metrics(full);
  ASSERT_EQ(a.size(), 4u);
  double grad_norm_max = 0, reward_std_max = 0;
  for (const auto& row : a) {
    grad_norm_max = std::max(grad_norm_max, row["grad_norm"].get<double>());
    reward_std_max = std::max(reward_std_max, row["reward_std"].get<double>());
    // fp32: the rollout decodes the merged policy, the trainer scores with the adapters; the two agree to
    // fp32 rounding (test_trainer.cpp's bound for a policy without adapters).
    ASSERT_TRUE(row.contains("logprob_mismatch_max")) << row.dump();
    EXPECT_LE(row["logprob_mismatch_max"].get<double>(), 1e-5) << row.dump();
  }
  EXPECT_GT(reward_std_max, 0) << "some step must have unequal rewards, so advantages are not all 0";
  EXPECT_GT(grad_norm_max, 0);
  EXPECT_GT(a[3]["kl"].get<double>(), 0) << "the adapters moved the policy away from its reference";

  // The rollout decodes a merged copy of the targeted weights: it goes with the step's engine, so the update
  // has its memory; an engine kept for the run (rollout.keep_cache) keeps the copy it decodes.
  collect_rollouts(run);
  EXPECT_EQ(run.rollout.merged, nullptr) << "the merged copy held through the update";
  evaluate(run);
  EXPECT_EQ(run.rollout.merged, nullptr) << "an evaluation's merged copy held into the next step";
  {
    Config k = c;
    k.rollout.engine.keep_cache = true;
    rlt::Run kept = make_run(k, (tmp.path() / "kept").string(), /*resume=*/false);
    collect_rollouts(kept);
    ASSERT_NE(kept.rollout.merged, nullptr);
    ASSERT_NE(kept.rollout.engine, nullptr);
    EXPECT_EQ(&kept.rollout.engine->model(), kept.rollout.merged.get());
  }

  // The base is the one a new run builds from model.init_seed, bit for bit; the adapters moved.
  const rlt::Run fresh = make_run(c, (tmp.path() / "fresh").string(), /*resume=*/false);
  const auto trained_base = run.model.policy->named_parameters(), fresh_base = fresh.model.policy->named_parameters();
  ASSERT_EQ(trained_base.size(), fresh_base.size());
  for (size_t k = 0; k < trained_base.size(); ++k) {
    EXPECT_FALSE(trained_base[k].second.requires_grad()) << trained_base[k].first;
    EXPECT_TRUE(at::equal(trained_base[k].second, fresh_base[k].second)) << trained_base[k].first << " changed";
  }
  const auto adapters = run.model.policy->named_trainable_parameters(),
             fresh_adapters = fresh.model.policy->named_trainable_parameters();
  ASSERT_EQ(adapters.size(), 2u * 7 * 2);
  for (size_t k = 0; k < adapters.size(); ++k) {
    EXPECT_FALSE(at::equal(adapters[k].second, fresh_adapters[k].second)) << adapters[k].first << " did not train";
  }

  // The checkpoint: a PEFT adapter folder, no model folder; the reference's adapters beside the run.
  EXPECT_TRUE(fs::exists(full + "/checkpoint/adapter/adapter_config.json"));
  EXPECT_TRUE(fs::exists(full + "/checkpoint/adapter/adapter_model.safetensors"));
  EXPECT_TRUE(fs::exists(full + "/checkpoint/adapter/tokenizer.model"));
  EXPECT_EQ(read_peft_config(full + "/checkpoint/adapter").rank, 4);
  EXPECT_FALSE(fs::exists(full + "/checkpoint/model"));
  EXPECT_TRUE(fs::exists(full + "/reference/adapter_config.json"));

  // The merged export is a whole model: its weights are the policy's merged ones.
  const std::string exported = (tmp.path() / "merged").string();
  save_merged_model(run, exported);
  const Transformer loaded = Transformer::load(exported, at::kFloat, at::kCPU);
  const auto want = run.model.policy->merged().named_parameters(), got = loaded.named_parameters();
  ASSERT_EQ(want.size(), got.size());
  int64_t moved = 0;
  for (size_t k = 0; k < want.size(); ++k) {
    EXPECT_TRUE(at::equal(got[k].second, want[k].second)) << got[k].first;
    moved += !at::equal(got[k].second, trained_base[k].second);
  }
  EXPECT_EQ(moved, 2 * 7) << "every targeted weight holds its adapter's update";
  EXPECT_TRUE(fs::exists(exported + "/tokenizer.model"));

  // Interrupted after step 2, then resumed: every step's figures equal the uninterrupted run's.
  {
    rlt::Run r = make_run(c, part, /*resume=*/false);
    r.stop_after = 2;
    train_grpo(r);
    EXPECT_EQ(r.counters.step, 2);
  }
  {
    rlt::Run r = make_run(c, part, /*resume=*/true);
    train_grpo(r);
  }
  const auto b = read_metrics(part);
  ASSERT_EQ(b.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    for (const char* k : {"loss", "grad_norm", "reward_mean", "kl", "lr"}) {
      EXPECT_EQ(a[i][k].get<double>(), b[i][k].get<double>()) << k << " at step " << i + 1;
    }
  }

  // A LoRA checkpoint resumed without the lora section, or with another rank, is refused by name.
  Config no_lora = c;
  no_lora.lora.rank = 0;
  try {
    make_run(no_lora, part, /*resume=*/true);
    ADD_FAILURE() << "a LoRA checkpoint resumed as a full fine-tuning run";
  } catch (const RunError& e) {
    EXPECT_NE(std::string(e.what()).find("lora.rank"), std::string::npos) << e.what();
  }
  Config other_rank = c;
  other_rank.lora.rank = 2;
  try {
    make_run(other_rank, part, /*resume=*/true);
    ADD_FAILURE() << "adapters of rank 4 loaded as rank 2";
  } catch (const ModelConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("lora.rank"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace rlt
