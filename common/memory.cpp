// CPU: a c10::Allocator that delegates to the allocator it replaces and counts live and peak bytes.
// CUDA: c10's caching-allocator statistics (allocated bytes, aggregate over pools).
#include "common/memory.h"

#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

#ifdef RLT_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <thread>

#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace rlt {

namespace {

std::atomic<int64_t> g_cpu_live{0};
std::atomic<int64_t> g_cpu_peak{0};

// Live allocations by data pointer. The DataPtr handed out has context == data, as LibTorch's
// raw_allocate (used by oneDNN/ideep for bf16 matmuls on CPU) requires; the inner allocation, with its own
// context and deleter, waits here until that pointer is freed.
struct Tracked {
  c10::DataPtr inner;
  size_t bytes;
};
std::mutex g_mu;
auto* g_live = new std::unordered_map<void*, Tracked>();  // never destroyed: frees may come at exit

void tracked_delete(void* data) {
  std::unordered_map<void*, Tracked>::node_type node;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    node = g_live->extract(data);
  }
  if (node) g_cpu_live.fetch_sub(static_cast<int64_t>(node.mapped().bytes));
  // node's destructor frees the inner allocation through its own deleter, outside the lock.
}

class TrackingAllocator final : public c10::Allocator {
 public:
  explicit TrackingAllocator(c10::Allocator* inner) : inner_(inner) {}
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr p = inner_->allocate(n);
    void* data = p.get();
    if (data == nullptr) return p;  // zero bytes: nothing to count
    const auto device = p.device();
    {
      std::lock_guard<std::mutex> lock(g_mu);
      g_live->emplace(data, Tracked{std::move(p), n});
    }
    const int64_t live = g_cpu_live.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
    int64_t peak = g_cpu_peak.load();
    while (live > peak && !g_cpu_peak.compare_exchange_weak(peak, live)) {
    }
    return {data, data, &tracked_delete, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &tracked_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }

 private:
  c10::Allocator* inner_;
};

}  // namespace

void install_cpu_memory_tracking() {
  static std::once_flag once;
  std::call_once(once, [] {
    static TrackingAllocator tracker(c10::GetCPUAllocator());
    c10::SetCPUAllocator(&tracker, /*priority=*/100);
  });
}

int64_t PeakMemory::allocated_bytes(const at::Device& device) {
#ifdef RLT_HAVE_CUDA
  if (device.is_cuda()) {
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index() < 0 ? 0 : device.index());
    return stats.allocated_bytes[0].current;  // index 0: aggregate over pools
  }
#endif
  return g_cpu_live.load();
}

PeakMemory::PeakMemory(const at::Device& device) : device_(device) {
#ifdef RLT_HAVE_CUDA
  if (device.is_cuda()) {
    const auto idx = device.index() < 0 ? 0 : device.index();
    c10::cuda::CUDACachingAllocator::resetPeakStats(idx);
    baseline_ = allocated_bytes(device);
    return;
  }
#endif
  baseline_ = g_cpu_live.load();
  g_cpu_peak.store(baseline_);
}

int64_t PeakMemory::peak_extra_bytes() const {
#ifdef RLT_HAVE_CUDA
  if (device_.is_cuda()) {
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device_.index() < 0 ? 0 : device_.index());
    return stats.allocated_bytes[0].peak - baseline_;
  }
#endif
  return g_cpu_peak.load() - baseline_;
}

int64_t PeakMemory::peak_bytes() const { return peak_extra_bytes() + baseline_; }

int64_t PeakMemory::peak_reserved_bytes() const {
#ifdef RLT_HAVE_CUDA
  if (device_.is_cuda()) {
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device_.index() < 0 ? 0 : device_.index());
    return stats.reserved_bytes[0].peak;
  }
#endif
  return peak_bytes();
}

void device_synchronize(const at::Device& device) {
#ifdef RLT_HAVE_CUDA
  if (device.is_cuda()) c10::cuda::device_synchronize();
#endif
}

void stream_synchronize(const at::Device& device) {
#ifdef RLT_HAVE_CUDA
  if (device.is_cuda()) c10::cuda::getCurrentCUDAStream(device.index()).synchronize();
#endif
}

