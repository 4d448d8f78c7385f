// adamw_step against torch::optim::AdamW and against a float64 loop, over 5 steps on odd sizes; the wrong
// variants (no bias correction, decay after the update, decay as L2, a moment read one element off) that
// the same comparisons must reject; OffloadedAdamW's drivers against adamw_step, bit for bit, and the
// weights they write against the masters' rounding; adamw_step_tensors against torch::optim::AdamW over a
// list of tensors, bit for bit, with its faults, and clip_grad_norm_tensors against clip_grad_norm_. CUDA
// cases skip without a GPU.
#include <ATen/Parallel.h>
#ifdef RLT_HAVE_CUDA
#include <ATen/cuda/Sleep.h>
#endif
#include <gtest/gtest.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "parallel/adamw.h"

namespace rlt {
namespace {

// adamw_step against torch and the float64 loop: 1e-6 of each tensor's scale (worst_error). The fp32
// kernel's own rounding is ~1e-7 relative after 5 steps (a few half-ulps per element); the CPU kernels
// differ from torch's only by its MKL sqrt (within an ulp).
constexpr double kRelTol = 1e-6;
constexpr int kSteps = 5;
const std::vector<int64_t> kSizes = {1, 7, 1031, 3 * kAdamWCpuGrain + 17};

// Away from every default. lr wd = 1e-2, so decaying after the update instead of before moves each weight
// by lr wd |update| ~ 2e-4 a step, 50x the tolerance on weights of magnitude ~4.
AdamWStep hyper(int64_t step) {
  AdamWStep s;
  s.lr = 2e-2;
  s.beta1 = 0.8;
  s.beta2 = 0.95;
  s.eps = 1e-6;
  s.weight_decay = 0.5;
  s.step = step;
  return s;
}

// Start weights and one gradient per step: N(0, 1) times a per-element scale e^N(0,1), so elements differ
// in magnitude the way parameters do.
struct Problem {
  at::Tensor p0;                  // (n) fp32
  std::vector<at::Tensor> grads;  // kSteps x (n) fp32
};

Problem make_problem(int64_t n, uint64_t seed) {
  at::manual_seed(seed);
  Problem pr;
  pr.p0 = at::randn({n});
  const at::Tensor scale = at::randn({n}).exp();
  for (int t = 0; t < kSteps; ++t) pr.grads.push_back(at::randn({n}) * scale);
  return pr;
}

struct State {
  at::Tensor p, m, v;  // (n) fp32 (or float64 for the reference)
};

// max |a - b| / max(max |b|, floor), in double.
double rel_error(const at::Tensor& actual, const at::Tensor& expected, double floor = 0) {
  const at::Tensor a = actual.to(at::kCPU, at::kDouble), e = expected.to(at::kCPU, at::kDouble);
  EXPECT_TRUE(a.isfinite().all().item<bool>()) << "NaN or Inf in the result";
  const double scale = std::max(e.abs().max().item<double>(), floor);
  return (a - e).abs().max().item<double>() / std::max(scale, 1e-300);
}

// The worst of the three tensors after step t: the one number each comparison accepts or rejects. A
// tensor's scale is floored by the largest term that entered it, since cancellation can leave it far
// below the roundings of its terms (b1 m and (1 - b1) g of opposite signs, a weight near zero moved by
// its update): the weights by one update's size lr, the first moment by (1 - b1) max |g_t|. The second
// moment sums positive terms.
double worst_error(const State& actual, const State& expected, const Problem& pr, int t) {
  const AdamWStep s = hyper(t + 1);
  const double m_floor = (1 - s.beta1) * pr.grads[t].abs().max().item<double>();
  return std::max({rel_error(actual.p, expected.p, s.lr), rel_error(actual.m, expected.m, m_floor),
                   rel_error(actual.v, expected.v)});
}

// Elementwise: |a - b| <= kRelTol max(|b|, floor) for every element; floor lr on the weights, where a
// weight near zero carries the absolute error of its update.
double elementwise_error(const at::Tensor& actual, const at::Tensor& expected, double floor) {
  const at::Tensor a = actual.to(at::kCPU, at::kDouble), e = expected.to(at::kCPU, at::kDouble);
  return ((a - e).abs() / e.abs().clamp_min(floor)).max().item<double>();
}

int64_t count_different(const at::Tensor& a, const at::Tensor& b) { return a.cpu().ne(b.cpu()).sum().item<int64_t>(); }

// torch::optim::AdamW (decoupled decay, amsgrad off) over the problem on `device`: the state after each step.
std::vector<State> torch_adamw(const Problem& pr, at::Device device) {
  const AdamWStep s = hyper(1);
  at::Tensor p = pr.p0.to(device).clone();
  torch::optim::AdamW opt(std::vector<at::Tensor>{p}, torch::optim::AdamWOptions(s.lr)
                                                          .betas({s.beta1, s.beta2})
                                                          .eps(s.eps)
                                                          .weight_decay(s.weight_decay)
                                                          .amsgrad(false));
  std::vector<State> out;
  for (int t = 0; t < kSteps; ++t) {
    p.mutable_grad() = pr.grads[t].to(device);
    opt.step();
    auto& st = static_cast<torch::optim::AdamWParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
    out.push_back({p.clone(), st.exp_avg().clone(), st.exp_avg_sq().clone()});
  }
  return out;
}

std::vector<State> rlt_adamw(const Problem& pr, at::Device device) {
  at::Tensor p = pr.p0.to(device).clone(), m = at::zeros_like(p), v = at::zeros_like(p);
  std::vector<State> out;
  for (int t = 0; t < kSteps; ++t) {
    adamw_step(p, pr.grads[t].to(device), m, v, hyper(t + 1));
    out.push_back({p.clone(), m.clone(), v.clone()});
  }
  return out;
}

// The float64 loop of the update, and the wrong variants the comparisons must reject.
enum class Bug {
  kNone,
  kNoBiasCorrection,  // b1^t, b2^t -> 0: the corrections 1 - b^t become 1
  kDecayAfterUpdate,  // p = (p - update) (1 - lr wd)
  kDecayAsL2,         // Adam's coupled decay: g + wd p enters the moments
  kShiftedMoment,     // the first moment reads the next element's gradient
};

std::vector<State> reference_adamw(const Problem& pr, Bug bug) {
  const int64_t n = pr.p0.numel();
  std::vector<double> p(n), m(n, 0.0), v(n, 0.0);
  for (int64_t i = 0; i < n; ++i) p[i] = pr.p0[i].item<double>();
  std::vector<State> out;
  for (int t = 0; t < kSteps; ++t) {
    const AdamWStep s = hyper(t + 1);
    const at::Tensor gt = pr.grads[t].to(at::kDouble).contiguous();
    const double* g = gt.data_ptr<double>();
    const double bc1 = bug == Bug::kNoBiasCorrection ? 1.0 : 1 - std::pow(s.beta1, double(s.step));
    const double bc2 = bug == Bug::kNoBiasCorrection ? 1.0 : 1 - std::pow(s.beta2, double(s.step));
    const double decay = 1 - s.lr * s.weight_decay;
    for (int64_t i = 0; i < n; ++i) {
      double gi = g[i];
      if (bug == Bug::kDecayAsL2) gi += s.weight_decay * p[i];
      if (bug == Bug::kNone || bug == Bug::kNoBiasCorrection || bug == Bug::kShiftedMoment) p[i] *= decay;
      const double gm = bug == Bug::kShiftedMoment ? g[std::min(i + 1, n - 1)] : gi;
      m[i] = s.beta1 * m[i] + (1 - s.beta1) * gm;
      v[i] = s.beta2 * v[i] + (1 - s.beta2) * gi * gi;
      const double denom = std::sqrt(v[i]) / std::sqrt(bc2) + s.eps;
      p[i] -= s.lr / bc1 * m[i] / denom;
      if (bug == Bug::kDecayAfterUpdate) p[i] *= decay;
    }
    auto tensor = [](const std::vector<double>& x) { return at::tensor(x, at::kDouble); };
    out.push_back({tensor(p), tensor(m), tensor(v)});
  }
  return out;
}

const std::vector<std::pair<Bug, const char*>> kTwins = {{Bug::kNoBiasCorrection, "no bias correction"},
                                                         {Bug::kDecayAfterUpdate, "decay after the update"},
                                                         {Bug::kDecayAsL2, "decay as L2 in the gradient"},
                                                         {Bug::kShiftedMoment, "first moment one element off"}};

// ATen's intra-op threads for a scope (ctest runs each test with OMP_NUM_THREADS=1).
struct Threads {
  int before = at::get_num_threads();
  explicit Threads(int n) { at::set_num_threads(n); }
  ~Threads() { at::set_num_threads(before); }
};

TEST(AdamwStep, MatchesTorchAdamW) {
  Threads threads(3);  // the largest size splits into 3 tasks of grain + 6: ranges not a multiple of 8
  for (const int64_t n : kSizes) {
    SCOPED_TRACE("n = " + std::to_string(n));
    const Problem pr = make_problem(n, 1000 + n);
    const auto expected = torch_adamw(pr, at::kCPU);
    const auto actual = rlt_adamw(pr, at::kCPU);
    for (int t = 0; t < kSteps; ++t) {
      SCOPED_TRACE("step " + std::to_string(t + 1));
      EXPECT_LE(worst_error(actual[t], expected[t], pr, t), kRelTol);
      EXPECT_LE(elementwise_error(actual[t].p, expected[t].p, hyper(1).lr), kRelTol);
    }
    std::cout << "n " << n << ": error " << worst_error(actual.back(), expected.back(), pr, kSteps - 1)
              << ", elements unlike torch's after " << kSteps << " steps: p "
              << count_different(actual.back().p, expected.back().p) << ", m "
              << count_different(actual.back().m, expected.back().m) << ", v "
              << count_different(actual.back().v, expected.back().v) << "\n";
    // The twins, held to the same check against torch's states.
    if (n < 7) continue;
    for (const auto& [bug, name] : kTwins) {
      const double error = worst_error(reference_adamw(pr, bug).back(), expected.back(), pr, kSteps - 1);
      EXPECT_GT(error, kRelTol) << "the check accepts: " << name;
      std::cout << "  twin '" << name << "': error " << error << "\n";
    }
  }
}

TEST(AdamwStep, MatchesFloat64Loop) {
  Threads threads(3);
  for (const int64_t n : kSizes) {
    SCOPED_TRACE("n = " + std::to_string(n));
    const Problem pr = make_problem(n, 2000 + n);
    const auto expected = reference_adamw(pr, Bug::kNone);
    const auto actual = rlt_adamw(pr, at::kCPU);
    double worst = 0;
    for (int t = 0; t < kSteps; ++t) worst = std::max(worst, worst_error(actual[t], expected[t], pr, t));
    EXPECT_LE(worst, kRelTol);
    std::cout << "n " << n << ": worst error against float64 " << worst << "\n";
    if (n < 7) continue;
    for (const auto& [bug, name] : kTwins) {
      const auto twin = reference_adamw(pr, bug);
      EXPECT_GT(worst_error(twin.back(), expected.back(), pr, kSteps - 1), kRelTol) << "the check accepts: " << name;
    }
  }
}

// Each step of the sequence reads only its own inputs: stepping the whole slice equals stepping any split
// of it (the sharded optimizer steps a rank's slice).
TEST(AdamwStep, SlicesStepIndependently) {
  const Problem pr = make_problem(1031, 7);
  at::Tensor p = pr.p0.clone(), m = at::zeros_like(p), v = at::zeros_like(p);
  at::Tensor ps = pr.p0.clone(), ms = at::zeros_like(p), vs = at::zeros_like(p);
  for (int t = 0; t < kSteps; ++t) {
    adamw_step(p, pr.grads[t], m, v, hyper(t + 1));
    for (auto [b, len] : {std::pair<int64_t, int64_t>{0, 500}, {500, 531}})
      adamw_step(ps.narrow(0, b, len), pr.grads[t].narrow(0, b, len), ms.narrow(0, b, len), vs.narrow(0, b, len),
                 hyper(t + 1));
  }
  EXPECT_TRUE(at::equal(p, ps) && at::equal(m, ms) && at::equal(v, vs));
}

// The message of the c10::Error `f` throws ("" when it throws none).
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

// A model's list of tensors for adamw_step_tensors, at rounds of kRound elements: tensors cut into slices
// (2,500 into three, 1,031 into two) and rounds that end inside a list, after a whole tensor, or hold one
// slice.
constexpr int64_t kRound = 1000;
const std::vector<std::vector<int64_t>> kShapes = {{3}, {7, 11}, {1031}, {50, 50}, {1}, {999}, {2}};

std::vector<Problem> make_list_problem(uint64_t seed) {
  std::vector<Problem> out;
  for (size_t i = 0; i < kShapes.size(); ++i) {
    int64_t n = 1;
    for (int64_t d : kShapes[i]) n *= d;
    out.push_back(make_problem(n, seed + i));
  }
  return out;
}

using ListStates = std::vector<std::vector<State>>;  // [step][tensor]

// torch::optim::AdamW over the list (one group) on `device` in `dtype`: the states after each step.
ListStates torch_adamw_list(const std::vector<Problem>& pr, at::Device device, at::ScalarType dtype) {
  const AdamWStep s = hyper(1);
  std::vector<at::Tensor> params;
  for (size_t i = 0; i < pr.size(); ++i) params.push_back(pr[i].p0.to(device, dtype).reshape(kShapes[i]).clone());
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(s.lr)
                                      .betas({s.beta1, s.beta2})
                                      .eps(s.eps)
                                      .weight_decay(s.weight_decay)
                                      .amsgrad(false));
  ListStates out;
  for (int t = 0; t < kSteps; ++t) {
    for (size_t i = 0; i < pr.size(); ++i)
      params[i].mutable_grad() = pr[i].grads[t].to(device, dtype).reshape(kShapes[i]);
    opt.step();
    out.emplace_back();
    for (const at::Tensor& p : params) {
      auto& st = static_cast<torch::optim::AdamWParamState&>(*opt.state().at(p.unsafeGetTensorImpl()));
      out.back().push_back({p.flatten().clone(), st.exp_avg().flatten().clone(), st.exp_avg_sq().flatten().clone()});
    }
  }
  return out;
}

ListStates rlt_adamw_list(const std::vector<Problem>& pr, at::Device device, at::ScalarType dtype,
                          AdamWTensorsFault fault = AdamWTensorsFault::kNone) {
  AdamWTensors ts;
  for (size_t i = 0; i < pr.size(); ++i) {
    ts.params.push_back(pr[i].p0.to(device, dtype).reshape(kShapes[i]).clone());
    ts.exp_avgs.push_back(at::zeros_like(ts.params.back()));
    ts.exp_avg_sqs.push_back(at::zeros_like(ts.params.back()));
  }
  ListStates out;
  for (int t = 0; t < kSteps; ++t) {
    ts.grads.clear();
    for (size_t i = 0; i < pr.size(); ++i) ts.grads.push_back(pr[i].grads[t].to(device, dtype).reshape(kShapes[i]));
    adamw_step_tensors(ts, hyper(t + 1), kRound, fault);
    out.emplace_back();
    for (size_t i = 0; i < pr.size(); ++i)
      out.back().push_back(
          {ts.params[i].flatten().clone(), ts.exp_avgs[i].flatten().clone(), ts.exp_avg_sqs[i].flatten().clone()});
  }
  return out;
}

// Elements of the list's states (weights, both moments) that differ between a and b at step t.
int64_t list_different(const ListStates& a, const ListStates& b, int t) {
  int64_t n = 0;
  for (size_t i = 0; i < a[t].size(); ++i)
    n += count_different(a[t][i].p, b[t][i].p) + count_different(a[t][i].m, b[t][i].m) +
         count_different(a[t][i].v, b[t][i].v);
  return n;
}

// The multi-tensor step against torch::optim::AdamW over the same list: bit for bit at every step, and in
// fp32 within kRelTol of the float64 loop; the faults (a round's last slice dropped, a cut tensor's slices
// all reading its first gradient slice) differ from torch's.
void check_adamw_list(at::Device device, at::ScalarType dtype) {
  const std::vector<Problem> pr = make_list_problem(dtype == at::kFloat ? 5000 : 6000);
  const ListStates expected = torch_adamw_list(pr, device, dtype);
  const ListStates actual = rlt_adamw_list(pr, device, dtype);
  for (int t = 0; t < kSteps; ++t) EXPECT_EQ(list_different(actual, expected, t), 0) << "step " << t + 1;
  if (dtype == at::kFloat) {
    double worst = 0;
    for (size_t i = 0; i < pr.size(); ++i) {
      const auto reference = reference_adamw(pr[i], Bug::kNone);
      for (int t = 0; t < kSteps; ++t) worst = std::max(worst, worst_error(actual[t][i], reference[t], pr[i], t));
    }
    EXPECT_LE(worst, kRelTol);
    std::cout << c10::toString(dtype) << " on " << device << ": worst error against float64 " << worst << "\n";
  }
  for (const auto& [fault, name] : {std::pair{AdamWTensorsFault::kSkipRoundTail, "a round's last slice dropped"},
                                    {AdamWTensorsFault::kSliceOffsetIgnored, "slices read the first gradient slice"}}) {
    const int64_t different = list_different(rlt_adamw_list(pr, device, dtype, fault), expected, kSteps - 1);
    EXPECT_GT(different, 0) << "the check accepts: " << name;
    std::cout << "  twin '" << name << "': " << different << " elements differ\n";
  }
}

TEST(AdamwStepTensors, EqualsTorchAdamWOverAList) { check_adamw_list(at::kCPU, at::kFloat); }

// clip_grad_norm_tensors against torch::nn::utils::clip_grad_norm_ on copies of the same gradients, with
// the clip active (max_norm below the norm) and not: the norm, and every gradient after it. `exact`: bit
// for bit (the CPU, where both take ATen's per-tensor norm); else within 1e-6 relative (CUDA's
// _foreach_norm reduces in its own order). The twins: the scale not clamped at 1, and the list's last
// gradient left unscaled.
void check_clip(at::Device device, bool exact) {
  const std::vector<Problem> pr = make_list_problem(7000);
  for (const double max_norm : {0.5, 1e6}) {
    SCOPED_TRACE("max_norm " + std::to_string(max_norm));
    std::vector<at::Tensor> ours, theirs, twin_unclamped, twin_last;
    for (size_t i = 0; i < pr.size(); ++i) {
      const at::Tensor g = pr[i].grads[0].to(device).reshape(kShapes[i]);
      ours.push_back(g.clone());
      twin_unclamped.push_back(g.clone());
      twin_last.push_back(g.clone());
      theirs.push_back(at::zeros_like(g));
      theirs.back().mutable_grad() = g.clone();
    }
    const double norm = clip_grad_norm_tensors(ours, max_norm);
    const double expected = torch::nn::utils::clip_grad_norm_(theirs, max_norm);
    EXPECT_GT(norm, 0.5);  // the clip at 0.5 scales every gradient down
    double worst = std::abs(norm - expected) / expected;
    for (size_t i = 0; i < ours.size(); ++i) {
      const at::Tensor& g = theirs[i].grad();
      if (exact) {
        EXPECT_TRUE(at::equal(ours[i], g)) << "tensor " << i;
      }
      worst = std::max(worst, ((ours[i] - g).abs().max() / g.abs().max()).item<double>());
    }
    if (exact) {
      EXPECT_EQ(norm, expected);
    }
    EXPECT_LE(worst, 1e-6);
    std::cout << device << ", max_norm " << max_norm << ": norm " << norm << " (torch " << expected
              << "), worst relative difference " << worst << "\n";
    // Twins, each compared with torch's gradients.
    for (at::Tensor& g : twin_unclamped) g.mul_(max_norm / (norm + 1e-6));
    const at::Tensor last = twin_last.back().clone();
    clip_grad_norm_tensors(twin_last, max_norm);
    twin_last.back().copy_(last);
    auto largest_difference = [&](const std::vector<at::Tensor>& twin) {
      double d = 0;
      for (size_t i = 0; i < twin.size(); ++i)
        d = std::max(d, ((twin[i] - theirs[i].grad()).abs().max() / theirs[i].grad().abs().max()).item<double>());
      return d;
    };
    if (max_norm > norm) {  // the scale is 1: unclamped, it would scale every gradient up
      EXPECT_GT(largest_difference(twin_unclamped), 1e-6) << "the check accepts an unclamped scale";
    } else {
      EXPECT_GT(largest_difference(twin_last), 1e-6) << "the check accepts an unscaled gradient";
    }
  }
}

TEST(AdamwStepTensors, ClipMatchesTorchClipGradNorm) { check_clip(at::kCPU, /*exact=*/true); }

TEST(AdamwStepTensors, RejectsBadInput) {
  AdamWTensors ts{{at::zeros({8})}, {at::zeros({8})}, {at::zeros({8})}, {at::zeros({8})}};
  AdamWTensors fewer = ts;
  fewer.grads.clear();
  EXPECT_NE(error_of([&] { adamw_step_tensors(fewer, hyper(1)); }).find("1 params, 0 grads"), std::string::npos);
  AdamWTensors shape = ts;
  shape.exp_avgs[0] = at::zeros({4, 2});
  EXPECT_NE(error_of([&] { adamw_step_tensors(shape, hyper(1)); }).find("of its shape [8]"), std::string::npos);
  AdamWTensors mixed = ts;
  mixed.params.push_back(at::zeros({2}, at::kDouble));
  for (auto* l : {&mixed.grads, &mixed.exp_avgs, &mixed.exp_avg_sqs}) l->push_back(at::zeros({2}, at::kDouble));
  EXPECT_NE(error_of([&] { adamw_step_tensors(mixed, hyper(1)); }).find("param 1 is Double"), std::string::npos);
  EXPECT_NE(error_of([&] { adamw_step_tensors(ts, hyper(1), 0); }).find("round_elems must be >= 1"), std::string::npos);
}

TEST(AdamwStep, RejectsBadInput) {
  at::Tensor p = at::zeros({8}), g = at::zeros({8}), m = at::zeros({8}), v = at::zeros({8});
  EXPECT_NE(error_of([&] { adamw_step(p, at::zeros({7}), m, v, hyper(1)); }).find("grad has 7 elements"),
            std::string::npos);
  EXPECT_NE(error_of([&] { adamw_step(p.to(at::kBFloat16), g, m, v, hyper(1)); }).find("param must be fp32"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              adamw_step(p, g, at::zeros({16}).slice(0, 0, 16, 2), v, hyper(1));
            }).find("exp_avg must be contiguous"),
            std::string::npos);
  EXPECT_NE(error_of([&] { adamw_step(p, g, m, v, hyper(0)); }).find("step must be >= 1"), std::string::npos);
  AdamWStep bad = hyper(1);
  bad.beta2 = 1.0;
  EXPECT_NE(error_of([&] { adamw_step(p, g, m, v, bad); }).find("beta2 must be in [0, 1)"), std::string::npos);
  OffloadedAdamW off(p, {OffloadMode::kStreamDevice, 4});
  EXPECT_NE(error_of([&] { off.step(g, hyper(1), at::zeros({8})); }).find("kStreamDevice needs grad and out on a CUDA"),
            std::string::npos);
  OffloadedAdamW host(p);
  EXPECT_NE(
      error_of([&] { host.step(g, hyper(1), at::zeros({8}, at::kDouble)); }).find("out must be fp32, bf16 or fp16"),
      std::string::npos);
  EXPECT_NE(
      error_of([&] { host.step(at::zeros({9}), hyper(1), at::zeros({8})); }).find("grad must be a contiguous fp32"),
      std::string::npos);
}

