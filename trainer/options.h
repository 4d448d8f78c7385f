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

// The model of a tokenizer the demo trains (sentencepiece's model types).
enum class TokenizerType { kBpe, kUnigram };
inline const EnumNames<TokenizerType>& enum_names(TokenizerType) {
  static const EnumNames<TokenizerType> names{{"bpe", TokenizerType::kBpe}, {"unigram", TokenizerType::kUnigram}};
  return names;
}

struct ModelOptions {
  std::string path;
  std::string tokenizer;
  int64_t tokenizer_vocab = 400;
  // On the demo's small, repetitive corpus a unigram model prunes itself to mostly characters (328 of
  // 400 pieces, 256 of them bytes: a prompt of 32 tokens); BPE fills the 400 with its words ("What",
  // " product": 15 tokens), which shortens every sequence the warm-up trains on and the rollout decodes
  // (configs/retool_tiny.yaml).
  TokenizerType tokenizer_type = TokenizerType::kUnigram;
  std::string device = "cpu";
  DType dtype = DType::kFloat32;
  bool activation_checkpointing = false;
  // With activation_checkpointing: the layers, from the first, that recompute their activations in the
  // backward; -1 = every layer. The first ones: their backward comes last, after the others' saved
  // activations are freed.
  int64_t checkpoint_layers = -1;
  // Training and scoring forwards on a GPU run the fused RMSNorm, RoPE and SiLU-gate kernels with their
  // backward kernels (Transformer::set_training_kernels); off: the ATen forms.
  bool fused_kernels = true;
  // A new model (when path is empty): llama-style decoder, its vocabulary the tokenizer's.
  int64_t init_hidden = 128;
  int64_t init_layers = 4;
  int64_t init_heads = 4;
  int64_t init_kv_heads = 2;
  int64_t init_intermediate = 384;
  int64_t init_seed = 0;

