// Run set-up, warm-up, schedule, checkpoints and metrics; see run.h.
#include "trainer/run.h"

#include <ftw.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <ATen/core/grad_mode.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <sstream>

#include "data/chat_template.h"
#include "data/synthetic.h"
#include "model/config.h"
#include "rollout/policy.h"
#include "rollout/retool.h"
#include "rollout/sandbox.h"
#include "trainer/batch.h"

namespace rlt {

namespace fs = std::filesystem;

void remove_tree(const std::string& path) {
  nftw(
      path.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }, 16,
      FTW_DEPTH | FTW_PHYS);
}

namespace {

const ToolTags kTags;

at::ScalarType scalar_type(DType d) { return d == DType::kBFloat16 ? at::kBFloat16 : at::kFloat; }

// The text a trained tokenizer learns from: prompts through the chat template and both kinds of
// warm-up traces, so every piece the demo writes is in its vocabulary.
std::vector<std::string> tokenizer_corpus(const Config& c) {
  SyntheticOptions s = c.synthetic;
  s.count = 600;
  s.seed = c.synthetic.seed + 7919;
  std::vector<std::string> docs;
  for (const auto& ex : make_multiplication_tasks(s)) {
    std::string trace = render_prompt(c.chat, ex.prompt);
    for (const auto& seg : tool_use_trace(ex, kTags)) trace += seg.text;
    docs.push_back(trace);
    docs.push_back(render_prompt(c.chat, ex.prompt) + "Answer: \\boxed{" + ex.answer + "}");
  }
  docs.push_back(c.rollout.feedback);
  return docs;
}

std::unique_ptr<Transformer> new_model(const Config& c, int64_t vocab, at::Device device) {
  const ModelOptions& m = c.model;
  nlohmann::json j = {{"model_type", "llama"},
                      {"vocab_size", vocab},
                      {"hidden_size", m.init_hidden},
                      {"intermediate_size", m.init_intermediate},
                      {"num_hidden_layers", m.init_layers},
                      {"num_attention_heads", m.init_heads},
                      {"num_key_value_heads", m.init_kv_heads},
                      {"rms_norm_eps", 1e-6},
                      {"rope_theta", 10000.0},
                      {"tie_word_embeddings", true},
                      {"max_position_embeddings", c.rollout.max_context}};
  return std::make_unique<Transformer>(model_config_from_json(j, "model.init_*"), scalar_type(m.dtype), device,
                                       static_cast<uint64_t>(m.init_seed));
}

// One AdamW: the policy's parameters, then run.extra's (a second group at its own learning rate).
void make_optimizer(Run& run, const ExtraParams& extra) {
  const TrainOptions& t = run.config.train;
  auto o = torch::optim::AdamWOptions(t.lr).betas({t.beta1, t.beta2}).eps(t.adam_eps).weight_decay(t.weight_decay);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(run.policy->parameters(), std::make_unique<torch::optim::AdamWOptions>(o));
  if (!run.extra.empty()) {
    std::vector<at::Tensor> params;
    for (const auto& [name, p] : run.extra) params.push_back(p);
    const double lr = extra.lr && extra.lr(run.config) > 0 ? extra.lr(run.config) : t.lr;
    run.extra_lr_scale = t.lr > 0 ? lr / t.lr : 1.0;
    auto eo = o;
    eo.lr(lr).weight_decay(0.0);  // a head started at zero: no decay towards it
    groups.emplace_back(params, std::make_unique<torch::optim::AdamWOptions>(eo));
  }
  run.optimizer = std::make_unique<torch::optim::AdamW>(std::move(groups), o);
}

std::string checkpoint_dir(const Run& run) { return (fs::path(run.out_dir) / "checkpoint").string(); }

// The rollout's model-side settings.
ModelPolicyOptions policy_options(const RolloutOptions& r) {
  ModelPolicyOptions o;
  o.cuda_graphs = r.cuda_graphs;
  return o;
}

}  // namespace

