// train.async: one_step. Step t+1's rollout runs on its own thread while step t's update runs, from a copy of
// the weights published after step t-1:
//
//   main thread:     [update t-1] publish w(t-1) [update t           ] publish w(t) [update t+1 ...
//   rollout thread:                [rollout t+1 from w(t-1)]  (waits)  [rollout t+2 from w(t) ...
//
// so every update trains on trajectories sampled by the weights one step behind its own (the first two
// steps both by the initial weights). The rollout decodes its own copy of the weights (LoRA: the merged
// copy), which a publish rewrites in place on the main thread's CUDA stream once the rollout that read it
// has ended; the rollout thread runs on a CUDA stream of its own, which waits on the publish by an event,
// and its collectives are a fork of the run's (Collectives::fork), so that the update's all-reduces and the
// rollout's reward gathering never interleave on one communicator.
//
// rollout.partial: a rollout returns once the step's groups are complete, and the groups it leaves continue
// in the next rollout, from the copy published by then (PartialCarry, RolloutCarry). The carry passes from
// one rollout to the next on the rollout thread; the pending rollout's carry as it began is kept for a
// checkpoint.
//
// Checkpoints: a save first waits for the pending rollout, then writes the published copy
// (rollout_weights.safetensors), where the pending rollout's prompts began, and with rollout.partial the
// groups it began with (each rank its own, partial_rank<R>.json). A resumed run loads them and samples the
// pending rollout again, with the same prompts and noise: it reproduces the uninterrupted run.
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "trainer/run.h"

namespace rlt {

// Wrong schedules the tests must reject: the rollout decodes the trained weights themselves while the
// update changes them (kLiveWeights), or the copy is published once and never again (kNoPublish).
enum class AsyncFault { kNone, kLiveWeights, kNoPublish };

// Where a checkpoint keeps the weights its pending rollout samples (a Hugging Face folder, as the model's).
inline constexpr const char* kRolloutWeightsDir = "rollout_weights";

// A resumed run's pending rollout of train.async one_step (its checkpoint's state["async"]), or nullopt
// when the checkpoint has none (a fresh run, a run in turn): where its prompts begin, the version of the
// weights it samples and their folder (a missing one is a RunError), and whether rollout.partial's carried
// groups are saved beside it.
struct PendingRollout {
  int64_t prompts_begin = 0;
  int64_t version = 0;
  bool partial = false;
  std::string weights;  // checkpoint/rollout_weights
};
std::optional<PendingRollout> pending_rollout(const Run& run);

// How stale a batch's sampled tokens are for the update about to train on it (run.counters.step before the step): per
// sampled token, run.counters.step less its version, averaged (mean) and at most (max), over every rank's batch of
// `dist`; and the batch's trajectories sampled by more than one version (spanning). Every rank calls it.
struct Staleness {
  double mean = 0, max = 0, spanning = 0;
};
Staleness batch_staleness(const Run& run, Collectives& dist, const RolloutBatch& batch);

class AsyncRollouts : public PendingRollouts {
 public:
  // collect samples one step's batch (collect_rollouts, or dynamic sampling's rounds of it). threaded =
  // false runs the same schedule on the calling thread (each rollout right after its publish): the
  // reference the threaded run must equal.
  AsyncRollouts(Run& run, std::function<RolloutBatch(Run&)> collect, bool threaded = true,
                AsyncFault fault = AsyncFault::kNone);
  ~AsyncRollouts();
  AsyncRollouts(const AsyncRollouts&) = delete;
  AsyncRollouts& operator=(const AsyncRollouts&) = delete;

  // Step run.counters.step + 1's batch: waits for its rollout (the first step, or a resumed run's first, samples
  // it here), publishes the weights as they are now, and starts step run.counters.step + 2's rollout from them.
  RolloutBatch next();

  // The step's figures, for the batch next() returned last: staleness_mean and staleness_max (the update's
  // version, run.counters.step before the step, less the version of each sampled token, averaged and at most), with
  // rollout.partial partial_resumed (trajectories the rollout continued from the one before), partial_cut
  // (unfinished ones it left for the next) and partial_spanning (the batch's trajectories sampled by more
  // than one version); and of that batch's rollout:
  // overlap_s (how long it ran while the previous update ran), wait_rollout_s (how long the update side
  // waited for it) and wait_update_s (how long, finished, it waited for the update), and its thread's own
  // span, gathering included: time_rollout_wall_s (time_rollout_s is the generation alone). The token and
  // trajectory figures cover every rank's batch: with several ranks, every rank calls it (two all_reduces
  // on the run's collectives).
  std::map<std::string, double> metrics(const RolloutBatch& batch) const;

  // A checkpoint's part: waits for the pending rollout; writes the published copy into dir and what a
  // resume needs into state["async"].
  void save(const std::string& dir, nlohmann::json& state) override;
  // rollout.partial, on every rank that writes the checkpoint (save_checkpoint): the groups the pending
  // rollout began with (none pending: the next one's), into dir/partial_rank<R>.json.
  void save_carry(const std::string& dir) const override;
  bool partial() const override { return partial_; }

 private:
  using Clock = std::chrono::steady_clock;
  void publish();
  void launch(int64_t batch_step);  // the rollout of step batch_step (1-based), from the copy
  RolloutBatch wait();

  Run& run_;
  std::function<RolloutBatch(Run&)> collect_;
  bool threaded_;
  AsyncFault fault_;
  std::unique_ptr<Transformer> copy_;     // the published weights the rollout decodes
  std::unique_ptr<DecodeEngine> engine_;  // rollout.keep_cache: the rollout thread's kept engine
  std::shared_ptr<Collectives> dist_;     // the rollout thread's collectives
  int64_t version_ = -1;                  // the copy's version: run.counters.step when it was published
  bool published_once_ = false;
  struct CudaOrder;  // the publish's event and the rollout's stream (CUDA builds)
  std::shared_ptr<CudaOrder> cuda_;

  // The pending rollout.
  std::thread thread_;
  bool pending_ = false;
  RolloutSource source_;
  int64_t pending_prompts_ = 0;  // run.data.prompts->consumed() when it began
  bool partial_ = false;         // rollout.partial
  PartialCarry carry_;           // what the next rollout continues (the pending one's, while it runs)
  PartialCarry carry_in_;        // the pending rollout's carry as it began
  RolloutBatch result_;
  std::exception_ptr error_;
  Clock::time_point started_, ended_;

  // The last batch's timing.
  Clock::time_point update_began_;  // when next() last returned
  bool update_running_ = false;
  double overlap_s_ = 0, wait_rollout_s_ = 0, wait_update_s_ = 0, rollout_wall_s_ = 0;
};

}  // namespace rlt
