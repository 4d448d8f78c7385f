// Tests of loss/policy_loss: hand-computed clipped-surrogate, dual-clip, KL, entropy and aggregation
// values (derived in comments), gradient accumulation over micro-batches, autograd vs float64 finite
// differences, metrics and option/input checks. CPU only, float64 unless a test says otherwise.
#include "loss/policy_loss.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace rlt {
namespace {

// float64 on O(1) values, same formulas as the std:: reference: only rounding (~1e-16) differs.
constexpr double kTolF64 = 1e-12;
// float32 path on O(1) values: a few ulps (float32 eps = 1.2e-7).
constexpr double kTolF32 = 1e-6;
// Central difference in float64 with step h: truncation ~h^2 |f'''| ~ 1e-12, rounding ~1e-16/h ~ 1e-10,
// so 1e-7 has margin yet is far below the O(0.1) gradients compared.
constexpr double kFdStep = 1e-6;
constexpr double kFdTol = 1e-7;
// Each accuracy check is paired with a wrong implementation (a symmetric clip where clip-higher is
// asked, a sign flip in the clip, a missing dual clip, another KL estimator, an unmasked mean, each
// micro-batch's own denominator) whose value the same tolerance must reject.

// NaN/Inf fail before the tolerance is looked at.
bool near(double got, double want, double tol) { return std::isfinite(got) && std::abs(got - want) <= tol; }

double val(const at::Tensor& t) { return t.item<double>(); }

// Max |a - b| over all elements; NaN if either holds a NaN (so near(.., 0, tol) fails).
double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  if (!at::isfinite(a).all().item<bool>() || !at::isfinite(b).all().item<bool>()) return NAN;
  return val((a - b).abs().max());
}

at::Tensor mat(const std::vector<std::vector<double>>& rows) {  // (S, L) float64
  const int64_t S = static_cast<int64_t>(rows.size());
  const int64_t L = S == 0 ? 0 : static_cast<int64_t>(rows[0].size());
  at::Tensor t = at::empty({S, L}, at::kDouble);
  auto a = t.accessor<double, 2>();
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t l = 0; l < L; ++l) a[s][l] = rows[s][l];
  }
  return t;
}

at::Tensor vec(const std::vector<double>& v) {  // (S) float64
  at::Tensor t = at::empty({static_cast<int64_t>(v.size())}, at::kDouble);
  for (size_t i = 0; i < v.size(); ++i) t.accessor<double, 1>()[i] = v[i];
  return t;
}

// One masked-in token with the given log-ratio and advantage (logprobs_old = -2).
struct OneToken {
  double loss, pg_loss, clip_frac, dual_clip_frac, dloss_dlogprob;
};
OneToken one_token(double log_ratio, double advantage, const PolicyLossOptions& opt) {
  PolicyLossInputs in;
  in.logprobs = mat({{-2.0 + log_ratio}}).requires_grad_();
  in.logprobs_old = mat({{-2.0}});
  in.advantages = vec({advantage});
  in.loss_mask = at::ones({1, 1}, at::kDouble);
  const PolicyLossOutput out = policy_loss(in, opt);
  out.loss.backward();
  return {val(out.loss), val(out.pg_loss), val(out.clip_frac), val(out.dual_clip_frac), val(in.logprobs.grad())};
}

PolicyLossOptions clip_higher() {  // DAPO: ratio range [0.8, 1.28]
  PolicyLossOptions opt;
  opt.clip_eps_low = 0.2;
  opt.clip_eps_high = 0.28;
  return opt;
}

TEST(PolicyLoss, ClipHigherPositiveAdvantage) {
  const PolicyLossOptions opt = clip_higher();
  // ratio = e^{0.5} = 1.6487 > 1+0.28 -> clipped to 1.28, A=1 -> pg = max(-1.6487, -1.28) = -1.28;
  // the clipped branch is constant in logprobs -> gradient 0.
  OneToken t = one_token(0.5, 1.0, opt);
  EXPECT_TRUE(near(t.loss, -1.28, kTolF64)) << t.loss;
  EXPECT_TRUE(near(t.pg_loss, -1.28, kTolF64));
  EXPECT_TRUE(near(t.dloss_dlogprob, 0.0, kTolF64));
  EXPECT_TRUE(near(t.clip_frac, 1.0, kTolF64));
  // Wrong: a symmetric clip (eps_high ignored) gives -1.2.
  PolicyLossOptions symmetric = opt;
  symmetric.clip_eps_high = symmetric.clip_eps_low;
  EXPECT_FALSE(near(one_token(0.5, 1.0, symmetric).loss, -1.28, kTolF64));
  // ratio = e^{0.22} = 1.2461: above 1+0.2 (would clip symmetrically) but below 1.28 -> unclipped,
  // A=2 -> pg = -2*1.2461 = -2.4922, d/dlogprob (-A e^{lp - lp_old}) = -A*ratio = -2.4922.
  t = one_token(0.22, 2.0, opt);
  EXPECT_TRUE(near(t.loss, -2.0 * std::exp(0.22), kTolF64)) << t.loss;
  EXPECT_TRUE(near(t.dloss_dlogprob, -2.0 * std::exp(0.22), kTolF64));
  EXPECT_TRUE(near(t.clip_frac, 0.0, kTolF64));
  // ratio = e^{-0.5} = 0.6065 < 1-0.2, A=1 -> pg = max(-0.6065, -0.8) = -0.6065: the pessimistic
  // bound keeps the unclipped (smaller gain) branch, gradient -A*ratio = -0.6065, not counted as clipped.
  t = one_token(-0.5, 1.0, opt);
  EXPECT_TRUE(near(t.loss, -std::exp(-0.5), kTolF64)) << t.loss;
  EXPECT_TRUE(near(t.dloss_dlogprob, -std::exp(-0.5), kTolF64));
  EXPECT_TRUE(near(t.clip_frac, 0.0, kTolF64));
}

TEST(PolicyLoss, ClipHigherNegativeAdvantage) {
  const PolicyLossOptions opt = clip_higher();
  // ratio = e^{0.5} = 1.6487, A=-1 -> pg = max(1.6487, 1.28) = 1.6487 unclipped (no dual clip),
  // gradient -A*ratio = 1.6487.
  OneToken t = one_token(0.5, -1.0, opt);
  EXPECT_TRUE(near(t.loss, std::exp(0.5), kTolF64)) << t.loss;
  EXPECT_TRUE(near(t.dloss_dlogprob, std::exp(0.5), kTolF64));
  EXPECT_TRUE(near(t.clip_frac, 0.0, kTolF64));
  // ratio = e^{-0.5} = 0.6065 < 0.8, A=-1 -> pg = max(0.6065, 0.8) = 0.8 clipped, gradient 0.
  t = one_token(-0.5, -1.0, opt);
  EXPECT_TRUE(near(t.loss, 0.8, kTolF64)) << t.loss;
  EXPECT_TRUE(near(t.dloss_dlogprob, 0.0, kTolF64));
  EXPECT_TRUE(near(t.clip_frac, 1.0, kTolF64));
  // Wrong: a sign flip in the clip (max(A r, A clip(r)) instead of max(-A r, -A clip(r))) gives
  // max(-0.6065, -0.8) = -0.6065; the pessimistic min instead of max gives 0.6065.
  const double r = std::exp(-0.5), r_clip = std::clamp(r, 0.8, 1.28);
  EXPECT_FALSE(near(std::max(-1.0 * r, -1.0 * r_clip), t.loss, kTolF64));
  EXPECT_FALSE(near(std::min(r, r_clip), t.loss, kTolF64));
  // ratio = e^{-0.2} = 0.8187 inside [0.8, 1.28], A=-1 -> pg = 0.8187, gradient 0.8187.
  t = one_token(-0.2, -1.0, opt);
  EXPECT_TRUE(near(t.loss, std::exp(-0.2), kTolF64)) << t.loss;
  EXPECT_TRUE(near(t.dloss_dlogprob, std::exp(-0.2), kTolF64));
}

