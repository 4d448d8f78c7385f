// Options of the model set-up, the GRPO/PPO training loop and the supervised warm-up. Each field is a
// config value (`model.<name>`, `train.<name>`, `sft.<name>`, `ppo.<name>`).
#pragma once

#include <cstdint>
#include <string>

#include "common/fields.h"
#include "parallel/options.h"

namespace rlt {

enum class DType { kFloat32, kBFloat16 };
inline const EnumNames<DType>& enum_names(DType) {
  static const EnumNames<DType> names{{"float32", DType::kFloat32}, {"bfloat16", DType::kBFloat16}};
  return names;
}

struct ModelOptions {
  // A Hugging Face checkpoint folder (config.json + safetensors). Empty: a new model from the init_*
  // fields, sized to the tokenizer (the built-in demo).
  std::string path;
  // A tokenizer.json, a sentencepiece .model or a folder holding one. Empty: the checkpoint's own
  // (model.path); with no checkpoint (the built-in demo), one is trained on the synthetic task.
  std::string tokenizer;
  int64_t tokenizer_vocab = 400;  // vocabulary of a trained tokenizer
  std::string device = "cpu";     // cpu | cuda | cuda:N
  DType dtype = DType::kFloat32;  // parameters and activations; log-probs are always fp32
  // Recompute each layer's activations in the backward instead of storing them.
  bool activation_checkpointing = false;
  // A new model (when path is empty): llama-style decoder.
  int64_t init_hidden = 128;
  int64_t init_layers = 4;
  int64_t init_heads = 4;
  int64_t init_kv_heads = 2;
  int64_t init_intermediate = 384;
  int64_t init_seed = 0;

