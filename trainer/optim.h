// The optimizer side of a step, shared by GRPO, PPO and the warm-up: AdamW over the policy (and a second
// parameter group for run.model.extra), its learning-rate schedule, the micro-batch ranges of gradient
// accumulation and their loss denominator, and the end of an optimizer step (clip, finite check, step).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "parallel/adamw.h"
#include "parallel/grad_reducer.h"
#include "parallel/shard.h"
#include "trainer/batch.h"
#include "trainer/run.h"

namespace rlt {

// A torch::optim::AdamW over model.policy's trainable parameters at `lr` (or, for a bf16 model with
// train.master_weights fp32, their fp32 master copies, made into model.master), then model.extra's (a second
// group at extra_lr, no weight decay); AdamW's settings from `t`.
void make_replicated_optimizer(ModelState& model, const TrainOptions& t, double lr, double extra_lr);

// One AdamW: the policy's parameters (or, for a bf16 model with train.master_weights fp32, their fp32
// master copies in run.model.master), then run.model.extra's (a second group at its own learning rate).
void make_optimizer(Run& run, const ExtraParams& extra);

// The run's sharded state (train.shard, train.offload) over its policy and extra tensors, reporting into
// its counters. `fault`: a deliberate mistake, for the tests only (parallel/shard.h).
std::shared_ptr<ShardedState> make_sharded_state(Run& run, ShardFault fault = ShardFault::kNone);

// Clears the gradients an optimizer step accumulates (the sharded state's, or AdamW's).
void zero_gradients(ModelState& model);

// The tensors AdamW updates, in its order: model.master (or the policy's parameters), then model.extra's.
// Gradient clipping reads their gradients.
std::vector<at::Tensor> optimizer_params(const ModelState& model);

// Call after each backward: with master weights, adds the policy's bf16 gradients into the fp32 master
// gradients and releases the bf16 ones, so micro-batches accumulate in fp32. Nothing otherwise.
void accumulate_gradients(ModelState& model);

// The run's reducer (train.dist_bucket_mb) when it has several ranks and no sharded state (which reduces
// its own); none for one process.
std::unique_ptr<GradReducer> make_reducer(Run& run);
// The same for any model state over `dist`'s ranks (PPO's separate critic), with buckets of bucket_bytes.
std::unique_ptr<GradReducer> make_reducer(const ModelState& model, Collectives& dist, int64_t bucket_bytes);

// One micro-batch's backward. `ends_step`: the last before an optimizer step; with a reducer (several
// ranks) its gradients are summed over the ranks as the backward produces them. Then
// accumulate_gradients.
void backward(Run& run, const at::Tensor& loss, GradReducer* reducer, bool ends_step);
void backward(ModelState& model, const at::Tensor& loss, GradReducer* reducer, bool ends_step);

// Seconds the update has waited for its collectives so far: the reducer's, or the sharded state's.
double update_comm_seconds(const ModelState& model, const GradReducer* reducer);

// With master weights: the bf16 weights the model computes with become the masters, rounded to nearest.
// Whatever trains model.master (the RL optimizer, the warm-up) calls it after each step.
void copy_master_weights_to_model(ModelState& model);

// The driver of train.offload's optimizer: train.offload_step as set; auto: the device when the run is on
// CUDA and more than one of its ranks share a host (`ranks_on_host`: the most on any of its hosts), whose
// host steps would share the host's memory bandwidth.
OffloadMode offload_mode(OffloadStep step, bool cuda, int ranks_on_host);

// Bytes the optimizer holds beside the model: master weights, their gradients and AdamW's two moments
// (for every parameter it updates, model.extra included); with model.sharded, what it holds on the device.
int64_t optimizer_memory_bytes(const ModelState& model);

// train.phase_offload: what leaves the device while the rollout runs: the fp32 masters and AdamW's moments,
// a sharded state's gradient chunks (zeros then: freed, not copied), and with training_state its weight
// chunks (ShardedState::phase_tensors). The weights the rollout decodes stay.
PhaseTensors phase_offload_tensors(const ModelState& model, PhaseOffload mode);
// The tensors phase_offload_tensors moves once the optimizer has stepped, in its order (the replicated
// AdamW makes its moments at its first step: here, tensors of their shape), `whole` when its weights are
// gathered while parked: what PhaseParking::reserve makes host buffers for before the first rollout.
std::vector<at::Tensor> phase_offload_layout(const ModelState& model, PhaseOffload mode, bool whole);
// train.phase_offload: the host buffers of the policy and a separate critic made on threads of their own,
// beside the warm-up (begin_training calls it; PPO again once its critic exists).
void reserve_phase_offload(Run& run);

// train.phase_offload for the scope's life (a step's rollout, an evaluation): the policy's and a separate
// critic's phase_offload_tensors in pinned host memory, back on the device when it ends. Under
// training_state with train.shard parameters the policy's weights are gathered once the optimizer state
// has left (the rollout decodes them whole anyway), then its chunks leave; when the scope ends the
// gathered weights are freed before anything comes back. Each move ends with a device synchronisation,
// and their seconds (the gather's not) add to run.metrics.phase_moves_s. Nothing with
// train.phase_offload none, on a rollout rank, or inside another such scope. Bringing the state back can
// fail (no device memory for it): the destructor then throws, unless the scope ends by an exception
// already, which it lets through after reporting its own on stderr.
class ParkedTrainingState {
 public:
  explicit ParkedTrainingState(Run& run);
  ~ParkedTrainingState() noexcept(false);
  ParkedTrainingState(const ParkedTrainingState&) = delete;
  ParkedTrainingState& operator=(const ParkedTrainingState&) = delete;