TEST(PolicyLoss, DualClip) {
  PolicyLossOptions opt;  // ratio range [0.8, 1.2]
  opt.clip_c = 3.0;
  // ratio = e^3 = 20.0855, A=-1 -> max(20.0855, 1.2) = 20.0855, dual clip min(20.0855, -A*c = 3) = 3;
  // the bound is constant in logprobs -> gradient 0.
  OneToken t = one_token(3.0, -1.0, opt);
  EXPECT_TRUE(near(t.loss, 3.0, kTolF64)) << t.loss;
  EXPECT_TRUE(near(t.dloss_dlogprob, 0.0, kTolF64));
  EXPECT_TRUE(near(t.dual_clip_frac, 1.0, kTolF64));
  EXPECT_TRUE(near(t.clip_frac, 0.0, kTolF64));  // pg2 = 1.2 is not the max
  // Wrong: without the dual clip the loss is e^3 = 20.0855.
  PolicyLossOptions no_dual = opt;
  no_dual.clip_c = 0.0;
  EXPECT_FALSE(near(one_token(3.0, -1.0, no_dual).loss, 3.0, kTolF64));
  // Same ratio, A=+1: dual clip does not apply -> max(-20.0855, -1.2) = -1.2.
  t = one_token(3.0, 1.0, opt);
  EXPECT_TRUE(near(t.loss, -1.2, kTolF64)) << t.loss;
  EXPECT_TRUE(near(t.dual_clip_frac, 0.0, kTolF64));
  // ratio = e^{0.5} = 1.6487 < c, A=-2 -> pg = 2*1.6487 = 3.2974 < -A*c = 6: untouched, gradient 3.2974.
  t = one_token(0.5, -2.0, opt);
  EXPECT_TRUE(near(t.loss, 2.0 * std::exp(0.5), kTolF64)) << t.loss;
  EXPECT_TRUE(near(t.dloss_dlogprob, 2.0 * std::exp(0.5), kTolF64));
  EXPECT_TRUE(near(t.dual_clip_frac, 0.0, kTolF64));
  // clip_c = 0 (off): the first case is unbounded, pg = e^3 = 20.0855.
  opt.clip_c = 0.0;
  t = one_token(3.0, -1.0, opt);
  EXPECT_TRUE(near(t.loss, std::exp(3.0), kTolF64)) << t.loss;
}

TEST(PolicyLoss, KlEstimators) {
  // A = 0 and logprobs_old = logprobs -> pg = 0 exactly; only the KL term is left.
  // log_q = logprobs_ref - logprobs = [-1.5 - -1.0, -1.7 - -2.0] = [-0.5, 0.3].
  //   k1 = -log_q            = [0.5, -0.3]                               mean 0.1
  //   k2 = 0.5 log_q^2       = [0.125, 0.045]                            mean 0.085
  //   k3 = e^log_q - 1 - log_q = [0.60653-0.5 = 0.10653, 1.34986-1.3 = 0.04986]  mean 0.07819
  // loss = kl_coef * mean (token-mean over 2 tokens); d loss/d logprobs = kl_coef/2 * dk/dlogprobs
  // with dlog_q/dlogprobs = -1: dk1 = 1, dk2 = -log_q, dk3 = 1 - e^log_q.
  const double q0 = -0.5, q1 = -1.7 - -2.0;
  struct Case {
    KlEstimator est;
    double k0, k1, dk0, dk1;
  };
  const Case cases[] = {
      {KlEstimator::kK1, -q0, -q1, 1.0, 1.0},
      {KlEstimator::kK2, 0.5 * q0 * q0, 0.5 * q1 * q1, -q0, -q1},
      {KlEstimator::kK3, std::exp(q0) - 1 - q0, std::exp(q1) - 1 - q1, 1 - std::exp(q0), 1 - std::exp(q1)},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(enum_to_string(c.est));
    PolicyLossOptions opt;
    opt.kl_coef = 0.1;
    opt.kl_estimator = c.est;
    PolicyLossInputs in;
    in.logprobs = mat({{-1.0, -2.0}}).requires_grad_();
    in.logprobs_old = mat({{-1.0, -2.0}});
    in.logprobs_ref = mat({{-1.5, -1.7}});
    in.advantages = vec({0.0});
    in.loss_mask = at::ones({1, 2}, at::kDouble);
    const PolicyLossOutput out = policy_loss(in, opt);
    const double kl_mean = 0.5 * (c.k0 + c.k1);
    EXPECT_TRUE(near(val(out.kl), kl_mean, kTolF64)) << val(out.kl);
    EXPECT_TRUE(near(val(out.loss), 0.1 * kl_mean, kTolF64)) << val(out.loss);
    EXPECT_TRUE(near(val(out.pg_loss), 0.0, kTolF64));
    // Wrong: each other estimator used where this one is asked (k1 mean 0.1, k2 0.085, k3 0.0782).
    for (const Case& other : cases) {
      if (other.est == c.est) continue;
      PolicyLossOptions wrong = opt;
      wrong.kl_estimator = other.est;
      PolicyLossInputs w = in;
      w.logprobs = in.logprobs.detach();
      EXPECT_FALSE(near(val(policy_loss(w, wrong).kl), kl_mean, kTolF64)) << enum_to_string(other.est);
    }
    out.loss.backward();
    const at::Tensor grad = in.logprobs.grad();  // (1, 2)
    EXPECT_TRUE(near(val(grad[0][0]), 0.05 * c.dk0, kTolF64)) << val(grad[0][0]);
    EXPECT_TRUE(near(val(grad[0][1]), 0.05 * c.dk1, kTolF64)) << val(grad[0][1]);
  }
  // Reference given with kl_coef = 0: reported as a metric, not in the loss. k3 mean 0.07819.
  PolicyLossInputs in;
  in.logprobs = mat({{-1.0, -2.0}});
  in.logprobs_old = in.logprobs;
  in.logprobs_ref = mat({{-1.5, -1.7}});
  in.advantages = vec({0.0});
  in.loss_mask = at::ones({1, 2}, at::kDouble);
  PolicyLossOutput out = policy_loss(in, PolicyLossOptions{});
  EXPECT_TRUE(near(val(out.kl), 0.5 * (std::exp(q0) - 1 - q0 + std::exp(q1) - 1 - q1), kTolF64));
  EXPECT_TRUE(near(val(out.loss), 0.0, kTolF64));
  // No reference: kl metric is 0.
  in.logprobs_ref = at::Tensor();
  out = policy_loss(in, PolicyLossOptions{});
  EXPECT_TRUE(near(val(out.kl), 0.0, kTolF64));
}

