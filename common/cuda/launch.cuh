// Launching the project's kernels with programmatic dependent launch (launch.h says when it is on).
// A kernel launched through launch() must call wait_for_inputs() before its first access to global
// memory that another kernel writes or reads (its inputs, its outputs, any workspace): until then the
// kernel ahead of it may still be running. Weights, constant for the launch, may be read before it.
// Inputs other kernels write are not `const __restrict__`: the compiler may load such data through the
// read-only cache and move the loads above the wait, whose memory clobber does not cover data it takes
// as unchanging for the whole kernel (constant weights may keep it).
// allow_dependents() lets the next kernel launch early; it only brings that kernel's launch forward,
// whose own wait_for_inputs() still waits for this kernel to finish and its writes to be visible. Both
// are no-ops for a kernel launched without the attribute, and compiled out before Hopper.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <mutex>
#include <unordered_map>
#include <utility>

#include "common/cuda/launch.h"

namespace rlt::cuda {

__device__ __forceinline__ void wait_for_inputs() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

namespace detail {
// Whether the code the device runs for `kernel` holds its waits: compiled for Hopper or later, from its
// PTX's virtual architecture where it has PTX (a build for an older one runs on Hopper through its PTX,
// with the waits compiled out), else from its machine code's. Asked once per kernel.
inline bool waits_compiled(const void* kernel) {
  static std::mutex mu;
  static std::unordered_map<const void*, bool> known;
  const std::lock_guard<std::mutex> lock(mu);
  auto it = known.find(kernel);
  if (it == known.end()) {
    cudaFuncAttributes a{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&a, kernel));
    it = known.emplace(kernel, (a.ptxVersion > 0 ? a.ptxVersion : a.binaryVersion) >= 90).first;
  }
  return it->second;
}
}  // namespace detail

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic stream serialization allowed where
// dependent_launch() is on and the kernel's code waits; a launch error throws.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = dependent_launch() && detail::waits_compiled(reinterpret_cast<const void*>(kernel)) ? 1 : 0;
  if (config.numAttrs) detail::dependent_launches.fetch_add(1, std::memory_order_relaxed);
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace rlt::cuda