 private:
  Run* run_ = nullptr;                      // set while this scope holds the state parked
  std::unique_ptr<GatheredWeights> whole_;  // training_state, shard parameters: held across the scope
  int exceptions_ = 0;                      // std::uncaught_exceptions() when the scope began
};

class PhasePeaks;
// The step's rollout, `collect`, with train.phase_offload's state parked meanwhile (ParkedTrainingState),
// each part a phase of `peaks`: with phase_offload, park (the moves out) and unpark (the moves back) on either
// side of the rollout, so the rollout's peak is measured with the state parked.
RolloutBatch parked_rollout(Run& run, PhasePeaks& peaks, const std::function<RolloutBatch()>& collect);

// torch::optim::AdamW::step over opt's groups as multi-tensor ops (adamw_step_tensors in
// parallel/adamw.h): the same state, made at a parameter's first step and counted per parameter (the
// parameters of a group that share a count step together), and the same weights, in a few kernels a round
// where opt.step() launches nine a tensor. Parameters without a gradient are skipped, as opt.step() skips
// them. amsgrad is refused.
void step_multi_tensor(torch::optim::AdamW& opt);
// The gradients of `params` (those without one skipped) clipped to the global norm max_norm as
// torch::nn::utils::clip_grad_norm_ clips them, in multi-tensor ops (clip_grad_norm_tensors); returns the
// norm. max_norm may be +inf.
double clip_gradients(const std::vector<at::Tensor>& params, double max_norm);

// The learning rate at optimizer step `step` (0-based) of `total`.
double learning_rate(const TrainOptions& o, int64_t step, int64_t total);
// Sets the policy group's learning rate to lr and the extra group's to lr * extra_lr_scale.
void set_learning_rate(torch::optim::AdamW& opt, double lr, double extra_lr_scale = 1.0);

// A step's batch sizes: S = prompts_per_step x samples_per_prompt trajectories, optimizer steps over
// mini-batches of `mini` (train.mini_batch_size, 0 = all S), forward/backward over micro-batches of
// `micro`, and the optimizer steps of the whole run (the learning-rate schedule's length). Over `world`
// ranks, S and mini are one rank's share (check_world: they split evenly); micro is per rank.
struct StepShape {
  int64_t S = 0, mini = 0, micro = 0, total_optimizer_steps = 0;
};
StepShape step_shape(const Config& config, int world = 1);

// Micro-batch ranges [begin, end) over S sequences: mini-batches of `mini`, each split into `micro`;
// a range never crosses a mini-batch boundary.
std::vector<std::pair<int64_t, int64_t>> micro_batch_ranges(int64_t S, int64_t mini, int64_t micro);

// Micro-batch ranges under a token budget (train.micro_batch_tokens): mini-batches of `mini` sequences as
// above, each cut where one more sequence would take its micro-batch past `budget` tokens or past `micro`
// rows; a sequence longer than the budget makes a micro-batch of its own. A micro-batch's tokens, lengths[i]
// a sequence: padded, its rows times its longest sequence; packed (train.pack_sequences), their sum,
// less shared[i] (empty: none) for each sequence after the first, the prompt tokens it takes from the one
// before (train.share_prompts). Sharing, a micro-batch's keys (what attention gathers: its summed
// lengths, each answer's prompt counted, and each run's prompt once more for its own sequence) also stay
// within kSharedKeysPerToken x budget, unless one sequence passes it. budget 0: micro_batch_ranges(lengths.size(),
// mini, micro).
constexpr int64_t kSharedKeysPerToken = 4;
std::vector<std::pair<int64_t, int64_t>> micro_batch_ranges(const std::vector<int64_t>& lengths, int64_t mini,
                                                            int64_t micro, int64_t budget, bool packed = false,
                                                            const std::vector<int64_t>& shared = {});

// Data parallelism with token-balanced ranks (train.balance_tokens): every rank's k-th mini-batch of `mini`
// sequences makes one of the step's, whose sequences are dealt over the ranks again, longest first (ties:
// by rank, then position), each to the rank with the fewest tokens of those short of their count (ties:
// the lower rank); each rank keeps as many sequences as it had, and the ranks' tokens differ by at most the
// longest sequence's. lengths[r]: rank r's sequences' tokens, in its order (the same count on every rank).
// Returns, per rank, the (rank, position) of each sequence it takes, mini-batch by mini-batch, in deal order.
std::vector<std::vector<std::pair<int, int64_t>>> deal_by_tokens(const std::vector<std::vector<int64_t>>& lengths,
                                                                 int64_t mini);

// The update's view of a step's batch: its trajectories and their places among the step's (rb.index), in
// the order the update takes them, and its micro-batch ranges over that order. With a token budget
// (train.micro_batch_tokens > 0), each mini-batch's sequences go longest first (stable), so that budgeted
// micro-batches hold sequences of like length; a mini-batch keeps its sequences, so its loss and its
// denominator are unchanged. Without one, the batch's own order and micro_batch_size ranges. With
// `balance` over several ranks, each mini-batch first takes the sequences deal_by_tokens gives this rank
// (the others' sent between the ranks, places and all), longest first: every step-wide mini-batch keeps its
// sequences, so the step's loss and gradient are unchanged, and no rank waits on a longer share. With
// `share` (packed: train.share_prompts), the sort keeps a prompt's answers together (its group by the
// group's tokens, then each answer longest first; it runs under balance too), and a budget counts each
// prompt once a micro-batch.
struct UpdateBatch {
  const std::vector<Trajectory>& trajs() const { return reordered_.empty() ? *source_ : reordered_; }
  std::vector<int64_t> index;
  std::vector<std::pair<int64_t, int64_t>> micro_ranges;
  // Each micro-range packed on `device` in the layout update_batch was given (packed, sharing prompts).
  std::vector<PackedBatch> micro_batches(at::Device device) const;