// bf16 by truncation (dropping the low 16 bits): the rounding twin the weights check must reject.
at::Tensor truncate_to_bf16(const at::Tensor& x) {
  const at::Tensor bits = x.contiguous().view(at::kInt).bitwise_and(int32_t(0xFFFF0000));
  return bits.view(at::kFloat).to(at::kBFloat16);
}

// OffloadedAdamW over kSteps against adamw_step on the same slice: the host state bit for bit, and `out`
// (on out_device, out_dtype) the masters rounded to out_dtype. grad_device: where the gradient lives.
void check_offload(OffloadOptions options, at::Device grad_device, at::Device out_device, at::ScalarType out_dtype,
                   int64_t n, at::Device reference_device) {
  const Problem pr = make_problem(n, 3000 + n);
  OffloadedAdamW off(pr.p0.to(grad_device), options);
  EXPECT_EQ(off.master().device(), at::Device(at::kCPU));
  EXPECT_EQ(off.master().is_pinned(), at::hasCUDA());
  EXPECT_EQ(off.host_bytes(), 12 * n);  // nothing staged before the first step
  at::Tensor p = pr.p0.to(reference_device).clone(), m = at::zeros_like(p), v = at::zeros_like(p);
  at::Tensor out = at::full({n}, 7.0, at::TensorOptions().dtype(out_dtype).device(out_device));
  for (int t = 0; t < kSteps; ++t) {
    SCOPED_TRACE("step " + std::to_string(t + 1));
    const at::Tensor before = off.master().to(out_dtype).clone();
    off.step(pr.grads[t].to(grad_device), hyper(t + 1), out);
    adamw_step(p, pr.grads[t].to(reference_device), m, v, hyper(t + 1));
    EXPECT_TRUE(at::equal(off.master(), p.cpu()));
    EXPECT_TRUE(at::equal(off.exp_avg(), m.cpu()));
    EXPECT_TRUE(at::equal(off.exp_avg_sq(), v.cpu()));
    const at::Tensor weights = out.cpu();
    EXPECT_TRUE(at::equal(weights, off.master().to(out_dtype)));
    EXPECT_FALSE(at::equal(weights, before)) << "the check accepts the weights of the step before";
    if (out_dtype == at::kBFloat16) {
      EXPECT_FALSE(at::equal(weights, truncate_to_bf16(off.master()))) << "the check accepts truncation";
    }
  }
}

