// The fused Hopper CCE kernels (loss/cuda/cce_fused.cu): wgmma GEMM tiles whose epilogue consumes the
// logits in registers. Built when CUTLASS's headers are found (RLT_HAVE_CUTLASS); loss/cce.cpp falls back to
// its blockwise path (cuBLAS GEMM + fused epilogue kernel) elsewhere, and that path is what the GPU tests
// hold these kernels to.
#pragma once

#include <ATen/ATen.h>

namespace rlt::cuda {

// True when the fused kernels take these operands: bf16/fp16 on an sm_90 GPU, built with CUTLASS.
bool cce_fused_available(const at::Tensor& hidden);

// hidden (n, D), weight (V, D), same dtype, targets (n) int64: writes logp, lse and H (n) fp32 (H only when
// entropy; it may be empty otherwise) for x = softcap(h w^T) / temperature: log-prob of the target, log-sum-exp,
// entropy. Any D (operands are copied to a zero-padded multiple of 8 when needed). A target outside [0, V)
// gives a NaN log-prob. pingpong: the two consumer warp groups take alternate tiles, one's epilogue under the
// other's MMAs (loss.cce_pingpong); false: both work on one tile, then both run its epilogue.
void cce_fused_forward(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets, double softcap,
                       double temperature, bool entropy, at::Tensor& logp, at::Tensor& lse, at::Tensor& H,
                       bool pingpong = false);

// The logits gradient of one vocabulary block, recomputed: weight is the block (k, D) starting at entry v0, g
// (n, k, unit column stride, any row stride) in the operands' dtype receives dz (cuda::cce_block_backward's
// formula, for the same lse, H, glp, gH, targets). Tile filtering (flags defined: int32 (>= n / 64, >= k / 256)):
// each 64 rows x 256 entries of g that hold an entry with p >= eps or a row's target get flags[r][c] = stamp;
// the others are left as they were (a stamp per call tells them apart without clearing).
void cce_fused_backward(const at::Tensor& hidden, const at::Tensor& weight, int64_t v0, double softcap,
                        double temperature, const at::Tensor& lse, const at::Tensor& H, const at::Tensor& glp,
                        const at::Tensor& gH, const at::Tensor& targets, double eps, at::Tensor& g,
                        const at::Tensor& flags, int stamp, bool pingpong = false);

// The block's dE and dW from g over the tiles whose flag is `stamp` (the others are skipped: entries with
// p < eps and no target, the filter's dropped part): dE (n, D) fp32 += g weight; dW (k, D) = g^T hidden when it
// has the operands' dtype, += when fp32. dW keeps exactly the flagged tiles; dE multiplies whole 128-row tiles,
// so it also keeps an unflagged 64-row half of a flagged pair (a superset, within the same bound). g's row
// stride must be a multiple of 8 (TMA); n and k at most 131072. No host synchronisation. max_blocks > 0 caps
// the persistent grid (tests: one thread block walking many tiles).
void cce_sparse_grads(const at::Tensor& g, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& flags,
                      int stamp, at::Tensor& dE, at::Tensor& dW, int max_blocks = 0);

}  // namespace rlt::cuda