TEST(PolicyLoss, EntropyBonus) {
  // A = 0, ratio 1 -> pg = 0. Token 0 (mask 1) has entropy 2.0, token 1 is masked out.
  // loss = -entropy_coef * 2.0 / 1 token = -0.01 * 2 = -0.02; d loss/d entropy = [-0.01, 0].
  PolicyLossOptions opt;
  opt.entropy_coef = 0.01;
  PolicyLossInputs in;
  in.logprobs = mat({{-1.0, -3.0}});
  in.logprobs_old = in.logprobs;
  in.advantages = vec({0.0});
  in.loss_mask = mat({{1.0, 0.0}});
  in.entropy = mat({{2.0, 1.0}}).requires_grad_();
  const PolicyLossOutput out = policy_loss(in, opt);
  EXPECT_TRUE(near(val(out.loss), -0.02, kTolF64)) << val(out.loss);
  EXPECT_TRUE(near(val(out.entropy), 2.0, kTolF64)) << val(out.entropy);
  // Wrong: the masked token counted (-0.01 * 3 / 2 = -0.015), or the bonus added with the wrong
  // sign (+0.02).
  PolicyLossInputs unmasked = in;
  unmasked.loss_mask = at::ones({1, 2}, at::kDouble);
  unmasked.entropy = in.entropy.detach();
  EXPECT_FALSE(near(val(policy_loss(unmasked, opt).loss), -0.02, kTolF64));
  EXPECT_FALSE(near(+opt.entropy_coef * 2.0, -0.02, kTolF64));
  out.loss.backward();
  EXPECT_TRUE(near(val(in.entropy.grad()[0][0]), -0.01, kTolF64));
  EXPECT_TRUE(near(val(in.entropy.grad()[0][1]), 0.0, kTolF64));
}

TEST(AggregateLoss, AllModesWithEmptySequence) {
  // per_token (3, 4); row 2 has no mask token; NaN and Inf sit at masked positions and must be ignored.
  const at::Tensor per_token = mat({{1, 2, 3, NAN}, {5, 6, 7, 8}, {INFINITY, 10, 11, 12}});
  const at::Tensor mask = mat({{1, 1, 0, 0}, {1, 1, 1, 1}, {0, 0, 0, 0}});
  // Masked sums per row: [1+2, 5+6+7+8, 0] = [3, 26, 0], total 29 over 6 tokens.
  //   token-mean              = 29 / 6
  //   seq-mean-token-mean     = (3/2 + 26/4) / 2 non-empty rows = (1.5 + 6.5) / 2 = 4
  //   seq-mean-token-sum      = (3 + 26 + 0) / 3 rows = 29 / 3
  //   seq-mean-token-sum-norm = 29 / (agg_norm 4 * 3 rows) = 29 / 12
  // With global_denominator = 10 each denominator is replaced: 29/10, 8/10, 29/10, 29/(4*10).
  struct Case {
    LossAgg agg;
    double local, global;
  };
  const Case cases[] = {{LossAgg::kTokenMean, 29.0 / 6, 29.0 / 10},
                        {LossAgg::kSeqMeanTokenMean, 4.0, 8.0 / 10},
                        {LossAgg::kSeqMeanTokenSum, 29.0 / 3, 29.0 / 10},
                        {LossAgg::kSeqMeanTokenSumNorm, 29.0 / 12, 29.0 / 40}};
  for (const Case& c : cases) {
    SCOPED_TRACE(enum_to_string(c.agg));
    const double local = val(aggregate_loss(per_token, mask, c.agg, /*agg_norm=*/4.0, /*global_denominator=*/0.0));
    const double global = val(aggregate_loss(per_token, mask, c.agg, /*agg_norm=*/4.0, /*global_denominator=*/10.0));
    EXPECT_TRUE(near(local, c.local, kTolF64)) << local;
    EXPECT_TRUE(near(global, c.global, kTolF64)) << global;
    // Wrong: every other aggregation mode, and this mode over a dropped row (row 1 missing).
    for (const Case& other : cases) {
      if (other.agg == c.agg) continue;
      EXPECT_FALSE(near(val(aggregate_loss(per_token, mask, other.agg, 4.0, 0.0)), c.local, kTolF64))
          << enum_to_string(other.agg);
    }
    const at::Tensor keep = at::tensor({0, 2}, at::kLong);
    EXPECT_FALSE(near(val(aggregate_loss(per_token.index_select(0, keep), mask.index_select(0, keep), c.agg, 4.0, 0.0)),
                      c.local, kTolF64));
    // All tokens masked: denominators clamp to >= 1 -> exactly 0, not NaN.
    const double empty = val(aggregate_loss(per_token, at::zeros_like(mask), c.agg, 4.0, 0.0));
    EXPECT_TRUE(near(empty, 0.0, kTolF64)) << empty;
  }
  // A bool mask gives the same as the float one.
  EXPECT_TRUE(
      near(val(aggregate_loss(per_token, mask.to(at::kBool), LossAgg::kTokenMean, 0.0, 0.0)), 29.0 / 6, kTolF64));
  EXPECT_THROW(aggregate_loss(per_token, mask, LossAgg::kSeqMeanTokenSumNorm, /*agg_norm=*/0.0, 0.0), c10::Error);
  EXPECT_THROW(aggregate_loss(per_token, mask.narrow(1, 0, 3), LossAgg::kTokenMean, 0.0, 0.0), c10::Error);
}

// A (5, 7) batch exercising every branch: clipped and dual-clipped tokens, an empty sequence, a
// tool-output hole in a mask, and garbage (-inf, -1e4) behaviour log-probs at masked positions.
struct Batch {
  at::Tensor logprobs, logprobs_old, logprobs_ref, advantages, loss_mask, entropy;
};
Batch make_batch() {
  constexpr int64_t S = 5, L = 7;
  at::manual_seed(7);
  Batch b;
  b.logprobs = -3.0 * at::rand({S, L}, at::kDouble);                   // (S, L)
  b.logprobs_old = b.logprobs + 0.4 * at::randn({S, L}, at::kDouble);  // (S, L)
  b.logprobs_ref = b.logprobs + 0.3 * at::randn({S, L}, at::kDouble);  // (S, L)
  b.entropy = 2.0 * at::rand({S, L}, at::kDouble);                     // (S, L)
  b.advantages = vec({-1.5, 0.7, 1.2, -0.4, 2.0});                     // (S) per sequence (GRPO)
  const int64_t lengths[S] = {7, 3, 0, 5, 1};
  b.loss_mask = at::zeros({S, L}, at::kDouble);  // (S, L)
  for (int64_t s = 0; s < S; ++s) b.loss_mask[s].narrow(0, 0, lengths[s]).fill_(1.0);
  b.loss_mask[3][2] = 0.0;                        // tool output inside a response
  b.logprobs_old[0][1] = b.logprobs[0][1] - 3.0;  // ratio e^3 with A = -1.5 -> dual clip
  b.logprobs_old[4][0] = b.logprobs[4][0] - 1.0;  // ratio e with A = 2 -> clipped at 1.28
  b.logprobs_old[1].narrow(0, 3, 4).fill_(-1e4);  // padding garbage: e^{1e4} would overflow
  b.logprobs_old[2].fill_(-INFINITY);             // empty sequence full of garbage
  return b;
}

PolicyLossOptions full_options(LossAgg agg) {
  PolicyLossOptions opt = clip_higher();
  opt.clip_c = 3.0;
  opt.kl_coef = 0.05;
  opt.kl_estimator = KlEstimator::kK3;
  opt.entropy_coef = 0.01;
  opt.agg = agg;
  opt.agg_norm = 7.0;  // = L, Dr. GRPO's max response length
  return opt;
}

PolicyLossInputs rows_of(const Batch& b, const at::Tensor& logprobs, const at::Tensor& entropy, int64_t start,
                         int64_t len, double global_denominator) {
  PolicyLossInputs in;
  in.logprobs = logprobs.narrow(0, start, len);
  in.logprobs_old = b.logprobs_old.narrow(0, start, len);
  in.logprobs_ref = b.logprobs_ref.narrow(0, start, len);
  in.advantages = b.advantages.narrow(0, start, len);
  in.loss_mask = b.loss_mask.narrow(0, start, len);
  in.entropy = entropy.narrow(0, start, len);
  in.global_denominator = global_denominator;
  return in;
}

