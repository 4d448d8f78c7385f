// Fused RMSNorm, residual add + RMSNorm, RoPE and SiLU-gate kernels; see decode_kernels.h.
// Every float operation is written with an explicit rounding intrinsic (__fmul_rn, __fadd_rn, ...): nvcc
// would otherwise contract a multiply and an add into one FMA, which ATen's separate kernels never form,
// and the float32 results would drift from the reference by an ulp.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/cuda/dtypes.cuh"
#include "model/cuda/decode_kernels.h"

namespace rlt::cuda {

namespace {

constexpr int kNormThreads = 128;

__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_sums[kNormThreads / 32];
  for (int off = 16; off > 0; off >>= 1) v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, v, off));
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kNormThreads / 32; ++w) total = __fadd_rn(total, warp_sums[w]);
  return total;
}

// One block per row. With `b`, the row is first h = a + b, written to `h`; the norm reads h back (each
// thread its own elements, so no barrier is needed between the write and the read).
template <typename T>
__global__ void __launch_bounds__(kNormThreads)
    rms_norm_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ h, const T* __restrict__ w,
                    int64_t D, float eps, bool gemma, T* __restrict__ out) {
  const int64_t off = int64_t(blockIdx.x) * D;
  const T* x = b ? h + off : a + off;
  float sq = 0.f;
  for (int64_t i = threadIdx.x; i < D; i += kNormThreads) {
    float v;
    if (b) {
      v = round_to<T>(__fadd_rn(to_f(a[off + i]), to_f(b[off + i])));
      h[off + i] = from_f<T>(v);
    } else {
      v = to_f(x[i]);
    }
    sq = __fadd_rn(sq, __fmul_rn(v, v));
  }
  const float ms = __fmul_rn(block_sum(sq), 1.0f / float(D));
  const float r = rsqrtf(__fadd_rn(ms, eps));
  for (int64_t i = threadIdx.x; i < D; i += kNormThreads) {
    const float y = __fmul_rn(to_f(x[i]), r);
    out[off + i] =
        gemma ? from_f<T>(__fmul_rn(y, __fadd_rn(1.0f, to_f(w[i])))) : from_f<T>(__fmul_rn(to_f(w[i]), round_to<T>(y)));
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
};

template <typename T>
__global__ void rope_kernel(T* __restrict__ q, T* __restrict__ k, const T* __restrict__ cos_t,
                            const T* __restrict__ sin_t, int64_t rows, int64_t L, int64_t H, int64_t Hkv, int64_t hd,
                            int64_t q_row, int64_t k_row, CacheWrite cw) {
  const int64_t half = hd / 2, heads = H + Hkv;
  const int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= rows * heads * half) return;
  const int64_t i = n % half, head = (n / half) % heads, row = n / (half * heads);  // row = b * L + l
  const bool is_q = head < H;
  const int64_t kv = head - H;
  T* x = is_q ? q + row * q_row + head * hd : k + row * k_row + kv * hd;
  const T* c = cos_t + row * hd;
  const T* s = sin_t + row * hd;
  const float x1 = to_f(x[i]), x2 = to_f(x[i + half]);
  // x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]; each product and the sum rounded.
  const float y1 = __fadd_rn(round_to<T>(__fmul_rn(x1, to_f(c[i]))), round_to<T>(__fmul_rn(-x2, to_f(s[i]))));
  const float y2 =
      __fadd_rn(round_to<T>(__fmul_rn(x2, to_f(c[i + half]))), round_to<T>(__fmul_rn(x1, to_f(s[i + half]))));
  if (is_q || !cw.k) {
    x[i] = from_f<T>(y1);
    x[i + half] = from_f<T>(y2);
    return;
  }
  const int64_t b = row / L, l = row % L;
  const int64_t dst = ((b * Hkv + kv) * cw.S + cw.slots[l]) * hd;
  T* kc = static_cast<T*>(cw.k) + dst;
  T* vc = static_cast<T*>(cw.v) + dst;
  const T* vn = static_cast<const T*>(cw.v_new) + row * cw.v_row + kv * hd;
  kc[i] = from_f<T>(y1);
  kc[i + half] = from_f<T>(y2);
  vc[i] = vn[i];
  vc[i + half] = vn[i + half];
}

