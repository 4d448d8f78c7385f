// Device helpers shared by the fused log-prob kernels: an online softmax state per thread
// (max m, s = sum e^{x-m}, t = sum e^{x-m} (x-m)), merged across a block (dtype conversions: common/cuda/dtypes.cuh).
// t is kept relative to the running max so that the entropy log s - t/s is a sum of non-negative
// terms (the textbook lse - E[x] cancels two numbers near the max logit).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/cuda/dtypes.cuh"

#include <cmath>
#include <cstdint>

namespace rlt::cuda {

struct Online {
  float m, s, t;  // running max, sum e^{x-m}, sum e^{x-m} (x-m)
};

// A state re-expressed relative to a larger max m: sum e^{x-m}(x-m) = r (t - s (m - m_old)), r = e^{m_old-m}.
__device__ __forceinline__ void rebase(const Online& a, float m, float& s, float& t) {
  if (a.m == -INFINITY) {
    s = 0.f;
    t = 0.f;
    return;
  }
  const float r = expf(a.m - m);
  s = a.s * r;
  t = r * (a.t - a.s * (m - a.m));
}

__device__ __forceinline__ Online merge(Online a, Online b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.f, 0.f};
  float sa, ta, sb, tb;
  rebase(a, m, sa, ta);
  rebase(b, m, sb, tb);
  return {m, sa + sb, ta + tb};
}

// Folds k consecutive values (already scaled by 1/temp) into the thread's state with one rescale.
template <int K>
__device__ __forceinline__ void fold(Online& st, const float (&x)[K], bool entropy) {
  float mx = x[0];
#pragma unroll
  for (int i = 1; i < K; ++i) mx = fmaxf(mx, x[i]);
  const float m = fmaxf(st.m, mx);
  float s, t;
  rebase(st, m, s, t);
#pragma unroll
  for (int i = 0; i < K; ++i) {
    const float d = x[i] - m;
    const float e = expf(d);
    s += e;
    if (entropy) t += e * d;
  }
  st = {m, s, entropy ? t : 0.f};
}

template <int kThreads>
__device__ Online block_merge(Online st) {
  __shared__ Online warp_state[kThreads / 32];
  for (int off = 16; off > 0; off >>= 1) {
    Online o{__shfl_xor_sync(0xffffffff, st.m, off), __shfl_xor_sync(0xffffffff, st.s, off),
             __shfl_xor_sync(0xffffffff, st.t, off)};
    st = merge(st, o);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_state[warp] = st;
  __syncthreads();
  if (warp == 0) {
    st = lane < kThreads / 32 ? warp_state[lane] : Online{-INFINITY, 0.f, 0.f};
    for (int off = 16; off > 0; off >>= 1) {
      Online o{__shfl_xor_sync(0xffffffff, st.m, off), __shfl_xor_sync(0xffffffff, st.s, off),
               __shfl_xor_sync(0xffffffff, st.t, off)};
      st = merge(st, o);
    }
    if (lane == 0) warp_state[0] = st;
  }
  __syncthreads();
  return warp_state[0];
}

// x / temp, skipped at temperature 1.
__device__ __forceinline__ float scale(float x, float temp) { return temp == 1.f ? x : x / temp; }

// Elements per 16-byte vector for T.
template <typename T>
constexpr int vec_elems() {
  return 16 / sizeof(T);
}

}  // namespace rlt::cuda
