// Step metrics, logs and the plot; see metrics.h.
#include "trainer/metrics.h"

#include <cmath>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#ifdef RLT_HAVE_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

#include "model/flops.h"
#include "parallel/shard.h"
#include "trainer/checkpoint.h"
#include "trainer/optim.h"
#include "trainer/rewards.h"

namespace rlt {

namespace fs = std::filesystem;

void UpdateMetrics::add(std::map<std::string, at::Tensor>& sums, const std::string& name, const at::Tensor& value) {
  const at::Tensor v = value.detach().to(at::kDouble).reshape({});  // ()
  auto it = sums.find(name);
  if (it == sums.end())
    sums.emplace(name, v.clone());
  else
    it->second.add_(v);
}

void UpdateMetrics::add_micro_batch(const at::Tensor& loss, const PolicyLossOutput& out, const at::Tensor& logprobs,
                                    const at::Tensor& loss_mask) {
  const at::Tensor tokens = loss_mask.detach().sum().to(at::kDouble);  // ()
  const at::Tensor l = loss.detach().to(at::kDouble);
  step_loss_ = step_loss_.defined() ? step_loss_ + l : l;
  add(per_update_, "pg_loss", out.pg_loss);
  add(per_token_, "kl", out.kl * tokens);
  if (clip_per_sequence_) {
    const at::Tensor seqs = (loss_mask.detach().sum(1) > 0).sum().to(at::kDouble);  // ()
    const at::Tensor c = out.clip_frac.detach().to(at::kDouble).reshape({}) * seqs;
    clip_sum_ = clip_sum_.defined() ? clip_sum_ + c : c;
    clip_sequences_ = clip_sequences_.defined() ? clip_sequences_ + seqs : seqs;
  } else {
    add(per_token_, "clip_frac", out.clip_frac * tokens);
  }
  add(per_token_, "approx_kl", out.approx_kl * tokens);
  add(per_token_, "dual_clip_frac", out.dual_clip_frac * tokens);
  if (out.tis_clip_frac.defined()) add(per_token_, "tis_clip_frac", out.tis_clip_frac * tokens);
  if (out.icepop_frac.defined()) add(per_token_, "icepop_frac", out.icepop_frac * tokens);
  if (out.entropy.defined()) add(per_token_, "entropy", out.entropy * tokens);
  add(per_token_, "logprob_mean", (logprobs.detach() * loss_mask).sum());
  tokens_ = tokens_.defined() ? tokens_ + tokens : tokens;
}

void LogprobMismatch::add(const at::Tensor& trainer, const at::Tensor& rollout, const at::Tensor& loss_mask) {
  const at::Tensor valid = loss_mask.detach() != 0;                                                // (S_m, R)
  const at::Tensor d = at::where(valid, (trainer.detach() - rollout).abs(), 0.0).to(at::kDouble);  // (S_m, R)
  const at::Tensor s = d.sum(), m = d.max(), n = valid.sum().to(at::kDouble);
  sum_ = sum_.defined() ? sum_ + s : s;
  max_ = max_.defined() ? at::maximum(max_, m) : m;
  count_ = count_.defined() ? count_ + n : n;
}

std::map<std::string, double> LogprobMismatch::read(Collectives* dist) const {
  // Every rank measures or none does (the same mini-batch and iteration rules on each).
  if (!sum_.defined()) return {};
  at::Tensor sums = at::stack({sum_, count_}).cpu(), max = max_.reshape({1}).cpu();  // device-to-host copies
  if (dist) {
    dist->all_reduce({sums}, ReduceOp::kSum);
    dist->all_reduce({max}, ReduceOp::kMax);
  }
  const double* v = sums.data_ptr<double>();
  return {{"logprob_mismatch_mean", v[0] / std::max(1.0, v[1])}, {"logprob_mismatch_max", max.item<double>()}};
}

void check_old_logprobs(Run& run, bool used_rollout, std::map<std::string, double>& metrics) {
  metrics["old_logprobs_recomputed"] = used_rollout ? 0.0 : 1.0;
  const auto it = metrics.find("logprob_mismatch_mean");
  const double tol = run.config.train.old_logprobs_tol;
  // A mismatch that is not a number fails the test too: the rollout's log-probs cannot be trusted then.
  if (!used_rollout || run.old_logprobs == OldLogprobs::kRecompute || it == metrics.end() || it->second <= tol) {
    return;
  }
  if (run.lead())
    std::cerr << "warning: step " << run.counters.step + 1 << ": logprob_mismatch_mean " << it->second
              << " exceeds train.old_logprobs_tol " << tol
              << ": the rollout's log-probs no longer stand in for the trainer's; the old log-probs are recomputed "
                 "(one scoring forward) from the next step on\n";
  run.old_logprobs = OldLogprobs::kRecompute;
}

void UpdateMetrics::add_update_term(const std::string& name, const at::Tensor& value) { add(per_update_, name, value); }

void UpdateMetrics::add_token_sum(const std::string& name, const at::Tensor& sum) { add(per_token_, name, sum); }

void UpdateMetrics::end_optimizer_step(double grad_norm) {
  if (step_loss_.defined()) add(per_update_, "loss", step_loss_);
  step_loss_ = at::Tensor();
  grad_norm_sum_ += grad_norm;
  ++updates_;
}

std::map<std::string, double> UpdateMetrics::read(Collectives* dist) const {
  std::vector<std::string> names;
  std::vector<at::Tensor> values;
  for (const auto& [name, v] : per_update_) {
    names.push_back(name);
    values.push_back(v);
  }
  for (const auto& [name, v] : per_token_) {
    names.push_back(name);
    values.push_back(v);
  }
  if (clip_sum_.defined()) {
    values.push_back(clip_sum_);
    values.push_back(clip_sequences_);
  }
  if (tokens_.defined()) {
    names.push_back("");
    values.push_back(tokens_);
  }
  std::map<std::string, double> m;
  const double n_upd = std::max<int64_t>(1, updates_);
  m["grad_norm"] = grad_norm_sum_ / n_upd;
  // Zeros for metrics a step had nothing to report on (no micro-batch at all, no entropy).
  for (const char* key :
       {"loss", "pg_loss", "kl", "entropy", "clip_frac", "approx_kl", "dual_clip_frac", "logprob_mean"}) {
    m[key] = 0.0;
  }
  if (values.empty()) return m;
  const at::Tensor host = at::stack(values).cpu();  // the one device-to-host copy
  if (dist) dist->all_reduce({host}, ReduceOp::kSum);
  const double* h = host.data_ptr<double>();
  const double tokens = tokens_.defined() ? std::max(1.0, h[values.size() - 1]) : 1.0;
  for (size_t i = 0; i < per_update_.size(); ++i) m[names[i]] = h[i] / n_upd;
  for (size_t i = per_update_.size(); i < per_update_.size() + per_token_.size(); ++i) m[names[i]] = h[i] / tokens;
  if (clip_sum_.defined()) {
    const size_t k = per_update_.size() + per_token_.size();
    m["clip_frac"] = h[k] / std::max(1.0, h[k + 1]);
  }
  return m;
}

int64_t scored_rows(const LossOptions& loss, int64_t tokens, int64_t response, int64_t sampled) {
  return !loss.response_only ? tokens : loss.loss_mask_only ? sampled : response;
}

double device_bf16_peak_flops(const at::Device& device) {
#ifdef RLT_HAVE_CUDA
  if (device.is_cuda()) return bf16_peak_flops(at::cuda::getDeviceProperties(device.index())->name);
#endif
  (void)device;
  return 0;
}

std::vector<SequenceWork> update_work(const LossOptions& loss, const std::vector<Trajectory>& trajs,
                                      const std::vector<PackedBatch>& batches) {
  std::vector<SequenceWork> work;
  work.reserve(trajs.size());
  for (const PackedBatch& b : batches) {
    for (int64_t s = 0; s < b.S; ++s) {
      TORCH_CHECK(work.size() < trajs.size(), "update_work: the micro-batches hold more sequences than trajs");
      const Trajectory& t = trajs[work.size()];
      const int64_t reused = b.reused.empty() ? 0 : b.reused[s], tokens = t.window_end() - reused;
      const int64_t response = static_cast<int64_t>(t.response_ids.size());
      work.push_back({tokens, scored_rows(loss, tokens, response, t.sampled_tokens()), reused});
    }
  }
  TORCH_CHECK(work.size() == trajs.size(), "update_work: ", trajs.size(), " trajectories, ", work.size(),
              " in the micro-batches");
  return work;
}

std::map<std::string, double> update_flop_metrics(const Run& run, const std::vector<SequenceWork>& work,
                                                  double update_s) {
  const Transformer& m = *run.model.policy;
  const PassFlops pass = training_flops(m.config(), work, /*weight_grads=*/!m.has_lora(),
                                        checkpointed_layers(run.config.model, m.config().num_layers));
  double forwarded = 0;
  for (const SequenceWork& w : work) forwarded += double(w.tokens);
  at::Tensor sums = at::tensor({pass.model, pass.hardware, forwarded}, at::kDouble);  // this rank's
  if (run.dist->world() > 1) run.dist->all_reduce({sums}, ReduceOp::kSum);
  const double* v = sums.data_ptr<double>();
  const double iterations = double(run.config.train.num_iterations);
  std::map<std::string, double> out = {{"update_flops", v[0] * iterations}, {"update_forwarded_tokens", v[2]}};
  // The rank's bf16 peak: train.peak_tflops, else the GPU's from the table; 0 when neither knows it.
  const double peak =
      run.config.train.peak_tflops > 0 ? run.config.train.peak_tflops * 1e12 : device_bf16_peak_flops(run.device);
  if (peak > 0 && update_s > 0) {
    const double available = update_s * peak * double(run.dist->world());
    out["update_mfu"] = v[0] * iterations / available;
    out["update_hfu"] = v[1] * iterations / available;
  }
  return out;
}

std::map<std::string, double> finish_step(Run& run, const RolloutBatch& rb, const UpdateMetrics& um,
                                          const std::vector<SequenceWork>& work, const PhasePeaks& peaks,
                                          const StepTimes& times, int64_t total_optimizer_steps,
                                          std::map<std::string, double> extra) {
  const TrainOptions& train = run.config.train;
  std::map<std::string, double> m = rollout_metrics(run, rb);
  // reward.kind python: reward_errors, reward/<field>
  m.merge(reward_metrics(run, rb.rewards));
  if (run.lead()) log_samples(run, rb.trajs);  // rank 0's first trajectories
  ++run.counters.step;
  m.merge(um.read(run.dist.get()));
  m.merge(extra);
  m.merge(periodic_evaluation(run));
  m.merge(peaks.metrics());
  m.merge(update_flop_metrics(run, work, times.update));
  m.insert({{"step", double(run.counters.step)},
            {"steps", double(train.steps)},
            {"lr", learning_rate(train, std::max<int64_t>(0, run.counters.optimizer_steps - 1), total_optimizer_steps)},
            {"skipped_steps", double(run.counters.skipped_steps)},
            {"optimizer_memory_mib", optimizer_memory_bytes(run.model) / 1048576.0},
            {"update_tokens_per_s", m.at("tokens") * train.num_iterations / std::max(1e-9, times.update)},
            {"time_scoring_s", times.scoring},
            {"time_update_s", times.update},
            {"time_step_s", times.step},
            {"world_size", double(run.dist->world())}});
  if (run.dist->world() > 1) m["time_update_comm_wait_s"] = times.comm;
  if (run.metrics.plan_bytes > 0) {  // the plan beside the measured peaks (memory_allocated_peak_*)
    m["memory_plan_mib"] = run.metrics.plan_bytes / 1048576.0;
    m["memory_plan_rollout_mib"] = run.metrics.plan_rollout_bytes / 1048576.0;
    m["memory_plan_update_mib"] = run.metrics.plan_update_bytes / 1048576.0;
  }
  if (train.phase_offload != PhaseOffload::kNone) {
    m["time_phase_moves_s"] = run.metrics.phase_moves_s;  // this step's rollout and evaluation
    run.metrics.phase_moves_s = 0;
  }
  if (run.model.sharded && run.config.train.offload == Offload::kOptimizer) {
    m["optimizer_host_memory_mib"] = run.model.sharded->host_bytes() / 1048576.0;
  }
  if (!run.lead()) {
    if (run.checkpoint_due() && checkpoint_on_every_rank(run)) save_checkpoint(run);  // each rank writes its part
    return m;
  }
  TORCH_CHECK(run.metrics.log, "finish_step: begin_training made no metrics log");
  run.metrics.log->write(m);
  std::cerr << progress_line(m, progress_fields(run, m)) << "\n";
  run.metrics.log->plot();
  if (run.checkpoint_due()) save_checkpoint(run);
  return m;
}

void PhasePeaks::end(const std::string& name) {
  mib_["peak_memory_" + name + "_mib"] = current_->peak_extra_bytes() / 1048576.0;
  phase_allocated_mib_["memory_allocated_peak_" + name + "_mib"] = current_->peak_bytes() / 1048576.0;
  allocated_mib_ = std::max(allocated_mib_, current_->peak_bytes() / 1048576.0);
  reserved_mib_ = std::max(reserved_mib_, current_->peak_reserved_bytes() / 1048576.0);
  current_.emplace(device_);
}

std::map<std::string, double> PhasePeaks::metrics() const {
  std::map<std::string, double> out = mib_;
  double top = 0;
  for (const auto& [name, mib] : mib_) top = std::max(top, mib);
  out["peak_memory_mib"] = top;
  out.insert(phase_allocated_mib_.begin(), phase_allocated_mib_.end());
  out["memory_allocated_peak_mib"] = allocated_mib_;
  out["memory_reserved_peak_mib"] = reserved_mib_;
  return out;
}

std::map<std::string, double> rollout_metrics(const Run& run, const RolloutBatch& rb) {
  TORCH_CHECK(rb.table.defined() && rb.table.dim() == 2 && rb.table.size(1) == kTableColumns,
              "rollout_metrics: the batch has no trajectory table (gather_table)");
  const at::Tensor table = rb.table.contiguous();
  auto t = table.accessor<double, 2>();
  const int64_t n = table.size(0);
  const double S = static_cast<double>(n);
  double correct = 0, tool_use = 0, tool_calls = 0, truncated = 0, len_sum = 0, len_max = 0, r_sum = 0;
  double sampled = 0, tokens = 0;
  for (int64_t s = 0; s < n; ++s) {
    sampled += t[s][kSampledTokens];
    tokens += t[s][kTokens];
    correct += t[s][kCorrect];
    tool_use += t[s][kToolCalls] > 0;
    tool_calls += t[s][kToolCalls];
    truncated += t[s][kTruncated];
    len_sum += t[s][kResponseTokens];
    len_max = std::max(len_max, t[s][kResponseTokens]);
    r_sum += t[s][kReward];
  }
  const double r_mean = r_sum / S;
  double r_var = 0;
  for (int64_t s = 0; s < n; ++s) r_var += (t[s][kReward] - r_mean) * (t[s][kReward] - r_mean);
  const double r_std = S > 1 ? std::sqrt(r_var / (S - 1)) : 0.0;
  const int64_t step = run.counters.step + 1;
  if (r_std == 0 && run.lead()) {
    std::cerr << "warning: step " << step << ": every reward is " << r_mean << ": zero advantage, zero gradient\n";
  }
  if (truncated > 0.5 * S && run.lead()) {
    std::cerr << "warning: step " << step << ": " << int(100 * truncated / S)
              << "% of completions hit a length limit (sampling.max_new_tokens / rollout.max_context)\n";
  }
  std::map<std::string, double> m = {
      {"reward_mean", r_mean},
      {"reward_std", r_std},
      {"accuracy", correct / S},
      {"tool_use", tool_use / S},
      {"tool_calls_mean", tool_calls / S},
      {"truncation_rate", truncated / S},
      {"response_length_mean", len_sum / S},
      {"response_length_max", len_max},
      {"sampled_tokens", sampled},
      {"tokens", tokens},
      {"rollout_tokens_per_s", sampled / std::max(1e-9, rb.seconds)},
      {"time_rollout_s", rb.seconds},
      {"time_rollout_prefill_s", rb.stats.prefill_s},
      {"time_rollout_decode_s", rb.stats.decode_s},
      {"time_rollout_sample_s", rb.stats.sample_s},
      {"time_rollout_tool_wait_s", rb.stats.tool_wait_s},
      {"rollout_decode_steps", double(rb.stats.decode_steps)},
      {"rollout_rows_per_step", double(rb.stats.fed_rows) / std::max<int64_t>(1, rb.stats.decode_steps)},
      {"rollout_forced_tokens", double(rb.stats.forced_tokens)},
      {"rollout_feed_steps", double(rb.stats.feed_steps)},
      {"rollout_refills", double(rb.stats.refills)},
      {"time_rollout_feed_s", rb.stats.feed_s},
      {"time_rollout_turn_s", rb.stats.turn_s},
      // The tail: decode passes of at most 16 rows (with several ranks, the slowest rank's time).
      {"time_rollout_tail_s", rb.stats.tail_s},
      {"rollout_tail_passes", double(rb.stats.tail_passes)},
      {"rollout_tail_tokens_per_pass", double(rb.stats.tail_sampled) / std::max<int64_t>(1, rb.stats.tail_passes)},
      // A tool call's latency as the loop saw it, and on the sandbox's clock, over the step's calls.
      {"rollout_tool_latency_ms_mean", 1e3 * rb.stats.tool_latency_s / std::max(1.0, tool_calls)},
      {"rollout_tool_run_ms_mean", 1e3 * rb.stats.tool_run_s / std::max(1.0, tool_calls)},
      // Passes of the loop a trajectory sat out, on average: waiting on its tool calls, or holding a
      // reply back to share a feed (rollout.feed_wait).
      {"rollout_tool_wait_passes_mean", double(rb.stats.tool_wait_row_steps) / S},
      {"rollout_feed_wait_passes_mean", double(rb.stats.feed_wait_row_steps) / S}};
  if (run.config.rollout.speculative != Speculative::kNone) {
    const RolloutStats& st = rb.stats;
    // Speculative rollouts: verifying forwards among the decode passes, draft tokens fed and taken, and the
    // tokens a row sampled per verifying forward.
    m["rollout_verify_passes"] = double(st.verify_passes);
    m["rollout_speculative_share"] =
        double(st.verify_passes) / std::max<int64_t>(1, st.verify_passes + st.decode_steps);
    m["rollout_draft_tokens"] = double(st.drafted_tokens);
    m["rollout_draft_accepted"] = double(st.accepted_tokens);
    m["rollout_draft_acceptance"] = double(st.accepted_tokens) / std::max<int64_t>(1, st.drafted_tokens);
    m["rollout_tokens_per_verify_row"] = double(st.verify_sampled) / std::max<int64_t>(1, st.verify_sampling_rows);
  }
  return m;
}

// A trajectory as TensorBoard's text plugin shows it: a Markdown line of its outcome, then the prompt and
// the response in fences of four backticks (a response's own code blocks use three).
static std::string sample_markdown(const Run& run, const Trajectory& t) {
  std::ostringstream md;
  md << "**reward** " << t.reward << " · " << (t.correct ? "correct" : "not correct") << " · finish "
     << enum_to_string(t.finish) << " · " << t.tool_calls << " tool call" << (t.tool_calls == 1 ? "" : "s")
     << "\n\n**prompt**\n\n````text\n"
     << run.data.tokenizer->decode(t.prompt_ids) << "\n````\n\n**response**\n\n````text\n"
     << run.data.tokenizer->decode(t.response_ids) << "\n````\n";
  return md.str();
}

void log_samples(const Run& run, const std::vector<Trajectory>& trajs) {
  if (run.metrics.log && run.metrics.log->tensorboard()) {
    const int64_t k = std::min<int64_t>(run.config.logging.tensorboard_samples, static_cast<int64_t>(trajs.size()));
    for (int64_t i = 0; i < k; ++i) {
      run.metrics.log->text(run.counters.step + 1, "samples/" + std::to_string(i), sample_markdown(run, trajs[i]));
    }
  }
  const int64_t n = std::min<int64_t>(run.config.train.log_samples, static_cast<int64_t>(trajs.size()));
  if (n == 0) return;
  std::ofstream f((fs::path(run.out_dir) / "samples.jsonl").string(),
                  run.counters.step == 0 ? std::ios::trunc : std::ios::app);
  for (int64_t i = 0; i < n; ++i) {
    const Trajectory& t = trajs[i];
    const int64_t last = t.versions.empty() ? t.weights_version : t.versions.back();
    nlohmann::json j = {{"step", run.counters.step + 1},
                        {"prompt", run.data.tokenizer->decode(t.prompt_ids)},
                        {"response", run.data.tokenizer->decode(t.response_ids)},
                        {"reward", t.reward},
                        {"correct", t.correct},
                        {"finish", enum_to_string(t.finish)},
                        {"tool_calls", t.tool_calls},
                        {"prompt_tokens", t.prompt_ids.size()},
                        {"response_tokens", t.response_ids.size()},
                        {"sampled_tokens", t.sampled_tokens()},
                        {"overlong_penalty", t.overlong_penalty},
                        {"weights_version", t.weights_version},
                        {"weights_version_last", last}};
    f << j.dump() << "\n";
  }
}

MetricsLog::MetricsLog(const std::string& out_dir, bool append, bool tensorboard) : out_dir_(out_dir) {
  if (tensorboard) {
    const fs::path dir = fs::path(out_dir) / "tensorboard";
    std::error_code ec;
    if (!append && fs::is_directory(dir, ec)) {  // a fresh run: the last run's events go with its metrics
      for (const auto& entry : fs::directory_iterator(dir, ec)) {
        if (entry.path().filename().string().rfind("events.out.tfevents.", 0) == 0) fs::remove(entry.path(), ec);
      }
    }
    try {
      events_ = std::make_unique<EventWriter>(dir.string());
    } catch (const std::runtime_error& e) {
      throw RunError(std::string("logging.tensorboard: ") + e.what());
    }
  }
  const std::string path = (fs::path(out_dir) / "metrics.jsonl").string();
  if (append) {  // keep the plot whole across a resume
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      try {
        std::map<std::string, double> row;
        const nlohmann::json parsed = nlohmann::json::parse(line);  // outlives the loop (items() refers to it)
        for (const auto& [k, v] : parsed.items()) {
          if (v.is_number()) row[k] = v.get<double>();
        }
        rows_.push_back(row);
      } catch (const nlohmann::json::exception&) {
      }
    }
  }
  file_.open(path, append ? std::ios::app : std::ios::trunc);
  if (!file_) throw RunError(path + ": cannot open for writing");
}

