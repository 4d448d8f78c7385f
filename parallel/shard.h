// The training state split over a run's ranks: ZeRO's stages (Rajbhandari et al. 2020) on the c10d
// collectives of parallel/dist.h (train.shard), and the optimizer state in host memory (train.offload).
//
// The trainable tensors (the policy's, or its LoRA adapters, then the extra ones: PPO's value head) are grouped into
// units: one per decoder layer, one per other tensor. A unit's elements, laid end to end and padded with zeros to a
// multiple of the world size, split into N equal chunks; rank r owns chunk r of every unit. What a rank
// holds per parameter, with P parameters over N ranks (bf16 model, fp32 masters):
//   optimizer:  the whole bf16 weights (2), a whole fp32 gradient accumulated over the micro-batches (4),
//               and its chunk of fp32 masters and AdamW moments (12/N). The gradient is reduce-scattered
//               once per optimizer step, unit by unit, as the last micro-batch's backward produces it.
//   gradients:  the whole weights (2), and its chunks of the gradient, masters and moments (16/N): every
//               micro-batch's backward reduce-scatters each unit as soon as its gradients are complete and
//               frees them, so a rank accumulates only its fp32 gradient chunk.
//   parameters: its chunk of the weights too (18/N). A layer's weights are all-gathered before its
//               forward (the next layer's gather already started) and freed after it, then gathered again
//               for its backward, which recomputes it (model.activation_checkpointing); the embedding,
//               final norm and head are gathered for a whole micro-batch. The rollout gathers every layer
//               once and frees them before the update, unless rollout.keep_weights keeps them.
// ZeRO's formulas count a 2-byte gradient (4 + 12/N, 2 + 14/N, 16/N); the gradient here is accumulated
// in fp32 over the micro-batches and summed over the ranks in fp32, as the replicated run does it.
// After an optimizer step each rank rounds its master chunk to the model's dtype and the chunks are
// all-gathered into the whole weights (the parameters stage keeps its chunk only).
//
// The global gradient norm is the square root of the sum over ranks of each chunk's sum of squares; the
// loss denominators are the replicated run's (trainer/optim.h, which calls step()), so the update equals it up to the
// order of floating-point sums (the CPU tests: within 1e-6 relative over 3 steps, 2 and 3 ranks).
//
// train.offload: optimizer keeps the master chunks and moments in pinned host memory and steps them there
// (parallel/adamw.h); the device holds the gradient chunk and the weights.
//
// Checkpoints hold the state per parameter, not per rank: each rank writes its pieces of every parameter
// (optimizer-<rank>.safetensors: "master/<name>/<first element>", "exp_avg/...", "exp_avg_sq/..."), so a
// run resumes with another number of ranks or another stage by reading the pieces that overlap its chunks.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "model/safetensors.h"
#include "model/transformer.h"
#include "parallel/dist.h"
#include "parallel/options.h"
#include "parallel/parking.h"

namespace rlt {

class OffloadedAdamW;
class ShardedState;

// The optimizer state of a checkpoint, per parameter, as pieces: "<kind>/<name>/<first element>" in every
// optimizer-*.safetensors of a folder, kind master (the fp32 values AdamW updates), exp_avg or exp_avg_sq.
// Written by ShardedState and by the replicated optimizer alike (trainer/checkpoint.cpp), so either reads
// the other's.
class OptimizerPieces {
 public:
  explicit OptimizerPieces(const std::string& dir);  // no files: empty()
  bool empty() const { return readers_.empty(); }
  // Fills dest (count elements of `name` from `begin`, flat) from the pieces that cover it; false when
  // some element is covered by none.
  bool read(const std::string& kind, const std::string& name, int64_t begin, const at::Tensor& dest) const;
  static std::string key(const std::string& kind, const std::string& name, int64_t begin);

 private:
  struct Stored {
    int64_t begin, count;
    size_t reader;
    std::string key;
  };
  std::vector<safetensors::Reader> readers_;
  std::map<std::string, std::vector<Stored>> index_;  // "<kind>/<name>" -> its pieces
};

// ShardedState::gather_weights() for a scope; nothing without a sharded state. Every rank makes one at
// the same point (the parameters stage gathers with a collective).
class GatheredWeights {
 public:
  explicit GatheredWeights(const std::shared_ptr<ShardedState>& s);
  ~GatheredWeights();
  GatheredWeights(const GatheredWeights&) = delete;
  GatheredWeights& operator=(const GatheredWeights&) = delete;

