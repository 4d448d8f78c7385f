// Clipped-surrogate policy loss and loss aggregation; the math and the denominators are documented in
// policy_loss.h. Everything stays on the device of logprobs: no .item(), no host sync.
#include "loss/policy_loss.h"

#include <ATen/core/grad_mode.h>  // at::NoGradGuard (not pulled in by ATen/ATen.h)

#include <algorithm>
#include <cmath>
#include <string>

namespace rlt {

void PolicyLossOptions::check(const FieldFail& fail) const {
  // c <= 1 would cap the loss of A < 0 tokens at or below its on-policy value -A (ratio 1), zeroing
  // the gradient of tokens still inside the trust region (Ye et al. 2020 require c > 1).
  if (clip_c != 0.0 && !(clip_c > 1.0)) fail("clip_c", "must be 0 (off) or > 1 (typically 3)");
  if (agg == LossAgg::kSeqMeanTokenSumNorm && !(agg_norm > 0.0)) {
    fail("agg_norm", "must be > 0 when agg is seq-mean-token-sum-norm (e.g. the max response length)");
  }
  if (tis != 0.0 && tis < 1.0) fail("tis", "must be 0 (off) or >= 1: a cap below 1 shrinks on-policy tokens too");
  const bool icepop = icepop_low != 0.0 || icepop_high != 0.0;
  if (icepop && !(icepop_low > 0.0 && icepop_low <= 1.0 && icepop_high >= 1.0)) {
    fail("icepop_high",
         "the band [icepop_low, icepop_high] must hold 1 with icepop_low > 0 (e.g. 0.5 and 2), or both 0");
  }
  // TIS/IcePop weigh tokens by a per-token rho; on a per-sequence ratio their level would be mixed.
  if (ratio_level == RatioLevel::kSequence && tis != 0.0) {
    fail("tis", "must be 0 with ratio_level: sequence (rho is per token, the GSPO ratio per sequence)");
  }
  if (ratio_level == RatioLevel::kSequence && icepop) {
    fail("icepop_low", "icepop_low and icepop_high must be 0 with ratio_level: sequence (rho is per token)");
  }
  if (loss == PolicyLossKind::kCispo && ratio_level != RatioLevel::kToken) {
    fail("ratio_level", "must be token with loss: cispo (CISPO weighs each token by its own ratio)");
  }
  // CISPO's weight is already capped at 1 + clip_eps_high, so the dual clip would never bind.
  if (loss == PolicyLossKind::kCispo && clip_c != 0.0) fail("clip_c", "must be 0 with loss: cispo");
}

namespace {

// Range check of every numeric option from visit(), so options built in code (not read from YAML)
// are checked as strictly as the config reader checks them.
void validate(const PolicyLossOptions& opt) {
  PolicyLossOptions copy = opt;  // visit() is non-const by the fields.h convention (the reader writes)
  rlt::validate(copy, [](const std::string& key, const std::string& why) {
    TORCH_CHECK(false, "policy_loss: option ", key, ": ", why);
  });
}

// t must be defined, floating, on logprobs' device and of logprobs' shape (S, R).
void check_like_logprobs(const at::Tensor& t, const at::Tensor& logprobs, const char* name) {
  TORCH_CHECK(t.defined(), "policy_loss: ", name, " is required here but undefined");
  TORCH_CHECK(t.sizes() == logprobs.sizes(), "policy_loss: ", name, " has shape ", t.sizes(),
              ", expected (S, L) = ", logprobs.sizes(), " like logprobs");
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), "policy_loss: ", name, " must be floating, got ", t.scalar_type());
  TORCH_CHECK(t.device() == logprobs.device(), "policy_loss: ", name, " is on ", t.device(), ", logprobs on ",
              logprobs.device());
}

// Masked token mean over this micro-batch, for metrics: sum(where(valid, x, 0)) / max(#valid, 1).
at::Tensor masked_token_mean(const at::Tensor& x /*(S, R) floating*/, const at::Tensor& valid /*(S, R) bool*/) {
  const at::Tensor count = valid.sum().to(x.scalar_type()).clamp_min(1.0);  // ()
  return at::where(valid, x, 0.0).sum() / count;
}

}  // namespace

