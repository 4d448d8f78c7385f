// The loss module's one entry point: per-token log-probs (and entropy) for rollout, reference scoring
// and the policy update, built only for the rows that are needed.
//
// Shape legend (used throughout loss/):
//   T   flattened positions of a batch (B L, or a packed batch)
//   T'  kept rows: the rows the caller asks for (response rows, or response rows with loss_mask = 1)
//   V   vocabulary size      D   hidden size
// Row t scores targets[t]: the caller aligns targets with rows (usually targets[t] = ids[t + 1]).
//
// Row selection (seed 001) is one index: the caller lists the rows it needs, in the order it wants the
// results (trainer/batch.h builds it once per batch, in (sequence, response position) order), and the
// outputs come back in that order, one value per listed row. With response_only the paths compute
// those rows only; without, they compute all T rows and the listed ones are picked afterwards (the
// baseline seed 001 measures against). Nothing is scattered back over all T rows.
//
// Two kinds of input:
//   * logits (T, V): paths naive and selective read the kept rows directly (no [T', V] copy for selective);
//   * hidden (T, D) + lm_head (V, D): every path. naive/selective build fp32 logits for the kept rows
//     only, chunk_size rows per LM-head matmul (selective's inplace_backward then lets the gradient
//     take their buffer); cce never holds [T', V].
// Output dtype: float32 (float64 for float64 inputs), whatever the input dtype: log-probs feed
// exp(logp_new - logp_old) and must not carry bf16 rounding (docs/loss.md, Numerics).
#pragma once

#include <ATen/ATen.h>

#include "loss/options.h"

namespace rlt {

struct LogprobInputs {
  at::Tensor logits;   // (T, V) float: logits-based input, or undefined when hidden is given
  at::Tensor hidden;   // (T, D) float: hidden states before the LM head
  at::Tensor lm_head;  // (V, D) float: LM-head weight (same dtype as hidden)
  at::Tensor targets;  // (T) int64: token whose log-prob row t returns
  // (T') int64: the rows to score, distinct, in [0, T), in the order the outputs take; undefined = all
  // T rows in order. The loss module never chooses rows itself: response_only only decides whether
  // the rows not listed are computed at all.
  at::Tensor rows;
  // The model's final-logit softcap (gemma2): logits = cap * tanh(z / cap) before the softmax and the
  // temperature; 0 = none. A property of the model (ModelConfig::final_softcap), not a loss option.
  double logit_softcap = 0.0;
};

struct LogprobOutput {
  at::Tensor logprobs;  // (T') float32/64: log p(targets[rows[i]]) of row rows[i]
  at::Tensor entropy;   // (T') float32/64 when options.entropy != none
};

// Gradients flow to logits, or to hidden and lm_head, through log-probs (and entropy when
// options.entropy == grad); rows not listed get exactly zero gradient.
LogprobOutput token_logprobs(const LogprobInputs& in, const LossOptions& options);

// The reference: full log_softmax over the vocabulary, then gather. Half-precision logits are upcast
// to float32 first. No chunking, no row selection: tests compare every path against this in float64.
// Returns (logprobs (T'), entropy (T') or undefined).
std::pair<at::Tensor, at::Tensor> naive_logprobs(const at::Tensor& logits /*(T',V)*/,
                                                 const at::Tensor& targets /*(T')*/, double temperature,
                                                 bool with_entropy);

// The dtype log-probs are accumulated and returned in: float64 for float64 inputs, else float32
// (bf16/fp16 logits are never reduced in their own precision).
inline at::ScalarType accumulation_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// logits = hidden @ lm_head^T in float32 (float64 for float64 inputs), accumulated in fp32 for bf16
// inputs rather than rounded to bf16 (an fp32-output GEMM on CUDA; an upcast on CPU). (T', V).
at::Tensor fp32_logits(const at::Tensor& hidden /*(T',D)*/, const at::Tensor& lm_head /*(V,D)*/);

}  // namespace rlt
