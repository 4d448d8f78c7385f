// The CPU tracking allocator: counts what LibTorch allocates and frees, and hands out pointers that
// LibTorch's raw_allocate accepts (oneDNN's bf16 matmul on CPU allocates its scratch through it).
#include "common/memory.h"

#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>

namespace rlt {
namespace {

TEST(CpuMemoryTracking, CountsAllocationsAndFreesAndServesOneDnn) {
  install_cpu_memory_tracking();
  const at::Device cpu(at::kCPU);
  const int64_t before = PeakMemory::allocated_bytes(cpu);
  {
    PeakMemory peak(cpu);
    at::Tensor a = at::empty({1 << 20}, at::kFloat);  // 4 MiB
    EXPECT_EQ(PeakMemory::allocated_bytes(cpu) - before, int64_t(4) << 20);
    a.reset();
    EXPECT_EQ(PeakMemory::allocated_bytes(cpu), before) << "a freed tensor leaves the count";
    EXPECT_GE(peak.peak_extra_bytes(), int64_t(4) << 20);
  }
  // bf16 matmul on CPU goes through oneDNN, whose scratch comes from raw_allocate: it needs a pointer
  // whose context is the data itself (this threw an internal assert in grpo_train with dtype bfloat16).
  at::Tensor x = at::randn({64, 96}).to(at::kBFloat16), w = at::randn({128, 96}).to(at::kBFloat16);
  at::Tensor y = at::linear(x, w);
  const at::Tensor ref = at::linear(x.to(at::kDouble), w.to(at::kDouble));
  EXPECT_LT((y.to(at::kDouble) - ref).abs().max().item<double>(), 0.02 * ref.abs().max().item<double>());
  void* raw = c10::GetCPUAllocator()->raw_allocate(1024);
  ASSERT_NE(raw, nullptr);
  EXPECT_EQ(PeakMemory::allocated_bytes(cpu) - before,
            1024 + int64_t(y.nbytes() + x.nbytes() + w.nbytes()) + int64_t(ref.nbytes()));
  c10::GetCPUAllocator()->raw_deallocate(raw);
}

}  // namespace
}  // namespace rlt