// g and u: rows of F elements a fixed stride apart (contiguous, or the halves of a packed gate/up output).
template <typename T>
__global__ void silu_mul_kernel(const T* __restrict__ g, const T* __restrict__ u, T* __restrict__ out, int64_t n,
                                int64_t F, int64_t g_row, int64_t u_row) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t r = i / F, j = i % F;
  const float x = to_f(g[r * g_row + j]);
  const float act = round_to<T>(__fdiv_rn(x, __fadd_rn(1.0f, expf(-x))));  // ATen's silu: x / (1 + e^-x)
  out[i] = from_f<T>(__fmul_rn(act, to_f(u[r * u_row + j])));
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
    rms_norm_kernel<T><<<unsigned(rows), kNormThreads, 0, stream>>>(ptr<T>(a), b ? ptr<T>(*b) : nullptr,
                                                                    h ? ptr<T>(*h) : nullptr, ptr<T>(w), D,
                                                                    static_cast<float>(eps), gemma, ptr<T>(out));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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

void launch_rope(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin, const CacheWrite& cw) {
  const int64_t q_row = q.dim() == 4 ? row_stride(q, 2) : -1, k_row = k.dim() == 4 ? row_stride(k, 2) : -1;
  TORCH_CHECK(q.is_cuda() && q_row > 0 && k_row > 0 && k.device() == q.device() && cos.device() == q.device() &&
                  sin.device() == q.device(),
              "rope_: q (B, L, H, hd) and k (B, L, Hkv, hd) on CUDA must hold each row's heads packed, rows evenly "
              "spaced");
  const int64_t B = q.size(0), L = q.size(1), H = q.size(2), hd = q.size(3), Hkv = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(1) == L && k.size(3) == hd && hd % 2 == 0, "rope_: q and k disagree");
  TORCH_CHECK(cos.sizes() == at::IntArrayRef({B, 1, L, hd}) && sin.sizes() == cos.sizes() && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.scalar_type() == q.scalar_type() && sin.scalar_type() == q.scalar_type() &&
                  k.scalar_type() == q.scalar_type(),
              "rope_: cos and sin must be contiguous (B, 1, L, hd) in q's dtype");
  const int64_t n = B * L * (H + Hkv) * (hd / 2);
  if (n == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_float_types(q.scalar_type(), "rope_", [&](auto tag) {
    using T = decltype(tag);
    rope_kernel<T><<<unsigned((n + 255) / 256), 256, 0, stream>>>(ptr<T>(q), ptr<T>(k), ptr<T>(cos), ptr<T>(sin), B * L,
                                                                  L, H, Hkv, hd, q_row, k_row, cw);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void rope_(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  launch_rope(q, k, cos, sin, CacheWrite{});
}

void rope_write_cache(at::Tensor& q, at::Tensor& k, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots) {
  const int64_t B = k.size(0), L = k.size(1), Hkv = k.size(2), hd = k.size(3);
  const int64_t v_row = v.dim() == 4 ? row_stride(v, 2) : -1;
  TORCH_CHECK(v.sizes() == k.sizes() && v_row > 0 && v.scalar_type() == k.scalar_type(),
              "rope_write_cache: v must be shaped like k, each row's heads packed");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(0) == B && k_cache.size(1) == Hkv && k_cache.size(3) == hd &&
                  k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == k.scalar_type() && v_cache.scalar_type() == k.scalar_type() &&
                  v.device() == k.device() && k_cache.device() == k.device() && v_cache.device() == k.device(),
              "rope_write_cache: the caches must be contiguous (B, Hkv, S, hd) in k's dtype");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == L && slots.scalar_type() == at::kLong &&
                  slots.device() == k.device() && slots.is_contiguous(),
              "rope_write_cache: one int64 slot per position, on the device");
  CacheWrite cw;
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
    silu_mul_kernel<T>
        <<<unsigned((n + 255) / 256), 256, 0, stream>>>(ptr<T>(g), ptr<T>(u), ptr<T>(out), n, F, g_row, u_row);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace rlt::cuda