Run make_run(const Config& config, const std::string& out_dir, bool resume, const ExtraParams& extra) {
  Run run;
  run.config = config;
  run.out_dir = out_dir;
  fs::create_directories(out_dir);
  try {
    run.device = at::Device(config.model.device);
  } catch (const std::exception&) {
    throw RunError("model.device: '" + config.model.device + "' is not a device (cpu, cuda, cuda:N)");
  }
  if (run.device.is_cuda() && !at::hasCUDA()) {
    throw RunError("model.device: " + config.model.device + " requested, but no CUDA device is available");
  }
  // Tokenizer.
  if (!config.model.tokenizer.empty()) {
    run.tokenizer = std::make_unique<Tokenizer>(Tokenizer::load(config.model.tokenizer));
  } else {
    const std::string path = (fs::path(out_dir) / "tokenizer.model").string();
    if (!(resume && fs::exists(path))) {
      TokenizerTrainOptions o;
      o.vocab_size = config.model.tokenizer_vocab;
      o.user_symbols = {kTags.code_open, kTags.code_close, kTags.output_open, kTags.output_close};
      Tokenizer::train(tokenizer_corpus(config), path, o);
    }
    run.tokenizer = std::make_unique<Tokenizer>(Tokenizer::load(path));
  }
  // Model: the checkpoint's when resuming, else the configured checkpoint, else a new one.
  const std::string ckpt = checkpoint_dir(run);
  std::string ckpt_found = fs::exists(ckpt) ? ckpt : fs::exists(ckpt + ".old") ? ckpt + ".old" : "";
  if (resume && ckpt_found.empty()) throw RunError(out_dir + ": --resume, but there is no checkpoint in it");
  if (resume) {
    run.policy = std::make_unique<Transformer>(
        Transformer::load((fs::path(ckpt_found) / "model").string(), scalar_type(config.model.dtype), run.device));
  } else if (!config.model.path.empty()) {
    if (!fs::exists(fs::path(config.model.path) / "config.json")) {
      throw RunError("model.path: " + config.model.path + " holds no config.json");
    }
    run.policy = std::make_unique<Transformer>(
        Transformer::load(config.model.path, scalar_type(config.model.dtype), run.device));
  } else {
    run.policy = new_model(config, run.tokenizer->vocab_size(), run.device);
  }
  if (run.policy->config().vocab_size < run.tokenizer->vocab_size()) {
    throw RunError("model.tokenizer: " + std::to_string(run.tokenizer->vocab_size()) +
                   " pieces, more than the model's vocabulary of " + std::to_string(run.policy->config().vocab_size));
  }
  run.policy->set_activation_checkpointing(config.model.activation_checkpointing);
  // Prompts: the last eval_prompts are held out.
  std::vector<PromptExample> examples = config.train.prompts == PromptSource::kJsonl
                                            ? load_jsonl(config.data).examples
                                            : make_multiplication_tasks(config.synthetic);
  // A prompt that leaves no room for a response is the dataset's problem: say which one, before training.
  for (const auto& ex : examples) {
    const int64_t n = static_cast<int64_t>(encode_prompt(*run.tokenizer, config.chat, ex.prompt).size());
    if (n + 1 >= config.rollout.max_context) {
      throw DataError(ex.source + ": the prompt is " + std::to_string(n) +
                      " tokens after the chat template, which leaves no room for a response within "
                      "rollout.max_context = " +
                      std::to_string(config.rollout.max_context));
    }
  }
  const int64_t n_eval = std::min<int64_t>(config.train.eval_prompts, static_cast<int64_t>(examples.size()) / 2);
  run.eval_set.assign(examples.end() - n_eval, examples.end());
  examples.resize(examples.size() - n_eval);
  run.prompts = std::make_unique<PromptSampler>(std::move(examples), static_cast<uint64_t>(config.train.seed));
  if (extra.make) run.extra = extra.make(*run.policy, config);
  make_optimizer(run, extra);
  if (resume) load_checkpoint(run);
  return run;
}

double learning_rate(const TrainOptions& o, int64_t step, int64_t total) {
  if (step < o.warmup_steps) return o.lr * double(step + 1) / double(o.warmup_steps + 1);
  const double span = std::max<int64_t>(1, total - o.warmup_steps);
  const double progress = std::min(1.0, double(step - o.warmup_steps) / span);  // 0 -> 1 after warm-up
  const double floor = o.lr * o.min_lr_ratio;
  switch (o.lr_schedule) {
    case LrSchedule::kConstant:
      return o.lr;
    case LrSchedule::kLinear:
      return floor + (o.lr - floor) * (1.0 - progress);
    case LrSchedule::kCosine:
      return floor + (o.lr - floor) * 0.5 * (1.0 + std::cos(M_PI * progress));
  }
  return o.lr;
}

