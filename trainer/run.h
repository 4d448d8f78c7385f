// What GRPO and PPO share around their loops: building the tokenizer, model and prompt stream from the
// config, the supervised warm-up of the built-in demo, AdamW with its learning-rate schedule, atomic
// checkpoints, metrics.jsonl with a terminal progress line, and the plot of the run.
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/adamw.h>

#include <cstdint>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "data/tokenizer.h"
#include "loss/memory.h"
#include "model/transformer.h"
#include "rollout/retool.h"
#include "trainer/config.h"

namespace rlt {

// Bad input found while setting a run up (missing checkpoint, tokenizer/model mismatch...): the apps
// print it and exit with code 2.
class RunError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Run {
  // True while the loop should go on: steps remain and --stop-after is not reached.
  bool more_steps() const { return step < config.train.steps && !(stop_after > 0 && step >= stop_after); }
  // True when the step just done must be checkpointed: the last, a --stop-after, or every checkpoint_every.
  bool checkpoint_due() const {
    const int64_t every = config.train.checkpoint_every;
    return step == config.train.steps || step == stop_after || (every > 0 && step % every == 0);
  }

  Config config;
  std::string out_dir;
  at::Device device = at::kCPU;
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<Transformer> policy;
  // Only when policy.kl_coef > 0: the policy as RL starts (after the warm-up), saved once to
  // out_dir/reference so a resumed run keeps it.
  std::unique_ptr<Transformer> reference;
  std::unique_ptr<PromptSampler> prompts;
  std::vector<PromptExample> eval_set;  // train.eval_prompts held-out problems
  // Named trainable tensors beside the policy (PPO's value head): optimised in a second parameter group
  // and checkpointed with the run.
  std::map<std::string, at::Tensor> extra;
  double extra_lr_scale = 1.0;  // the second group's learning rate over the policy's
  std::unique_ptr<torch::optim::AdamW> optimizer;
  int64_t step = 0;             // RL steps done
  int64_t optimizer_steps = 0;  // optimizer steps done (the schedule's clock)
  int64_t skipped_steps = 0;    // optimizer steps skipped for a non-finite loss or gradient
  int64_t stop_after = 0;       // > 0: checkpoint and return once `step` reaches it (--stop-after)
};

// Makes the named extra parameters of a run for its policy (PPO: the value head, sized to the hidden
// states), and the learning rate of their parameter group (0 = train.lr).
struct ExtraParams {
  std::function<std::map<std::string, at::Tensor>(const Transformer& policy, const Config& config)> make;
  std::function<double(const Config& config)> lr;
};

// Builds everything from the config: tokenizer (loaded, or trained on the synthetic task into out_dir),
// model (loaded, or new), the extra parameters, the prompt stream, and the optimizer. With resume, the
// model, extra parameters, optimizer state, step counters and prompt position come from out_dir's
// checkpoint. Throws RunError / ConfigError / DataError / ModelConfigError for bad input.
Run make_run(const Config& config, const std::string& out_dir, bool resume, const ExtraParams& extra = {});

// The learning rate at optimizer step `step` (0-based) of `total`.
double learning_rate(const TrainOptions& o, int64_t step, int64_t total);
// Sets the policy group's learning rate to lr and the extra group's to lr * extra_lr_scale.
void set_learning_rate(torch::optim::AdamW& opt, double lr, double extra_lr_scale = 1.0);

// Makes run.reference when policy.kl_coef > 0 and there is none: loaded from out_dir/reference when a
// resumed run saved one, else a copy of the policy, saved there.
void ensure_reference(Run& run);

// Supervised warm-up on synthetic tool-use traces (sft.*); returns the last loss. Tool output is masked
// out of the loss as in RL.
double sft_warmup(Run& run);

// The warm-up's problems: o.steps * o.batch_size of them, drawn apart from the RL prompts, cycling
// through operand lengths [o.operand_digits_min, digits] x [.., digits] (just the task's own lengths when
// operand_digits_min is 0).
std::vector<PromptExample> warmup_tasks(const SyntheticOptions& task, const SftOptions& o);

// Prompt ids of examples through the chat template.
std::vector<std::vector<int64_t>> encode_prompts(const Run& run, const std::vector<PromptExample>& examples);

// One step's rollout: the next train.prompts_per_step prompts, sampling.samples_per_prompt trajectories
// each (prompt-major: trajectory s belongs to prompt s / G), rewards assigned. Noise streams follow the
// prompt's draw index and the step, so a resumed run samples what the uninterrupted one did.
struct RolloutBatch {
  std::vector<PromptExample> examples;  // (P)
  std::vector<Trajectory> trajs;        // (P * G)
  double seconds = 0;                   // wall time of the generation (tool calls included)
  RolloutStats stats;                   // where the generation's time went
};
RolloutBatch collect_rollouts(Run& run, const ToolRunner& tools);

// Micro-batch ranges [begin, end) over S sequences: mini-batches of `mini`, each split into `micro`;
// a range never crosses a mini-batch boundary.
std::vector<std::pair<int64_t, int64_t>> micro_batch_ranges(int64_t S, int64_t mini, int64_t micro);

// The denominator of mini-batch [begin, end) for aggregate_loss's global_denominator, so the
// micro-batch losses add up to the mini-batch loss (see LossAgg in loss/policy_loss.h).
double mini_batch_denominator(const std::vector<Trajectory>& trajs, int64_t begin, int64_t end, LossAgg agg);

// Ends one optimizer step whose gradients have been accumulated: clips the global norm (train.grad_clip),
// and applies AdamW at the schedule's learning rate only when `loss` and the norm are finite; otherwise
// zeroes the gradients and counts the step in run.skipped_steps (never applied). Returns the norm.
double apply_gradients(Run& run, const std::vector<at::Tensor>& params, double loss, int64_t total_optimizer_steps);

// Peak extra memory of a step's phases, measured one after another: each phase's peak is over what was
// allocated when it began (a PeakMemory resets the device's peak counter, so phases cannot overlap).
class PhasePeaks {
 public:
  explicit PhasePeaks(const at::Device& device) : device_(device), current_(std::in_place, device) {}
  // Ends the current phase as peak_memory_<name>_mib and starts the next one.
  void end(const std::string& name);
  // peak_memory_<name>_mib of every ended phase, and peak_memory_mib, their maximum.
  std::map<std::string, double> metrics() const;