  template <class V>
  void visit(V&& v) {
    v("path", path, "Hugging Face checkpoint folder; empty = a new model from init_*");
    v("tokenizer", tokenizer, "tokenizer.json, .model or folder; empty = model.path's own (the demo trains one)");
    v("tokenizer_vocab", tokenizer_vocab, "vocabulary of a trained tokenizer", FieldRange{300, 1e6});
    v("device", device, "cpu | cuda | cuda:N");
    v("dtype", dtype, "float32 | bfloat16");
    v("activation_checkpointing", activation_checkpointing, "recompute layer activations in the backward");
    v("init_hidden", init_hidden, "new model: hidden size", FieldRange{8, 1e5});
    v("init_layers", init_layers, "new model: layers", FieldRange{1, 1000});
    v("init_heads", init_heads, "new model: attention heads", FieldRange{1, 1000});
    v("init_kv_heads", init_kv_heads, "new model: key/value heads", FieldRange{1, 1000});
    v("init_intermediate", init_intermediate, "new model: MLP width", FieldRange{8, 1e6});
    v("init_seed", init_seed, "new model: initialisation seed", FieldRange{0, 9.0e18});
  }
  void check(const FieldFail& fail) const {
    if (init_hidden % init_heads != 0) fail("init_hidden", "must be a multiple of init_heads");
    if (init_heads % init_kv_heads != 0) fail("init_kv_heads", "must divide init_heads");
    if (device != "cpu" && device.rfind("cuda", 0) != 0) fail("device", "must be cpu, cuda or cuda:N");
  }
};

// Where prompts come from.
enum class PromptSource { kSynthetic, kJsonl };
inline const EnumNames<PromptSource>& enum_names(PromptSource) {
  static const EnumNames<PromptSource> names{{"synthetic", PromptSource::kSynthetic}, {"jsonl", PromptSource::kJsonl}};
  return names;
}

// How GRPO normalises rewards into advantages: A = r - mean_group(r), divided by the std of the group,
// of the whole batch, or not at all (Dr. GRPO).
enum class ScaleRewards { kGroup, kBatch, kNone };
inline const EnumNames<ScaleRewards>& enum_names(ScaleRewards) {
  static const EnumNames<ScaleRewards> names{
      {"group", ScaleRewards::kGroup}, {"batch", ScaleRewards::kBatch}, {"none", ScaleRewards::kNone}};
  return names;
}

// How GRPO turns the step's rewards into one advantage per trajectory (grpo.h, group_advantages):
// grpo: r - mean of its group, scaled per train.scale_rewards; rloo: r - mean of the group's other samples
// (Ahmadian et al. 2024); reinforce_pp: (r - batch mean) / batch std over the whole step (REINFORCE++, Hu
// 2025); reinforce_pp_baseline: the group mean subtracted first, then normalised over the whole step.
enum class Advantage { kGrpo, kRloo, kReinforcePp, kReinforcePpBaseline };
inline const EnumNames<Advantage>& enum_names(Advantage) {
  static const EnumNames<Advantage> names{{"grpo", Advantage::kGrpo},
                                          {"rloo", Advantage::kRloo},
                                          {"reinforce_pp", Advantage::kReinforcePp},
                                          {"reinforce_pp_baseline", Advantage::kReinforcePpBaseline}};
  return names;
}

// Where AdamW keeps the weights it updates when the model computes in bf16: fp32 master copies (the bf16
// weights are their rounding), or the bf16 weights themselves. A bf16 weight cannot absorb an update below
// half its resolution (2^-8 relative), so at RL learning rates plain bf16 AdamW leaves most updates
// unapplied (docs/benchmarks.md, mixed precision).
enum class MasterWeights { kFp32, kNone };
inline const EnumNames<MasterWeights>& enum_names(MasterWeights) {
  static const EnumNames<MasterWeights> names{{"fp32", MasterWeights::kFp32}, {"none", MasterWeights::kNone}};
  return names;
}

enum class LrSchedule { kConstant, kLinear, kCosine };
inline const EnumNames<LrSchedule>& enum_names(LrSchedule) {
  static const EnumNames<LrSchedule> names{
      {"constant", LrSchedule::kConstant}, {"linear", LrSchedule::kLinear}, {"cosine", LrSchedule::kCosine}};
  return names;
}

// Where an off-policy update (train.num_iterations > 1, or mini-batches) takes the old policy's log-probs:
// the rollout's own sampling log-probs, which come through the loss module's fp32 path and so equal the
// trainer's on the same weights up to rounding (GRPO then spends no scoring forward on the policy), or a
// scoring forward of the policy before the update. An on-policy GRPO update needs neither: its old
// log-probs are its own, detached.
// train.async: off runs each step's rollout, then its update. one_step runs step t+1's rollout, from the
// weights published after step t-1, on its own thread (and CUDA stream) while step t's update runs
// (trainer/async_rollout.h): every update trains on trajectories one step stale.
enum class AsyncMode { kOff, kOneStep };
inline const EnumNames<AsyncMode>& enum_names(AsyncMode) {
  static const EnumNames<AsyncMode> names{{"off", AsyncMode::kOff}, {"one_step", AsyncMode::kOneStep}};
  return names;
}

enum class OldLogprobs { kRollout, kRecompute };
inline const EnumNames<OldLogprobs>& enum_names(OldLogprobs) {
  static const EnumNames<OldLogprobs> names{{"rollout", OldLogprobs::kRollout}, {"recompute", OldLogprobs::kRecompute}};
  return names;
}

struct TrainOptions {
  PromptSource prompts = PromptSource::kSynthetic;   // data.path (jsonl) or the synthetic task
  int64_t steps = 40;                                // RL steps (rollout + update)
  int64_t prompts_per_step = 16;                     // prompts per step; each gets sampling.samples_per_prompt
  int64_t num_iterations = 1;                        // passes over each step's rollouts (PPO epochs)
  int64_t mini_batch_size = 0;                       // sequences per optimizer step; 0 = the whole batch
  int64_t micro_batch_size = 32;                     // sequences per forward/backward (gradient accumulation)
  OldLogprobs old_logprobs = OldLogprobs::kRollout;  // off-policy old log-probs: the rollout's, or scored
  // The rollout's log-probs stand in for the old policy's while the measured logprob_mismatch_mean (nats
  // per sampled token, rollout vs trainer on the same weights) stays at or below this; the first step above
  // it warns once and the run recomputes from the next step on. 1e-3 sits between the two measured regimes:
  // fp32 about 2e-7 (tests/trainer/test_trainer.cpp), bf16 on the H200 7.7e-3 (docs/benchmarks.md), so
  // fp32 runs reuse the rollout's and bf16 runs switch after their first step. An error of 1e-3 in a
  // log-ratio moves the importance ratio by 0.1%, 200x inside the default clip range of 0.2.
  double old_logprobs_tol = 1e-3;
  double lr = 1e-6;
  double beta1 = 0.9, beta2 = 0.98, adam_eps = 1e-8, weight_decay = 0.1;
  double grad_clip = 1.0;  // max global gradient norm; 0 = off
  // bf16 models: fp32 master weights, fp32 AdamW moments and fp32 gradient accumulation (fp32 models
  // need none of it).
  MasterWeights master_weights = MasterWeights::kFp32;
  LrSchedule lr_schedule = LrSchedule::kConstant;
  int64_t warmup_steps = 0;   // optimizer steps of linear warm-up from 0
  double min_lr_ratio = 0.0;  // linear/cosine decay ends at lr * min_lr_ratio

