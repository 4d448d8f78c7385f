// Options of the log-prob module (loss/logprob.h). Every field is a config value (`loss.<name>` in YAML,
// `--set loss.<name>=...` on every app) so users can ablate each memory technique on its own.
#pragma once

#include <cstdint>
#include <string>

#include "common/fields.h"

namespace rlt {

// Which algorithm turns (hidden states or logits) + target ids into per-token log-probs.
enum class LogprobImpl {
  kNaive,      // full log_softmax over [T', V] then gather: the reference every other path is tested against
  kSelective,  // seed 000: per-row log-sum-exp, gather the target logit; custom backward from the saved lse
  kCce,        // seed 002: Cut Cross-Entropy from hidden states, never holding [T', V]
};
inline const EnumNames<LogprobImpl>& enum_names(LogprobImpl) {
  static const EnumNames<LogprobImpl> names{
      {"naive", LogprobImpl::kNaive}, {"selective", LogprobImpl::kSelective}, {"cce", LogprobImpl::kCce}};
  return names;
}

// Whether the per-token entropy is computed, and whether gradient flows through it.
enum class EntropyMode { kNone, kValue, kGrad };
inline const EnumNames<EntropyMode>& enum_names(EntropyMode) {
  static const EnumNames<EntropyMode> names{
      {"none", EntropyMode::kNone}, {"value", EntropyMode::kValue}, {"grad", EntropyMode::kGrad}};
  return names;
}

struct LossOptions {
  // Log-prob algorithm: naive | selective | cce.
  LogprobImpl impl = LogprobImpl::kSelective;
  // Seed 001: compute only the rows the caller lists (LogprobInputs::rows: the response rows), gathered
  // before the cross-entropy. false computes every row of the batch and picks the listed ones after:
  // the baseline's memory, bit-identical results on the listed rows.
  bool response_only = true;
  // Seed 001: list only response rows with loss_mask = 1 (drops tool output): the trainer builds its
  // row index from them (trainer/batch.cpp), and their log-probs read as 0 in the (S, R) response
  // layout. Only valid with response_only, and only on the policy-loss path.
  bool loss_mask_only = false;
  // Rows processed at a time (seeds 003/004): bounds the [rows, V] working set of every path, and on
  // the hidden-state path the LM-head matmul's fp32 [rows, V] logits too. 0 = automatic: naive all rows
  // at once; selective 1M logits per ATen chunk (the CUDA kernel streams rows and needs none) and 4096
  // rows per LM-head matmul; cce 4096 rows, 8192 on the fused kernels (cce_blocks in loss/cce.cpp says why).
  int64_t chunk_size = 0;
  // cce: vocabulary entries per block; 0 = automatic (about 8M logits per [rows, vocab] block; 4096 entries
  // on the fused kernels).
  int64_t vocab_chunk_size = 0;
  // Per-token entropy: none | value (no gradient) | grad (differentiable, for an entropy bonus).
  EntropyMode entropy = EntropyMode::kNone;
  // Sampling temperature: log-probs of softmax(logits / temperature).
  double temperature = 1.0;
  // cce: skip backward blocks whose softmax is below grad_filter_eps everywhere (seed 002, sec. 4.3); on the fused
  // Hopper path, tiles of 64 rows x 256 entries without such an entry or a target, decided on the device.
  bool grad_filter = true;
  // cce: the gradient-filtering threshold; 2^-12 is the smallest bf16 value that survives rounding.
  double grad_filter_eps = 1.0 / 4096.0;
  // selective: write the logits' gradient into the logits' own buffer (seed 003), saving a [T', V]
  // gradient. Given logits: only when nothing else reads them after the loss. Hidden-state path: the
  // logits are the module's own, so true is always safe there and saves the buffer; false keeps a
  // separate gradient buffer (an ablation of seed 003).
  bool inplace_backward = false;
  // cce on an H100/H200 (bf16/fp16): the fused Hopper kernels (loss/cuda/cce_fused.cu), whose GEMM tiles
  // never leave registers; false: cuBLAS GEMM blocks through HBM + epilogue kernels (their reference,
  // kept for ablation).
  bool cce_fused = true;
  // The fused kernels' schedule. false (cooperative): both MMA warp groups share a 128-row tile and the
  // tensor cores idle during its epilogue. true (ping-pong): the two take alternate 64-row tiles, one's
  // epilogue under the other's MMAs; slower on the H100 in every row but one (docs/benchmarks.md, design
  // notes), so it stays an ablation.
  bool cce_pingpong = false;

  template <class V>
  void visit(V&& v) {
    v("impl", impl, "log-prob path: naive | selective | cce");
    v("response_only", response_only, "compute only rows inside response windows (seed 001)");
    v("loss_mask_only", loss_mask_only, "keep only response rows with loss_mask = 1; needs response_only");
    v("chunk_size", chunk_size, "rows per chunk for every path; 0 = automatic per path", FieldRange{0, 1e9});
    v("vocab_chunk_size", vocab_chunk_size, "cce vocabulary block; 0 = automatic", FieldRange{0, 1e9});
    v("entropy", entropy, "per-token entropy: none | value | grad");
    v("temperature", temperature, "softmax temperature", FieldRange{1e-6, 1e6});
    v("grad_filter", grad_filter, "cce: skip backward blocks (fused path: tiles) with softmax < grad_filter_eps");
    v("grad_filter_eps", grad_filter_eps, "cce: gradient-filtering threshold", FieldRange{0, 1});
    v("inplace_backward", inplace_backward, "selective: overwrite the logits with their gradient");
    v("cce_fused", cce_fused, "cce: fused Hopper kernels where available; false: cuBLAS blocks + epilogues");
    v("cce_pingpong", cce_pingpong,
      "cce_fused: alternate 64-row tiles between MMA warp groups; false: shared 128-row tiles");
  }
  void check(const FieldFail& fail) const {
    if (loss_mask_only && !response_only) {
      fail("loss_mask_only", "true needs loss.response_only: true (it only drops rows inside response windows)");
    }
  }
};

}  // namespace rlt
