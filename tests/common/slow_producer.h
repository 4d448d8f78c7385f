// A producer kernel for the tests of programmatic dependent launch (common/cuda/launch.h): it lets the
// kernel after it in the stream launch at once, then writes its output late. A kernel launched with the
// attribute behind it reads that output correctly only if it waits for its inputs (cuda::wait_for_inputs);
// one that does not reads what the memory held before. CUDA builds only.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace rlt::probe {

// dst's bytes become src's, written by one block on the current stream `microseconds` after it starts,
// while the next kernel may already run. dst and src contiguous, of one size, on the same CUDA device.
void slow_copy_(at::Tensor& dst, const at::Tensor& src, int64_t microseconds);
// A copy of src by a kernel launched through cuda::launch (with the attribute where dependent launch is
// on) that reads src without waiting for its inputs: the wrong kernel the tests must catch.
at::Tensor copy_without_wait(const at::Tensor& src);

}  // namespace rlt::probe
