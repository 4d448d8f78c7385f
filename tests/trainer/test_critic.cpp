// PPO's separate critic (trainer/critic.h) against transformers and torch in float64: tiny random
// *ForTokenClassification checkpoints that transformers saves, and a toy PPO batch over them
// (tests/rollout/reward_model_reference.py): the critic's values, GAE, two optimizer steps of the clipped
// value loss with AdamW, the values after. Each check has a wrong twin it must reject: the value read at the
// token's own row instead of the row that predicts it, GAE over the tool tokens too, the value loss
// without its clip.
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/common/files.h"
#include "tests/common/tmpdir.h"
#include "trainer/config.h"
#include "trainer/critic.h"
#include "trainer/optim.h"
#include "trainer/ppo.h"

namespace rlt {
namespace {

namespace fs = std::filesystem;
using testing::read_json;
using json = nlohmann::json;

// The references: made by the ctest fixture make_reward_model_references (tests/CMakeLists.txt).
fs::path references() { return RLT_REWARD_MODEL_REFS; }

// The toy batch's trajectories.
std::vector<Trajectory> toy_batch(const json& batch) {
  std::vector<Trajectory> out;
  for (size_t s = 0; s < batch["prompts"].size(); ++s) {
    Trajectory t;
    t.prompt_ids = batch["prompts"][s].get<std::vector<int64_t>>();
    t.response_ids = batch["responses"][s].get<std::vector<int64_t>>();
    t.loss_mask = batch["masks"][s].get<std::vector<uint8_t>>();
    t.logprobs.assign(t.response_ids.size(), 0.0f);
    t.reward = batch["rewards"][s].get<double>();
    out.push_back(std::move(t));
  }
  return out;
}

// Largest |a - ref| over the response tokens, a (S, R) in the batch's layout, ref per sequence.
double max_diff(const at::Tensor& a, const json& ref) {
  const at::Tensor c = a.detach().to(at::kDouble);
  double d = 0;
  for (size_t s = 0; s < ref.size(); ++s) {
    for (size_t j = 0; j < ref[s].size(); ++j)
      d = std::max(d, std::abs(c[s][j].item<double>() - ref[s][j].get<double>()));
  }
  return d;
}

class CriticReference : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    dir_ = (references() / GetParam()).string();
    ASSERT_TRUE(fs::exists(fs::path(dir_) / "reference.json")) << dir_;
    ref_ = read_json(fs::path(dir_) / "reference.json");
    trajs_ = toy_batch(ref_["batch"]);
  }
  std::string dir_;
  json ref_;
  std::vector<Trajectory> trajs_;
};

// The folder transformers saved, loaded as it is, gives transformers' values at every sampled token, padded
// and packed.
TEST_P(CriticReference, ValuesMatchTransformersTokenClassification) {
  const Transformer critic = Transformer::load(dir_, at::kFloat, at::kCPU);
  ASSERT_EQ(critic.config().head, ModelHead::kTokenScore);
  at::NoGradGuard no_grad;
  for (bool packed : {false, true}) {
    const PackedBatch b = pack(trajs_, 0, static_cast<int64_t>(trajs_.size()), at::kCPU, packed);
    EXPECT_LT(max_diff(critic_values(critic, b), ref_["values_old"]), 1e-5) << (packed ? "packed" : "padded");
    // The twin: each value read at its token's own row, one past the row that predicts it.
    ResponseRows own = b.sampled;
    own.rows = own.rows + 1;
    const at::Tensor h = batch_hidden(critic, b);
    const at::Tensor wrong =
        to_response_layout(critic.score(h.reshape({-1, h.size(2)}).index_select(0, own.rows)).squeeze(1), own, b);
    EXPECT_GT(max_diff(wrong, ref_["values_old"]), 1e-2) << "the twin must fail";
  }
}

// What one PPO step does to a separate critic, against the float64 reference: values, GAE and returns, then
// per optimizer step the clipped value loss, its gradient norm and clipped share, and the values after.
struct UpdateResult {
  at::Tensor values_old, advantages, returns, values_after;
  std::vector<double> loss, grad_norm, clip_frac;
};