TEST(OffloadedAdamW, HostStepOnCpuEqualsAdamwStep) {
  Threads threads(2);
  // 11 chunks of 100, the last of 31; then one chunk spanning several parallel tasks.
  for (const at::ScalarType dtype : {at::kBFloat16, at::kFloat, at::kHalf}) {
    SCOPED_TRACE(std::string("out ") + c10::toString(dtype));
    check_offload({OffloadMode::kHostStep, 100}, at::kCPU, at::kCPU, dtype, 1031, at::kCPU);
  }
  check_offload({OffloadMode::kHostStep, int64_t(1) << 20}, at::kCPU, at::kCPU, at::kBFloat16, 3 * kAdamWCpuGrain + 17,
                at::kCPU);
}

// The kernel's bf16 rounding against c10's on the values where rounding is delicate: ties to even,
// the largest finite values (rounding up to Inf), Inf, NaN, subnormals, signed zeros.
TEST(OffloadedAdamW, Bf16RoundingMatchesC10) {
  std::vector<uint32_t> bits = {0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x7F7FFFFF, 0x7F7F8000,
                                0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0x00000001, 0x00008000,
                                0x00018000, 0x80000000, 0x00000000, 0xBF808000};
  for (uint32_t i = 0; i < 4096; ++i) bits.push_back(0x3F800000u + i * 0x1111u);
  std::vector<float> values(bits.size());
  std::memcpy(values.data(), bits.data(), bits.size() * sizeof(float));
  const int64_t n = int64_t(values.size());
  const at::Tensor target = at::tensor(values);
  // Zero gradient, lr 0: the step leaves every master as it is, so out is the masters' rounding alone.
  AdamWStep s = hyper(1);
  s.lr = 0;
  OffloadedAdamW off(target);
  at::Tensor out = at::zeros({n}, at::kBFloat16);
  off.step(at::zeros({n}), s, out);
  const at::Tensor expected = target.to(at::kBFloat16);
  // NaN's bits differ between ATen's own conversions (0x7FC0 scalar, 0xFFFF vectorised): NaN stays NaN,
  // every other value is compared bit for bit.
  const at::Tensor nan = target.isnan();
  EXPECT_TRUE(at::equal(out.isnan(), nan));
  EXPECT_TRUE(at::equal(out.view(at::kShort).masked_select(~nan), expected.view(at::kShort).masked_select(~nan)));
  EXPECT_FALSE(at::equal(truncate_to_bf16(target).view(at::kShort).masked_select(~nan),
                         expected.view(at::kShort).masked_select(~nan)));
}