TEST(PolicyLoss, GradientAccumulationMatchesFullBatch) {
  const Batch b = make_batch();
  // Mini-batch denominators of the (5, 7) batch: mask tokens 7 + 3 + 0 + 4 + 1 = 15 (token-mean);
  // non-empty sequences 4 (seq-mean-token-mean, row 2 is empty); all sequences 5 (seq-sum modes).
  const std::pair<LossAgg, double> cases[] = {{LossAgg::kTokenMean, 15.0},
                                              {LossAgg::kSeqMeanTokenMean, 4.0},
                                              {LossAgg::kSeqMeanTokenSum, 5.0},
                                              {LossAgg::kSeqMeanTokenSumNorm, 5.0}};
  for (const auto& [agg, global] : cases) {
    SCOPED_TRACE(enum_to_string(agg));
    const PolicyLossOptions opt = full_options(agg);
    // Whole mini-batch, its own denominators.
    const at::Tensor lp_full = b.logprobs.clone().requires_grad_();
    const at::Tensor ent_full = b.entropy.clone().requires_grad_();
    const PolicyLossOutput full = policy_loss(rows_of(b, lp_full, ent_full, 0, 5, 0.0), opt);
    full.loss.backward();
    ASSERT_TRUE(std::isfinite(val(full.loss)));
    EXPECT_TRUE(near(val(full.dual_clip_frac), 1.0 / 15, kTolF64));  // only token (0, 1)
    // Micro-batches rows [0, 2) and [2, 5) (the second holds the empty row), global denominator.
    const at::Tensor lp_acc = b.logprobs.clone().requires_grad_();
    const at::Tensor ent_acc = b.entropy.clone().requires_grad_();
    double loss_sum = 0.0, pg_sum = 0.0, naive_sum = 0.0;
    const std::pair<int64_t, int64_t> splits[] = {{0, 2}, {2, 3}};  // (first row, rows)
    for (const auto& [start, len] : splits) {
      const PolicyLossOutput micro = policy_loss(rows_of(b, lp_acc, ent_acc, start, len, global), opt);
      micro.loss.backward();  // gradients accumulate into lp_acc / ent_acc
      loss_sum += val(micro.loss);
      pg_sum += val(micro.pg_loss);
      naive_sum += val(policy_loss(rows_of(b, b.logprobs, b.entropy, start, len, 0.0), opt).loss);
    }
    EXPECT_TRUE(near(loss_sum, val(full.loss), kTolF64)) << loss_sum << " vs " << val(full.loss);
    EXPECT_TRUE(near(pg_sum, val(full.pg_loss), kTolF64)) << pg_sum << " vs " << val(full.pg_loss);
    EXPECT_TRUE(near(max_abs_diff(lp_acc.grad(), lp_full.grad()), 0.0, kTolF64));
    EXPECT_TRUE(near(max_abs_diff(ent_acc.grad(), ent_full.grad()), 0.0, kTolF64));
    // Masked positions get exactly zero gradient, even where logprobs_old is -inf / -1e4.
    EXPECT_EQ(val((lp_full.grad() * (1 - b.loss_mask)).abs().sum()), 0.0);
    // Wrong: each micro-batch divided by its own denominator instead of the mini-batch's.
    const at::Tensor lp_own = b.logprobs.clone().requires_grad_();
    const at::Tensor ent_own = b.entropy.clone().requires_grad_();
    for (const auto& [start, len] : splits)
      policy_loss(rows_of(b, lp_own, ent_own, start, len, 0.0), opt).loss.backward();
    EXPECT_FALSE(near(max_abs_diff(lp_own.grad(), lp_full.grad()), 0.0, kTolF64));
    if (agg == LossAgg::kTokenMean) {
      // Known-bad: averaging micro-batch token-means (10 and 5 tokens) weighs the tokens of the second
      // micro-batch twice as much as those of the first, so it is not the mini-batch token-mean.
      EXPECT_FALSE(near(0.5 * naive_sum, val(full.loss), kTolF64)) << 0.5 * naive_sum;
    }
  }
}

TEST(PolicyLoss, GradientMatchesFiniteDifference) {
  // Autograd d loss/d logprobs vs central differences in float64, for the pg term alone (with dual
  // clip) and with each KL estimator and the entropy term added.
  constexpr int64_t S = 3, L = 5;
  at::manual_seed(11);
  const at::Tensor logprobs = -2.0 * at::rand({S, L}, at::kDouble);                 // (S, L)
  at::Tensor logprobs_old = logprobs + 0.3 * at::randn({S, L}, at::kDouble);        // (S, L)
  const at::Tensor logprobs_ref = logprobs + 0.3 * at::randn({S, L}, at::kDouble);  // (S, L)
  at::Tensor advantages = at::randn({S, L}, at::kDouble);                           // (S, L) per token
  logprobs_old[0][0] = logprobs[0][0] - 2.0;  // ratio e^2 = 7.39 > c = 3 with A = -1: dual clip
  advantages[0][0] = -1.0;
  at::Tensor mask = at::ones({S, L}, at::kDouble);
  mask[2].narrow(0, 3, 2).fill_(0.0);  // padding
  const at::Tensor entropy = at::rand({S, L}, at::kDouble);

  struct Config {
    const char* name;
    double kl_coef, entropy_coef;
    KlEstimator est;
  };
  const Config configs[] = {{"pg only", 0.0, 0.0, KlEstimator::kK3},
                            {"k1", 0.1, 0.0, KlEstimator::kK1},
                            {"k2", 0.1, 0.0, KlEstimator::kK2},
                            {"k3 + entropy", 0.1, 0.01, KlEstimator::kK3}};
  for (const Config& c : configs) {
    SCOPED_TRACE(c.name);
    PolicyLossOptions opt = clip_higher();
    opt.clip_c = 3.0;
    opt.kl_coef = c.kl_coef;
    opt.kl_estimator = c.est;
    opt.entropy_coef = c.entropy_coef;
    auto loss_at = [&](const at::Tensor& lp) {
      PolicyLossInputs in;
      in.logprobs = lp;
      in.logprobs_old = logprobs_old;
      in.logprobs_ref = logprobs_ref;
      in.advantages = advantages;
      in.loss_mask = mask;
      in.entropy = entropy;
      return policy_loss(in, opt).loss;
    };
    const at::Tensor lp = logprobs.clone().requires_grad_();
    loss_at(lp).backward();
    const at::Tensor grad = lp.grad();  // (S, L)
    at::Tensor grad_fd = at::zeros({S, L}, at::kDouble);
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t l = 0; l < L; ++l) {
        at::Tensor plus = logprobs.clone(), minus = logprobs.clone();
        plus[s][l] += kFdStep;
        minus[s][l] -= kFdStep;
        grad_fd[s][l] = (val(loss_at(plus)) - val(loss_at(minus))) / (2 * kFdStep);
      }
    }
    EXPECT_TRUE(near(max_abs_diff(grad, grad_fd), 0.0, kFdTol)) << max_abs_diff(grad, grad_fd);
    if (c.kl_coef == 0.0) {
      EXPECT_TRUE(near(val(grad[0][0]), 0.0, kTolF64));  // dual-clipped: no pg gradient
    }
    EXPECT_GT(val(grad.abs().max()), 0.1);  // the comparison is not between two near-zero tensors
    // Wrong: the autograd gradient of a loss without the dual clip and with the next KL estimator
    // (k2 where k3 is asked, k3 where k2, ...) must fail the finite-difference tolerance.
    PolicyLossOptions right = opt;
    opt.clip_c = 0.0;
    opt.kl_estimator = c.est == KlEstimator::kK1   ? KlEstimator::kK2
                       : c.est == KlEstimator::kK2 ? KlEstimator::kK3
                                                   : KlEstimator::kK1;
    const at::Tensor lp_wrong = logprobs.clone().requires_grad_();
    loss_at(lp_wrong).backward();
    opt = right;
    EXPECT_FALSE(near(max_abs_diff(lp_wrong.grad(), grad_fd), 0.0, kFdTol));
  }
}

