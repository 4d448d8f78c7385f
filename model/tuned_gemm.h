// GEMMs of the decode step through cuBLASLt with the algorithm measured fastest for their shape
// (EngineSwitches::tuned_gemms, off by default). ATen's at::linear takes cuBLAS's heuristic choice, made for
// any GEMM of that shape; a decode step's are a few rows against a whole weight, read once from memory. The
// first call of a shape outside a graph capture times each of cuBLASLt's candidates and ATen's own call, the
// cache cleared before each run, and keeps the fastest; a call inside a capture uses what was chosen (ATen's
// call where nothing was). Plain C++: the engine and the model set it without CUDA headers.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "common/thread_flag.h"

namespace rlt {

namespace detail {
inline thread_local bool tuned_gemms_on = false;
}  // namespace detail

inline bool tuned_gemms() { return detail::tuned_gemms_on; }

// Sets the thread's choice for its lifetime, then restores the one before it.
class TunedGemmScope : public ThreadFlagScope {
 public:
  explicit TunedGemmScope(bool on) : ThreadFlagScope(detail::tuned_gemms_on, on) {}
};

// x (..., K) times w (N, K) transposed, plus b (N) where defined: at::linear's result. Through the tuned
// cuBLASLt call for bf16 CUDA tensors with w contiguous (x's rows made contiguous where they are not), no
// gradient asked for; at::linear otherwise, and everywhere in a build without CUDA. A candidate whose
// product differs from ATen's by more than a few bf16 roundings of its largest value is not taken. The
// choice rests on timing, so two processes may choose differently and round differently.
at::Tensor tuned_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b);

// Shapes tuned in this process, and the ones whose choice was a cuBLASLt algorithm rather than ATen's call.
struct TunedGemmCounts {
  int64_t shapes = 0, lt_chosen = 0;
};
TunedGemmCounts tuned_gemm_counts();

// Test seam: while on, shapes tuned leave ATen's call out of the candidates, so that a cuBLASLt algorithm
// is chosen wherever one agrees with ATen's product (shapes tuned either way are kept apart).
void tuned_gemms_without_aten(bool on);

}  // namespace rlt