bool has_cuda() { return at::hasCUDA(); }

TEST(AdamwStepCuda, EqualsTorchAdamWOnCuda) {
  if (!has_cuda()) GTEST_SKIP() << "no CUDA device";
  for (const int64_t n : kSizes) {
    SCOPED_TRACE("n = " + std::to_string(n));
    const Problem pr = make_problem(n, 4000 + n);
    const auto expected = torch_adamw(pr, at::kCUDA);
    const auto actual = rlt_adamw(pr, at::kCUDA);
    const auto reference = reference_adamw(pr, Bug::kNone);
    double worst = 0;
    for (int t = 0; t < kSteps; ++t) {
      SCOPED_TRACE("step " + std::to_string(t + 1));
      // The same ATen ops in the same order: bit for bit.
      EXPECT_TRUE(at::equal(actual[t].p, expected[t].p));
      EXPECT_TRUE(at::equal(actual[t].m, expected[t].m));
      EXPECT_TRUE(at::equal(actual[t].v, expected[t].v));
      worst = std::max(worst, worst_error(actual[t], reference[t], pr, t));
    }
    EXPECT_LE(worst, kRelTol);
    std::cout << "n " << n << ": worst error against float64 " << worst << "\n";
    if (n < 7) continue;
    for (const auto& [bug, name] : kTwins) {
      EXPECT_GT(worst_error(reference_adamw(pr, bug).back(), actual.back(), pr, kSteps - 1), kRelTol)
          << "the check accepts: " << name;
    }
  }
}