TEST(PolicyLoss, Metrics) {
  // 4 tokens, A = 1, ratio range [0.8, 1.2], mask [1, 1, 1, 0]; log-ratios [0.5, -0.5, 0.1, 2.0].
  //   token 0: ratio 1.6487 > 1.2 -> pg2 = -1.2 > pg1 = -1.6487: clipped
  //   token 1: ratio 0.6065 < 0.8 -> pg2 = -0.8 < pg1 = -0.6065: unclipped (pessimistic branch)
  //   token 2: ratio 1.1052 inside -> pg1 = pg2: not clipped; token 3 is masked out.
  // clip_frac = 1/3; approx_kl = 0.5*(0.25 + 0.25 + 0.01)/3 = 0.085.
  PolicyLossInputs in;
  in.logprobs = mat({{-2.0 + 0.5, -2.0 - 0.5, -2.0 + 0.1, -2.0 + 2.0}}).requires_grad_();
  in.logprobs_old = mat({{-2.0, -2.0, -2.0, -2.0}});
  in.advantages = vec({1.0});
  in.loss_mask = mat({{1, 1, 1, 0}});
  const PolicyLossOutput out = policy_loss(in, PolicyLossOptions{});
  EXPECT_TRUE(near(val(out.clip_frac), 1.0 / 3, kTolF64)) << val(out.clip_frac);
  EXPECT_TRUE(near(val(out.approx_kl), 0.085, kTolF64)) << val(out.approx_kl);
  // Wrong: the masked token counted: 0.5 (0.25 + 0.25 + 0.01 + 4) / 4 = 0.56375.
  PolicyLossInputs unmasked = in;
  unmasked.loss_mask = at::ones({1, 4}, at::kDouble);
  EXPECT_FALSE(near(val(policy_loss(unmasked, PolicyLossOptions{}).approx_kl), 0.085, kTolF64));
  EXPECT_TRUE(near(val(out.dual_clip_frac), 0.0, kTolF64));
  // pg = [-1.2, -0.6065, -1.1052] -> token-mean = -(1.2 + e^{-0.5} + e^{0.1})/3.
  EXPECT_TRUE(near(val(out.loss), -(1.2 + std::exp(-0.5) + std::exp(0.1)) / 3, kTolF64)) << val(out.loss);
  EXPECT_FALSE(out.entropy.defined());
  EXPECT_TRUE(out.loss.requires_grad());
  for (const at::Tensor* m : {&out.pg_loss, &out.kl, &out.clip_frac, &out.approx_kl, &out.dual_clip_frac}) {
    EXPECT_EQ(m->dim(), 0);
    EXPECT_FALSE(m->requires_grad());
  }
}

TEST(PolicyLoss, SequenceAdvantagesBroadcastLikeTokenAdvantages) {
  const Batch b = make_batch();
  const PolicyLossOptions opt = full_options(LossAgg::kTokenMean);
  PolicyLossInputs in = rows_of(b, b.logprobs, b.entropy, 0, 5, 0.0);
  const double per_seq = val(policy_loss(in, opt).loss);
  in.advantages = b.advantages.unsqueeze(1).expand({5, 7}).contiguous();  // (S, L)
  EXPECT_TRUE(near(val(policy_loss(in, opt).loss), per_seq, kTolF64));
}

TEST(PolicyLoss, Float32) {
  // Same as the first clip case in float32: ratio e^{0.5} -> clipped to 1.28, A=1 -> -1.28.
  PolicyLossInputs in;
  in.logprobs = at::full({1, 1}, -1.5, at::kFloat);
  in.logprobs_old = at::full({1, 1}, -2.0, at::kFloat);
  in.advantages = at::ones({1}, at::kFloat);
  in.loss_mask = at::ones({1, 1}, at::kBool);
  const PolicyLossOutput out = policy_loss(in, clip_higher());
  EXPECT_EQ(out.loss.scalar_type(), at::kFloat);
  EXPECT_TRUE(near(val(out.loss), -1.28, kTolF32)) << val(out.loss);
  // Wrong: a symmetric clip gives -1.2 in float32 too.
  EXPECT_FALSE(near(val(policy_loss(in, PolicyLossOptions{}).loss), -1.28, kTolF32));
}

std::vector<std::string> failed_keys(const PolicyLossOptions& opt) {
  std::vector<std::string> keys;
  opt.check([&](const std::string& key, const std::string& /*why*/) { keys.push_back(key); });
  return keys;
}

TEST(PolicyLossOptions, Check) {
  using Keys = std::vector<std::string>;
  PolicyLossOptions opt;
  EXPECT_EQ(failed_keys(opt), Keys{});
  for (double c : {0.5, 1.0, -1.0}) {
    opt.clip_c = c;
    EXPECT_EQ(failed_keys(opt), Keys{"clip_c"}) << c;
  }
  for (double c : {0.0, 1.0001, 3.0}) {
    opt.clip_c = c;
    EXPECT_EQ(failed_keys(opt), Keys{}) << c;
  }
  opt.agg = LossAgg::kSeqMeanTokenSumNorm;
  for (double n : {0.0, -1.0}) {
    opt.agg_norm = n;
    EXPECT_EQ(failed_keys(opt), Keys{"agg_norm"}) << n;
  }
  opt.agg_norm = 4096.0;
  EXPECT_EQ(failed_keys(opt), Keys{});
  opt.agg = LossAgg::kTokenMean;
  opt.agg_norm = 0.0;  // unused outside the norm mode
  EXPECT_EQ(failed_keys(opt), Keys{});
  // GSPO's per-sequence ratio refuses the per-token mismatch weights; CISPO refuses the sequence
  // ratio and the dual clip.
  opt.ratio_level = RatioLevel::kSequence;
  opt.clip_c = 3.0;  // defined at sequence level: the cap applies to the sequence's surrogate
  EXPECT_EQ(failed_keys(opt), Keys{});
  opt.clip_c = 0.0;
  opt.tis = 2.0;
  EXPECT_EQ(failed_keys(opt), Keys{"tis"});
  opt.tis = 0.0;
  opt.icepop_low = 0.5;
  opt.icepop_high = 2.0;
  EXPECT_EQ(failed_keys(opt), Keys{"icepop_low"});
  opt.icepop_low = opt.icepop_high = 0.0;
  opt.loss = PolicyLossKind::kCispo;
  EXPECT_EQ(failed_keys(opt), Keys{"ratio_level"});
  opt.ratio_level = RatioLevel::kToken;
  EXPECT_EQ(failed_keys(opt), Keys{});
  opt.clip_c = 3.0;
  EXPECT_EQ(failed_keys(opt), Keys{"clip_c"});
  opt.clip_c = 0.0;
  opt.tis = 2.0;  // a constant per-token weight on CISPO's term: allowed
  EXPECT_EQ(failed_keys(opt), Keys{});
}

