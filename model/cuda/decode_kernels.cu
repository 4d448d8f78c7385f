// Fused RMSNorm, residual add + RMSNorm, RoPE and SiLU-gate kernels; see decode_kernels.h.
// Every float operation is written with an explicit rounding intrinsic (__fmul_rn, __fadd_rn, ...): nvcc
// would otherwise contract a multiply and an add into one FMA, which ATen's separate kernels never form,
// and the float32 results would drift from the reference by an ulp.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <array>
#include <atomic>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <type_traits>
#include <vector>

#include "common/cuda/dtypes.cuh"
#include "common/cuda/launch.cuh"
#include "model/cuda/decode_kernels.h"

namespace rlt::cuda {

namespace {

// THREADS threads a block: 128 for rows of up to 2,048, 512 for wider ones (a decode step's few rows make
// as few blocks, whose threads each wait on their loads in turn).
template <int THREADS>
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_sums[THREADS / 32];
  for (int off = 16; off > 0; off >>= 1) v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, v, off));
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < THREADS / 32; ++w) total = __fadd_rn(total, warp_sums[w]);
  return total;
}

// One block per row. With `b`, the row is first h = a + b, written to `h`. PER > 0 (D <= THREADS PER): each
// thread keeps its PER elements in registers between the sum of squares and the scaling, and its loads,
// unrolled, all go out at once. A loop that reads each element when it needs it waits on every load in
// turn: 3.4 us a norm for D = 896, against 1.8 us so. At D = 3,584 over 16 rows, 128 threads looping took
// 19.4 us a norm once their inputs could no longer be `__restrict__` (a store to h may alias the next
// load); 512 threads of 8 registers' elements take 2.7 us (bench_step's trace, H200). PER = 0, for rows
// past THREADS x 16 elements: that loop, the norm reading h back (each thread its own elements, so no
// barrier is needed between the write and the read). Each thread sums its squares in the same order.
template <typename T, int PER, int THREADS>
__global__ void __launch_bounds__(THREADS)
    rms_norm_kernel(const T* a, const T* b, T* h, const T* __restrict__ w, int64_t D, float eps, bool gemma, T* out) {
  const int64_t off = int64_t(blockIdx.x) * D;
  auto scaled = [&](float y, T wi) {  // y = x * rsqrt(mean(x^2) + eps), wi the weight
    return gemma ? from_f<T>(__fmul_rn(y, __fadd_rn(1.0f, to_f(wi)))) : from_f<T>(__fmul_rn(to_f(wi), round_to<T>(y)));
  };
  if constexpr (PER > 0) {
    T wk[PER];  // the weights, constant: loaded while the kernel ahead may still run
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int64_t i = threadIdx.x + int64_t(k) * THREADS;
      wk[k] = i < D ? w[i] : from_f<T>(0.f);
    }
    wait_for_inputs();
    allow_dependents();
    float v[PER];
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int64_t i = threadIdx.x + int64_t(k) * THREADS;
      v[k] = i < D ? (b ? round_to<T>(__fadd_rn(to_f(a[off + i]), to_f(b[off + i]))) : to_f(a[off + i])) : 0.f;
    }
    float sq = 0.f;
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int64_t i = threadIdx.x + int64_t(k) * THREADS;
      if (i >= D) break;
      if (b) h[off + i] = from_f<T>(v[k]);
      sq = __fadd_rn(sq, __fmul_rn(v[k], v[k]));
    }
    const float r = rsqrtf(__fadd_rn(__fmul_rn(block_sum<THREADS>(sq), 1.0f / float(D)), eps));
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int64_t i = threadIdx.x + int64_t(k) * THREADS;
      if (i < D) out[off + i] = scaled(__fmul_rn(v[k], r), wk[k]);
    }
  } else {
    wait_for_inputs();
    allow_dependents();
    const T* x = b ? h + off : a + off;
    float sq = 0.f;
    for (int64_t i = threadIdx.x; i < D; i += THREADS) {
      float v;
      if (b) {
        v = round_to<T>(__fadd_rn(to_f(a[off + i]), to_f(b[off + i])));
        h[off + i] = from_f<T>(v);
      } else {
        v = to_f(x[i]);
      }
      sq = __fadd_rn(sq, __fmul_rn(v, v));
    }
    const float r = rsqrtf(__fadd_rn(__fmul_rn(block_sum<THREADS>(sq), 1.0f / float(D)), eps));
    for (int64_t i = threadIdx.x; i < D; i += THREADS) out[off + i] = scaled(__fmul_rn(to_f(x[i]), r), w[i]);
  }
}

// One thread per (row, head, i < hd / 2) pair of q and k: reads x_i and x_{i+h} before writing either.
// With a cache (a decode step at KvCache::step_slot), k's rotated pair and v's pair go to the cache's
// slot for position l instead of back into k: (B, Hkv, S, hd) tensors, slots[l] on the device.
// q, k and v_new are (B, L, heads, hd) with heads packed in a row and rows (b, l) a fixed stride apart:
// contiguous tensors, or views of one packed projection's output (PackedWeights).
struct CacheWrite {
  void* k = nullptr;
  void* v = nullptr;
  const void* v_new = nullptr;  // (B, L, Hkv, hd)
  int64_t v_row = 0;            // v_new's row stride
  const int64_t* slots = nullptr;
  int64_t S = 0;
  const int64_t* rows = nullptr;  // (B) the cache row of each input row (a feed of some rows); null: row b
};

// Out of place (RopeOut): the rotated q and k go to contiguous (B, L, heads, hd) tensors instead, and with
// `inverse` sin is negated: the transpose of the rotation, which is its gradient. (The transpose takes
// sin at i + half where the rotation takes it at i; the two are equal because the tables are
// cat(freqs, freqs), as Transformer::rope_tables makes them for every rope type.)
template <typename T>
struct RopeOut {
  T* q = nullptr;
  T* k = nullptr;
  bool inverse = false;
};

// One rotated pair (x1 at i, x2 at i + half) as ATen computes x * cos + rotate_half(x) * sin, rotate_half(x)
// = [-x2, x1]: each product and the sum rounded to T. inverse: sin negated (RopeOut).
template <typename T>
__device__ __forceinline__ void rope_pair(T x1_t, T x2_t, T c1, T c2, T s1_t, T s2_t, bool inverse, T& y1_t, T& y2_t) {
  const float x1 = to_f(x1_t), x2 = to_f(x2_t);
  const float s1 = inverse ? -to_f(s1_t) : to_f(s1_t), s2 = inverse ? -to_f(s2_t) : to_f(s2_t);
  y1_t = from_f<T>(__fadd_rn(round_to<T>(__fmul_rn(x1, to_f(c1))), round_to<T>(__fmul_rn(-x2, s1))));
  y2_t = from_f<T>(__fadd_rn(round_to<T>(__fmul_rn(x2, to_f(c2))), round_to<T>(__fmul_rn(x1, s2))));
}

