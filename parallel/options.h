// What the parallel floor's classes take instead of a run: the training state's split (train.shard) and
// offload (train.offload), and the counters an optimizer step reports into.
#pragma once

#include <cstdint>

#include "common/fields.h"

namespace rlt {

// How the training state (bf16 weights, gradients, fp32 masters, AdamW moments) is split over the ranks:
// ZeRO's stages (parallel/shard.h). none: every rank holds all of it (16 bytes a parameter); optimizer:
// masters and moments split (4 + 12/N); gradients: gradients too, reduce-scattered during the backward
// (2 + 14/N); parameters: the weights too, gathered a layer at a time (16/N).
enum class ShardStage { kNone, kOptimizer, kGradients, kParameters };
inline const EnumNames<ShardStage>& enum_names(ShardStage) {
  static const EnumNames<ShardStage> names{{"none", ShardStage::kNone},
                                           {"optimizer", ShardStage::kOptimizer},
                                           {"gradients", ShardStage::kGradients},
                                           {"parameters", ShardStage::kParameters}};
  return names;
}

// Where the optimizer's masters and moments live: on the device, or in pinned host memory, stepped there.
enum class Offload { kNone, kOptimizer };
inline const EnumNames<Offload>& enum_names(Offload) {
  static const EnumNames<Offload> names{{"none", Offload::kNone}, {"optimizer", Offload::kOptimizer}};
  return names;
}

// OffloadedAdamW's two drivers (parallel/adamw.h), both over masters and moments in pinned host memory:
// kHostStep, all of the host's cores step them (the gradient comes down and the weights go up, 6 bytes an
// element over PCIe; host memory bandwidth, shared by every rank of a host, is the limit); kStreamDevice,
// they stream through the GPU in chunks (24 bytes an element over the rank's own PCIe link).
enum class OffloadMode { kHostStep, kStreamDevice };

// train.offload_step: which driver steps train.offload's optimizer. auto: the device when several ranks of
// the run share a host (their host steps would share its memory bandwidth), the host otherwise.
enum class OffloadStep { kAuto, kHost, kDevice };
inline const EnumNames<OffloadStep>& enum_names(OffloadStep) {
  static const EnumNames<OffloadStep> names{
      {"auto", OffloadStep::kAuto}, {"host", OffloadStep::kHost}, {"device", OffloadStep::kDevice}};
  return names;
}

// What leaves the device while the rollout runs (train.phase_offload), moved to pinned host memory and back
// before the update: nothing; the optimizer's fp32 masters and AdamW moments (and a sharded state's
// gradient chunks, zeros between steps: freed, not copied); or the training state, which adds the sharded
// state's weight chunks (and its gradient chunks under train.offload, whose optimizer lives on the host).
enum class PhaseOffload { kNone, kOptimizer, kTrainingState };
inline const EnumNames<PhaseOffload>& enum_names(PhaseOffload) {
  static const EnumNames<PhaseOffload> names{{"none", PhaseOffload::kNone},
                                             {"optimizer", PhaseOffload::kOptimizer},
                                             {"training_state", PhaseOffload::kTrainingState}};
  return names;
}

// The optimizer's clock and its misses, owned by the run and reported into by whatever steps the
// optimizer (trainer/optim.h's apply_gradients, ShardedState::step); a checkpoint keeps them.
struct StepCounters {
  int64_t step = 0;             // RL steps done
  int64_t optimizer_steps = 0;  // optimizer steps done (the schedule's clock)
  int64_t skipped_steps = 0;    // optimizer steps skipped for a non-finite loss or gradient
};

}  // namespace rlt
