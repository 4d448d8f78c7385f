// Cut Cross-Entropy and the hidden-state paths against float64 naive on hidden @ W^T: forward and
// backward (dE, dW) for any per-token upstream gradient, entropy, temperature, ragged blocks, bf16
// with fp32 accumulation; gradient filtering bounded by its threshold; float64 gradcheck.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "loss/cce.h"
#include "loss/logprob.h"
#ifdef RLT_HAVE_CUDA
#include <ATen/cuda/CUDAContext.h>

#include "loss/cuda/cce_fused.h"
#endif
#include "tests/common/check.h"
#include "tests/common/gradcheck.h"

namespace rlt {
namespace {

// fp32 accumulation of D = 29 products and an lse over V = 1013: ~1e-6; 1e-5 leaves headroom.
constexpr double kLogprobAtol = 1e-5;
// fp32 inputs: dE, dW are sums of O(1) terms over V (resp. N) in fp32: ~1e-6 relative.
constexpr double kGradAtolFp32 = 1e-5, kGradRtolFp32 = 1e-4;
// bf16 inputs: the block gradient dz enters the GEMMs rounded to bf16, each product term off by up to
// 2^-9 relative, so dE = dz W is off by up to 2^-9 (|dz| |W|) elementwise (dW likewise with |dz|^T |E|),
// and the result is stored in bf16 (half an ulp, <= 2^-8 relative). Tolerance: twice the first bound
// (computed per element from the float64 reference) + 2^-8 relative + a 1e-6 floor.
constexpr double kGemmRoundingBf16 = 2.0 / 512, kGradRtolBf16 = 1.0 / 256, kGradFloorBf16 = 1e-6;

struct Lm {
  at::Tensor E, W, y;  // (N, D), (V, D), (N)
};

// LM-like: the target logit ~ `peak` above a N(0, 1) background (W rows have unit norm on average).
Lm make_lm(int64_t N, int64_t V, int64_t D, at::ScalarType dt, uint64_t seed, at::Device dev = at::kCPU,
           double peak = 6.0) {
  at::manual_seed(seed);
  at::Tensor W = at::randn({V, D}, at::kDouble) / std::sqrt(double(D));
  at::Tensor y = at::randint(0, V, {N}, at::kLong);
  at::Tensor E = at::randn({N, D}, at::kDouble) + peak * W.index_select(0, y);
  return {E.to(dt).to(dev), W.to(dt).to(dev), y.to(dev)};
}

struct Grads {
  at::Tensor lp, H, dE, dW;
  at::Tensor bound_dE, bound_dW;  // reference only: |dZ| |W| and |dZ|^T |E|, Z = E W^T
};

std::pair<at::Tensor, at::Tensor> upstream(int64_t N) {
  at::manual_seed(4242);
  return {at::randn({N}, at::kDouble), at::randn({N}, at::kDouble)};
}

// float64 naive on the same values (logits soft-capped when cap > 0).
Grads reference(const Lm& lm, double temp, bool entropy_grad, double cap = 0.0) {
  at::Tensor E = lm.E.detach().cpu().to(at::kDouble).requires_grad_(true);
  at::Tensor W = lm.W.detach().cpu().to(at::kDouble).requires_grad_(true);
  at::Tensor Z = at::mm(E, W.t());
  auto [lp, H] = naive_logprobs(cap > 0 ? at::tanh(Z / cap) * cap : Z, lm.y.cpu(), temp, true);
  auto [u1, u2] = upstream(E.size(0));
  at::Tensor loss = (u1 * lp).sum();
  if (entropy_grad) loss = loss + (u2 * H).sum();
  auto g = torch::autograd::grad({loss}, {E, W, Z});
  at::Tensor dZ = g[2].abs();
  return {lp.detach(), H.detach(), g[0], g[1], at::mm(dZ, W.detach().abs()), at::mm(dZ.t(), E.detach().abs())};
}

Grads run(const Lm& lm, const LossOptions& o, double cap = 0.0) {
  at::Tensor E = lm.E.detach().clone().requires_grad_(true), W = lm.W.detach().clone().requires_grad_(true);
  LogprobInputs in;
  in.hidden = E;
  in.lm_head = W;
  in.targets = lm.y;
  in.logit_softcap = cap;
  LogprobOutput out = token_logprobs(in, o);
  auto [u1, u2] = upstream(E.size(0));
  at::Tensor loss = (u1.to(out.logprobs.options()) * out.logprobs).sum();
  if (o.entropy == EntropyMode::kGrad) loss = loss + (u2.to(out.entropy.options()) * out.entropy).sum();
  auto g = torch::autograd::grad({loss}, {E, W});
  return {out.logprobs.detach(), out.entropy.defined() ? out.entropy.detach() : at::Tensor(), g[0], g[1]};
}

// with_wrong: also run the wrong implementations (once per dtype and tolerance is enough; they cost
// three more passes).
void expect_matches(const Lm& lm, const LossOptions& o, const std::string& what, double cap = 0.0,
                    bool with_wrong = true) {
  SCOPED_TRACE(what);
  const bool half = lm.E.scalar_type() == at::kBFloat16 || lm.E.scalar_type() == at::kHalf;
  Grads r = reference(lm, o.temperature, o.entropy == EntropyMode::kGrad, cap);
  Grads g = run(lm, o, cap);
  EXPECT_EQ(g.lp.scalar_type(), at::kFloat);
  const at::Tensor dE_atol = half ? r.bound_dE * kGemmRoundingBf16 + kGradFloorBf16 : at::scalar_tensor(kGradAtolFp32);
  const at::Tensor dW_atol = half ? r.bound_dW * kGemmRoundingBf16 + kGradFloorBf16 : at::scalar_tensor(kGradAtolFp32);
  const double g_rtol = half ? kGradRtolBf16 : kGradRtolFp32;
  RLT_EXPECT_CLOSE(g.lp, r.lp, kLogprobAtol, 0.0, what + " logprobs");
  if (o.entropy != EntropyMode::kNone) {
    RLT_EXPECT_CLOSE(g.H, r.H, kLogprobAtol, 0.0, what + " entropy");
  }
  RLT_EXPECT_CLOSE(g.dE, r.dE, dE_atol, g_rtol, what + " dE");
  RLT_EXPECT_CLOSE(g.dW, r.dW, dW_atol, g_rtol, what + " dW");
  if (!with_wrong) return;
  // Wrong implementations each tolerance must reject: an off-by-one target (log-probs, dE, dW), an
  // off-by-one row (entropy), a missing temperature, a missing softcap.
  using rlt::testing::rejects;
  const int64_t V = lm.W.size(0);
  const Grads off_target = run({lm.E, lm.W, (lm.y + 1).remainder(V)}, o, cap);
  EXPECT_TRUE(rejects(off_target.lp, r.lp, kLogprobAtol, 0.0, what + " logprobs", "target y + 1"));
  EXPECT_TRUE(rejects(off_target.dE, r.dE, dE_atol, g_rtol, what + " dE", "target y + 1"));
  EXPECT_TRUE(rejects(off_target.dW, r.dW, dW_atol, g_rtol, what + " dW", "target y + 1"));
  if (o.entropy != EntropyMode::kNone) {
    const Grads off_row = run({lm.E.roll(/*shifts=*/-1, /*dims=*/0), lm.W, lm.y}, o, cap);
    EXPECT_TRUE(rejects(off_row.H, r.H, kLogprobAtol, 0.0, what + " entropy", "row n + 1"));
  }
  if (o.temperature != 1.0) {
    LossOptions no_temp = o;
    no_temp.temperature = 1.0;
    EXPECT_TRUE(rejects(run(lm, no_temp, cap).lp, r.lp, kLogprobAtol, 0.0, what, "temperature ignored"));
  }
  if (cap > 0) {
    EXPECT_TRUE(rejects(run(lm, o, 0.0).lp, r.lp, kLogprobAtol, 0.0, what, "softcap ignored"));
  }
}

TEST(Cce, MatchesFloat64NaiveOnOddShapes) {
  const int64_t N = 37, V = 1013, D = 29;
  for (auto dt : {at::kFloat, at::kBFloat16}) {
    const Lm lm = make_lm(N, V, D, dt, 1);
    for (auto ent : {EntropyMode::kNone, EntropyMode::kValue, EntropyMode::kGrad}) {
      for (auto [rb, vb] : {std::pair<int64_t, int64_t>{0, 0}, {8, 100}, {37, 1013}, {5, 1}}) {
        for (double temp : {1.0, 0.7}) {
          LossOptions o;
          o.impl = LogprobImpl::kCce;
          o.response_only = false;
          o.entropy = ent;
          o.chunk_size = rb;
          o.vocab_chunk_size = vb;
          o.temperature = temp;
          o.grad_filter = false;
          std::ostringstream os;
          os << "cce " << dt << " entropy=" << enum_to_string(ent) << " blocks=" << rb << "x" << vb << " temp=" << temp;
          // The wrong implementations once per dtype, entropy mode and temperature, on the first blocks.
          expect_matches(lm, o, os.str(), 0.0, /*with_wrong=*/rb == 0);
        }
      }
    }
  }
}

// gemma2's final-logit softcap, on every hidden-state path: logits = cap tanh(z / cap). Cap 5 against
// target logits near 6 changes the distribution, so a missing or misplaced cap fails the tolerances.
TEST(Cce, FinalLogitSoftcapOnEveryHiddenStatePath) {
  for (auto dt : {at::kFloat, at::kBFloat16}) {
    const Lm lm = make_lm(37, 1013, 29, dt, 11);
    for (auto impl : {LogprobImpl::kNaive, LogprobImpl::kSelective, LogprobImpl::kCce}) {
      LossOptions o;
      o.impl = impl;
      o.response_only = false;
      o.entropy = EntropyMode::kGrad;
      o.temperature = 0.7;
      o.chunk_size = 8;
      o.vocab_chunk_size = 100;
      o.grad_filter = false;
      std::ostringstream os;
      os << "softcap " << enum_to_string(impl) << " " << dt;
      expect_matches(lm, o, os.str(), /*cap=*/5.0);
    }
  }
  // The cap matters here: without it the log-probs are far from the capped reference.
  const Lm lm = make_lm(37, 1013, 29, at::kFloat, 11);
  LossOptions o;
  o.impl = LogprobImpl::kCce;
  o.response_only = false;
  EXPECT_FALSE(rlt::testing::close(run(lm, o, 0.0).lp, reference(lm, 1.0, false, 5.0).lp, kLogprobAtol, 0.0, "no cap"));
}

TEST(Cce, HiddenStatePathsOfNaiveAndSelectiveMatchToo) {
  const Lm lm = make_lm(37, 1013, 29, at::kFloat, 2);
  for (auto impl : {LogprobImpl::kNaive, LogprobImpl::kSelective}) {
    LossOptions o;
    o.impl = impl;
    o.response_only = false;
    o.entropy = EntropyMode::kGrad;
    o.chunk_size = 7;
    expect_matches(lm, o, std::string("hidden ") + enum_to_string(impl));
  }
}

// The bound gradient filtering must keep (seed 002, sec. 4.3). A block (on the fused path: a 64-row x
// 256-entry tile of one) is skipped only when every softmax entry p_nv in it is below eps, and skipping drops
// only its softmax part -u1_n p_nv / temp of dz_nv (the target term is added on its own; the fused path keeps
// every tile holding a target; no entropy gradient here). So, elementwise, with the
// float64 softmax p:
//   |dE_filtered - dE|[n, d] <= |u1_n| sum_{v: p_nv < eps} p_nv |W_vd|
//   |dW_filtered - dW|[v, d] <= sum_{n: p_nv < eps} |u1_n| p_nv |E_nd|
// (not eps * V * max|u1| max|W|, which is several units against O(1) gradients). With eps = 2^-12 each
// dropped term is below 2^-12 |u1| |W|: under the 2^-8 relative resolution of a bf16 gradient of the
// O(|u1| |W|) target term, which is the paper's argument for the threshold. Plus kGradAtolFp32 and
// kGradRtolFp32 for the fp32 arithmetic of the kept blocks.
struct FilterBound {
  at::Tensor dE, dW;  // (N, D), (V, D)
};
FilterBound filter_bound(const Lm& lm, double eps, const at::Tensor& u1) {
  const at::Tensor E = lm.E.detach().cpu().to(at::kDouble), W = lm.W.detach().cpu().to(at::kDouble);
  const at::Tensor p = at::softmax(at::mm(E, W.t()), 1);                          // (N, V)
  const at::Tensor dropped = at::where(p < eps, p, 0.0) * u1.abs().unsqueeze(1);  // (N, V)
  return {at::mm(dropped, W.abs()), at::mm(dropped.t(), E.abs())};
}

// dt bf16: against the same path unfiltered, whose dz takes the same roundings; both store dW in bf16, so an ulp
// (2^-7 relative) more. rows, entries: the block (rows 0 = automatic: on the fused path all
// rows, dW's block written straight by one GEMM). A block is skipped only when none of its rows x entries
// reaches eps: here about 8% of the non-target entries do, so blocks of 64 entries or fewer are needed.
// lm_in: other inputs than the default 16 x 1013 x 29 ones.
void check_filtering(at::Device dev, at::ScalarType dt = at::kFloat, int64_t rows = 4, int64_t entries = 16,
                     const Lm* lm_in = nullptr) {
  const Lm lm = lm_in ? *lm_in : make_lm(16, 1013, 29, dt, 3, dev, /*peak=*/12.0);  // p(other) ~ 1e-5 e^z
  const int64_t N = lm.E.size(0);
  // bf16: both runs store dW (and dE) rounded, half an ulp each, so values a filtered difference puts on either
  // side of a rounding boundary may land a whole ulp apart (2^-7 relative; seen on the fused path).
  const double rtol = dt == at::kFloat ? kGradRtolFp32 : 2 * kGradRtolBf16;
  LossOptions o;
  o.impl = LogprobImpl::kCce;
  o.response_only = false;
  o.chunk_size = rows;
  o.vocab_chunk_size = entries;
  o.grad_filter = false;
  Grads exact = run(lm, o);
  o.grad_filter = true;
  o.grad_filter_eps = 1.0 / 4096;
  Grads filt = run(lm, o);
  EXPECT_TRUE(at::equal(filt.lp, exact.lp)) << "filtering is backward-only";
  EXPECT_FALSE(at::equal(filt.dW, exact.dW) && at::equal(filt.dE, exact.dE)) << "this case must have filterable blocks";
  auto [u1, u2] = upstream(N);
  const FilterBound b = filter_bound(lm, o.grad_filter_eps, u1);
  const at::Tensor exact_dE = exact.dE.cpu().to(at::kDouble), exact_dW = exact.dW.cpu().to(at::kDouble);
  RLT_EXPECT_CLOSE(filt.dE, exact_dE, b.dE + kGradAtolFp32, rtol, "filtered dE");
  RLT_EXPECT_CLOSE(filt.dW, exact_dW, b.dW + kGradAtolFp32, rtol, "filtered dW");
  // The same code with a threshold nothing misses keeps every block (tile): it matches the unfiltered run within
  // rounding (on the fused path other GEMMs than cuBLAS's), and the filtered run must differ from it, so the
  // filter skipped something on the very kernels it runs on.
  const double eps = o.grad_filter_eps;
  o.grad_filter_eps = 1e-30;
  const Grads kept_all = run(lm, o);
  RLT_EXPECT_CLOSE(kept_all.dE, exact_dE, kGradAtolFp32, rtol, "every block kept dE");
  RLT_EXPECT_CLOSE(kept_all.dW, exact_dW, kGradAtolFp32, rtol, "every block kept dW");
  EXPECT_FALSE(at::equal(filt.dW, kept_all.dW) && at::equal(filt.dE, kept_all.dE)) << "the filter skipped nothing";
  o.grad_filter_eps = eps;
  // Wrong: a threshold of 1 skips every block's softmax part, the target's own p_y ~ 1 included; the
  // bound for 2^-12 must reject it.
  o.grad_filter_eps = 1.0;
  Grads all = run(lm, o);
  EXPECT_TRUE(rlt::testing::rejects(all.dE, exact_dE, b.dE + kGradAtolFp32, rtol, "filtered dE", "eps = 1"));
  EXPECT_TRUE(rlt::testing::rejects(all.dW, exact_dW, b.dW + kGradAtolFp32, rtol, "filtered dW", "eps = 1"));
  o.grad_filter_eps = 0.0;
  Grads none = run(lm, o);
  EXPECT_TRUE(at::equal(none.dW, exact.dW)) << "eps = 0 filters nothing";
}

TEST(Cce, GradientFilteringStaysWithinItsBound) { check_filtering(at::kCPU); }

TEST(CceCuda, GradientFilteringStaysWithinItsBound) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  check_filtering(at::Device(at::kCUDA, 0));
}

// Why a fused-kernel test cannot run here ("" when it can): no GPU, or one that is not sm_90. On an sm_90 GPU
// the kernels must have been built, so their absence fails the test instead of skipping it.
std::string fused_skip_reason() {
  if (!at::hasCUDA()) return "no CUDA device";
#ifdef RLT_HAVE_CUDA
  const auto* props = at::cuda::getDeviceProperties(0);
  if (props->major != 9 || props->minor != 0) return "the fused kernels are for sm_90 (H100/H200)";
  const bool built = cuda::cce_fused_available(at::empty({1}, at::TensorOptions(at::kCUDA).dtype(at::kBFloat16)));
  EXPECT_TRUE(built) << "built without CUTLASS's headers (pip install nvidia-cutlass==4.2.0.0): the fused "
                        "kernels are missing";
  return built ? "" : "the fused kernels are missing (a failure above)";
#else
  return "built without CUDA";
#endif
}

// Filtering on the fused path (bf16): blocks of 16 and 2 entries, far narrower than a 256-entry tile; with all
// 16 rows in one block, dW's blocks are written straight, or from the target term alone when skipped.
TEST(CceCuda, FusedGradientFilteringStaysWithinItsBound) {
  const std::string skip = fused_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
#ifdef RLT_HAVE_CUDA
  const at::Device dev(at::kCUDA, 0);
  for (auto [rows, entries] : {std::pair<int64_t, int64_t>{4, 16}, {0, 2}}) {
    SCOPED_TRACE("block " + std::to_string(rows) + " x " + std::to_string(entries));
    check_filtering(dev, at::kBFloat16, rows, entries);
  }
  // At the kernels' own sizes (64-row x 256-entry flags, 128-row tiles, default blocks). Rows 0-63 are unsure:
  // their top token (logit ~10 up) is not their target (a sampled token), ~350 entries a row reach 2^-12, every
  // tile of theirs is kept. Rows 64-299 are sharp (target logit ~20 up, nothing else reaches 2^-12) with targets
  // among the first 256 ids (frequent tokens), so only that column of their tiles is kept: a 128-row tile of dE
  // mixes a kept and a skipped flag row, and dW's k-blocks are kept for some rows of a column and not others.
  // (Emulated in float64 beforehand: a third of the tiles kept; eps = 1 drops the unsure rows' top tokens and is
  // rejected on dE and dW.)
  at::manual_seed(21);
  const int64_t N = 300, V = 4133, D = 136;
  at::Tensor W = at::randn({V, D}, at::kDouble) / std::sqrt(double(D));
  at::Tensor y = at::randint(0, V, {N}, at::kLong);
  y.narrow(0, 64, N - 64).remainder_(256);
  at::Tensor top = at::randint(0, V, {N}, at::kLong);
  top.narrow(0, 64, N - 64).copy_(y.narrow(0, 64, N - 64));
  at::Tensor peak = at::full({N, 1}, 20.0, at::kDouble);
  peak.narrow(0, 0, 64).fill_(10.0);
  at::Tensor E = at::randn({N, D}, at::kDouble) + peak * W.index_select(0, top);
  const Lm mixed{E.to(at::kBFloat16).to(dev), W.to(at::kBFloat16).to(dev), y.to(dev)};
  SCOPED_TRACE("mixed peaks, default blocks");
  check_filtering(dev, at::kBFloat16, 0, 0, &mixed);
#endif
}

#ifdef RLT_HAVE_CUDA
// cuda::cce_sparse_grads on its own: dE += g w and dW = g^T h (or += in fp32) over the flagged tiles only,
// against float64 on the same values with the unkept entries of g zeroed. Its contract, at the kernels' tiles:
// dW keeps exactly the flagged 64-row x 256-entry tiles; dE keeps an entry when either 64-row half of its
// 128-row tile is flagged in its 256-entry column. Stale stamps (stamp - 1) count as unflagged. Shapes cut every
// tile: n = 300 (flag rows 5, the last partial), k = 1500 (6 flag columns, g's rows padded to 1504), D = 200
// (two 192-wide output tiles, the second partial) and D = 29 (operands padded for TMA).
at::Tensor kept_mask(const at::Tensor& flags, int stamp, int64_t n, int64_t k, bool pair_rows) {
  at::Tensor f = flags.cpu().eq(stamp);  // (rows / 64, k / 256)
  if (pair_rows) {                       // a 128-row tile keeps a column when either half does
    if (f.size(0) % 2) f = at::cat({f, at::zeros({1, f.size(1)}, f.options())});
    f = f.view({-1, 2, f.size(1)}).any(1, /*keepdim=*/true).expand({-1, 2, f.size(1)}).reshape({-1, f.size(1)});
  }
  return f.repeat_interleave(64, 0).repeat_interleave(256, 1).narrow(0, 0, n).narrow(1, 0, k).to(at::kDouble);
}
#endif

// The backward epilogue's flags: a 64-row x 256-entry tile of g is flagged exactly when one of its rows has an
// entry with p >= eps there or its target. Against float64 on the same bf16 operands, per 64-row group and
// 256-entry column: tiles whose largest p lies within 1e-3 relative of eps may go either way (fp32 logits);
// every other tile must match. V = 1500 (a partial last column), both schedules, a stale stamp in place. Rows:
//   0-63: unsure (top token ~10 up, a random target): every tile kept;
//   64-299: sharp on their targets, among ids 512-767: column 2 only (a target in a later column of the block
//           must not flag the earlier ones);
//   but row 125 (warp 3 of its group, its second register row): sharp on a token among ids 0-255, its target
//           among ids 1024-1279 with p ~ 1e-9: it alone flags column 0 (by p) and column 4 (by its target) of
//           rows 64-127, so a vote that missed a warp or a register row would show.
TEST(CceCuda, BackwardFlagsMarkTheTilesToKeep) {
  const std::string skip = fused_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
#ifdef RLT_HAVE_CUDA
  const at::Device dev(at::kCUDA, 0);
  at::manual_seed(23);
  const int64_t N = 300, V = 1500, D = 136;
  const double eps = 1.0 / 4096;
  at::Tensor W = at::randn({V, D}, at::kDouble) / std::sqrt(double(D));
  at::Tensor y = at::randint(0, V, {N}, at::kLong);
  y.narrow(0, 64, N - 64).remainder_(256).add_(512);
  at::Tensor top = at::randint(0, V, {N}, at::kLong);
  top.narrow(0, 64, N - 64).copy_(y.narrow(0, 64, N - 64));
  y[125] = 1024 + 77, top[125] = 33;
  at::Tensor peak = at::full({N, 1}, 20.0, at::kDouble);
  peak.narrow(0, 0, 64).fill_(10.0);
  const at::Tensor E = (at::randn({N, D}, at::kDouble) + peak * W.index_select(0, top)).to(at::kBFloat16);
  const at::Tensor Wb = W.to(at::kBFloat16);
  const at::Tensor logits = at::mm(E.to(at::kDouble), Wb.to(at::kDouble).t());
  const at::Tensor lse = logits.logsumexp(1), p = at::softmax(logits, 1);
  // Per tile: the largest p, and whether a target lies in it.
  const int64_t R = (N + 63) / 64, C = (V + 255) / 256;
  auto per_tile = [&](const at::Tensor& x) {  // (N, V) -> (R, C) max, zero-padded
    return at::constant_pad_nd(x, {0, C * 256 - V, 0, R * 64 - N}).view({R, 64, C, 256}).amax({1, 3});
  };
  const at::Tensor pmax = per_tile(p);
  const at::Tensor has_target = per_tile(at::zeros({N, V}, at::kDouble).scatter_(1, y.unsqueeze(1), 1.0)).gt(0);
  const at::Tensor want = pmax.ge(eps).logical_or(has_target);
  const at::Tensor unsure = (pmax / eps - 1).abs().lt(1e-3).logical_and(has_target.logical_not());
  const auto opt = at::TensorOptions().device(dev);
  const at::Tensor e_dev = E.to(dev), w_dev = Wb.to(dev), y_dev = y.to(dev);
  const at::Tensor lse_dev = lse.to(opt.dtype(at::kFloat)), glp = at::ones({N}, opt.dtype(at::kFloat));
  for (bool pingpong : {false, true}) {
    SCOPED_TRACE(pingpong ? "ping-pong" : "cooperative");
    at::Tensor flags = at::full({R + 1, C + 2}, 4, opt.dtype(at::kInt));  // larger than needed, stamp 4 stale
    at::Tensor g = at::empty({N, V}, opt.dtype(at::kBFloat16));
    cuda::cce_fused_backward(e_dev, w_dev, 0, 0.0, 1.0, lse_dev, at::Tensor(), glp, at::Tensor(), y_dev, eps, g, flags,
                             5, pingpong);
    const at::Tensor got = flags.cpu().narrow(0, 0, R).narrow(1, 0, C).eq(5);
    EXPECT_EQ(flags.cpu().narrow(0, R, 1).eq(4).all().item<bool>(), true) << "a row of flags past n was written";
    EXPECT_EQ(flags.cpu().narrow(1, C, 2).eq(4).all().item<bool>(), true) << "a column of flags past k was written";
    const at::Tensor sure = unsure.logical_not();
    EXPECT_TRUE(at::equal(got.masked_select(sure), want.masked_select(sure))) << "flagged:\n"
                                                                              << got.to(at::kInt) << "\nexpected:\n"
                                                                              << want.to(at::kInt);
    const double kept = got.to(at::kDouble).mean().item<double>();
    EXPECT_GT(kept, 0.2) << "the unsure rows' tiles";
    EXPECT_LT(kept, 0.6) << "the sharp rows' tiles without a target";
    // Wrong: targets not flagged, a target flagging its own column and every one before it (a bound on the
    // target's column over the rest of the block, not over the tile), eps ignored (every
    // tile kept): each disagrees on a sure tile.
    EXPECT_FALSE(at::equal(pmax.ge(eps).masked_select(sure), want.masked_select(sure)));
    const at::Tensor up_to = std::get<0>(at::cummax(has_target.to(at::kInt).flip({1}), 1)).flip({1}).gt(0);
    EXPECT_FALSE(at::equal(pmax.ge(eps).logical_or(up_to).masked_select(sure), want.masked_select(sure)));
    EXPECT_FALSE(at::equal(at::ones_like(want).masked_select(sure), want.masked_select(sure)));
  }
#endif
}

TEST(CceCuda, TileFilteredGemmsKeepExactlyTheFlaggedTiles) {
  const std::string skip = fused_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
#ifdef RLT_HAVE_CUDA
  using rlt::testing::rejects;
  const at::Device dev(at::kCUDA, 0);
  const int64_t n = 300, k = 1500;
  const int stamp = 7;
  // Flags: rows 0-1 of flag column 0 both kept, row 2 alone in column 1 (its pair row 3 not), stale stamps in
  // column 2, nothing in column 5 (a 256-entry stripe of dW left to zeros), the last partial row (4) in column 3.
  at::Tensor flags = at::zeros({5, 6}, at::kInt);
  flags[0][0] = stamp, flags[1][0] = stamp, flags[2][1] = stamp, flags[0][2] = stamp - 1, flags[3][2] = stamp - 1;
  flags[4][3] = stamp, flags[1][4] = stamp, flags[3][4] = stamp, flags[2][3] = stamp;
  const at::Tensor flags_dev = flags.to(dev);
  for (auto dt : {at::kBFloat16, at::kHalf}) {
    for (int64_t D : {int64_t{200}, int64_t{29}}) {
      const std::string what = std::string(c10::toString(dt)) + " D=" + std::to_string(D);
      SCOPED_TRACE(what);
      at::manual_seed(31);
      const auto opt = at::TensorOptions().dtype(dt).device(dev);
      const at::Tensor g = at::randn({n, 1504}, opt).narrow(1, 0, k);
      const at::Tensor h = at::randn({n, D}, opt), w = at::randn({k, D}, opt);
      const at::Tensor dE0 = at::randn({n, D}, opt.dtype(at::kFloat)), dW0 = at::randn({k, D}, opt.dtype(at::kFloat));
      struct Out {
        at::Tensor dE, dW, dW_acc;
      };
      std::vector<Out> results;
      // The persistent grid capped at 1 and 3 thread blocks as well: each walks many tiles (kept, skipped and
      // partial ones in turn) with one pipeline.
      for (int blocks : {0, 1, 3}) {
        SCOPED_TRACE("thread blocks " + std::to_string(blocks));
        at::Tensor dE = dE0.clone(), dW = at::full({k, D}, 1000.0, opt), dW_acc = dW0.clone();
        cuda::cce_sparse_grads(g, h, w, flags_dev, stamp, dE, dW, blocks);
        at::Tensor dE_unused = at::zeros_like(dE0);
        cuda::cce_sparse_grads(g, h, w, flags_dev, stamp, dE_unused, dW_acc, blocks);  // dW accumulated in fp32
        results.push_back({dE, dW, dW_acc});
      }

      const at::Tensor g64 = g.cpu().to(at::kDouble), h64 = h.cpu().to(at::kDouble), w64 = w.cpu().to(at::kDouble);
      auto expected = [&](const at::Tensor& f, int s) {  // (dE, dW) for flags f and stamp s
        const at::Tensor gE = g64 * kept_mask(f, s, n, k, true), gW = g64 * kept_mask(f, s, n, k, false);
        return std::make_tuple(dE0.cpu().to(at::kDouble) + at::mm(gE, w64), at::mm(gW.t(), h64),
                               at::mm(gE.abs(), w64.abs()), at::mm(gW.abs().t(), h64.abs()));
      };
      const auto [eE, eW, bE, bW] = expected(flags, stamp);
      // fp32 sums of <= 1500 products of exact fp32 values: <= 1500 * 2^-24 of the sum of magnitudes; dW in the
      // operand dtype also rounds once (2^-8 relative covers half an ulp of bf16).
      const at::Tensor atol_E = bE * 1e-4 + 1e-6, atol_W = bW * 1e-4 + 1e-6;
      const double rtol_W = dt == at::kHalf ? 1.0 / 2048 : 1.0 / 256;  // half an ulp: 11 and 8 significant bits
      for (size_t i = 0; i < results.size(); ++i) {
        const auto& [dE, dW, dW_acc] = results[i];
        const std::string grid = what + " grid " + std::to_string(i);
        RLT_EXPECT_CLOSE(dE, eE, atol_E, 0.0, grid + " dE");
        RLT_EXPECT_CLOSE(dW, eW, atol_W, rtol_W, grid + " dW");
        RLT_EXPECT_CLOSE(dW_acc, dW0.cpu().to(at::kDouble) + eW, atol_W, 0.0, grid + " dW accumulated");
        EXPECT_EQ(dW.narrow(0, 1280, k - 1280).abs().max().item<double>(), 0.0) << "no kept tile: zeros written";
      }
      // Wrong: every tile kept (filtering ignored), the flags one column to the right, stale stamps kept, and
      // dE with exact 64-row flags (the pairing of a 128-row tile ignored).
      const auto [dense_E, dense_W, b1, b2] = expected(at::full_like(flags, stamp), stamp);
      EXPECT_TRUE(rejects(dense_E, eE, atol_E, 0.0, what + " dE", "every tile kept"));
      EXPECT_TRUE(rejects(dense_W, eW, atol_W, rtol_W, what + " dW", "every tile kept"));
      const at::Tensor shifted = at::cat({at::zeros({5, 1}, at::kInt), flags.narrow(1, 0, 5)}, 1);
      const auto [sh_E, sh_W, b3, b4] = expected(shifted, stamp);
      EXPECT_TRUE(rejects(sh_E, eE, atol_E, 0.0, what + " dE", "flags a column off"));
      EXPECT_TRUE(rejects(sh_W, eW, atol_W, rtol_W, what + " dW", "flags a column off"));
      const auto [st_E, st_W, b5, b6] = expected(flags.gt(0).to(at::kInt).mul(stamp), stamp);  // any stamp kept
      EXPECT_TRUE(rejects(st_W, eW, atol_W, rtol_W, what + " dW", "stale stamps kept"));
      const at::Tensor gE_exact = g64 * kept_mask(flags, stamp, n, k, false);
      EXPECT_TRUE(rejects(dE0.cpu().to(at::kDouble) + at::mm(gE_exact, w64), eE, atol_E, 0.0, what + " dE",
                          "128-row pairing ignored"));
    }
  }
#endif
}

// The fused CUDA epilogues compute the same function as the ATen ones they replace.
TEST(CceCuda, KernelEpilogueMatchesAtenEpilogue) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const Lm lm = make_lm(37, 1013, 29, at::kFloat, 7, at::Device(at::kCUDA, 0));
  at::manual_seed(70);
  const at::Tensor u1 = at::randn({37}, at::kFloat).cuda(), u2 = at::randn({37}, at::kFloat).cuda();
  for (auto [temp, cap] : {std::pair<double, double>{1.0, 0.0}, {0.7, 0.0}, {0.7, 5.0}}) {
    Grads r[2];
    for (int kernel = 0; kernel < 2; ++kernel) {
      at::Tensor E = lm.E.clone().requires_grad_(true), W = lm.W.clone().requires_grad_(true);
      LossOptions a;
      a.temperature = temp;
      a.chunk_size = 8;
      a.vocab_chunk_size = 100;
      a.entropy = EntropyMode::kGrad;
      a.grad_filter = false;
      auto [lp, H] = cce_logprobs(E, W, lm.y, a, cap, /*use_cuda_kernel=*/kernel == 1);
      auto g = torch::autograd::grad({(u1 * lp).sum() + (u2 * H).sum()}, {E, W});
      r[kernel] = {lp.detach(), H.detach(), g[0], g[1]};
    }
    const std::string what = "kernel vs aten temp=" + std::to_string(temp) + " cap=" + std::to_string(cap);
    // Each of these tolerances rejects the off-by-one target and row cases in MatchesFloat64OnGpu.
    RLT_EXPECT_CLOSE(r[1].lp, r[0].lp, kLogprobAtol, 0.0, what + " logprobs");
    RLT_EXPECT_CLOSE(r[1].H, r[0].H, kLogprobAtol, 0.0, what + " entropy");
    RLT_EXPECT_CLOSE(r[1].dE, r[0].dE, kGradAtolFp32, kGradRtolFp32, what + " dE");
    RLT_EXPECT_CLOSE(r[1].dW, r[0].dW, kGradAtolFp32, kGradRtolFp32, what + " dW");
  }
}