 private:
  friend UpdateBatch update_batch(const RolloutBatch& rb, int64_t mini, int64_t micro, int64_t budget, bool packed,
                                  bool share, Collectives* balance);
  const std::vector<Trajectory>* source_ = nullptr;
  std::vector<Trajectory> reordered_;
  bool packed_ = false, share_ = false;
};
UpdateBatch update_batch(const RolloutBatch& rb, int64_t mini, int64_t micro, int64_t budget, bool packed = false,
                         bool share = false, Collectives* balance = nullptr);

// The denominator of mini-batch [begin, end) for aggregate_loss's global_denominator, so the
// micro-batch losses add up to the mini-batch loss (see LossAgg in loss/policy_loss.h).
double mini_batch_denominator(const std::vector<Trajectory>& trajs, int64_t begin, int64_t end, LossAgg agg);
// The denominator of each of this rank's mini-batches ([0, mini), [mini, 2 mini), ... of trajs) when
// every rank's k-th mini-batch makes one: tokens and sequences summed over the ranks first, so each rank's
// loss is its share of the one-process loss.
std::vector<double> mini_batch_denominators(const std::vector<Trajectory>& trajs, int64_t mini, LossAgg agg,
                                            Collectives& dist);

// Ends one optimizer step whose gradients have been accumulated: clips the global norm (train.grad_clip),
// and applies AdamW at the schedule's learning rate only when `loss` () and the norm are finite; otherwise
// zeroes the gradients and counts the step in run.counters.skipped_steps (never applied). With master weights it
// first takes any bf16 gradients still pending (accumulate_gradients), and after the step rounds the
// masters into the bf16 parameters. Returns the norm. The one host sync of an optimizer step: clipping
// needs the norm on the host, and the finite check rides on it. Over several ranks the gradients are
// already summed (GradReducer), so the norm is the global one; the loss is summed too, so every rank
// skips or steps alike.
double apply_gradients(Run& run, const at::Tensor& loss, int64_t total_optimizer_steps);

// What apply_gradients does, for any model state of the run (the policy's, PPO's separate critic's): the
// step's loss (the finite check) and learning rate (model.extra's group at lr * model.extra_lr_scale), the
// counters it counts into, and the word a skipped step's warning names (the lead rank prints it, with the RL
// step). AdamW's settings and the clip are train's.
double step_optimizer(Run& run, ModelState& model, StepCounters& counters, const at::Tensor& loss, double lr,
                      const char* what);

}  // namespace rlt
