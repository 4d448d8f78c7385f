// A training run and its set-up: the tokenizer, model, prompt stream and optimizer built from the config
// (or restored from a checkpoint), one step's rollout, and the greedy evaluation. What GRPO and PPO share
// around their loops lives beside it, one concern per file: optim.h (AdamW, schedule, accumulation
// ranges), warmup.h (the demo's supervised warm-up), checkpoint.h, metrics.h.
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <nlohmann/json_fwd.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/errors.h"
#include "data/dataset.h"
#include "data/hf_chat.h"
#include "data/tokenizer.h"
#include "model/transformer.h"
#include "parallel/dist.h"
#include "rollout/engine.h"
#include "rollout/python_reward.h"
#include "rollout/retool.h"
#include "rollout/sandbox.h"
#include "rollout/tools.h"
#include "trainer/config.h"

namespace rlt {

class MetricsLog;
class ShardedState;
struct ScriptRewards;
class RewardModel;
struct Placement;
struct Critic;
class PhaseParking;

// A rollout that is not the step's own (train.async's, beside the update; train.rollout_ranks', on other
// ranks): what a checkpoint keeps of it so that a resumed run samples it again.
class PendingRollouts {
 public:
  virtual ~PendingRollouts() = default;
  // On rank 0: writes into dir what a resume needs, and state["async"].
  virtual void save(const std::string& dir, nlohmann::json& state) = 0;
  // rollout.partial, on every rank that writes the checkpoint: the rank's carried groups.
  virtual void save_carry(const std::string& dir) const {}
  virtual bool partial() const { return false; }
};

// The model and its optimizer state: what the update trains and a checkpoint keeps.
struct ModelState {
  std::unique_ptr<Transformer> policy;
  // Only when objective.kl_coef > 0: the policy as RL starts (after the warm-up), saved once to
  // out_dir/reference so a resumed run keeps it. With LoRA: the base shared with the policy plus a
  // frozen copy of the adapters, saved as a PEFT adapter folder.
  std::unique_ptr<Transformer> reference;
  // Named trainable tensors beside the policy (PPO's value head): optimised in a second parameter group
  // and checkpointed with the run.
  std::map<std::string, at::Tensor> extra;
  double extra_lr_scale = 1.0;  // the second group's learning rate over the policy's
  std::unique_ptr<torch::optim::AdamW> optimizer;
  // Mixed precision (model.dtype bfloat16, train.master_weights fp32): fp32 copies of the policy's
  // parameters, in the order of policy->parameters(). AdamW steps these (its moments are fp32 too); the
  // bf16 parameters are their rounding, refreshed after every step. Empty otherwise.
  std::vector<at::Tensor> master;
  // train.shard / train.offload set: the sharded state (parallel/shard.h) trains in place of `optimizer`
  // and `master` (both empty then). Shared: ShardedState is complete in parallel/shard.h only.
  std::shared_ptr<ShardedState> sharded;
  // PPO with critic.shared false: the value model of its own, with its optimizer (trainer/critic.h).
  std::shared_ptr<Critic> critic;
  // train.phase_offload: the host buffers the optimizer state moves to while the rollout runs
  // (parallel/parking.h), made on the first move.
  std::shared_ptr<PhaseParking> parking;
};

// What the rollout decodes with and calls: the engine, the merged weights, the tools and the reward script.
struct RolloutState {
  ToolProtocol tools;  // how the model calls the interpreter and how its output comes back (rollout/tools.h)
  // The run's interpreter pool, made on first use (tool_runner).
  std::shared_ptr<SandboxPool> sandbox;
  // reward.kind python: the script, its own interpreter pool and its pending metrics (trainer/rewards.h),
  // made at the first scoring.
  std::shared_ptr<ScriptRewards> rewards;
  // reward.kind model (or a model term of reward.combine): the reward model, loaded at the first scoring on
  // this rank's device in model.dtype.
  std::shared_ptr<RewardModel> reward_model;
  // rollout.keep_cache: the training rollouts' DecodeEngine, made at the first and kept (its KV cache and
  // CUDA graphs with it) while it is built on the policy.
  std::unique_ptr<DecodeEngine> engine;
  // lora.rank > 0: what the rollout and the evaluation decode, the policy with its adapters merged into
  // the targeted weights (Transformer::merged; its other tensors are the policy's), refreshed in place by
  // rollout_model(). It costs the targeted weights' size again: freed after each training rollout unless
  // rollout.keep_cache keeps the engine built on it.
  std::unique_ptr<Transformer> merged;
  // train.async's rollout beside the update, or train.rollout_ranks' on other ranks: what a checkpoint
  // keeps of it.
  PendingRollouts* pending = nullptr;
};

// What the run reads: the tokenizer, the chat template, the prompt stream and the held-out set.
struct RunData {
  std::unique_ptr<Tokenizer> tokenizer;
  // chat.template model: the checkpoint's own chat template (else prompts use the fixed chat.prompt).
  std::shared_ptr<const HfChatTemplate> chat;
  std::unique_ptr<PromptSampler> prompts;
  std::vector<PromptExample> eval_set;  // held-out training prompts, or data.eval_path's problems
};

// Where the run's figures go: metrics.jsonl, the console and the plot (made by begin_training; shared:
// MetricsLog is complete in trainer/metrics.h only), and the latest evaluation.
struct RunMetrics {
  std::shared_ptr<MetricsLog> log;
  double last_eval_step = -1, last_eval_pass1 = 0;  // the latest evaluation: after which step, its pass@1
  double phase_moves_s = 0;  // train.phase_offload: seconds of moves since the last step's metrics
  // The memory plan this rank was checked against before loading (trainer/memory_plan.h), per phase: the
  // persistent part plus the rollout's, plus the update's, and the larger (or, with train.async, the sum).
  // Logged beside the measured peaks as memory_plan_{rollout_,update_,}mib; 0 before the check.
  int64_t plan_rollout_bytes = 0, plan_update_bytes = 0, plan_bytes = 0;
};

// A training run: its config and place among the ranks, then its parts grouped by who owns them.
struct Run {
  // True while the loop should go on: steps remain and --stop-after is not reached.
  bool more_steps() const { return counters.step < last_step(); }
  // The last step the run takes: train.steps, or --stop-after's.
  int64_t last_step() const { return stop_after > 0 ? std::min(config.train.steps, stop_after) : config.train.steps; }
  // True when the step just done must be checkpointed: the last, a --stop-after, or every checkpoint_every.
  bool checkpoint_due() const { return checkpoint_due_at(counters.step); }
  bool checkpoint_due_at(int64_t s) const {
    const int64_t every = config.train.checkpoint_every;
    return s == config.train.steps || s == stop_after || (every > 0 && s % every == 0);
  }