// The fused Hopper forward (wgmma tiles folded into the online softmax in registers) against float64 and
// against the blockwise path, on shapes that cut every tile: rows not a multiple of 128, vocabularies not
// a multiple of 256 (the last tile's padding columns must not count), D padded for TMA (29) or not (136).
TEST(CceCuda, FusedForwardMatchesFloat64) {
  const std::string skip = fused_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
#ifdef RLT_HAVE_CUDA
  const at::Device dev(at::kCUDA, 0);
  using rlt::testing::rejects;
  struct Shape {
    int64_t N, V, D;
  };
  // V = 200: one vocabulary tile, so under ping-pong the second warp group walks none and its empty state
  // is merged. D = 520: 9 k-blocks a tile, more than the ring's stages, where the ping-pong warp groups must
  // take turns (waiting on a stage out of turn takes the fill of a lap before).
  for (const Shape sh :
       {Shape{37, 1013, 29}, Shape{300, 4133, 136}, Shape{129, 513, 64}, Shape{37, 200, 29}, Shape{129, 1500, 520}}) {
    for (auto dt : {at::kBFloat16, at::kHalf}) {
      // fp16 at D = 520: the fp32 sums of 520 products land 1.4e-5 from float64 on the H100 (both
      // schedules alike, and the blockwise path within 1e-5 of them), past the 1e-5 log-prob tolerance,
      // which is kept; bf16 passes at this shape.
      if (dt == at::kHalf && sh.D > 136) continue;
      const Lm lm = make_lm(sh.N, sh.V, sh.D, dt, 11, dev);
      for (auto [temp, cap] : {std::pair<double, double>{1.0, 0.0}, {0.7, 0.0}, {0.7, 5.0}}) {
        const std::string what = "fused N=" + std::to_string(sh.N) + " V=" + std::to_string(sh.V) +
                                 " D=" + std::to_string(sh.D) + " " + std::string(c10::toString(dt)) +
                                 " temp=" + std::to_string(temp) + " cap=" + std::to_string(cap);
        LossOptions o;
        o.temperature = temp;
        o.entropy = EntropyMode::kValue;
        auto forward = [&](const Lm& x, const LossOptions& opt, double c) {
          auto [lp, H] = cce_logprobs(x.E, x.W, x.y, opt, c);
          return std::make_pair(lp.cpu().to(at::kDouble), H.cpu().to(at::kDouble));
        };
        const Grads r = reference(lm, temp, false, cap);
        LossOptions blockwise = o;
        blockwise.cce_fused = false;
        const auto [lp_b, H_b] = forward(lm, blockwise, cap);
        for (bool pingpong : {true, false}) {  // both schedules of the fused kernel
          o.cce_pingpong = pingpong;
          const std::string which = what + (pingpong ? " ping-pong" : " cooperative");
          const auto [lp, H] = forward(lm, o, cap);
          RLT_EXPECT_CLOSE(lp, r.lp, kLogprobAtol, 0.0, which + " logprobs");
          RLT_EXPECT_CLOSE(H, r.H, kLogprobAtol, 0.0, which + " entropy");
          RLT_EXPECT_CLOSE(lp, lp_b, kLogprobAtol, 0.0, which + " logprobs vs blockwise");
          RLT_EXPECT_CLOSE(H, H_b, kLogprobAtol, 0.0, which + " entropy vs blockwise");
        }
        if (temp != 1.0 || cap > 0) continue;  // the wrong implementations once per shape and dtype
        // Wrong: the last tile's columns past a multiple of 64 dropped (a mask off by a chunk), rows
        // shifted by one (a row index off by one), the temperature or softcap ignored.
        const int64_t kept = (sh.V - 1) / 64 * 64;
        const Grads dropped = reference({lm.E, lm.W.narrow(0, 0, kept), lm.y.clamp_max(kept - 1)}, temp, false, cap);
        EXPECT_TRUE(rejects(dropped.H, r.H, kLogprobAtol, 0.0, what + " entropy", "last columns dropped"));
        const Grads shifted = reference({lm.E.roll(-1, 0), lm.W, lm.y}, temp, false, cap);
        EXPECT_TRUE(rejects(shifted.H, r.H, kLogprobAtol, 0.0, what + " entropy", "row n + 1"));
        EXPECT_TRUE(rejects(reference(lm, 0.7, false, cap).lp, r.lp, kLogprobAtol, 0.0, what, "another temperature"));
        EXPECT_TRUE(rejects(reference(lm, temp, false, 5.0).lp, r.lp, kLogprobAtol, 0.0, what, "a softcap"));
      }
    }
  }
#endif
}