// W elements of each half a thread: W = 1 one pair; W = 16 / sizeof(T) a 16-byte load of each half of x,
// cos and sin (launch_rope takes it where every row, head and half starts 16-byte aligned), with 32-bit
// index arithmetic. In a 0.5B scoring forward over 176k tokens on an H200 the 16-byte form takes 5.8 ms,
// the one-pair form 19.
template <typename T, int W, typename I>
__global__ void rope_kernel(T* q, T* k, const T* cos_t, const T* sin_t, int64_t rows, int64_t L, int64_t H, int64_t Hkv,
                            int64_t hd, int64_t q_row, int64_t k_row, CacheWrite cw, RopeOut<T> ro) {
  wait_for_inputs();
  allow_dependents();
  const I chunks = I(hd / 2 / W), heads = I(H + Hkv);
  const I n = I(blockIdx.x) * I(blockDim.x) + I(threadIdx.x);
  if (int64_t(n) >= rows * int64_t(heads) * int64_t(chunks)) return;
  const I c = n % chunks, t = n / chunks;
  const int64_t half = hd / 2, i = int64_t(c) * W, head = t % heads, row = t / heads;  // row = b * L + l
  const bool is_q = head < H;
  const int64_t kv = head - H;
  T* x = is_q ? q + row * q_row + head * hd : k + row * k_row + kv * hd;
  const T* cs = cos_t + row * hd;
  const T* sn = sin_t + row * hd;
  const Pack<T, W> x1 = load_pack<W>(x + i), x2 = load_pack<W>(x + i + half), c1 = load_pack<W>(cs + i),
                   c2 = load_pack<W>(cs + i + half), s1 = load_pack<W>(sn + i), s2 = load_pack<W>(sn + i + half);
  Pack<T, W> y1, y2;
#pragma unroll
  for (int e = 0; e < W; ++e)
    rope_pair(x1.v[e], x2.v[e], c1.v[e], c2.v[e], s1.v[e], s2.v[e], ro.inverse, y1.v[e], y2.v[e]);
  if (ro.q) {
    T* y = is_q ? ro.q + (row * H + head) * hd : ro.k + (row * Hkv + kv) * hd;
    store_pack(y + i, y1);
    store_pack(y + i + half, y2);
    return;
  }
  if (is_q || !cw.k) {
    store_pack(x + i, y1);
    store_pack(x + i + half, y2);
    return;
  }
  const int64_t b = row / L, l = row % L, cache_row = cw.rows ? cw.rows[b] : b;
  const int64_t dst = ((cache_row * Hkv + kv) * cw.S + cw.slots[l]) * hd;
  T* kc = static_cast<T*>(cw.k) + dst;
  T* vc = static_cast<T*>(cw.v) + dst;
  const T* vn = static_cast<const T*>(cw.v_new) + row * cw.v_row + kv * hd;
  store_pack(kc + i, y1);
  store_pack(kc + i + half, y2);
  store_pack(vc + i, load_pack<W>(vn + i));
  store_pack(vc + i + half, load_pack<W>(vn + i + half));
}

// One element of silu(g) * u as ATen computes it: silu(x) = x / (1 + e^-x) rounded to T, then the product.
template <typename T>
__device__ __forceinline__ T silu_times(T g, T u) {
  const float x = to_f(g);
  const float act = round_to<T>(__fdiv_rn(x, __fadd_rn(1.0f, expf(-x))));
  return from_f<T>(__fmul_rn(act, to_f(u)));
}

// V elements a thread in 16-byte loads and stores, for rows whose every start is 16-byte aligned (F, the row
// strides and the pointers multiples of V elements), with 32-bit index arithmetic (n / V < 2^32). Elementwise
// work runs near the memory's rate only so: the one-element form below, with its 64-bit division per
// element, takes 110 ms of a 0.5B scoring forward over 176k tokens on an H200, this one 33.
template <typename T, int V>
__global__ void silu_mul_vec_kernel(const T* g, const T* u, T* out, uint32_t n_vec, uint32_t F_vec, int64_t g_row,
                                    int64_t u_row) {
  wait_for_inputs();
  allow_dependents();
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n_vec) return;
  const uint32_t r = i / F_vec, j = (i - r * F_vec) * V;
  const Pack<T, V> gp = load_pack<V>(g + int64_t(r) * g_row + j), up = load_pack<V>(u + int64_t(r) * u_row + j);
  Pack<T, V> o;
#pragma unroll
  for (int k = 0; k < V; ++k) o.v[k] = silu_times(gp.v[k], up.v[k]);
  store_pack(out + int64_t(i) * V, o);
}

// g and u: rows of F elements a fixed stride apart (contiguous, or the halves of a packed gate/up output).
template <typename T>
__global__ void silu_mul_kernel(const T* g, const T* u, T* out, int64_t n, int64_t F, int64_t g_row, int64_t u_row) {
  wait_for_inputs();
  allow_dependents();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t r = i / F, j = i % F;
  out[i] = silu_times(g[r * g_row + j], u[r * u_row + j]);
}

// The stride between consecutive rows of t's last `inner` dims (packed: unit stride inside a row, the
// inner dims contiguous within it), when the leading dims collapse into evenly spaced rows; -1 otherwise.
int64_t row_stride(const at::Tensor& t, int64_t inner) {
  const int64_t d = t.dim();
  if (d < inner) return -1;
  int64_t expect = 1;
  for (int64_t i = d - 1; i >= d - inner; --i) {
    if (t.size(i) != 1 && t.stride(i) != expect) return -1;
    expect *= t.size(i);
  }
  int64_t row = -1, span = 0;  // the innermost leading dim of size > 1 steps one row
  for (int64_t i = d - inner - 1; i >= 0; --i) {
    if (t.size(i) == 1) continue;
    if (row < 0) span = row = t.stride(i);
    if (t.stride(i) != span) return -1;
    span *= t.size(i);
  }
  return row < 0 ? expect : row;
}

template <typename T>
T* ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

void check_norm(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.dim() >= 1, "rms_norm: x must be contiguous on CUDA");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1) && w.scalar_type() == x.scalar_type() && w.is_contiguous() &&
                  w.device() == x.device(),
              "rms_norm: weight must be (", x.size(-1), ") in the activations' dtype");
}

void launch_norm(const at::Tensor& a, const at::Tensor* b, const at::Tensor* h, const at::Tensor& w, double eps,
                 bool gemma, const at::Tensor& out) {
  const int64_t D = a.size(-1), rows = D > 0 ? a.numel() / D : 0;
  if (rows == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_float_types(a.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    auto launch_per = [&](auto per, auto threads) {
      launch(rms_norm_kernel<T, decltype(per)::value, decltype(threads)::value>, unsigned(rows),
             decltype(threads)::value, 0, stream, ptr<T>(a), b ? ptr<T>(*b) : nullptr, h ? ptr<T>(*h) : nullptr,
             ptr<T>(w), D, static_cast<float>(eps), gemma, ptr<T>(out));
    };
    using Narrow = std::integral_constant<int, 128>;
    using Wide = std::integral_constant<int, 512>;
    // Every row of up to 8,192 in registers, 8 or 16 elements a thread; wider ones through the loop.
    if (D <= 8 * Narrow::value) {
      launch_per(std::integral_constant<int, 8>{}, Narrow{});
    } else if (D <= 16 * Narrow::value) {
      launch_per(std::integral_constant<int, 16>{}, Narrow{});
    } else if (D <= 8 * Wide::value) {
      launch_per(std::integral_constant<int, 8>{}, Wide{});
    } else if (D <= 16 * Wide::value) {
      launch_per(std::integral_constant<int, 16>{}, Wide{});
    } else {
      launch_per(std::integral_constant<int, 0>{}, Wide{});
    }
  });
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool gemma) {
  check_norm(x, w);
  at::Tensor out = at::empty_like(x);
  launch_norm(x, nullptr, nullptr, w, eps, gemma, out);
  return out;
}