void set_learning_rate(torch::optim::AdamW& opt, double lr, double extra_lr_scale) {
  auto& groups = opt.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    static_cast<torch::optim::AdamWOptions&>(groups[g].options()).lr(g == 0 ? lr : lr * extra_lr_scale);
  }
}

void ensure_reference(Run& run) {
  if (run.config.policy.kl_coef <= 0 || run.reference) return;
  const std::string dir = (fs::path(run.out_dir) / "reference").string();
  if (run.step > 0 && fs::exists(fs::path(dir) / "config.json")) {
    run.reference =
        std::make_unique<Transformer>(Transformer::load(dir, scalar_type(run.config.model.dtype), run.device));
    return;
  }
  if (run.step > 0) throw RunError(dir + ": missing; a resumed run with policy.kl_coef > 0 needs its reference");
  run.reference = std::make_unique<Transformer>(run.policy->clone());
  remove_tree(dir + ".tmp");
  run.reference->save(dir + ".tmp");
  remove_tree(dir);
  fs::rename(dir + ".tmp", dir);
}

std::vector<std::vector<int64_t>> encode_prompts(const Run& run, const std::vector<PromptExample>& examples) {
  std::vector<std::vector<int64_t>> out;
  out.reserve(examples.size());
  for (const auto& ex : examples) out.push_back(encode_prompt(*run.tokenizer, run.config.chat, ex.prompt));
  return out;
}

std::vector<PromptExample> warmup_tasks(const SyntheticOptions& task, const SftOptions& o) {
  const int64_t n = o.steps * o.batch_size;
  // Operand lengths (digits_a, digits_b) of the warm-up problems, cycled through problem by problem.
  auto shortest = [&](int64_t digits) {
    return o.operand_digits_min > 0 ? std::min(o.operand_digits_min, digits) : digits;
  };
  std::vector<std::pair<int64_t, int64_t>> shapes;
  for (int64_t a = shortest(task.digits_a); a <= task.digits_a; ++a) {
    for (int64_t b = shortest(task.digits_b); b <= task.digits_b; ++b) shapes.emplace_back(a, b);
  }
  const int64_t S = static_cast<int64_t>(shapes.size());
  std::vector<std::vector<PromptExample>> by_shape(S);
  for (int64_t i = 0; i < S; ++i) {
    SyntheticOptions s = task;
    s.digits_a = shapes[i].first;
    s.digits_b = shapes[i].second;
    s.count = (n + S - 1) / S;
    s.seed = task.seed + 104729 + 7919 * i;  // other problems than the RL prompts
    by_shape[i] = make_multiplication_tasks(s);
  }
  std::vector<PromptExample> tasks;
  tasks.reserve(n);
  for (int64_t k = 0; k < n; ++k) tasks.push_back(by_shape[k % S][k / S]);
  return tasks;
}