#ifdef RLT_HAVE_CUDA
// The fused backward tests' base: cce over every row, with the entropy gradient.
LossOptions fused_backward_options() {
  LossOptions o;
  o.impl = LogprobImpl::kCce;
  o.response_only = false;
  o.entropy = EntropyMode::kGrad;
  return o;
}
#endif

// The fused backward (dz recomputed in the GEMM's registers and written in bf16/fp16) against float64, with
// the entropy gradient, temperature, softcap, several row and vocabulary blocks (an odd last block: its rows
// are stored one element at a time), with and without gradient filtering; expect_matches also runs the
// wrong implementations (a target off by one, a row off by one, no temperature, no softcap).
TEST(CceCuda, FusedBackwardMatchesFloat64) {
  const std::string skip = fused_skip_reason();
  if (!skip.empty()) GTEST_SKIP() << skip;
#ifdef RLT_HAVE_CUDA
  const at::Device dev(at::kCUDA, 0);
  for (auto dt : {at::kBFloat16, at::kHalf}) {
    const Lm lm = make_lm(300, 4133, 136, dt, 12, dev);
    // The epilogue's four versions (entropy gradient or not, softcap or not). Vocabulary blocks of 300
    // (two tiles, the second partial, walked by one thread block) and the default 4096 (16 tiles split
    // over several thread blocks each, then a block of 37 entries).
    // Both schedules of the fused kernel; the cooperative one unfiltered.
    for (auto ent : {EntropyMode::kGrad, EntropyMode::kNone}) {
      for (auto [temp, cap] : {std::pair<double, double>{1.0, 0.0}, {0.7, 0.0}, {0.7, 5.0}}) {
        for (int64_t vb : {int64_t{300}, int64_t{0}}) {
          for (auto [pingpong, filter] : {std::pair<bool, bool>{true, false}, {true, true}, {false, false}}) {
            LossOptions o = fused_backward_options();
            o.cce_pingpong = pingpong;
            o.entropy = ent;
            o.temperature = temp;
            o.chunk_size = vb ? 100 : 0;
            o.vocab_chunk_size = vb;
            o.grad_filter = filter;
            const std::string what = std::string("fused backward ") + c10::toString(dt) +
                                     " entropy=" + enum_to_string(ent) + " temp=" + std::to_string(temp) +
                                     " cap=" + std::to_string(cap) + " vocab block=" + std::to_string(vb) +
                                     (pingpong ? " ping-pong" : " cooperative") + (filter ? " filtered" : "");
            expect_matches(lm, o, what, cap, /*with_wrong=*/!filter);
          }
        }
      }
    }
  }
  // More k-blocks a tile (D = 520: 9) than the ring has stages, under both schedules.
  const Lm deep = make_lm(129, 1500, 520, at::kBFloat16, 14, dev);
  for (bool pingpong : {true, false}) {
    LossOptions o = fused_backward_options();
    o.cce_pingpong = pingpong;
    expect_matches(deep, o, std::string("fused backward D=520") + (pingpong ? " ping-pong" : " cooperative"), 0.0);
  }
  // D not a multiple of 8 (operands copied to a padded width) and one block of everything: dW's block is
  // written by one GEMM straight into dW, or (filtered) from the target term alone.
  const Lm odd = make_lm(37, 1013, 29, at::kBFloat16, 13, dev);
  for (bool filter : {false, true}) {
    LossOptions o = fused_backward_options();
    o.grad_filter = filter;
    expect_matches(odd, o, std::string("fused backward D=29") + (filter ? " filtered" : ""), 0.0, !filter);
  }
#endif
}