std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& w,
                                               double eps, bool gemma) {
  check_norm(a, w);
  TORCH_CHECK(
      b.sizes() == a.sizes() && b.scalar_type() == a.scalar_type() && b.is_contiguous() && b.device() == a.device(),
      "add_rms_norm: a and b must be contiguous, of one shape and dtype");
  at::Tensor h = at::empty_like(a), out = at::empty_like(a);
  launch_norm(a, &b, &h, w, eps, gemma, out);
  return {h, out};
}

namespace {

// The RoPE tables the kernels take: cos and sin contiguous (B, 1, L, hd) in q's dtype, on its device.
bool rope_tables_fit(const at::Tensor& q, const at::Tensor& cos, const at::Tensor& sin, int64_t B, int64_t L,
                     int64_t hd) {
  return cos.sizes() == at::IntArrayRef({B, 1, L, hd}) && sin.sizes() == cos.sizes() && cos.is_contiguous() &&
         sin.is_contiguous() && cos.scalar_type() == q.scalar_type() && sin.scalar_type() == q.scalar_type() &&
         cos.device() == q.device() && sin.device() == q.device();
}

// out: null (in place, or into the cache) or {q_out, k_out}, contiguous and shaped like q and k.
void launch_rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                 const CacheWrite& cw, const std::pair<at::Tensor, at::Tensor>* out = nullptr, bool inverse = false) {
  const int64_t q_row = q.dim() == 4 ? row_stride(q, 2) : -1, k_row = k.dim() == 4 ? row_stride(k, 2) : -1;
  TORCH_CHECK(q.is_cuda() && q_row > 0 && k_row > 0 && k.device() == q.device() && cos.device() == q.device() &&
                  sin.device() == q.device(),
              "rope_: q (B, L, H, hd) and k (B, L, Hkv, hd) on CUDA must hold each row's heads packed, rows evenly "
              "spaced");
  const int64_t B = q.size(0), L = q.size(1), H = q.size(2), hd = q.size(3), Hkv = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(1) == L && k.size(3) == hd && hd % 2 == 0, "rope_: q and k disagree");
  TORCH_CHECK(rope_tables_fit(q, cos, sin, B, L, hd) && k.scalar_type() == q.scalar_type(),
              "rope_: cos and sin must be contiguous (B, 1, L, hd) in q's dtype");
  const int64_t n = B * L * (H + Hkv) * (hd / 2);
  if (n == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_float_types(q.scalar_type(), "rope_", [&](auto tag) {
    using T = decltype(tag);
    RopeOut<T> ro;
    if (out) ro = {ptr<T>(out->first), ptr<T>(out->second), inverse};
    constexpr int W = 16 / sizeof(T);
    // 16-byte loads where every row, head and half starts 16-byte aligned.
    bool wide = (hd / 2) % W == 0 && q_row % W == 0 && k_row % W == 0 && n / W < (int64_t(1) << 32) - 256;
    const std::array<const void*, 9> starts{ptr<T>(q), ptr<T>(k), ptr<T>(cos), ptr<T>(sin), ro.q,
                                            ro.k,      cw.k,      cw.v,        cw.v_new};
    for (const void* p : starts) wide = wide && aligned_16(p);
    if (cw.k) wide = wide && cw.v_row % W == 0;
    if (wide) {
      const int64_t threads = n / W;
      launch(rope_kernel<T, W, uint32_t>, unsigned((threads + 255) / 256), 256, 0, stream, ptr<T>(q), ptr<T>(k),
             ptr<T>(cos), ptr<T>(sin), B * L, L, H, Hkv, hd, q_row, k_row, cw, ro);
    } else {
      launch(rope_kernel<T, 1, int64_t>, unsigned((n + 255) / 256), 256, 0, stream, ptr<T>(q), ptr<T>(k), ptr<T>(cos),
             ptr<T>(sin), B * L, L, H, Hkv, hd, q_row, k_row, cw, ro);
    }
  });
}

}  // namespace

void rope_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  launch_rope(q, k, cos, sin, CacheWrite{});
}

std::pair<at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                       const at::Tensor& sin, bool inverse) {
  std::pair<at::Tensor, at::Tensor> out{at::empty(q.sizes(), q.options()), at::empty(k.sizes(), k.options())};
  launch_rope(q, k, cos, sin, CacheWrite{}, &out, inverse);
  return out;
}

namespace {

// rope_write_cache's checks of what it writes: returns v's row stride.
int64_t check_cache_write(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& rows) {
  TORCH_CHECK(k.dim() == 4, "rope_write_cache: k must be (B, L, Hkv, hd)");
  const int64_t B = k.size(0), L = k.size(1), Hkv = k.size(2), hd = k.size(3);
  const int64_t v_row = v.dim() == 4 ? row_stride(v, 2) : -1;
  TORCH_CHECK(v.sizes() == k.sizes() && v_row > 0 && v.scalar_type() == k.scalar_type(),
              "rope_write_cache: v must be shaped like k, each row's heads packed");
  TORCH_CHECK(k_cache.dim() == 4 && (rows.defined() || k_cache.size(0) == B) && k_cache.size(1) == Hkv &&
                  k_cache.size(3) == hd && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous() && k_cache.scalar_type() == k.scalar_type() &&
                  v_cache.scalar_type() == k.scalar_type() && v.device() == k.device() &&
                  k_cache.device() == k.device() && v_cache.device() == k.device(),
              "rope_write_cache: the caches must be contiguous (B, Hkv, S, hd) in k's dtype");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == L && slots.scalar_type() == at::kLong &&
                  slots.device() == k.device() && slots.is_contiguous(),
              "rope_write_cache: one int64 slot per position, on the device");
  TORCH_CHECK(!rows.defined() || (rows.dim() == 1 && rows.size(0) == B && rows.scalar_type() == at::kLong &&
                                  rows.device() == k.device() && rows.is_contiguous()),
              "rope_write_cache: one int64 cache row per input row, on the device");
  return v_row;
}

std::atomic<bool> rope_in_attention_on{true};
std::atomic<bool> attention_lean_scratch_on{true};

}  // namespace

void set_rope_in_attention(bool on) { rope_in_attention_on = on; }
bool rope_in_attention() { return rope_in_attention_on; }
void set_attention_lean_scratch(bool on) { attention_lean_scratch_on = on; }
bool attention_lean_scratch() { return attention_lean_scratch_on; }

void rope_write_cache(at::Tensor& q, at::Tensor& k, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& rows) {
  const int64_t v_row = check_cache_write(k, v, k_cache, v_cache, slots, rows);
  CacheWrite cw;
  cw.rows = rows.defined() ? rows.data_ptr<int64_t>() : nullptr;
  cw.k = k_cache.data_ptr();
  cw.v = v_cache.data_ptr();
  cw.v_new = v.data_ptr();
  cw.v_row = v_row;
  cw.slots = slots.data_ptr<int64_t>();
  cw.S = k_cache.size(2);
  launch_rope(q, k, cos, sin, cw);
}

