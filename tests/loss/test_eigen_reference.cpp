// The LibTorch loss paths against the float64 Eigen reference (loss/reference/eigen_reference.h), an
// implementation that shares no code with them: log-probs, entropy and their gradients from logits
// (naive, selective) and from hidden states (naive, selective, cce: dE, dC), with temperature and
// softcap, response-only and loss-mask rows; the policy loss (asymmetric and dual clip, k1/k2/k3, every
// aggregation) and its gradients. Odd shapes; NaN/Inf fail first (close()); each tolerance also rejects
// the reference run with one deliberate mistake (an off-by-one target, an off-by-one row, no
// temperature, no softcap, another KL estimator, a symmetric clip).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "loss/logprob.h"
#include "loss/policy_loss.h"
#include "loss/reference/eigen_reference.h"
#include "tests/common/check.h"

namespace rlt {
namespace {

namespace ref = rlt::reference;
using rlt::testing::close;
using rlt::testing::rejects;

// Tolerances against float64: fp32 log-probs accumulate an lse over V <= 101 logits of size <= ~10:
// rounding ~1e-6; fp32 gradients are O(1) sums of V (or N) terms: ~1e-6 relative. float64 inputs run
// the same code in float64 (1e-12). An off-by-one target moves a log-prob by O(1).
constexpr double kLogprobAtolFp32 = 1e-5, kGradAtolFp32 = 1e-5, kGradRtolFp32 = 1e-4;
constexpr double kAtolFp64 = 1e-12;
// bf16 logits: the reference sees the same bf16 values in float64; log-probs are accumulated in fp32,
// so only fp32 rounding remains; the logits gradient is stored in bf16 (2^-8 relative, half an ulp).
constexpr double kGradRtolBf16 = 1.0 / 256;

ref::Mat to_eigen(const at::Tensor& t) {
  at::Tensor d = t.detach().cpu().to(at::kDouble).contiguous();
  if (d.dim() == 1) d = d.unsqueeze(1);
  ref::Mat m(d.size(0), d.size(1));
  auto a = d.accessor<double, 2>();
  for (int64_t i = 0; i < d.size(0); ++i) {
    for (int64_t j = 0; j < d.size(1); ++j) m(i, j) = a[i][j];
  }
  return m;
}
ref::Vec to_vec(const at::Tensor& t) { return to_eigen(t.reshape({-1, 1})).col(0); }
at::Tensor to_tensor(const ref::Mat& m) {
  at::Tensor t = at::empty({m.rows(), m.cols()}, at::kDouble);
  auto a = t.accessor<double, 2>();
  for (int64_t i = 0; i < m.rows(); ++i) {
    for (int64_t j = 0; j < m.cols(); ++j) a[i][j] = m(i, j);
  }
  return t;
}
at::Tensor to_tensor(const ref::Vec& v) { return to_tensor(ref::Mat(v)).squeeze(1); }
ref::Ids ids_of(const at::Tensor& t) {
  at::Tensor c = t.cpu().contiguous();
  return ref::Ids(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}
ref::Ids shifted(const ref::Ids& y, int64_t V) {
  ref::Ids s = y;
  for (auto& v : s) v = (v + 1) % V;
  return s;
}

// The Eigen results for logits z: log-probs, entropy, and d/dz of sum(g_lp lp) + sum(g_H H).
struct Expected {
  at::Tensor lp, H, grad;
};
Expected expected(const ref::Mat& z, const ref::Ids& y, double temp, double cap, const ref::Vec& g_lp,
                  const ref::Vec& g_H) {
  const ref::Mat x = ref::scaled_logits(z, temp, cap);
  return {to_tensor(ref::selective_logprob(x, y)), to_tensor(ref::entropy(x)),
          to_tensor(ref::logits_grad(z, y, temp, cap, g_lp, g_H))};
}

// ---- from logits -----------------------------------------------------------------------------------

TEST(EigenReference, LogitPathsOnOddShapes) {
  const int64_t T = 13, V = 101;
  at::manual_seed(1);
  const at::Tensor z64 = at::randn({T, V}, at::kDouble) * 3;  // (T, V)
  const at::Tensor y = at::randint(0, V, {T}, at::kLong);     // (T)
  const at::Tensor g_lp = at::randn({T}, at::kDouble), g_H = at::randn({T}, at::kDouble);
  for (auto dt : {at::kFloat, at::kBFloat16, at::kDouble}) {
    const at::Tensor z = z64.to(dt);
    const ref::Mat ze = to_eigen(z);  // the same (possibly bf16-rounded) values in float64
    for (auto impl : {LogprobImpl::kNaive, LogprobImpl::kSelective}) {
      for (double temp : {1.0, 0.7}) {
        for (int64_t chunk : {0, 4}) {
          LossOptions o;
          o.impl = impl;
          o.response_only = false;
          o.entropy = EntropyMode::kGrad;
          o.temperature = temp;
          o.chunk_size = chunk;
          std::ostringstream os;
          os << enum_to_string(impl) << " " << dt << " temp=" << temp << " chunk=" << chunk;
          const std::string what = os.str();
          SCOPED_TRACE(what);
          at::Tensor x = z.clone().requires_grad_(true);
          LogprobInputs in;
          in.logits = x;
          in.targets = y;
          LogprobOutput out = token_logprobs(in, o);
          at::Tensor loss = (g_lp.to(out.logprobs.options()) * out.logprobs).sum() +
                            (g_H.to(out.entropy.options()) * out.entropy).sum();
          const at::Tensor grad = torch::autograd::grad({loss}, {x})[0];
          const ref::Ids ye = ids_of(y);
          const Expected e = expected(ze, ye, temp, 0.0, to_vec(g_lp), to_vec(g_H));
          const Expected off_target = expected(ze, shifted(ye, V), temp, 0.0, to_vec(g_lp), to_vec(g_H));
          const Expected off_row = expected(to_eigen(z.roll(-1, 0)), ye, temp, 0.0, to_vec(g_lp), to_vec(g_H));
          const double atol = dt == at::kDouble ? kAtolFp64 : kLogprobAtolFp32;
          RLT_EXPECT_CLOSE_REJECTING(out.logprobs, off_target.lp, "target y + 1", e.lp, atol, 0.0, what + " logprobs");
          RLT_EXPECT_CLOSE_REJECTING(out.entropy, off_row.H, "row t + 1", e.H, atol, 0.0, what + " entropy");
          if (temp != 1.0) {
            const Expected no_temp = expected(ze, ye, 1.0, 0.0, to_vec(g_lp), to_vec(g_H));
            EXPECT_TRUE(rejects(out.logprobs, no_temp.lp, atol, 0.0, what, "temperature ignored"));
          }
          // The gradient a perfect implementation stores: the float64 one rounded to the logits dtype.
          const double g_atol = dt == at::kDouble ? kAtolFp64 : kGradAtolFp32;
          const double g_rtol = dt == at::kDouble ? 0.0 : dt == at::kBFloat16 ? kGradRtolBf16 : kGradRtolFp32;
          RLT_EXPECT_CLOSE_REJECTING(grad, off_target.grad.to(dt), "target y + 1", e.grad.to(dt).to(at::kDouble),
                                     g_atol, g_rtol, what + " grad");
        }
      }
    }
  }
}

// Listed rows (a sequence's response rows in the trainer's order): each result is the reference's value
// at its row, with or without response_only; unlisted rows get zero gradient. A wrong row (one off) and
// a dropped row (the last one) must be caught.
TEST(EigenReference, ListedRows) {
  const int64_t T = 17, V = 23;
  at::manual_seed(2);
  const at::Tensor z = at::randn({T, V}, at::kFloat) * 2, y = at::randint(0, V, {T}, at::kLong);
  const at::Tensor rows = at::tensor({1, 2, 3, 4, 5, 11, 12, 13, 14, 15, 16}, at::kLong);
  const at::Tensor lp_all = to_tensor(ref::selective_logprob(to_eigen(z), ids_of(y)));  // (T)
  const at::Tensor want = lp_all.index_select(0, rows);
  const at::Tensor off_by_one = lp_all.index_select(0, rows - 1);
  const at::Tensor dropped = at::cat({want.narrow(0, 0, want.size(0) - 1), at::zeros({1}, want.options())});
  for (bool response_only : {true, false}) {
    for (auto impl : {LogprobImpl::kNaive, LogprobImpl::kSelective}) {
      const std::string what = std::string(enum_to_string(impl)) + (response_only ? " response_only" : " all rows");
      LossOptions o;
      o.impl = impl;
      o.response_only = response_only;
      at::Tensor x = z.clone().requires_grad_(true);
      LogprobInputs in;
      in.logits = x;
      in.targets = y;
      in.rows = rows;
      const at::Tensor lp = token_logprobs(in, o).logprobs;  // (T')
      const at::Tensor grad = torch::autograd::grad({lp.sum()}, {x})[0];
      RLT_EXPECT_CLOSE_REJECTING(lp, off_by_one, "row t - 1", want, kLogprobAtolFp32, 0.0, what);
      EXPECT_TRUE(rlt::testing::rejects(dropped, want, kLogprobAtolFp32, 0.0, what, "last row dropped"));
      at::Tensor unlisted = at::ones({T}, at::kBool).index_fill_(0, rows, false);
      EXPECT_EQ(grad.index_select(0, unlisted.nonzero().squeeze(1)).abs().max().item<double>(), 0.0) << what;
    }
  }
}

// ---- from hidden states: every impl, temperature and softcap, dE and dC -----------------------------

TEST(EigenReference, HiddenStatePathsAndCce) {
  const int64_t N = 11, V = 53, D = 7;
  at::manual_seed(3);
  const at::Tensor C = at::randn({V, D}, at::kDouble) / std::sqrt(double(D));
  const at::Tensor y = at::randint(0, V, {N}, at::kLong);
  const at::Tensor E = at::randn({N, D}, at::kDouble) + 4 * C.index_select(0, y);  // LM-like peaks
  const at::Tensor g_lp = at::randn({N}, at::kDouble), g_H = at::randn({N}, at::kDouble);
  const ref::Mat Ee = to_eigen(E), Ce = to_eigen(C);
  const ref::Ids ye = ids_of(y);
  for (auto dt : {at::kFloat, at::kDouble}) {
    for (auto impl : {LogprobImpl::kNaive, LogprobImpl::kSelective, LogprobImpl::kCce}) {
      for (auto [temp, cap] : {std::pair<double, double>{1.0, 0.0}, {0.7, 0.0}, {0.7, 3.0}}) {
        for (int64_t chunk : {0, 4}) {
          std::ostringstream os;
          os << enum_to_string(impl) << " " << dt << " temp=" << temp << " cap=" << cap << " chunk=" << chunk;
          const std::string what = os.str();
          SCOPED_TRACE(what);
          LossOptions o;
          o.impl = impl;
          o.response_only = false;
          o.entropy = EntropyMode::kGrad;
          o.temperature = temp;
          o.chunk_size = chunk;
          o.vocab_chunk_size = 10;  // cce: ragged vocabulary blocks
          o.grad_filter = false;
          at::Tensor e = E.to(dt).requires_grad_(true), c = C.to(dt).requires_grad_(true);
          LogprobInputs in;
          in.hidden = e;
          in.lm_head = c;
          in.targets = y;
          in.logit_softcap = cap;
          LogprobOutput out = token_logprobs(in, o);
          at::Tensor loss = (g_lp.to(out.logprobs.options()) * out.logprobs).sum() +
                            (g_H.to(out.entropy.options()) * out.entropy).sum();
          auto g = torch::autograd::grad({loss}, {e, c});
          const ref::CceForward f = ref::cce_forward(Ee, Ce, ye, temp, cap);
          const ref::CceBackward b = ref::cce_backward(Ee, Ce, ye, temp, cap, to_vec(g_lp), to_vec(g_H));
          const ref::CceForward f_off = ref::cce_forward(Ee, Ce, shifted(ye, V), temp, cap);
          const ref::CceBackward b_off =
              ref::cce_backward(Ee, Ce, shifted(ye, V), temp, cap, to_vec(g_lp), to_vec(g_H));
          const ref::Mat E_rolled = to_eigen(E.roll(-1, 0));
          const ref::CceForward f_row = ref::cce_forward(E_rolled, Ce, ye, temp, cap);
          const bool fp64 = dt == at::kDouble;
          const double atol = fp64 ? kAtolFp64 : kLogprobAtolFp32;
          const double g_atol = fp64 ? kAtolFp64 : kGradAtolFp32, g_rtol = fp64 ? 0.0 : kGradRtolFp32;
          RLT_EXPECT_CLOSE_REJECTING(out.logprobs, to_tensor(f_off.logprob), "target y + 1", to_tensor(f.logprob), atol,
                                     0.0, what + " logprobs");
          RLT_EXPECT_CLOSE_REJECTING(out.entropy, to_tensor(f_row.entropy), "row n + 1", to_tensor(f.entropy), atol,
                                     0.0, what + " entropy");
          RLT_EXPECT_CLOSE_REJECTING(g[0], to_tensor(b_off.dE), "target y + 1", to_tensor(b.dE), g_atol, g_rtol,
                                     what + " dE");
          RLT_EXPECT_CLOSE_REJECTING(g[1], to_tensor(b_off.dC), "target y + 1", to_tensor(b.dC), g_atol, g_rtol,
                                     what + " dC");
          if (temp != 1.0) {
            EXPECT_TRUE(rejects(out.logprobs, to_tensor(ref::cce_forward(Ee, Ce, ye, 1.0, cap).logprob), atol, 0.0,
                                what, "temperature ignored"));
          }
          if (cap > 0) {
            EXPECT_TRUE(rejects(out.logprobs, to_tensor(ref::cce_forward(Ee, Ce, ye, temp, 0.0).logprob), atol, 0.0,
                                what, "softcap ignored"));
          }
        }
      }
    }
  }
}

// ---- the policy loss ---------------------------------------------------------------------------------

TEST(EigenReference, PolicyLossEveryBranch) {
  constexpr int64_t S = 5, L = 7;
  at::manual_seed(4);
  const at::Tensor lp = -3.0 * at::rand({S, L}, at::kDouble);
  at::Tensor lp_old = lp + 0.4 * at::randn({S, L}, at::kDouble);
  const at::Tensor lp_ref = lp + 0.3 * at::randn({S, L}, at::kDouble);
  const at::Tensor ent = 2.0 * at::rand({S, L}, at::kDouble);
  at::Tensor adv = at::randn({S, L}, at::kDouble);
  lp_old[0][1] = lp[0][1] - 3.0;  // ratio e^3 with A < 0: dual clip
  adv[0][1] = -1.5;
  lp_old[4][0] = lp[4][0] - 1.0;  // ratio e with A > 0: clipped at 1 + high
  adv[4][0] = 2.0;
  const int64_t lengths[S] = {7, 3, 0, 5, 1};
  at::Tensor mask = at::zeros({S, L}, at::kDouble);
  for (int64_t s = 0; s < S; ++s) mask[s].narrow(0, 0, lengths[s]).fill_(1.0);
  mask[3][2] = 0.0;  // tool output inside a response

  const std::pair<LossAgg, ref::Agg> aggs[] = {{LossAgg::kTokenMean, ref::Agg::kTokenMean},
                                               {LossAgg::kSeqMeanTokenMean, ref::Agg::kSeqMeanTokenMean},
                                               {LossAgg::kSeqMeanTokenSum, ref::Agg::kSeqMeanTokenSum},
                                               {LossAgg::kSeqMeanTokenSumNorm, ref::Agg::kSeqMeanTokenSumNorm}};
  const std::pair<KlEstimator, ref::Kl> kls[] = {
      {KlEstimator::kK1, ref::Kl::kK1}, {KlEstimator::kK2, ref::Kl::kK2}, {KlEstimator::kK3, ref::Kl::kK3}};
  for (const auto& [agg, ragg] : aggs) {
    for (size_t k = 0; k < 3; ++k) {
      for (double clip_c : {0.0, 3.0}) {
        for (double global : {0.0, 9.0}) {
          const std::string what = std::string(enum_to_string(agg)) + " " + enum_to_string(kls[k].first) +
                                   " clip_c=" + std::to_string(clip_c) + " global=" + std::to_string(global);
          SCOPED_TRACE(what);
          PolicyLossOptions opt;
          opt.clip_eps_low = 0.2;
          opt.clip_eps_high = 0.28;
          opt.clip_c = clip_c;
          opt.kl_coef = 0.05;
          opt.kl_estimator = kls[k].first;
          opt.entropy_coef = 0.01;
          opt.agg = agg;
          opt.agg_norm = 7.0;
          ref::PolicyConfig cfg;
          cfg.clip_eps_low = 0.2;
          cfg.clip_eps_high = 0.28;
          cfg.clip_c = clip_c;
          cfg.kl_coef = 0.05;
          cfg.kl = kls[k].second;
          cfg.entropy_coef = 0.01;
          cfg.agg = ragg;
          cfg.agg_norm = 7.0;
          cfg.global_denominator = global;
          PolicyLossInputs in;
          in.logprobs = lp.clone().requires_grad_(true);
          in.logprobs_old = lp_old;
          in.logprobs_ref = lp_ref;
          in.advantages = adv;
          in.loss_mask = mask;
          in.entropy = ent.clone().requires_grad_(true);
          in.global_denominator = global;
          const PolicyLossOutput out = policy_loss(in, opt);
          auto g = torch::autograd::grad({out.loss}, {in.logprobs, in.entropy});
          auto eig = [&](const ref::PolicyConfig& c) {
            return ref::policy_loss(to_eigen(lp), to_eigen(lp_old), to_eigen(lp_ref), to_eigen(adv), to_eigen(mask),
                                    to_eigen(ent), c);
          };
          const ref::PolicyLoss want = eig(cfg);
          // Wrong: the next KL estimator (k2 where k3 is asked, ...), and a symmetric clip.
          ref::PolicyConfig other_kl = cfg, symmetric = cfg;
          other_kl.kl = kls[(k + 1) % 3].second;
          symmetric.clip_eps_high = symmetric.clip_eps_low;
          const ref::PolicyLoss w_kl = eig(other_kl), w_sym = eig(symmetric);
          auto scalar = [](double v) { return at::scalar_tensor(v, at::kDouble); };
          RLT_EXPECT_CLOSE_REJECTING(out.loss, scalar(w_kl.loss), "other KL estimator", scalar(want.loss), kAtolFp64,
                                     0.0, what + " loss");
          RLT_EXPECT_CLOSE_REJECTING(out.pg_loss, scalar(w_sym.pg_loss), "symmetric clip", scalar(want.pg_loss),
                                     kAtolFp64, 0.0, what + " pg_loss");
          RLT_EXPECT_CLOSE_REJECTING(g[0], to_tensor(w_kl.dlogprobs), "other KL estimator", to_tensor(want.dlogprobs),
                                     kAtolFp64, 0.0, what + " dlogprobs");
          ref::PolicyConfig other_agg = cfg;
          other_agg.agg =
              ragg == ref::Agg::kSeqMeanTokenSumNorm ? ref::Agg::kTokenMean : ref::Agg::kSeqMeanTokenSumNorm;
          RLT_EXPECT_CLOSE_REJECTING(g[1], to_tensor(eig(other_agg).dentropy), "other aggregation",
                                     to_tensor(want.dentropy), kAtolFp64, 0.0, what + " dentropy");
        }
      }
    }
  }
}

}  // namespace
}  // namespace rlt