UpdateResult critic_update(const std::string& dir, const std::vector<Trajectory>& trajs, const json& u,
                           bool gae_over_tool_tokens = false, bool no_clip = false) {
  Run run;  // what critic_step reads: the optimizer's settings, one process
  TrainOptions& t = run.config.train;
  t.lr = u["lr"].get<double>();
  t.beta1 = u["beta1"].get<double>();
  t.beta2 = u["beta2"].get<double>();
  t.adam_eps = u["eps"].get<double>();
  t.weight_decay = u["weight_decay"].get<double>();
  t.grad_clip = u["grad_clip"].get<double>();
  t.lr_schedule = LrSchedule::kConstant;
  t.warmup_steps = 0;
  PpoOptions ppo;
  ppo.gamma = u["gamma"].get<double>();
  ppo.lam = u["lam"].get<double>();
  ppo.value_clip = no_clip ? 0.0 : u["value_clip"].get<double>();
  PolicyLossOptions objective;
  objective.agg = LossAgg::kSeqMeanTokenMean;

  Critic critic;
  critic.state.policy = std::make_unique<Transformer>(Transformer::load(dir, at::kFloat, at::kCPU).value_model());
  make_replicated_optimizer(critic.state, t, t.lr, t.lr);
  const int64_t S = static_cast<int64_t>(trajs.size());
  const PackedBatch b = pack(trajs, 0, S, at::kCPU, /*packed=*/true);
  UpdateResult r;
  {
    at::NoGradGuard no_grad;
    r.values_old = critic_values(*critic.state.policy, b);
  }
  const at::Tensor mask = gae_over_tool_tokens ? at::ones_like(b.loss_mask) : b.loss_mask;
  std::tie(r.advantages, r.returns) =
      gae_advantages(terminal_rewards(trajs, 0, S, b.R), r.values_old, mask, ppo.gamma, ppo.lam);
  const double denom = mini_batch_denominator(trajs, 0, S, objective.agg);
  const int64_t iterations = u["iterations"].get<int64_t>();
  for (int64_t it = 0; it < iterations; ++it) {
    zero_gradients(critic.state);
    const at::Tensor values = critic_values(*critic.state.policy, b);
    const ValueLoss vf = value_loss(values, r.values_old, r.returns, b.loss_mask, ppo, objective, denom);
    critic_backward(critic, vf.loss, /*ends_step=*/true);
    r.grad_norm.push_back(critic_step(run, critic, vf.loss, iterations));
    r.loss.push_back(vf.loss.item<double>());
    r.clip_frac.push_back((vf.clipped * b.loss_mask).sum().item<double>() / b.loss_mask.sum().item<double>());
  }
  EXPECT_EQ(critic.counters.optimizer_steps, iterations);
  at::NoGradGuard no_grad;
  r.values_after = critic_values(*critic.state.policy, b);
  return r;
}

TEST_P(CriticReference, AnUpdateOfTheValueLossMatchesAFloat64Reference) {
  const json& u = ref_["update"];
  const UpdateResult r = critic_update(dir_, trajs_, u);
  EXPECT_LT(max_diff(r.values_old, ref_["values_old"]), 1e-5);
  EXPECT_LT(max_diff(r.advantages, ref_["advantages"]), 1e-5);
  EXPECT_LT(max_diff(r.returns, ref_["returns"]), 1e-5);
  const json& steps = ref_["steps"];
  ASSERT_EQ(r.loss.size(), steps.size());
  for (size_t i = 0; i < steps.size(); ++i) {
    EXPECT_NEAR(r.loss[i], steps[i]["loss"].get<double>(), 1e-5 * std::max(1.0, std::abs(r.loss[i]))) << "step " << i;
    const double g = steps[i]["grad_norm"].get<double>();
    EXPECT_NEAR(r.grad_norm[i], g, 1e-5 * g) << "step " << i;
    EXPECT_NEAR(r.clip_frac[i], steps[i]["clip_frac"].get<double>(), 1e-12) << "step " << i;
  }
  const double after = max_diff(r.values_after, ref_["values_after"]);
  EXPECT_LT(after, 1e-5);
  std::cerr << GetParam() << ": values after " << steps.size() << " steps within " << after << " of float64\n";

  // The twins: GAE stepping through the tool tokens as if they were actions; the value loss without its clip
  // (the reference's last step clips some tokens).
  EXPECT_GT(max_diff(critic_update(dir_, trajs_, u, /*gae_over_tool_tokens=*/true).advantages, ref_["advantages"]),
            1e-2);
  EXPECT_GT(max_diff(critic_update(dir_, trajs_, u, false, /*no_clip=*/true).values_after, ref_["values_after"]), 1e-2);
}

// On a GPU, in bf16 with the training kernels (as ppo_train runs it): the values within bf16's rounding of
// transformers' float64 ones, padded and packed, and a backward that reaches every tensor of the critic. The
// twin (the token's own row) stays far off.
TEST_P(CriticReference, CudaBf16ValuesTrackTheReference) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  Transformer critic = Transformer::load(dir_, at::kBFloat16, at::Device(at::kCUDA)).value_model();
  critic.set_training_kernels(true);
  for (bool packed : {false, true}) {
    const PackedBatch b = pack(trajs_, 0, static_cast<int64_t>(trajs_.size()), at::Device(at::kCUDA), packed);
    const at::Tensor v = critic_values(critic, b);
    EXPECT_EQ(v.scalar_type(), at::kFloat);
    EXPECT_LT(max_diff(v.cpu(), ref_["values_old"]), 5e-2) << (packed ? "packed" : "padded");
    v.sum().backward();
    for (const auto& [name, p] : critic.named_parameters()) {
      ASSERT_TRUE(p.grad().defined()) << name;
      EXPECT_TRUE(p.grad().isfinite().all().item<bool>()) << name;
      p.mutable_grad() = at::Tensor();
    }
    ResponseRows own = b.sampled;
    own.rows = own.rows + 1;
    at::NoGradGuard no_grad;
    const at::Tensor h = batch_hidden(critic, b).to(at::kFloat);
    const at::Tensor wrong =
        to_response_layout(critic.score(h.reshape({-1, h.size(2)}).index_select(0, own.rows)).squeeze(1), own, b);
    EXPECT_GT(max_diff(wrong.cpu(), ref_["values_old"]), 0.3) << "the twin must fail";
  }
}

