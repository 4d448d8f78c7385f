// Fused selective log-softmax kernels: the CUDA twin of the ATen chunks in loss/selective.cpp, which
// stay the reference (tests/loss/test_logprob.cpp compares the two on odd shapes).
//
// Forward: one thread block per kept row reads the row once (16-byte loads where aligned) and keeps an
// online (max m, s = sum e^{x-m}, t = sum e^{x-m} (x-m)) per thread, merged across the block:
//   lse = m + log s,  logp = x_y - lse,  H = log s - t / s.      All in fp32, whatever the logits dtype.
// t is kept relative to the running max so that H is a sum of non-negative terms: the textbook
// lse - E[x] subtracts two numbers near the max logit and loses ~1e-5 in fp32. The arithmetic follows
// the ATen reference (x / temp, expf, logf): the kernel is memory-bound, so accuracy costs no time.
// Backward: one block per row rebuilds p = e^{x - lse} and writes
//   grad_v = ( -p_v (glp + gH (log p_v + H)) + glp [v = y] ) / temp
// in the logits dtype; grad may be the logits buffer itself (each element is read before it is written
// by the same thread).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "loss/cuda/online_softmax.cuh"
#include "loss/selective.h"

namespace rlt::cuda {

namespace {

constexpr int kThreads = 512;
// 16-byte loads each thread has in flight before it folds or writes them: enough bytes in flight per SM to
// cover HBM's latency (with one load per thread the forward reads 3.4 TB/s on the H200; more loads or
// streaming loads: docs/benchmarks.md, design notes).
constexpr int kUnroll = 4;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(const T* __restrict__ logits, const int64_t* __restrict__ rows, const int64_t* __restrict__ targets,
                   int64_t V, float temp, bool vec_ok, float* __restrict__ logp, float* __restrict__ lse,
                   float* __restrict__ entropy) {
  const int64_t r = blockIdx.x;
  const int64_t row = rows ? rows[r] : r;
  const T* x = logits + row * V;
  const bool ent = entropy != nullptr;
  Online st{-INFINITY, 0.f, 0.f};
  constexpr int K = vec_elems<T>();
  int64_t tail = 0;
  if (vec_ok) {
    const int64_t nvec = V / K;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    int64_t i = threadIdx.x;
    // kUnroll loads in flight per thread, then one fold (one rescale) over their kUnroll * K values.
    for (; i + (kUnroll - 1) * kThreads < nvec; i += kUnroll * kThreads) {
      uint4 raw[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) raw[u] = __ldg(xv + i + u * kThreads);
      float v[kUnroll * K];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const T* e = reinterpret_cast<const T*>(&raw[u]);
#pragma unroll
        for (int j = 0; j < K; ++j) v[u * K + j] = scale(to_f(e[j]), temp);
      }
      fold<kUnroll * K>(st, v, ent);
    }
    for (; i < nvec; i += kThreads) {
      uint4 raw = __ldg(xv + i);
      const T* e = reinterpret_cast<const T*>(&raw);
      float v[K];
#pragma unroll
      for (int j = 0; j < K; ++j) v[j] = scale(to_f(e[j]), temp);
      fold<K>(st, v, ent);
    }
    tail = nvec * K;
  }
  for (int64_t i = tail + threadIdx.x; i < V; i += kThreads) {
    float v[1] = {scale(to_f(x[i]), temp)};
    fold<1>(st, v, ent);
  }
  st = block_merge<kThreads>(st);
  if (threadIdx.x == 0) {
    const float l = st.m + logf(st.s);
    lse[r] = l;
    logp[r] = scale(to_f(x[targets[r]]), temp) - l;
    if (ent) entropy[r] = logf(st.s) - st.t / st.s;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(const T* logits, const int64_t* __restrict__ rows, const int64_t* __restrict__ targets,
                    const float* __restrict__ lse, const float* __restrict__ entropy, const float* __restrict__ glp,
                    const float* __restrict__ gH, int64_t V, float temp, bool vec_ok, T* grad) {
  const int64_t r = blockIdx.x;
  const int64_t row = rows ? rows[r] : r;
  const T* x = logits + row * V;
  T* g = grad + row * V;
  const float l = lse[r], a = glp[r];
  const float b = gH ? gH[r] : 0.f, h = gH ? entropy[r] : 0.f;
  const int64_t y = targets[r];
  // grad_v = (-p (a + b (logp + h)) + a [v = y]) / temp
  auto one = [&](float xv, int64_t v) {
    const float lp = scale(xv, temp) - l;
    const float p = expf(lp);
    float gv = -p * (a + b * (lp + h));
    if (v == y) gv += a;
    return temp == 1.f ? gv : gv / temp;
  };
  constexpr int K = vec_elems<T>();
  int64_t tail = 0;
  if (vec_ok) {
    const int64_t nvec = V / K;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    uint4* gvp = reinterpret_cast<uint4*>(g);
    // kUnroll loads in flight per thread; every element is read before the same thread writes it.
    auto store = [&](const uint4& raw, int64_t i) {
      const T* e = reinterpret_cast<const T*>(&raw);
      uint4 outv;
      T* o = reinterpret_cast<T*>(&outv);
#pragma unroll
      for (int j = 0; j < K; ++j) o[j] = from_f<T>(one(to_f(e[j]), i * K + j));
      gvp[i] = outv;
    };
    int64_t i = threadIdx.x;
    for (; i + (kUnroll - 1) * kThreads < nvec; i += kUnroll * kThreads) {
      uint4 raw[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) raw[u] = xv[i + u * kThreads];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) store(raw[u], i + u * kThreads);
    }
    for (; i < nvec; i += kThreads) store(xv[i], i);
    tail = nvec * K;
  }
  for (int64_t i = tail + threadIdx.x; i < V; i += kThreads) g[i] = from_f<T>(one(to_f(x[i]), i));
}

bool aligned16(const void* p, int64_t V, int64_t elem) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0 && (V * elem) % 16 == 0;
}

}  // namespace