at::Tensor silu_mul(const at::Tensor& g, const at::Tensor& u) {
  const int64_t g_row = row_stride(g, 1), u_row = row_stride(u, 1);
  TORCH_CHECK(g.is_cuda() && g.dim() >= 1 && g_row > 0 && u_row > 0 && g.sizes() == u.sizes() &&
                  g.scalar_type() == u.scalar_type() && u.device() == g.device(),
              "silu_mul: g and u must be on CUDA, of one shape and dtype, with unit-stride rows evenly spaced");
  at::Tensor out = at::empty(g.sizes(), g.options());
  const int64_t n = g.numel(), F = g.size(-1);
  if (n == 0) return out;
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_float_types(g.scalar_type(), "silu_mul", [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    if (F % V == 0 && g_row % V == 0 && u_row % V == 0 && aligned_16(g.data_ptr()) && aligned_16(u.data_ptr()) &&
        aligned_16(out.data_ptr()) && n / V < (int64_t(1) << 32) - 256) {
      const int64_t n_vec = n / V;
      launch(silu_mul_vec_kernel<T, V>, unsigned((n_vec + 255) / 256), 256, 0, stream, ptr<T>(g), ptr<T>(u),
             ptr<T>(out), uint32_t(n_vec), uint32_t(F / V), g_row, u_row);
    } else {
      launch(silu_mul_kernel<T>, unsigned((n + 255) / 256), 256, 0, stream, ptr<T>(g), ptr<T>(u), ptr<T>(out), n, F,
             g_row, u_row);
    }
  });
  return out;
}

