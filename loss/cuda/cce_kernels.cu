// Fused epilogues of the CCE blocks (loss/cce.cpp keeps the GEMMs in cuBLAS and its ATen epilogue as
// the reference these are tested against). One thread block per row of an (n, k) fp32 logits block z:
//   forward:  merge the block's online softmax state (max, sum e^{x-m}, sum e^{x-m}(x-m)), x = z / temp,
//             into the row's running state: one read of z instead of ~6 elementwise passes;
//   backward: dz_v = (-p_v (glp + gH (log p_v + H)) + glp [v0 + v = y]) / temp, p = e^{x - lse},
//             written straight in the GEMM operand dtype (possibly over z itself), and a flag raised
//             when any p_v >= eps (gradient filtering decides on it).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include "loss/cce.h"
#include "loss/cuda/online_softmax.cuh"

namespace rlt::cuda {

namespace {

constexpr int kThreads = 256;

// x = cap tanh(z / cap) (cap > 0), then / temp.
__device__ __forceinline__ float capped(float z, float cap) { return cap > 0.f ? cap * tanhf(z / cap) : z; }

__global__ void __launch_bounds__(kThreads) cce_forward_kernel(const float* __restrict__ z, int64_t k, float cap,
                                                               float temp, bool entropy, float* m, float* s, float* t) {
  const int64_t r = blockIdx.x;
  const float* row = z + r * k;
  Online st{-INFINITY, 0.f, 0.f};
  int64_t tail = 0;
  if (k % 4 == 0 && reinterpret_cast<uintptr_t>(z) % 16 == 0) {
    const float4* rv = reinterpret_cast<const float4*>(row);
    for (int64_t i = threadIdx.x; i < k / 4; i += kThreads) {
      const float4 q = rv[i];
      const float v[4] = {scale(capped(q.x, cap), temp), scale(capped(q.y, cap), temp), scale(capped(q.z, cap), temp),
                          scale(capped(q.w, cap), temp)};
      fold<4>(st, v, entropy);
    }
    tail = k / 4 * 4;
  }
  for (int64_t i = tail + threadIdx.x; i < k; i += kThreads) {
    const float v[1] = {scale(capped(row[i], cap), temp)};
    fold<1>(st, v, entropy);
  }
  st = block_merge<kThreads>(st);
  if (threadIdx.x == 0) {
    const Online merged = merge(Online{m[r], s[r], t[r]}, st);
    m[r] = merged.m;
    s[r] = merged.s;
    t[r] = entropy ? merged.t : 0.f;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    cce_backward_kernel(const float* z, int64_t k, int64_t v0, float cap, float temp, const float* __restrict__ lse,
                        const float* __restrict__ H, const float* __restrict__ glp, const float* __restrict__ gH,
                        const int64_t* __restrict__ targets, float eps, T* g, int* any_above) {
  const int64_t r = blockIdx.x;
  const float* row = z + r * k;
  T* out = g + r * k;
  const float l = lse[r], a = glp[r];
  const float b = gH ? gH[r] : 0.f, h = gH ? H[r] : 0.f;
  const int64_t y = targets[r] - v0;
  bool above = false;
  for (int64_t i = threadIdx.x; i < k; i += kThreads) {
    const float tc = cap > 0.f ? tanhf(row[i] / cap) : 0.f;
    const float lp = scale(cap > 0.f ? cap * tc : row[i], temp) - l;
    const float p = expf(lp);
    above |= p >= eps;
    float gv = -p * (a + b * (lp + h));
    if (i == y) gv += a;
    if (temp != 1.f) gv /= temp;
    if (cap > 0.f) gv *= 1.f - tc * tc;  // through the softcap
    out[i] = from_f<T>(gv);              // same thread read row[i] first: may alias z
  }
  if (__syncthreads_or(above) && threadIdx.x == 0) atomicOr(any_above, 1);
}

}  // namespace

void cce_block_forward(const at::Tensor& z, double softcap, double temperature, bool entropy, at::Tensor& m,
                       at::Tensor& s, at::Tensor& t) {
  TORCH_CHECK(z.is_cuda() && z.is_contiguous() && z.scalar_type() == at::kFloat && z.dim() == 2,
              "cce_block_forward: z must be a contiguous fp32 CUDA (n, k) block");
  const int64_t n = z.size(0), k = z.size(1);
  if (n == 0 || k == 0) return;
  cce_forward_kernel<<<n, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      z.data_ptr<float>(), k, static_cast<float>(softcap), static_cast<float>(temperature), entropy,
      m.data_ptr<float>(), s.data_ptr<float>(), t.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void cce_block_backward(const at::Tensor& z, int64_t v0, double softcap, double temperature, const at::Tensor& lse,
                        const at::Tensor& H, const at::Tensor& glp, const at::Tensor& gH, const at::Tensor& targets,
                        double eps, at::Tensor& g, at::Tensor& any_above) {
  TORCH_CHECK(z.is_cuda() && z.is_contiguous() && z.scalar_type() == at::kFloat && z.dim() == 2,
              "cce_block_backward: z must be a contiguous fp32 CUDA (n, k) block");
  TORCH_CHECK(g.is_contiguous() && g.sizes() == z.sizes(), "cce_block_backward: g must be like z");
  const int64_t n = z.size(0), k = z.size(1);
  if (n == 0 || k == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  auto launch = [&](auto* out) {
    using T = std::remove_pointer_t<decltype(out)>;
    cce_backward_kernel<T><<<n, kThreads, 0, stream>>>(
        z.data_ptr<float>(), k, v0, static_cast<float>(softcap), static_cast<float>(temperature), lse.data_ptr<float>(),
        gH.defined() ? H.data_ptr<float>() : nullptr, glp.data_ptr<float>(),
        gH.defined() ? gH.data_ptr<float>() : nullptr, targets.data_ptr<int64_t>(), static_cast<float>(eps), out,
        any_above.data_ptr<int>());
  };
  switch (g.scalar_type()) {
    case at::kFloat:
      launch(g.data_ptr<float>());
      break;
    case at::kBFloat16:
      launch(reinterpret_cast<__nv_bfloat16*>(g.data_ptr()));
      break;
    case at::kHalf:
      launch(reinterpret_cast<__half*>(g.data_ptr()));
      break;
    default:
      TORCH_CHECK(false, "cce_block_backward: unsupported gradient dtype ", g.scalar_type());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace rlt::cuda