void selective_forward(const at::Tensor& logits, const at::Tensor& rows, const at::Tensor& targets, double temperature,
                       at::Tensor& logprob, at::Tensor& lse, at::Tensor* entropy) {
  TORCH_CHECK(logits.is_cuda() && logits.is_contiguous() && logits.dim() == 2, "logits must be contiguous CUDA (T, V)");
  TORCH_CHECK(targets.is_cuda() && targets.is_contiguous(), "targets must be contiguous CUDA");
  TORCH_CHECK(logprob.scalar_type() == at::kFloat && lse.scalar_type() == at::kFloat, "fp32 outputs expected");
  const int64_t N = targets.size(0), V = logits.size(1);
  if (N == 0) return;
  const float temp = static_cast<float>(temperature);
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_float_types(logits.scalar_type(), "selective CUDA kernel", [&](auto tag) {
    using T = decltype(tag);
    const T* x = reinterpret_cast<const T*>(logits.data_ptr());
    forward_kernel<T><<<N, kThreads, 0, stream>>>(x, rows.defined() ? rows.data_ptr<int64_t>() : nullptr,
                                                  targets.data_ptr<int64_t>(), V, temp, aligned16(x, V, sizeof(T)),
                                                  logprob.data_ptr<float>(), lse.data_ptr<float>(),
                                                  entropy ? entropy->data_ptr<float>() : nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void selective_backward(const at::Tensor& logits, const at::Tensor& rows, const at::Tensor& targets,
                        const at::Tensor& lse, const at::Tensor& entropy, const at::Tensor& glp, const at::Tensor& gH,
                        double temperature, at::Tensor& grad) {
  TORCH_CHECK(grad.is_contiguous() && grad.sizes() == logits.sizes() && grad.scalar_type() == logits.scalar_type(),
              "grad must be a contiguous tensor like logits");
  const int64_t N = targets.size(0), V = logits.size(1);
  if (N == 0) return;
  at::Tensor glp_c = glp.to(at::kFloat).contiguous();
  at::Tensor gH_c = gH.defined() ? gH.to(at::kFloat).contiguous() : at::Tensor();
  const float temp = static_cast<float>(temperature);
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_float_types(logits.scalar_type(), "selective CUDA kernel", [&](auto tag) {
    using T = decltype(tag);
    const T* x = reinterpret_cast<const T*>(logits.data_ptr());
    T* g = reinterpret_cast<T*>(grad.data_ptr());
    backward_kernel<T><<<N, kThreads, 0, stream>>>(
        x, rows.defined() ? rows.data_ptr<int64_t>() : nullptr, targets.data_ptr<int64_t>(), lse.data_ptr<float>(),
        gH_c.defined() ? entropy.data_ptr<float>() : nullptr, glp_c.data_ptr<float>(),
        gH_c.defined() ? gH_c.data_ptr<float>() : nullptr, V, temp,
        aligned16(x, V, sizeof(T)) && aligned16(g, V, sizeof(T)), g);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace rlt::cuda