  // GRPO's advantage estimator (PPO's is GAE, ppo.*), and the std that scales advantage grpo's.
  Advantage advantage = Advantage::kGrpo;
  ScaleRewards scale_rewards = ScaleRewards::kGroup;
  // Truncated trajectories (a length or context limit) get no loss: their loss mask is zeroed, so they
  // count in no denominator either (DAPO's overlong filtering).
  bool mask_truncated = false;
  // DAPO's dynamic sampling (trainer/dynamic_sampling.h): groups whose rewards are all equal are dropped and
  // rounds of prompts_per_step more prompts are sampled until prompts_per_step groups are kept, or
  // max_sampling_rounds rounds are spent (then the step trains on what was kept, with a warning once).
  bool dynamic_sampling = false;
  int64_t max_sampling_rounds = 3;
  // Rollout and update overlapped (AsyncMode). one_step's update takes the rollout's log-probs as the old
  // ones (or scores them, train.old_logprobs: recompute), and objective.tis / icepop apply as configured.
  AsyncMode async = AsyncMode::kOff;
  // Disaggregated placement (trainer/rollout_ranks.h): of a run's N ranks, the last rollout_ranks only decode and
  // the others only train; the weights go to the rollout ranks by broadcast after each update. 0: every
  // rank does both.
  int64_t rollout_ranks = 0;
  // The bucket of that broadcast: each bucket's broadcast waits for the last, so a few large ones keep the
  // link busy (2 x H200, 7B shape: 25 MiB buckets 64 GB/s, 400 MiB 209 GB/s).
  int64_t rollout_sync_mb = 400;
  int64_t checkpoint_every = 0;  // RL steps between checkpoints; 0 = only at the end
  // The root of the run's randomness: the prompt order and each step's sampling noise derive from it
  // (synthetic.seed defines the built-in task's problems, like a dataset file; model.init_seed a new
  // model's weights).
  int64_t seed = 0;
  // The evaluation set: without data.eval_path, the last eval_prompts training prompts are held out;
  // with it, its first eval_prompts rows (0 = all). Evaluated before RL, after it, and every eval_every
  // steps (0 = before and after only), eval_samples completions per problem: 1 = greedy; k > 1 =
  // sampled as in training, pass@1 the mean accuracy over the k samples, pass@k the share of problems
  // with a correct one.
  int64_t eval_prompts = 0;
  int64_t eval_every = 0;
  int64_t eval_samples = 1;
  int64_t log_samples = 4;  // trajectories per step written to samples.jsonl; 0 = none
  // Several ranks (torchrun, --nproc): how long a collective may wait for a late rank before the job ends
  // naming it (a rollout's length is the usual wait), and the size of a gradient bucket.
  double dist_timeout_s = 1800;
  int64_t dist_bucket_mb = 25;
  ShardStage shard = ShardStage::kNone;  // ZeRO stage over the ranks (parallel/shard.h)
  Offload offload = Offload::kNone;      // masters and moments in pinned host memory