TEST(AdamwStepTensorsCuda, EqualsTorchAdamWOverAListOnCuda) {
  if (!has_cuda()) GTEST_SKIP() << "no CUDA device";
  check_adamw_list(at::kCUDA, at::kFloat);
  check_adamw_list(at::kCUDA, at::kBFloat16);
}

TEST(AdamwStepTensorsCuda, ClipMatchesTorchClipGradNormOnCuda) {
  if (!has_cuda()) GTEST_SKIP() << "no CUDA device";
  check_clip(at::kCUDA, /*exact=*/false);
}

TEST(OffloadedAdamWCuda, HostStepEqualsAdamwStepOnCpu) {
  if (!has_cuda()) GTEST_SKIP() << "no CUDA device";
  // 11 chunks of 1000 and a tail of 7: the staging halves are each reused five times.
  for (const at::ScalarType dtype : {at::kBFloat16, at::kFloat, at::kHalf}) {
    SCOPED_TRACE(std::string("out ") + c10::toString(dtype));
    check_offload({OffloadMode::kHostStep, 1000}, at::kCUDA, at::kCUDA, dtype, 11007, at::kCPU);
  }
  // Gradient on the device, weights on the host, and the reverse.
  check_offload({OffloadMode::kHostStep, 1000}, at::kCUDA, at::kCPU, at::kBFloat16, 11007, at::kCPU);
  check_offload({OffloadMode::kHostStep, 1000}, at::kCPU, at::kCUDA, at::kBFloat16, 11007, at::kCPU);
}

