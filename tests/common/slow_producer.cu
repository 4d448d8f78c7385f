#include "tests/common/slow_producer.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/util/Exception.h>

#include "common/cuda/launch.cuh"

namespace rlt::probe {
namespace {

__device__ unsigned long long globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void slow_copy_kernel(const uint8_t* src, uint8_t* dst, int64_t n, unsigned long long delay_ns) {
  cuda::allow_dependents();  // the kernel behind may launch now, before anything is written
  if (threadIdx.x == 0) {
    const unsigned long long t0 = globaltimer_ns();
    while (globaltimer_ns() - t0 < delay_ns) {
    }
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

__global__ void copy_without_wait_kernel(const uint8_t* src, uint8_t* dst, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

}  // namespace

void slow_copy_(at::Tensor& dst, const at::Tensor& src, int64_t microseconds) {
  TORCH_CHECK(dst.is_cuda() && src.device() == dst.device() && dst.is_contiguous() && src.is_contiguous() &&
                  dst.nbytes() == src.nbytes(),
              "slow_copy_: dst and src contiguous, of one size, on one CUDA device");
  slow_copy_kernel<<<1, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const uint8_t*>(src.data_ptr()), static_cast<uint8_t*>(dst.data_ptr()),
      static_cast<int64_t>(src.nbytes()), static_cast<unsigned long long>(microseconds) * 1000ull);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor copy_without_wait(const at::Tensor& src) {
  TORCH_CHECK(src.is_cuda() && src.is_contiguous(), "copy_without_wait: a contiguous CUDA tensor");
  at::Tensor out = at::empty_like(src);
  cuda::launch(copy_without_wait_kernel, dim3(8), dim3(256), 0, at::cuda::getCurrentCUDAStream(),
               static_cast<const uint8_t*>(src.data_ptr()), static_cast<uint8_t*>(out.data_ptr()),
               static_cast<int64_t>(src.nbytes()));
  return out;
}

}  // namespace rlt::probe
