// The loss module's mathematics in float64 Eigen, one formula per line: the teaching version of
// loss/logprob, loss/selective, loss/cce and loss/policy_loss, and the independent oracle their tests
// compare the LibTorch paths against. Header-only, used by tests only (never linked into the trainer).
// Leaves out everything that is about memory or speed: it holds whole [T', V] matrices, has no chunks,
// no row selection (the caller picks rows), no autograd (gradients are written out from the formulas),
// and no bf16. Small shapes only.
//
// Letters as in docs/glossary.md: T' rows, V vocabulary, D hidden size; S sequences, R response slots.
// E and C are matrices, not sizes: the hidden states and the LM head (the glossary's W).
#pragma once

#include <Eigen/Dense>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace rlt::reference {

using Mat = Eigen::MatrixXd;  // row-major meaning: row n is one token
using Vec = Eigen::VectorXd;
using Ids = std::vector<int64_t>;

// ---- log-probs -------------------------------------------------------------------------------------

// The logits the softmax sees: gemma2's final softcap first, then the sampling temperature.
//   x = (cap > 0 ? cap * tanh(z / cap) : z) / temperature
inline Mat scaled_logits(const Mat& z /*(T', V)*/, double temperature, double cap) {
  Mat x = z;
  if (cap > 0) x = (z.array() / cap).tanh() * cap;  // cap * tanh(z / cap)
  return x / temperature;                           // x / temperature
}

// Row-wise log-softmax, stabilised by the row max m:
//   lse_n = m_n + log sum_v exp(x_nv - m_n),   log p_nv = x_nv - lse_n
inline Vec log_sum_exp(const Mat& x /*(T', V)*/) {
  Vec lse(x.rows());
  for (Eigen::Index n = 0; n < x.rows(); ++n) {
    const double m = x.row(n).maxCoeff();                       // m_n
    lse(n) = m + std::log((x.row(n).array() - m).exp().sum());  // m_n + log sum_v e^{x_nv - m_n}
  }
  return lse;
}
inline Mat log_softmax(const Mat& x /*(T', V)*/) {
  return x.colwise() - log_sum_exp(x);  // log p_nv = x_nv - lse_n
}

// Selective log-prob: only the chosen token's entry, log p(y_n) = x_{n, y_n} - lse_n.
inline Vec selective_logprob(const Mat& x /*(T', V)*/, const Ids& y /*(T')*/) {
  const Vec lse = log_sum_exp(x);
  Vec lp(x.rows());
  for (Eigen::Index n = 0; n < x.rows(); ++n) lp(n) = x(n, y[n]) - lse(n);  // x_{n,y_n} - lse_n
  return lp;
}

// Entropy of each row's softmax: H_n = -sum_v p_nv log p_nv.
inline Vec entropy(const Mat& x /*(T', V)*/) {
  const Mat logp = log_softmax(x);
  return -(logp.array().exp() * logp.array()).rowwise().sum();  // -sum_v p log p
}

// d/dz of sum_n (g_lp_n log p(y_n) + g_H_n H_n), z the raw logits (before cap and temperature):
//   d log p(y_n) / dx_nv = [v = y_n] - p_nv
//   d H_n / dx_nv        = -p_nv (log p_nv + H_n)
//   dx/dz                = (1 - tanh^2(z / cap)) / temperature      (1 / temperature without a cap)
inline Mat logits_grad(const Mat& z /*(T', V)*/, const Ids& y, double temperature, double cap, const Vec& g_lp,
                       const Vec& g_H) {
  const Mat x = scaled_logits(z, temperature, cap);
  const Mat logp = log_softmax(x);
  const Vec H = entropy(x);
  const Mat p = logp.array().exp();
  Mat dx(z.rows(), z.cols());
  for (Eigen::Index n = 0; n < z.rows(); ++n) {
    for (Eigen::Index v = 0; v < z.cols(); ++v) {
      const double target = v == y[n] ? 1.0 : 0.0;
      dx(n, v) = g_lp(n) * (target - p(n, v))               // g_lp ([v = y] - p)
                 - g_H(n) * p(n, v) * (logp(n, v) + H(n));  // - g_H p (log p + H)
    }
  }
  Mat dz = dx / temperature;  // through x = (.) / temperature
  if (cap > 0) {
    const Mat t = (z.array() / cap).tanh();
    dz = dz.array() * (1.0 - t.array().square());  // through cap tanh(z / cap)
  }
  return dz;
}

