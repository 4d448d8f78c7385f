// Memory accounting for benchmarks: the peak of bytes allocated above a baseline, on CPU (a tracking
// allocator wrapped around LibTorch's CPU allocator) and on CUDA (the caching allocator's own stats).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace rlt {

// Installs the tracking CPU allocator (idempotent). Tensors allocated before this call are not tracked
// but are freed correctly.
void install_cpu_memory_tracking();

// Measures peak bytes allocated on `device` above what was allocated at construction.
class PeakMemory {
 public:
  explicit PeakMemory(const at::Device& device);  // resets the device's peak counter
  int64_t peak_extra_bytes() const;               // max(allocated) since construction - baseline
  int64_t peak_bytes() const;                     // max(allocated) since construction
  // The most the allocator held since construction, cached blocks included: what the device saw (CUDA's
  // reserved bytes; on the CPU, where nothing is cached, peak_bytes()).
  int64_t peak_reserved_bytes() const;
  static int64_t allocated_bytes(const at::Device& device);

 private:
  at::Device device_;
  int64_t baseline_ = 0;
};

// Waits for all work queued on `device` (no-op on CPU).
void device_synchronize(const at::Device& device);
// Waits for the work this thread queued: the current stream of `device` (no-op on CPU). What a phase's
// timer and a graph capture wait for: with train.async the rollout's thread and the update's run on
// streams of their own, and neither waits for the other's work.
void stream_synchronize(const at::Device& device);
// A CPU tensor (or int64 host values) on `device` without waiting: staged in pinned memory and copied
// asynchronously on the current stream. A copy from pageable memory first waits for all work queued on
// the stream, which in a decode loop idles the GPU while the host launches what comes next. On the CPU,
// the tensor itself.
at::Tensor to_device_async(const at::Tensor& cpu, const at::Device& device);
at::Tensor to_device_async(const std::vector<int64_t>& values, const at::Device& device);
// A host tensor of exactly `sizes`, zeros, page-locked where CUDA is present (plain host memory
// otherwise), for state that lives in host memory for a run and moves to and from a GPU asynchronously: its
// own pages (mmap, zeros already), faulted in by several threads, then registered with CUDA once for every
// context (portable), from a device that already has one. torch's pinned allocator would take each buffer
// rounded up to a power of two (a 65 GiB buffer holds 128 GiB) and keep it cached after it is freed. No
// event guards the pages: the owner keeps the tensor alive until the copies that read or write it have
// run. Throws c10::Error, naming the size, where the host cannot map or lock it (an overcommitted host may
// instead stop the process while the pages are touched).
at::Tensor pinned_host_zeros(at::IntArrayRef sizes, at::ScalarType dtype);
// The host memory the plan counts for a pinned_host_zeros of `bytes`: whole 4 KiB pages (0 for 0), x86-64's;
// a host of larger pages takes up to one page more a buffer.
constexpr int64_t kHostPageBytes = 4096;
constexpr int64_t pinned_host_bytes(int64_t bytes) {
  return (bytes + kHostPageBytes - 1) / kHostPageBytes * kHostPageBytes;
}
// Returns cached, unused device blocks to the driver (CUDA), e.g. after an out-of-memory error.
void release_cached_memory(const at::Device& device);

// What ATen allocates for each (cuBLAS handle, stream) pair that runs a GEMM and keeps until the process
// ends: a cuBLAS workspace and a cuBLASLt one. With a CUDA device, the sizes ATen chose for it
// (CUBLAS_WORKSPACE_CONFIG and CUBLASLT_WORKSPACE_SIZE change them); otherwise kCublasWorkspacesHopper,
// ATen's defaults on a Hopper GPU: 32 MiB and 1 MiB.
constexpr int64_t kCublasWorkspacesHopper = int64_t(33) << 20;
int64_t cublas_workspace_bytes();

}  // namespace rlt
