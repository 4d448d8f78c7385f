// RMSNorm and SiLU-gate backward kernels; see train_kernels.h.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <type_traits>

#include "common/cuda/dtypes.cuh"
#include "model/cuda/train_kernels.h"

namespace rlt::cuda {

namespace {

template <typename T>
T* ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

// The block's sums of a and of b, on every thread. Ends with a barrier, so the next call may reuse the
// shared slots.
template <int THREADS>
__device__ __forceinline__ float2 block_sum2(float a, float b) {
  __shared__ float2 warp_sums[THREADS / 32];
  for (int off = 16; off > 0; off >>= 1) {
    a += __shfl_down_sync(0xffffffffu, a, off);
    b += __shfl_down_sync(0xffffffffu, b, off);
  }
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = make_float2(a, b);
  __syncthreads();
  float2 total = make_float2(0.f, 0.f);
#pragma unroll
  for (int w = 0; w < THREADS / 32; ++w) {
    total.x += warp_sums[w].x;
    total.y += warp_sums[w].y;
  }
  __syncthreads();
  return total;
}

// Each block walks rows blockIdx.x, blockIdx.x + gridDim.x, …; each thread holds PER elements of a row
// (columns threadIdx.x + k THREADS), its weights, and its columns' share of grad_w over the block's rows,
// written at the end to partial (gridDim.x, D) in float32 for one sum over the blocks.
//   x_hat = x r, r = rsqrt(mean(x^2) + eps)
//   llama: y = w * cast(x_hat)     dy/dx_hat = g w        grad_w += g cast(x_hat)
//   gemma: y = cast(x_hat (1 + w)) dy/dx_hat = g (1 + w)  grad_w += g x_hat
//   grad_x = r (gy - x_hat mean(gy x_hat)) (+ extra, after rounding)
template <typename T, int THREADS, int PER>
__global__ void __launch_bounds__(THREADS)
    rms_norm_backward_kernel(const T* __restrict__ grad, const T* __restrict__ x, const T* __restrict__ w,
                             const T* __restrict__ extra, int64_t rows, int64_t D, float eps, bool gemma,
                             T* __restrict__ grad_x, float* __restrict__ partial) {
  float wv[PER], acc[PER];
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int64_t i = threadIdx.x + int64_t(k) * THREADS;
    wv[k] = i < D ? (gemma ? 1.0f + to_f(w[i]) : to_f(w[i])) : 0.f;
    acc[k] = 0.f;
  }
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t off = row * D;
    float xv[PER], gv[PER];
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int64_t i = threadIdx.x + int64_t(k) * THREADS;
      xv[k] = i < D ? to_f(x[off + i]) : 0.f;
      gv[k] = i < D ? to_f(grad[off + i]) : 0.f;
    }
    float sq = 0.f;
#pragma unroll
    for (int k = 0; k < PER; ++k) sq += xv[k] * xv[k];
    const float r = rsqrtf(block_sum2<THREADS>(sq, 0.f).x / float(D) + eps);
    float dot = 0.f;
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const float hat = xv[k] * r;
      acc[k] += gv[k] * (gemma ? hat : round_to<T>(hat));
      gv[k] *= wv[k];  // gy, the gradient at x_hat
      dot += gv[k] * hat;
    }
    const float mean_dot = block_sum2<THREADS>(dot, 0.f).x / float(D);
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int64_t i = threadIdx.x + int64_t(k) * THREADS;
      if (i >= D) break;
      float gx = r * (gv[k] - xv[k] * r * mean_dot);
      // Rounded before the residual's gradient is added, as autograd adds the two: a checkpointed layer,
      // whose residual add is its own node, gets the same gradients bit for bit.
      if (extra) gx = round_to<T>(gx) + to_f(extra[off + i]);
      grad_x[off + i] = from_f<T>(gx);
    }
  }
  if (!partial) return;
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int64_t i = threadIdx.x + int64_t(k) * THREADS;
    if (i < D) partial[int64_t(blockIdx.x) * D + i] = acc[k];
  }
}

// Element i of silu_mul's gradients: grad_u = dy silu(g), grad_g = (dy u) silu'(g), each rounded as ATen's
// autograd of silu(g) * u rounds it.
template <typename T>
__device__ __forceinline__ void silu_mul_grads(T grad, T g, T u, T& grad_g, T& grad_u) {
  const float x = to_f(g), dy = to_f(grad);
  const float act = round_to<T>(__fdiv_rn(x, __fadd_rn(1.0f, expf(-x))));  // the forward's silu(g), as stored
  grad_u = from_f<T>(__fmul_rn(dy, act));
  const float d_act = round_to<T>(__fmul_rn(dy, to_f(u)));
  const float s = 1.0f / (1.0f + expf(-x));
  grad_g = from_f<T>(d_act * s * (1.0f + x * (1.0f - s)));
}

template <typename T>
__global__ void silu_mul_backward_kernel(const T* __restrict__ grad, const T* __restrict__ g, const T* __restrict__ u,
                                         T* __restrict__ grad_g, T* __restrict__ grad_u, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  silu_mul_grads(grad[i], g[i], u[i], grad_g[i], grad_u[i]);
}

