// Clipped-surrogate policy loss for RL post-training (PPO / GRPO / DAPO / Dr. GRPO variants) on
// precomputed per-token log-probs, with an optional KL penalty to a reference policy, an entropy bonus
// and four loss aggregations. Leaves out: computing log-probs (loss/logprob.h), advantage estimation
// (GAE, group normalisation) and the value loss (which reuses aggregate_loss).
//
// Shape letters: S = sequences in the (micro-)batch, L = padded response length.
//
// Per token, with A the advantage and r = exp(logprobs - logprobs_old) (Schulman et al. 2017, eq. 7):
//   pg  = max(-A r, -A clamp(r, 1 - clip_eps_low, 1 + clip_eps_high))      (DAPO: eps_high > eps_low)
//   pg  = min(pg, -A clip_c)                    only where A < 0 and clip_c > 1 (dual clip, Ye et al. 2020)
//   loss_tok = pg + kl_coef * kl_tok - entropy_coef * entropy
// with log_q = logprobs_ref - logprobs and Schulman's (2020, "Approximating KL divergence") estimators
// of KL(pi || pi_ref) on samples from pi:
//   k1 = -log_q,   k2 = 0.5 log_q^2,   k3 = exp(log_q) - 1 - log_q   (k3: unbiased and >= 0)
// loss_tok is then reduced to a scalar by aggregate_loss (see LossAgg for each denominator).
//
// Rollout/trainer mismatch corrections (the sampler's log-probs logprobs_rollout differ from the trainer's
// logprobs_old on the same weights; rho = exp(logprobs_old - logprobs_rollout), a constant):
//   tis     pg *= min(rho, tis)                       truncated importance sampling (Yao et al. 2025)
//   icepop  pg *= [icepop_low <= rho <= icepop_high]  tokens outside the band give no gradient (IcePop)
// Both leave the denominators as they are: a masked token still counts, with a zero term.
//
// Sequence-level ratio (ratio_level = sequence; GSPO, Zheng et al. 2025): per sequence i with
// mask tokens T_i, s_i = exp(mean_{t in T_i} (logprobs - logprobs_old)), the exp of the mean log-ratio,
// so its gradient reaches every token's log-prob (d s_i / d logprobs_t = s_i / |T_i|). Every mask token
// t of sequence i then takes pg = max(-A_t s_i, -A_t clamp(s_i, 1 - clip_eps_low, 1 + clip_eps_high))
// (A_t = A_i with per-sequence advantages, GSPO's setting), then the dual clip as above and the
// configured aggregation; GSPO's own objective is seq-mean-token-mean. tis/icepop are refused (their
// rho is per token).
//
// CISPO (loss = cispo; MiniMax-M1, MiniMax 2025): per token
//   pg = -sg(clamp(r, 1 - clip_eps_low, 1 + clip_eps_high)) A logprobs
// with sg = stop-gradient, so d pg / d logprobs = -w A with the clipped weight w: every token keeps a
// gradient, with its importance weight capped. The value of pg is a surrogate (it scales with the
// log-prob), only its gradient means something. tis/icepop multiply it as above; clip_c and
// ratio_level = sequence are refused.
//
// Masking: loss_mask != 0 marks tokens that count (its values are used as 0/1, not as weights). The
// log-ratios are zeroed outside the mask before exp(), so garbage log-probs at prompt/padding
// positions (e.g. -inf, or a large gap between policies) give neither NaN/Inf losses nor NaN gradients.
#pragma once

#include <ATen/ATen.h>

#include <limits>

#include "common/fields.h"

