// What a step reports: the peak memory of its phases, the rollout's metrics, the update's metrics
// (accumulated on the device, read once per step), samples.jsonl, metrics.jsonl, the console's progress
// line, and plot.svg.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/memory.h"
#include "common/tensorboard.h"
#include "loss/policy_loss.h"
#include "model/flops.h"
#include "trainer/batch.h"
#include "trainer/run.h"

namespace rlt {

// Peak extra memory of a step's phases, measured one after another: each phase's peak is over what was
// allocated when it began (a PeakMemory resets the device's peak counter, so phases cannot overlap).
class PhasePeaks {
 public:
  explicit PhasePeaks(const at::Device& device) : device_(device), current_(std::in_place, device) {}
  // Ends the current phase as peak_memory_<name>_mib (over its start) and memory_allocated_peak_<name>_mib
  // (the most allocated at once within it, what the plan's phase must cover), and starts the next one.
  void end(const std::string& name);
  // Those of every ended phase, and peak_memory_mib, the largest phase's; over the whole step,
  // memory_allocated_peak_mib (the most allocated at once, everything counted: what a plan must cover)
  // and memory_reserved_peak_mib (the most the caching allocator held from the device, its cache
  // included: what nvidia-smi shows).
  std::map<std::string, double> metrics() const;

 private:
  at::Device device_;
  std::optional<PeakMemory> current_;
  std::map<std::string, double> mib_, phase_allocated_mib_;
  double allocated_mib_ = 0, reserved_mib_ = 0;
};

// The update's metrics of one step, summed on the device as the micro-batches go and copied to the host
// once, by read(). Two kinds:
//   * per optimizer step, averaged over the step's optimizer steps: loss, pg_loss, grad_norm, and the
//     terms given to add_update_term (PPO's value_loss). policy_loss() aggregates each micro-batch with
//     the mini-batch's global denominator, so a mini-batch's value is the plain SUM of its micro-batch
//     terms (weighting them by tokens again would count the denominator twice). With no KL and no
//     entropy term, pg_loss == loss exactly.
//   * per loss-mask token, averaged over every micro-batch's loss-mask tokens: kl, entropy, clip_frac,
//     approx_kl, dual_clip_frac, logprob_mean, and the sums given to add_token_sum (PPO's
//     value_clip_frac). A micro-batch's token mean is weighted by its own token count.
//   * clip_frac with objective.ratio_level sequence (GSPO): a share of sequences, so a micro-batch's value
//     is weighted by its sequences with a loss-mask token, and averaged over them.
class UpdateMetrics {
 public:
  explicit UpdateMetrics(const at::Device& device, bool clip_per_sequence = false)
      : device_(device), clip_per_sequence_(clip_per_sequence) {}
  // One micro-batch: `loss` () is what was backpropagated (the policy loss plus any extra term);
  // logprobs, loss_mask (S_m, R).
  void add_micro_batch(const at::Tensor& loss, const PolicyLossOutput& out, const at::Tensor& logprobs,
                       const at::Tensor& loss_mask);
  // A term of this optimizer step's loss, averaged per optimizer step like loss (PPO: value_loss).
  void add_update_term(const std::string& name, const at::Tensor& value);
  // A sum over loss-mask tokens, averaged per token (PPO: value_clip_frac).
  void add_token_sum(const std::string& name, const at::Tensor& sum);
  // The loss of the optimizer step under way: the sum of its micro-batches' losses so far. ()
  const at::Tensor& step_loss() const { return step_loss_; }
  // Ends an optimizer step with its gradient norm (already on the host: clipping reads it).
  void end_optimizer_step(double grad_norm);
  // Every metric, one device-to-host copy; with `dist`, the sums of every rank (each rank's losses are its
  // share of the step's, its token sums its own tokens'; the gradient norm is already the global one).
  std::map<std::string, double> read(Collectives* dist = nullptr) const;