  template <class V>
  void visit(V&& v) {
    v("prompts", prompts, "prompt source: synthetic | jsonl (data.path)");
    v("steps", steps, "RL steps", FieldRange{0, 1e9});
    v("prompts_per_step", prompts_per_step, "prompts per step", FieldRange{1, 1e9});
    v("num_iterations", num_iterations, "passes over each step's rollouts", FieldRange{1, 1000});
    v("mini_batch_size", mini_batch_size, "sequences per optimizer step; 0 = all", FieldRange{0, 1e9});
    v("micro_batch_size", micro_batch_size, "sequences per forward/backward", FieldRange{1, 1e9});
    v("old_logprobs", old_logprobs,
      "off-policy old log-probs: rollout (the sampler's, no scoring forward) | recompute (a scoring forward)");
    v("old_logprobs_tol", old_logprobs_tol,
      "rollout: the logprob_mismatch_mean above which the run switches to recompute", FieldRange{0, 1e9});
    v("lr", lr, "peak learning rate", FieldRange{0, 10});
    v("beta1", beta1, "AdamW beta1", FieldRange{0, 1});
    v("beta2", beta2, "AdamW beta2", FieldRange{0, 1});
    v("adam_eps", adam_eps, "AdamW epsilon", FieldRange{0, 1});
    v("weight_decay", weight_decay, "AdamW decoupled weight decay", FieldRange{0, 10});
    v("grad_clip", grad_clip, "max global gradient norm; 0 = off", FieldRange{0, 1e9});
    v("master_weights", master_weights, "bf16 models: fp32 (master weights, moments, gradients) | none");
    v("lr_schedule", lr_schedule, "constant | linear | cosine");
    v("warmup_steps", warmup_steps, "optimizer steps of linear warm-up", FieldRange{0, 1e9});
    v("min_lr_ratio", min_lr_ratio, "decay floor as a fraction of lr", FieldRange{0, 1});
    v("scale_rewards", scale_rewards, "advantage scaling: group | batch | none (train.advantage grpo)");
    v("advantage", advantage,
      "GRPO advantage: grpo (group-relative) | rloo (leave-one-out mean) | reinforce_pp (batch-normalised) | "
      "reinforce_pp_baseline (group mean off, then batch-normalised); ppo_train takes grpo only (GAE)");
    v("mask_truncated", mask_truncated, "truncated trajectories get no loss (their loss mask is zeroed)");
    v("dynamic_sampling", dynamic_sampling,
      "DAPO dynamic sampling (grpo_train): drop groups whose rewards are all equal, sample more prompts until "
      "prompts_per_step groups are kept");
    v("max_sampling_rounds", max_sampling_rounds,
      "dynamic_sampling: rounds of prompts_per_step prompts a step samples at most", FieldRange{1, 1e6});
    v("async", async,
      "off | one_step: step t+1's rollout runs from the weights after step t-1 while step t's update runs "
      "(grpo_train)");
    v("rollout_ranks", rollout_ranks,
      "several ranks: the last N only sample (and score) trajectories, the others only train; weights are "
      "broadcast to them after each update; 0 = every rank does both (grpo_train)",
      FieldRange{0, 1023});
    v("rollout_sync_mb", rollout_sync_mb, "rollout_ranks: MiB per bucket of the weights' broadcast to them",
      FieldRange{1, 1e5});
    v("checkpoint_every", checkpoint_every, "steps between checkpoints; 0 = at the end only", FieldRange{0, 1e9});
    v("seed", seed, "the run's seed: prompt order and sampling noise", FieldRange{0, 9.0e18});
    v("eval_prompts", eval_prompts,
      "evaluation problems: held out of the training prompts, or the first N of data.eval_path (0 = all)",
      FieldRange{0, 1e6});
    v("eval_every", eval_every, "RL steps between evaluations; 0 = before and after training only", FieldRange{0, 1e9});
    v("eval_samples", eval_samples, "completions per evaluation problem: 1 = greedy, k > 1 = pass@1 over k samples",
      FieldRange{1, 1e6});
    v("log_samples", log_samples, "trajectories per step written to samples.jsonl", FieldRange{0, 1e6});
    v("dist_timeout_s", dist_timeout_s, "several ranks: seconds a collective waits for a late rank",
      FieldRange{1, 1e6});
    v("dist_bucket_mb", dist_bucket_mb, "several ranks: MiB per gradient bucket summed during the backward",
      FieldRange{1, 1e5});
    v("shard", shard,
      "training state split over the ranks: none | optimizer (masters, moments) | gradients (and gradients) | "
      "parameters (and weights)");
    v("offload", offload, "none | optimizer: fp32 masters and AdamW moments in pinned host memory, stepped there");
  }
  void check(const FieldFail& fail) const {}
};

// Supervised warm-up on synthetic tool-use traces (the built-in demo), before RL.
struct SftOptions {
  int64_t steps = 0;        // 0 = none
  int64_t batch_size = 32;  // traces per step
  // Its own AdamW and schedule (the RL's train.* settings would be far too gentle for a model trained
  // from nothing): peak lr, linear warm-up, decay to lr * min_lr_ratio, global-norm clip.
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999, adam_eps = 1e-8, weight_decay = 0.0;
  LrSchedule lr_schedule = LrSchedule::kCosine;
  int64_t warmup_steps = 20;
  double min_lr_ratio = 0.1;
  double grad_clip = 1.0;
  // Share of warm-up traces that use the tool; the rest answer directly (and mostly wrongly): RL then
  // has something to discover.
  double tool_fraction = 0.3;
  // Shortest operand of a warm-up problem, in digits; 0 = the task's own lengths (synthetic.digits_a/b).
  // With 2 on a 3 x 3-digit task, warm-up problems cycle through 2 x 2, 2 x 3, 3 x 2 and 3 x 3 digits, so
  // products of 3 to 6 digits are copied from the interpreter's output. Without it, 5-digit products
  // (17% of 3 x 3-digit problems) are miscopied into the answer far more often than 6-digit ones.
  int64_t operand_digits_min = 0;