 private:
  std::shared_ptr<ShardedState> s_;
};

// Deliberate mistakes, for the tests: each equivalence test runs one and must see the result differ.
// kReducesUnbounded gives each reduce buffers of its own and waits for none until the backward ends: the
// results are right and the memory is not (a test of the reduces in flight must see it).
enum class ShardFault {
  kNone,
  kReduceTwice,
  kNeverReduce,
  kSliceOffByOne,
  kAverage,
  kMomentWrongSlice,
  kReducesUnbounded
};

// What a sharded state is told once: its stage and offload (train.shard, train.offload), whether the
// parameters stage keeps the gathered weights through the update (rollout.keep_weights), and whether this
// rank prints the run's warnings.
struct ShardOptions {
  ShardStage stage = ShardStage::kNone;
  Offload offload = Offload::kNone;
  bool keep_weights = false;
  bool lead = true;
  OffloadMode offload_step = OffloadMode::kHostStep;  // where train.offload's optimizer steps
};

// One optimizer step's settings: AdamW's for the policy's group (its step count is the counters'), the
// extra group's learning rate (no weight decay there), and the global-norm clip (0: none).
struct StepSettings {
  double lr = 0, extra_lr = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0, grad_clip = 0;
};

class ShardedState : public WeightResidency {
 public:
  // The reduces a backward keeps in flight, each in a slot of its own (see in_flight_ below).
  static constexpr size_t kReduceSlots = 2;
  // Takes `params` (the model's trainable tensors by name, then `extra`, a second parameter group) and
  // their values as they are now; with the parameters stage the model's weights are freed to their chunks
  // (`model` asks this object for them, until this object is gone). `dist`, `model` and `counters` are
  // held by reference, so they must outlive this object where they are (the trainer's Run is built in
  // place and never moved): step() reports into the counters. `fault`: a deliberate mistake, for the tests
  // only.
  ShardedState(const ShardOptions& options, Collectives& dist, Transformer& model,
               const std::vector<std::pair<std::string, at::Tensor>>& extra, StepCounters& counters,
               ShardFault fault = ShardFault::kNone);
  ~ShardedState() override;
  ShardedState(const ShardedState&) = delete;
  ShardedState& operator=(const ShardedState&) = delete;

  // One micro-batch's backward. `ends_step`: the last before an optimizer step (the optimizer stage
  // reduces then only).
  void backward(const at::Tensor& loss, bool ends_step);
  // Ends an optimizer step as apply_gradients does (trainer/optim.h): global norm, clip, the finite check
  // on the norm and the ranks' summed `loss`, AdamW on every chunk, the weights rebuilt. Counts the step in
  // counters.optimizer_steps, or a non-finite one in counters.skipped_steps. Returns the norm.
  double step(const at::Tensor& loss, const StepSettings& settings);
  void zero_grad();

  // The parameters stage: every layer's weights gathered and kept until release_weights() (the rollout,
  // an evaluation, a save); the other stages hold them anyway. Calls nest.
  void gather_weights();
  void release_weights();
  // The masters (and weight chunks) from the tensors' values now: after the warm-up trained them.
  void load_from_model();

  // This rank's pieces into dir/optimizer-<rank>.safetensors; and back, from every optimizer-*.safetensors
  // in dir, whatever the stage and world that wrote them (RunError naming a parameter no piece covers).
  void save(const std::string& dir) const;
  void load(const std::string& dir);

  // What train.phase_offload takes off the device for the rollout. `moved` go to host memory and come
  // back: the fp32 masters and AdamW moments this rank holds on the device (none under train.offload, whose
  // state lives in host memory). `zeroed`: the gradient chunks, all zero between steps (a backward since
  // the last step moves them); they are in one of the two unless train.offload holds the optimizer state
  // and not `training_state`. `chunks`, with `training_state`: the weight chunks in the model's dtype,
  // where nothing gathers from them meanwhile: every stage but parameters, or its weights gathered already
  // (or, `whole`, by the caller before it parks them: the layout of a later park).
  PhaseTensors phase_tensors(bool training_state, bool whole = false) const;

  // Bytes this rank holds for the state: on the device (gradient chunks or whole gradients, masters and
  // moments unless offloaded, the weight chunks of the parameters stage) and in host memory (offload).
  int64_t device_bytes() const;
  int64_t host_bytes() const;
  // Seconds spent waiting for the reduce-scatters and all-gathers.
  double comm_seconds() const { return comm_s_; }
  ShardStage stage() const { return stage_; }

  // WeightResidency (the parameters stage; otherwise nothing to do).
  void acquire(int64_t layer, bool backward) override;
  void release(int64_t layer) override;