// Field visitor (fields.h convention) that records the keys and checks each has a doc and a sane range.
struct CollectFields {
  std::vector<std::string>* names;
  void operator()(const char* key, double& /*value*/, const char* doc, FieldRange r) const {
    EXPECT_GT(std::string(doc).size(), 10u) << key;
    EXPECT_LE(r.lo, r.hi) << key;
    names->push_back(key);
  }
  template <class E>
  void operator()(const char* key, E& /*value*/, const char* doc) const {
    EXPECT_GT(std::string(doc).size(), 10u) << key;
    EXPECT_NE(std::string(enum_to_string(E{})), "?") << key;
    names->push_back(key);
  }
};

// Rollout/trainer mismatch corrections on three on-policy tokens (ratio 1, A = 1, token-mean) whose
// sampler log-probs differ from the trainer's: rho = exp(old - rollout) = 1, 4, 1/4. By hand:
//   none             pg = -1, -1, -1              loss -1          d/dlp = -1/3 each
//   tis 2            pg = -1, -2, -1/4            loss -3.25/3     d/dlp = -1/3, -2/3, -1/12
//   icepop [0.5, 2]  pg = -1, 0, 0 (rho 4, 1/4 out) loss -1/3      d/dlp = -1/3, 0, 0
// Wrong: TIS without the cap (weights 1, 4, 1/4) gives -5.25/3; IcePop renormalised over kept tokens -1.
TEST(PolicyLoss, TruncatedImportanceSamplingAndIcePop) {
  auto run = [](const PolicyLossOptions& opt, bool with_rollout = true) {
    PolicyLossInputs in;
    in.logprobs = mat({{-1.0, -2.0, -3.0}}).requires_grad_();
    in.logprobs_old = mat({{-1.0, -2.0, -3.0}});
    if (with_rollout) in.logprobs_rollout = mat({{-1.0, -2.0 - std::log(4.0), -3.0 + std::log(4.0)}});
    in.advantages = vec({1.0});
    in.loss_mask = at::ones({1, 3}, at::kDouble);
    const PolicyLossOutput out = policy_loss(in, opt);
    out.loss.backward();
    return std::make_tuple(out, in.logprobs.grad());
  };
  PolicyLossOptions none;
  auto [o0, g0] = run(none, false);
  EXPECT_TRUE(near(val(o0.loss), -1.0, kTolF64));
  EXPECT_EQ(val(o0.tis_clip_frac), 0.0);
  PolicyLossOptions tis;
  tis.tis = 2.0;
  auto [o1, g1] = run(tis);
  EXPECT_TRUE(near(val(o1.loss), -3.25 / 3, kTolF64)) << val(o1.loss);
  EXPECT_FALSE(near(-5.25 / 3, -3.25 / 3, kTolF64)) << "an uncapped weight is told apart";
  EXPECT_TRUE(near(val(o1.pg_loss), -3.25 / 3, kTolF64)) << "pg_loss carries the weight too: still == loss";
  EXPECT_TRUE(near(max_abs_diff(g1, mat({{-1.0 / 3, -2.0 / 3, -1.0 / 12}})), 0.0, kTolF64)) << g1;
  EXPECT_TRUE(near(val(o1.tis_clip_frac), 1.0 / 3, kTolF64));
  PolicyLossOptions ice;
  ice.icepop_low = 0.5;
  ice.icepop_high = 2.0;
  auto [o2, g2] = run(ice);
  EXPECT_TRUE(near(val(o2.loss), -1.0 / 3, kTolF64)) << val(o2.loss);
  EXPECT_FALSE(near(-1.0, -1.0 / 3, kTolF64)) << "renormalising over the kept tokens is told apart";
  EXPECT_TRUE(near(max_abs_diff(g2, mat({{-1.0 / 3, 0.0, 0.0}})), 0.0, kTolF64)) << g2;
  EXPECT_TRUE(near(val(o2.icepop_frac), 2.0 / 3, kTolF64));
  // Both need the sampler's log-probs, and their options keep 1 inside.
  EXPECT_THROW(run(tis, false), c10::Error);
  PolicyLossOptions bad = tis;
  bad.tis = 0.5;
  EXPECT_THROW(run(bad), c10::Error);
  bad = ice;
  bad.icepop_low = 1.5;
  EXPECT_THROW(run(bad), c10::Error);
}

TEST(PolicyLossOptions, VisitListsEveryFieldAndEnumNames) {
  PolicyLossOptions opt;
  std::vector<std::string> names;
  opt.visit(CollectFields{&names});
  EXPECT_EQ(names, (std::vector<std::string>{"clip_eps_low", "clip_eps_high", "clip_c", "kl_coef", "kl_estimator",
                                             "entropy_coef", "agg", "agg_norm", "tis", "icepop_low", "icepop_high",
                                             "ratio_level", "loss"}));
  EXPECT_STREQ(enum_to_string(RatioLevel::kSequence), "sequence");
  EXPECT_STREQ(enum_to_string(PolicyLossKind::kCispo), "cispo");
  EXPECT_STREQ(enum_to_string(KlEstimator::kK2), "k2");
  EXPECT_STREQ(enum_to_string(LossAgg::kTokenMean), "token-mean");
  EXPECT_STREQ(enum_to_string(LossAgg::kSeqMeanTokenMean), "seq-mean-token-mean");
  EXPECT_STREQ(enum_to_string(LossAgg::kSeqMeanTokenSum), "seq-mean-token-sum");
  EXPECT_STREQ(enum_to_string(LossAgg::kSeqMeanTokenSumNorm), "seq-mean-token-sum-norm");
}

TEST(PolicyLoss, RejectsBadInputsAndOptions) {
  const Batch b = make_batch();
  const PolicyLossInputs good = rows_of(b, b.logprobs, b.entropy, 0, 5, 0.0);
  const PolicyLossOptions opt = full_options(LossAgg::kTokenMean);
  EXPECT_NO_THROW(policy_loss(good, opt));
  PolicyLossInputs in = good;
  in.logprobs_old = b.logprobs_old.narrow(1, 0, 6);  // (S, L-1)
  EXPECT_THROW(policy_loss(in, opt), c10::Error);
  in = good;
  in.advantages = vec({1, 2, 3, 4, 5, 6});  // (S+1)
  EXPECT_THROW(policy_loss(in, opt), c10::Error);
  in = good;
  in.loss_mask = b.loss_mask.narrow(0, 0, 4);
  EXPECT_THROW(policy_loss(in, opt), c10::Error);
  in = good;
  in.logprobs = b.logprobs.to(at::kLong);  // integer log-probs
  EXPECT_THROW(policy_loss(in, opt), c10::Error);
  in = good;
  in.logprobs_ref = at::Tensor();  // kl_coef != 0 needs a reference
  EXPECT_THROW(policy_loss(in, opt), c10::Error);
  in = good;
  in.entropy = at::Tensor();  // entropy_coef != 0 needs entropy
  EXPECT_THROW(policy_loss(in, opt), c10::Error);
  PolicyLossOptions bad = opt;
  bad.clip_c = 0.5;  // check(): clip_c in (0, 1]
  EXPECT_THROW(policy_loss(good, bad), c10::Error);
  bad = opt;
  bad.clip_eps_low = 1.5;  // range [0, 1]
  EXPECT_THROW(policy_loss(good, bad), c10::Error);
  bad = opt;
  bad.agg = LossAgg::kSeqMeanTokenSumNorm;
  bad.agg_norm = 0.0;  // check(): norm mode needs agg_norm > 0
  EXPECT_THROW(policy_loss(good, bad), c10::Error);
}