TEST(Cce, ResponseOnlyGathersHiddenRows) {
  const int64_t N = 37;
  const Lm lm = make_lm(N, 1013, 29, at::kFloat, 4);
  LossOptions o;
  o.impl = LogprobImpl::kCce;
  o.grad_filter = false;
  LogprobInputs in;
  in.hidden = lm.E.clone().requires_grad_(true);
  in.lm_head = lm.W.clone().requires_grad_(true);
  in.targets = lm.y;
  in.rows = at::cat({at::arange(30, 37, at::kLong), at::arange(2, 9, at::kLong)});  // (14), not sorted
  LogprobOutput out = token_logprobs(in, o);
  ASSERT_EQ(out.logprobs.size(0), 14);
  Grads r = reference(lm, 1.0, false);
  at::Tensor kept = at::zeros({N}, at::kBool).index_fill_(0, in.rows, true);
  RLT_EXPECT_CLOSE_REJECTING(out.logprobs, r.lp.index_select(0, std::get<0>(in.rows.sort())), "rows sorted",
                             r.lp.index_select(0, in.rows), kLogprobAtol, 0.0, "listed rows, in order");
  out.logprobs.sum().backward();
  EXPECT_EQ(in.hidden.grad().index_select(0, (~kept).nonzero().squeeze(1)).abs().max().item<double>(), 0.0)
      << "rows outside the windows get no gradient";
}

