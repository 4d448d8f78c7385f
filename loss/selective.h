// Selective log-softmax (seed 000) as one custom autograd function: the forward keeps only the
// per-row log-sum-exp (T' floats), the backward rebuilds softmax from it, so no [T', V] log-softmax
// is stored. bf16/fp16 logits are read as bf16 and accumulated in fp32; log-probs come out in fp32.
// On CUDA a fused kernel (loss/cuda/) reads each row once; elsewhere the rows go through ATen ops a
// chunk at a time. Both compute the same function and are tested against each other.
#pragma once

#include <ATen/ATen.h>

#include "loss/options.h"

namespace rlt {

struct SelectiveArgs {
  double temperature = 1.0;
  int64_t chunk_size = 1024;  // rows per ATen chunk; 0 = all kept rows at once
  EntropyMode entropy = EntropyMode::kNone;
  bool inplace_backward = false;  // write the gradient into `logits` itself (seed 003)
  bool use_cuda_kernel = true;    // on CUDA tensors, the fused kernel; false forces the ATen chunks
};

// logits (T, V); rows (T') int64 kept rows or undefined for all T rows; targets (T') int64 aligned with
// the kept rows. Returns (logprobs (T'), entropy (T') or undefined), float32 (float64 for float64).
// Gradient reaches `logits` only (zero on rows that were not kept).
std::pair<at::Tensor, at::Tensor> selective_logprobs(const at::Tensor& logits, const at::Tensor& rows,
                                                     const at::Tensor& targets, const SelectiveArgs& args);

#ifdef RLT_HAVE_CUDA
namespace cuda {
// Fused row kernels (loss/cuda/selective_kernels.cu). Row r of the kept set reads logits[rows[r]]
// (rows undefined: row r). Forward writes logprob, lse and (if entropy != nullptr) entropy, all fp32.
void selective_forward(const at::Tensor& logits, const at::Tensor& rows, const at::Tensor& targets, double temperature,
                       at::Tensor& logprob, at::Tensor& lse, at::Tensor* entropy);
// Backward writes grad[rows[r]] = d/dlogits of (glp . logprob + gH . entropy); grad may alias logits.
void selective_backward(const at::Tensor& logits, const at::Tensor& rows, const at::Tensor& targets,
                        const at::Tensor& lse, const at::Tensor& entropy, const at::Tensor& glp, const at::Tensor& gH,
                        double temperature, at::Tensor& grad);
}  // namespace cuda
#endif

}  // namespace rlt
