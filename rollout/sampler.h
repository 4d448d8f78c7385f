// Choosing the next token from logits: temperature, top-k, top-p, and a counter-based noise source so that
// a sequence's samples depend only on (seed, the sequence's stream id, its token index). They do not
// depend on which other sequences share the batch, on G, or on when tool calls of other sequences
// return: a rollout is reproducible under a seed even though tool calls finish in any order.
//
// Sampling is the Gumbel-max trick: argmax(logits / temperature + g) with g = -log(-log u) draws exactly from
// softmax(logits / temperature) restricted to the kept (top-k / top-p) set. The log-prob recorded for a sampled
// token is that of the full temperature softmax (what the trainer recomputes through the loss module),
// not of the truncated distribution, as in the usual GRPO recipes.
//
// Shapes: B rows being sampled, V vocabulary.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/fields.h"

namespace rlt {

struct SamplingOptions {
  double temperature = 1.0;
  int64_t top_k = 0;
  double top_p = 1.0;
  int64_t max_new_tokens = 256;
  int64_t samples_per_prompt = 8;
  // Noise seed: equal seeds give equal rollouts. Not a config key: the trainer derives it from train.seed
  // and the step (one seed tree), benchmarks set it themselves.
  int64_t seed = 0;

  template <class V>
  void visit(V&& v) {
    v("temperature", temperature, "softmax temperature; 0 = greedy (argmax, log-probs then at temperature 1)",
      FieldRange{0, 100});
    v("top_k", top_k, "keep the k most likely tokens; 0 = all", FieldRange{0, 1e9});
    v("top_p", top_p, "nucleus: smallest set reaching this probability; 1 = all", FieldRange{1e-6, 1});
    v("max_new_tokens", max_new_tokens, "tokens one assistant turn may sample (within rollout.max_context)",
      FieldRange{1, 1e9});
    v("samples_per_prompt", samples_per_prompt, "completions per prompt (the GRPO group size G)", FieldRange{1, 1e6});
  }
  void check(const FieldFail& fail) const {}
};

// logits (B, V) -> the same with every entry outside the top-k / top-p set at -inf (ties at the k-th
// value are kept). The input is logits already divided by the temperature.
at::Tensor filter_top_k_top_p(const at::Tensor& logits, int64_t top_k, double top_p);

// Uniforms in (0, 1), (B, V) float32, on `device`: entry (i, v) is a hash of (seed, streams[i],
// counters[i], v). streams, counters: (B) int64 on the CPU.
at::Tensor counter_uniforms(int64_t seed, const at::Tensor& streams, const at::Tensor& counters, int64_t vocab,
                            at::Device device);

// The Gumbel-max draw: ids (B) int64 = argmax_v logits[n, v] / temperature - log(-log u[n, v]), u =
// counter_uniforms(seed, streams, counters). logits (B, V) float32 (already filtered, if at all). On a CUDA
// device, unless `fused` is false, one kernel makes the noise on the fly (rollout/cuda/sample_kernels.cu),
// bit-identical to the ATen form, which is the reference and the CPU path.
at::Tensor gumbel_argmax(const at::Tensor& logits, double temperature, int64_t seed, const at::Tensor& streams,
                         const at::Tensor& counters, bool fused = true);

// Each row's noise key, (B) int64 on the CPU: the hash of (seed, streams[i], counters[i]) that
// counter_uniforms and the draws below expand into one uniform per vocabulary entry.
at::Tensor sample_row_keys(int64_t seed, const at::Tensor& streams, const at::Tensor& counters);

// counter_uniforms from the rows' keys (B) int64, already on the device the uniforms are made on.
at::Tensor uniforms_from_keys(const at::Tensor& row_keys, int64_t vocab);

// gumbel_argmax with the rows' keys (B) int64 on the logits' device: reads nothing back to the host, so a
// CUDA graph can hold it.
at::Tensor gumbel_argmax_keyed(const at::Tensor& logits, double temperature, const at::Tensor& row_keys,
                               bool fused = true);

struct SampleOutput {
  at::Tensor ids;       // (B) int64, on the CPU
  at::Tensor logprobs;  // (B) float32, on the CPU: log softmax(logits / temperature)[ids] through the loss module
};

// The draw of sample_tokens on the logits' device: ids (B) int64 and their log-probs (B) float32, the noise
// from row_keys (B) int64 on that device (sample_row_keys). No host copy and no synchronisation: the decode
// step's CUDA graph holds it (DecodeEngine::step_draw).
struct DeviceDraw {
  at::Tensor ids, logprobs;
};
DeviceDraw draw_tokens(const at::Tensor& logits, const SamplingOptions& options, const at::Tensor& row_keys,
                       int64_t vocab_limit = 0, bool fused = true);

// A draw as one (2, B) float64 tensor on its device, ids then log-probs (both exact in float64): one copy
// brings it to the host.
at::Tensor pack_draw(const DeviceDraw& draw);
// A packed draw on the host: the ids and log-probs of rows `pick` ((B') int64 on the CPU; undefined: all),
// after the check that each is finite. logits (the draw's input, or undefined) are read only to count
// their non-finite values when the check fails.
SampleOutput unpack_draw(const at::Tensor& packed, const at::Tensor& pick = at::Tensor(),
                         const at::Tensor& logits = at::Tensor());

// One token per row of logits (B, V) with the rows' noise keys given (B) int64 on the CPU (sample_row_keys):
// draw_tokens, then unpack_draw.
SampleOutput sample_keyed(const at::Tensor& logits, const SamplingOptions& options, const at::Tensor& row_keys,
                          int64_t vocab_limit = 0, bool fused = true);

// One token per row of logits (B, V) (final-logit softcap already applied): sample_keyed with the keys of
// (options.seed, streams, counters).
// Rows at or past `vocab_limit` (> 0) are never sampled: a checkpoint's embedding may be larger than its
// tokenizer. `fused` as in gumbel_argmax (false: the ATen draw, for benchmarks' A/B).
SampleOutput sample_tokens(const at::Tensor& logits, const SamplingOptions& options, const at::Tensor& streams,
                           const at::Tensor& counters, int64_t vocab_limit = 0, bool fused = true);

}  // namespace rlt
