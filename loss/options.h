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
  LogprobImpl impl = LogprobImpl::kSelective;
  // The rows are LogprobInputs::rows (the response rows). false computes every row of the batch and picks
  // the listed ones after: the baseline's memory, bit-identical results on the listed rows.
  bool response_only = true;
  // The trainer builds its row index from the kept rows (trainer/batch.cpp); the dropped rows' log-probs
  // read as 0 in the (S, R) response layout. For the policy-loss path only.
  bool loss_mask_only = false;
  // Seeds 003/004: the chunk bounds the [rows, V] working set of every path, and on the hidden-state path
  // the LM-head matmul's fp32 [rows, V] logits too. 0: naive all rows at once; selective 1M logits per
  // ATen chunk (the CUDA kernel streams rows and needs none) and 4096 rows per LM-head matmul; cce 4096
  // rows, 8192 on the fused kernels (cce_blocks in loss/cce.cpp says why).
  int64_t chunk_size = 0;
  int64_t vocab_chunk_size = 0;
  EntropyMode entropy = EntropyMode::kNone;
  double temperature = 1.0;
  // Seed 002, sec. 4.3. On the fused Hopper path a tile is 64 rows x 256 entries, skipped when it holds
  // no such entry and no target, decided on the device.
  bool grad_filter = true;
  // 2^-12 is the smallest bf16 value that survives rounding.
  double grad_filter_eps = 1.0 / 4096.0;
  // Given logits: only when nothing else reads them after the loss. On the hidden-state path the logits
  // are the module's own, so true is always safe there; false keeps a separate gradient buffer (an
  // ablation of seed 003).
  bool inplace_backward = false;
  // loss/cuda/cce_fused.cu, whose GEMM tiles never leave registers. The cuBLAS blocks go through HBM;
  // they are the fused kernels' reference, kept for ablation.
  bool cce_fused = true;
  // Cooperative (false) idles the tensor cores during a 128-row tile's epilogue; ping-pong puts one warp
  // group's epilogue under the other's MMAs, yet is slower on the H100 in every row but one
  // (docs/benchmarks.md, design notes), so it stays an ablation.
  bool cce_pingpong = false;

  template <class V>
  void visit(V&& v) {
    v("impl", impl, "log-prob path: naive | selective | cce");
    v("response_only", response_only,
      "compute only the rows inside response windows, gathered before the cross-entropy (seed 001)");
    v("loss_mask_only", loss_mask_only,
      "keep only response rows with loss_mask = 1, dropping tool output (seed 001); needs response_only");
    v("chunk_size", chunk_size, "rows per chunk for every path; 0 = automatic per path", FieldRange{0, 1e9});
    v("vocab_chunk_size", vocab_chunk_size,
      "cce: vocabulary entries per block; 0 = automatic (about 8M logits a block; 4096 on the fused kernels)",
      FieldRange{0, 1e9});
    v("entropy", entropy,
      "per-token entropy: none | value (no gradient) | grad (differentiable, for an entropy bonus)");
    v("temperature", temperature, "softmax temperature: log-probs of softmax(logits / temperature)",
      FieldRange{1e-6, 1e6});
    v("grad_filter", grad_filter, "cce: skip backward blocks (fused path: tiles) with softmax < grad_filter_eps");
    v("grad_filter_eps", grad_filter_eps, "cce: gradient-filtering threshold", FieldRange{0, 1});
    v("inplace_backward", inplace_backward,
      "selective: write the logits' gradient into the logits' own buffer, saving a [T', V] buffer (seed 003)");
    v("cce_fused", cce_fused,
      "cce: fused Hopper kernels where available (H100/H200, bf16/fp16); false: cuBLAS blocks + epilogues");
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