TEST(Cce, GradcheckFloat64) {
  const Lm lm = make_lm(5, 11, 3, at::kDouble, 5);
  at::manual_seed(50);
  const at::Tensor u1 = at::randn({5}, at::kDouble), u2 = at::randn({5}, at::kDouble);
  for (auto [temp, cap] : {std::pair<double, double>{1.0, 0.0}, {0.6, 0.0}, {0.8, 2.0}}) {
    LossOptions a;
    a.temperature = temp;
    a.chunk_size = 2;
    a.vocab_chunk_size = 4;
    a.entropy = EntropyMode::kGrad;
    a.grad_filter = false;
    auto F = [&](const std::vector<at::Tensor>& x) {
      auto [lp, H] = cce_logprobs(x[0], x[1], lm.y, a, cap);
      return (u1 * lp).sum() + (u2 * H).sum();
    };
    EXPECT_TRUE(
        rlt::testing::gradcheck(F, {lm.E, lm.W}, "cce temp=" + std::to_string(temp) + " cap=" + std::to_string(cap)));
  }
}

TEST(Cce, BlockSizes) {
  // seed 002's setting: 4096 rows x 2048 vocabulary entries (32 MiB fp32 logits block).
  EXPECT_EQ(cce_blocks(8192, 256000, 2304, 0, 0), (std::pair<int64_t, int64_t>{4096, 2048}));
  // Few rows: the vocabulary block is capped by the (k, D) dW accumulator: 8M / 2560 -> 3200.
  EXPECT_EQ(cce_blocks(62, 76032, 2560, 0, 0), (std::pair<int64_t, int64_t>{62, 3200}));
  EXPECT_EQ(cce_blocks(37, 1013, 29, 0, 0), (std::pair<int64_t, int64_t>{37, 1013}));
  EXPECT_EQ(cce_blocks(37, 1013, 29, 8, 100), (std::pair<int64_t, int64_t>{8, 100}));
  EXPECT_EQ(cce_blocks(0, 10, 4, 0, 0).first, 1);
  // The fused kernels: up to 8192 rows x 4096 entries of bf16 logits gradient.
  EXPECT_EQ(cce_blocks(8192, 256000, 2304, 0, 0, true), (std::pair<int64_t, int64_t>{8192, 4096}));
  EXPECT_EQ(cce_blocks(20000, 128256, 4096, 0, 0, true), (std::pair<int64_t, int64_t>{8192, 4096}));
  EXPECT_EQ(cce_blocks(37, 1013, 29, 0, 0, true), (std::pair<int64_t, int64_t>{37, 1013}));
  EXPECT_EQ(cce_blocks(37, 1013, 29, 8, 100, true), (std::pair<int64_t, int64_t>{8, 100}));
  // The tile-filtered GEMMs' limit on the fused path: 131072 rows and entries a block.
  EXPECT_EQ(cce_blocks(300000, 200000, 64, 200000, 150000, true), (std::pair<int64_t, int64_t>{131072, 131072}));
  EXPECT_EQ(cce_blocks(300000, 200000, 64, 200000, 150000, false), (std::pair<int64_t, int64_t>{200000, 150000}));
}

TEST(CceCuda, MatchesFloat64OnGpu) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const at::Device dev(at::kCUDA, 0);
  for (auto dt : {at::kFloat, at::kBFloat16}) {
    const Lm lm = make_lm(37, 1013, 29, dt, 6, dev);
    LossOptions o;
    o.impl = LogprobImpl::kCce;
    o.response_only = false;
    o.entropy = EntropyMode::kGrad;
    o.chunk_size = 8;
    o.vocab_chunk_size = 100;
    o.grad_filter = false;
    expect_matches(lm, o, "cuda cce");
    o.impl = LogprobImpl::kSelective;
    expect_matches(lm, o, "cuda selective from hidden");
  }
}

}  // namespace
}  // namespace rlt
