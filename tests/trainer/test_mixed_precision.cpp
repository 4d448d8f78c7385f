// Mixed precision through the trainer's own optimizer path (make_optimizer, accumulate_gradients,
// apply_gradients): a bf16 model with fp32 master weights moves the way an fp32 model does at lr 1e-6,
// where plain bf16 AdamW rounds most updates away; the bf16 weights are the masters rounded; gradients of
// micro-batches add up in fp32; the trainer's multi-tensor AdamW step equals torch::optim::AdamW::step.
#include <gtest/gtest.h>

#include <torch/optim/adamw.h>

#include <cmath>
#include <iostream>
#include <memory>

#include "loss/logprob.h"
#include "tests/common/tiny_model.h"
#include "trainer/config.h"
#include "trainer/optim.h"
#include "trainer/run.h"

namespace rlt {
namespace {

// A run around a model in `dtype` whose weights are `start` (the same values for every run), with the
// optimizer the trainer makes. No weight decay and no clipping, so only the gradient moves a weight.
Run tiny_run(at::ScalarType dtype, MasterWeights master, const std::vector<at::Tensor>& start) {
  Run run;
  run.config = load_config("", {});
  run.config.train.lr = 1e-6;
  run.config.train.weight_decay = 0;
  run.config.train.grad_clip = 0;
  run.config.train.master_weights = master;
  run.model.policy = std::make_unique<Transformer>(testing::tiny_llama(96), dtype, at::kCPU, /*seed=*/0);
  const auto params = run.model.policy->parameters();
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) params[i].detach().copy_(start[i]);
  make_optimizer(run, {});
  return run;
}

// One optimizer step over two micro-batches of a fixed next-token loss.
void train_step(Run& run, const at::Tensor& ids /*(B, L)*/) {
  LossOptions lo;
  lo.response_only = false;
  for (int64_t half = 0; half < 2; ++half) {
    const at::Tensor x = ids.narrow(0, half * ids.size(0) / 2, ids.size(0) / 2);  // (B/2, L)
    const int64_t B = x.size(0), L = x.size(1);
    const at::Tensor positions = at::arange(L, at::kLong).expand({B, L});
    const at::Tensor hidden = run.model.policy->forward(x, positions, at::Tensor());  // (B/2, L, D)
    LogprobInputs in;
    in.hidden = hidden.narrow(1, 0, L - 1).reshape({-1, hidden.size(2)});  // (B/2 * (L-1), D)
    in.lm_head = run.model.policy->lm_head();
    in.targets = x.narrow(1, 1, L - 1).reshape({-1});
    const at::Tensor loss = -token_logprobs(in, lo).logprobs.mean() / 2;
    loss.backward();
    accumulate_gradients(run.model);
  }
  apply_gradients(run, at::Tensor(), /*total_optimizer_steps=*/10);
  run.model.optimizer->zero_grad();
}

// The flattened weights a run's optimizer updates, in float64: the masters, or the model's own.
at::Tensor flat_weights(const Run& run) {
  std::vector<at::Tensor> parts;
  for (const auto& p : run.model.master.empty() ? run.model.policy->parameters() : run.model.master) {
    parts.push_back(p.detach().to(at::kDouble).reshape({-1}));
  }
  return at::cat(parts);
}

double cosine(const at::Tensor& a, const at::Tensor& b) {
  return (a * b).sum().item<double>() / (a.norm().item<double>() * b.norm().item<double>() + 1e-300);
}

struct Deltas {
  at::Tensor fp32, master, plain_bf16;
};

Deltas ten_steps() {
  Transformer init(testing::tiny_llama(96), at::kFloat, at::kCPU, /*seed=*/3);
  std::vector<at::Tensor> start;  // bf16-representable, so every run starts at exactly the same point
  for (const auto& p : init.parameters()) start.push_back(p.detach().to(at::kBFloat16).to(at::kFloat));
  const at::Tensor ids = at::randint(0, 96, {8, 12}, at::TensorOptions().dtype(at::kLong));
  Run fp32 = tiny_run(at::kFloat, MasterWeights::kFp32, start);
  Run master = tiny_run(at::kBFloat16, MasterWeights::kFp32, start);
  Run plain = tiny_run(at::kBFloat16, MasterWeights::kNone, start);
  EXPECT_TRUE(fp32.model.master.empty()) << "an fp32 model needs no master copy";
  EXPECT_FALSE(master.model.master.empty());
  EXPECT_TRUE(plain.model.master.empty());
  Deltas d;
  const at::Tensor w0 = flat_weights(fp32);
  for (Run* r : {&fp32, &master, &plain}) {
    for (int step = 0; step < 10; ++step) train_step(*r, ids);
  }
  d.fp32 = flat_weights(fp32) - w0;
  d.master = flat_weights(master) - w0;
  d.plain_bf16 = flat_weights(plain) - w0;
  // The bf16 weights the master run computes with are its masters rounded to nearest.
  const auto params = master.model.policy->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(at::equal(params[i], master.model.master[i].to(at::kBFloat16))) << "parameter " << i;
  }
  return d;
}

