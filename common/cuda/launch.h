// Programmatic dependent launch (Hopper and later): whether the project's kernels launched on this thread
// may start before the kernel ahead of them in the stream has finished. Such a kernel is resident and
// waiting (cuda::wait_for_inputs, launch.cuh) when its predecessor ends, so the gap between the two, a
// microsecond or two inside a CUDA graph, is mostly hidden. Captured into a graph, the launch becomes a
// programmatic edge. Off by default; DecodeEngine turns it on while it captures a step
// (EngineSwitches::dependent_launch). Plain C++: the engine sets it without CUDA headers.
#pragma once

#include <atomic>
#include <cstdint>

#include "common/thread_flag.h"

namespace rlt::cuda {

namespace detail {
inline thread_local bool dependent_launch_on = false;
inline std::atomic<int64_t> dependent_launches{0};
}  // namespace detail

inline bool dependent_launch() { return detail::dependent_launch_on; }
// The kernels launched with the attribute in this process, on every thread (the tests read it).
inline int64_t dependent_launch_count() { return detail::dependent_launches.load(std::memory_order_relaxed); }

// Sets the thread's choice for its lifetime, then restores the one before it.
class DependentLaunchScope : public ThreadFlagScope {
 public:
  explicit DependentLaunchScope(bool on) : ThreadFlagScope(detail::dependent_launch_on, on) {}
};

}  // namespace rlt::cuda