double sft_warmup(Run& run) {
  const SftOptions& o = run.config.sft;
  if (o.steps == 0) return 0.0;
  const std::vector<PromptExample> tasks = warmup_tasks(run.config.synthetic, o);
  const auto prompts = encode_prompts(run, tasks);
  torch::optim::AdamW opt(run.policy->parameters(), torch::optim::AdamWOptions(o.lr).weight_decay(0.0));
  TrainOptions sched;
  sched.lr = o.lr;
  sched.lr_schedule = LrSchedule::kCosine;
  sched.min_lr_ratio = 0.1;
  sched.warmup_steps = std::min<int64_t>(20, o.steps / 10);
  // A fixed log-prob path, whatever `loss:` says: the warm-up then ends in the same weights for every
  // loss.impl / row-selection setting, so the README's ablation compares the RL step alone.
  LossOptions lo;
  lo.impl = LogprobImpl::kSelective;
  lo.response_only = true;
  lo.loss_mask_only = true;
  lo.entropy = EntropyMode::kNone;
  double loss_value = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t step = 0; step < o.steps; ++step) {
    std::vector<Trajectory> batch;
    for (int64_t i = 0; i < o.batch_size; ++i) {
      const int64_t k = step * o.batch_size + i;
      Trajectory t;
      t.prompt_ids = prompts[k];
      // A fixed share uses the tool (a deterministic interleave, not a random draw).
      const bool tool = std::floor((k + 1) * o.tool_fraction) > std::floor(k * o.tool_fraction);
      std::vector<TraceSegment> segs =
          tool ? tool_use_trace(tasks[k], kTags)
               : std::vector<TraceSegment>{{"Answer: \\boxed{" + tasks[k].answer + "}", true}};
      for (const auto& seg : segs) {
        for (int64_t id : run.tokenizer->encode(seg.text)) {
          t.response_ids.push_back(id);
          t.loss_mask.push_back(seg.trainable ? 1 : 0);
          t.logprobs.push_back(0.0f);
        }
      }
      batch.push_back(std::move(t));
    }
    set_learning_rate(opt, learning_rate(sched, step, o.steps));
    opt.zero_grad();
    PackedBatch b = pack(batch, 0, static_cast<int64_t>(batch.size()), run.device);
    ResponseLogprobs r = response_logprobs(*run.policy, b, lo);
    at::Tensor loss = -(r.logprobs * b.loss_mask).sum() / b.loss_mask.sum().clamp_min(1);  // token-mean NLL
    loss.backward();
    torch::nn::utils::clip_grad_norm_(run.policy->parameters(), 1.0);
    opt.step();
    loss_value = loss.item<double>();
    if (step % 20 == 0 || step + 1 == o.steps) {
      const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::cerr << "\rwarm-up " << step + 1 << "/" << o.steps << "  loss " << std::fixed << std::setprecision(4)
                << loss_value << "  " << std::setprecision(1) << sec << " s" << std::flush;
    }
  }
  std::cerr << "\n";
  return loss_value;
}