// V elements a thread in 16-byte loads and stores (every pointer 16-byte aligned, n a multiple of V), as
// silu_mul's forward does (decode_kernels.cu).
template <typename T, int V>
__global__ void silu_mul_backward_vec_kernel(const T* __restrict__ grad, const T* __restrict__ g,
                                             const T* __restrict__ u, T* __restrict__ grad_g, T* __restrict__ grad_u,
                                             int64_t n_vec) {
  const int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V;
  if (i >= n_vec * V) return;
  const Pack<T, V> dp = load_pack<V>(grad + i), gp = load_pack<V>(g + i), up = load_pack<V>(u + i);
  Pack<T, V> gg, gu;
#pragma unroll
  for (int k = 0; k < V; ++k) silu_mul_grads(dp.v[k], gp.v[k], up.v[k], gg.v[k], gu.v[k]);
  store_pack(grad_g + i, gg);
  store_pack(grad_u + i, gu);
}

}  // namespace

bool rms_norm_backward_supports(int64_t D) { return D >= 1 && D <= 8192; }

std::pair<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad_out, const at::Tensor& x,
                                                    const at::Tensor& w, double eps, bool gemma,
                                                    const at::Tensor& extra, bool weight_grad) {
  const int64_t D = x.size(-1);
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && grad_out.is_contiguous() && grad_out.sizes() == x.sizes() &&
                  grad_out.scalar_type() == x.scalar_type() && grad_out.device() == x.device(),
              "rms_norm_backward: x and grad_out must be contiguous on CUDA, of one shape and dtype");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == D && w.scalar_type() == x.scalar_type() && w.is_contiguous() &&
                  w.device() == x.device(),
              "rms_norm_backward: weight must be (", D, ") in the activations' dtype");
  TORCH_CHECK(!extra.defined() || (extra.sizes() == x.sizes() && extra.scalar_type() == x.scalar_type() &&
                                   extra.is_contiguous() && extra.device() == x.device()),
              "rms_norm_backward: extra must be shaped like x, contiguous");
  TORCH_CHECK(rms_norm_backward_supports(D), "rms_norm_backward: rows of 1 to 8,192 elements, got ", D);
  const int64_t rows = x.numel() / D;
  at::Tensor grad_x = at::empty_like(x);
  if (rows == 0) return {grad_x, weight_grad ? at::zeros_like(w) : at::Tensor()};
  auto stream = at::cuda::getCurrentCUDAStream();
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = std::min<int64_t>(rows, int64_t(sms) * 8);
  at::Tensor partial = weight_grad ? at::empty({blocks, D}, x.options().dtype(at::kFloat)) : at::Tensor();
  dispatch_float_types(x.scalar_type(), "rms_norm_backward", [&](auto tag) {
    using T = decltype(tag);
    auto launch = [&](auto threads, auto per) {
      rms_norm_backward_kernel<T, decltype(threads)::value, decltype(per)::value>
          <<<unsigned(blocks), decltype(threads)::value, 0, stream>>>(
              ptr<T>(grad_out), ptr<T>(x), ptr<T>(w), extra.defined() ? ptr<T>(extra) : nullptr, rows, D,
              static_cast<float>(eps), gemma, ptr<T>(grad_x), weight_grad ? partial.data_ptr<float>() : nullptr);
    };
    if (D <= 256) {
      launch(std::integral_constant<int, 64>{}, std::integral_constant<int, 4>{});
    } else if (D <= 1024) {
      launch(std::integral_constant<int, 128>{}, std::integral_constant<int, 8>{});
    } else if (D <= 2048) {
      launch(std::integral_constant<int, 128>{}, std::integral_constant<int, 16>{});
    } else if (D <= 4096) {
      launch(std::integral_constant<int, 256>{}, std::integral_constant<int, 16>{});
    } else {
      launch(std::integral_constant<int, 256>{}, std::integral_constant<int, 32>{});
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (!weight_grad) return {grad_x, at::Tensor()};
  return {grad_x, partial.sum(0).to(w.scalar_type())};
}

std::pair<at::Tensor, at::Tensor> silu_mul_backward(const at::Tensor& grad_out, const at::Tensor& g,
                                                    const at::Tensor& u) {
  TORCH_CHECK(g.is_cuda() && g.is_contiguous() && u.is_contiguous() && grad_out.is_contiguous() &&
                  u.sizes() == g.sizes() && grad_out.sizes() == g.sizes() && u.scalar_type() == g.scalar_type() &&
                  grad_out.scalar_type() == g.scalar_type() && u.device() == g.device() &&
                  grad_out.device() == g.device(),
              "silu_mul_backward: g, u and grad_out must be contiguous on CUDA, of one shape and dtype");
  at::Tensor grad_g = at::empty_like(g), grad_u = at::empty_like(u);
  const int64_t n = g.numel();
  if (n == 0) return {grad_g, grad_u};
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_float_types(g.scalar_type(), "silu_mul_backward", [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = 16 / sizeof(T);
    bool aligned = n % V == 0;
    for (const at::Tensor& t : std::vector<at::Tensor>{grad_out, g, u, grad_g, grad_u})
      aligned = aligned && aligned_16(t.data_ptr());
    if (aligned) {
      silu_mul_backward_vec_kernel<T, V><<<unsigned((n / V + 255) / 256), 256, 0, stream>>>(
          ptr<T>(grad_out), ptr<T>(g), ptr<T>(u), ptr<T>(grad_g), ptr<T>(grad_u), n / V);
    } else {
      silu_mul_backward_kernel<T><<<unsigned((n + 255) / 256), 256, 0, stream>>>(ptr<T>(grad_out), ptr<T>(g), ptr<T>(u),
                                                                                 ptr<T>(grad_g), ptr<T>(grad_u), n);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {grad_g, grad_u};
}

}  // namespace rlt::cuda