INSTANTIATE_TEST_SUITE_P(Families, CriticReference, ::testing::Values("qwen2_token", "llama_token"),
                         [](const auto& info) { return std::string(info.param); });

// The critic made from a causal LM: the trunk copied, the head at zero (every first value 0), a
// token-classification config; saved and loaded back, the same tensors. A reward model's score weight is kept.
TEST(CriticModel, FromAPolicyOrARewardModel) {
  ModelConfig mc;
  mc.type = ModelType::kQwen2;
  mc.model_type = "qwen2";
  mc.architecture = "Qwen2ForCausalLM";
  mc.raw = {{"model_type", "qwen2"},      {"architectures", {"Qwen2ForCausalLM"}},
            {"vocab_size", 64},           {"hidden_size", 16},
            {"intermediate_size", 32},    {"num_hidden_layers", 2},
            {"num_attention_heads", 2},   {"num_key_value_heads", 1},
            {"tie_word_embeddings", true}};
  const ModelConfig c = model_config_from_json(mc.raw, "test");
  const Transformer policy(c, at::kFloat, at::kCPU, 3);
  const Transformer critic = policy.value_model();
  EXPECT_EQ(critic.config().head, ModelHead::kTokenScore);
  EXPECT_EQ(critic.config().architecture, "Qwen2ForTokenClassification");
  for (const auto& [name, p] : critic.named_parameters()) {
    EXPECT_TRUE(p.requires_grad()) << name;
    if (name.rfind("score.", 0) == 0) {
      EXPECT_EQ(p.abs().max().item<double>(), 0.0) << name << ": the head starts at zero";
      continue;
    }
    bool found = false;
    for (const auto& [pn, pp] : policy.named_parameters()) {
      if (pn != name) continue;
      found = true;
      EXPECT_TRUE(at::equal(p, pp)) << name;
      EXPECT_NE(p.data_ptr(), pp.data_ptr()) << name << ": a copy, not the policy's tensor";
    }
    EXPECT_TRUE(found) << name;
  }
  testing::TempDir tmp("critic_model");
  const std::string dir = (tmp.path() / "critic").string();
  critic.save(dir);
  const json saved = read_json(fs::path(dir) / "config.json");
  EXPECT_EQ(saved["architectures"][0], "Qwen2ForTokenClassification");
  EXPECT_EQ(saved["id2label"].size(), 1u);
  const Transformer back = Transformer::load(dir, at::kFloat, at::kCPU);
  ASSERT_EQ(back.named_parameters().size(), critic.named_parameters().size());
  for (size_t i = 0; i < back.named_parameters().size(); ++i) {
    EXPECT_TRUE(at::equal(back.named_parameters()[i].second, critic.named_parameters()[i].second));
  }
  // A reward model (one-label sequence score): its score weight, a zero bias; two labels are refused.
  const Transformer rm = Transformer::load((references() / "qwen2").string(), at::kFloat, at::kCPU);
  const Transformer from_rm = rm.value_model();
  for (const auto& [name, p] : from_rm.named_parameters()) {
    if (name == "score.bias") EXPECT_EQ(p.abs().max().item<double>(), 0.0);
    if (name == "score.weight") {
      for (const auto& [rn, rp] : rm.named_parameters())
        if (rn == name) EXPECT_TRUE(at::equal(p, rp));
    }
  }
  json two = read_json(references() / "qwen2" / "config.json");
  two["id2label"] = {{"0", "a"}, {"1", "b"}};
  const Transformer two_labels(model_config_from_json(two, "two"), at::kFloat, at::kCPU);
  EXPECT_THROW(two_labels.value_model(), ModelConfigError);
}

// critic.lr on train.lr's schedule, its own peak: a frozen policy (train.lr 0) still has a critic that learns;
// the twin, critic.lr as a multiple of train.lr, would give 0.
TEST(CriticModel, LearnsOnTheScheduleAtItsOwnPeak) {
  Config c = load_config("", {});
  c.train.lr_schedule = LrSchedule::kCosine;
  c.train.warmup_steps = 2;
  c.train.min_lr_ratio = 0.1;
  c.critic.lr = 1e-3;
  for (double policy_lr : {1e-5, 0.0}) {
    c.train.lr = policy_lr;
    TrainOptions t = c.train;
    t.lr = 1e-3;
    for (int64_t step : {0, 1, 2, 5, 9}) {
      EXPECT_DOUBLE_EQ(critic_learning_rate(c, step, 10), learning_rate(t, step, 10)) << policy_lr << " " << step;
    }
  }
  EXPECT_GT(critic_learning_rate(c, 5, 10), 0) << "train.lr 0: the critic still learns";
  c.critic.lr = 0;
  c.train.lr = 2e-5;
  EXPECT_DOUBLE_EQ(critic_learning_rate(c, 5, 10), learning_rate(c.train, 5, 10)) << "0: train.lr's own";
}

}  // namespace
}  // namespace rlt
