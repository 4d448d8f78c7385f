// The logits-based paths (naive, selective: ATen chunks and the CUDA kernel) against float64 naive,
// the row index (results in the caller's order, response_only bit-identical to computing every row), and float64
// gradient checks of the selective autograd function.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>

#include "loss/logprob.h"
#include "loss/selective.h"
#include "tests/common/check.h"
#include "tests/common/gradcheck.h"

namespace rlt {
namespace {

using rlt::testing::close;

// Log-probs accumulate lse over V <= 1024 logits of magnitude <= ~15 in fp32: rounding ~1e-6, so 1e-5
// leaves 10x headroom without accepting a wrong row (an off-by-one target is off by O(1)).
constexpr double kLogprobAtol = 1e-5;
// fp32 gradients: g_v = (-p_v (glp + gH (log p_v + H)) + glp [v = y]) / temp. An fp32 error eps in
// lse and H (|x| <= 16, V <= 32768: 16 * 2^-24 * log2(V) ~ 1.4e-6, so eps = 2e-6) moves g_v by at most
// eps * p_v (|glp| + |gH| (2 + |log p_v + H|)) / temp: that per-element bound, plus 1e-6 absolute and
// 1e-5 relative for the rest of the arithmetic.
constexpr double kLseErrFp32 = 2e-6, kGradAtolFp32 = 1e-6, kGradRtolFp32 = 1e-5;
// bf16/fp16 gradients are stored in the logits dtype and compared with the float64 gradient rounded to
// that dtype: an fp32 value near a rounding boundary may land one ulp away, i.e. 2^-7 relative for bf16
// (8 significant bits) and 2^-10 for fp16 (11 bits).
constexpr double kGradAtolHalf = 1e-7, kGradRtolBf16 = 1.0 / 128, kGradRtolFp16 = 1.0 / 1024;
// float64 inputs run the same code in float64.
constexpr double kAtolFp64 = 1e-12;

at::Tensor make_logits(int64_t T, int64_t V, at::ScalarType dt, uint64_t seed, at::Device dev = at::kCPU) {
  at::manual_seed(seed);
  return (at::randn({T, V}, at::kDouble) * 3).to(dt).to(dev);
}

at::Tensor make_targets(int64_t T, int64_t V, uint64_t seed, at::Device dev = at::kCPU) {
  at::manual_seed(seed + 1000);
  return at::randint(0, V, {T}, at::kLong).to(dev);
}

struct Result {
  at::Tensor lp, H, grad;      // (T), (T) or undefined, d/dlogits (T, V)
  at::Tensor lse_sensitivity;  // reference only: p_v (|glp| + |gH| (2 + |log p_v + H|)) / temp, (T, V)
};

// Upstream gradients: u1 on log-probs, u2 on entropy (when it is differentiable).
std::pair<at::Tensor, at::Tensor> upstream(int64_t T, uint64_t seed) {
  at::manual_seed(seed + 2000);
  return {at::randn({T}, at::kDouble), at::randn({T}, at::kDouble)};
}

// float64 naive on the same (possibly bf16) values; grads of sum(u1 lp) (+ sum(u2 H) if entropy_grad).
Result reference(const at::Tensor& logits, const at::Tensor& targets, double temp, bool entropy_grad,
                 const at::Tensor& row_mask = at::Tensor()) {
  at::Tensor x = logits.detach().to(at::kCPU).to(at::kDouble).requires_grad_(true);
  auto [lp, H] = naive_logprobs(x, targets.to(at::kCPU), temp, true);
  auto [u1, u2] = upstream(x.size(0), 7);
  if (row_mask.defined())
    u1 = u1 * row_mask.to(at::kCPU).to(at::kDouble), u2 = u2 * row_mask.to(at::kCPU).to(at::kDouble);
  at::Tensor loss = (u1 * lp).sum();
  if (entropy_grad) loss = loss + (u2 * H).sum();
  auto g = torch::autograd::grad({loss}, {x});
  at::NoGradGuard ng;
  at::Tensor logp_all = at::log_softmax(x.detach() / temp, 1);  // (T, V)
  at::Tensor gH = entropy_grad ? u2.abs().unsqueeze(1) : at::zeros_like(u2).unsqueeze(1);
  at::Tensor sens =
      logp_all.exp() * (u1.abs().unsqueeze(1) + gH * (2 + (logp_all + H.detach().unsqueeze(1)).abs())) / temp;
  return {lp.detach(), H.detach(), g[0], sens};
}

// Our log-probs of `rows` (all rows when undefined) and the gradient of sum(u1 lp) (+ sum(u2 H)), the
// upstream gradients being those of the reference at the same rows (times row_mask when given).
Result ours(const at::Tensor& logits, const at::Tensor& targets, const LossOptions& opt,
            const at::Tensor& rows = at::Tensor(), const at::Tensor& row_mask = at::Tensor()) {
  at::Tensor x = logits.detach().clone().requires_grad_(true);
  LogprobInputs in;
  in.logits = x;
  in.targets = targets;
  in.rows = rows;
  LogprobOutput out = token_logprobs(in, opt);
  auto [u1, u2] = upstream(x.size(0), 7);
  u1 = u1.to(out.logprobs.options());
  u2 = u2.to(out.logprobs.options());
  if (row_mask.defined()) u1 = u1 * row_mask.to(u1.options()), u2 = u2 * row_mask.to(u2.options());
  if (rows.defined()) u1 = u1.index_select(0, rows), u2 = u2.index_select(0, rows);
  at::Tensor loss = (u1 * out.logprobs).sum();
  if (opt.entropy == EntropyMode::kGrad) loss = loss + (u2 * out.entropy).sum();
  auto g = torch::autograd::grad({loss}, {x});
  return {out.logprobs.detach(), out.entropy.defined() ? out.entropy.detach() : at::Tensor(), g[0]};
}

std::string name(const LossOptions& o, at::ScalarType dt) {
  std::ostringstream os;
  os << enum_to_string(o.impl) << " " << dt << " entropy=" << enum_to_string(o.entropy) << " chunk=" << o.chunk_size
     << " temp=" << o.temperature << " inplace=" << o.inplace_backward;
  return os.str();
}

void expect_matches_reference(const at::Tensor& logits, const at::Tensor& targets, const LossOptions& opt) {
  const auto dt = logits.scalar_type();
  const std::string what = name(opt, dt);
  SCOPED_TRACE(what);
  Result r = reference(logits, targets, opt.temperature, opt.entropy == EntropyMode::kGrad);
  Result o = ours(logits, targets, opt);
  // Wrong implementations each tolerance must reject: an off-by-one target (log-probs, gradients), an
  // off-by-one row (entropy, which does not depend on the target), a missing temperature.
  const int64_t V = logits.size(1);
  Result off_target = ours(logits, (targets + 1).remainder(V), opt);
  Result off_row = ours(logits.roll(/*shifts=*/-1, /*dims=*/0), targets, opt);
  const bool fp64 = dt == at::kDouble, half = dt == at::kBFloat16 || dt == at::kHalf;
  EXPECT_EQ(o.lp.scalar_type(), fp64 ? at::kDouble : at::kFloat) << "log-probs come out in fp32 (fp64)";
  const double lp_atol = fp64 ? kAtolFp64 : kLogprobAtol;
  RLT_EXPECT_CLOSE_REJECTING(o.lp, off_target.lp, "target y + 1", r.lp, lp_atol, 0.0, what + " logprobs");
  if (opt.temperature != 1.0) {
    LossOptions no_temp = opt;
    no_temp.temperature = 1.0;
    EXPECT_TRUE(rlt::testing::rejects(ours(logits, targets, no_temp).lp, r.lp, lp_atol, 0.0, what + " logprobs",
                                      "temperature ignored"));
  }
  if (opt.entropy != EntropyMode::kNone) {
    RLT_EXPECT_CLOSE_REJECTING(o.H, off_row.H, "row t + 1", r.H, lp_atol, 0.0, what + " entropy");
  }
  const double g_rtol = fp64                  ? 0.0
                        : dt == at::kBFloat16 ? kGradRtolBf16
                        : dt == at::kHalf     ? kGradRtolFp16
                                              : kGradRtolFp32;
  const at::Tensor g_atol = fp64   ? at::scalar_tensor(kAtolFp64, at::kDouble)
                            : half ? at::scalar_tensor(kGradAtolHalf, at::kDouble) + kLseErrFp32 * r.lse_sensitivity
                                   : kGradAtolFp32 + kLseErrFp32 * r.lse_sensitivity;
  // The reference gradient rounded to the logits dtype is what a perfect kernel would store.
  RLT_EXPECT_CLOSE_REJECTING(o.grad, off_target.grad, "target y + 1", r.grad.to(dt).to(at::kDouble), g_atol, g_rtol,
                             what + " grad");
}

TEST(Logprob, PathsMatchFloat64NaiveOnOddShapes) {
  const int64_t T = 37, V = 1013;
  for (auto dt : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble}) {
    const at::Tensor logits = make_logits(T, V, dt, 1), targets = make_targets(T, V, 1);
    for (auto impl : {LogprobImpl::kNaive, LogprobImpl::kSelective}) {
      for (auto ent : {EntropyMode::kNone, EntropyMode::kValue, EntropyMode::kGrad}) {
        for (int64_t chunk : {0, 7}) {
          for (double temp : {1.0, 0.7}) {
            LossOptions o;
            o.impl = impl;
            o.response_only = false;
            o.entropy = ent;
            o.chunk_size = chunk;
            o.temperature = temp;
            expect_matches_reference(logits, targets, o);
            if (impl == LogprobImpl::kSelective) {
              o.inplace_backward = true;
              expect_matches_reference(logits, targets, o);
            }
          }
        }
      }
    }
  }
}

TEST(Logprob, EntropyGradientFlowsOnlyWhenAsked) {
  const at::Tensor logits = make_logits(5, 11, at::kFloat, 2).requires_grad_(true), targets = make_targets(5, 11, 2);
  for (auto impl : {LogprobImpl::kNaive, LogprobImpl::kSelective}) {
    LossOptions o;
    o.impl = impl;
    o.response_only = false;
    LogprobInputs in;
    in.logits = logits;
    in.targets = targets;
    o.entropy = EntropyMode::kValue;
    EXPECT_FALSE(token_logprobs(in, o).entropy.requires_grad()) << enum_to_string(impl);
    o.entropy = EntropyMode::kGrad;
    EXPECT_TRUE(token_logprobs(in, o).entropy.requires_grad()) << enum_to_string(impl);
    o.entropy = EntropyMode::kNone;
    EXPECT_FALSE(token_logprobs(in, o).entropy.defined()) << enum_to_string(impl);
  }
}

// The response rows of a 3-sequence batch of 37 rows ([3, 12) and [20, 37)), listed out of order, as a
// caller may list them: the results must come back in this order.
at::Tensor response_rows(at::Device dev = at::kCPU) {
  std::vector<int64_t> r;
  for (int64_t t = 20; t < 37; ++t) r.push_back(t);
  for (int64_t t = 11; t >= 3; --t) r.push_back(t);
  return at::tensor(r, at::kLong).to(dev);
}

at::Tensor response_mask(int64_t T) {
  at::Tensor m = at::zeros({T}, at::kBool);
  m.narrow(0, 3, 9).fill_(true);    // [3, 12)
  m.narrow(0, 20, 17).fill_(true);  // [20, 37)
  return m;
}

// Listed rows come back in the caller's order, equal bit for bit to the same rows of an all-rows call,
// with or without response_only (which only decides whether unlisted rows are computed); gradients
// too, and exactly zero on rows not listed. Wrong: the rows in sorted order, or one row off.
TEST(Logprob, ListedRowsComeBackInOrderAndBitIdentical) {
  const int64_t T = 37, V = 1013;
  const at::Tensor kept = response_mask(T), rows = response_rows();
  const at::Tensor out_idx = (~kept).nonzero().squeeze(1);
  for (auto dt : {at::kFloat, at::kBFloat16}) {
    const at::Tensor logits = make_logits(T, V, dt, 3), targets = make_targets(T, V, 3);
    for (auto impl : {LogprobImpl::kNaive, LogprobImpl::kSelective}) {
      for (int64_t chunk : {0, 5}) {
        LossOptions o;
        o.impl = impl;
        o.chunk_size = chunk;
        o.entropy = EntropyMode::kGrad;
        o.response_only = false;
        SCOPED_TRACE(name(o, dt));
        // All rows, upstream gradient only on the response rows, as the policy loss would give.
        const Result full = ours(logits, targets, o, at::Tensor(), kept);
        for (bool response_only : {true, false}) {
          o.response_only = response_only;
          const Result sel = ours(logits, targets, o, rows);
          EXPECT_TRUE(at::equal(sel.lp, full.lp.index_select(0, rows))) << "log-probs, response_only " << response_only;
          EXPECT_TRUE(at::equal(sel.H, full.H.index_select(0, rows))) << "entropy";
          EXPECT_TRUE(at::equal(sel.grad, full.grad)) << "gradients, and 0 on rows not listed";
          EXPECT_EQ(sel.grad.index_select(0, out_idx).abs().max().item<double>(), 0.0);
          // A wrong order or a wrong row would be caught.
          EXPECT_FALSE(at::equal(sel.lp, full.lp.index_select(0, std::get<0>(rows.sort()))));
          EXPECT_FALSE(at::equal(sel.lp, full.lp.index_select(0, rows - 1)));
        }
      }
    }
  }
}

TEST(Logprob, BadInputsAreRejected) {
  const at::Tensor logits = make_logits(8, 5, at::kFloat, 5), targets = make_targets(8, 5, 5);
  LossOptions o;
  LogprobInputs in;
  in.logits = logits;
  in.targets = targets;
  auto expect_error = [&](const std::string& want) {
    try {
      token_logprobs(in, o);
      ADD_FAILURE() << "accepted; wanted an error with: " << want;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find(want), std::string::npos) << e.what_without_backtrace();
    }
  };
  in.rows = at::tensor({2, 8}, at::kLong);  // row past T
  expect_error("rows must lie in [0, T) with T = 8, got [2, 8]");
  in.rows = at::tensor({-1, 3}, at::kLong);  // negative row
  expect_error("rows must lie in [0, T)");
  in.rows = at::tensor({3, 5, 3}, at::kLong);  // a row listed twice
  expect_error("rows must be distinct");
  in.rows = at::tensor({1, 2}, at::kInt);  // not int64
  expect_error("rows must be a (T') int64 index");
  in.rows = at::tensor({1, 2}, at::kLong).view({1, 2});  // not 1-D
  expect_error("rows must be a (T') int64 index");
  in.rows = at::Tensor();
  in.targets = make_targets(7, 5, 5);  // wrong length
  EXPECT_THROW(token_logprobs(in, o), c10::Error);
  in.targets = targets;
  in.hidden = at::randn({8, 3});  // both logits and hidden
  EXPECT_THROW(token_logprobs(in, o), c10::Error);
  in.hidden = at::Tensor();
  o.impl = LogprobImpl::kCce;  // cce needs hidden states
  EXPECT_THROW(token_logprobs(in, o), c10::Error);
}

