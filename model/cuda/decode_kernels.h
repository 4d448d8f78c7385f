// Fused kernels for the decoder's no-grad cache forwards (the rollout's prefill, decode steps and feeds):
// each replaces a chain of small ATen kernels whose launches, not their bytes, set a decode step's time.
// A 0.5B model's graphed decode step ran 1,117 kernels for 64 rows on an H200 (bench_model --trace, phase
// steady_policy_step_x16): RMSNorm alone is eight (cast, square, mean, add, rsqrt, multiply, cast,
// weight), RoPE five per tensor. Each kernel here does its chain's float operations in the same order, each
// rounded on its own as ATen's separate kernels round them, so outputs match the ATen forms (which stay
// the reference, the CPU path and the training path) bit for bit, except RMSNorm's sum of squares, whose
// summation order differs (a few float32 ulps before the final rounding).
//
// Tensors are in float32, bfloat16 or float16; weights in the activations' dtype. RMSNorm takes
// contiguous tensors; RoPE and the SiLU gate also take views of a packed projection's output
// (PackedWeights: rows a fixed stride apart, each row's own elements packed).
#pragma once

#include <ATen/ATen.h>

#include <utility>

namespace rlt::cuda {

// RMSNorm over the last dim (D): llama form w * cast(x * rsqrt(mean(x^2) + eps)); gemma form
// cast(x_hat * (1 + w)).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool gemma);
// h = a + b (rounded to the dtype), then rms_norm(h): the residual add before a block's norm. Returns
// {h, rms_norm(h)}.
std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& w,
                                               double eps, bool gemma);
// RoPE in place: x * cos + rotate_half(x) * sin for q (B, L, H, hd) and k (B, L, Hkv, hd), with cos and sin
// (B, 1, L, hd) in the same dtype.
void rope_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin);
// rope_ for a decode step at KvCache::step_slot: q rotated in place; k rotated and written, with v (B, L,
// Hkv, hd), to slots[l] of every row of the caches (B, Hkv, S, hd) (the ATen form: rotate, then two
// index_copy_ calls); k itself is left as it was. slots (L) int64 on the device, each in [0, S): unlike
// index_copy_, the kernel does not check them (the caller's step slot is below the cache's slots).
void rope_write_cache(at::Tensor& q, at::Tensor& k, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots);
// silu(g) * u, each rounded to the dtype as ATen's two kernels round them.
at::Tensor silu_mul(const at::Tensor& g, const at::Tensor& u);

}  // namespace rlt::cuda