  // Rank 0 writes the run folder (checkpoints, metrics.jsonl, samples.jsonl, the plot) and the console.
  bool lead() const { return dist->lead() && !rollout_rank; }

  Config config;
  std::string out_dir;
  at::Device device = at::kCPU;
  // The ranks of a data-parallel run (parallel/dist.h); one process: collectives that do nothing. With
  // train.rollout_ranks, this rank's side of the placement: the training ranks, or the rollout ranks.
  std::shared_ptr<Collectives> dist = single_process();
  // train.rollout_ranks (parallel/placement.h): the job's ranks, the broadcast group, and this rank's role.
  std::shared_ptr<Placement> placement;
  bool rollout_rank = false;  // this rank only samples: it has no optimizer and writes no run files

  ModelState model;
  RolloutState rollout;
  RunData data;
  RunMetrics metrics;

  StepCounters counters;     // RL steps, optimizer steps and skipped ones (parallel/options.h)
  int64_t stop_after = 0;    // > 0: checkpoint and return once `step` reaches it (--stop-after)
  std::string resumed_from;  // the checkpoint folder a resumed run loaded (load_checkpoint)
  // The old log-probs in force: train.old_logprobs, switched to recompute for good once a step's
  // logprob_mismatch_mean exceeds train.old_logprobs_tol (check_old_logprobs, trainer/metrics.h).
  // Checkpointed, so a resumed run keeps the switch.
  OldLogprobs old_logprobs = OldLogprobs::kRollout;
};

// Makes the named extra parameters of a run for its policy (PPO: the value head, sized to the hidden
// states), and the learning rate of their parameter group (0 = train.lr).
struct ExtraParams {
  std::function<std::map<std::string, at::Tensor>(const Transformer& policy, const Config& config)> make;
  std::function<double(const Config& config)> lr;
};

// model.dtype as the tensors' dtype.
at::ScalarType scalar_type(DType d);

// Builds everything from the config: tokenizer (loaded, or trained on the synthetic task into out_dir),
// model (loaded, or new), the extra parameters, the prompt stream, and the optimizer. With resume, the
// model, extra parameters, optimizer state, step counters and prompt position come from out_dir's
// checkpoint. Throws RunError / ConfigError / DataError / ModelConfigError for bad input. With `dist` (several
// ranks) the step's shapes must split over the ranks (check_world), rank 0 alone trains a tokenizer, and
// every rank builds the same run.
// With `placement` (train.rollout_ranks), `dist` is this rank's side (Placement::side).
Run make_run(const Config& config, const std::string& out_dir, bool resume, const ExtraParams& extra = {},
             std::shared_ptr<Collectives> dist = nullptr, std::shared_ptr<Placement> placement = nullptr);

// The ranks of the run on this rank's host (a collective: every rank of `dist` calls it).
int ranks_on_this_host(Collectives& dist);
// The CPUs this process may run on (its affinity mask) and the host's online ones.
struct HostCpus {
  int allowed = 1, online = 1;
};
HostCpus host_cpus();
// train.cpu_threads for a rank of a launched run: `configured` when set; else `user` (user_omp_threads) when
// set; else the CPUs the rank may run on, shared by the run's `ranks_on_host` where the rank may run on
// all of the host's (a rank bound to CPUs of its own, by srun or numactl, takes them all), at least one.
int rank_cpu_threads(int64_t configured, int user, const HostCpus& cpus, int ranks_on_host);
// OMP_NUM_THREADS as the user set it, read through `env`: 0 when unset or not a positive count, and 0 for
// the 1 torchrun gives every rank of a job (TORCHELASTIC_RUN_ID set) whose environment has none.
int user_omp_threads(const std::function<const char*(const char*)>& env);

// A step's trajectories (train.prompts_per_step x samples_per_prompt) and its mini-batches must split
// evenly over `world` ranks, whole prompts each: RunError naming the keys otherwise.
void check_world(const Config& config, int world);

// Rank 0's parameters (the policy's, its fp32 masters, run.model.extra) on every rank.
void broadcast_weights(Run& run);

// Makes run.model.reference when objective.kl_coef > 0 and there is none: loaded from out_dir/reference when a
// resumed run saved one, else a copy of the policy, saved there.
void ensure_reference(Run& run);

// What every trainer does before its first RL step: CPU memory tracking (the peak-memory metrics), the
// metrics log, the warm-up (a fresh run with sft.steps > 0), the reference policy (objective.kl_coef > 0),
// and the evaluation "before" on a fresh run. Returns that
// evaluation's pass@1, NaN when there is none.
double begin_training(Run& run);
// After the last step: the evaluation "after" (the last step's own when train.eval_every ran one there),
// adding eval_accuracy_start / eval_accuracy_end (pass@1) to `m`.
void end_training(Run& run, double eval_start, std::map<std::string, double>& m);

// The model the rollout and the evaluation decode: the policy itself, or with LoRA rollout.merged, made on
// first use and rewritten in place from the policy's current adapters at every call.
const Transformer& rollout_model(const ModelState& model, RolloutState& rollout);
// Frees that merged copy unless the kept engine (rollout.keep_cache) decodes it: a training rollout, an
// evaluation and a publish to the rollout ranks each make it again, so the update has its memory.
void release_rollout_model(RolloutState& rollout);

// The rollout's engine settings: rollout.<switch>, and the cache bounded at rollout.max_context slots, where
// the memory plan counts it.
EngineOptions engine_options(const RolloutOptions& r);

// Prompt ids of examples through the chat template (data.chat, else config.chat's fixed one); with
// rollout.tool_format tool_call, the template lists the protocol's tool.
std::vector<std::vector<int64_t>> encode_prompts(const RunData& data, const Config& config,
                                                 const ToolProtocol& protocol,
                                                 const std::vector<PromptExample>& examples);

// One step's rollout: the next train.prompts_per_step prompts, sampling.samples_per_prompt trajectories
// each (prompt-major: trajectory s belongs to prompt s / G), rewards assigned. Noise streams follow the
// prompt's draw index and the step, so a resumed run samples what the uninterrupted one did, and a rank
// samples its prompts (rank_prompts) exactly as one process samples them.
struct RolloutBatch {
  std::vector<PromptExample> examples;  // (P_rank) this rank's prompts
  std::vector<Trajectory> trajs;        // (P_rank * G)
  std::vector<int64_t> index;           // (P_rank * G) each trajectory's place among the step's P * G
  // (P * G, kTableColumns) float64 on the CPU: every trajectory of the step, gathered from every rank, one
  // row each (TableColumn); what the step's advantages and metrics read.
  at::Tensor table;
  double seconds = 0;   // wall time of the generation (tool calls included); the slowest rank's
  RolloutStats stats;   // where the generation's time went: times the slowest rank's, counts summed
  RewardTally rewards;  // reward.kind python: the script's failures and fields over this rank's trajectories
};
enum TableColumn : int64_t {
  kReward,
  kCorrect,
  kToolCalls,
  kTruncated,
  kResponseTokens,
  kSampledTokens,
  kTokens,           // prompt + response (window_end)
  kOverlongPenalty,  // of kReward, the overlong shaping
  kTableColumns
};
// The table row of each of `trajs`, placed at `index`, summed over the ranks: (S_step, kTableColumns).
at::Tensor gather_table(Collectives& dist, const std::vector<Trajectory>& trajs, const std::vector<int64_t>& index,
                        int64_t S_step);
RolloutBatch collect_rollouts(Run& run);

// rollout.partial: the groups one rollout leaves for the next (rollout/retool.h's RolloutCarry), with their
// prompts' examples, which the rewards read once a group is returned.
struct PartialCarry {
  std::vector<CarriedGroup> groups;
  std::map<int64_t, PromptExample> examples;  // by CarriedGroup::key
};
// rollout.partial_extra_prompts as a run keeps them in play: 0 = a quarter of train.prompts_per_step (at
// least 1), rounded up to a multiple of the ranks (each keeps as many).
int64_t partial_extra_prompts(const Config& config, int world);

// What collect_rollouts decodes from, for a rollout that runs beside the update (train.async): a copy of
// the weights published for it, its own kept engine (rollout.keep_cache), its own collectives (the update's
// run on the other thread), and the step it samples for. Installed for the calling thread only, for the
// scope's life; without one, collect_rollouts reads the run's own (rollout_model, run.dist, run.counters.step).
struct RolloutSource {
  const Transformer* model = nullptr;
  std::unique_ptr<DecodeEngine>* engine = nullptr;  // where the kept DecodeEngine lives
  Collectives* dist = nullptr;
  int64_t step = 0;     // run.counters.step as the batch's step begins: seeds the sampling noise
  int64_t version = 0;  // the weights' version (Trajectory::weights_version)
  // rollout.partial: the groups it continues, and where it leaves those it does not return. The draw tops
  // them up to partial_extra_prompts / world beyond the rank's share of the step's prompts.
  PartialCarry* carry = nullptr;
};
// The collectives a rollout on this thread gathers with: its RolloutSource's, else the run's.
Collectives& rollout_collectives(Run& run);
class RolloutSourceScope {
 public:
  explicit RolloutSourceScope(const RolloutSource& source);
  ~RolloutSourceScope();
  RolloutSourceScope(const RolloutSourceScope&) = delete;
  RolloutSourceScope& operator=(const RolloutSourceScope&) = delete;