 private:
  at::Device device_;
  std::optional<PeakMemory> current_;
  std::map<std::string, double> mib_;
};

// Per-step rollout metrics of a batch: accuracy, tool use, lengths, truncation, rewards, sampled_tokens and
// tokens (prompt + response), rollout tokens/s and where the rollout's time went (time_rollout_*); and the
// warnings of a degenerate step: every reward equal (zero advantage), most completions truncated.
std::map<std::string, double> rollout_metrics(const Run& run, const RolloutBatch& rb);

// Appends the first train.log_samples trajectories of a step to out_dir/samples.jsonl: step, prompt and
// response text (tool output included, as the model saw it), reward, finish reason, tool calls.
void log_samples(const Run& run, const std::vector<Trajectory>& trajs);

// Greedy accuracy and tool-use share on run.eval_set (no training).
std::pair<double, double> evaluate(Run& run);
// evaluate(), printed as "eval <when> RL: accuracy ..., tool use ..."; returns the accuracy.
double report_evaluation(Run& run, const char* when);

// Checkpoint out_dir/checkpoint: model folder (HF), optimizer.pt, extra.pt (run.extra), state.json,
// written under a temporary name and renamed; the previous checkpoint stays until the new one is complete.
void save_checkpoint(Run& run);
// Restores the state saved by save_checkpoint into a run made for it (make_run calls it with resume).
void load_checkpoint(Run& run);

// metrics.jsonl (one JSON object per step), the progress line, and plot.svg.
class MetricsLog {
 public:
  MetricsLog(const std::string& out_dir, bool append);
  void write(const std::map<std::string, double>& metrics);
  // plot.svg: reward, accuracy and tool use against step.
  void plot() const;

 private:
  std::string out_dir_;
  std::ofstream file_;
  std::vector<std::map<std::string, double>> rows_;
};

// Removes a folder tree without following symlinks (POSIX nftw: libtorch exports a broken
// std::filesystem::remove_all).
void remove_tree(const std::string& path);

}  // namespace rlt