namespace rlt {

// Estimator of KL(pi || pi_ref) per sampled token (Schulman 2020). k3 is the GRPO default.
enum class KlEstimator { kK1, kK2, kK3 };

inline const EnumNames<KlEstimator>& enum_names(KlEstimator) {
  static const EnumNames<KlEstimator> names{
      {"k1", KlEstimator::kK1}, {"k2", KlEstimator::kK2}, {"k3", KlEstimator::kK3}};
  return names;
}

// How the per-token losses loss_tok (S, R) become one scalar. m = mask (0/1), den = the denominator;
// "global" is PolicyLossInputs::global_denominator (> 0 replaces this micro-batch's own den).
//
// kTokenMean            loss = sum_{s,t} m loss_tok / den,  den = number of mask tokens, clamped to >= 1
//                       (an all-masked micro-batch gives 0, not NaN). Every token weighs the same.
//                       Gradient accumulation: with each micro-batch's own den_k, a token weighs 1/den_k,
//                       so tokens of micro-batches with few mask tokens count more and the sum (or the
//                       mean) of the micro-batch losses is not the mini-batch loss. Pass
//                       global = mask tokens of the whole mini-batch (over everything whose gradients
//                       are summed) and the micro-batch losses add up to it exactly.
// kSeqMeanTokenMean     each sequence's token-mean (its token count clamped to >= 1), summed over
//                       sequences, / den with den = number of sequences with >= 1 mask token, clamped to
//                       >= 1. Sequences with no mask token contribute nothing and are not counted (their
//                       token-mean is 0/0). Every sequence weighs the same; tokens of short responses
//                       weigh more (the original GRPO length bias). Gradient accumulation: pass
//                       global = non-empty sequences of the mini-batch.
// kSeqMeanTokenSum      each sequence's masked token sum, summed, / den with den = S (all sequences,
//                       including empty ones whose sum is 0; clamped to >= 1). Scale grows with
//                       response length. Gradient accumulation: pass global = mini-batch sequence
//                       count.
// kSeqMeanTokenSumNorm  sum_{s,t} m loss_tok / (agg_norm * den), den = S (clamped to >= 1). Dr. GRPO
//                       (Liu et al. 2025): a constant normaliser (e.g. the max response length) instead
//                       of each sequence's own length removes the length bias. agg_norm must be > 0.
//                       Gradient accumulation: pass global = mini-batch sequence count; the
//                       denominator becomes agg_norm * global.
// A mask-independent denominator (the last two modes, or any global one) makes the loss of a
// micro-batch a plain sum over its tokens, so splitting never changes the gradient.
enum class LossAgg { kTokenMean, kSeqMeanTokenMean, kSeqMeanTokenSum, kSeqMeanTokenSumNorm };

inline const EnumNames<LossAgg>& enum_names(LossAgg) {
  static const EnumNames<LossAgg> names{{"token-mean", LossAgg::kTokenMean},
                                        {"seq-mean-token-mean", LossAgg::kSeqMeanTokenMean},
                                        {"seq-mean-token-sum", LossAgg::kSeqMeanTokenSum},
                                        {"seq-mean-token-sum-norm", LossAgg::kSeqMeanTokenSumNorm}};
  return names;
}

// Which ratio the clipped surrogate uses: each token's own, or one per sequence (GSPO).
enum class RatioLevel { kToken, kSequence };

inline const EnumNames<RatioLevel>& enum_names(RatioLevel) {
  static const EnumNames<RatioLevel> names{{"token", RatioLevel::kToken}, {"sequence", RatioLevel::kSequence}};
  return names;
}

// The policy-gradient term: PPO's clipped surrogate, or CISPO's clipped, detached importance weight.
enum class PolicyLossKind { kPpoClip, kCispo };

inline const EnumNames<PolicyLossKind>& enum_names(PolicyLossKind) {
  static const EnumNames<PolicyLossKind> names{{"ppo_clip", PolicyLossKind::kPpoClip},
                                               {"cispo", PolicyLossKind::kCispo}};
  return names;
}

struct PolicyLossOptions {
  double clip_eps_low = 0.2;
  double clip_eps_high = 0.2;
  double clip_c = 0.0;
  double kl_coef = 0.0;
  KlEstimator kl_estimator = KlEstimator::kK3;
  double entropy_coef = 0.0;
  LossAgg agg = LossAgg::kTokenMean;
  double agg_norm = 0.0;
  double tis = 0.0;
  double icepop_low = 0.0;
  double icepop_high = 0.0;
  RatioLevel ratio_level = RatioLevel::kToken;
  PolicyLossKind loss = PolicyLossKind::kPpoClip;

