// Wall-clock seconds on the monotonic clock, for the timings that the trainer logs and the benchmarks print.
#pragma once

#include <algorithm>
#include <chrono>
#include <vector>

namespace rlt {

// Seconds from t0 to now on std::chrono::steady_clock.
inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
inline double ms_since(std::chrono::steady_clock::time_point t0) { return 1e3 * seconds_since(t0); }

// The q-quantile of v (0 <= q <= 1) by the nearest rank, as the benchmarks report p50 and p99; 0 when empty.
inline double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5))];
}

}  // namespace rlt
