// Run set-up, one step's rollout and the evaluation; see run.h.
#include "trainer/run.h"

#include <ATen/core/grad_mode.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <sstream>

#include "common/files.h"
#include "data/chat_template.h"
#include "data/synthetic.h"
#include "model/config.h"
#include "rollout/policy.h"
#include "rollout/retool.h"
#include "rollout/sandbox.h"
#include "trainer/batch.h"
#include "trainer/checkpoint.h"
#include "trainer/metrics.h"
#include "trainer/optim.h"
#include "trainer/warmup.h"

namespace rlt {

namespace fs = std::filesystem;

namespace {

at::ScalarType scalar_type(DType d) { return d == DType::kBFloat16 ? at::kBFloat16 : at::kFloat; }

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

// The rollout's model-side settings.
ModelPolicyOptions policy_options(const RolloutOptions& r) {
  ModelPolicyOptions o;
  o.cuda_graphs = r.cuda_graphs;
  o.fused_kernels = r.fused_kernels;
  o.packed_weights = r.packed_weights;
  return o;
}

// The run's tool protocol: rollout.tool_format and tool_name; the reply in the chat template's own tool
// turn when prompts go through the model's template, else in <interpreter> blocks.
ToolProtocol tool_protocol(const Config& c, const std::shared_ptr<const HfChatTemplate>& chat) {
  ToolProtocol p;
  p.format = c.rollout.tool_format;
  p.tool_name = c.rollout.tool_name;
  if (chat && c.rollout.tools) {
    try {
      use_template_reply(p, chat, nlohmann::ordered_json::parse(c.chat.template_vars));
    } catch (const DataError& e) {
      throw RunError(std::string("chat.template: model with rollout.tools: ") + e.what());
    }
  }
  return p;
}

// A prompt that leaves no room for a response is the dataset's problem: say which one, before training.
void check_prompt_lengths(const Run& run, const std::vector<PromptExample>& examples) {
  for (const auto& ex : examples) {
    int64_t n = 0;
    try {
      n = static_cast<int64_t>(encode_prompts(run, {ex}).front().size());
    } catch (const jinja::TemplateRaise& e) {
      throw DataError(ex.source + ": the chat template refuses this prompt: " + e.what());
    }
    if (n + 1 >= run.config.rollout.max_context) {
      throw DataError(ex.source + ": the prompt is " + std::to_string(n) +
                      " tokens after the chat template, which leaves no room for a response within "
                      "rollout.max_context = " +
                      std::to_string(run.config.rollout.max_context));
    }
  }
}

}  // namespace

Run make_run(const Config& config, const std::string& out_dir, bool resume, const ExtraParams& extra) {
  Run run;
  run.config = config;
  // One temperature: the trainer scores the distribution it samples from (greedy decoding scores at 1,
  // as the sampler reports its log-probs).
  run.config.loss.temperature = config.sampling.temperature > 0 ? config.sampling.temperature : 1.0;
  run.out_dir = out_dir;
  run.old_logprobs = config.train.old_logprobs;  // a resumed run's switch comes from its checkpoint
  run.tools = tool_protocol(config, nullptr);    // the model's template, when used, reframes the reply below
  fs::create_directories(out_dir);
  try {
    run.device = at::Device(config.model.device);
  } catch (const std::exception&) {
    throw RunError("model.device: '" + config.model.device + "' is not a device (cpu, cuda, cuda:N)");
  }
  if (run.device.is_cuda() && !at::hasCUDA()) {
    throw RunError("model.device: " + config.model.device + " requested, but no CUDA device is available");
  }
  // Tokenizer: model.tokenizer (a file or a folder) when set; else the checkpoint's own (tokenizer.json,
  // then tokenizer.model); only the built-in demo, with no checkpoint, trains one.
  if (!config.model.tokenizer.empty()) {
    run.tokenizer = std::make_unique<Tokenizer>(Tokenizer::load(config.model.tokenizer));
  } else if (!config.model.path.empty()) {
    if (!fs::is_directory(config.model.path)) throw RunError("model.path: " + config.model.path + " is not a folder");
    try {
      run.tokenizer = std::make_unique<Tokenizer>(Tokenizer::from_checkpoint(config.model.path));
    } catch (const DataError& e) {
      throw RunError(std::string("model.path: ") + e.what() +
                     " (a checkpoint is trained with its own tokenizer; set model.tokenizer to use another)");
    }
  } else {
    const std::string path = (fs::path(out_dir) / "tokenizer.model").string();
    if (!(resume && fs::exists(path))) {
      TokenizerTrainOptions o;
      o.vocab_size = config.model.tokenizer_vocab;
      o.user_symbols = run.tools.symbols();
      Tokenizer::train(tokenizer_corpus(config, run.tools), path, o);
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
  // Stop ids: generation_config.json's eos_token_id (one or a list) and the tokenizer's EOS; rollout.stop
  // adds a stop string.
  if (!config.model.path.empty()) {
    for (int64_t id : generation_eos_ids(config.model.path)) run.config.rollout.stop_ids.push_back(id);
  }
  if (run.tokenizer->eos_id() >= 0) run.config.rollout.stop_ids.push_back(run.tokenizer->eos_id());
  if (run.config.rollout.stop_ids.empty()) {
    throw RunError("model: neither generation_config.json nor the tokenizer names an end-of-sequence token");
  }
  if (run.policy->config().vocab_size < run.tokenizer->vocab_size()) {
    throw RunError("model.tokenizer: " + std::to_string(run.tokenizer->vocab_size()) +
                   " pieces, more than the model's vocabulary of " + std::to_string(run.policy->config().vocab_size));
  }
  run.policy->set_activation_checkpointing(config.model.activation_checkpointing);
  // The chat template: the model's own (from model.tokenizer when it is a folder, else model.path).
  if (config.chat.template_kind == ChatTemplateKind::kModel) {
    const std::string dir = fs::is_directory(config.model.tokenizer) ? config.model.tokenizer : config.model.path;
    if (dir.empty()) throw RunError("chat.template: model needs a checkpoint folder (model.path) that has one");
    try {
      run.chat = std::make_shared<HfChatTemplate>(HfChatTemplate::from_folder(dir));
    } catch (const DataError& e) {
      throw RunError(std::string("chat.template: model: ") + e.what());
    }
    run.tools = tool_protocol(config, run.chat);
  }
  // Prompts: the last eval_prompts are held out.
  std::vector<PromptExample> examples = config.train.prompts == PromptSource::kJsonl
                                            ? load_jsonl(config.data).examples
                                            : make_multiplication_tasks(config.synthetic);
  check_prompt_lengths(run, examples);
  if (!config.data.eval_path.empty()) {
    // Its own file (AIME 2024: problem / zero-padded answer): every row, or the first eval_prompts.
    DatasetOptions eo = config.data.eval_options();
    eo.max_examples = config.train.eval_prompts;
    run.eval_set = load_jsonl(eo).examples;
    check_prompt_lengths(run, run.eval_set);
  } else {
    const int64_t n_eval = std::min<int64_t>(config.train.eval_prompts, static_cast<int64_t>(examples.size()) / 2);
    run.eval_set.assign(examples.end() - n_eval, examples.end());
    examples.resize(examples.size() - n_eval);
  }
  run.prompts = std::make_unique<PromptSampler>(std::move(examples), static_cast<uint64_t>(config.train.seed));
  if (extra.make) run.extra = extra.make(*run.policy, config);
  make_optimizer(run, extra);
  {
    int64_t n = 0;
    for (const auto& p : run.policy->parameters()) n += p.numel();
    // AdamW's two moments take its parameters' dtype: fp32 with master weights, else the model's.
    const int64_t moments = 2 * n * (run.master.empty() ? run.policy->lm_head().element_size() : 4);
    std::cerr << "optimizer: AdamW over " << n << " parameters, "
              << (run.master.empty() ? std::string("in the model's dtype")
                                     : "on fp32 master weights (" + std::to_string(optimizer_memory_bytes(run) >> 20) +
                                           " MiB) while the model computes in bf16")
              << "; moments " << (moments >> 20) << " MiB once stepped\n";
  }
  if (resume) load_checkpoint(run);
  return run;
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
  // tool_call format through the model's template: the template lists the tool (Qwen's <tools> block).
  const bool list_tool = run.config.rollout.tools && run.tools.format == ToolFormat::kToolCall;
  const nlohmann::ordered_json tools =
      list_tool ? nlohmann::ordered_json::array({run.tools.tool_schema()}) : nlohmann::ordered_json();
  std::vector<std::vector<int64_t>> out;
  out.reserve(examples.size());
  for (const auto& ex : examples) {
    out.push_back(run.chat ? encode_chat(*run.tokenizer, *run.chat, run.config.chat, ex.messages, ex.prompt, tools)
                           : encode_prompt(*run.tokenizer, run.config.chat, ex.prompt));
  }
  return out;
}

ToolRunner tool_runner(Run& run) {
  if (!run.sandbox) run.sandbox = std::make_shared<SandboxPool>(run.config.sandbox);
  std::shared_ptr<SandboxPool> pool = run.sandbox;
  return [pool](const std::string& code) { return pool->submit(code); };
}

RolloutBatch collect_rollouts(Run& run) {
  const ToolRunner tools = tool_runner(run);
  const Config& cfg = run.config;
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t P = cfg.train.prompts_per_step;
  RolloutBatch out;
  const int64_t first_draw = run.prompts->consumed();
  out.examples = run.prompts->next(P);
  std::vector<int64_t> streams(P);
  for (int64_t i = 0; i < P; ++i) streams[i] = first_draw + i;
  SamplingOptions sampling = cfg.sampling;
  sampling.seed = cfg.train.seed * 1000003 + run.step;
  {
    at::NoGradGuard no_grad;
    ModelPolicy policy(*run.policy, policy_options(cfg.rollout));
    out.trajs = rollout(policy, *run.tokenizer, encode_prompts(run, out.examples), sampling, cfg.rollout, tools,
                        streams, run.tools, &out.stats);
  }
  std::vector<std::string> answers;
  for (const auto& ex : out.examples) answers.push_back(ex.answer);
  assign_rewards(out.trajs, answers, cfg.reward);
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

double begin_training(Run& run) {
  if (!run.device.is_cuda()) install_cpu_memory_tracking();
  run.log = std::make_shared<MetricsLog>(run.out_dir, /*append=*/run.step > 0);
  const bool fresh = run.step == 0;
  if (fresh && run.config.sft.steps > 0) sft_warmup(run);
  ensure_reference(run);  // only when policy.kl_coef > 0: the policy RL starts from
  return fresh && !run.eval_set.empty() ? report_evaluation(run, "before RL").pass1 : NAN;
}

void end_training(Run& run, double eval_start, std::map<std::string, double>& m) {
  if (run.eval_set.empty() || run.step != run.config.train.steps) return;
  const double pass1 = run.last_eval_step == run.step ? run.last_eval_pass1 : report_evaluation(run, "after RL").pass1;
  if (std::isfinite(eval_start)) m["eval_accuracy_start"] = eval_start;
  m["eval_accuracy_end"] = pass1;
}

std::map<std::string, double> periodic_evaluation(Run& run) {
  const int64_t every = run.config.train.eval_every;
  if (run.eval_set.empty() || every <= 0 || !(run.step % every == 0 || run.step == run.config.train.steps)) return {};
  const EvalResult r = report_evaluation(run, "after step " + std::to_string(run.step));
  return {{"eval_pass@1", r.pass1}, {"eval_pass@k", r.pass_k}, {"eval_tool_use", r.tool_use}};
}

EvalResult report_evaluation(Run& run, const std::string& when) {
  const EvalResult r = evaluate(run);
  std::cerr << "eval " << when << ": pass@1 " << 100 * r.pass1 << "%";
  if (r.k > 1) std::cerr << " (" << r.k << " samples), pass@" << r.k << " " << 100 * r.pass_k << "%";
  std::cerr << ", tool use " << 100 * r.tool_use << "%\n";
  run.last_eval_step = static_cast<double>(run.step);
  run.last_eval_pass1 = r.pass1;
  return r;
}

EvalResult evaluate(Run& run) {
  if (run.eval_set.empty()) return EvalResult{};
  at::NoGradGuard no_grad;
  const int64_t k = run.config.train.eval_samples;
  SamplingOptions s = run.config.sampling;
  if (k == 1) s.temperature = 0;  // greedy
  s.samples_per_prompt = k;
  // Its own noise, fixed per step, 2^40 above the training rollouts' seeds (train.seed * 1000003 + step).
  s.seed = run.config.train.seed * 1000003 + run.step + (int64_t{1} << 40);
  ModelPolicy policy(*run.policy, policy_options(run.config.rollout));
  auto trajs = rollout(policy, *run.tokenizer, encode_prompts(run, run.eval_set), s, run.config.rollout,
                       tool_runner(run), {}, run.tools);
  std::vector<std::string> answers;
  for (const auto& ex : run.eval_set) answers.push_back(ex.answer);
  assign_rewards(trajs, answers, run.config.reward);
  return summarize_evaluation(trajs, k);
}

EvalResult summarize_evaluation(const std::vector<Trajectory>& trajs, int64_t k) {
  TORCH_CHECK(k >= 1 && !trajs.empty() && trajs.size() % k == 0, "summarize_evaluation: ", trajs.size(),
              " completions are not whole groups of k = ", k);
  EvalResult r;
  r.k = k;
  const size_t P = trajs.size() / k;
  for (size_t p = 0; p < P; ++p) {
    int64_t correct = 0;
    for (int64_t g = 0; g < k; ++g) {
      const Trajectory& t = trajs[p * k + g];  // prompt-major
      correct += t.correct;
      r.tool_use += t.tool_calls > 0;
    }
    r.pass1 += static_cast<double>(correct) / k;
    r.pass_k += correct > 0;
  }
  r.pass1 /= P;
  r.pass_k /= P;
  r.tool_use /= static_cast<double>(trajs.size());
  return r;
}

}  // namespace rlt