// ---- Cut Cross-Entropy: the same function of the hidden states E and the LM head C ------------------
// CCE computes exactly this without holding Z; here Z is built, which is the point of a reference.

struct CceForward {
  Vec logprob;  // (T') log p(y_n)
  Vec entropy;  // (T') H_n
};
// Z = E C^T, then the log-prob and entropy of softmax(scaled_logits(Z)).
inline CceForward cce_forward(const Mat& E /*(T', D)*/, const Mat& C /*(V, D)*/, const Ids& y, double temperature,
                              double cap) {
  const Mat x = scaled_logits(E * C.transpose(), temperature, cap);  // (T', V)
  return {selective_logprob(x, y), entropy(x)};
}

struct CceBackward {
  Mat dE;  // (T', D)
  Mat dC;  // (V, D)
};
// For upstream gradients g_lp, g_H (T'): dZ = logits_grad(Z), dE = dZ C, dC = dZ^T E.
inline CceBackward cce_backward(const Mat& E, const Mat& C, const Ids& y, double temperature, double cap,
                                const Vec& g_lp, const Vec& g_H) {
  const Mat dZ = logits_grad(E * C.transpose(), y, temperature, cap, g_lp, g_H);  // (T', V)
  return {dZ * C, dZ.transpose() * E};                                            // dE = dZ C, dC = dZ^T E
}

// ---- the policy loss (loss/policy_loss.h has the sources of each formula) --------------------------

enum class Kl { kK1, kK2, kK3 };
enum class Agg { kTokenMean, kSeqMeanTokenMean, kSeqMeanTokenSum, kSeqMeanTokenSumNorm };

struct PolicyConfig {
  double clip_eps_low = 0.2, clip_eps_high = 0.2;  // ratio clipped to [1 - low, 1 + high]
  double clip_c = 0.0;                             // dual clip (> 1), 0 = off
  double kl_coef = 0.0;
  Kl kl = Kl::kK3;
  double entropy_coef = 0.0;
  Agg agg = Agg::kTokenMean;
  double agg_norm = 0.0;            // seq-mean-token-sum-norm's constant
  double global_denominator = 0.0;  // > 0 replaces this batch's own denominator
};

// Per-token KL(pi || pi_ref) estimate on a sample from pi, log_q = log pi_ref - log pi (Schulman 2020),
// and its derivative in log pi (d log_q / d log pi = -1).
inline double kl_estimate(Kl k, double log_q) {
  switch (k) {
    case Kl::kK1:
      return -log_q;  // k1 = -log q
    case Kl::kK2:
      return 0.5 * log_q * log_q;  // k2 = (log q)^2 / 2
    case Kl::kK3:
      return std::exp(log_q) - 1.0 - log_q;  // k3 = q - 1 - log q
  }
  return 0.0;
}
inline double kl_grad(Kl k, double log_q) {
  switch (k) {
    case Kl::kK1:
      return 1.0;  // d(-log q)/d log pi
    case Kl::kK2:
      return -log_q;  // d((log q)^2 / 2)/d log pi
    case Kl::kK3:
      return 1.0 - std::exp(log_q);  // d(q - 1 - log q)/d log pi
  }
  return 0.0;
}