// The weights reach the device on a side stream, which must wait for the caller's stream: its kernels may
// still write or read them. Here a fill of `out` waits behind a ~25 ms sleep on the caller's stream when the
// second step starts, with the gradient on the host (no gradient copy to order the upload) and the pinned
// staging made by the first step (pinning memory would synchronise the device). Without that wait the
// step's weights land first and the fill overwrites them with 7s.
TEST(OffloadedAdamWCuda, WeightsWaitForTheCallersStream) {
  if (!has_cuda()) GTEST_SKIP() << "no CUDA device";
#ifdef RLT_HAVE_CUDA
  const int64_t n = 4096;
  const Problem pr = make_problem(n, 77);
  OffloadedAdamW off(pr.p0, {OffloadMode::kHostStep, 1000});
  at::Tensor out = at::empty({n}, at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA));
  off.step(pr.grads[0], hyper(1), out);
  at::cuda::sleep(int64_t(50) * 1000 * 1000);  // clock cycles on the caller's stream
  out.fill_(7.0);
  off.step(pr.grads[1], hyper(2), out);
  EXPECT_TRUE(at::equal(out.cpu(), off.master().to(at::kBFloat16)));
#endif
}

TEST(OffloadedAdamWCuda, StreamThroughDeviceEqualsAdamwStepOnCuda) {
  if (!has_cuda()) GTEST_SKIP() << "no CUDA device";
  // 11 chunks of 1000 and a tail of 7 through 3 slots: each slot is reused four times.
  for (const at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
    SCOPED_TRACE(std::string("out ") + c10::toString(dtype));
    check_offload({OffloadMode::kStreamDevice, 1000}, at::kCUDA, at::kCUDA, dtype, 11007, at::kCUDA);
  }
}

}  // namespace
}  // namespace rlt