at::Tensor aggregate_loss(const at::Tensor& per_token, const at::Tensor& loss_mask, LossAgg agg, double agg_norm,
                          double global_denominator) {
  TORCH_CHECK(per_token.defined() && per_token.dim() == 2, "aggregate_loss: per_token must be (S, L), got ",
              per_token.defined() ? per_token.sizes() : at::IntArrayRef{});
  TORCH_CHECK(at::isFloatingType(per_token.scalar_type()), "aggregate_loss: per_token must be floating, got ",
              per_token.scalar_type());
  TORCH_CHECK(loss_mask.defined() && loss_mask.sizes() == per_token.sizes(),
              "aggregate_loss: loss_mask must be (S, L) = ", per_token.sizes(), ", got ",
              loss_mask.defined() ? loss_mask.sizes() : at::IntArrayRef{});
  TORCH_CHECK(!at::isComplexType(loss_mask.scalar_type()), "aggregate_loss: loss_mask must be real");
  TORCH_CHECK(loss_mask.device() == per_token.device(), "aggregate_loss: loss_mask is on ", loss_mask.device(),
              ", per_token on ", per_token.device());
  TORCH_CHECK(std::isfinite(global_denominator), "aggregate_loss: global_denominator must be finite, got ",
              global_denominator);
  const auto dtype = per_token.scalar_type();
  const bool global = global_denominator > 0.0;
  const at::Tensor valid = loss_mask != 0;                                        // (S, R) bool
  const at::Tensor masked = at::where(valid, per_token, 0.0);                     // (S, R) exactly 0 outside the mask
  const double num_seqs = std::max(static_cast<double>(per_token.size(0)), 1.0);  // S, clamped >= 1

  switch (agg) {
    case LossAgg::kTokenMean: {
      if (global) return masked.sum() / global_denominator;
      return masked.sum() / valid.sum().to(dtype).clamp_min(1.0);
    }
    case LossAgg::kSeqMeanTokenMean: {
      const at::Tensor seq_count = valid.sum(/*dim=*/1).to(dtype);                   // (S) tokens per seq
      const at::Tensor seq_mean = masked.sum(/*dim=*/1) / seq_count.clamp_min(1.0);  // (S) 0 if empty
      if (global) return seq_mean.sum() / global_denominator;
      return seq_mean.sum() / (seq_count > 0).sum().to(dtype).clamp_min(1.0);
    }
    case LossAgg::kSeqMeanTokenSum:
      return masked.sum() / (global ? global_denominator : num_seqs);
    case LossAgg::kSeqMeanTokenSumNorm:
      TORCH_CHECK(agg_norm > 0.0, "aggregate_loss: agg_norm must be > 0 for seq-mean-token-sum-norm, got ", agg_norm);
      return masked.sum() / (agg_norm * (global ? global_denominator : num_seqs));
  }
  TORCH_CHECK(false, "aggregate_loss: unknown LossAgg ", static_cast<int>(agg));
  return {};
}

