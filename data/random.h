// The deterministic random streams of data/: the same numbers on every platform and standard library,
// unlike std:: distributions, so synthetic tasks and prompt orders reproduce everywhere.
#pragma once

#include <cstdint>

namespace rlt {

// splitmix64 (Steele, Lea & Flood 2014): a full-period 64-bit stream whose outputs pass BigCrush; one
// multiply-xorshift per draw is plenty for shuffling prompts and drawing operands.
inline uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Uniform in [0, n) without modulo bias (Lemire 2019, "Fast random integer generation in an interval").
inline uint64_t uniform_below(uint64_t& state, uint64_t n) {
  unsigned __int128 m = static_cast<unsigned __int128>(splitmix64(state)) * n;
  uint64_t low = static_cast<uint64_t>(m);
  if (low < n) {
    const uint64_t threshold = (0 - n) % n;  // 2^64 mod n
    while (low < threshold) {
      m = static_cast<unsigned __int128>(splitmix64(state)) * n;
      low = static_cast<uint64_t>(m);
    }
  }
  return static_cast<uint64_t>(m >> 64);
}

}  // namespace rlt
