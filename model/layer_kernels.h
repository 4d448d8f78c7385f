// The operations of a decoder layer that a fused CUDA kernel can take over (model/cuda/decode_kernels.h),
// behind one interface: a forward picks an implementation once, at its start, and every layer calls
// through it. The ATen implementation is the reference (Hugging Face's operations: RMSNorm in fp32,
// rotate_half RoPE, the activation then the gate product) and the CPU's; the fused one (the rollout's
// cache forwards) runs each chain as one kernel with the same roundings, so it matches the reference bit
// for bit in float32 but for RMSNorm's sum of squares; the training one (forwards without a cache on
// CUDA: training and scoring) runs those kernels as autograd nodes with backward kernels. Leaves out the
// projections and SDPA, which every implementation calls alike (model/transformer.cpp).
// Internal to model/: the Transformer's forwards include it, its callers do not.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "model/config.h"
#include "model/kv_cache.h"

namespace rlt {

class LayerKernels {
 public:
  virtual ~LayerKernels() = default;
  // RMSNorm over the last dim of x (…, D): llama form w * cast(x * rsqrt(mean(x^2) + eps)), gemma form
  // cast(x_hat * (1 + w)).
  virtual at::Tensor norm(const at::Tensor& x, const at::Tensor& w, double eps, bool gemma) const = 0;
  // A residual add and the norm after it: {a + b, norm(a + b)}; b undefined: {a, norm(a)}.
  virtual std::pair<at::Tensor, at::Tensor> add_norm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& w,
                                                     double eps, bool gemma) const = 0;
  // A block's closing residual add, h + m (B, L, D); or h, with m left in `pending` (the pending residual)
  // for the next add_norm to add (the fused form: one kernel fewer a layer). pending comes in undefined.
  virtual at::Tensor add_residual(const at::Tensor& h, const at::Tensor& m, at::Tensor& pending) const = 0;
  // RoPE of q (B, L, H, hd) and k (B, L, Hkv, hd) by cos, sin (B, 1, L, hd); then, with a cache, the new k
  // and v (B, L, Hkv, hd) written to layer `layer`'s slots (KvCache::update). Returns q (B, H, L, hd) and
  // the keys and values its queries attend over (B, Hkv, C, hd): the new ones alone without a cache.
  virtual std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_and_cache(int64_t layer, at::Tensor q, at::Tensor k,
                                                                        at::Tensor v, const at::Tensor& cos,
                                                                        const at::Tensor& sin,
                                                                        KvCache* cache) const = 0;
  // The MLP's gate: act(g) * u, act SiLU or (gelu_tanh) tanh-approximated GELU; g, u (B, L, F).
  virtual at::Tensor act_mul(const at::Tensor& g, const at::Tensor& u, bool gelu_tanh) const = 0;
  // A boolean attention mask (…, C) as this implementation's SDPA calls take it: the ATen form passes it
  // as it is; the fused one makes it additive in `dtype` once per forward, where SDPA would convert it at
  // every call (two kernels a layer).
  virtual at::Tensor sdpa_mask(const at::Tensor& mask, at::ScalarType dtype) const = 0;
  // attend_in_place runs for this dtype and head size (the fused kernels only).
  virtual bool attends_in_place(at::ScalarType dtype, int64_t head_dim) const = 0;
  // RoPE of q (E, L, H, hd) and k, k and v written to slots `slots` (L) of the cache's rows `rows` (E; undefined:
  // every row, E == Bc) at layer `layer`, then attention over those rows' cache where it lies, under the
  // causal mask that keep (E, span) bool and the slots make (cuda::cache_attention). Returns (E, L, H, hd).
  virtual at::Tensor attend_in_place(int64_t layer, at::Tensor q, at::Tensor k, const at::Tensor& v,
                                     const at::Tensor& cos, const at::Tensor& sin, KvCache& cache,
                                     const at::Tensor& rows, const at::Tensor& keep, const at::Tensor& slots,
                                     double scale) const = 0;
};