MetricsLog::~MetricsLog() = default;

void MetricsLog::write(const std::map<std::string, double>& m) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [k, v] : m) j[k] = std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr);
  file_ << j.dump() << "\n";
  file_.flush();
  rows_.push_back(m);
  if (!events_) return;
  try {
    events_->scalars(m.count("step") ? int64_t(m.at("step")) : int64_t(rows_.size()), m);
    events_->flush();
  } catch (const std::runtime_error& e) {  // a full disk: the run goes on, metrics.jsonl has every step
    std::cerr << "warning: logging.tensorboard: " << e.what() << "; no more TensorBoard events\n";
    events_.reset();
  }
}

void MetricsLog::text(int64_t step, const std::string& tag, const std::string& markdown) {
  if (events_) events_->text(step, tag, markdown);
}

ProgressFields progress_fields(const Run& run, const std::map<std::string, double>& metrics) {
  const StepShape shape = step_shape(run.config, run.dist->world());
  const bool off_policy = run.config.train.num_iterations > 1 || shape.mini < shape.S;
  ProgressFields f;
  f.loss = off_policy || metrics.count("value_loss") > 0;
  f.kl = run.model.reference != nullptr;
  f.entropy = run.config.loss.entropy != EntropyMode::kNone;
  return f;
}

std::string progress_line(const std::map<std::string, double>& m, const ProgressFields& show) {
  auto get = [&](const char* k) { return m.count(k) ? m.at(k) : 0.0; };
  std::ostringstream line;
  line << std::fixed << "step " << int64_t(get("step")) << "/" << int64_t(get("steps")) << "  reward "
       << std::setprecision(3) << get("reward_mean") << "  acc " << std::setprecision(0) << 100 * get("accuracy")
       << "%  tool " << 100 * get("tool_use") << "%  len " << std::setprecision(1) << get("response_length_mean");
  if (show.entropy) line << "  entropy " << std::setprecision(3) << get("entropy");
  line << std::defaultfloat << std::setprecision(3) << "  grad norm " << get("grad_norm") << std::fixed
       << std::setprecision(1) << "  clip " << 100 * get("clip_frac") << "%";
  if (show.loss) line << std::scientific << std::setprecision(3) << "  loss " << get("loss");
  if (show.kl) line << std::scientific << std::setprecision(3) << "  kl " << get("kl");
  if (m.count("update_mfu")) line << std::fixed << std::setprecision(1) << "  mfu " << 100 * m.at("update_mfu") << "%";
  line << std::fixed << std::setprecision(0) << "  sampled " << get("rollout_tokens_per_s") << " tok/s  "
       << std::setprecision(2) << get("time_step_s") << " s/step";
  return line.str();
}