PolicyLossOptions gspo(double eps_low, double eps_high) {
  PolicyLossOptions opt;
  opt.ratio_level = RatioLevel::kSequence;
  opt.clip_eps_low = eps_low;
  opt.clip_eps_high = eps_high;
  opt.agg = LossAgg::kSeqMeanTokenMean;
  return opt;
}

TEST(PolicyLossGspo, RatioIsExpOfMeanLogRatio) {
  // Sequence 0: log-ratios [0.1, -0.3, 0.05], all masked in, A = 1.
  // Sequence 1: log-ratios [0.2, 0.4, 5.0], mask [1, 1, 0], A = -0.5.
  //   s_0 = exp((0.1 - 0.3 + 0.05) / 3) = exp(-0.05),  s_1 = exp((0.2 + 0.4) / 2) = exp(0.3).
  // Clip range [0.1, 11]: no clipping, so each token's pg = -A_i s_i; seq-mean-token-mean:
  //   loss = (-1 * s_0 + 0.5 * s_1) / 2.
  PolicyLossInputs in;
  in.logprobs = mat({{-2.0 + 0.1, -2.0 - 0.3, -2.0 + 0.05}, {-2.0 + 0.2, -2.0 + 0.4, -2.0 + 5.0}}).requires_grad_();
  in.logprobs_old = mat({{-2.0, -2.0, -2.0}, {-2.0, -2.0, -2.0}});
  in.advantages = vec({1.0, -0.5});
  in.loss_mask = mat({{1, 1, 1}, {1, 1, 0}});
  const PolicyLossOutput out = policy_loss(in, gspo(0.9, 10.0));
  auto loss_of = [](double s0, double s1) { return (-1.0 * s0 + 0.5 * s1) / 2; };
  const double want = loss_of(std::exp(-0.05), std::exp(0.3));
  EXPECT_TRUE(near(val(out.loss), want, kTolF64)) << val(out.loss) << " vs " << want;
  // Wrong: the mean of the ratios, the exp of the summed log-ratios, the padding token counted.
  const double mean_of_ratios =
      loss_of((std::exp(0.1) + std::exp(-0.3) + std::exp(0.05)) / 3, (std::exp(0.2) + std::exp(0.4)) / 2);
  const double exp_of_sum = loss_of(std::exp(-0.15), std::exp(0.6));
  const double unmasked = loss_of(std::exp(-0.05), std::exp((0.2 + 0.4 + 5.0) / 3));
  for (double wrong : {mean_of_ratios, exp_of_sum, unmasked}) {
    EXPECT_FALSE(near(val(out.loss), wrong, kTolF64)) << wrong;
  }
}

TEST(PolicyLossGspo, ClipFractionCountsSequences) {
  // GSPO's tiny range [1 - 3e-4, 1 + 4e-4]; advantages per sequence; seq-mean-token-mean.
  //   seq 0: 3 tokens, log-ratios [0.02, 0.01, 0.0], mean 0.01, A = 1: s = e^0.01 > 1.0004 -> clipped,
  //          pg = -1.0004 on each token.
  //   seq 1: 1 token, log-ratio -0.01, A = 1: s = e^-0.01 < 0.9997 -> pg = max(-s, -0.9997) = -s.
  //   seq 2: no mask token (ignored by the aggregation and by the clip fraction).
  //   seq 3: 2 tokens, log-ratios [-0.02, 0.0], mean -0.01, A = -1: pg = max(s, 0.9997) = 0.9997 ->
  //          clipped.
  // clip_frac = 2 clipped / 3 non-empty sequences; loss = (-1.0004 - e^-0.01 + 0.9997) / 3.
  PolicyLossInputs in;
  in.logprobs = mat({{-1.0 + 0.02, -1.0 + 0.01, -1.0},
                     {-1.0 - 0.01, -1.0, -1.0},
                     {-1.0 + 0.5, -1.0, -1.0},
                     {-1.0 - 0.02, -1.0, -1.0}})
                    .requires_grad_();
  in.logprobs_old = at::full({4, 3}, -1.0, at::kDouble);
  in.advantages = vec({1.0, 1.0, 1.0, -1.0});
  in.loss_mask = mat({{1, 1, 1}, {1, 0, 0}, {0, 0, 0}, {1, 1, 0}});
  const PolicyLossOutput out = policy_loss(in, gspo(3e-4, 4e-4));
  EXPECT_TRUE(near(val(out.clip_frac), 2.0 / 3, kTolF64)) << val(out.clip_frac);
  // Wrong: weighted by mask tokens (5 of 6), or with the empty sequence counted (2 of 4).
  EXPECT_FALSE(near(val(out.clip_frac), 5.0 / 6, kTolF64));
  EXPECT_FALSE(near(val(out.clip_frac), 2.0 / 4, kTolF64));
  const double want = (-1.0004 - std::exp(-0.01) + 0.9997) / 3;
  EXPECT_TRUE(near(val(out.loss), want, kTolF64)) << val(out.loss) << " vs " << want;
  // Wrong: the symmetric default range [0.8, 1.2] clips nothing: (-e^0.01 - e^-0.01 + e^-0.01) / 3.
  EXPECT_FALSE(near(val(policy_loss(in, gspo(0.2, 0.2)).loss), want, kTolF64));
  out.loss.backward();
  // The clipped sequences 0 and 3 get no gradient; sequence 1's token gets -A s / (1 token * 3 seqs).
  const at::Tensor g = in.logprobs.grad();
  EXPECT_TRUE(near(val(g[0].abs().sum() + g[3].abs().sum()), 0.0, kTolF64));
  EXPECT_TRUE(near(val(g[1][0]), -std::exp(-0.01) / 3, kTolF64)) << val(g[1][0]);
}

TEST(PolicyLossGspo, GradientMatchesFiniteDifference) {
  // Autograd d loss/d logprobs vs float64 central differences for the sequence-level ratio, with one
  // clipped sequence (0), padding (sequence 2) and two aggregations.
  constexpr int64_t S = 3, L = 5;
  at::manual_seed(12);
  const at::Tensor logprobs = -2.0 * at::rand({S, L}, at::kDouble);           // (S, L)
  at::Tensor logprobs_old = logprobs + 0.3 * at::randn({S, L}, at::kDouble);  // (S, L)
  logprobs_old[0] = logprobs[0] - 0.5;                                        // s_0 = e^0.5 > 1.28 with A = 1: clipped
  const at::Tensor advantages = vec({1.0, -0.7, 1.3});
  at::Tensor mask = at::ones({S, L}, at::kDouble);
  mask[2].narrow(0, 3, 2).fill_(0.0);  // padding
  for (LossAgg agg : {LossAgg::kTokenMean, LossAgg::kSeqMeanTokenMean}) {
    SCOPED_TRACE(enum_to_string(agg));
    PolicyLossOptions opt = clip_higher();
    opt.ratio_level = RatioLevel::kSequence;
    opt.agg = agg;
    auto loss_at = [&](const at::Tensor& lp, const PolicyLossOptions& o) {
      PolicyLossInputs in;
      in.logprobs = lp;
      in.logprobs_old = logprobs_old;
      in.advantages = advantages;
      in.loss_mask = mask;
      return policy_loss(in, o).loss;
    };
    const at::Tensor lp = logprobs.clone().requires_grad_();
    loss_at(lp, opt).backward();
    const at::Tensor grad = lp.grad();  // (S, L)
    at::Tensor grad_fd = at::zeros({S, L}, at::kDouble);
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t l = 0; l < L; ++l) {
        at::Tensor plus = logprobs.clone(), minus = logprobs.clone();
        plus[s][l] += kFdStep;
        minus[s][l] -= kFdStep;
        grad_fd[s][l] = (val(loss_at(plus, opt)) - val(loss_at(minus, opt))) / (2 * kFdStep);
      }
    }
    EXPECT_TRUE(near(max_abs_diff(grad, grad_fd), 0.0, kFdTol)) << max_abs_diff(grad, grad_fd);
    EXPECT_TRUE(near(val(grad[0].abs().sum()), 0.0, kTolF64));  // clipped sequence: no gradient
    EXPECT_GT(val(grad.abs().max()), 0.05);                     // not two near-zero tensors
    // Wrong: a detached sequence ratio (no gradient at all), and each token's own ratio (token level).
    EXPECT_FALSE(near(max_abs_diff(at::zeros_like(grad_fd), grad_fd), 0.0, kFdTol));
    PolicyLossOptions token = opt;
    token.ratio_level = RatioLevel::kToken;
    const at::Tensor lp_wrong = logprobs.clone().requires_grad_();
    loss_at(lp_wrong, token).backward();
    EXPECT_FALSE(near(max_abs_diff(lp_wrong.grad(), grad_fd), 0.0, kFdTol));
  }
}

