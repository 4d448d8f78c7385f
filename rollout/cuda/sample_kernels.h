// The fused Gumbel-max draw (sample_kernels.cu); rollout/sampler.cpp calls it on CUDA devices.
#pragma once

#include <ATen/ATen.h>

namespace rlt::cuda {

// ids (B) int64: argmax_v x[n, v] / temperature - log(-log u[n, v]), with u as counter_uniforms makes it
// from the row's key row_keys[n] (the hash of seed, stream and counter). x (B, V) float32 on CUDA, unit
// column stride; row_keys (B) int64 on the same device. Bit-identical to the ATen form in sampler.cpp.
at::Tensor gumbel_argmax(const at::Tensor& x, const at::Tensor& row_keys, double temperature);

}  // namespace rlt::cuda
