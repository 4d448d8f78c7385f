// The ranks of a disaggregated job (train.rollout_ranks; the protocol the trainer runs over them is in
// trainer/rollout_ranks.h): the groups each side meets in, the handovers in the job's store that keep a
// collective's wait bounded while the other side works through a long phase, and the bucketed broadcast of
// the weights from training rank 0 to the rollout ranks.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "parallel/dist.h"

namespace rlt {

// Signs of life and handovers in the job's store: every rank adds to its own counter four times a timeout
// (at most once a second), from a thread of its own on a connection of its own (thread ranks share the
// store under their own ranks). Before a broadcast of the weights, rank 0 says it publishes and the rollout
// ranks that they are ready for it; before a batch, each rollout rank says it is ready. await() waits until
// each of `ranks` has announced `key`, for as long as each of them that has not shows signs of life; one
// whose counter stands still for `timeout` ends the wait with a DistError naming it and what was awaited
// (so does a store that is gone). Keys are per attempt of a torchrun job (TORCHELASTIC_RESTART_COUNT).
class Handover {
 public:
  Handover(c10::intrusive_ptr<c10d::Store> store, int rank, std::chrono::milliseconds timeout);
  ~Handover();
  Handover(const Handover&) = delete;
  Handover& operator=(const Handover&) = delete;
  void announce(const std::string& key);
  void await(const std::string& key, const std::vector<int>& ranks, const std::string& what);
  void fall_silent();  // the counter stops (a test's rank that falls silent)

 private:
  void poll(const std::string& key, const std::vector<int>& ranks, const std::string& what);
  c10::intrusive_ptr<c10d::Store> store_;
  int rank_;
  std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread beat_;
};

// The job's ranks as train.rollout_ranks places them: the first N - k train, the last k sample.
struct Placement {
  std::shared_ptr<Collectives> all;      // every rank of the job
  std::shared_ptr<Collectives> side;     // this rank's side: the training ranks, or the rollout ranks
  std::shared_ptr<Collectives> publish;  // training rank 0 and the rollout ranks; nullptr on the other trainers
  int rollout_ranks = 0;
  bool rollout = false;                // this rank is a rollout rank
  std::shared_ptr<Handover> handover;  // nullptr only for collectives without a store
  std::vector<int> sampling_ranks() const;
};

// The placement of a job over `all` (every rank calls it, in the same order) with its last `rollout_ranks`
// ranks sampling; `timeout` bounds a handover's silence (train.dist_timeout_s). Needs 0 < rollout_ranks <
// all->world().
std::shared_ptr<Placement> place_ranks(int rollout_ranks, std::chrono::milliseconds timeout,
                                       const std::shared_ptr<Collectives>& all);

// The weights' broadcast: the root of `group` (training rank 0) sends `tensors` to every other member, which
// receive into theirs (the same shapes and dtypes, in the same order), in buckets of up to bucket_bytes of
// one dtype; first a scalar with `version`, where both sides meet (its broadcast returns once every member
// has arrived). Returns the version; `timing` holds the buckets' time alone (the device synchronized),
// their bytes and their number.
struct SyncTiming {
  double seconds = 0, bytes = 0;
  int64_t buckets = 0;
};
int64_t broadcast_in_buckets(Collectives& group, const std::vector<at::Tensor>& tensors, int64_t version,
                             int64_t bucket_bytes, at::Device device, SyncTiming& timing);

}  // namespace rlt