  template <class V>
  void visit(V&& v) {
    constexpr double kInf = std::numeric_limits<double>::infinity();
    v("clip_eps_low", clip_eps_low, "ratio lower clip bound is 1 - clip_eps_low", FieldRange{0, 1});
    v("clip_eps_high", clip_eps_high, "ratio upper clip bound is 1 + clip_eps_high (DAPO clip-higher: 0.28)",
      FieldRange{0, kInf});
    v("clip_c", clip_c,
      "dual-clip constant c: where A < 0 the loss is capped at -A*c (Ye et al. 2020); 0 = off, "
      "else > 1 (typically 3)",
      FieldRange{0, kInf});
    v("kl_coef", kl_coef, "weight of the KL penalty to the reference policy; 0 = off (no reference log-probs needed)",
      FieldRange{0, kInf});
    v("kl_estimator", kl_estimator, "per-token estimator of KL(pi || pi_ref): k1 | k2 | k3 (Schulman 2020)");
    v("entropy_coef", entropy_coef, "entropy bonus weight: loss -= entropy_coef * entropy; 0 = off",
      FieldRange{0, kInf});
    v("agg", agg,
      "loss aggregation: token-mean | seq-mean-token-mean | seq-mean-token-sum | "
      "seq-mean-token-sum-norm");
    v("agg_norm", agg_norm,
      "constant normaliser of seq-mean-token-sum-norm (Dr. GRPO: the max response length); must be "
      "> 0 in that mode, unused otherwise",
      FieldRange{0, kInf});
    v("tis", tis,
      "truncated importance sampling: weight each token's surrogate by min(rho, tis), rho = "
      "exp(logprobs_old - logprobs_rollout); 0 = off, else >= 1",
      FieldRange{0, kInf});
    v("icepop_low", icepop_low,
      "IcePop: tokens with rho below this give no gradient; 0 with icepop_high 0 = off, else in (0, 1]",
      FieldRange{0, kInf});
    v("icepop_high", icepop_high, "IcePop: tokens with rho above this give no gradient; >= 1 when on",
      FieldRange{0, kInf});
    v("ratio_level", ratio_level,
      "importance ratio of the clipped surrogate: token | sequence (GSPO, Zheng et al. 2025: "
      "exp of the mean log-ratio over a sequence's mask tokens, clipped to [1 - clip_eps_low, "
      "1 + clip_eps_high]; GSPO uses tiny ranges, e.g. clip_eps_low 3e-4 and clip_eps_high 4e-4, and "
      "seq-mean-token-mean); sequence refuses tis and icepop");
    v("loss", loss,
      "policy-gradient term: ppo_clip | cispo (MiniMax-M1 2025: -sg(clamp(r, 1 - clip_eps_low, "
      "1 + clip_eps_high)) * A * logprob, the clipped ratio detached); cispo needs ratio_level token "
      "and clip_c 0");
  }

