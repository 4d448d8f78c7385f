// CPU: a c10::Allocator that delegates to the allocator it replaces and counts live and peak bytes.
// CUDA: c10's caching-allocator statistics (allocated bytes, aggregate over pools).
#include "common/memory.h"

#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <mutex>
#include <unordered_map>

#ifdef RLT_HAVE_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
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

void release_cached_memory(const at::Device& device) {
#ifdef RLT_HAVE_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
}

}  // namespace rlt