TEST(MixedPrecision, MasterWeightsMoveLikeFp32AndPlainBf16DoesNot) {
  const Deltas d = ten_steps();
  ASSERT_GT(d.fp32.norm().item<double>(), 0) << "the fp32 run must move";
  // The bound of the issue: the master's 10-step delta points where the fp32 run's does.
  constexpr double kMinCosine = 0.99;
  EXPECT_GE(cosine(d.master, d.fp32), kMinCosine);
  // The wrong implementation, plain bf16 AdamW at lr 1e-6, fails the same bound: updates under half a
  // bf16 step (2^-9 of the weight) round away.
  EXPECT_LT(cosine(d.plain_bf16, d.fp32), kMinCosine);
  const double moved = (d.plain_bf16 != 0).to(at::kDouble).mean().item<double>();
  const double moved_master = (d.master != 0).to(at::kDouble).mean().item<double>();
  EXPECT_LT(moved, 0.5) << "plain bf16 keeps most weights where they were";
  EXPECT_GT(moved_master, 0.9) << "the masters take nearly every update";
  std::cout << "cosine to fp32: master " << cosine(d.master, d.fp32) << ", plain bf16 " << cosine(d.plain_bf16, d.fp32)
            << "; weights moved: master " << moved_master << ", plain bf16 " << moved << "\n";
}

TEST(MixedPrecision, MicroBatchGradientsAddUpInFp32) {
  Transformer init(testing::tiny_llama(96), at::kFloat, at::kCPU, /*seed=*/5);
  std::vector<at::Tensor> start;
  for (const auto& p : init.parameters()) start.push_back(p.detach());
  rlt::Run run = tiny_run(at::kBFloat16, MasterWeights::kFp32, start);
  auto params = run.model.policy->parameters();
  // Two micro-batches' gradients: 1 and 2^-9. In bf16 (8 significant bits) 1 + 2^-9 rounds back to 1.
  const double small = std::ldexp(1.0, -9);
  for (double g : {1.0, small}) {
    for (auto& p : params) p.mutable_grad() = at::full_like(p, g);  // bf16, as a backward leaves it
    accumulate_gradients(run.model);
    EXPECT_FALSE(params[0].grad().defined()) << "the bf16 gradient is released once taken";
  }
  const at::Tensor want = at::full_like(run.model.master[0], 1.0 + small);  // fp32: exact
  EXPECT_TRUE(at::equal(run.model.master[0].grad(), want));
  // What accumulating in bf16 would have kept: not the sum.
  const at::Tensor bf16_sum = at::full_like(params[0], 1.0) + at::full_like(params[0], small);
  EXPECT_FALSE(at::equal(bf16_sum.to(at::kFloat), want));
}

TEST(MixedPrecision, OptimizerMemoryCountsMastersGradientsAndMoments) {
  Transformer init(testing::tiny_llama(96), at::kFloat, at::kCPU, /*seed=*/7);
  std::vector<at::Tensor> start;
  int64_t n = 0;
  for (const auto& p : init.parameters()) {
    start.push_back(p.detach());
    n += p.numel();
  }
  rlt::Run run = tiny_run(at::kBFloat16, MasterWeights::kFp32, start);
  EXPECT_EQ(optimizer_memory_bytes(run.model), 4 * n) << "masters only before the first step";
  const at::Tensor ids = at::randint(0, 96, {4, 8}, at::TensorOptions().dtype(at::kLong));
  train_step(run, ids);
  EXPECT_EQ(optimizer_memory_bytes(run.model), 4 * n + 2 * 4 * n) << "+ two fp32 moments (gradients zeroed to none)";
}