  // Cross-field rules: clip_c is 0 or > 1; agg_norm > 0 when agg is seq-mean-token-sum-norm; the IcePop
  // band is off or 0 < low <= 1 <= high; tis is 0 or >= 1; ratio_level sequence without tis and
  // icepop; loss cispo with ratio_level token and clip_c 0.
  void check(const FieldFail& fail) const;
};

struct PolicyLossInputs {
  at::Tensor logprobs;          // (S, R) new log-probs (requires grad); float32 or float64, sets the dtype
  at::Tensor logprobs_old;      // (S, R) behaviour-policy log-probs (treated as constant: detached)
  at::Tensor logprobs_ref;      // (S, R) reference log-probs (detached); required iff kl_coef != 0
  at::Tensor advantages;        // (S, R) or (S): per-token or per-sequence advantages (detached)
  at::Tensor loss_mask;         // (S, R) != 0: token counts in the loss; 0 = prompt/tool output/padding
  at::Tensor entropy;           // (S, R) per-token entropy (differentiable); required iff entropy_coef != 0;
                                // optional otherwise (metric only)
  at::Tensor logprobs_rollout;  // (S, R) the sampler's log-probs (detached); required iff tis or icepop is on
  // Gradient accumulation: when a mini-batch is split into micro-batches, pass the mini-batch's
  // global denominator here (token count for token-mean, non-empty sequence count for
  // seq-mean-token-mean, sequence count for seq-mean-token-sum*) so that the sum of micro-batch
  // losses equals the loss on the whole mini-batch. <= 0 means "this micro-batch's own".
  double global_denominator = 0.0;
};

// Metrics are this micro-batch's own masked token means (they ignore global_denominator); average
// them over micro-batches weighted by mask-token count if an exact mini-batch value is needed (the
// sequence-level clip_frac is a mean over non-empty sequences: weight it by their count instead).
struct PolicyLossOutput {
  at::Tensor loss;            // () differentiable: aggregate of pg + kl_coef*kl - entropy_coef*entropy
  at::Tensor pg_loss;         // () the clipped-surrogate part, same aggregation as loss (detached)
  at::Tensor kl;              // () masked token-mean of the chosen KL estimator vs ref (detached; 0 if no
                              //    ref given, computed as a metric if ref is given with kl_coef = 0)
  at::Tensor entropy;         // () masked token-mean entropy (detached; undefined if none given)
  at::Tensor clip_frac;       // () ppo_clip, token level: fraction of mask tokens where the clipped
                              //    branch was taken, i.e. the clipped term was strictly larger.
                              //    sequence level: fraction of the sequences with >= 1 mask token
                              //    (each weighs 1, whatever its length) where the clipped branch was
                              //    taken at a mask token (at all of them with per-sequence A).
                              //    cispo: fraction of mask tokens whose weight r was clamped, i.e.
                              //    r outside [1 - clip_eps_low, 1 + clip_eps_high] (detached)
  at::Tensor approx_kl;       // () masked mean of 0.5*(logprobs - logprobs_old)^2, vs the behaviour
                              //    policy (detached)
  at::Tensor dual_clip_frac;  // () fraction of mask tokens where A < 0 and the dual-clip bound -A*c
                              //    was the smaller one (detached; 0 when clip_c = 0)
  at::Tensor tis_clip_frac;   // () fraction of mask tokens whose rho exceeded the tis cap (0 when off)
  at::Tensor icepop_frac;     // () fraction of mask tokens IcePop dropped (0 when off)
};

// Starts by checking options (ranges and check()), shapes, dtypes and devices (TORCH_CHECK, throws
// c10::Error). No host sync: nothing is read back from the device.
PolicyLossOutput policy_loss(const PolicyLossInputs& in, const PolicyLossOptions& opt);

// The aggregation alone, exposed for reuse (value loss in PPO later). per_token (S, R) floating;
// loss_mask (S, R), any real dtype, != 0 counts. Values of per_token outside the mask are ignored,
// even NaN/Inf (selected away, not multiplied by 0). Returns a () tensor of per_token's dtype.
// agg_norm is used by kSeqMeanTokenSumNorm only (must be > 0 there); global_denominator as in
// PolicyLossInputs. Denominators per mode: see LossAgg.
at::Tensor aggregate_loss(const at::Tensor& per_token, const at::Tensor& loss_mask, LossAgg agg, double agg_norm,
                          double global_denominator);

}  // namespace rlt