 private:
  const RolloutSource* previous_;
};

// Runs code on the rollout's interpreter pool (sandbox.workers processes), made on first use and kept.
ToolRunner tool_runner(RolloutState& rollout, const SandboxOptions& options);

// One evaluation on run.data.eval_set (no training): train.eval_samples completions per problem, at
// train.eval_temperature (-1: greedy for 1 sample, else sampling.temperature) with sampling.top_p / top_k
// and a noise stream of its own.
struct EvalResult {
  double pass1 = 0;     // mean over problems of (correct completions / k): avg@k
  double pass_k = 0;    // share of problems with at least one correct completion
  double tool_use = 0;  // share of completions that called the tool
  int64_t k = 1;
  // pass@j for j = 1, 2, 4, ... below k, and k: the mean over problems of the unbiased estimator
  // 1 - C(k - c, j) / C(k, j) of a problem with c correct of its k completions (the chance that j of them,
  // drawn without replacement, hold a correct one). pass_at[1] is pass1, pass_at[k] pass_k.
  std::map<int64_t, double> pass_at;
  // With several evaluation sets (data.eval_path, data.eval_sets, the held-out prompts): each set's own
  // figures, by PromptExample::data_source.
  std::map<std::string, EvalResult> by_set;
};
// The unbiased estimator of pass@j from c correct of n completions (j <= n): 1 - C(n - c, j) / C(n, j),
// computed as 1 - prod_{i = n - c + 1}^{n} (1 - j / i).
double pass_at_estimate(int64_t n, int64_t c, int64_t j);
EvalResult evaluate(Run& run);
// The sampling of an evaluation after RL step `step`: sampling.* with train.eval_samples completions a
// problem, at train.eval_temperature (-1: 0 for one completion, else sampling.temperature), on a seed of
// its own.
SamplingOptions evaluation_sampling(const Config& c, int64_t step);
// The figures of prompt-major completions, k per problem; over every rank's problems with `dist`.
EvalResult summarize_evaluation(const std::vector<Trajectory>& trajs, int64_t k, Collectives* dist = nullptr);
// Each set's figures: of the completions whose problem (problems[t.prompt_index]) has data_source `name`,
// for every name in `names` (the same list on every rank, in the same order, with `dist`).
std::map<std::string, EvalResult> summarize_evaluation_sets(const std::vector<Trajectory>& trajs,
                                                            const std::vector<PromptExample>& problems,
                                                            const std::vector<std::string>& names, int64_t k,
                                                            Collectives* dist = nullptr);
// evaluate(), printed as "eval <when>: pass@1 ..., pass@k ..., tool use ..."; remembered in the run.
EvalResult report_evaluation(Run& run, const std::string& when);
// After RL step run.counters.step: when train.eval_every says so (and at the last step), an evaluation, as the
// metrics eval_pass@j (EvalResult::pass_at), eval_avg@k and eval_tool_use, and with several sets
// eval_avg@k/<set> and eval_pass@j/<set> of each; else nothing.
std::map<std::string, double> periodic_evaluation(Run& run);

}  // namespace rlt