PolicyLossOutput policy_loss(const PolicyLossInputs& in, const PolicyLossOptions& opt) {
  validate(opt);
  const at::Tensor& logprobs = in.logprobs;  // (S, R)
  TORCH_CHECK(logprobs.defined(), "policy_loss: logprobs is undefined");
  TORCH_CHECK(logprobs.dim() == 2, "policy_loss: logprobs must be (S, L), got ", logprobs.sizes());
  const auto dtype = logprobs.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble, "policy_loss: logprobs must be float32 or float64, got ",
              dtype);
  const int64_t S = logprobs.size(0);
  check_like_logprobs(in.logprobs_old, logprobs, "logprobs_old");
  TORCH_CHECK(in.loss_mask.defined(), "policy_loss: loss_mask is undefined");
  TORCH_CHECK(in.loss_mask.sizes() == logprobs.sizes(), "policy_loss: loss_mask has shape ", in.loss_mask.sizes(),
              ", expected (S, L) = ", logprobs.sizes());
  TORCH_CHECK(in.loss_mask.device() == logprobs.device(), "policy_loss: loss_mask is on ", in.loss_mask.device(),
              ", logprobs on ", logprobs.device());
  TORCH_CHECK(in.advantages.defined(), "policy_loss: advantages is undefined");
  TORCH_CHECK((in.advantages.dim() == 1 && in.advantages.size(0) == S) ||
                  (in.advantages.dim() == 2 && in.advantages.sizes() == logprobs.sizes()),
              "policy_loss: advantages must be (S) or (S, L) with (S, L) = ", logprobs.sizes(), ", got ",
              in.advantages.sizes());
  TORCH_CHECK(at::isFloatingType(in.advantages.scalar_type()), "policy_loss: advantages must be floating, got ",
              in.advantages.scalar_type());
  TORCH_CHECK(in.advantages.device() == logprobs.device(), "policy_loss: advantages is on ", in.advantages.device(),
              ", logprobs on ", logprobs.device());
  const bool use_kl = opt.kl_coef != 0.0;
  const bool use_entropy = opt.entropy_coef != 0.0;
  TORCH_CHECK(!use_kl || in.logprobs_ref.defined(), "policy_loss: logprobs_ref is required when kl_coef != 0");
  TORCH_CHECK(!use_entropy || in.entropy.defined(), "policy_loss: entropy is required when entropy_coef != 0");
  if (in.logprobs_ref.defined()) check_like_logprobs(in.logprobs_ref, logprobs, "logprobs_ref");
  if (in.entropy.defined()) check_like_logprobs(in.entropy, logprobs, "entropy");
  const bool use_tis = opt.tis != 0.0, use_icepop = opt.icepop_low != 0.0 || opt.icepop_high != 0.0;
  TORCH_CHECK(!(use_tis || use_icepop) || in.logprobs_rollout.defined(),
              "policy_loss: logprobs_rollout is required with tis or icepop");
  if (use_tis || use_icepop) check_like_logprobs(in.logprobs_rollout, logprobs, "logprobs_rollout");

  const at::Tensor valid = in.loss_mask != 0;  // (S, R) bool
  // Behaviour log-probs and advantages are constants of the surrogate: detached in case a caller
  // passes tensors still attached to a graph.
  const at::Tensor logprobs_old = in.logprobs_old.detach().to(dtype);  // (S, R)
  at::Tensor advantages = in.advantages.detach().to(dtype);            // (S, R) or (S)
  if (advantages.dim() == 1) advantages = advantages.unsqueeze(1);     // (S, 1) broadcasts over R

  // Zeroed outside the mask before exp(): padding may hold -inf or large policy gaps; where() keeps
  // both the forward value and the gradient there exactly 0 (no inf * 0 = NaN in backward).
  const at::Tensor log_ratio = at::where(valid, logprobs - logprobs_old, 0.0);  // (S, R)
  const bool seq_level = opt.ratio_level == RatioLevel::kSequence;
  const at::Tensor seq_tokens = valid.sum(/*dim=*/1, /*keepdim=*/true).to(dtype);  // (S, 1) mask tokens
  // GSPO: exp of the mean log-ratio over the sequence's mask tokens (count clamped to >= 1: an empty
  // sequence gets ratio 1 and no term), broadcast to its tokens; the gradient flows into each token.
  const at::Tensor ratio = seq_level ? at::exp(log_ratio.sum(/*dim=*/1, /*keepdim=*/true) / seq_tokens.clamp_min(1.0))
                                     : at::exp(log_ratio);  // (S, 1) or (S, R)
  const at::Tensor ratio_clamped = at::clamp(ratio, 1.0 - opt.clip_eps_low, 1.0 + opt.clip_eps_high);
  const bool cispo = opt.loss == PolicyLossKind::kCispo;
  at::Tensor pg_unclipped, pg_clipped, pg_max, pg;  // (S, R); the first three for ppo_clip only
  at::Tensor dual_bound;                            // (S, R) or (S, 1)
  if (cispo) {
    // CISPO: the clipped ratio is a detached weight on the log-prob's gradient. logprobs is zeroed
    // outside the mask so that -inf padding gives no NaN gradient through the product.
    pg = -advantages * ratio_clamped.detach() * at::where(valid, logprobs, 0.0);
  } else {
    // expand(): with a per-sequence ratio and advantages both are (S, 1).
    pg_unclipped = (-advantages * ratio).expand({S, logprobs.size(1)});        // (S, R)
    pg_clipped = (-advantages * ratio_clamped).expand({S, logprobs.size(1)});  // (S, R)
    // Pessimistic bound (PPO eq. 7 as a loss): the larger loss. At a tie (ratio inside the clip range)
    // maximum() splits the gradient half/half between two identical branches: the full gradient.
    pg_max = at::maximum(pg_unclipped, pg_clipped);  // (S, R)
    pg = pg_max;
    if (opt.clip_c > 1.0) {
      // Dual clip (Ye et al. 2020, eq. 5): for A < 0 the loss -A*r grows without bound in r; cap it
      // at -A*c so a few stale tokens with huge ratios cannot dominate the update.
      dual_bound = -advantages * opt.clip_c;
      pg = at::where(advantages < 0, at::minimum(pg_max, dual_bound), pg_max);
    }
  }
  // Rollout/trainer mismatch: rho = pi_old / pi_rollout per token, a constant weight on the surrogate.
  at::Tensor rho;  // (S, R), defined with tis or icepop
  if (use_tis || use_icepop) {
    rho = at::exp(at::where(valid, logprobs_old - in.logprobs_rollout.detach().to(dtype), 0.0));
    if (use_tis) pg = pg * at::clamp_max(rho, opt.tis);
    if (use_icepop) pg = at::where((rho >= opt.icepop_low) & (rho <= opt.icepop_high), pg, 0.0);
  }
  at::Tensor per_token = pg;  // (S, R)

  at::Tensor kl_tok;  // (S, R), defined iff logprobs_ref is given
  if (in.logprobs_ref.defined()) {
    // With kl_coef = 0 it is a metric only: no graph through logprobs.
    const at::Tensor lp = use_kl ? logprobs : logprobs.detach();
    const at::Tensor log_q = at::where(valid, in.logprobs_ref.detach().to(dtype) - lp, 0.0);  // (S, R)
    switch (opt.kl_estimator) {
      case KlEstimator::kK1:
        kl_tok = -log_q;
        break;
      case KlEstimator::kK2:
        kl_tok = 0.5 * log_q * log_q;
        break;
      case KlEstimator::kK3:
        kl_tok = at::exp(log_q) - 1.0 - log_q;
        break;
    }
    if (use_kl) per_token = per_token + opt.kl_coef * kl_tok;
  }
  at::Tensor entropy_tok;  // (S, R), defined iff entropy is given
  if (in.entropy.defined()) {
    entropy_tok = at::where(valid, use_entropy ? in.entropy.to(dtype) : in.entropy.detach().to(dtype), 0.0);
    if (use_entropy) per_token = per_token - opt.entropy_coef * entropy_tok;
  }

  PolicyLossOutput out;
  out.loss = aggregate_loss(per_token, valid, opt.agg, opt.agg_norm, in.global_denominator);

  at::NoGradGuard no_grad;
  out.pg_loss = aggregate_loss(pg.detach(), valid, opt.agg, opt.agg_norm, in.global_denominator);
  out.kl = kl_tok.defined() ? masked_token_mean(kl_tok.detach(), valid) : at::zeros({}, logprobs.options());
  if (entropy_tok.defined()) out.entropy = masked_token_mean(entropy_tok.detach(), valid);
  if (cispo) {
    out.clip_frac = masked_token_mean((ratio_clamped != ratio).to(dtype), valid);
  } else if (seq_level) {
    // A sequence counts as clipped when the clipped branch is taken at any of its mask tokens.
    const at::Tensor taken = ((pg_clipped > pg_unclipped) & valid).any(/*dim=*/1);  // (S) bool
    const at::Tensor nonempty = seq_tokens.squeeze(1) > 0;                          // (S) bool
    out.clip_frac = (taken & nonempty).sum().to(dtype) / nonempty.sum().to(dtype).clamp_min(1.0);
  } else {
    out.clip_frac = masked_token_mean((pg_clipped > pg_unclipped).to(dtype), valid);
  }
  out.approx_kl = masked_token_mean(0.5 * log_ratio.detach() * log_ratio.detach(), valid);
  out.dual_clip_frac = dual_bound.defined()
                           ? masked_token_mean(((advantages < 0) & (pg_max > dual_bound)).to(dtype), valid)
                           : at::zeros({}, logprobs.options());
  const at::Tensor zero = at::zeros({}, logprobs.options());
  out.tis_clip_frac = use_tis ? masked_token_mean((rho > opt.tis).to(dtype), valid) : zero;
  out.icepop_frac =
      use_icepop ? masked_token_mean(((rho < opt.icepop_low) | (rho > opt.icepop_high)).to(dtype), valid) : zero;
  return out;
}

}  // namespace rlt
