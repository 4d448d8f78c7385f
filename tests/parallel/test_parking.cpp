// PhaseParking (parallel/parking.h): tensors moved to host memory and back keep their identity and come back
// bit for bit, on the CPU and on a GPU; the host buffers are made once (ahead, by reserve, on a thread of
// their own) and reused, and each park writes the values of its moment; zeros are freed and come back as
// zeros. The wrong twins write their buffers on the first park only (the state of a later phase comes back
// a step stale), or put each tensor back one element over.
#include <gtest/gtest.h>

#include <vector>

#include "parallel/parking.h"

namespace rlt {
namespace {

std::vector<at::Tensor> state_on(at::Device device) {
  at::manual_seed(7);
  std::vector<at::Tensor> t;
  for (int64_t n : {5, 5, 12, 3}) t.push_back(at::randn({n}, at::kFloat).to(device));
  t.push_back(at::Tensor());  // an undefined one is passed over
  t.push_back(at::randn({2, 3}, at::kFloat).to(device));
  return t;
}

void round_trip(at::Device device, bool reserve) {
  std::vector<at::Tensor> state = state_on(device);
  std::vector<at::Tensor> before;
  std::vector<const void*> impls;
  for (const auto& t : state) {
    before.push_back(t.defined() ? t.clone() : t);
    impls.push_back(t.defined() ? t.unsafeGetTensorImpl() : nullptr);
  }
  at::Tensor grad = at::zeros({4, 2}, at::TensorOptions().dtype(at::kFloat).device(device));
  const void* grad_impl = grad.unsafeGetTensorImpl();
  PhaseParking parking;
  const int64_t bytes = 4 * (5 + 5 + 12 + 3 + 6);
  if (reserve) {
    parking.reserve(state);
    EXPECT_EQ(parking.host_bytes(), 0) << "taken at the first park";
  }
  std::vector<const void*> buffers;
  for (int round = 0; round < 2; ++round) {
    parking.park(state, {grad});
    EXPECT_TRUE(parking.parked());
    for (const auto& t : state) {
      if (t.defined()) EXPECT_TRUE(t.device().is_cpu()) << "parked in host memory";
    }
    EXPECT_EQ(grad.numel(), 0) << "a zero tensor is freed, not copied";
    EXPECT_EQ(grad.device().type(), device.type());
    EXPECT_EQ(parking.host_bytes(), bytes);
    EXPECT_EQ(parking.moved_bytes(), bytes);
    EXPECT_EQ(parking.zeroed_bytes(), 4 * 8);
    std::vector<const void*> now;
    for (const auto& t : state) now.push_back(t.defined() ? t.data_ptr() : nullptr);
    if (round == 0) {
      buffers = now;
    } else {
      EXPECT_EQ(now, buffers) << "the host buffers are reused";
    }
    // The rollout's phase: the state is not touched; then it comes back.
    parking.unpark();
    EXPECT_EQ(parking.host_bytes(), bytes) << "the host buffers stay for the next phase";
    for (size_t i = 0; i < state.size(); ++i) {
      if (!state[i].defined()) continue;
      EXPECT_EQ(state[i].device().type(), device.type());
      EXPECT_EQ(state[i].unsafeGetTensorImpl(), impls[i]) << "the same tensor, as the optimizer keys it";
      EXPECT_TRUE(at::equal(state[i], before[i])) << "tensor " << i << ", round " << round;
    }
    EXPECT_EQ(grad.unsafeGetTensorImpl(), grad_impl);
    EXPECT_EQ(grad.sizes(), at::IntArrayRef({4, 2}));
    EXPECT_EQ(grad.device().type(), device.type());
    EXPECT_TRUE(at::equal(grad, at::zeros_like(grad)));
    state[0].add_(1.0);  // the update moves it: the next park must carry the new values
    before[0] = state[0].clone();
  }
  // The twins: a stale copy from the second park on; every tensor one element over.
  PhaseParking stale(PhaseParking::Fault::kStaleCopy);
  stale.park(state);
  stale.unpark();
  state[0].add_(1.0);
  before[0] = state[0].clone();
  stale.park(state);
  stale.unpark();
  EXPECT_FALSE(at::equal(state[0], before[0])) << "the stale twin must fail";
  state[0].copy_(before[0]);
  PhaseParking shifted(PhaseParking::Fault::kWrongSlice);
  shifted.park(state);
  shifted.unpark();
  EXPECT_FALSE(at::equal(state[2], before[2])) << "the wrong-slice twin must fail";
}

TEST(PhaseParking, StateComesBackBitForBitAsTheSameTensors) {
  round_trip(at::kCPU, /*reserve=*/false);
  round_trip(at::kCPU, /*reserve=*/true);
}

TEST(PhaseParking, CudaStateLeavesTheDeviceAndComesBack) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  round_trip(at::Device(at::kCUDA), /*reserve=*/false);
  round_trip(at::Device(at::kCUDA), /*reserve=*/true);
}

// Buffers reserved for a longer list serve a park of its first tensors (the replicated AdamW's masters
// before its first step made the moments), and a tensor whose shape differs from its reserved buffer gets
// one of its own.
TEST(PhaseParking, ReservedBuffersServeAPrefixAndAMismatchGetsItsOwn) {
  std::vector<at::Tensor> masters = {at::randn({3}), at::randn({2, 2})};
  std::vector<at::Tensor> layout = masters;
  for (const auto& m : masters) layout.insert(layout.end(), {m, m});
  PhaseParking parking;
  parking.reserve(layout);
  const at::Tensor before = masters[1].clone();
  parking.park(masters);
  EXPECT_EQ(parking.host_bytes(), 3 * 4 * (3 + 4)) << "every reserved buffer";
  parking.unpark();
  EXPECT_TRUE(at::equal(masters[1], before));
  std::vector<at::Tensor> other = {at::randn({5})};
  const at::Tensor other_before = other[0].clone();
  parking.park(other);
  EXPECT_EQ(parking.host_bytes(), 3 * 4 * (3 + 4) - 4 * 3 + 4 * 5);
  parking.unpark();
  EXPECT_TRUE(at::equal(other[0], other_before));
}

}  // namespace
}  // namespace rlt

