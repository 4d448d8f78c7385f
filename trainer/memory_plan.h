// The memory a run needs on each rank, planned from the config and the model's shape before anything is
// allocated: the run prints the plan at its start (MemoryPlan::table) and refuses, before step 1, a plan
// that exceeds the device (check_memory_plan), naming what would fit instead.
//
// A step has two phases that never hold their working sets at once: the rollout (the KV cache and the
// rollout's weight copies) and the update (gradients and one micro-batch's activations). Weights, fp32
// masters, AdamW's moments and the reference policy live through both. rollout.keep_cache (and
// rollout.keep_weights under train.shard parameters) keep the rollout's part through the update.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <string>

#include "model/config.h"
#include "trainer/config.h"

namespace rlt {

struct MemoryPlan {
  // Per rank, bytes.
  int64_t weights = 0;           // the model in its dtype (its shard and a gathered layer under shard
                                 // parameters), plus the LoRA adapters in fp32
  int64_t gradients = 0;         // the gradients the optimizer steps on
  int64_t grad_buffers = 0;      // the backward's gradients before they reach those: the model-dtype ones
                                 // awaiting the fp32 sum, or the fp32 wholes awaiting the reduce-scatter
  int64_t masters = 0;           // fp32 master weights of a bf16 model
  int64_t moments = 0;           // AdamW's two moments
  int64_t optimizer_step = 0;    // the optimizer step's temporaries: its denominator over a round, the norm's
  int64_t reference = 0;         // the reference policy (objective.kl_coef > 0)
  int64_t rollout_weights = 0;   // the rollout's packed q/k/v and gate/up, its merged LoRA projections, the
                                 // weights it gathers under shard parameters
  int64_t kv_cache = 0;          // every cache row at rollout.max_context
  int64_t graph_pool = 0;        // the memory pool the rollout's CUDA graphs share (graph_pool_bytes)
  int64_t activations = 0;       // one micro-batch's forward/backward, the loss module's working set included
  int64_t host_optimizer = 0;    // train.offload optimizer: masters and moments in pinned host memory
  int64_t host_rounding = 0;     // what the pages add to those and to `parked`'s buffers: each buffer is
                                 // whole pages of host memory (pinned_host_zeros)
  int64_t reward_model = 0;      // reward.kind model: its weights in model.dtype and one scoring forward
  int64_t critic = 0;            // PPO's separate critic (critic.shared false): its weights, masters and
                                 // moments at critic.shard's stage, and a sharded state's gradients
  int64_t critic_gradients = 0;  // its gradients (but a sharded state's, in `critic` where they persist) and
                                 // gradient buffers, through the update
  int64_t workspaces = 0;        // cuBLAS's, kept for the process: cublas_workspace_pairs x
                                 // cublas_workspace_bytes (common/memory.h)
  // train.phase_offload: of masters, moments and the critic's (with training_state the sharded weight
  // chunks too), what leaves the device while the rollout runs (in pinned host memory then): counted in
  // the update's phase, not in both.
  int64_t parked = 0;
  // Of rollout_weights + kv_cache + graph_pool, what stays allocated through the update (rollout.keep_cache,
  // rollout.keep_weights).
  int64_t held_through_update = 0;
  // train.async: the rollout runs beside the update, so the two phases add up instead of taking turns.
  bool phases_overlap = false;
  // The sharded state's (train.shard, train.offload) fp32 gradient chunk lives through both phases, made with
  // the state, unless train.phase_offload frees it while the rollout runs. The replicated optimizer's
  // gradients exist only in the update.
  bool gradients_persist = false;

  // The model's parameters, the ones the optimizer updates, and the ranks the plan is for.
  int64_t parameters = 0, trainable = 0;
  int world = 1;

