// Cut Cross-Entropy (seed 002) with LibTorch ops: log-probs (and entropy) of softmax(hidden @ W^T / temp)
// without holding the [N, V] logits. Forward: blocks of rows x vocabulary, an online log-sum-exp per
// row (max m, sum s = sum e^{z-m}, and t = sum e^{z-m} z for the entropy). Backward: recompute each
// block's logits from the saved lse, form its gradient for any per-token upstream gradient, and
// accumulate dE and dW (fp32 for bf16/fp16 inputs); blocks whose softmax is below eps everywhere are
// skipped (gradient filtering). The target-token term (the "indexed matmul") is added outside the
// blocks, so filtering never drops it. Runs on CPU and GPU; a fused CUDA kernel will be tested against it.
#pragma once

#include <ATen/ATen.h>

#include "loss/options.h"

namespace rlt {

struct CceArgs {
  double temperature = 1.0;
  int64_t row_block = 0;    // rows per block; 0 = automatic
  int64_t vocab_block = 0;  // vocabulary entries per block; 0 = automatic
  EntropyMode entropy = EntropyMode::kNone;
  double grad_filter_eps = 0.0;  // 0 = no filtering
};

// hidden (N, D), lm_head (V, D) same float dtype; targets (N) int64.
// Returns (logprobs (N), entropy (N) or undefined), float32 (float64 for float64 inputs).
std::pair<at::Tensor, at::Tensor> cce_logprobs(const at::Tensor& hidden, const at::Tensor& lm_head,
                                               const at::Tensor& targets, const CceArgs& args);

// The (row, vocabulary) block sizes cce uses for N rows, V entries, hidden size D (automatic choice
// when the requested size is 0).
std::pair<int64_t, int64_t> cce_blocks(int64_t N, int64_t V, int64_t D, int64_t row_block, int64_t vocab_block);

}  // namespace rlt