 private:
  void add(std::map<std::string, at::Tensor>& sums, const std::string& name, const at::Tensor& value);
  at::Device device_;
  at::Tensor step_loss_;                          // () float64, the optimizer step under way
  std::map<std::string, at::Tensor> per_update_;  // name -> () float64 sum over optimizer steps
  std::map<std::string, at::Tensor> per_token_;   // name -> () float64 sum over loss-mask tokens
  at::Tensor tokens_;                             // () float64 loss-mask tokens
  bool clip_per_sequence_ = false;
  at::Tensor clip_sum_, clip_sequences_;  // clip_per_sequence_: () float64 sums of clip_frac x sequences, of sequences
  double grad_norm_sum_ = 0;
  int64_t updates_ = 0;
};

// How far the rollout's sampling log-probs are from the trainer's own log-probs of the same tokens under
// the same weights (both through the loss module): over every sampled token of the step,
// logprob_mismatch_mean = mean |trainer - rollout| and logprob_mismatch_max = max |trainer - rollout|.
// Summed on the device; read once.
class LogprobMismatch {
 public:
  // trainer, rollout, loss_mask (S_m, R); the mask's nonzero entries are the sampled tokens.
  void add(const at::Tensor& trainer, const at::Tensor& rollout, const at::Tensor& loss_mask);
  // Over every rank's tokens (a rank that measured nothing adds zeros).
  std::map<std::string, double> read(Collectives* dist = nullptr) const;

