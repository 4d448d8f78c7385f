// The CPU tracking allocator: counts what LibTorch allocates and frees, and hands out pointers that
// LibTorch's raw_allocate accepts (oneDNN's bf16 matmul on CPU allocates its scratch through it). Pinned
// host buffers of exactly the size asked for.
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

// A buffer's host memory is its bytes in whole 4 KiB pages, not torch's pinned allocator's power of two:
// a 65 GiB buffer takes 65 GiB, not 128. The tensor has the sizes and dtype asked for, starts as zeros and
// holds what is written to it.
TEST(PinnedHostMemory, TakesWholePagesOfTheSizeAskedFor) {
  EXPECT_EQ(pinned_host_bytes(0), 0);
  EXPECT_EQ(pinned_host_bytes(1), 4096);
  EXPECT_EQ(pinned_host_bytes(4096), 4096);
  EXPECT_EQ(pinned_host_bytes(4097), 8192);
  const int64_t gib = int64_t{1} << 30;
  EXPECT_EQ(pinned_host_bytes(65 * gib), 65 * gib) << "torch's pinned allocator would take 128 GiB";
  at::Tensor t = pinned_host_zeros({3, 1001}, at::kFloat);
  EXPECT_TRUE(t.is_cpu());
  EXPECT_EQ(t.sizes(), at::IntArrayRef({3, 1001}));
  EXPECT_EQ(t.scalar_type(), at::kFloat);
  EXPECT_EQ(t.count_nonzero().item<int64_t>(), 0) << "zeros";
  t.copy_(at::arange(3 * 1001, at::kFloat).view({3, 1001}));
  EXPECT_TRUE(at::equal(t, at::arange(3 * 1001, at::kFloat).view({3, 1001})));
  EXPECT_EQ(pinned_host_zeros({0}, at::kBFloat16).numel(), 0);
}

// Where CUDA is present the pages are locked (is_pinned), so copies to and from the device run
// asynchronously and come back whole; a buffer past 8 MiB (its pages touched by several threads first)
// too. Freed, its pages go back to the host (no error left behind for the next CUDA call).
TEST(PinnedHostMemoryCuda, IsPageLockedAndCopiesBothWays) {
#ifndef RLT_HAVE_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  for (int64_t n : {int64_t{1001}, (int64_t{300} << 20) / 4 + 7}) {
    at::Tensor h = pinned_host_zeros({n}, at::kFloat);
    EXPECT_TRUE(h.is_pinned()) << n << " floats";
    EXPECT_EQ(h.count_nonzero().item<int64_t>(), 0) << n << " floats: zeros";
    h.copy_(at::arange(n, at::kFloat));
    at::Tensor d = h.to(at::kCUDA, /*non_blocking=*/true).mul_(2);
    at::Tensor back = pinned_host_zeros({n}, at::kFloat);
    back.copy_(d, /*non_blocking=*/true);
    device_synchronize(d.device());
    EXPECT_TRUE(at::equal(back, at::arange(n, at::kFloat) * 2)) << n << " floats";
  }
  device_synchronize(at::Device(at::kCUDA, 0));
  EXPECT_TRUE(at::zeros({4}, at::kCUDA).sum().item<float>() == 0.f) << "a CUDA call after the frees";
#endif
}

}  // namespace
}  // namespace rlt
