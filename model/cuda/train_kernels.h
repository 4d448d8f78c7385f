// The backward kernels of the fused layer forms (decode_kernels.h) for training forwards on CUDA: with
// them a layer's RMSNorm, RoPE and SiLU gate are one kernel each way, where ATen's autograd runs each
// chain's forms and their backwards as a dozen small elementwise kernels. Their forwards are the decode
// kernels, so a training forward's activations equal the ATen forms' bit for bit but for RMSNorm's sum
// of squares. The RoPE gradient is decode_kernels.h's rope with `inverse` (bit for bit ATen's); the
// others compute in float32 and round once, where ATen's autograd rounds each product to the dtype.
#pragma once

#include <ATen/ATen.h>

#include <utility>

namespace rlt::cuda {

// rms_norm_backward runs for rows of D elements (up to 8,192).
bool rms_norm_backward_supports(int64_t D);
// The gradients of rms_norm(x, w, eps, gemma) (decode_kernels.h) given grad_out, the gradient of its
// output: {grad_x, grad_w}. x and grad_out (…, D) contiguous, w (D), all in one dtype (float32, bfloat16
// or float16). With `extra` (shaped like x, contiguous), grad_x rounded to the dtype, then + extra: the
// residual's own gradient of an add_rms_norm, which reaches a and b alike, added as autograd adds a
// separate residual add's two gradients (so a checkpointed layer's recompute, which adds its residual in a
// node of its own, gives the same gradients bit for bit). grad_w in w's dtype, summed over every row in float32; with
// weight_grad false it is left undefined (a frozen weight). mean(x^2) is recomputed from x.
std::pair<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad_out, const at::Tensor& x,
                                                    const at::Tensor& w, double eps, bool gemma,
                                                    const at::Tensor& extra, bool weight_grad);
// The gradients of silu_mul(g, u) = silu(g) * u given grad_out: {grad_g, grad_u}, shaped like g. grad_u =
// grad_out * silu(g) rounded as ATen's product; grad_g = (grad_out * u rounded) * s (1 + g (1 - s)),
// s = sigmoid(g), in float32 rounded once (ATen's silu_backward). g, u, grad_out: one shape and dtype.
std::pair<at::Tensor, at::Tensor> silu_mul_backward(const at::Tensor& grad_out, const at::Tensor& g,
                                                    const at::Tensor& u);

}  // namespace rlt::cuda
