// DAPO's dynamic sampling (Yu et al. 2025, "DAPO", section 3.2 and Algorithm 1) for GRPO: a group whose
// G rewards are all equal has zero advantage under a group baseline, so it adds no policy gradient and only
// dilutes the batch. A step samples rounds of P = train.prompts_per_step prompts (the stream's next P, as
// DAPO samples a whole generation batch a round), drops the equal-reward groups, and stops once P groups
// with varied rewards are kept or train.max_sampling_rounds rounds are spent. Varied groups beyond P are
// dropped, not carried into the next step.
//
// What it leaves out: carrying surplus groups over, and a batch of fewer than P groups. When the rounds run
// out with K < P groups kept, the batch keeps its P-group shape (the mini-batches, micro-batches and their
// rank split stay those of trainer/optim.h's step_shape): the P - K empty slots take dropped equal-reward
// groups with their loss masks zeroed, so they add nothing to the loss (policy term, KL, entropy) and no
// token to a denominator; see DynamicSampling::collect for what they still touch.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "parallel/dist.h"
#include "trainer/config.h"
#include "trainer/run.h"

namespace rlt {

// Rewards whose spread (max - min) within a group is at most this are equal. Rewards are O(1) scores (a
// correct answer 1, shaping in tenths, an overlong penalty of at least reward.overlong_penalty / L per
// token), so a spread of 1e-9 is rounding (a reward summed in another order), not signal; grpo's group
// scaling already treats a std below 1e-6 as none.
inline constexpr double kEqualRewardTol = 1e-9;

// Which of a step's groups have varied rewards: table (P * G, kTableColumns) float64, prompt-major (rows
// p * G .. p * G + G - 1 are group p); out (P), true = kept (max - min > kEqualRewardTol).
std::vector<bool> varied_groups(const at::Tensor& table, int64_t G);

// The decision rule of one round, (P * G, kTableColumns) table -> (P) kept; varied_groups unless a test
// passes another.
using GroupFilter = std::function<std::vector<bool>(const at::Tensor& table, int64_t G)>;

// What one step's dynamic sampling did. prompts_sampled = groups_filtered + groups_kept + groups_surplus.
struct SamplingRounds {
  int64_t rounds = 0;           // rounds sampled, 1 .. train.max_sampling_rounds
  int64_t prompts_sampled = 0;  // rounds * P: the prompts drawn from the stream this step
  int64_t groups_filtered = 0;  // groups with equal rewards: dropped (those filling empty slots included)
  int64_t groups_kept = 0;      // groups with varied rewards trained on: P, or fewer when the rounds ran out
  int64_t groups_surplus = 0;   // groups with varied rewards beyond P: dropped
  double sampled_accuracy = 0;  // the share of correct trajectories over every round (accuracy is the batch's)
};

class DynamicSampling {
 public:
  // From train.dynamic_sampling, max_sampling_rounds, prompts_per_step, mini_batch_size and
  // sampling.samples_per_prompt. prompts_per_mini: rank_prompts' unit, the prompts of a mini-batch (0), or
  // the step's (a rollout rank of train.rollout_ranks, whose ranks split the step contiguously).
  explicit DynamicSampling(const Config& config, int64_t prompts_per_mini = 0);

  // train.rollout_ranks: the figures of a batch the rollout ranks collected, as if collected here.
  void record(const SamplingRounds& rounds);

  // The step's rollout. train.dynamic_sampling off: collect_rollouts(run). On: rounds of
  // collect_rollouts(run), each drawing the stream's next P prompts (run.data.prompts->consumed() advances by P a
  // round, so a resumed run draws what the uninterrupted one did), then the selection below.
  RolloutBatch collect(Run& run);

  // The selection, over rounds from next_round: each a RolloutBatch as collect_rollouts makes it (this
  // rank's prompts of the round, rank_prompts, and the round's whole (P * G) table, every rank's rows).
  // Every decision reads the whole table, so every rank keeps the same groups, and the result is the one
  // process's: slot q of the step (its rows q * G .. q * G + G - 1 of the table) trains on the rank that
  // rank_prompts gives it, and a group sampled on another rank is sent there (two all_reduces a step).
  //   slots: with K = P groups kept, the kept groups in draw order (round, then prompt); with K < P, kept
  //     group i at slot floor(i P / K) (spread, so every mini-batch gets its share of them), and the
  //     dropped equal-reward groups, in draw order, in the other slots with their loss masks zeroed.
  //   rb.examples, rb.trajs (prompt_index: the local slot), rb.index, rb.table: those of the slots;
  //   rb.seconds and rb.stats: summed over the rounds.
  // Rank 0 warns on stderr, once per DynamicSampling, the first time the rounds run out with K < P.
  RolloutBatch collect(const std::function<RolloutBatch()>& next_round, Collectives& dist,
                       const GroupFilter& filter = varied_groups);

  // The figures of each collected batch wait, in collection order, until its step reports them: with
  // train.async one_step the next step's batch is collected (on the rollout thread) while this step
  // trains, so the step being trained is the oldest unreported batch. Thread-safe.
  //
  // The update's passes over the oldest unreported batch: num_iterations, or 0 when dynamic sampling kept
  // no group of it (the update is skipped: no optimizer step, so AdamW's momentum and weight decay do not
  // move the weights on a step with no gradient).
  int64_t iterations(int64_t num_iterations) const;
  // The oldest unreported batch's metrics, which are then reported (removed): groups_filtered, groups_kept,
  // groups_surplus, sampling_rounds, prompts_sampled, sampled_accuracy, update_skipped (1 when no group was
  // kept). Empty when off.
  std::map<std::string, double> metrics();

  bool enabled() const { return enabled_; }
  // The figures of the batch collected last (zeros before the first).
  SamplingRounds last() const;

 private:
  bool enabled_ = false;
  int64_t P_ = 0, G_ = 0, max_rounds_ = 1;
  int64_t prompts_per_mini_ = 0;  // global prompts per mini-batch: rank_prompts' unit
  mutable std::mutex mutex_;      // the rollout thread collects while the trainer reads (train.async)
  bool warned_ = false;
  SamplingRounds last_;
  std::deque<SamplingRounds> unreported_;
};

}  // namespace rlt
