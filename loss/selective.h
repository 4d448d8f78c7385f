// Selective log-softmax (seed 000) as one custom autograd function: the forward keeps only the
// per-row log-sum-exp (T' floats), the backward rebuilds softmax from it, so no [T', V] log-softmax
// is stored. bf16/fp16 logits are read as bf16 and accumulated in fp32; log-probs come out in fp32.
// On CUDA a fused kernel (loss/cuda/) reads each row once; elsewhere the rows go through ATen ops a
// chunk at a time. Both compute the same function and are tested against each other.
#pragma once

#include <ATen/ATen.h>

#include "loss/options.h"

namespace rlt {

// logits (T, V); rows (T') int64 distinct kept rows or undefined for all T rows; targets (T') int64
// aligned with the kept rows. Reads options.temperature, entropy, inplace_backward (write the gradient
// into `logits` itself, seed 003) and chunk_size (rows per ATen chunk; 0 = about 1M logits per chunk).
// use_cuda_kernel: on CUDA tensors, the fused kernel; false forces the ATen chunks (tests).
// Returns (logprobs (T'), entropy (T') or undefined), float32 (float64 for float64). Gradient reaches
// `logits` only (zero on rows that were not kept).
std::pair<at::Tensor, at::Tensor> selective_logprobs(const at::Tensor& logits, const at::Tensor& rows,
                                                     const at::Tensor& targets, const LossOptions& options,
                                                     bool use_cuda_kernel = true);

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
