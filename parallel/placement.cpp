// Placement, handovers and the weights' broadcast; see placement.h.
#include "parallel/placement.h"

#include <chrono>
#include <cstdlib>
#include <numeric>
#include <thread>

#include "common/memory.h"
#include "common/timing.h"

namespace rlt {

using Clock = std::chrono::steady_clock;

int64_t broadcast_in_buckets(Collectives& group, const std::vector<at::Tensor>& tensors, int64_t version,
                             int64_t bucket_bytes, at::Device device, SyncTiming& timing) {
  // The version, as a maximum in which the receivers add nothing: an all-reduce returns on no member before
  // every member has joined it (a broadcast's root may return once its bytes are sent).
  const bool root = group.rank() == 0;
  at::Tensor v = at::tensor({root ? static_cast<double>(version) : -1e300}, at::kDouble);
  group.all_reduce({v}, ReduceOp::kMax);
  const auto t0 = Clock::now();
  timing = SyncTiming{};
  for (size_t i = 0; i < tensors.size();) {
    size_t j = i;
    int64_t size = 0;
    while (j < tensors.size() && tensors[j].scalar_type() == tensors[i].scalar_type() &&
           (j == i || size + static_cast<int64_t>(tensors[j].nbytes()) <= bucket_bytes)) {
      size += static_cast<int64_t>(tensors[j].nbytes());
      ++j;
    }
    std::vector<at::Tensor> flat;
    for (size_t k = i; k < j; ++k) flat.push_back(tensors[k].reshape({-1}));
    at::Tensor bucket = root ? at::cat(flat) : at::empty({size / tensors[i].element_size()}, tensors[i].options());
    group.broadcast({bucket}, 0);
    if (!root) {
      int64_t offset = 0;
      for (size_t k = i; k < j; ++k) {
        tensors[k].copy_(bucket.narrow(0, offset, tensors[k].numel()).view(tensors[k].sizes()));
        offset += tensors[k].numel();
      }
    }
    timing.bytes += static_cast<double>(size);
    timing.buckets += 1;
    i = j;
  }
  stream_synchronize(device);
  timing.seconds = seconds_since(t0);
  return static_cast<int64_t>(v.item<double>());
}

std::shared_ptr<Placement> place_ranks(int k, std::chrono::milliseconds timeout,
                                       const std::shared_ptr<Collectives>& all) {
  const int world = all->world();
  TORCH_CHECK(k > 0 && k < world, "place_ranks: ", k, " rollout ranks of ", world);
  std::vector<int> trainers(world - k), rollouts(k), publish{0};
  std::iota(trainers.begin(), trainers.end(), 0);
  std::iota(rollouts.begin(), rollouts.end(), world - k);
  publish.insert(publish.end(), rollouts.begin(), rollouts.end());
  auto p = std::make_shared<Placement>();
  p->all = all;
  p->rollout_ranks = k;
  p->rollout = all->rank() >= world - k;
  std::shared_ptr<Collectives> train = all->group("train", trainers);
  std::shared_ptr<Collectives> rollout = all->group("rollout", rollouts);
  p->publish = all->group("publish", publish);
  p->side = p->rollout ? rollout : train;
  if (const auto store = all->store()) {
    p->handover = std::make_shared<Handover>(store, all->rank(), timeout);
  }
  return p;
}

namespace {
// Keys of this attempt of the job: torchrun's agent keeps its store across a restart of the workers.
std::string placement_key(const std::string& what) {
  const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
  return "rlt/placement/" + std::string(attempt ? attempt : "0") + "/" + what;
}
std::string alive_key(int rank) { return placement_key("alive/" + std::to_string(rank)); }
std::string said_key(const std::string& key, int rank) {
  return placement_key("said/" + key + "/" + std::to_string(rank));
}
}  // namespace

Handover::Handover(c10::intrusive_ptr<c10d::Store> store, int rank, std::chrono::milliseconds timeout)
    : store_(std::move(store)), rank_(rank), timeout_(timeout) {
  store_->add(alive_key(rank_), 1);
  // Its own connection: a TCPStore client holds its lock through a blocking wait (a collective's), which
  // would hold the beats back on a shared one. Four beats a timeout, at most one a second.
  c10::intrusive_ptr<c10d::Store> own;
  try {
    own = store_->clone();
  } catch (const std::exception&) {
    own = store_;
  }
  const auto every = std::clamp(timeout_ / 4, std::chrono::milliseconds(50), std::chrono::milliseconds(1000));
  beat_ = std::thread([this, own, every] {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!wake_.wait_for(lock, every, [this] { return stop_; })) {
      try {
        own->add(alive_key(rank_), 1);
      } catch (const std::exception&) {
        return;  // the store is gone: the job is ending, and a wait on it reports that
      }
    }
  });
}

Handover::~Handover() { fall_silent(); }

void Handover::fall_silent() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (beat_.joinable()) beat_.join();
}

void Handover::announce(const std::string& key) {
  try {
    store_->set(said_key(key, rank_), std::vector<uint8_t>{1});
  } catch (const c10::Error& e) {
    throw DistError("rank " + std::to_string(rank_) +
                    ": the rendezvous store is gone (rank 0 serves it): " + e.what_without_backtrace());
  }
}

void Handover::await(const std::string& key, const std::vector<int>& ranks, const std::string& what) {
  try {
    poll(key, ranks, what);
  } catch (const c10::Error& e) {
    throw DistError("rank " + std::to_string(rank_) + " waited for " + what +
                    ": the rendezvous store is gone (rank 0 serves it): " + e.what_without_backtrace());
  }
}

void Handover::poll(const std::string& key, const std::vector<int>& ranks, const std::string& what) {
  using Clock = std::chrono::steady_clock;
  struct Seen {
    int64_t count = -1;
    Clock::time_point since;
  };
  std::map<int, Seen> seen;
  for (;;) {
    bool all = true;
    const Clock::time_point now = Clock::now();
    for (int r : ranks) {
      if (store_->check({said_key(key, r)})) continue;
      all = false;
      const int64_t count = store_->add(alive_key(r), 0);
      Seen& s = seen[r];
      if (count != s.count) {
        s.count = count;
        s.since = now;
      } else if (now - s.since > timeout_) {
        throw DistError("rank " + std::to_string(rank_) + " waited for " + what + ": rank " + std::to_string(r) +
                        " showed no sign of life for " + std::to_string(timeout_.count() / 1000) +
                        " s (train.dist_timeout_s)");
      }
    }
    if (all) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::vector<int> Placement::sampling_ranks() const {
  std::vector<int> r(rollout_ranks);
  std::iota(r.begin(), r.end(), all->world() - rollout_ranks);
  return r;
}

}  // namespace rlt