  template <class V>
  void visit(V&& v) {
    v("steps", steps, "supervised warm-up steps; 0 = none", FieldRange{0, 1e9});
    v("operand_digits_min", operand_digits_min, "shortest warm-up operand in digits; 0 = the task's own",
      FieldRange{0, 18});
    v("batch_size", batch_size, "traces per warm-up step", FieldRange{1, 1e9});
    v("lr", lr, "warm-up peak learning rate", FieldRange{0, 10});
    v("beta1", beta1, "warm-up AdamW beta1", FieldRange{0, 1});
    v("beta2", beta2, "warm-up AdamW beta2", FieldRange{0, 1});
    v("adam_eps", adam_eps, "warm-up AdamW epsilon", FieldRange{0, 1});
    v("weight_decay", weight_decay, "warm-up AdamW decoupled weight decay", FieldRange{0, 10});
    v("lr_schedule", lr_schedule, "warm-up schedule: constant | linear | cosine");
    v("warmup_steps", warmup_steps, "linear warm-up steps of the warm-up's learning rate", FieldRange{0, 1e9});
    v("min_lr_ratio", min_lr_ratio, "warm-up decay floor as a fraction of sft.lr", FieldRange{0, 1});
    v("grad_clip", grad_clip, "warm-up max global gradient norm; 0 = off", FieldRange{0, 1e9});
    v("tool_fraction", tool_fraction, "share of warm-up traces that use the tool", FieldRange{0, 1});
  }
  void check(const FieldFail& fail) const {}
};

// PPO's critic: a linear value head on the policy's hidden states.
struct PpoOptions {
  double gamma = 1.0;       // discount per response token
  double lam = 0.95;        // GAE lambda
  double vf_coef = 0.5;     // value-loss weight
  double value_clip = 0.2;  // |V - V_old| clip of the value loss; 0 = off
  double value_lr = 0.0;    // value-head learning rate; 0 = train.lr
  // Normalise advantages to mean 0, std 1 over the batch's sampled tokens.
  bool whiten_advantages = true;

  template <class V>
  void visit(V&& v) {
    v("gamma", gamma, "discount per response token", FieldRange{0, 1});
    v("lam", lam, "GAE lambda", FieldRange{0, 1});
    v("vf_coef", vf_coef, "value-loss weight", FieldRange{0, 1e6});
    v("value_clip", value_clip, "value clipping range; 0 = off", FieldRange{0, 1e6});
    v("value_lr", value_lr, "value-head learning rate; 0 = train.lr", FieldRange{0, 10});
    v("whiten_advantages", whiten_advantages, "normalise advantages over the batch's sampled tokens");
  }
  void check(const FieldFail& fail) const {}
};

}  // namespace rlt
