// Wall-clock seconds on the monotonic clock, for the timings that the trainer logs and the benchmarks print.
#pragma once

#include <chrono>

namespace rlt {

// Seconds from t0 to now on std::chrono::steady_clock.
inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace rlt
