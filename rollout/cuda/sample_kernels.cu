// The Gumbel-max draw of rollout/sampler.cpp in one pass over the logits: the ATen form (which stays the
// reference, and the CPU path) makes the (B, V) noise as int64 tensors, ten elementwise passes of 78 MB
// each for 64 rows of a 151,936-entry vocabulary: 0.86 ms of a 4.9 ms decode step on an H200
// (bench_model --trace, phase steady_sample_x16). Here each thread hashes its own entries and keeps the
// best score, so the logits are read once and nothing of (B, V) is written.
//
// Bit-identical to the ATen form: the same 64-bit hash (uint64 arithmetic is what ATen's wrapping int64
// ops compute), the same float operations in the same order, each rounded on its own (__fmul_rn and
// friends keep nvcc from contracting them into FMAs that ATen's separate kernels never form), and
// temperature applied as ATen's CUDA division by a scalar does it: times the float reciprocal 1 / temperature.
// Ties go to the lower index, as at::argmax does.
//
// Work split: a row of 151,936 entries is cut into chunks so that every SM has blocks; each block reduces
// its chunk to (score, index) packed in 64 bits, ordered so that an unsigned max picks the higher score
// and, among equal scores, the lower index, and merges it into the row's slot with atomicMax.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <cstdint>

#include "common/cuda/launch.cuh"
#include "rollout/cuda/sample_kernels.h"
#include "rollout/hash.h"

namespace rlt::cuda {

namespace {

constexpr int kThreads = 256;

// A float's bits mapped so that unsigned order is numeric order (-inf lowest, +inf highest).
__device__ __forceinline__ uint32_t ordered(float f) {
  const uint32_t b = __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ uint64_t pack(float score, int64_t v) {
  return (uint64_t(ordered(score)) << 32) | uint64_t(0xffffffffu - uint32_t(v));
}

__global__ void __launch_bounds__(kThreads)
    gumbel_argmax_kernel(const float* x, int64_t row_stride, int64_t V, int64_t chunk, const int64_t* row_keys,
                         float inv_t, unsigned long long* best) {
  wait_for_inputs();
  allow_dependents();
  const int64_t n = blockIdx.x;
  const int64_t begin = int64_t(blockIdx.y) * chunk, end = min(V, begin + chunk);
  const float* row = x + n * row_stride;
  const uint64_t key = uint64_t(row_keys[n]);
  constexpr float kScale = 1.0f / 16777216.0f, kBelowOne = 1.0f - 1.0f / 16777216.0f;
  uint64_t mine = 0;  // below every packed score
  for (int64_t v = begin + threadIdx.x; v < end; v += kThreads) {
    // counter_uniforms: the top 24 bits of fmix64(row key ^ column key), centred, clamped below 1.
    const uint64_t z = fmix64(key ^ column_key(v));
    const float u = fminf(__fmul_rn(__fadd_rn(float(z >> 40), 0.5f), kScale), kBelowOne);
    // kept - log(-log u), kept = logits times 1 / temperature.
    // (+ 0 turns a -0 score into +0: at::argmax ranks the two equal, the packed order would not.)
    const float s = __fadd_rn(__fsub_rn(__fmul_rn(row[v], inv_t), logf(-logf(u))), 0.0f);
    // NaN counts as the largest score (at::argmax's order); the sampler rejects non-finite logits anyway.
    const uint64_t p = isnan(s) ? (~uint64_t(0) << 32) | uint64_t(0xffffffffu - uint32_t(v)) : pack(s, v);
    mine = p > mine ? p : mine;
  }
  // Block max: warp shuffles, then one value per warp.
  for (int off = 16; off > 0; off >>= 1) {
    const uint64_t o = __shfl_down_sync(0xffffffffu, mine, off);
    mine = o > mine ? o : mine;
  }
  __shared__ uint64_t warp_best[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_best[threadIdx.x >> 5] = mine;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) mine = warp_best[w] > mine ? warp_best[w] : mine;
    atomicMax(best + n, static_cast<unsigned long long>(mine));
  }
}

__global__ void unpack_kernel(const unsigned long long* best, int64_t N, int64_t* ids) {
  wait_for_inputs();
  allow_dependents();
  const int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n < N) ids[n] = int64_t(0xffffffffu - uint32_t(best[n] & 0xffffffffull));
}

}  // namespace

at::Tensor gumbel_argmax(const at::Tensor& x, const at::Tensor& row_keys, double temperature) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "gumbel_argmax: logits must be (N, V) float32 on CUDA with unit column stride");
  TORCH_CHECK(row_keys.device() == x.device() && row_keys.scalar_type() == at::kLong && row_keys.numel() == x.size(0) &&
                  row_keys.is_contiguous(),
              "gumbel_argmax: one int64 row key per row, on the logits' device");
  TORCH_CHECK(x.size(1) > 0 && x.size(1) < (int64_t(1) << 32),
              "gumbel_argmax: the vocabulary must have 1 to 2^32 - 1 entries");
  TORCH_CHECK(temperature > 0, "gumbel_argmax: temperature must be > 0");
  const int64_t N = x.size(0), V = x.size(1);
  auto lopts = x.options().dtype(at::kLong);
  at::Tensor ids = at::empty({N}, lopts);
  if (N == 0) return ids;
  at::Tensor best = at::zeros({N}, lopts);
  // Enough blocks for every SM a few times over, chunks of at least 2048 entries.
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int64_t splits = std::max<int64_t>(1, (4 * sms + N - 1) / N);
  splits = std::min<int64_t>(splits, std::max<int64_t>(1, V / 2048));
  const int64_t chunk = (V + splits - 1) / splits;
  const float inv_t = 1.0f / static_cast<float>(temperature);  // ATen: opmath 1 / float(T)
  auto stream = at::cuda::getCurrentCUDAStream();
  auto* b = reinterpret_cast<unsigned long long*>(best.data_ptr<int64_t>());
  launch(gumbel_argmax_kernel, dim3(unsigned(N), unsigned(splits)), kThreads, 0, stream, x.data_ptr<float>(),
         x.stride(0), V, chunk, row_keys.data_ptr<int64_t>(), inv_t, b);
  launch(unpack_kernel, unsigned((N + 255) / 256), 256, 0, stream, b, N, ids.data_ptr<int64_t>());
  return ids;
}

}  // namespace rlt::cuda