// The weight w_st of token (s, t) in the aggregate: loss = sum_{s,t} m_st w_st loss_tok_st.
//   token-mean               w = 1 / max(#mask tokens, 1)                  (or 1 / global)
//   seq-mean-token-mean      w = 1 / (max(n_s, 1) max(#non-empty seqs, 1)) (or .. / global)
//   seq-mean-token-sum       w = 1 / max(S, 1)                             (or 1 / global)
//   seq-mean-token-sum-norm  w = 1 / (agg_norm max(S, 1))                  (or 1 / (agg_norm global))
inline Mat aggregation_weights(const Mat& mask /*(S, R) 0/1*/, const PolicyConfig& cfg) {
  const Eigen::Index S = mask.rows();
  const bool global = cfg.global_denominator > 0;
  const double tokens = mask.sum(), seqs = std::max<double>(S, 1);
  Mat w = Mat::Zero(mask.rows(), mask.cols());
  double non_empty = 0;
  for (Eigen::Index s = 0; s < S; ++s) non_empty += mask.row(s).sum() > 0 ? 1 : 0;
  for (Eigen::Index s = 0; s < S; ++s) {
    const double n_s = std::max(mask.row(s).sum(), 1.0);
    double ws = 0;
    switch (cfg.agg) {
      case Agg::kTokenMean:
        ws = 1.0 / (global ? cfg.global_denominator : std::max(tokens, 1.0));
        break;
      case Agg::kSeqMeanTokenMean:
        ws = 1.0 / (n_s * (global ? cfg.global_denominator : std::max(non_empty, 1.0)));
        break;
      case Agg::kSeqMeanTokenSum:
        ws = 1.0 / (global ? cfg.global_denominator : seqs);
        break;
      case Agg::kSeqMeanTokenSumNorm:
        ws = 1.0 / (cfg.agg_norm * (global ? cfg.global_denominator : seqs));
        break;
    }
    w.row(s) = mask.row(s) * ws;  // masked tokens weigh 0
  }
  return w;
}

struct PolicyLoss {
  double loss = 0;     // the aggregate of pg + kl_coef k - entropy_coef H
  double pg_loss = 0;  // the aggregate of pg alone
  Mat dlogprobs;       // (S, R) d loss / d log pi
  Mat dentropy;        // (S, R) d loss / d H
};

// Per token, A the advantage, r = exp(log pi - log pi_old) (Schulman et al. 2017, eq. 7):
//   pg = max(-A r, -A clip(r, 1 - low, 1 + high))
//   pg = min(pg, -A c)                   where A < 0 and c > 1 (dual clip, Ye et al. 2020)
//   loss_tok = pg + kl_coef k(log_q) - entropy_coef H
// and the aggregate sum m w loss_tok. Masked tokens contribute nothing, whatever their values.
inline PolicyLoss policy_loss(const Mat& logprobs, const Mat& logprobs_old, const Mat& logprobs_ref,
                              const Mat& advantages /*(S, R)*/, const Mat& mask, const Mat& entropy,
                              const PolicyConfig& cfg) {
  const Mat w = aggregation_weights(mask, cfg);
  PolicyLoss out;
  out.dlogprobs = Mat::Zero(logprobs.rows(), logprobs.cols());
  out.dentropy = Mat::Zero(logprobs.rows(), logprobs.cols());
  for (Eigen::Index s = 0; s < logprobs.rows(); ++s) {
    for (Eigen::Index t = 0; t < logprobs.cols(); ++t) {
      if (mask(s, t) == 0) continue;
      const double A = advantages(s, t);
      const double r = std::exp(logprobs(s, t) - logprobs_old(s, t));  // ratio
      const double r_clip = std::clamp(r, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high);
      const double unclipped = -A * r, clipped = -A * r_clip;
      double pg = std::max(unclipped, clipped);                                              // pessimistic bound
      double dpg = clipped > unclipped ? 0.0 : -A * r;                                       // d pg / d log pi
      if (cfg.clip_c > 1 && A < 0 && pg > -A * cfg.clip_c) pg = -A * cfg.clip_c, dpg = 0.0;  // dual clip
      double tok = pg, dtok = dpg;
      if (cfg.kl_coef != 0) {
        const double log_q = logprobs_ref(s, t) - logprobs(s, t);  // log pi_ref - log pi
        tok += cfg.kl_coef * kl_estimate(cfg.kl, log_q);
        dtok += cfg.kl_coef * kl_grad(cfg.kl, log_q);
      }
      if (cfg.entropy_coef != 0) tok -= cfg.entropy_coef * entropy(s, t);  // entropy bonus
      out.loss += w(s, t) * tok;
      out.pg_loss += w(s, t) * pg;
      out.dlogprobs(s, t) = w(s, t) * dtok;
      out.dentropy(s, t) = -w(s, t) * cfg.entropy_coef;
    }
  }
  return out;
}

}  // namespace rlt::reference
