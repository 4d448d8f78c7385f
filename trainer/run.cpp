// Run set-up, one step's rollout and the evaluation; see run.h.
#include "trainer/run.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iomanip>
#include <iostream>
#include <numeric>
#include <sstream>

#include <sched.h>
#include <unistd.h>

#include "common/files.h"
#include "common/timing.h"
#include "data/chat_template.h"
#include "data/synthetic.h"
#include "model/config.h"
#include "model/peft.h"
#include "parallel/shard.h"
#include "rollout/engine.h"
#include "rollout/retool.h"
#include "rollout/sandbox.h"
#include "trainer/batch.h"
#include "trainer/checkpoint.h"
#include "trainer/critic.h"
#include "trainer/grpo.h"
#include "trainer/memory_plan.h"
#include "trainer/metrics.h"
#include "trainer/optim.h"
#include "trainer/rewards.h"
#include "trainer/rollout_ranks.h"
#include "trainer/warmup.h"

namespace rlt {

namespace fs = std::filesystem;

at::ScalarType scalar_type(DType d) { return d == DType::kBFloat16 ? at::kBFloat16 : at::kFloat; }

namespace {

// The config of a new model (model.path empty): llama-style, from model.init_*.
ModelConfig new_model_config(const Config& c, int64_t vocab) {
  const ModelOptions& m = c.model;
  const nlohmann::json j = {{"model_type", "llama"},
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
  return model_config_from_json(j, "model.init_*");
}

std::unique_ptr<Transformer> new_model(const Config& c, int64_t vocab, at::Device device) {
  return std::make_unique<Transformer>(new_model_config(c, vocab), scalar_type(c.model.dtype), device,
                                       static_cast<uint64_t>(c.model.init_seed));
}

// The memory plan (trainer/memory_plan.h), before any weight is loaded: printed by rank 0, and a run that
// cannot fit the smallest device of its ranks is refused (RunError) with the numbers and what would fit.
// The run keeps the plan's figures for its metrics (RunMetrics::plan_bytes).
void check_memory(Run& run, const ModelConfig& mc) {
  const int world = run.dist->world();
  const MemoryPlan plan =
      run.rollout_rank ? plan_rollout_rank(run.config, mc, world) : plan_memory(run.config, mc, world);
  run.metrics.plan_rollout_bytes = plan.persistent() + plan.rollout_phase();
  run.metrics.plan_update_bytes = plan.persistent() + plan.update_phase();
  run.metrics.plan_bytes = plan.device_total();
  if (run.lead() || (run.rollout_rank && run.dist->lead())) std::cerr << plan.table() << std::flush;
  at::Tensor low = at::tensor({-double(device_memory_bytes(run.device))}, at::kDouble);
  run.dist->all_reduce({low}, ReduceOp::kMax);  // the smallest device: every rank refuses alike
  const int64_t device_bytes = int64_t(-low.item<double>());
  if (run.rollout_rank && device_bytes > 0 && plan.device_total() > device_bytes) {
    throw RunError("a rollout rank's memory plan needs " + std::to_string(plan.device_total() >> 20) +
                   " MiB and its device has " + std::to_string(device_bytes >> 20) + " MiB:\n" + plan.table() +
                   "fewer rows fit: lower rollout.max_batch, or add rollout ranks (train.rollout_ranks)");
  }
  if (run.rollout_rank) return;
  check_memory_plan(plan, run.config, mc, world, device_bytes);
  // Pinned host memory: the ranks of one host share it. The most ranks on a host and the least memory any
  // host has available, so that every rank refuses alike.
  at::Tensor host = at::tensor({double(ranks_on_this_host(*run.dist)), -double(host_memory_bytes())}, at::kDouble);
  run.dist->all_reduce({host}, ReduceOp::kMax);
  check_host_memory(plan, int(host[0].item<double>()), int64_t(-host[1].item<double>()));
  const int64_t fewer = fewest_checkpointed_layers(run.config, mc, world, device_bytes);
  if (fewer >= 0 && run.lead()) {
    Config x = run.config;
    x.model.checkpoint_layers = fewer;
    std::cerr << "fewer checkpointed layers fit: model.checkpoint_layers: " << fewer << " of " << mc.num_layers
              << " plans " << (plan_memory(x, mc, world).device_total() >> 20) << " MiB of the device's "
              << (device_bytes >> 20) << " (a shorter update: those layers are not recomputed)\n";
  }
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
      n = static_cast<int64_t>(encode_prompts(run.data, run.config, run.rollout.tools, {ex}).front().size());
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

EngineOptions engine_options(const RolloutOptions& r) {
  EngineOptions o;
  o.switches = r.engine;
  o.max_slots = r.max_context;  // no sequence holds more: the cache stops growing where the plan counts it
  return o;
}

// Every rank's host name, hashed into a slot of its own and gathered by a sum.
int ranks_on_this_host(Collectives& dist) {
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  const double mine = double(std::hash<std::string>{}(name) & ((uint64_t{1} << 52) - 1)) + 1;  // exact, never 0
  at::Tensor all = at::zeros({dist.world()}, at::kDouble);
  all[dist.rank()] = mine;
  dist.all_reduce({all}, ReduceOp::kSum);
  return int((all == mine).sum().item<int64_t>());
}

int rank_cpu_threads(int64_t configured, int user, const HostCpus& cpus, int ranks_on_host) {
  if (configured > 0) return int(configured);
  if (user > 0) return user;
  if (cpus.allowed < cpus.online) return std::max(1, cpus.allowed);
  return std::max(1, cpus.allowed / std::max(1, ranks_on_host));
}

int user_omp_threads(const std::function<const char*(const char*)>& env) {
  const char* v = env("OMP_NUM_THREADS");
  if (!v) return 0;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (end == v || *end != '\0' || n <= 0 || n > 4096) return 0;
  if (n == 1 && env("TORCHELASTIC_RUN_ID")) return 0;  // torchrun's default for every rank
  return int(n);
}

HostCpus host_cpus() {
  HostCpus c;
  c.online = std::max(1, int(sysconf(_SC_NPROCESSORS_ONLN)));
  cpu_set_t set;
  CPU_ZERO(&set);
  c.allowed = sched_getaffinity(0, sizeof set, &set) == 0 ? std::max(1, CPU_COUNT(&set)) : c.online;
  return c;
}

Run make_run(const Config& config, const std::string& out_dir, bool resume, const ExtraParams& extra,
             std::shared_ptr<Collectives> dist, std::shared_ptr<Placement> placement) {
  Run run;
  // A critic of its own is PPO's, which makes its run with the value head's ExtraParams.
  if (!config.critic.shared && !extra.make) {
    throw RunError("critic.shared: false trains a critic model, which only ppo_train has");
  }
  if (dist) run.dist = std::move(dist);
  if (placement) {
    TORCH_CHECK(placement->side == run.dist, "make_run: with a placement, dist is its side");
    check_placement(config, placement->all->world());
    run.rollout_rank = placement->rollout;
    run.placement = std::move(placement);
  } else {
    check_world(config, run.dist->world());
  }
  run.config = config;
  // One temperature: the trainer scores the distribution it samples from (greedy decoding scores at 1,
  // as the sampler reports its log-probs).
  run.config.loss.temperature = config.sampling.temperature > 0 ? config.sampling.temperature : 1.0;
  run.out_dir = out_dir;
  run.old_logprobs = config.train.old_logprobs;        // a resumed run's switch comes from its checkpoint
  run.rollout.tools = tool_protocol(config, nullptr);  // the model's template, when used, reframes the reply below
  fs::create_directories(out_dir);
  try {
    run.device = at::Device(config.model.device);
  } catch (const std::exception&) {
    throw RunError("model.device: '" + config.model.device + "' is not a device (cpu, cuda, cuda:N)");
  }
  if (run.device.is_cuda() && !at::hasCUDA()) {
    throw RunError("model.device: " + config.model.device + " requested, but no CUDA device is available");
  }
  // train.offload_step auto, decided from the most ranks any host of the run has, so that every rank steps
  // alike; the memory plan and the optimizer then see host or device.
  if (config.train.offload == Offload::kOptimizer && config.train.offload_step == OffloadStep::kAuto) {
    at::Tensor most = at::tensor({double(ranks_on_this_host(*run.dist))}, at::kDouble);
    run.dist->all_reduce({most}, ReduceOp::kMax);
    const bool streams =
        offload_mode(OffloadStep::kAuto, run.device.is_cuda(), int(most.item<double>())) == OffloadMode::kStreamDevice;
    run.config.train.offload_step = streams ? OffloadStep::kDevice : OffloadStep::kHost;
  }
  // Tokenizer: model.tokenizer (a file or a folder) when set; else the checkpoint's own (tokenizer.json,
  // then tokenizer.model); only the built-in demo, with no checkpoint, trains one.
  if (!config.model.tokenizer.empty()) {
    run.data.tokenizer = std::make_unique<Tokenizer>(Tokenizer::load(config.model.tokenizer));
  } else if (!config.model.path.empty()) {
    if (!fs::is_directory(config.model.path)) throw RunError("model.path: " + config.model.path + " is not a folder");
    try {
      run.data.tokenizer = std::make_unique<Tokenizer>(Tokenizer::from_checkpoint(config.model.path));
    } catch (const DataError& e) {
      throw RunError(std::string("model.path: ") + e.what() +
                     " (a checkpoint is trained with its own tokenizer; set model.tokenizer to use another)");
    }
  } else {
    // Rank 0 trains it into the run folder; the others wait for it and load the same file.
    const std::string path = (fs::path(out_dir) / "tokenizer.model").string();
    if (run.lead() && !(resume && fs::exists(path))) {
      TokenizerTrainOptions o;
      o.vocab_size = config.model.tokenizer_vocab;
      o.model_type = config.model.tokenizer_type == TokenizerType::kBpe ? "bpe" : "unigram";
      o.user_symbols = run.rollout.tools.symbols();
      Tokenizer::train(tokenizer_corpus(config, run.rollout.tools), path, o);
    }
    (run.placement ? *run.placement->all : *run.dist).barrier();  // rank 0 of the job trains it
    run.data.tokenizer = std::make_unique<Tokenizer>(Tokenizer::load(path));
  }
  // Model: the checkpoint's when resuming, else the configured checkpoint, else a new one. With LoRA the
  // base is always the configured one (or the new one of model.init_seed); the checkpoint holds adapters.
  const std::string ckpt = checkpoint_dir(run);
  std::string ckpt_found = fs::exists(ckpt) ? ckpt : fs::exists(ckpt + ".old") ? ckpt + ".old" : "";
  if (resume && ckpt_found.empty()) throw RunError(out_dir + ": --resume, but there is no checkpoint in it");
  if (resume && fs::exists(fs::path(ckpt_found) / "adapter") != config.lora.enabled()) {
    throw RunError(ckpt_found + ": the checkpoint holds " +
                   (config.lora.enabled() ? "a whole model, and lora.rank is " + std::to_string(config.lora.rank)
                                          : std::string("LoRA adapters, and lora.rank is 0")) +
                   ": resume with the lora section the run was trained with");
  }
  {
    const std::string from =
        resume && !config.lora.enabled() ? (fs::path(ckpt_found) / "model").string() : config.model.path;
    if (!from.empty() && !fs::exists(fs::path(from) / "config.json")) {
      throw RunError((from == config.model.path ? "model.path: " : "") + from + " holds no config.json");
    }
    const ModelConfig shape =
        from.empty() ? new_model_config(config, run.data.tokenizer->vocab_size()) : load_model_config(from);
    if (shape.head != ModelHead::kCausalLm) {
      throw RunError("model.path: " + from + " is a " + shape.architecture +
                     " (a score head, no LM head): the policy must be a *ForCausalLM checkpoint");
    }
    check_memory(run, shape);
  }
  if (resume && !config.lora.enabled()) {
    run.model.policy = std::make_unique<Transformer>(
        Transformer::load((fs::path(ckpt_found) / "model").string(), scalar_type(config.model.dtype), run.device));
  } else if (!config.model.path.empty()) {
    if (!fs::exists(fs::path(config.model.path) / "config.json")) {
      throw RunError("model.path: " + config.model.path + " holds no config.json");
    }
    run.model.policy = std::make_unique<Transformer>(
        Transformer::load(config.model.path, scalar_type(config.model.dtype), run.device));
  } else {
    run.model.policy = new_model(config, run.data.tokenizer->vocab_size(), run.device);
  }
  // Stop ids: generation_config.json's eos_token_id (one or a list) and the tokenizer's EOS; rollout.stop
  // adds a stop string.
  if (!config.model.path.empty()) {
    for (int64_t id : generation_eos_ids(config.model.path)) run.config.rollout.stop_ids.push_back(id);
  }
  if (run.data.tokenizer->eos_id() >= 0) run.config.rollout.stop_ids.push_back(run.data.tokenizer->eos_id());
  if (run.config.rollout.stop_ids.empty()) {
    throw RunError("model: neither generation_config.json nor the tokenizer names an end-of-sequence token");
  }
  // rollout.speculative: the training rollouts' responses, as the next rollouts' drafts of their prompts.
  if (run.config.rollout.speculative != Speculative::kNone) {
    run.config.rollout.draft_history = std::make_shared<DraftHistory>(run.config.rollout.draft_history_tokens);
  }
  if (run.model.policy->config().vocab_size < run.data.tokenizer->vocab_size()) {
    throw RunError("model.tokenizer: " + std::to_string(run.data.tokenizer->vocab_size()) +
                   " pieces, more than the model's vocabulary of " +
                   std::to_string(run.model.policy->config().vocab_size));
  }
  // A critic from a folder reads the policy's token ids: its vocabulary must hold them.
  if (!config.critic.shared && config.critic.init != CriticInit::kPolicy) {
    const ModelConfig critic = critic_model_config(config, run.model.policy->config());
    const bool from_path = config.critic.init == CriticInit::kPath;
    if (critic.vocab_size < run.data.tokenizer->vocab_size()) {
      throw RunError(std::string(from_path ? "critic.path: " : "critic.init: reward_model: ") +
                     (from_path ? config.critic.path : config.reward.model_path) + " has a vocabulary of " +
                     std::to_string(critic.vocab_size) + ", fewer than the policy's tokenizer's " +
                     std::to_string(run.data.tokenizer->vocab_size()) + " pieces: a critic reads the policy's tokens");
    }
  }
  if (config.model.checkpoint_layers > run.model.policy->config().num_layers) {
    throw RunError("model.checkpoint_layers: " + std::to_string(config.model.checkpoint_layers) +
                   ", more than the model's " + std::to_string(run.model.policy->config().num_layers) + " layers");
  }
  run.model.policy->set_activation_checkpointing(config.model.activation_checkpointing, config.model.checkpoint_layers);
  run.model.policy->set_training_kernels(config.model.fused_kernels);
  // LoRA: adapters on the frozen base (model/lora.h); a resumed run's values come from its checkpoint.
  if (config.lora.enabled()) run.model.policy->attach_lora(config.lora, static_cast<uint64_t>(config.train.seed));
  // The chat template: the model's own (from model.tokenizer when it is a folder, else model.path).
  if (config.chat.template_kind == ChatTemplateKind::kModel) {
    const std::string dir = fs::is_directory(config.model.tokenizer) ? config.model.tokenizer : config.model.path;
    if (dir.empty()) throw RunError("chat.template: model needs a checkpoint folder (model.path) that has one");
    try {
      run.data.chat = std::make_shared<HfChatTemplate>(HfChatTemplate::from_folder(dir));
    } catch (const DataError& e) {
      throw RunError(std::string("chat.template: model: ") + e.what());
    }
    run.rollout.tools = tool_protocol(config, run.data.chat);
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
    run.data.eval_set = load_jsonl(eo).examples;
    check_prompt_lengths(run, run.data.eval_set);
  } else {
    const int64_t n_eval = std::min<int64_t>(config.train.eval_prompts, static_cast<int64_t>(examples.size()) / 2);
    run.data.eval_set.assign(examples.end() - n_eval, examples.end());
    for (PromptExample& ex : run.data.eval_set) ex.data_source = "held_out";
    examples.resize(examples.size() - n_eval);
  }
  // data.eval_sets: more files, each its own set in the metrics.
  for (size_t i = 0; i < config.data.eval_sets.size(); ++i) {
    std::vector<PromptExample> more = load_jsonl(config.data.eval_set_options(i)).examples;
    check_prompt_lengths(run, more);
    for (const PromptExample& ex : run.data.eval_set) {
      if (ex.data_source == more.front().data_source) {
        throw RunError("data.eval_sets: " + config.data.eval_sets[i].path + ": a second set named '" + ex.data_source +
                       "' (sets are named by their file names)");
      }
    }
    run.data.eval_set.insert(run.data.eval_set.end(), more.begin(), more.end());
  }
  run.data.prompts = std::make_unique<PromptSampler>(std::move(examples), static_cast<uint64_t>(config.train.seed));
  if (extra.make) run.model.extra = extra.make(*run.model.policy, config);
  if (run.rollout_rank) {  // it samples from the weights the training ranks send: nothing to optimise
    if (resume) load_checkpoint(run);
    return run;
  }
  make_optimizer(run, extra);
  if (run.lead() && run.model.sharded) {
    const TrainOptions& t = run.config.train;  // offload_step resolved
    std::cerr << "optimizer: AdamW on fp32 masters, train.shard " << enum_to_string(t.shard) << " over "
              << run.dist->world() << " rank(s)"
              << (t.offload == Offload::kOptimizer
                      ? std::string(", offloaded, stepped on the ") + enum_to_string(t.offload_step)
                      : "")
              << ": " << (run.model.sharded->device_bytes() >> 20) << " MiB on the device, "
              << (run.model.sharded->host_bytes() >> 20) << " MiB in host memory, per rank\n";
  } else if (run.lead()) {
    int64_t n = 0;
    const std::vector<at::Tensor> trained = run.model.policy->trainable_parameters();  // LoRA: the adapters
    for (const auto& p : trained) n += p.numel();
    // AdamW's two moments take its parameters' dtype: fp32 with master weights, else the trained tensors'.
    const int64_t moments = 2 * n * (run.model.master.empty() ? trained.front().element_size() : 4);
    std::cerr << "optimizer: AdamW over " << n << " parameters, "
              << (run.model.master.empty()
                      ? std::string("in their dtype, ") + c10::toString(trained.front().scalar_type())
                      : "on fp32 master weights (" + std::to_string(optimizer_memory_bytes(run.model) >> 20) +
                            " MiB) while the model computes in bf16")
              << "; moments " << (moments >> 20) << " MiB once stepped\n";
  }
  if (resume) load_checkpoint(run);
  return run;
}

void ensure_reference(Run& run) {
  if (run.config.objective.kl_coef <= 0 || run.model.reference) return;
  const std::string dir = (fs::path(run.out_dir) / "reference").string();
  if (run.model.policy->has_lora()) {
    // LoRA: the base weights shared with the policy, and a frozen copy of the adapters as RL starts (B = 0,
    // i.e. the base itself, unless a warm-up trained them), kept as a PEFT adapter folder for a resume.
    run.model.reference = std::make_unique<Transformer>(run.model.policy->adapter_snapshot());
    if (run.counters.step > 0) {
      if (!fs::exists(fs::path(dir) / "adapter_config.json")) {
        throw RunError(dir + ": missing; a resumed LoRA run with objective.kl_coef > 0 needs its reference adapters");
      }
      load_peft_adapter(*run.model.reference, dir);
      return;
    }
    if (!run.lead()) return;
    remove_tree(dir + ".tmp");
    save_peft_adapter(*run.model.reference, dir + ".tmp", run.config.model.path);
    remove_tree(dir);
    fs::rename(dir + ".tmp", dir);
    return;
  }
  if (run.counters.step > 0 && fs::exists(fs::path(dir) / "config.json")) {
    run.model.reference =
        std::make_unique<Transformer>(Transformer::load(dir, scalar_type(run.config.model.dtype), run.device));
    run.model.reference->set_training_kernels(run.config.model.fused_kernels);
    return;
  }
  if (run.counters.step > 0)
    throw RunError(dir + ": missing; a resumed run with objective.kl_coef > 0 needs its reference");
  {
    const GatheredWeights whole(run.model.sharded);
    run.model.reference = std::make_unique<Transformer>(run.model.policy->clone());
    run.model.reference->set_residency(nullptr);
  }
  if (!run.lead()) return;  // every rank holds the same policy (broadcast_weights); rank 0 saves it
  remove_tree(dir + ".tmp");
  run.model.reference->save(dir + ".tmp");
  remove_tree(dir);
  fs::rename(dir + ".tmp", dir);
}

const Transformer& rollout_model(const ModelState& model, RolloutState& rollout) {
  if (!model.policy->has_lora()) return *model.policy;
  if (!rollout.merged) {
    rollout.merged = std::make_unique<Transformer>(model.policy->merged());
  } else {
    model.policy->merge_into(*rollout.merged);  // in place: a kept DecodeEngine's tensors and graphs stay valid
  }
  return *rollout.merged;
}

void release_rollout_model(RolloutState& rollout) {
  if (rollout.engine && &rollout.engine->model() == rollout.merged.get()) return;
  rollout.merged.reset();
}

std::vector<std::vector<int64_t>> encode_prompts(const RunData& data, const Config& config,
                                                 const ToolProtocol& protocol,
                                                 const std::vector<PromptExample>& examples) {
  // tool_call format through the model's template: the template lists the tool (Qwen's <tools> block).
  const bool list_tool = config.rollout.tools && protocol.format == ToolFormat::kToolCall;
  const nlohmann::ordered_json tools =
      list_tool ? nlohmann::ordered_json::array({protocol.tool_schema()}) : nlohmann::ordered_json();
  std::vector<std::vector<int64_t>> out;
  out.reserve(examples.size());
  for (const auto& ex : examples) {
    out.push_back(data.chat ? encode_chat(*data.tokenizer, *data.chat, config.chat, ex.messages, ex.prompt, tools)
                            : encode_prompt(*data.tokenizer, config.chat, ex.prompt));
  }
  return out;
}

ToolRunner tool_runner(RolloutState& rollout, const SandboxOptions& options) {
  if (!rollout.sandbox) rollout.sandbox = std::make_shared<SandboxPool>(options);
  std::shared_ptr<SandboxPool> pool = rollout.sandbox;
  return [pool](const std::string& code) { return pool->submit(code); };
}

void check_world(const Config& c, int world) {
  if (world == 1) return;
  const int64_t P = c.train.prompts_per_step, G = c.sampling.samples_per_prompt;
  const StepShape whole = step_shape(c);  // the step's trajectories and mini-batch, before any split
  const int64_t S = whole.S, mini = whole.mini;
  const std::string w = std::to_string(world);
  if (P % world != 0) {
    throw RunError("train.prompts_per_step = " + std::to_string(P) + " does not split over " + w +
                   " ranks: each rank samples whole prompts (a prompt's samples stay on one rank); use a multiple of " +
                   w);
  }
  if (mini % G != 0 || S % mini != 0 || (mini / G) % world != 0) {
    throw RunError(
        "train.mini_batch_size = " + std::to_string(c.train.mini_batch_size) + ": with " + w +
        " ranks a mini-batch must be whole prompts (a multiple of sampling.samples_per_prompt = " + std::to_string(G) +
        "), divide the step's " + std::to_string(S) + " trajectories, and hold a multiple of " + w + " prompts");
  }
}

void broadcast_weights(Run& run) {
  if (run.dist->world() == 1) return;
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> tensors;
  // The parameters stage holds chunks, not weights: every rank's are its own, made from the same weights.
  if (!run.model.sharded || run.model.sharded->stage() != ShardStage::kParameters) {
    for (const auto& p : run.model.policy->parameters()) tensors.push_back(p.detach());
  }
  for (const auto& m : run.model.master) tensors.push_back(m.detach());
  for (const auto& [name, t] : run.model.extra) tensors.push_back(t.detach());
  run.dist->broadcast(tensors, 0);
}

at::Tensor gather_table(Collectives& dist, const std::vector<Trajectory>& trajs, const std::vector<int64_t>& index,
                        int64_t S_step) {
  TORCH_CHECK(trajs.size() == index.size(), "gather_table: ", trajs.size(), " trajectories, ", index.size(), " places");
  at::Tensor table = at::zeros({S_step, kTableColumns}, at::kDouble);
  auto t = table.accessor<double, 2>();
  for (size_t i = 0; i < trajs.size(); ++i) {
    const Trajectory& tr = trajs[i];
    const int64_t s = index[i];
    TORCH_CHECK(s >= 0 && s < S_step, "gather_table: place ", s, " outside the step's ", S_step, " trajectories");
    t[s][kReward] = tr.reward;
    t[s][kCorrect] = tr.correct;
    t[s][kToolCalls] = tr.tool_calls;
    t[s][kTruncated] = tr.truncated;
    t[s][kResponseTokens] = static_cast<double>(tr.response_ids.size());
    t[s][kSampledTokens] = static_cast<double>(tr.sampled_tokens());
    t[s][kTokens] = static_cast<double>(tr.window_end());
    t[s][kOverlongPenalty] = tr.overlong_penalty;
  }
  dist.all_reduce({table}, ReduceOp::kSum);  // every row is one rank's, zero on the others
  return table;
}

namespace {
thread_local const RolloutSource* rollout_source = nullptr;
}  // namespace

RolloutSourceScope::RolloutSourceScope(const RolloutSource& source) : previous_(rollout_source) {
  rollout_source = &source;
}
RolloutSourceScope::~RolloutSourceScope() { rollout_source = previous_; }

Collectives& rollout_collectives(Run& run) { return rollout_source ? *rollout_source->dist : *run.dist; }

int64_t partial_extra_prompts(const Config& config, int world) {
  const int64_t P = config.train.prompts_per_step;
  const int64_t e = config.rollout.partial_extra_prompts > 0 ? config.rollout.partial_extra_prompts
                                                             : std::max<int64_t>(1, (P + 3) / 4);
  return (e + world - 1) / world * world;
}

RolloutBatch collect_rollouts(Run& run) {
  const ToolRunner tools = tool_runner(run.rollout, run.config.sandbox);
  const Config& cfg = run.config;
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t P = cfg.train.prompts_per_step, G = cfg.sampling.samples_per_prompt;
  const RolloutSource* source = rollout_source;
  Collectives& dist = rollout_collectives(run);
  const int64_t step = source ? source->step : run.counters.step;
  const int world = dist.world();
  RolloutBatch out;
  PartialCarry* carry = source ? source->carry : nullptr;
  // rollout.partial: each rank keeps extra / world groups in play beyond its share of the step's; the draw
  // tops the carried ones up. Every rank carries as many (it returns its share and keeps the rest), so
  // every rank draws the same.
  const int64_t extra = carry ? partial_extra_prompts(cfg, world) : 0;
  const int64_t top_up = extra - world * (carry ? static_cast<int64_t>(carry->groups.size()) : 0);
  TORCH_CHECK(top_up >= 0 && top_up % world == 0, "collect_rollouts: ", carry ? carry->groups.size() : 0,
              " carried groups on a rank, more than rollout.partial_extra_prompts ", extra, " over ", world, " ranks");
  // Every rank draws the step's P prompts; each samples its share (rank_prompts), with the noise stream of
  // the prompt's draw index, as one process would.
  const int64_t first_draw = run.data.prompts->consumed();
  const std::vector<PromptExample> drawn = run.data.prompts->next(P + top_up);
  std::vector<int64_t> mine(P);
  std::iota(mine.begin(), mine.end(), 0);
  // A rollout rank (train.rollout_ranks) takes a contiguous 1/world of the step; the training ranks re-split.
  if (world > 1) mine = rank_prompts(P, run.rollout_rank ? P : step_shape(cfg).mini / G, world, dist.rank());
  std::vector<int64_t> streams;
  std::vector<PromptExample> examples;  // the new prompts this rank samples
  for (int64_t p : mine) {
    examples.push_back(drawn[p]);
    streams.push_back(first_draw + p);
    for (int64_t g = 0; g < G; ++g) out.index.push_back(p * G + g);
  }
  for (int64_t i = 0; i < top_up / world; ++i) {  // the extra ones in play: a block each
    const int64_t p = P + dist.rank() * (top_up / world) + i;
    examples.push_back(drawn[p]);
    streams.push_back(first_draw + p);
  }
  RolloutCarry rc;
  rc.version = source ? source->version : run.counters.step;
  if (carry) {
    rc.groups = static_cast<int64_t>(mine.size());
    rc.carry = std::move(carry->groups);
  }
  SamplingOptions sampling = cfg.sampling;
  sampling.seed = cfg.train.seed * 1000003 + step;
  RolloutOptions ro = cfg.rollout;
  if (!(run.rollout_rank ? dist.lead() : run.lead())) ro.progress_s = 0;  // one live line: the first sampler's
  {
    at::NoGradGuard no_grad;
    // train.shard parameters: decoded from whole weights (a source's copy is whole already).
    const GatheredWeights whole(source ? std::shared_ptr<ShardedState>() : run.model.sharded);
    // rollout.keep_cache: one engine for the run (its cache and graphs outlive the step), else one per step.
    std::unique_ptr<DecodeEngine> own;
    const Transformer& model = source ? *source->model : rollout_model(run.model, run.rollout);
    std::unique_ptr<DecodeEngine>& kept = source ? *source->engine : run.rollout.engine;
    if (!cfg.rollout.engine.keep_cache) {
      own = std::make_unique<DecodeEngine>(model, engine_options(cfg.rollout));
    } else if (!kept || &kept->model() != &model) {
      kept = std::make_unique<DecodeEngine>(model, engine_options(cfg.rollout));
    }
    DecodeEngine& engine = own ? *own : *kept;
    out.trajs = rollout(engine, *run.data.tokenizer, encode_prompts(run.data, run.config, run.rollout.tools, examples),
                        sampling, ro, tools, streams, run.rollout.tools, &out.stats, &rc);
  }
  // LoRA: the merged copy goes with the step's engine, so the update has its memory (7.5 GiB of the 32B
  // recipe's); a kept engine decodes it again, in place.
  if (!source) release_rollout_model(run.rollout);
  if (carry) {  // the returned groups' examples, and the carried ones' kept for their turn
    std::map<int64_t, PromptExample> known = std::move(carry->examples);
    for (size_t i = 0; i < examples.size(); ++i) known[streams[i]] = std::move(examples[i]);
    for (int64_t key : rc.keys) out.examples.push_back(known.at(key));
    carry->groups = std::move(rc.carry);
    carry->examples.clear();
    for (const CarriedGroup& g : carry->groups) carry->examples[g.key] = known.at(g.key);
  } else {
    out.examples = std::move(examples);
  }
  out.rewards = score_rewards(run, out.trajs, out.examples);
  // DAPO's overlong shaping (reward.overlong_buffer > 0), on the training rollouts' rewards.
  if (cfg.reward.overlong_buffer > 0) {
    for (Trajectory& t : out.trajs) {
      t.overlong_penalty = overlong_shaping(cfg, t.window_begin(), t.sampled_tokens());
      t.reward += t.overlong_penalty;
    }
  }
  out.seconds = seconds_since(t0);
  out.table = gather_table(dist, out.trajs, out.index, P * G);
  if (world > 1) {  // the step waits for the slowest rank; counts (and the calls' summed latencies) add up
    RolloutStats& st = out.stats;
    at::Tensor times = at::tensor({out.seconds, st.prefill_s, st.decode_s, st.feed_s, st.sample_s, st.tool_wait_s,
                                   st.total_s, st.turn_s, st.tail_s},
                                  at::kDouble);
    at::Tensor counts = at::tensor({double(st.decode_steps),
                                    double(st.fed_rows),
                                    double(st.feed_steps),
                                    double(st.feed_tokens),
                                    double(st.forced_tokens),
                                    double(st.refills),
                                    st.tool_latency_s,
                                    st.tool_run_s,
                                    double(st.tool_wait_row_steps),
                                    double(st.feed_wait_row_steps),
                                    double(st.resumed),
                                    double(st.cut),
                                    double(st.verify_passes),
                                    double(st.verify_rows),
                                    double(st.drafted_tokens),
                                    double(st.accepted_tokens),
                                    double(st.verify_sampled),
                                    double(st.verify_sampling_rows),
                                    double(st.tail_passes),
                                    double(st.tail_sampled)},
                                   at::kDouble);
    dist.all_reduce({times}, ReduceOp::kMax);
    dist.all_reduce({counts}, ReduceOp::kSum);
    const double* t = times.data_ptr<double>();
    const double* n = counts.data_ptr<double>();
    out.seconds = t[0];
    st.prefill_s = t[1], st.decode_s = t[2], st.feed_s = t[3], st.sample_s = t[4], st.tool_wait_s = t[5];
    st.total_s = t[6], st.turn_s = t[7], st.tail_s = t[8];
    st.decode_steps = int64_t(n[0]), st.fed_rows = int64_t(n[1]), st.feed_steps = int64_t(n[2]);
    st.feed_tokens = int64_t(n[3]), st.forced_tokens = int64_t(n[4]), st.refills = int64_t(n[5]);
    st.tool_latency_s = n[6], st.tool_run_s = n[7];
    st.tool_wait_row_steps = int64_t(n[8]), st.feed_wait_row_steps = int64_t(n[9]);
    st.resumed = int64_t(n[10]), st.cut = int64_t(n[11]);
    st.verify_passes = int64_t(n[12]), st.verify_rows = int64_t(n[13]), st.drafted_tokens = int64_t(n[14]);
    st.accepted_tokens = int64_t(n[15]), st.verify_sampled = int64_t(n[16]), st.verify_sampling_rows = int64_t(n[17]);
    st.tail_passes = int64_t(n[18]), st.tail_sampled = int64_t(n[19]);
  }
  return out;
}

double begin_training(Run& run) {
  if (!run.device.is_cuda()) install_cpu_memory_tracking();
  reserve_phase_offload(run);  // train.phase_offload: its pinned buffers made beside the warm-up
  if (run.lead()) {
    run.metrics.log =
        std::make_shared<MetricsLog>(run.out_dir, /*append=*/run.counters.step > 0, run.config.logging.tensorboard);
  }
  const bool fresh = run.counters.step == 0, warms_up = fresh && run.config.sft.steps > 0;
  {
    // Under shard parameters the warm-up trains whole weights, and the masters are taken from them.
    const GatheredWeights whole(warms_up ? run.model.sharded : nullptr);
    if (warms_up) sft_warmup(run);  // every rank the same warm-up
    broadcast_weights(run);         // several ranks: rank 0's weights everywhere, fresh or resumed
    // The sharded state took its masters from the weights before the warm-up trained them.
    if (run.model.sharded && warms_up) run.model.sharded->load_from_model();
  }
  ensure_reference(run);  // only when objective.kl_coef > 0: the policy RL starts from
  const double before = fresh && !run.data.eval_set.empty() ? report_evaluation(run, "before RL").pass1 : NAN;
  run.metrics.phase_moves_s = 0;  // step 1's figure is its own rollout's and evaluation's
  return before;
}

void end_training(Run& run, double eval_start, std::map<std::string, double>& m) {
  if (run.data.eval_set.empty() || run.counters.step != run.config.train.steps) return;
  const double pass1 = run.metrics.last_eval_step == run.counters.step ? run.metrics.last_eval_pass1
                                                                       : report_evaluation(run, "after RL").pass1;
  if (std::isfinite(eval_start)) m["eval_accuracy_start"] = eval_start;
  m["eval_accuracy_end"] = pass1;
}

std::map<std::string, double> periodic_evaluation(Run& run) {
  const int64_t every = run.config.train.eval_every;
  if (run.data.eval_set.empty() || every <= 0 ||
      !(run.counters.step % every == 0 || run.counters.step == run.config.train.steps))
    return {};
  const EvalResult r = report_evaluation(run, "after step " + std::to_string(run.counters.step));
  std::map<std::string, double> m = {{"eval_avg@" + std::to_string(r.k), r.pass1}, {"eval_tool_use", r.tool_use}};
  for (const auto& [j, p] : r.pass_at) m["eval_pass@" + std::to_string(j)] = p;
  for (const auto& [name, s] : r.by_set) {
    m["eval_avg@" + std::to_string(s.k) + "/" + name] = s.pass1;
    for (const auto& [j, p] : s.pass_at) m["eval_pass@" + std::to_string(j) + "/" + name] = p;
  }
  return m;
}

EvalResult report_evaluation(Run& run, const std::string& when) {
  EvalResult r;
  {
    const ParkedTrainingState parked(run);  // train.phase_offload: the training state in host memory meanwhile
    r = evaluate(run);
  }
  run.metrics.last_eval_step = static_cast<double>(run.counters.step);
  run.metrics.last_eval_pass1 = r.pass1;
  if (!run.lead()) return r;
  std::cerr << "eval " << when << ": pass@1 " << 100 * r.pass1 << "%";
  if (r.k > 1) std::cerr << " (" << r.k << " samples), pass@" << r.k << " " << 100 * r.pass_k << "%";
  std::cerr << ", tool use " << 100 * r.tool_use << "%";
  for (const auto& [name, s] : r.by_set) std::cerr << "; " << name << " " << 100 * s.pass1 << "%";
  std::cerr << "\n";
  return r;
}

SamplingOptions evaluation_sampling(const Config& c, int64_t step) {
  SamplingOptions s = c.sampling;
  const int64_t k = c.train.eval_samples;
  const double t = c.train.eval_temperature;
  s.temperature = t >= 0 ? t : k == 1 ? 0.0 : s.temperature;  // -1: greedy for one sample
  s.samples_per_prompt = k;
  // Its own noise, fixed per step, 2^40 above the training rollouts' seeds (train.seed * 1000003 + step).
  s.seed = c.train.seed * 1000003 + step + (int64_t{1} << 40);
  return s;
}

EvalResult evaluate(Run& run) {
  if (run.data.eval_set.empty()) return EvalResult{};
  at::NoGradGuard no_grad;
  const GatheredWeights whole(run.model.sharded);
  const int64_t k = run.config.train.eval_samples;
  const SamplingOptions s = evaluation_sampling(run.config, run.counters.step);
  // Rank r evaluates problems r, r + world, ...; each with the noise stream of its index, as one process.
  std::vector<PromptExample> problems;
  std::vector<int64_t> streams;
  for (size_t i = run.dist->rank(); i < run.data.eval_set.size(); i += run.dist->world()) {
    problems.push_back(run.data.eval_set[i]);
    streams.push_back(static_cast<int64_t>(i));
  }
  std::vector<Trajectory> trajs;
  if (!problems.empty()) {
    RolloutOptions ro = run.config.rollout;
    if (!run.lead()) ro.progress_s = 0;
    ro.draft_history = nullptr;  // held-out prompts: drafts from their own rollout only, none kept
    DecodeEngine engine(rollout_model(run.model, run.rollout), engine_options(run.config.rollout));
    trajs = rollout(engine, *run.data.tokenizer, encode_prompts(run.data, run.config, run.rollout.tools, problems), s,
                    ro, tool_runner(run.rollout, run.config.sandbox), streams, run.rollout.tools);
    score_rewards(run, trajs, problems);  // an evaluation's script failures count in no metric
  }
  release_rollout_model(run.rollout);
  EvalResult r = summarize_evaluation(trajs, k, run.dist.get());
  std::vector<std::string> names;  // every rank's, from the whole evaluation set, so the reductions pair up
  for (const PromptExample& ex : run.data.eval_set) {
    if (std::find(names.begin(), names.end(), ex.data_source) == names.end()) names.push_back(ex.data_source);
  }
  if (names.size() > 1) r.by_set = summarize_evaluation_sets(trajs, problems, names, k, run.dist.get());
  return r;
}

std::map<std::string, EvalResult> summarize_evaluation_sets(const std::vector<Trajectory>& trajs,
                                                            const std::vector<PromptExample>& problems,
                                                            const std::vector<std::string>& names, int64_t k,
                                                            Collectives* dist) {
  std::map<std::string, EvalResult> out;
  for (const std::string& name : names) {
    std::vector<Trajectory> mine;  // prompt-major still: a problem's k completions stay together
    for (const Trajectory& t : trajs) {
      TORCH_CHECK(t.prompt_index >= 0 && t.prompt_index < static_cast<int64_t>(problems.size()),
                  "summarize_evaluation_sets: no problem ", t.prompt_index);
      if (problems[t.prompt_index].data_source == name) mine.push_back(t);
    }
    out[name] = summarize_evaluation(mine, k, dist);
  }
  return out;
}

double pass_at_estimate(int64_t n, int64_t c, int64_t j) {
  TORCH_CHECK(0 <= c && c <= n && 1 <= j && j <= n, "pass_at_estimate: ", c, " of ", n, " correct, j = ", j);
  if (j == 1) return double(c) / double(n);  // the correct share, exactly
  if (n - c < j) return 1.0;                 // every draw of j holds a correct completion
  double none = 1.0;                         // C(n - c, j) / C(n, j)
  for (int64_t i = n - c + 1; i <= n; ++i) none *= 1.0 - double(j) / double(i);
  return 1.0 - none;
}

EvalResult summarize_evaluation(const std::vector<Trajectory>& trajs, int64_t k, Collectives* dist) {
  TORCH_CHECK(k >= 1 && trajs.size() % k == 0, "summarize_evaluation: ", trajs.size(),
              " completions are not whole groups of k = ", k);
  std::vector<int64_t> js;  // 1, 2, 4, ... below k, then k
  for (int64_t j = 1; j < k; j *= 2) js.push_back(j);
  js.push_back(k);
  // Sums over problems (and over ranks), then means: pass@j for each j, tool use, the problems.
  std::vector<double> sums(js.size() + 2, 0.0);
  const size_t P = trajs.size() / k;
  for (size_t p = 0; p < P; ++p) {
    int64_t correct = 0;
    for (int64_t g = 0; g < k; ++g) {
      const Trajectory& t = trajs[p * k + g];  // prompt-major
      correct += t.correct;
      sums[js.size()] += t.tool_calls > 0;
    }
    for (size_t i = 0; i < js.size(); ++i) sums[i] += pass_at_estimate(k, correct, js[i]);
  }
  sums.back() = double(P);
  at::Tensor all = at::tensor(sums, at::kDouble);
  if (dist) dist->all_reduce({all}, ReduceOp::kSum);
  const double* v = all.data_ptr<double>();
  const double problems = v[js.size() + 1];
  TORCH_CHECK(problems > 0, "summarize_evaluation: no completions");
  EvalResult r;
  r.k = k;
  for (size_t i = 0; i < js.size(); ++i) r.pass_at[js[i]] = v[i] / problems;
  r.pass1 = r.pass_at[1];
  r.pass_k = r.pass_at[k];
  r.tool_use = v[js.size()] / (problems * k);
  return r;
}

}  // namespace rlt
