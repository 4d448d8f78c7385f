// The counter-based noise's hash, shared by the sampler's host code (sampler.cpp) and its fused CUDA
// draw (cuda/sample_kernels.cu), so that both make the same bits.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define RLT_HOST_DEVICE __host__ __device__
#else
#define RLT_HOST_DEVICE
#endif

namespace rlt {

// MurmurHash3's 64-bit finaliser: a bijection on 64 bits whose output bits each depend on every input bit.
RLT_HOST_DEVICE inline uint64_t fmix64(uint64_t z) {
  z ^= z >> 33;
  z *= 0xff51afd7ed558ccdULL;
  z ^= z >> 33;
  z *= 0xc4ceb9fe1a85ec53ULL;
  z ^= z >> 33;
  return z;
}

// Vocabulary entry v's key (a row's noise at v is fmix64(row key ^ column key)).
RLT_HOST_DEVICE inline uint64_t column_key(int64_t v) { return fmix64(0x9e3779b97f4a7c15ULL * uint64_t(v + 1)); }

}  // namespace rlt