void MetricsLog::plot() const {
  // Accuracy and tool use on [0, 1] (left axis), mean reward on [-1.2, 1] (right axis), against step.
  const double W = 720, H = 360, x0 = 60, x1 = W - 60, y0 = 30, y1 = H - 50;
  double smax = 1;
  for (const auto& r : rows_) smax = std::max(smax, r.count("step") ? r.at("step") : 0.0);
  auto X = [&](double s) { return x0 + (x1 - x0) * (s - 1) / std::max(1.0, smax - 1); };
  auto Y01 = [&](double v) { return y1 - (y1 - y0) * v; };
  auto Yr = [&](double v) { return Y01((v + 1.2) / 2.2); };
  std::ostringstream svg;
  svg << std::fixed << std::setprecision(1);
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  for (int i = 0; i <= 4; ++i) {
    const double v = i / 4.0;
    svg << "<line x1=\"" << x0 << "\" x2=\"" << x1 << "\" y1=\"" << Y01(v) << "\" y2=\"" << Y01(v)
        << "\" stroke=\"#ddd\"/>\n<text x=\"" << x0 - 8 << "\" y=\"" << Y01(v) + 4 << "\" text-anchor=\"end\">"
        << int(v * 100) << "%</text>\n<text x=\"" << x1 + 8 << "\" y=\"" << Y01(v) + 4 << "\">" << std::setprecision(2)
        << (-1.2 + 2.2 * v) << std::setprecision(1) << "</text>\n";
  }
  svg << "<text x=\"" << (x0 + x1) / 2 << "\" y=\"" << H - 15 << "\" text-anchor=\"middle\">RL step (1.." << int(smax)
      << ")</text>\n";
  const std::pair<const char*, const char*> series[] = {
      {"accuracy", "#1f77b4"}, {"tool_use", "#2ca02c"}, {"reward_mean", "#d62728"}};
  int k = 0;
  for (const auto& [key, color] : series) {
    svg << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-width=\"2\" points=\"";
    for (const auto& r : rows_) {
      if (!r.count("step") || !r.count(key)) continue;
      const double v = r.at(key);
      svg << X(r.at("step")) << "," << (std::string(key) == "reward_mean" ? Yr(v) : Y01(v)) << " ";
    }
    svg << "\"/>\n<text x=\"" << x0 + 10 + 150 * k << "\" y=\"" << y0 - 10 << "\" fill=\"" << color << "\">"
        << (k == 2 ? "reward (right axis)" : key) << "</text>\n";
    ++k;
  }
  svg << "</svg>\n";
  const std::string path = (fs::path(out_dir_) / "plot.svg").string();
  std::ofstream f(path + ".tmp");
  f << svg.str();
  f.close();
  fs::rename(path + ".tmp", path);
}

}  // namespace rlt
