// Trajectories as bytes between ranks: the groups dynamic sampling sends to the rank that trains their slot,
// and the batches train.rollout_ranks' rollout ranks send to the training ranks. A record holds every field
// of the example and of each trajectory (rollout/retool.h), so the receiver trains on what the sender
// sampled.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "data/dataset.h"
#include "parallel/dist.h"
#include "rollout/python_reward.h"
#include "rollout/retool.h"

namespace rlt {

class ByteWriter {
 public:
  template <class T>
  void put(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    bytes.insert(bytes.end(), p, p + sizeof(T));
  }
  template <class T>
  void put_vec(const std::vector<T>& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    put<int64_t>(static_cast<int64_t>(v.size()));
    const auto* p = reinterpret_cast<const uint8_t*>(v.data());
    bytes.insert(bytes.end(), p, p + v.size() * sizeof(T));
  }
  void put_str(const std::string& s) { put_vec(std::vector<char>(s.begin(), s.end())); }
  std::vector<uint8_t> bytes;
};

// Reads what a ByteWriter wrote; a record that runs past its buffer is a c10::Error.
class ByteReader {
 public:
  ByteReader(const uint8_t* data, size_t size) : p_(data), end_(data + size) {}
  bool done() const { return p_ == end_; }
  template <class T>
  T get() {
    static_assert(std::is_trivially_copyable_v<T>);
    T v;
    take(&v, sizeof(T));
    return v;
  }
  template <class T>
  std::vector<T> get_vec() {
    const auto n = get<int64_t>();
    TORCH_CHECK(n >= 0 && static_cast<size_t>(n) <= static_cast<size_t>(end_ - p_) / sizeof(T),
                "a corrupt trajectory record: a vector of ", n, " elements");
    std::vector<T> v(static_cast<size_t>(n));
    take(v.data(), v.size() * sizeof(T));
    return v;
  }
  std::string get_str() {
    const std::vector<char> c = get_vec<char>();
    return std::string(c.begin(), c.end());
  }

 private:
  void take(void* out, size_t n) {
    TORCH_CHECK(static_cast<size_t>(end_ - p_) >= n, "a trajectory record runs past its buffer");
    if (n) std::memcpy(out, p_, n);
    p_ += n;
  }
  const uint8_t* p_;
  const uint8_t* end_;
};

// A prompt's example and its G trajectories, under `slot` (the receiver's place for them).
void write_group(ByteWriter& w, int64_t slot, const PromptExample& ex, const Trajectory* trajs, int64_t G);
struct GroupRecord {
  int64_t slot = -1;
  PromptExample example;
  std::vector<Trajectory> trajs;  // (G)
};
GroupRecord read_group(ByteReader& r, int64_t G);

// A batch's reward tally (rollout/python_reward.h): the trajectories scored and failed, and each field's
// sum and count.
void write_tally(ByteWriter& w, const RewardTally& t);
RewardTally read_tally(ByteReader& r);

// Every rank's `mine` bytes, concatenated in rank order, on every rank: the sizes, then the bytes, each an
// all_reduce sum in which every other rank adds zeros. Every rank makes the same calls.
std::vector<uint8_t> exchange_bytes(Collectives& dist, const std::vector<uint8_t>& mine);

}  // namespace rlt