TEST(PolicyLossGspo, OneTokenSequenceEqualsTokenLevel) {
  // A sequence with a single mask token has s = r, so sequence level is token-level PPO (clip-higher
  // and dual clip included). A padding position after it holds log-ratio 5, which must not count.
  // Wrong: the mean taken over L = 2 positions with the padding's log-ratio zeroed, s = exp(lr / 2).
  const double cases[][2] = {{0.1, 1.0}, {-0.5, 1.0}, {1.5, -1.0}, {0.05, -1.0}, {-0.4, -2.0}};
  for (const auto& c : cases) {
    const double lr = c[0], adv = c[1];
    SCOPED_TRACE("log-ratio " + std::to_string(lr) + ", A " + std::to_string(adv));
    PolicyLossOptions opt = clip_higher();
    opt.clip_c = 3.0;
    const OneToken tok = one_token(lr, adv, opt);
    opt.ratio_level = RatioLevel::kSequence;
    PolicyLossInputs in;
    in.logprobs = mat({{-2.0 + lr, -2.0 + 5.0}}).requires_grad_();
    in.logprobs_old = mat({{-2.0, -2.0}});
    in.advantages = vec({adv});
    in.loss_mask = mat({{1, 0}});
    const PolicyLossOutput out = policy_loss(in, opt);
    out.loss.backward();
    EXPECT_TRUE(near(val(out.loss), tok.loss, kTolF64)) << val(out.loss) << " vs " << tok.loss;
    EXPECT_TRUE(near(val(in.logprobs.grad()[0][0]), tok.dloss_dlogprob, kTolF64));
    EXPECT_TRUE(near(val(in.logprobs.grad()[0][1]), 0.0, kTolF64));
    EXPECT_TRUE(near(val(out.clip_frac), tok.clip_frac, kTolF64));
    EXPECT_TRUE(near(val(out.dual_clip_frac), tok.dual_clip_frac, kTolF64));
    const double half = std::exp(lr / 2);
    double wrong = std::max(-adv * half, -adv * std::clamp(half, 0.8, 1.28));
    if (adv < 0) wrong = std::min(wrong, -adv * 3.0);
    EXPECT_FALSE(near(val(out.loss), wrong, kTolF64)) << wrong;
  }
}

TEST(PolicyLossCispo, WeightCarriesNoGradient) {
  // Tokens (logprobs_old = -1, A per sequence [1, -2], mask [[1, 1, 1], [1, 1, 0]], range [0.8, 1.28]):
  //   log-ratios [0.5, 0.1, -0.5] and [0.2, -0.1, (padding: logprob -inf)].
  //   w = clamp(e^lr) = [1.28, e^0.1, 0.8] and [e^0.2, e^-0.1]: tokens 0 and 2 of sequence 0 clamped.
  // token-mean over D = 5 tokens: loss = -sum w A logprob / 5, d loss / d logprob = -w A / 5.
  const double lr[2][3] = {{0.5, 0.1, -0.5}, {0.2, -0.1, 0.0}};
  const double adv[2] = {1.0, -2.0};
  PolicyLossInputs in;
  in.logprobs =
      mat({{-1.0 + lr[0][0], -1.0 + lr[0][1], -1.0 + lr[0][2]}, {-1.0 + lr[1][0], -1.0 + lr[1][1], -INFINITY}})
          .requires_grad_();
  in.logprobs_old = at::full({2, 3}, -1.0, at::kDouble);
  in.advantages = vec({adv[0], adv[1]});
  in.loss_mask = mat({{1, 1, 1}, {1, 1, 0}});
  PolicyLossOptions opt = clip_higher();
  opt.loss = PolicyLossKind::kCispo;
  const PolicyLossOutput out = policy_loss(in, opt);
  out.loss.backward();
  const at::Tensor grad = in.logprobs.grad();
  at::Tensor want_grad = at::zeros({2, 3}, at::kDouble), wrong_grad = at::zeros({2, 3}, at::kDouble);
  double want_loss = 0.0;
  for (int s = 0; s < 2; ++s) {
    for (int t = 0; t < (s == 0 ? 3 : 2); ++t) {
      const double r = std::exp(lr[s][t]), lp = -1.0 + lr[s][t];
      const double w = std::clamp(r, 0.8, 1.28);
      const double dw = (r > 0.8 && r < 1.28) ? r : 0.0;  // d w / d logprob where w is not detached
      want_loss += -w * adv[s] * lp / 5;
      want_grad[s][t] = -w * adv[s] / 5;
      // Wrong: the weight carries gradient, d/dlp (w A lp) = A (dw lp + w).
      wrong_grad[s][t] = -adv[s] * (dw * lp + w) / 5;
    }
  }
  EXPECT_TRUE(near(val(out.loss), want_loss, kTolF64)) << val(out.loss) << " vs " << want_loss;
  EXPECT_TRUE(near(max_abs_diff(grad, want_grad), 0.0, kTolF64)) << max_abs_diff(grad, want_grad);
  EXPECT_FALSE(near(max_abs_diff(grad, wrong_grad), 0.0, kTolF64));
  // Every token keeps a gradient, clamped ones too (PPO would zero tokens 0 and 2 of sequence 0).
  EXPECT_GT(std::abs(val(grad[0][0])), 0.1);
  EXPECT_GT(std::abs(val(grad[0][2])), 0.1);
  // Wrong: PPO's clipped surrogate on the same tokens gives them no gradient.
  const at::Tensor lp_ppo = in.logprobs.detach().clone().requires_grad_();
  PolicyLossInputs ppo_in = in;
  ppo_in.logprobs = lp_ppo;
  policy_loss(ppo_in, clip_higher()).loss.backward();
  EXPECT_FALSE(near(max_abs_diff(lp_ppo.grad(), want_grad), 0.0, kTolF64));
  // clip_frac: the share of mask tokens whose weight was clamped, 2 of 5 (PPO's branch rule gives 1 of
  // 5: token 2 of sequence 0 has A > 0 and r < 0.8, where PPO keeps the unclipped branch).
  EXPECT_TRUE(near(val(out.clip_frac), 2.0 / 5, kTolF64)) << val(out.clip_frac);
  EXPECT_FALSE(near(val(out.clip_frac), 1.0 / 5, kTolF64));
}

}  // namespace
}  // namespace rlt