namespace {

// cache_attention: one block of kAttnWarps warps per (input row, KV head, 16 kAttnWarps query rows), a
// query row being one (position, head of the group) pair: t G + g. Each warp owns 16 query rows. Keys and
// values come in blocks of BK slots (BK hd = 4096 elements) through shared memory, two stages deep
// (cp.async: the next block loads while this one is used; a block costs a few hundred nanoseconds of work,
// a load from memory about as much latency). A warp takes its rows' scores on tensor cores (wmma, float32
// accumulation), then each row's online softmax in float32 on two lanes (the even and odd keys), then the
// probabilities (rounded to T) times the values on tensor cores again, which the two lanes add into their
// halves (even and odd columns) of the row's output, kept in float32 registers. Shared rows are padded
// (kPad) so that the lanes of a warp reading a column hit different banks.
// SPLIT (a tile's query rows fit one warp's 16, as in a decode step: G L <= 16): the warps share one tile
// and split each key block instead, warp w taking its keys [16 w, 16 w + 16) with an online softmax of its
// own; at the end the warps' shares are added up as the splits' are. Otherwise three warps of four would
// multiply zero rows, each reading the whole block from shared memory.
constexpr int kAttnWarps = 4;
constexpr int kAttnRows = 16 * kAttnWarps;

template <int HD>
struct AttnShape {
  static constexpr int BK = 4096 / HD;                 // keys per block: 64 (hd 64), 32 (hd 128)
  static constexpr int KLD = HD + 8;                   // a key's (value's, query's) row in shared memory, elements
  static constexpr int SLD = (BK > HD ? BK : HD) + 4;  // a warp's score or product row, floats
  static constexpr int PLD = BK + 8;                   // a warp's probability row, elements
  static constexpr int STAGE = BK * KLD;               // elements of keys (or values) per stage
  // LEAN: a warp's scratch holds its scores (16, BK), then their probabilities over them, then the value
  // product one (16, 16) column tile at a time: 16 (BK + 4) floats a warp instead of 16 SLD floats and
  // 16 PLD elements, so that more blocks fit on an SM.
  static constexpr int LLD = BK + 4;
  template <typename T, bool LEAN>
  static constexpr size_t smem() {
    return 4 * STAGE * sizeof(T)                                   // keys and values, two stages (the query tile first)
           + kAttnWarps * 16 * (LEAN ? LLD : SLD) * sizeof(float)  // per warp: scores, then the value product
           + (LEAN ? 0 : kAttnWarps * 16 * PLD * sizeof(T))        // per warp: probabilities
           + 2 * BK;                                               // the block's keep flags, two stages
  }
};

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// RoPE inside the attention (rope_cache_attention): q arrives unrotated and each block rotates its query
// tile as it loads it; the new keys, rotated, and values go to their slots of the cache, each written by
// the block of the one split whose keys hold that slot, before that block loads any key. Every query of an
// input row is in one tile (G L <= kAttnRows), so no other block reads those slots. Null cos: q arrives
// rotated and the cache already holds the new keys (cache_attention).
template <typename T>
struct RopeIn {
  const T* cos = nullptr;  // (E, 1, L, hd) contiguous, as sin: row e L + l
  const T* sin = nullptr;
  const T* k = nullptr;  // (E, L, Hkv, hd), each row's heads packed, rows k_row apart (v: v_row)
  const T* v = nullptr;
  int64_t k_row = 0, v_row = 0;
  T* k_cache = nullptr;  // the caches kc and vc, written
  T* v_cache = nullptr;
};

// LEAN: 4 blocks an SM, which caps a thread's registers at 128 (hd 128 and fp16 hd 64 without the split
// spill a few bytes to the L1).
template <typename T, int HD, bool SPLIT, bool LEAN>
__global__ void __launch_bounds__(kAttnWarps * 32, LEAN ? 4 : 0)
    cache_attention_kernel(const T* q, int64_t q_row, const T* kc, const T* vc, const int64_t* rows, const bool* keep,
                           int64_t keep_row, const int64_t* slots, int64_t L, int64_t G, int64_t Hkv, int64_t S,
                           int64_t span, float scale, int splits, int64_t per_split, T* out, float* part_o,
                           float* part_ml, RopeIn<T> ri) {
  using namespace nvcuda;
  using A = AttnShape<HD>;
  constexpr int BK = A::BK, KLD = A::KLD, V8 = HD / 8;  // V8: 16-byte vectors a row
  constexpr int SLD = LEAN ? A::LLD : A::SLD, PLD = A::PLD;
  static_assert(!LEAN || 16 * PLD * sizeof(T) <= 16 * SLD * sizeof(float), "probabilities over the scores");
  static_assert(BK % 16 == 0 && HD % 16 == 0 && 2 * A::STAGE >= kAttnRows * KLD, "tile shapes");
  extern __shared__ __align__(128) unsigned char smem[];
  T* kv_s = reinterpret_cast<T*>(smem);  // stage s: keys at kv_s + 2 s STAGE, values after them
  float* scratch = reinterpret_cast<float*>(kv_s + 4 * A::STAGE);
  T* probs = reinterpret_cast<T*>(scratch + kAttnWarps * 16 * SLD);
  bool* keep_s = reinterpret_cast<bool*>(probs + (LEAN ? 0 : kAttnWarps * 16 * PLD));  // stage s: keep_s + s BK

  wait_for_inputs();
  allow_dependents();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t e = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z % splits;
  const int64_t first = int64_t(blockIdx.z / splits) * kAttnRows, GL = G * L;
  const int64_t H = G * Hkv, cache_row = rows ? rows[e] : e;

  // The query tile (kAttnRows, HD), rows past G L zero, through the first stage's buffers.
  // The block's keys end at the largest slot of its queries (none sees a slot past its own), found by one
  // load per position, all in flight at once (a loop of dependent loads cost microseconds).
  __shared__ unsigned long long last_s;  // 1 + that slot
  if (threadIdx.x == 0) last_s = 0;
  T* qs = kv_s;
  for (int i = threadIdx.x; i < kAttnRows * V8; i += blockDim.x) {
    const int64_t r = i / V8, c = (i % V8) * 8, qi = first + r;
    uint4 x = make_uint4(0, 0, 0, 0);
    if (qi < GL) x = *reinterpret_cast<const uint4*>(q + (e * L + qi / G) * q_row + (kvh * G + qi % G) * HD + c);
    *reinterpret_cast<uint4*>(qs + r * KLD + c) = x;
  }
  __syncthreads();
  {
    const int64_t t = first / G + threadIdx.x;
    if (t <= (first + kAttnRows - 1) / G && t < L) atomicMax(&last_s, static_cast<unsigned long long>(slots[t] + 1));
  }
  if (ri.cos) {
    // The tile's live query rows rotated in place, as rope_kernel rotates them; then this split's new keys
    // and values into the cache (one tile: blockIdx.z is the split), where its key blocks start below.
    constexpr int HALF = HD / 2;
    for (int i = threadIdx.x; i < kAttnRows * HALF; i += blockDim.x) {
      const int r = i / HALF, c = i % HALF;
      if (first + r >= GL) continue;
      const int64_t pos = e * L + (first + r) / G;
      const T *cs = ri.cos + pos * HD, *sn = ri.sin + pos * HD;
      T* x = qs + r * KLD;
      rope_pair(x[c], x[c + HALF], cs[c], cs[c + HALF], sn[c], sn[c + HALF], false, x[c], x[c + HALF]);
    }
    const int64_t lo = split * per_split * BK, hi = lo + per_split * BK;
    for (int i = threadIdx.x; i < L * HALF; i += blockDim.x) {
      const int64_t l = i / HALF, c = i % HALF, slot = slots[l];
      if (slot < lo || slot >= hi) continue;
      const int64_t pos = e * L + l, dst = ((cache_row * Hkv + kvh) * S + slot) * HD;
      const T *x = ri.k + pos * ri.k_row + kvh * HD, *vn = ri.v + pos * ri.v_row + kvh * HD;
      const T *cs = ri.cos + pos * HD, *sn = ri.sin + pos * HD;
      rope_pair(x[c], x[c + HALF], cs[c], cs[c + HALF], sn[c], sn[c + HALF], false, ri.k_cache[dst + c],
                ri.k_cache[dst + c + HALF]);
      ri.v_cache[dst + c] = vn[c];
      ri.v_cache[dst + c + HALF] = vn[c + HALF];
    }
    __syncthreads();  // the rotated tile for the fragments, the written slots for the key loads
  }
  // The warp's query rows: its 16 of the tile, or with SPLIT the tile's first 16, shared by every warp.
  const int tile_row = SPLIT ? 0 : warp * 16;
  wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> qf[HD / 16];
#pragma unroll
  for (int d = 0; d < HD / 16; ++d) wmma::load_matrix_sync(qf[d], qs + tile_row * KLD + d * 16, KLD);

  // This lane's query row (of the warp's 16) and its parity: the keys, then the output columns, it owns.
  const int r = lane / 2, half = lane % 2;
  const int64_t qi = first + tile_row + r;
  // The keys of each block this warp takes: [kofs, kofs + NK) (with SPLIT, none for warps past BK / 16).
  constexpr int NK = SPLIT ? 16 : BK;
  const int kofs = SPLIT ? warp * 16 : 0;
  const bool has_keys = kofs < BK;
  const bool live = qi < GL;
  const int64_t own = live ? slots[qi / G] : -1;
  const bool* keep_e = keep + e * keep_row;
  const T* kbase = kc + (cache_row * Hkv + kvh) * S * HD;
  const T* vbase = vc + (cache_row * Hkv + kvh) * S * HD;
  float* sc = scratch + warp * 16 * SLD;
  T* pw = LEAN ? reinterpret_cast<T*>(sc) : probs + warp * 16 * PLD;
  __syncthreads();  // every warp holds its query fragments: the buffers take the keys
  const int64_t end = min(span, static_cast<int64_t>(last_s));
  // This split's key blocks: [b_first, b_end) of the span's (none when its share lies past the end).
  const int64_t b_first = split * per_split, b_end = min((end + BK - 1) / BK, b_first + per_split);

  // Block b's keys and values into stage b % 2 (slots past the end zero: 0 x garbage would be NaN), and its
  // keep flags into a register, stored at the top of its iteration.
  auto load = [&](int64_t b) {
    T* ks = kv_s + 2 * ((b - b_first) % 2) * A::STAGE;
    T* vs = ks + A::STAGE;
    const int64_t j0 = b * BK;
    for (int i = threadIdx.x; i < BK * V8; i += blockDim.x) {
      const int64_t j = i / V8, c = (i % V8) * 8;
      const bool in = j0 + j < end;
      cp_async16(ks + j * KLD + c, in ? kbase + (j0 + j) * HD + c : kbase, in);
      cp_async16(vs + j * KLD + c, in ? vbase + (j0 + j) * HD + c : vbase, in);
    }
    cp_async_commit();
  };
  bool kept = false;  // thread t < BK: keep flag of slot t of the block to come
  if (b_first < b_end) {
    load(b_first);
    const int64_t j = b_first * BK + threadIdx.x;
    if (threadIdx.x < BK) kept = j < end && keep_e[j];
  }

  float m = -INFINITY, l = 0.f, o[HD / 2];
#pragma unroll
  for (int c = 0; c < HD / 2; ++c) o[c] = 0.f;
  for (int64_t b = b_first; b < b_end; ++b) {
    const int stage = (b - b_first) % 2;
    const T* ks = kv_s + 2 * stage * A::STAGE;
    const T* vs = ks + A::STAGE;
    const bool* kb = keep_s + stage * BK;
    if (threadIdx.x < BK) keep_s[stage * BK + threadIdx.x] = kept;
    if (b + 1 < b_end) {
      load(b + 1);
      const int64_t j = (b + 1) * BK + threadIdx.x;
      if (threadIdx.x < BK) kept = j < end && keep_e[j];
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (has_keys) {
      // Scores (16, NK) = Q K^T: K stored (BK, HD) row-major is K^T column-major.
#pragma unroll
      for (int n = 0; n < NK / 16; ++n) {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> sf;
        wmma::fill_fragment(sf, 0.f);
#pragma unroll
        for (int d = 0; d < HD / 16; ++d) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> kf;
          wmma::load_matrix_sync(kf, ks + (kofs + n * 16) * KLD + d * 16, KLD);
          wmma::mma_sync(sf, qf[d], kf, sf);
        }
        wmma::store_matrix_sync(sc + n * 16, sf, SLD, wmma::mem_row_major);
      }
      __syncwarp();
      // Online softmax over this warp's visible keys of the block: key kofs + 2c + half.
      // The row sees the keys before its own slot where kept, and its own slot (own - first key: `mine`,
      // clamped to [-1, NK]; a padding row's own is -1, so it sees none). own < end, so no key past the end
      // passes.
      constexpr int C = NK / 2;
      const int64_t rel = own - b * BK - kofs;
      const int mine = rel < -1 ? -1 : rel > NK ? NK : static_cast<int>(rel);
      float s[C], top = -INFINITY;
#pragma unroll
      for (int c = 0; c < C; ++c) {
        const int jj = 2 * c + half;
        const bool seen = jj < mine ? kb[kofs + jj] : jj == mine;
        s[c] = seen ? sc[r * SLD + jj] * scale : -INFINITY;  // scale: the softmax scale times log2(e)
        top = fmaxf(top, s[c]);
      }
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
      const float m_new = fmaxf(m, top);
      const float corr = m_new == -INFINITY ? 1.f : exp2f(m - m_new);
      const float shift = m_new == -INFINITY ? 0.f : m_new;  // 2^(-inf - shift) = 0 for the keys not seen
      if constexpr (LEAN) __syncwarp();  // every lane holds its scores: the probabilities go over them
      float sum = 0.f;
#pragma unroll
      for (int c = 0; c < C; ++c) {
        const float p = exp2f(s[c] - shift);
        sum += p;
        pw[r * PLD + 2 * c + half] = from_f<T>(p);
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      l = l * corr + sum;
      m = m_new;
      __syncwarp();
      // (16, HD) = P V over this warp's keys, added into the lanes' columns of the output rows.
      if constexpr (LEAN) {
        // The probabilities into fragments, then one (16, 16) column tile of the product at a time over them.
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> pf[NK / 16];
#pragma unroll
        for (int kk = 0; kk < NK / 16; ++kk) wmma::load_matrix_sync(pf[kk], pw + kk * 16, PLD);
        __syncwarp();
#pragma unroll
        for (int n = 0; n < HD / 16; ++n) {
          wmma::fragment<wmma::accumulator, 16, 16, 16, float> of;
          wmma::fill_fragment(of, 0.f);
#pragma unroll
          for (int kk = 0; kk < NK / 16; ++kk) {
            wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> vf;
            wmma::load_matrix_sync(vf, vs + (kofs + kk * 16) * KLD + n * 16, KLD);
            wmma::mma_sync(of, pf[kk], vf, of);
          }
          wmma::store_matrix_sync(sc, of, SLD, wmma::mem_row_major);
          __syncwarp();
#pragma unroll
          for (int c = 0; c < 8; ++c) o[8 * n + c] = o[8 * n + c] * corr + sc[r * SLD + 2 * c + half];
          __syncwarp();
        }
      } else {
#pragma unroll
        for (int n = 0; n < HD / 16; ++n) {
          wmma::fragment<wmma::accumulator, 16, 16, 16, float> of;
          wmma::fill_fragment(of, 0.f);
#pragma unroll
          for (int kk = 0; kk < NK / 16; ++kk) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> pf;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> vf;
            wmma::load_matrix_sync(pf, pw + kk * 16, PLD);
            wmma::load_matrix_sync(vf, vs + (kofs + kk * 16) * KLD + n * 16, KLD);
            wmma::mma_sync(of, pf, vf, of);
          }
          wmma::store_matrix_sync(sc + n * 16, of, SLD, wmma::mem_row_major);
        }
        __syncwarp();
#pragma unroll
        for (int c = 0; c < HD / 2; ++c) o[c] = o[c] * corr + sc[r * SLD + 2 * c + half];
      }
    }
    __syncthreads();  // the stage is loaded again two blocks on
  }
  if constexpr (SPLIT) {
    static_assert(kAttnWarps * 16 * (HD + 2) * sizeof(float) <= 4 * A::STAGE * sizeof(T), "the shares' buffer");
    // The warps' shares of the tile's rows, added up in warp 0 through the (now free) key buffers: each
    // weighted by 2^(its maximum - the row's maximum), as cache_attention_combine adds the splits'.
    float* share = reinterpret_cast<float*>(smem);  // per warp: 16 rows of (HD outputs, maximum, sum)
    constexpr int RS = HD + 2;
    float* mine_s = share + (warp * 16 + r) * RS;
#pragma unroll
    for (int c = 0; c < HD / 2; ++c) mine_s[2 * c + half] = o[c];
    if (half == 0) {
      mine_s[HD] = m;
      mine_s[HD + 1] = l;
    }
    __syncthreads();
    if (warp != 0) return;
    float top = -INFINITY;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) top = fmaxf(top, share[(w * 16 + r) * RS + HD]);
    float lsum = 0.f;
#pragma unroll
    for (int c = 0; c < HD / 2; ++c) o[c] = 0.f;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) {
      const float* ws = share + (w * 16 + r) * RS;
      if (ws[HD] == -INFINITY) continue;  // a warp that saw no key of this row
      const float wt = exp2f(ws[HD] - top);
      lsum += wt * ws[HD + 1];
#pragma unroll
      for (int c = 0; c < HD / 2; ++c) o[c] += wt * ws[2 * c + half];
    }
    m = top;
    l = lsum;
  }
  if (!live) return;
  const int64_t row = (e * L + qi / G) * H + kvh * G + qi % G;  // the output row, (e, t, h)
  if (splits == 1) {
    T* dst = out + row * HD + half;
    const float inv = 1.f / l;
#pragma unroll
    for (int c = 0; c < HD / 2; ++c) dst[2 * c] = from_f<T>(o[c] * inv);
    return;
  }
  // A split's share: its row's maximum (log2 units) and sum, and the unnormalised output.
  const int64_t rows_all = gridDim.x * L * H, at = split * rows_all + row;
  float* dst = part_o + at * HD + half;
