// tuned_linear without CUDA (model/tuned_gemm.h): at::linear. The CUDA build defines it in cuda/tuned_gemm.cu.
#include "model/tuned_gemm.h"

#ifndef RLT_HAVE_CUDA
namespace rlt {

at::Tensor tuned_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  return b.defined() ? at::linear(x, w, b) : at::linear(x, w);
}

TunedGemmCounts tuned_gemm_counts() { return {}; }

void tuned_gemms_without_aten(bool) {}

}  // namespace rlt
#endif
