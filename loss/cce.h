// Cut Cross-Entropy (seed 002) with LibTorch ops: log-probs (and entropy) of softmax(hidden @ W^T / temp)
// without holding the [T', V] logits. Forward: blocks of rows x vocabulary, an online log-sum-exp per
// row (max m, sum s = sum e^{z-m}, and t = sum e^{z-m} z for the entropy). Backward: recompute each
// block's logits from the saved lse, form its gradient for any per-token upstream gradient, and
// accumulate dE and dW (fp32 for bf16/fp16 inputs); blocks whose softmax is below eps everywhere are
// skipped (gradient filtering). The target-token term (the "indexed matmul") is added outside the
// blocks, so filtering never drops it. Runs on CPU and GPU; on CUDA the block epilogues run as fused kernels
// (loss/cuda/cce_kernels.cu), tested against these ATen epilogues in tests/loss/test_cce.cpp (CceCuda.*).
// On an H100/H200 with bf16/fp16 inputs (loss.cce_fused, on by default) the fused Hopper kernels
// (loss/cuda/cce_fused.cu) take over: the forward is one wgmma kernel whose logits tiles never leave
// registers, and the backward recomputes each block's logits gradient in the same way, written once in
// bf16 for the dE and dW GEMMs.
#pragma once

#include <ATen/ATen.h>

#include "loss/options.h"

namespace rlt {

// hidden (T', D), lm_head (V, D) same float dtype; targets (T') int64. Reads options.temperature,
// entropy, chunk_size (rows per block; 0 = automatic), vocab_chunk_size (vocabulary entries per block;
// 0 = automatic) and grad_filter / grad_filter_eps. softcap: the model's final-logit softcap,
// z <- cap * tanh(z / cap) before everything; 0 = none. use_cuda_kernel: on CUDA, the fused block
// epilogues (loss/cuda/cce_kernels.cu) or the fused Hopper kernels (options.cce_fused); false forces the
// ATen epilogues (tests).
// Returns (logprobs (T'), entropy (T') or undefined), float32 (float64 for float64 inputs).
std::pair<at::Tensor, at::Tensor> cce_logprobs(const at::Tensor& hidden, const at::Tensor& lm_head,
                                               const at::Tensor& targets, const LossOptions& options,
                                               double softcap = 0.0, bool use_cuda_kernel = true);

// The (row, vocabulary) block sizes cce uses for N = T' rows, V entries, hidden size D (automatic choice
// when the requested size is 0), on the blockwise path or (fused) the fused Hopper kernels' backward.
std::pair<int64_t, int64_t> cce_blocks(int64_t N, int64_t V, int64_t D, int64_t row_block, int64_t vocab_block,
                                       bool fused = false);

#ifdef RLT_HAVE_CUDA
namespace cuda {
// Merges the online softmax state (m, s, t: (n) fp32, t = sum e^{x-m}(x-m)) of rows with the (n, k)
// fp32 logits block z (x = z / temperature).
void cce_block_forward(const at::Tensor& z, double softcap, double temperature, bool entropy, at::Tensor& m,
                       at::Tensor& s, at::Tensor& t);
// Writes the block's logits gradient g (n, k) (fp32/bf16/fp16; may alias z) for upstream glp, gH
// (gH undefined: none), the target term for targets in [v0, v0 + k), and sets any_above (int32 [1])
// to 1 if any softmax entry of the block is >= eps.
void cce_block_backward(const at::Tensor& z, int64_t v0, double softcap, double temperature, const at::Tensor& lse,
                        const at::Tensor& H, const at::Tensor& glp, const at::Tensor& gH, const at::Tensor& targets,
                        double eps, at::Tensor& g, at::Tensor& any_above);
}  // namespace cuda
#endif

}  // namespace rlt