#pragma unroll
  for (int c = 0; c < HD / 2; ++c) dst[2 * c] = o[c];
  if (half == 0) {
    part_ml[2 * at] = m;
    part_ml[2 * at + 1] = l;
  }
}

// The splits' shares of each output row added up, each weighted by 2^(its maximum - the row's maximum).
// A block of (HD, 4) threads takes four rows.
template <typename T>
__global__ void cache_attention_combine(const float* part_o, const float* part_ml, int splits, int64_t rows_all, int HD,
                                        T* out) {
  wait_for_inputs();
  allow_dependents();
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= rows_all) return;
  float top = -INFINITY;
  for (int sp = 0; sp < splits; ++sp) top = fmaxf(top, part_ml[2 * (sp * rows_all + row)]);
  float l = 0.f, acc = 0.f;
  for (int sp = 0; sp < splits; ++sp) {
    const int64_t at = sp * rows_all + row;
    const float m = part_ml[2 * at];
    if (m == -INFINITY) continue;  // a split that saw no key of this row
    const float w = exp2f(m - top);
    l += w * part_ml[2 * at + 1];
    acc += w * part_o[at * HD + threadIdx.x];
  }
  out[row * HD + threadIdx.x] = from_f<T>(acc / l);
}

// The kernel's resident blocks per SM (as many as its shared memory lets fit), once per device; its
// dynamic shared memory limit is raised there first when it needs more than the default 48 KiB.
template <typename T, int HD, bool SPLIT, bool LEAN>
int64_t cache_attention_blocks_per_sm(size_t smem) {
  static std::mutex mu;
  static std::map<int, int> per_device;
  const std::lock_guard<std::mutex> lock(mu);
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  auto it = per_device.find(dev);
  if (it == per_device.end()) {
    if (smem > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(cache_attention_kernel<T, HD, SPLIT, LEAN>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    }
    int n = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, cache_attention_kernel<T, HD, SPLIT, LEAN>,
                                                                 kAttnWarps * 32, smem));
    it = per_device.emplace(dev, std::max(n, 1)).first;
  }
  return it->second;
}

}  // namespace

