// train.rollout_ranks: disaggregated placement. Of a job's N ranks, the last k (the rollout ranks) only
// sample and score trajectories, and the first N - k (the training ranks) only train, as a data-parallel
// run of N - k ranks whose rank 0 writes the run folder:
//
//   training ranks:  publish w(t) | receive batch t+1 | update t+1 ............ | publish w(t+1) | ...
//   rollout ranks:   receive w(t) | send batch t+1    | sample batch t+2 ...   | receive w(t+1) | ...
//
// With train.async one_step, a rollout rank samples batch t+2 from w(t) while the training ranks update on
// batch t+1, as the colocated one_step does (trainer/async_rollout.h): every update trains on trajectories
// one version behind it. With train.async off, it receives w(t) before sampling batch t+1, and the update is
// on-policy; the two sides then take turns. Either way the batches, their noise and the updates are those
// of the colocated run of N - k ranks.
//
// At the start of each step (after the previous update, its evaluation and checkpoint), training rank 0
// broadcasts the weights the rollout decodes (LoRA: merged; under train.shard parameters, gathered first by
// every training rank) in buckets of train.rollout_sync_mb, over a group of itself and the rollout ranks;
// an all-reduce of the weights' version first is where the two sides meet, so the buckets' time is the
// transfer alone. The rollout ranks split a step's
// prompts evenly, each sampling its share with the noise streams one process would use, and send their
// groups to every training rank in one byte exchange over all N ranks; each training rank keeps its share
// (rank_prompts), as if it had sampled it. With train.dynamic_sampling the rollout ranks sample its rounds
// and filter the groups; the batch carries the rounds' figures and the prompt stream's position.
//
// Checkpoints: the training ranks' files as in a colocated run. With one_step, the weights the pending
// rollout samples from are written by the first rollout rank beside the run folder before it sends the
// batch of a step that checkpoints, and rank 0 moves them into the checkpoint as rollout_weights, with the
// prompt stream's positions a colocated run records (its pending rollout has drawn its prompts): the
// checkpoint is a colocated one_step run's, and a run resumes with either placement.
//
// Handovers: one side waits through the other's whole phase (the rollout ranks through the training ranks'
// warm-up, evaluations, updates and checkpoints; the training ranks, in turn, through a rollout), longer
// than train.dist_timeout_s may be (with one_step, rank 0 publishing while the rollout ranks still sample,
// too). So a side first waits in the store for the other's word that it is
// ready (Handover), for as long as the ranks it waits for show signs of life, and only then joins the
// collective, which the other side has joined too: a collective's wait stays bounded by the timeout, and a
// rank that hangs is named once it has been silent that long.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "parallel/placement.h"
#include "trainer/dynamic_sampling.h"
#include "trainer/run.h"

namespace rlt {

// train.rollout_ranks = k over `world` ranks: at least one rank each side, the training ranks' shapes split
// as a data-parallel run's (check_world at N - k), and the step's prompts evenly over the rollout ranks.
// RunError naming the keys otherwise. Nothing for k = 0.
void check_placement(const Config& config, int world);

// The placement of a job over `all` (every rank calls it, in the same order): check_placement, then
// place_ranks (parallel/placement.h); nullptr when train.rollout_ranks is 0.
std::shared_ptr<Placement> place(const Config& config, const std::shared_ptr<Collectives>& all);

// Wrong placements the tests must reject: the rollout ranks keep sampling from the first weights they get
// (kStaleWeights), or each training rank trains on the first share of the batch (kOneShare); and a rollout
// rank that stops showing signs of life before its first batch, then goes on after 3 x train.dist_timeout_s
// (kSilent: the training ranks must name it).
enum class PlacementFault { kNone, kStaleWeights, kOneShare, kSilent };

// The training ranks' side: next() publishes the weights and returns this rank's share of the batch.
class RemoteRollouts : public PendingRollouts {
 public:
  // before_publish: a test's stand-in for a long phase on the training side (run before every publish).
  explicit RemoteRollouts(Run& run, PlacementFault fault = PlacementFault::kNone,
                          std::function<void()> before_publish = nullptr);
  // Step run.counters.step + 1's batch: publishes the weights as they are now (the first call of a fresh one_step run
  // publishes them twice: for the first two batches), then receives the batch.
  RolloutBatch next();
  // The step's figures: staleness_mean / staleness_max as train.async defines them; time_weight_sync_s (the
  // step's publishes' buckets, rank 0's), weight_sync_gbps (their bytes over that time), wait_rollout_s (the
  // update side waiting for the batch: the trajectory exchange, its transfer included), transfer_mb (the
  // step's trajectory records); of the rollout ranks' batch: time_rollout_wall_s (the first rollout rank's
  // sampling, scoring and gathering) and wait_update_s (how long it waited for the weights, the transfer
  // aside).
  std::map<std::string, double> metrics(const RolloutBatch& batch) const;
  void save(const std::string& dir, nlohmann::json& state) override;
  // train.dynamic_sampling: the rounds the rollout ranks sampled for the batch next() returned last.
  const SamplingRounds& rounds() const { return rounds_; }

 private:
  void publish();
  Run& run_;
  PlacementFault fault_;
  std::function<void()> before_publish_;
  int64_t publishes_ = 0;
  SamplingRounds rounds_;
  bool async_;
  bool published_ = false;
  double sync_s_ = 0, sync_bytes_ = 0, wait_s_ = 0, transfer_bytes_ = 0, rollout_wall_s_ = 0, wait_update_s_ = 0;
};

// The rollout ranks' side: samples, scores and sends every remaining step's batch (run.counters.step + 1 to the last
// step, or --stop-after), from the weights the training ranks publish.
// before_sample: a test's stand-in for a long rollout (run before every batch's sampling).
void serve_rollouts(Run& run, PlacementFault fault = PlacementFault::kNone,
                    const std::function<void()>& before_sample = nullptr);

// Where the first rollout rank leaves the weights a checkpoint's pending rollout samples from.
std::string staged_rollout_weights(const Run& run);

}  // namespace rlt