RolloutBatch collect_rollouts(Run& run, const ToolRunner& tools) {
  const Config& cfg = run.config;
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t P = cfg.train.prompts_per_step;
  RolloutBatch out;
  const int64_t first_draw = run.prompts->consumed();
  out.examples = run.prompts->next(P);
  std::vector<int64_t> streams(P);
  for (int64_t i = 0; i < P; ++i) streams[i] = first_draw + i;
  SamplingOptions sampling = cfg.sampling;
  sampling.seed = cfg.sampling.seed + cfg.train.seed * 1000003 + run.step;
  {
    at::NoGradGuard no_grad;
    ModelPolicy policy(*run.policy, policy_options(cfg.rollout));
    out.trajs = rollout(policy, *run.tokenizer, encode_prompts(run, out.examples), sampling, cfg.rollout, tools,
                        streams, kTags, &out.stats);
  }
  std::vector<std::string> answers;
  for (const auto& ex : out.examples) answers.push_back(ex.answer);
  assign_rewards(out.trajs, answers, cfg.reward);
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

std::vector<std::pair<int64_t, int64_t>> micro_batch_ranges(int64_t S, int64_t mini, int64_t micro) {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (int64_t mb = 0; mb < S; mb += mini) {
    const int64_t mb_end = std::min(S, mb + mini);
    for (int64_t b = mb; b < mb_end; b += micro) ranges.push_back({b, std::min(mb_end, b + micro)});
  }
  return ranges;
}

double mini_batch_denominator(const std::vector<Trajectory>& trajs, int64_t begin, int64_t end, LossAgg agg) {
  double tokens = 0, nonempty = 0;
  for (int64_t s = begin; s < end; ++s) {
    const int64_t n = trajs[s].sampled_tokens();
    tokens += n;
    nonempty += n > 0;
  }
  switch (agg) {
    case LossAgg::kTokenMean:
      return std::max(1.0, tokens);
    case LossAgg::kSeqMeanTokenMean:
      return std::max(1.0, nonempty);
    default:
      return std::max<double>(1.0, end - begin);
  }
}

double apply_gradients(Run& run, const std::vector<at::Tensor>& params, double loss, int64_t total_optimizer_steps) {
  const double clip = run.config.train.grad_clip;
  const double norm = torch::nn::utils::clip_grad_norm_(params, clip > 0 ? clip : INFINITY);
  if (!std::isfinite(loss) || !std::isfinite(norm)) {
    run.optimizer->zero_grad();  // never applied
    ++run.skipped_steps;
    std::cerr << "warning: step " << run.step + 1 << ": non-finite loss or gradient, update skipped\n";
    return norm;
  }
  set_learning_rate(*run.optimizer, learning_rate(run.config.train, run.optimizer_steps, total_optimizer_steps),
                    run.extra_lr_scale);
  run.optimizer->step();
  ++run.optimizer_steps;
  return norm;
}

void PhasePeaks::end(const std::string& name) {
  mib_["peak_memory_" + name + "_mib"] = current_->peak_extra_bytes() / 1048576.0;
  current_.emplace(device_);
}

std::map<std::string, double> PhasePeaks::metrics() const {
  std::map<std::string, double> out = mib_;
  double top = 0;
  for (const auto& [name, mib] : mib_) top = std::max(top, mib);
  out["peak_memory_mib"] = top;
  return out;
}

std::map<std::string, double> rollout_metrics(const Run& run, const RolloutBatch& rb) {
  const std::vector<Trajectory>& trajs = rb.trajs;
  const double S = static_cast<double>(trajs.size());
  double correct = 0, tool_use = 0, tool_calls = 0, truncated = 0, len_sum = 0, len_max = 0, r_sum = 0;
  double sampled = 0, tokens = 0;
  for (const auto& t : trajs) {
    sampled += t.sampled_tokens();
    tokens += t.window_end();
    correct += t.correct;
    tool_use += t.tool_calls > 0;
    tool_calls += t.tool_calls;
    truncated += t.truncated;
    len_sum += t.response_ids.size();
    len_max = std::max<double>(len_max, t.response_ids.size());
    r_sum += t.reward;
  }
  const double r_mean = r_sum / S;
  double r_var = 0;
  for (const auto& t : trajs) r_var += (t.reward - r_mean) * (t.reward - r_mean);
  const double r_std = S > 1 ? std::sqrt(r_var / (S - 1)) : 0.0;
  const int64_t step = run.step + 1;
  if (r_std == 0) {
    std::cerr << "warning: step " << step << ": every reward is " << r_mean << ": zero advantage, zero gradient\n";
  }
  if (truncated > 0.5 * S) {
    std::cerr << "warning: step " << step << ": " << int(100 * truncated / S)
              << "% of completions hit a length limit (sampling.max_new_tokens / rollout.max_context)\n";
  }
  return {{"reward_mean", r_mean},
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
          {"rollout_forced_tokens", double(rb.stats.forced_tokens)}};
}

void log_samples(const Run& run, const std::vector<Trajectory>& trajs) {
  const int64_t n = std::min<int64_t>(run.config.train.log_samples, static_cast<int64_t>(trajs.size()));
  if (n == 0) return;
  std::ofstream f((fs::path(run.out_dir) / "samples.jsonl").string(), run.step == 0 ? std::ios::trunc : std::ios::app);
  for (int64_t i = 0; i < n; ++i) {
    const Trajectory& t = trajs[i];
    nlohmann::json j = {{"step", run.step + 1},
                        {"prompt", run.tokenizer->decode(t.prompt_ids)},
                        {"response", run.tokenizer->decode(t.response_ids)},
                        {"reward", t.reward},
                        {"correct", t.correct},
                        {"finish", enum_to_string(t.finish)},
                        {"tool_calls", t.tool_calls},
                        {"response_tokens", t.response_ids.size()},
                        {"sampled_tokens", t.sampled_tokens()}};
    f << j.dump() << "\n";
  }
}

double report_evaluation(Run& run, const char* when) {
  const auto [accuracy, tool_use] = evaluate(run);
  std::cerr << "eval " << when << " RL: accuracy " << 100 * accuracy << "%, tool use " << 100 * tool_use << "%\n";
  return accuracy;
}

std::pair<double, double> evaluate(Run& run) {
  if (run.eval_set.empty()) return {0.0, 0.0};
  at::NoGradGuard no_grad;
  SamplingOptions s = run.config.sampling;
  s.temperature = 0;
  s.samples_per_prompt = 1;
  SandboxPool pool(run.config.sandbox);
  ToolRunner tools = [&pool](const std::string& code) { return pool.submit(code); };
  ModelPolicy policy(*run.policy, policy_options(run.config.rollout));
  auto trajs = rollout(policy, *run.tokenizer, encode_prompts(run, run.eval_set), s, run.config.rollout, tools);
  std::vector<std::string> answers;
  for (const auto& ex : run.eval_set) answers.push_back(ex.answer);
  assign_rewards(trajs, answers, run.config.reward);
  double correct = 0, tool = 0;
  for (const auto& t : trajs) {
    correct += t.correct;
    tool += t.tool_calls > 0;
  }
  return {correct / trajs.size(), tool / trajs.size()};
}

void save_checkpoint(Run& run) {
  const auto& extra = run.extra;
  const std::string dir = checkpoint_dir(run), tmp = dir + ".tmp", old = dir + ".old";
  remove_tree(tmp);
  fs::create_directories(tmp);
  run.policy->save((fs::path(tmp) / "model").string());
  torch::save(*run.optimizer, (fs::path(tmp) / "optimizer.pt").string());
  if (!extra.empty()) {
    torch::serialize::OutputArchive a;
    for (const auto& [name, t] : extra) a.write(name, t.detach().cpu());
    a.save_to((fs::path(tmp) / "extra.pt").string());
  }
  nlohmann::json state = {{"step", run.step},
                          {"optimizer_steps", run.optimizer_steps},
                          {"skipped_steps", run.skipped_steps},
                          {"prompts_consumed", run.prompts->consumed()}};
  {
    std::ofstream f((fs::path(tmp) / "state.json").string());
    f << state.dump(2) << "\n";
    if (!f) throw RunError(tmp + "/state.json: cannot write");
  }
  // The previous checkpoint is moved aside, not deleted, until the new one is in place.
  remove_tree(old);
  if (fs::exists(dir)) fs::rename(dir, old);
  fs::rename(tmp, dir);
  remove_tree(old);
}

void load_checkpoint(Run& run) {
  std::string dir = checkpoint_dir(run);
  if (!fs::exists(dir)) dir += ".old";  // interrupted between the two renames
  const std::string state_path = (fs::path(dir) / "state.json").string();
  std::ifstream f(state_path);
  if (!f) throw RunError(state_path + ": missing; the checkpoint is incomplete");
  nlohmann::json state;
  try {
    state = nlohmann::json::parse(f);
    run.step = state.at("step").get<int64_t>();
    run.optimizer_steps = state.at("optimizer_steps").get<int64_t>();
    run.skipped_steps = state.at("skipped_steps").get<int64_t>();
    run.prompts->seek(state.at("prompts_consumed").get<int64_t>());
  } catch (const nlohmann::json::exception& e) {
    throw RunError(state_path + ": " + e.what());
  }
  try {
    torch::load(*run.optimizer, (fs::path(dir) / "optimizer.pt").string());
    if (!run.extra.empty()) {
      torch::serialize::InputArchive a;
      a.load_from((fs::path(dir) / "extra.pt").string());
      for (auto& [name, t] : run.extra) {
        at::Tensor v;
        a.read(name, v);
        at::NoGradGuard no_grad;
        t.copy_(v);
      }
    }
  } catch (const c10::Error& e) {
    throw RunError(dir + ": cannot restore the optimizer state: " + e.what_without_backtrace());
  }
}

MetricsLog::MetricsLog(const std::string& out_dir, bool append) : out_dir_(out_dir) {
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

void MetricsLog::write(const std::map<std::string, double>& m) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [k, v] : m) j[k] = std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr);
  file_ << j.dump() << "\n";
  file_.flush();
  rows_.push_back(m);
  auto get = [&](const char* k) { return m.count(k) ? m.at(k) : 0.0; };
  std::ostringstream line;
  line << std::fixed << "step " << int64_t(get("step")) << "/" << int64_t(get("steps")) << "  reward "
       << std::setprecision(3) << get("reward_mean") << "  acc " << std::setprecision(0) << 100 * get("accuracy")
       << "%  tool " << 100 * get("tool_use") << "%  len " << std::setprecision(1) << get("response_length_mean")
       << "  loss " << std::setprecision(4) << get("loss") << "  kl " << get("kl") << "  " << std::setprecision(1)
       << get("time_step_s") << " s";
  std::cerr << line.str() << "\n";
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