int64_t cache_attention_splits(int64_t units, int64_t key_blocks, int64_t resident) {
  int64_t best = 1, best_cost = std::numeric_limits<int64_t>::max();
  for (int64_t s = 1; s <= key_blocks; ++s) {
    const int64_t per = (key_blocks + s - 1) / s;
    if ((s - 1) * per >= key_blocks) continue;  // s - 1 splits of `per` blocks cover them: one would be empty
    const int64_t cost = (units * s + resident - 1) / resident * (per + 1);
    if (cost < best_cost) {
      best = s;
      best_cost = cost;
    }
  }
  return best;
}

namespace {

// rope_cache_attention's inputs beside cache_attention's: the unrotated keys and values, and the tables.
struct RopeArgs {
  const at::Tensor *k = nullptr, *v = nullptr, *cos = nullptr, *sin = nullptr;
  int64_t k_row = 0, v_row = 0;
};

template <typename T, int HD, bool LEAN>
void launch_cache_attention(const at::Tensor& q, int64_t q_row, const at::Tensor& kc, const at::Tensor& vc,
                            const at::Tensor& rows, const at::Tensor& keep, const at::Tensor& slots, int64_t span,
                            float scale, const at::Tensor& out, const RopeArgs* rope) {
  RopeIn<T> ri;
  if (rope) {
    ri = {ptr<T>(*rope->cos), ptr<T>(*rope->sin), ptr<T>(*rope->k), ptr<T>(*rope->v),
          rope->k_row,        rope->v_row,        ptr<T>(kc),       ptr<T>(vc)};
  }
  constexpr size_t smem = AttnShape<HD>::template smem<T, LEAN>();
  const int64_t E = q.size(0), L = q.size(1), H = q.size(2), Hkv = kc.size(1), G = H / Hkv;
  // One warp's 16 query rows hold the tile (a decode step's G L <= 16): the warps split each key block.
  const bool split_keys = G * L <= 16;
  const int64_t tiles = (G * L + kAttnRows - 1) / kAttnRows,
                blocks = (span + AttnShape<HD>::BK - 1) / AttnShape<HD>::BK;
  // A block of 4 warps walks its keys one block after another, each step a chain of dependent instructions,
  // so the span's key blocks are split between blocks (flash-decoding), and a second kernel adds the
  // splits' shares: cache_attention_splits picks how many.
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t per_sm = split_keys ? cache_attention_blocks_per_sm<T, HD, true, LEAN>(smem)
                                    : cache_attention_blocks_per_sm<T, HD, false, LEAN>(smem);
  const int64_t splits = cache_attention_splits(E * Hkv * tiles, blocks, per_sm * sms);
  const int64_t per_split = (blocks + splits - 1) / splits;
  const int64_t rows_all = E * L * H;
  at::Tensor part_o, part_ml;
  if (splits > 1) {
    part_o = at::empty({splits, rows_all, HD}, q.options().dtype(at::kFloat));
    part_ml = at::empty({splits, rows_all, 2}, q.options().dtype(at::kFloat));
  }
  const auto stream = at::cuda::getCurrentCUDAStream();
  const dim3 grid(unsigned(E), unsigned(Hkv), unsigned(tiles * splits));
  auto launch_split = [&](auto split_tag) {
    launch(cache_attention_kernel<T, HD, decltype(split_tag)::value, LEAN>, grid, kAttnWarps * 32, smem, stream,
           ptr<T>(q), q_row, ptr<T>(kc), ptr<T>(vc), rows.defined() ? rows.data_ptr<int64_t>() : nullptr,
           keep.data_ptr<bool>(), keep.stride(0), slots.data_ptr<int64_t>(), L, G, Hkv, kc.size(2), span,
           scale * static_cast<float>(M_LOG2E), int(splits), per_split, ptr<T>(out),
           splits > 1 ? part_o.data_ptr<float>() : nullptr, splits > 1 ? part_ml.data_ptr<float>() : nullptr, ri);
  };
  if (split_keys) {
    launch_split(std::true_type{});
  } else {
    launch_split(std::false_type{});
  }
  if (splits > 1) {
    constexpr int kRowsPerBlock = 4;
    launch(cache_attention_combine<T>, unsigned((rows_all + kRowsPerBlock - 1) / kRowsPerBlock),
           dim3(HD, kRowsPerBlock), 0, stream, part_o.data_ptr<float>(), part_ml.data_ptr<float>(), int(splits),
           rows_all, HD, ptr<T>(out));
  }
}

}  // namespace

bool cache_attention_supports(at::ScalarType dtype, int64_t head_dim) {
  return (dtype == at::kBFloat16 || dtype == at::kHalf) && (head_dim == 64 || head_dim == 128);
}

namespace {

at::Tensor attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& rows,
                  const at::Tensor& keep, const at::Tensor& slots, int64_t span, double scale, const RopeArgs* rope) {
  TORCH_CHECK(q.is_cuda() && q.dim() == 4, "cache_attention: q must be (E, L, H, hd) on CUDA");
  const int64_t E = q.size(0), L = q.size(1), H = q.size(2), hd = q.size(3);
  TORCH_CHECK(cache_attention_supports(q.scalar_type(), hd),
              "cache_attention: bfloat16 or float16 with hd 64 or 128, got ", q.scalar_type(), " and hd ", hd);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(3) == hd && H % k_cache.size(1) == 0 && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type() &&
                  k_cache.device() == q.device() && v_cache.device() == q.device(),
              "cache_attention: the caches must be contiguous (Bc, Hkv, S, hd) in q's dtype, H a multiple of Hkv");
  TORCH_CHECK(span >= 1 && span <= k_cache.size(2), "cache_attention: span ", span, " outside [1, ", k_cache.size(2),
              "]");
  TORCH_CHECK(rows.defined() ? rows.dim() == 1 && rows.size(0) == E && rows.scalar_type() == at::kLong &&
                                   rows.is_contiguous() && rows.device() == q.device()
                             : E == k_cache.size(0),
              "cache_attention: one int64 cache row per input row, on the device (or none: one input row per "
              "cache row)");
  TORCH_CHECK(keep.dim() == 2 && keep.size(0) == E && keep.size(1) >= span && keep.scalar_type() == at::kBool &&
                  keep.stride(1) == 1 && keep.device() == q.device(),
              "cache_attention: keep must be (E, >= span) bool with contiguous rows");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == L && slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.device() == q.device(),
              "cache_attention: one int64 slot per query position, on the device");
  // 16-byte loads of q's heads: rows packed and evenly spaced, aligned; otherwise an aligned copy (clone: a
  // contiguous tensor at an odd offset would come back from contiguous() as it is).
  at::Tensor qq = q;
  int64_t q_row = row_stride(q, 2);
  if (q_row <= 0 || q_row % 8 != 0 || reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 != 0) {
    qq = q.clone(at::MemoryFormat::Contiguous);
    q_row = H * hd;
  }
  TORCH_CHECK(reinterpret_cast<uintptr_t>(k_cache.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(v_cache.data_ptr()) % 16 == 0,
              "cache_attention: the caches must start 16-byte aligned");
  at::Tensor out = at::empty({E, L, H, hd}, q.options());
  if (out.numel() == 0) return out;
  const c10::cuda::CUDAGuard guard(q.device());
  const float s = static_cast<float>(scale);
  auto run = [&](auto lean_tag) {
    constexpr bool LEAN = decltype(lean_tag)::value;
    if (q.scalar_type() == at::kBFloat16) {
      if (hd == 64)
        launch_cache_attention<__nv_bfloat16, 64, LEAN>(qq, q_row, k_cache, v_cache, rows, keep, slots, span, s, out,
                                                        rope);
      else
        launch_cache_attention<__nv_bfloat16, 128, LEAN>(qq, q_row, k_cache, v_cache, rows, keep, slots, span, s, out,
                                                         rope);
    } else {
      if (hd == 64)
        launch_cache_attention<__half, 64, LEAN>(qq, q_row, k_cache, v_cache, rows, keep, slots, span, s, out, rope);
      else
        launch_cache_attention<__half, 128, LEAN>(qq, q_row, k_cache, v_cache, rows, keep, slots, span, s, out, rope);
    }
  };
  if (attention_lean_scratch()) {
    run(std::true_type{});
  } else {
    run(std::false_type{});
  }
  return out;
}

}  // namespace

