// Fused kernels for the decoder's no-grad cache forwards (the rollout's prefill, decode steps and feeds):
// each replaces a chain of small ATen kernels whose launches, not their bytes, set a decode step's time.
// In the ATen forms a 0.5B model's graphed decode step runs 1,117 kernels for 64 rows on an H200 (bench_model
// --trace, phase steady_policy_step_x16): RMSNorm alone is eight (cast, square, mean, add, rsqrt, multiply, cast,
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
#include <vector>

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
// rope_ out of place: returns the rotated q and k as new contiguous tensors, q and k left as they were.
// With `inverse`, the rotation by -sin: its transpose, so rope(g_q, g_k, cos, sin, true) is the gradient
// of rope with respect to q and k, rounded as ATen's autograd rounds the backward of the ATen form.
std::pair<at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                       const at::Tensor& sin, bool inverse = false);
// rope_ for a decode step at KvCache::step_slot: q rotated in place; k rotated and written, with v (B, L,
// Hkv, hd), to slots[l] of every row of the caches (B, Hkv, C, hd) (the ATen form: rotate, then two
// index_copy_ calls); k itself is left as it was. slots (L) int64 on the device, each in [0, C): unlike
// index_copy_, the kernel does not check them (the caller's step slot is below the cache's slots).
// With rows (B) int64 on the device (a feed of some of the cache's rows, KvCache::step_rows): input row b
// goes to cache row rows[b] (distinct, in [0, Bc), unchecked), the caches being (Bc, Hkv, C, hd).
void rope_write_cache(at::Tensor& q, at::Tensor& k, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                      const at::Tensor& rows = at::Tensor());
// Attention of some cache rows' new queries over those rows' cached keys and values, read where they lie
// (no gathered copy of the rows' cache, no mask tensor per layer): a feed's forward (KvCache::step_rows)
// and a decode step's. The keys end at the largest slot a query sees, not at the span, and are split
// between blocks in whole waves (cache_attention_splits; flash-decoding), so a step's cost follows its
// rows' contexts.
// q (E, L, H, hd), each (e, l) row's heads packed, rows evenly spaced (a packed projection's view serves);
// k_cache, v_cache (Bc, Hkv, C, hd) contiguous, already holding the new keys and values; rows (E) int64:
// input row e's cache row (undefined: row e itself, E == Bc, as in a step over every row); keep (E, >= span)
// bool, rows contiguous: the slots input row e's queries may see; slots (L) int64: query l's own slot. Query
// l of row e attends to slot j < span iff j == slots[l], or j <= slots[l] and keep[e, j]: the causal, padded
// mask of Transformer::forward. Grouped-query heads share their KV head (H a multiple of Hkv). Softmax in
// float32 on tensor-core products (the probabilities rounded to the dtype for the value product, as flash
// attention does). Returns (E, L, H, hd) contiguous in q's dtype. bfloat16 and float16 with hd 64 or 128
// only (cache_attention_supports); slots and rows are not checked on the device.
bool cache_attention_supports(at::ScalarType dtype, int64_t head_dim);
// How many blocks cache_attention splits each query tile's key blocks between (flash-decoding; a second
// kernel adds the splits' shares): units query tiles (input rows x KV heads x tiles), key_blocks blocks of
// keys in the span, `resident` blocks running at once on the device (per SM, as many as the kernel's
// shared memory lets fit, times the SMs). The blocks run in waves of `resident`, each walking its split's
// key blocks one after another after a setup of about one key block's time (the query tile, the partial
// output), so the count minimises waves x (key blocks per split + 1); the smallest of equals, and none
// left empty.
int64_t cache_attention_splits(int64_t units, int64_t key_blocks, int64_t resident);
at::Tensor cache_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& rows, const at::Tensor& keep, const at::Tensor& slots, int64_t span,
                           double scale);
// rope_write_cache, then cache_attention, with the same results bit for bit (the caches included), as one
// kernel where every query of an input row fits one block's tile (G L <= 64: a decode step's, a short
// feed's): each block rotates its queries as it loads them, and the block whose split of the keys holds a
// new slot rotates the key and writes it, with the value, before it reads any key. q is left unrotated
// then. Otherwise, or with set_rope_in_attention(false), the two kernels. As both kernels take them: the
// slots below span (a slot past the split keys' end is not written by the one kernel), the rows distinct.
at::Tensor rope_cache_attention(at::Tensor& q, at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                                const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& rows,
                                const at::Tensor& keep, const at::Tensor& slots, int64_t span, double scale);
// Whether rope_cache_attention takes the one kernel where it can (on unless set off, for the process):
// bench_step's separate_rope variant and the tests time and check the two kernels with it off.
void set_rope_in_attention(bool on);
bool rope_in_attention();
// Whether cache_attention's warps keep their probabilities over their scores and take the value product
// one column tile at a time (on unless set off, for the process): hd 64 in bf16 takes 53 KiB a block
// instead of 62, hd 128 43 KiB instead of 72, and 4 blocks fit an SM instead of 3 (registers capped at
// 128 a thread). The arithmetic is the same; the split count follows the blocks an SM holds.
// bench_step's full_scratch variant times the other form.
void set_attention_lean_scratch(bool on);
bool attention_lean_scratch();
// KvCache::squeeze_ in one launch, in place: in every tensor of k and v (each (B, Hkv, max_len, hd)), row r's
// slot j becomes its slot order[r, j] wherever order[r, j] > j (order (B, C <= max_len) int64: each row's
// kept slots in increasing order, then zeros, as DecodeEngine::compact makes it); other slots keep what they
// hold. Byte copies, any dtype, where the tensors are contiguous, 16-byte aligned and a slot is a multiple of
// 16 bytes up to 16 KiB (squeeze_slots_supports); order is not checked on the device.
bool squeeze_slots_supports(const std::vector<at::Tensor>& k, const std::vector<at::Tensor>& v);
void squeeze_slots_(std::vector<at::Tensor>& k, std::vector<at::Tensor>& v, const at::Tensor& order);
// silu(g) * u, each rounded to the dtype as ATen's two kernels round them.
at::Tensor silu_mul(const at::Tensor& g, const at::Tensor& u);

}  // namespace rlt::cuda