TEST(Logprob, SelectiveGradcheckFloat64) {
  const int64_t T = 6, V = 7;
  const at::Tensor targets = make_targets(T, V, 6);
  const at::Tensor rows = at::tensor({0, 2, 3, 5}, at::kLong);
  at::manual_seed(60);
  const at::Tensor u1 = at::randn({4}, at::kDouble), u2 = at::randn({4}, at::kDouble);
  for (bool subset : {false, true}) {
    for (double temp : {1.0, 0.8}) {
      LossOptions a;
      a.temperature = temp;
      a.chunk_size = 3;
      a.entropy = EntropyMode::kGrad;
      auto F = [&](const std::vector<at::Tensor>& x) {
        at::Tensor r = subset ? rows : at::Tensor();
        at::Tensor t = subset ? targets.index_select(0, rows) : targets.narrow(0, 0, 4);
        at::Tensor logits = subset ? x[0] : x[0].narrow(0, 0, 4).contiguous();
        auto [lp, H] = selective_logprobs(logits, r, t, a);
        return (u1 * lp).sum() + (u2 * H).sum();
      };
      EXPECT_TRUE(
          rlt::testing::gradcheck(F, {make_logits(T, V, at::kDouble, 61)},
                                  "selective subset=" + std::to_string(subset) + " temp=" + std::to_string(temp)));
    }
  }
}