// The ATen forms: the reference.
const LayerKernels& aten_layer_kernels();
// The fused CUDA kernels; nullptr in a build without CUDA.
const LayerKernels* fused_layer_kernels();
// The fused forms of training and scoring forwards without a cache on CUDA, as autograd nodes with
// backward kernels (model/cuda/train_kernels.h); the ATen forms wherever the kernels do not apply; nullptr
// in a build without CUDA.
const LayerKernels* training_layer_kernels();

// RoPE's inverse frequencies (hd / 2) in fp32, as transformers computes them (default and llama3 rope
// types): a forward's tables are cos and sin of positions times these.
at::Tensor rope_inv_frequencies(const ModelConfig& c, const at::Device& dev);

// A mask (rows, slots) as attend_in_place reads its `keep`: bool on `dev`, each row's flags contiguous; the
// mask itself where it already is so (a step's view of the cache's valid-slot flags).
at::Tensor kept_slots(const at::Tensor& mask, const at::Device& dev);

// Forwards that ran the fused kernels in this process, and of them the feeds over some cache rows and the
// steps over every row whose attention read the cache in place (Transformer::fused_forward_count and its
// two siblings).
struct FusedForwardCounts {
  std::atomic<int64_t> forwards{0}, in_place_feeds{0}, in_place_steps{0};
};
FusedForwardCounts& fused_forward_counts();

// What a forward decides once for all its layers (Transformer::forward and forward_mixed build it; each
// layer reads it).
struct ForwardPlan {
  const LayerKernels* ops = nullptr;      // the ATen forms, the fused kernels or the training ones
  KvCache* cache = nullptr;               // the cache the forward goes through, or none
  const PackedWeights* packed = nullptr;  // the cache's packed weights, in fused forwards only
  at::Tensor cos, sin;                    // (B, 1, L, hd): RoPE tables in the activations' dtype
  // Which slots each new position may attend to, (B, 1, L, C) or grouped (B, 1, (H / Hkv) L, C) (see
  // attention() in transformer.cpp), bool or additive (sdpa_mask), on every layer or on sliding layers;
  // undefined where no layer needs it.
  at::Tensor full_mask, sliding_mask;
  bool fast = false;       // layers without a restricting window attend unmasked
  int64_t S = 0;           // C, the slots attended over
  at::Tensor keep, slots;  // (B, C) bool, (L) int64: attend_in_place's; undefined: SDPA
  bool dropout = false;    // the adapters' dropout (a training forward)
  // Sequences laid end to end in one row (Transformer::forward_packed): sequence s holds tokens
  // [starts[s], starts[s + 1]) and attends causally within itself only. Empty: rows of a batch.
  std::vector<int64_t> starts;
  at::Tensor cu_seqlens;  // starts as (S + 1) int32 on the device (the varlen attention kernel's form)
  int64_t longest = 0;    // the longest sequence's tokens
  // Shared prefixes (forward_packed's prefix_of; empty: none): sequence s attends over sequence
  // prefix_of[s]'s tokens, then its own. kv_index lists, sequence after sequence, the packed tokens each
  // attends over (the keys' gather), cu_seqlens_k their cumulative counts (int32), both on the device.
  std::vector<int64_t> prefix_of;
  at::Tensor kv_index, cu_seqlens_k;
  int64_t longest_context = 0;  // the most tokens a sequence attends over (its prefix's and its own)
  // The packed tokens whose hidden states the forward returns (forward_packed's outputs; undefined: every
  // token): the last layer runs its queries, output projection and MLP over these rows alone, row r
  // attending over the tokens out_kv_index lists for it (its prefix's, then its own sequence's up to it;
  // the last sliding_window of them on a sliding last layer), out_cu_k their cumulative counts (int32), both
  // on the device; out_keys the same counts on the host, out_longest the largest.
  at::Tensor out_rows, out_kv_index, out_cu_k;
  std::vector<int64_t> out_keys;
  int64_t out_longest = 0;
};

}  // namespace rlt