  // Both phases: weights, masters, moments, the reference, the reward model, the critic, persisting
  // gradients and cuBLAS's workspaces, plus the larger of the rollout's part (rollout_weights + kv_cache + graph_pool)
  // and the update's: the other gradients (the critic's too), what train.phase_offload parks during the rollout, what
  // the rollout keeps, and the larger of a backward's (activations, gradient buffers) and the optimizer step's
  // temporaries (the step follows the last backward). A separate critic's forward and backward follow the policy's
  // backward, so `activations` is the larger of the two.
  int64_t persistent() const {
    return weights + masters + moments + reference + reward_model + critic + (gradients_persist ? gradients : 0) +
           workspaces - parked;
  }
  int64_t rollout_phase() const { return rollout_weights + kv_cache + graph_pool; }
  int64_t update_phase() const {
    const int64_t backward = activations + grad_buffers;
    return (gradients_persist ? 0 : gradients) + critic_gradients + parked + held_through_update +
           (backward > optimizer_step ? backward : optimizer_step);
  }
  int64_t device_total() const;
  // Pinned host memory per rank: train.offload's masters and moments, and the buffers that hold what
  // train.phase_offload parks (made before the first rollout, kept), in whole pages.
  int64_t host_total() const { return host_optimizer + parked + host_rounding; }
  // The lines the run prints: one per item in GiB with two decimals, then the device total (and the pinned
  // host memory, where the run pins any).
  std::string table() const;
};

// reward.kind model: the bytes MemoryPlan::reward_model counts (0 without a model term).
int64_t reward_model_bytes(const Config& c);

// The memory pool that DecodeEngine's CUDA graphs share (rollout.cuda_graphs on a CUDA device; 0
// otherwise), for a cache of `rows` rows: as large as the largest captured forward's working set, which the
// LM head's float32 logits dominate. A decode step draws at every cache row; a speculative rollout's
// verifying forward at up to rollout.speculative_max_rows rows (a power of two of at least 8, at most the
// cache's) x its bucket of positions (2, 4 or 8: the draft and the token before it). Two float32
// tensors of positions x vocabulary (the logits and the log-prob's working copy) and kGraphPoolTemporaries
// for the layers' temporaries, which the allocator holds in segments of 2 and 20 MiB. On an H200, with
// every capture on one stream, the pools held one such tensor and 3-64 MiB more at 16 to 256 rows: a
// two-layer model's (MemoryPlan.GraphPoolCoversTheEnginesOnCuda), the 0.5B's and the 7B's (bench_model's
// graph_pool_mb: 22, 60, 176 and 22, 64, 212 MiB at 16, 64, 256 rows). The second tensor is the rollout
// phase's margin: a pool counted as measured (one tensor, 24 MiB of segments and twice a layer's
// temporaries a position) would plan the rollout phases of docs/benchmarks.md's plan-against-peak table
// 0.0-0.5% under their peaks, whose 8-14 MiB beyond the pool no term places. The multi-token feeds' and
// merged passes' graphs (rollout.feed_graphs, rollout.merge_feeds, off by default) are not counted.
constexpr int64_t kGraphPoolTemporaries = int64_t(96) << 20;
int64_t graph_pool_bytes(const Config& c, const ModelConfig& m, int64_t rows);

// The (cuBLAS handle, stream) pairs a rank runs GEMMs on, each holding its workspaces for the process: the
// training thread's stream and the autograd engine's device thread (the backward; not on a rollout rank),
// the one stream every CUDA graph is captured on (rollout.cuda_graphs), and with train.async the rollout
// thread's own stream, and its captures beside the training thread's where an evaluation captures too.
// Measured on an H200 (the 0.5B, LoRA and full): three pairs through every step. None on the CPU.
int cublas_workspace_pairs(const Config& c, bool rollout_rank = false);

// Parameters of a model of this shape: the embedding, per layer the norms, q/k/v/o (with their biases and
// q/k norms where the config has them) and the MLP, the final norm, and the LM head unless tied (or a score
// head: its weight, and its bias for token classification).
int64_t parameter_count(const ModelConfig& m);
// A parameter count in millions from 100,000 and in billions from 10^9, with two decimals below 10, one
// below 100: 832000 -> "0.83M", 45700000 -> "45.7M", 7615616512 -> "7.62B"; below 100,000 the integer.
std::string count_text(int64_t n);
// A byte count in the unit that fits: 512 B, 450 KiB, 1.00 MiB, 65.0 GiB (three significant digits).
std::string bytes_text(int64_t bytes);

// The plan of a run of config `c` over model `m` on each of `world` ranks. `c.model.dtype` is the dtype
// the run computes in (m.dtype, the checkpoint's, is not read).
MemoryPlan plan_memory(const Config& c, const ModelConfig& m, int world);
// A rollout rank's plan (train.rollout_ranks, `rollout_ranks` of them): the weights it decodes and the cache
// of its share of the step's rows; no gradient, optimizer state or activation.
MemoryPlan plan_rollout_rank(const Config& c, const ModelConfig& m, int rollout_ranks);

// Throws RunError (trainer/run.h) when plan.device_total() > device_bytes, with the plan's figures and the
// changes that would fit, each re-planned: the train.shard stage (at this world), train.offload
// optimizer, model.activation_checkpointing, loss.impl cce, lora.rank 64, and the most rollout.max_batch
// and train.micro_batch_size rows that fit; when no single change fits, the combination that does (if
// one does). device_bytes <= 0: no check (the CPU).
void check_memory_plan(const MemoryPlan& plan, const Config& c, const ModelConfig& m, int world, int64_t device_bytes);

// Throws RunError when `ranks` ranks of this plan on one host need more pinned host memory (ranks x
// plan.host_total()) than `host_bytes`, with both figures and what the host memory holds. host_bytes <= 0:
// no check.
void check_host_memory(const MemoryPlan& plan, int ranks, int64_t host_bytes);
// The host memory a run may pin: MemAvailable of /proc/meminfo (free pages plus the page cache that can be
// dropped), in bytes; 0 where it cannot be read. A test replaces it with a fake figure (set_host_memory_probe;
// nullptr restores it).
int64_t host_memory_bytes();
void set_host_memory_probe(std::function<int64_t()> probe);

// With every layer checkpointed (model.activation_checkpointing, model.checkpoint_layers -1), the fewest
// checkpointed layers whose plan still fits in 90% of device_bytes (the plan is an estimate: the margin
// keeps the hint off the edge): a shorter update, each layer not recomputed; -1 when no fewer fit, or
// nothing is checkpointed, or device_bytes <= 0.
int64_t fewest_checkpointed_layers(const Config& c, const ModelConfig& m, int world, int64_t device_bytes);

// Bytes this process may use on `device`: a CUDA device's free memory plus what the caching allocator
// already holds for this process. 0 for the CPU (check_memory_plan then checks nothing).
int64_t device_memory_bytes(const at::Device& device);

}  // namespace rlt