// ---- CUDA: the fused kernel against float64 and against the ATen chunks (skips without a GPU) ----

TEST(LogprobCuda, KernelMatchesReferenceAndAtenPath) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const at::Device dev(at::kCUDA, 0);
  for (int64_t V : {1013, 1024, 32768}) {  // scalar tail only, 16-byte vectors only, large row
    const int64_t T = 37;
    for (auto dt : {at::kFloat, at::kBFloat16, at::kHalf}) {
      const at::Tensor logits = make_logits(T, V, dt, 8, dev), targets = make_targets(T, V, 8, dev);
      for (auto ent : {EntropyMode::kNone, EntropyMode::kGrad}) {
        for (double temp : {1.0, 0.7}) {
          for (bool inplace : {false, true}) {
            LossOptions o;
            o.response_only = false;
            o.entropy = ent;
            o.temperature = temp;
            o.inplace_backward = inplace;
            expect_matches_reference(logits, targets, o);
          }
        }
        // The kernel and the ATen chunks compute the same function.
        LossOptions a;
        a.entropy = ent;
        at::Tensor r = at::tensor({0, 5, 6, 36}, at::kLong).to(dev);
        at::Tensor t = targets.index_select(0, r);
        auto k = selective_logprobs(logits, r, t, a, /*use_cuda_kernel=*/true);
        auto c = selective_logprobs(logits, r, t, a, /*use_cuda_kernel=*/false);
        // Wrong: an off-by-one target (log-probs) and an off-by-one row (entropy).
        auto w = selective_logprobs(logits, r, (t + 1).remainder(V), a);
        auto w_row = selective_logprobs(logits, (r + 1).remainder(T), t, a);
        RLT_EXPECT_CLOSE_REJECTING(k.first, w.first, "target y + 1", c.first, kLogprobAtol, 0.0,
                                   "kernel vs aten logprobs");
        if (ent != EntropyMode::kNone)
          RLT_EXPECT_CLOSE_REJECTING(k.second, w_row.second, "row r + 1", c.second, kLogprobAtol, 0.0,
                                     "kernel vs aten entropy");
      }
    }
  }
}

TEST(LogprobCuda, ResponseOnlyBitIdenticalOnGpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const at::Device dev(at::kCUDA, 0);
  const int64_t T = 37, V = 4096;
  const at::Tensor kept = response_mask(T).to(dev), rows = response_rows(dev);
  const at::Tensor out_idx = (~kept).nonzero().squeeze(1);
  for (auto dt : {at::kFloat, at::kBFloat16}) {
    const at::Tensor logits = make_logits(T, V, dt, 9, dev), targets = make_targets(T, V, 9, dev);
    LossOptions o;
    o.entropy = EntropyMode::kGrad;
    o.response_only = false;
    Result full = ours(logits, targets, o, at::Tensor(), kept);
    o.response_only = true;
    Result sel = ours(logits, targets, o, rows);
    EXPECT_TRUE(at::equal(sel.lp, full.lp.index_select(0, rows)));
    EXPECT_TRUE(at::equal(sel.grad, full.grad));
    EXPECT_EQ(sel.grad.index_select(0, out_idx).abs().max().item<double>(), 0.0);
    EXPECT_FALSE(at::equal(sel.lp, full.lp.index_select(0, std::get<0>(rows.sort())))) << "order is checked";
  }
}

}  // namespace
}  // namespace rlt