namespace rlt {
namespace {

// A park while parked adds to what is parked and takes the next buffers (ParkedTrainingState parks the
// weight chunks after the gather); one unpark brings both back, and the next phase reuses the buffers.
// Rejected: a second park that starts the phase again (the first tensor would stay on its host buffer),
// or that takes the first buffers again (a buffer of the wrong shape, made anew: more host bytes).
TEST(PhaseParking, ASecondParkAddsToThePhase) {
  std::vector<at::Tensor> first = {at::randn({4})}, second = {at::randn({2, 3})};
  const at::Tensor a = first[0].clone(), b = second[0].clone();
  PhaseParking parking;
  parking.reserve({first[0], second[0]});
  for (int round = 0; round < 2; ++round) {
    parking.park(first);
    const void* parked_first = first[0].data_ptr();  // its host buffer
    parking.park(second);
    EXPECT_EQ(parking.moved_bytes(), 4 * (4 + 6));
    EXPECT_EQ(parking.host_bytes(), 4 * (4 + 6)) << "the reserved buffers, in order";
    parking.unpark();
    EXPECT_FALSE(parking.parked());
    EXPECT_NE(first[0].data_ptr(), parked_first) << "the first park's tensor came back too";
    EXPECT_TRUE(at::equal(first[0], a));
    EXPECT_TRUE(at::equal(second[0], b));
  }
}

// A park that throws halfway (a tensor that cannot be copied: a meta tensor) leaves what it moved
// parked, and unpark() brings exactly that back. Rejected: a park that only marks the phase at its end
// (nothing would come back: the first tensor stays on its host buffer), or one that records a tensor
// before its copy (the meta tensor would come back as an uninitialised host buffer).
TEST(PhaseParking, APartialParkComesBack) {
  at::Tensor moved = at::randn({4}), meta = at::empty({4}, at::TensorOptions().device(at::kMeta));
  const at::Tensor before = moved.clone();
  PhaseParking parking;
  EXPECT_THROW(parking.park({moved, meta}), c10::Error);
  EXPECT_TRUE(parking.parked());
  EXPECT_EQ(parking.moved_bytes(), 4 * 4);
  parking.unpark();
  EXPECT_FALSE(parking.parked());
  EXPECT_TRUE(at::equal(moved, before));
  EXPECT_TRUE(meta.is_meta()) << meta.device();
}

}  // namespace
}  // namespace rlt