  // The pieces a rank owns, for the tests: (parameter index, first element, count, offset in its group's
  // flat chunk). Exposed so a test can check every element is owned exactly once.
  struct Piece {
    size_t param;
    int64_t begin, count, flat;
  };
  std::vector<Piece> pieces() const;

 private:
  struct Param {
    std::string name;
    at::Tensor leaf;
    std::vector<int64_t> shape;
    int64_t numel = 0, offset = 0;  // within its unit
    size_t unit = 0;
  };
  struct Unit {
    std::vector<size_t> params;
    int64_t numel = 0, chunk = 0;  // chunk: elements per rank (numel padded to world x chunk)
    int group = 0;                 // 0: the model's; 1: the extra ones (its own learning rate, no decay)
    int64_t layer = -1;            // decoder layer, -1: the embedding / final norm / head, -2: an extra tensor
    int64_t flat = 0;              // offset of this rank's chunk in its group's flat tensors
    size_t remaining = 0;          // gradients not yet complete in this backward
    bool started = false, resident = true;
    at::Tensor reduce_in, reduce_out;  // fp32 (world x chunk, chunk), views of a reduce slot, while its
                                       // reduce-scatter runs
    std::unique_ptr<Pending> reduce_pending;
    at::Tensor gather_buf;  // the parameters stage: (world x chunk) while gathered or gathering
    std::unique_ptr<Pending> gather_pending;
  };
  struct Group {
    at::Tensor master, grad, exp_avg, exp_avg_sq;  // fp32 flat chunks of its units
    at::Tensor weights;  // the masters rounded to the model's dtype: all-gather input, the parameters stage's chunks
    std::unique_ptr<OffloadedAdamW> offload;
  };

  void ready(size_t i);
  void start_ready_units();
  void start_reduce(Unit& u);
  void finish_backward();
  // Waits for the oldest reduce in flight (NCCL's wait with the run's timeout holds the host until it is
  // done) and adds its result into the rank's fp32 gradient chunk, which frees its slot.
  void finish_oldest_reduce();
  at::Tensor unit_chunk(const at::Tensor& flat, const Unit& u) const { return flat.narrow(0, u.flat, u.chunk); }
  // Every unit's rounded chunk all-gathered into the leaves (extra_only: the extra tensors' units only).
  void write_whole_weights(bool extra_only = false);
  void start_gather(Unit& u);
  void install(Unit& u);  // waits for its gather; the leaves become views of it
  void free_weights(Unit& u);
  void acquire_unit(Unit& u);
  std::vector<size_t> units_of_layer(int64_t layer) const;

  Collectives& dist_;
  Transformer* model_;  // the parameters stage: the model whose residency this is
  StepCounters& counters_;
  bool lead_ = true;
  ShardStage stage_;
  int world_ = 1, rank_ = 0;
  at::ScalarType weight_dtype_ = at::kFloat;
  std::vector<Param> params_;
  std::vector<Unit> units_;  // in the order their reductions start (the backward's order)
  std::vector<Group> groups_;
  std::vector<at::Tensor> accum_;  // the optimizer stage: whole fp32 gradients over the micro-batches
  std::vector<bool> done_;         // per parameter, in the backward that reduces
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> hook_keys_;
  size_t next_unit_ = 0;
  // The reduces in flight (unit indices, oldest first) and the buffers they use: kReduceSlots pairs of an
  // fp32 whole (world x chunk) and its reduced chunk, taken in turn. A reduce waits for the oldest once
  // every slot is busy, so a backward holds kReduceSlots unit-sized buffers however far the host runs
  // ahead of the device: buffers freed as each reduce starts stay allocated until NCCL's stream is done
  // with them, and with the host ahead that was most of a gradient. They live from a step's first backward
  // to its optimizer step (kReduceSlots, public: the memory plan counts them).
  std::deque<size_t> in_flight_;
  std::vector<at::Tensor> slot_in_, slot_out_;
  size_t next_slot_ = 0;
  int64_t largest_chunk_ = 0;     // the largest unit's chunk: the reduce slots and the all-gather buffer fit it
  at::Device device_ = at::kCPU;  // the model's: where the state lives unless parked or offloaded
  bool collecting_ = false;       // a backward of this object's is running: the hooks take its gradients
  bool reducing_ = false;         // the running backward reduces its gradients
  bool grads_zero_ = true;        // every gradient chunk is zero: no reduce has added into one since zero_grad
  int pinned_ = 0;                // gather_weights() depth
  double comm_s_ = 0;
  int shard_world_ = 1;  // ranks the state is split over: 1 with shard none (offload alone)
  bool keep_ = false;    // rollout.keep_weights
  ShardFault fault_ = ShardFault::kNone;
};

}  // namespace rlt