at::Tensor cache_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& rows, const at::Tensor& keep, const at::Tensor& slots, int64_t span,
                           double scale) {
  return attend(q, k_cache, v_cache, rows, keep, slots, span, scale, nullptr);
}

at::Tensor rope_cache_attention(at::Tensor& q, at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                                const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& rows,
                                const at::Tensor& keep, const at::Tensor& slots, int64_t span, double scale) {
  const int64_t v_row = check_cache_write(k, v, k_cache, v_cache, slots, rows);
  const int64_t B = k.size(0), L = k.size(1), Hkv = k.size(2), hd = k.size(3), k_row = row_stride(k, 2);
  // One query tile a row (the kernel writes a row's new slots before any of its blocks reads them), k laid
  // out as rope_kernel takes it, and the tables as it takes them; otherwise the two kernels.
  const bool one_tile = q.dim() == 4 && q.size(0) == B && q.size(1) == L && q.size(3) == hd && Hkv > 0 &&
                        q.size(2) % Hkv == 0 && q.size(2) / Hkv * L <= kAttnRows;
  if (!rope_in_attention() || !one_tile || !rope_tables_fit(q, cos, sin, B, L, hd) || k_row <= 0 ||
      k.scalar_type() != q.scalar_type() || k.device() != q.device()) {
    rope_write_cache(q, k, v, cos, sin, k_cache, v_cache, slots, rows);
    return cache_attention(q, k_cache, v_cache, rows, keep, slots, span, scale);
  }
  const RopeArgs rope{&k, &v, &cos, &sin, k_row, v_row};
  return attend(q, k_cache, v_cache, rows, keep, slots, span, scale, &rope);
}

// ---------------------------------------------------------------------------------------------------
// squeeze_slots_: one block per (tensor, row, KV head) moves that row's kept slots down in place, in chunks
// of kSqueezeThreads x kSqueezePerThread 16-byte vectors: every thread loads its vectors of the chunk, the block syncs,
// then every thread stores them. Chunk c writes slots [j0, j0 + C) and reads slots order[j] >= j >= j0, so it reads
// nothing an earlier chunk wrote, and within the chunk every read precedes every write.
namespace {

constexpr int kSqueezeThreads = 256, kSqueezePerThread = 4;

__global__ void __launch_bounds__(kSqueezeThreads)
    squeeze_slots_kernel(const int64_t* __restrict__ bases, const int64_t* __restrict__ order, int64_t S, int Hkv,
                         int64_t max_len, int vecs_per_slot) {
  const int tensor = blockIdx.y, row = blockIdx.x / Hkv, head = blockIdx.x % Hkv;
  uint4* base = reinterpret_cast<uint4*>(bases[tensor]) + ((int64_t(row) * Hkv + head) * max_len) * vecs_per_slot;
  const int64_t* row_order = order + int64_t(row) * S;
  const int64_t chunk = int64_t(kSqueezeThreads) * kSqueezePerThread / vecs_per_slot;  // slots
  for (int64_t j0 = 0; j0 < S; j0 += chunk) {
    uint4 held[kSqueezePerThread];
    int64_t to[kSqueezePerThread];
#pragma unroll
    for (int r = 0; r < kSqueezePerThread; ++r) {
      const int i = threadIdx.x + r * kSqueezeThreads;
      const int64_t j = j0 + i / vecs_per_slot;
      to[r] = -1;
      if (j < S) {
        const int64_t from = row_order[j];
        if (from > j) {  // kept slots only move down; from == j stays, and a row's slots past its kept ones
                         // (order 0 there) keep what they hold
          held[r] = base[from * vecs_per_slot + i % vecs_per_slot];
          to[r] = j * vecs_per_slot + i % vecs_per_slot;
        }
      }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kSqueezePerThread; ++r) {
      if (to[r] >= 0) base[to[r]] = held[r];
    }
  }
}

}  // namespace

bool squeeze_slots_supports(const std::vector<at::Tensor>& k, const std::vector<at::Tensor>& v) {
  if (k.empty() || v.size() != k.size()) return false;
  const at::Tensor& t0 = k[0];
  // A chunk holds kSqueezeThreads * kSqueezePerThread vectors: at least one slot (16 KiB).
  const int64_t slot_bytes = t0.dim() == 4 ? t0.size(3) * t0.element_size() : 0;
  if (!t0.is_cuda() || slot_bytes == 0 || slot_bytes % 16 != 0 ||
      slot_bytes / 16 > int64_t(kSqueezeThreads) * kSqueezePerThread) {
    return false;
  }
  for (const auto* layers : {&k, &v}) {
    for (const at::Tensor& t : *layers) {
      if (t.sizes() != t0.sizes() || t.scalar_type() != t0.scalar_type() || t.device() != t0.device() ||
          !t.is_contiguous() || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) {
        return false;
      }
    }
  }
  return true;
}

void squeeze_slots_(std::vector<at::Tensor>& k, std::vector<at::Tensor>& v, const at::Tensor& order) {
  TORCH_CHECK(squeeze_slots_supports(k, v),
              "squeeze_slots_: the caches must be contiguous (B, Hkv, S, hd) CUDA tensors of one shape and dtype, "
              "16-byte aligned, a slot a multiple of 16 bytes up to 16 KiB");
  const at::Tensor& t0 = k[0];
  const int64_t B = t0.size(0), Hkv = t0.size(1), max_len = t0.size(2);
  TORCH_CHECK(order.dim() == 2 && order.size(0) == B && order.size(1) <= max_len && order.scalar_type() == at::kLong &&
                  order.is_contiguous() && order.device() == t0.device(),
              "squeeze_slots_: order must be (B, S <= ", max_len, ") contiguous int64 on the caches' device");
  const int64_t S = order.size(1), n = 2 * static_cast<int64_t>(k.size());
  if (B == 0 || S == 0) return;
  TORCH_CHECK(B * Hkv <= INT32_MAX && n <= 65535, "squeeze_slots_: too many rows or layers for one launch");
  std::vector<int64_t> bases;
  for (const auto* layers : {&k, &v}) {
    for (const at::Tensor& t : *layers)
      bases.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr())));
  }
  const c10::cuda::CUDAGuard guard(t0.device());
  at::Tensor dev_bases = at::tensor(bases, at::kLong).pin_memory().to(t0.device(), /*non_blocking=*/true);
  const int vecs = static_cast<int>(t0.size(3) * t0.element_size() / 16);
  squeeze_slots_kernel<<<dim3(unsigned(B * Hkv), unsigned(n)), kSqueezeThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      dev_bases.data_ptr<int64_t>(), order.data_ptr<int64_t>(), S, int(Hkv), max_len, vecs);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace rlt::cuda
