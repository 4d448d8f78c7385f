// Projection weights packed for decoding: the fused forwards through a KvCache (model/kv_cache.h) run one
// GEMM for q, k and v and one for gate and up. Transformer::pack_weights makes them (packed_weights.cpp).
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace rlt {

// Projection weights packed for decoding, per layer: [q; k; v] (with their biases) and [gate; up] as one
// matrix each, so that a forward runs one GEMM for each group instead of three and two: a decode step's
// GEMMs are a few microseconds each, set by their launch and tile count rather than their bytes. A
// snapshot of the parameters when made (DecodeEngine makes one per rollout); it costs their size again
// (qkv and gate/up: 0.47 GB for Qwen2.5-0.5B in bf16) for as long as it lives. qkv_w is empty for models
// with q/k norms, whose fused RMSNorm needs q and k contiguous.
struct PackedWeights {
  std::vector<at::Tensor> qkv_w, qkv_b;  // per layer: ((H + 2 Hkv) hd, D) and its bias (undefined: none)
  std::vector<at::Tensor> gate_up_w;     // per layer: (2 F, D)
};

}  // namespace rlt