// The trainer's AdamW step (step_multi_tensor) against torch::optim::AdamW::step on copies of the same two
// groups (the second at its own learning rate without decay, as the trainer's extra group), five steps in
// which one parameter has no gradient at the second step, so its count lags its group's: the weights and
// every state (moments, count) bit for bit after each step. The twin, that parameter stepped with a zero
// gradient instead (its weight decays and moves on its moment), must differ.
void check_multi_tensor_step(at::Device device, at::ScalarType dtype) {
  const std::vector<std::vector<int64_t>> shapes = {{7, 5}, {64}, {3, 11}, {1}, {5}, {2, 2}};
  const size_t first_group = 4, skipped = 1, skipped_at = 1;
  at::manual_seed(11);
  std::vector<at::Tensor> start;
  for (const auto& shape : shapes) start.push_back(at::randn(shape).to(device, dtype));
  struct Copy {
    std::vector<at::Tensor> params;
    std::unique_ptr<torch::optim::AdamW> opt;
  };
  auto make_copy = [&] {
    Copy c;
    for (const at::Tensor& t : start) c.params.push_back(t.clone());
    auto o = torch::optim::AdamWOptions(2e-2).betas({0.8, 0.95}).eps(1e-6).weight_decay(0.5);
    auto extra = o;
    extra.lr(5e-2).weight_decay(0.0);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::vector<at::Tensor>(c.params.begin(), c.params.begin() + first_group),
                        std::make_unique<torch::optim::AdamWOptions>(o));
    groups.emplace_back(std::vector<at::Tensor>(c.params.begin() + first_group, c.params.end()),
                        std::make_unique<torch::optim::AdamWOptions>(extra));
    c.opt = std::make_unique<torch::optim::AdamW>(std::move(groups), o);
    return c;
  };
  Copy theirs = make_copy(), ours = make_copy(), twin = make_copy();
  auto same = [](const Copy& a, const Copy& b) {
    bool equal = true;
    for (size_t i = 0; i < a.params.size(); ++i) {
      equal = equal && at::equal(a.params[i], b.params[i]);
      const auto& sa =
          static_cast<torch::optim::AdamWParamState&>(*a.opt->state().at(a.params[i].unsafeGetTensorImpl()));
      const auto& sb =
          static_cast<torch::optim::AdamWParamState&>(*b.opt->state().at(b.params[i].unsafeGetTensorImpl()));
      equal = equal && sa.step() == sb.step() && at::equal(sa.exp_avg(), sb.exp_avg()) &&
              at::equal(sa.exp_avg_sq(), sb.exp_avg_sq());
    }
    return equal;
  };
  for (size_t t = 0; t < 5; ++t) {
    for (size_t i = 0; i < shapes.size(); ++i) {
      const at::Tensor g = (at::randn(shapes[i]) * at::randn(shapes[i]).exp()).to(device, dtype);
      const bool none = i == skipped && t == skipped_at;
      theirs.params[i].mutable_grad() = none ? at::Tensor() : g;
      ours.params[i].mutable_grad() = none ? at::Tensor() : g.clone();
      twin.params[i].mutable_grad() = none ? at::zeros_like(g) : g.clone();
    }
    theirs.opt->step();
    step_multi_tensor(*ours.opt);
    step_multi_tensor(*twin.opt);
    EXPECT_TRUE(same(ours, theirs)) << "step " << t + 1;
  }
  const auto& lagging =
      static_cast<torch::optim::AdamWParamState&>(*ours.opt->state().at(ours.params[skipped].unsafeGetTensorImpl()));
  EXPECT_EQ(lagging.step(), 4) << "the parameter without a gradient keeps its count";
  EXPECT_FALSE(same(twin, theirs)) << "the check accepts a missing gradient stepped as zero";
}

TEST(MixedPrecision, MultiTensorStepEqualsTorchAdamW) { check_multi_tensor_step(at::kCPU, at::kFloat); }

TEST(MixedPrecisionCuda, MultiTensorStepEqualsTorchAdamWOnCuda) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  check_multi_tensor_step(at::kCUDA, at::kFloat);
  check_multi_tensor_step(at::kCUDA, at::kBFloat16);
}

}  // namespace
}  // namespace rlt