 private:
  at::Tensor sum_, max_, count_;  // () float64
};

// After the update: adds old_logprobs_recomputed to a step's metrics (1 = the old log-probs were the
// trainer's own, from a scoring forward or, on-policy GRPO, the update's own pass; 0 = the rollout's) and,
// when they were the rollout's and the step's logprob_mismatch_mean (already in `metrics`) exceeds
// train.old_logprobs_tol, prints one warning and switches run.old_logprobs to recompute for the following
// steps. Call it before finish_step, so the checkpoint a step writes holds the switch.
void check_old_logprobs(Run& run, bool used_rollout, std::map<std::string, double>& metrics);

class MetricsLog;

// Seconds a step spent scoring, updating, and in all; and of the update, waiting for the gradient
// collectives once its backward was done (several ranks).
struct StepTimes {
  double scoring = 0, update = 0, step = 0, comm = 0;
};

// The update's work on this rank: each of `trajs` (the update's order) as the forwards of `batches` (its
// micro-batches over that order) ran it: its tokens less those another answer's forward ran
// (PackedBatch::reused, train.share_prompts), which it attends over as context, and the rows the loss
// module scores (scored_rows).
std::vector<SequenceWork> update_work(const LossOptions& loss, const std::vector<Trajectory>& trajs,
                                      const std::vector<PackedBatch>& batches);
// The update's FLOPs over every rank's work (model/flops.h; each rank's `work`, summed over the ranks): the
// forwarded tokens through the layers, the scored rows through the LM head, forward and backward,
// train.num_iterations times. update_flops: that count (model FLOPs of the work done: a prompt an answer
// shares is counted once); update_forwarded_tokens: the tokens the forwards took, an iteration; update_mfu:
// the FLOPs over update_s x the rank's bf16 peak x the ranks; update_hfu: the same with the layers'
// recompute under model.activation_checkpointing. The two rates only where the peak is known
// (train.peak_tflops, or the GPU's name in model/flops.h's table). Every rank calls it.
std::map<std::string, double> update_flop_metrics(const Run& run, const std::vector<SequenceWork>& work,
                                                  double update_s);
// The rows the loss module scores of a sequence of `tokens` tokens, `response` of them the response and
// `sampled` of those sampled: every position, the response (loss.response_only), or the sampled tokens
// (with loss.loss_mask_only).
int64_t scored_rows(const LossOptions& loss, int64_t tokens, int64_t response, int64_t sampled);
// A device's dense bf16 rate from model/flops.h's table, FLOP/s; 0 for the CPU or a GPU it does not name.
double device_bf16_peak_flops(const at::Device& device);

// The end of every step, the same for GRPO and PPO: the rollout's, the update's and the trainer's own
// metrics (`extra`), the schedule, timings and peak memory to metrics.jsonl, the progress line on stderr,
// and the plot;
// samples.jsonl; run.counters.step advanced; the checkpoint when one is due. Returns the step's metrics. Every rank
// calls it (the metrics are reduced over the ranks); rank 0 writes.
std::map<std::string, double> finish_step(Run& run, const RolloutBatch& rb, const UpdateMetrics& um,
                                          const std::vector<SequenceWork>& work, const PhasePeaks& peaks,
                                          const StepTimes& times, int64_t total_optimizer_steps,
                                          std::map<std::string, double> extra = {});

// Per-step rollout metrics of a batch, from its table (every rank's trajectories): accuracy, tool use,
// lengths, truncation, rewards, sampled_tokens and tokens (prompt + response), rollout tokens/s and where the
// rollout's time went (time_rollout_*); and the warnings of a degenerate step: every reward equal (zero
// advantage), most completions truncated.
std::map<std::string, double> rollout_metrics(const Run& run, const RolloutBatch& rb);

// Appends the first train.log_samples trajectories of a step to out_dir/samples.jsonl: step, prompt and
// response text (tool output included, as the model saw it), reward, finish reason, tool calls.
void log_samples(const Run& run, const std::vector<Trajectory>& trajs);

// The optional fields of the console's progress line. Every line shows the step, reward_mean, accuracy,
// tool_use, response_length_mean, grad_norm, clip_frac, rollout_tokens_per_s (sampled tokens per second
// of generation) and time_step_s.
struct ProgressFields {
  bool loss = false;     // loss: where its value says something (progress_fields)
  bool kl = false;       // kl: to the reference policy, which exists when objective.kl_coef > 0
  bool entropy = false;  // entropy: measured when loss.entropy != none
};

// The fields a run's progress line shows. The loss shows for PPO (it holds the value loss) and for an
// off-policy GRPO update (train.num_iterations > 1 or mini-batches: the old log-probs are not the current
// ones). On-policy GRPO's loss is -mean(advantage) at ratio 1, which group normalisation holds near zero
// whatever the policy learns, so the line leaves it out; metrics.jsonl keeps it.
ProgressFields progress_fields(const Run& run, const std::map<std::string, double>& metrics);

// One step's console line, e.g. "step 3/40  reward 0.250  acc 25%  tool 50%  len 87.3  entropy 0.812
// grad norm 0.456  clip 1.2%  sampled 1234 tok/s  2.10 s/step" (one line, no newline).
std::string progress_line(const std::map<std::string, double>& metrics, const ProgressFields& show);

// metrics.jsonl (one JSON object per step), plot.svg, and with `tensorboard` the same scalars in
// TensorBoard event files under out_dir/tensorboard/ (common/tensorboard.h). A fresh run (append false)
// removes the event files a previous run left there, as it truncates metrics.jsonl; a resumed one adds a
// file.
class MetricsLog {
 public:
  MetricsLog(const std::string& out_dir, bool append, bool tensorboard = false);
  ~MetricsLog();
  // One step's metrics: a line of metrics.jsonl and, with TensorBoard, every value a scalar at m["step"].
  void write(const std::map<std::string, double>& metrics);
  // A TensorBoard text summary (Markdown) at `step`; nothing without TensorBoard.
  void text(int64_t step, const std::string& tag, const std::string& markdown);
  bool tensorboard() const { return events_ != nullptr; }
  // plot.svg: reward, accuracy and tool use against step.
  void plot() const;

 private:
  std::string out_dir_;
  std::ofstream file_;
  std::vector<std::map<std::string, double>> rows_;
  std::unique_ptr<EventWriter> events_;
};

}  // namespace rlt