at::Tensor to_device_async(const at::Tensor& cpu, const at::Device& device) {
  TORCH_CHECK(cpu.is_cpu(), "to_device_async: the source must be a CPU tensor");
  if (!device.is_cuda()) return cpu.to(device);
  // Always a fresh staging buffer (the caller may reuse its own), which the host allocator keeps until
  // the copy has run.
  at::Tensor staged = at::empty(cpu.sizes(), cpu.options().pinned_memory(true));
  staged.copy_(cpu);
  return staged.to(device, /*non_blocking=*/true);
}

at::Tensor to_device_async(const std::vector<int64_t>& values, const at::Device& device) {
  if (!device.is_cuda()) return at::tensor(values, at::kLong);
  // A view of the vector: the overload above copies it into its staging buffer before returning.
  return to_device_async(
      at::from_blob(const_cast<int64_t*>(values.data()), {static_cast<int64_t>(values.size())}, at::kLong), device);
}

at::Tensor pinned_host_zeros(at::IntArrayRef sizes, at::ScalarType dtype) {
  const at::TensorOptions options = at::TensorOptions().dtype(dtype).device(at::kCPU);
#ifdef RLT_HAVE_CUDA
  const int64_t bytes = c10::multiply_integers(sizes) * static_cast<int64_t>(c10::elementSize(dtype));
  if (at::hasCUDA() && bytes > 0) {
    at::globalContext().lazyInitDevice(at::kCUDA);  // torch's CUDA state first: is_pinned asks it
    // Registered from a device whose context exists (none is made on device 0 for a run on another).
    std::optional<c10::cuda::CUDAGuard> guard;
    if (const auto with_context = c10::cuda::getDeviceIndexWithPrimaryContext()) guard.emplace(*with_context);
    const auto page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t length = (static_cast<size_t>(bytes) + page - 1) / page * page;
    void* data = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(data != MAP_FAILED, "pinned_host_zeros: mapping ", length,
                " bytes of host memory failed: ", std::strerror(errno));
    try {
      // Registration locks the pages, faulting in those not yet touched one at a time; touched first by
      // several threads (one write a page), a buffer registers several times faster. Threads from 8 MiB
      // up, where the faults outlast starting them.
      const size_t pages = length / page;
      const size_t threads =
          length >= (size_t{8} << 20) ? std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 8) : 1;
      auto touch = [data, page](size_t first, size_t last) {
        for (size_t i = first; i < last; ++i) static_cast<volatile char*>(data)[i * page] = 0;
      };
      std::vector<std::thread> workers;
      try {
        for (size_t w = 1; w < threads; ++w)
          workers.emplace_back(touch, pages * w / threads, pages * (w + 1) / threads);
      } catch (...) {
        for (std::thread& th : workers) th.join();
        throw;
      }
      touch(0, pages / threads);
      for (std::thread& th : workers) th.join();
      const cudaError_t status = cudaHostRegister(data, length, cudaHostRegisterPortable);
      if (status != cudaSuccess) {
        (void)cudaGetLastError();  // not sticky: leave no error for the next call to find
        TORCH_CHECK(false, "pinned_host_zeros: locking ", length,
                    " bytes of host memory failed: ", cudaGetErrorString(status));
      }
    } catch (...) {
      munmap(data, length);
      throw;
    }
    auto release = [length](void* p) {
      if (cudaHostUnregister(p) != cudaSuccess) (void)cudaGetLastError();
      munmap(p, length);
    };
    try {
      return at::from_blob(data, sizes, release, options);
    } catch (...) {
      release(data);
      throw;
    }
  }
#endif
  return at::zeros(sizes, options);
}

void release_cached_memory(const at::Device& device) {
#ifdef RLT_HAVE_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
}

int64_t cublas_workspace_bytes() {
#ifdef RLT_HAVE_CUDA
  if (at::hasCUDA())
    return static_cast<int64_t>(at::cuda::getChosenWorkspaceSize() + at::cuda::getCUDABlasLtWorkspaceSize());
#endif
  return kCublasWorkspacesHopper;
}

}  // namespace rlt