  template <class V>
  void visit(V&& v) {
    v("path", path, "Hugging Face checkpoint folder (config.json + safetensors); empty = a new model from init_*");
    v("tokenizer", tokenizer, "tokenizer.json, .model or folder; empty = model.path's own (the demo trains one)");
    v("tokenizer_vocab", tokenizer_vocab, "vocabulary of a trained tokenizer", FieldRange{300, 1e6});
    v("tokenizer_type", tokenizer_type,
      "model of a trained tokenizer: unigram | bpe (fewer, longer pieces on a small corpus)");
    v("device", device, "cpu | cuda | cuda:N");
    v("dtype", dtype, "parameters and activations: float32 | bfloat16 (log-probs are always fp32)");
    v("activation_checkpointing", activation_checkpointing, "recompute layer activations in the backward");
    v("checkpoint_layers", checkpoint_layers,
      "with activation_checkpointing: the first N layers recompute theirs, the rest keep them; -1 = every layer",
      FieldRange{-1, 1e6});
    v("fused_kernels", fused_kernels,
      "fused CUDA kernels, with backward kernels, in training and scoring forwards (false: ATen forms; GPU only)");
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

// The layers a training forward checkpoints: the first model.checkpoint_layers (every one at -1) with
// model.activation_checkpointing, else none.
inline int64_t checkpointed_layers(const ModelOptions& m, int64_t num_layers) {
  if (!m.activation_checkpointing) return 0;
  return m.checkpoint_layers < 0 || m.checkpoint_layers > num_layers ? num_layers : m.checkpoint_layers;
}

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

// What a run writes beside metrics.jsonl and samples.jsonl (`logging:`).
struct LoggingOptions {
  bool tensorboard = true;
  int64_t tensorboard_samples = 2;

  template <class V>
  void visit(V&& v) {
    v("tensorboard", tensorboard,
      "TensorBoard event files in <run>/tensorboard/: every metrics.jsonl field a scalar at its step");
    v("tensorboard_samples", tensorboard_samples,
      "with tensorboard: the step's first N trajectories as text (prompt, response, reward); 0 = none",
      FieldRange{0, 1e4});
  }
  void check(const FieldFail& fail) const {}
};

struct TrainOptions {
  PromptSource prompts = PromptSource::kSynthetic;
  int64_t steps = 40;
  int64_t prompts_per_step = 16;
  int64_t num_iterations = 1;
  int64_t mini_batch_size = 0;
  int64_t micro_batch_size = 32;
  // > 0: micro-batches of at most this many padded tokens (rows x the longest), each mini-batch's sequences
  // longest first; micro_batch_size still caps the rows.
  int64_t micro_batch_tokens = 0;
  // Micro-batches lay their sequences end to end, with no padding (trainer/batch.h); off: right-padded rows.
  bool pack_sequences = false;
  // Packed: answers to one prompt that share a micro-batch run the prompt once, each continuing it
  // (trainer/batch.h); budgeted micro-batches keep a prompt's answers together.
  bool share_prompts = true;
  // Over several ranks, each step-wide mini-batch's sequences are dealt over the ranks by tokens (longest
  // first, to the rank with the fewest) rather than kept where they were sampled; each rank keeps its count.
  // Off by default until a multi-GPU run measures it (docs/training.md).
  bool balance_tokens = false;
  OldLogprobs old_logprobs = OldLogprobs::kRollout;
  // The first step above it warns once, and the run recomputes from the next step on. 1e-3 sits between
  // the two measured regimes: fp32 about 2e-7 (tests/trainer/test_trainer.cpp), bf16 on the H200 7.7e-3
  // (docs/benchmarks.md), so fp32 runs reuse the rollout's and bf16 runs switch after their first step. An
  // error of 1e-3 in a log-ratio moves the importance ratio by 0.1%, 200x inside the default clip range
  // of 0.2.
  double old_logprobs_tol = 1e-3;
  double lr = 1e-6;
  double beta1 = 0.9, beta2 = 0.98, adam_eps = 1e-8, weight_decay = 0.1;
  double grad_clip = 1.0;
  MasterWeights master_weights = MasterWeights::kFp32;
  LrSchedule lr_schedule = LrSchedule::kConstant;
  int64_t warmup_steps = 0;
  double min_lr_ratio = 0.0;

  Advantage advantage = Advantage::kGrpo;
  ScaleRewards scale_rewards = ScaleRewards::kGroup;
  bool mask_truncated = false;
  // trainer/dynamic_sampling.h; running out of rounds warns once.
  bool dynamic_sampling = false;
  int64_t max_sampling_rounds = 3;
  // one_step's update takes the rollout's log-probs as the old ones (or scores them, train.old_logprobs:
  // recompute), and objective.tis / icepop apply as configured.
  AsyncMode async = AsyncMode::kOff;
  // Disaggregated placement (trainer/rollout_ranks.h).
  int64_t rollout_ranks = 0;
  // Each bucket's broadcast waits for the last, so a few large ones keep the link busy (2 x H200, 7B
  // shape: 25 MiB buckets 64 GB/s, 400 MiB 209 GB/s).
  int64_t rollout_sync_mb = 400;
  // A rank's ATen CPU threads (the host step of train.offload, the reward model's encoding, CPU kernels).
  // 0: a launched rank keeps an OMP_NUM_THREADS the user set, else takes the CPUs it may run on, divided by
  // the run's ranks on its host unless it is bound to CPUs of its own (torchrun's OMP_NUM_THREADS=1 for
  // every rank is not the user's); a lone process keeps ATen's own count.
  int64_t cpu_threads = 0;
  int64_t checkpoint_every = 0;
  // The bf16 peak update_mfu divides by, TFLOP/s per rank; 0: the GPU's from model/flops.h's table (a
  // device outside it, or the CPU, logs no update_mfu).
  double peak_tflops = 0;
  // Not the only seed: synthetic.seed defines the built-in task's problems, like a dataset file, and
  // model.init_seed a new model's weights.
  int64_t seed = 0;
  int64_t eval_prompts = 0;
  int64_t eval_every = 0;
  // k > 1 samples as in training: pass@1 is the mean accuracy over the k samples, pass@k the share of
  // problems with a correct one.
  int64_t eval_samples = 1;
  // The evaluation's sampling temperature; -1: greedy for one sample, sampling.temperature for more.
  double eval_temperature = -1;
  int64_t log_samples = 4;
  // A rollout's length is the usual wait for a late rank.
  double dist_timeout_s = 1800;
  int64_t dist_bucket_mb = 25;
  ShardStage shard = ShardStage::kNone;
  Offload offload = Offload::kNone;
  OffloadStep offload_step = OffloadStep::kAuto;
  PhaseOffload phase_offload = PhaseOffload::kNone;

  template <class V>
  void visit(V&& v) {
    v("prompts", prompts, "prompt source: synthetic | jsonl (data.path)");
    v("steps", steps, "RL steps (rollout + update)", FieldRange{0, 1e9});
    v("prompts_per_step", prompts_per_step, "prompts per step, each sampled sampling.samples_per_prompt times",
      FieldRange{1, 1e9});
    v("num_iterations", num_iterations, "passes over each step's rollouts (PPO epochs)", FieldRange{1, 1000});
    v("mini_batch_size", mini_batch_size, "sequences per optimizer step; 0 = all", FieldRange{0, 1e9});
    v("micro_batch_size", micro_batch_size, "sequences per forward/backward (gradient accumulation)",
      FieldRange{1, 1e9});
    v("micro_batch_tokens", micro_batch_tokens,
      "tokens per forward/backward (padded: rows x the longest), each mini-batch longest first (micro_batch_size "
      "caps the rows); 0 = off",
      FieldRange{0, 1e12});
    v("pack_sequences", pack_sequences,
      "forwards take their sequences end to end with no padding (varlen attention); false = right-padded rows");
    v("share_prompts", share_prompts,
      "with pack_sequences: a micro-batch's answers to one prompt run it once, each attending over its keys; "
      "false = every answer forwards its prompt");
    v("balance_tokens", balance_tokens,
      "over several ranks: deal each mini-batch's sequences over the ranks by tokens; false = train where sampled");
    v("old_logprobs", old_logprobs,
      "off-policy old log-probs: rollout (the sampler's, no scoring forward) | recompute (a scoring forward)");
    v("old_logprobs_tol", old_logprobs_tol,
      "rollout: the logprob_mismatch_mean (nats a sampled token) above which the run switches to recompute",
      FieldRange{0, 1e9});
    v("lr", lr, "peak learning rate", FieldRange{0, 10});
    v("beta1", beta1, "AdamW beta1", FieldRange{0, 1});
    v("beta2", beta2, "AdamW beta2", FieldRange{0, 1});
    v("adam_eps", adam_eps, "AdamW epsilon", FieldRange{0, 1});
    v("weight_decay", weight_decay, "AdamW decoupled weight decay", FieldRange{0, 10});
    v("grad_clip", grad_clip, "max global gradient norm; 0 = off", FieldRange{0, 1e9});
    v("master_weights", master_weights, "bf16 models: fp32 (master weights, moments, gradients) | none");
    v("lr_schedule", lr_schedule, "constant | linear | cosine");
    v("warmup_steps", warmup_steps, "optimizer steps of linear warm-up from 0", FieldRange{0, 1e9});
    v("min_lr_ratio", min_lr_ratio, "linear/cosine decay floor as a fraction of lr", FieldRange{0, 1});
    v("scale_rewards", scale_rewards, "advantage scaling: group | batch | none (train.advantage grpo)");
    v("advantage", advantage,
      "GRPO advantage: grpo (group-relative) | rloo (leave-one-out mean) | reinforce_pp (batch-normalised) | "
      "reinforce_pp_baseline (group mean off, then batch-normalised); ppo_train takes grpo only (GAE)");
    v("mask_truncated", mask_truncated,
      "DAPO overlong filtering: truncated trajectories get no loss and count in no denominator");
    v("dynamic_sampling", dynamic_sampling,
      "DAPO dynamic sampling (grpo_train): drop groups whose rewards are all equal, sample more prompts until "
      "prompts_per_step groups are kept");
    v("max_sampling_rounds", max_sampling_rounds,
      "dynamic_sampling: rounds of prompts_per_step prompts a step samples at most, then trains on what it kept",
      FieldRange{1, 1e6});
    v("async", async,
      "off | one_step: step t+1's rollout runs from the weights after step t-1 while step t's update runs "
      "(grpo_train)");
    v("rollout_ranks", rollout_ranks,
      "several ranks: the last N only sample (and score) trajectories, the others only train; weights are "
      "broadcast to them after each update; 0 = every rank does both (grpo_train)",
      FieldRange{0, 1023});
    v("rollout_sync_mb", rollout_sync_mb, "rollout_ranks: MiB per bucket of the weights' broadcast to them",
      FieldRange{1, 1e5});
    v("peak_tflops", peak_tflops,
      "a rank's peak bf16 TFLOP/s for update_mfu; 0 = the GPU's from the table in docs/training.md",
      FieldRange{0, 1e6});
    v("cpu_threads", cpu_threads,
      "a rank's CPU threads (train.offload's host step, encoding, CPU kernels); 0 = a launched rank keeps the "
      "user's OMP_NUM_THREADS, else takes its CPUs over the host's ranks, or all where bound to its own "
      "(torchrun's default 1 is not kept); a lone process keeps ATen's count",
      FieldRange{0, 4096});
    v("checkpoint_every", checkpoint_every, "steps between checkpoints; 0 = at the end only", FieldRange{0, 1e9});
    v("seed", seed, "the run's seed: prompt order and sampling noise", FieldRange{0, 9.0e18});
    v("eval_prompts", eval_prompts,
      "evaluation problems: the last N training prompts held out (0: none), or data.eval_path's first N (0: all)",
      FieldRange{0, 1e6});
    v("eval_every", eval_every, "RL steps between evaluations; 0 = before and after training only", FieldRange{0, 1e9});
    v("eval_samples", eval_samples,
      "completions per evaluation problem (k): avg@k and the unbiased pass@1, 2, 4, ..., k over them",
      FieldRange{1, 1e6});
    v("eval_temperature", eval_temperature,
      "evaluation sampling temperature; -1 = greedy at eval_samples 1, else sampling.temperature", FieldRange{-1, 100});
    v("log_samples", log_samples, "trajectories per step written to samples.jsonl; 0 = none", FieldRange{0, 1e6});
    v("dist_timeout_s", dist_timeout_s,
      "several ranks: seconds a collective waits for a late rank before the job ends naming it", FieldRange{1, 1e6});
    v("dist_bucket_mb", dist_bucket_mb, "several ranks: MiB per gradient bucket summed during the backward",
      FieldRange{1, 1e5});
    v("shard", shard,
      "training state split over the ranks: none | optimizer (masters, moments) | gradients (and gradients) | "
      "parameters (and weights)");
    v("offload", offload, "none | optimizer: fp32 masters and AdamW moments in pinned host memory");
    v("offload_step", offload_step,
      "where train.offload optimizer steps: host (every core; the ranks of a host share its memory bandwidth) | "
      "device (masters and moments stream through the GPU in chunks over its own PCIe link; CUDA) | auto (device "
      "when several ranks share a host, else host)");
    v("phase_offload", phase_offload,
      "none | optimizer: fp32 masters and AdamW moments (sharded: gradient chunks too) in pinned host memory "
      "while the rollout and evaluations run, back on the device for the update | training_state: with "
      "train.shard or train.offload, the weight chunks too (and the gradient chunks under offload)");
  }
  void check(const FieldFail& fail) const {
    if (eval_temperature < 0 && eval_temperature != -1) fail("eval_temperature", "must be -1 (automatic) or >= 0");
  }
};

// Supervised warm-up on synthetic tool-use traces (the built-in demo), before RL.
struct SftOptions {
  int64_t steps = 0;
  int64_t batch_size = 32;
  // Its own AdamW and schedule: the RL's train.* settings would be far too gentle for a model trained from
  // nothing.
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999, adam_eps = 1e-8, weight_decay = 0.0;
  LrSchedule lr_schedule = LrSchedule::kCosine;
  int64_t warmup_steps = 20;
  double min_lr_ratio = 0.1;
  double grad_clip = 1.0;
  // The rest answer directly (and mostly wrongly): RL then has something to discover.
  double tool_fraction = 0.3;
  // With 2 on a 3 x 3-digit task, warm-up problems cycle through 2 x 2, 2 x 3, 3 x 2 and 3 x 3 digits, so
  // products of 3 to 6 digits are copied from the interpreter's output. Without it, 5-digit products
  // (17% of 3 x 3-digit problems) are miscopied into the answer far more often than 6-digit ones.
  int64_t operand_digits_min = 0;

  template <class V>
  void visit(V&& v) {
    v("steps", steps, "supervised warm-up steps; 0 = none", FieldRange{0, 1e9});
    v("operand_digits_min", operand_digits_min,
      "shortest warm-up operand in digits; 0 = the task's own (synthetic.digits_a/b)", FieldRange{0, 18});
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
    v("tool_fraction", tool_fraction, "share of warm-up traces that use the tool; the rest answer directly",
      FieldRange{0, 1});
  }
  void check(const FieldFail& fail) const {}
};

// PPO's critic: a linear value head on the policy's hidden states.
struct PpoOptions {
  double gamma = 1.0;
  double lam = 0.95;
  double vf_coef = 0.5;
  double value_clip = 0.2;
  double value_lr = 0.0;
  bool whiten_advantages = true;

  template <class V>
  void visit(V&& v) {
    v("gamma", gamma, "discount per response token", FieldRange{0, 1});
    v("lam", lam, "GAE lambda", FieldRange{0, 1});
    v("vf_coef", vf_coef, "value-loss weight", FieldRange{0, 1e6});
    v("value_clip", value_clip, "value loss: clip range of values - values_old; 0 = off", FieldRange{0, 1e6});
    v("value_lr", value_lr, "value-head learning rate; 0 = train.lr", FieldRange{0, 10});
    v("whiten_advantages", whiten_advantages, "normalise advantages to mean 0, std 1 over the batch's sampled tokens");
  }
  void check(const FieldFail& fail) const {}
};

// Where PPO's separate critic (critic.shared false) starts: a copy of the policy as RL starts (its trunk,
// a value head at zero), the reward model's folder (reward.model_path: its trunk and score head), or a
// folder of its own (critic.path).
enum class CriticInit { kPolicy, kRewardModel, kPath };
inline const EnumNames<CriticInit>& enum_names(CriticInit) {
  static const EnumNames<CriticInit> names{
      {"policy", CriticInit::kPolicy}, {"reward_model", CriticInit::kRewardModel}, {"path", CriticInit::kPath}};
  return names;
}

// The critic's shard stage: the policy's (train.shard), or one of its own.
enum class CriticShard { kTrain, kNone, kOptimizer, kGradients, kParameters };
inline const EnumNames<CriticShard>& enum_names(CriticShard) {
  static const EnumNames<CriticShard> names{{"train", CriticShard::kTrain},
                                            {"none", CriticShard::kNone},
                                            {"optimizer", CriticShard::kOptimizer},
                                            {"gradients", CriticShard::kGradients},
                                            {"parameters", CriticShard::kParameters}};
  return names;
}

// PPO's critic: a value head on the policy's trunk (shared), or a model of its own with its own optimizer
// (trainer/critic.h).
struct CriticOptions {
  bool shared = true;
  CriticInit init = CriticInit::kPolicy;
  std::string path;
  double lr = 0.0;
  CriticShard shard = CriticShard::kTrain;

  template <class V>
  void visit(V&& v) {
    v("shared", shared,
      "true: a value head on the policy's trunk (ppo.value_lr); false: a critic model of its own, its own "
      "optimizer (a whole model, beside LoRA's adapters too)");
    v("init", init,
      "separate critic's start: policy (a copy as RL starts, value head at 0) | reward_model (reward.model_path) "
      "| path (critic.path)");
    v("path", path, "critic.init path: a Hugging Face folder (*ForTokenClassification, or a trunk to put a head on)");
    v("lr", lr, "separate critic's peak learning rate (train.lr's schedule); 0 = train.lr", FieldRange{0, 10});
    v("shard", shard,
      "separate critic's shard stage: train (train.shard's) | none | optimizer | gradients | parameters");
  }
  void check(const FieldFail& fail) const {
    if (init == CriticInit::kPath && path.empty()) fail("path", "critic.init is path, so a folder is needed");
    if (init != CriticInit::kPath && !path.empty()) {
      fail("path", std::string("is read only with critic.init: path (now ") + enum_to_string(init) + ")");
    }
  }
  // The stage the critic's state is sharded at.
  ShardStage stage(ShardStage train) const {
    switch (shard) {
      case CriticShard::kTrain:
        return train;
      case CriticShard::kNone:
        return ShardStage::kNone;
      case CriticShard::kOptimizer:
        return ShardStage::kOptimizer;
      case CriticShard::kGradients:
        return ShardStage::kGradients;
      case CriticShard::kParameters:
        return ShardStage::kParameters;
    }
    return train;
  }
};

}  // namespace rlt
