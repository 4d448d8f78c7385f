// PhaseParking (parallel/parking.h): tensors moved to host memory and back keep their identity and come back
// bit for bit, on the CPU and on a GPU; the host buffers are made once and reused, and each park writes
// the values of its moment. The wrong twin writes its buffers on the first park only: the state of a later
// phase comes back a step stale.
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

void round_trip(at::Device device) {
  std::vector<at::Tensor> state = state_on(device);
  std::vector<at::Tensor> before;
  std::vector<const void*> impls;
  for (const auto& t : state) {
    before.push_back(t.defined() ? t.clone() : t);
    impls.push_back(t.defined() ? t.unsafeGetTensorImpl() : nullptr);
  }
  PhaseParking parking;
  for (int round = 0; round < 2; ++round) {
    parking.park(state);
    EXPECT_TRUE(parking.parked());
    for (const auto& t : state) {
      if (t.defined()) EXPECT_TRUE(t.device().is_cpu()) << "parked in host memory";
    }
    const int64_t host = parking.host_bytes();
    EXPECT_EQ(host, 4 * (5 + 5 + 12 + 3 + 6));
    // The rollout's phase: the state is not touched; then it comes back.
    parking.unpark();
    EXPECT_EQ(parking.host_bytes(), host) << "the host buffers stay for the next phase";
    for (size_t i = 0; i < state.size(); ++i) {
      if (!state[i].defined()) continue;
      EXPECT_EQ(state[i].device().type(), device.type());
      EXPECT_EQ(state[i].unsafeGetTensorImpl(), impls[i]) << "the same tensor, as the optimizer keys it";
      EXPECT_TRUE(at::equal(state[i], before[i])) << "tensor " << i << ", round " << round;
    }
    state[0].add_(1.0);  // the update moves it: the next park must carry the new values
    before[0] = state[0].clone();
  }
  // The twin: a stale copy from the second park on.
  PhaseParking wrong(PhaseParking::Fault::kStaleCopy);
  wrong.park(state);
  wrong.unpark();
  state[0].add_(1.0);
  before[0] = state[0].clone();
  wrong.park(state);
  wrong.unpark();
  EXPECT_FALSE(at::equal(state[0], before[0])) << "the twin must fail";
}

TEST(PhaseParking, StateComesBackBitForBitAsTheSameTensors) { round_trip(at::kCPU); }

TEST(PhaseParking, CudaStateLeavesTheDeviceAndComesBack) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  round_trip(at::Device(at::kCUDA));
}

}  // namespace
}  // namespace rlt
