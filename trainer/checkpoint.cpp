// save_checkpoint / load_checkpoint; see checkpoint.h.
#include "trainer/checkpoint.h"

#include <torch/serialize.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <vector>

#include "common/files.h"
#include "model/peft.h"
#include "model/safetensors.h"
#include "parallel/shard.h"
#include "trainer/async_rollout.h"
#include "trainer/critic.h"
#include "trainer/memory_plan.h"
#include "trainer/optim.h"

namespace rlt {

namespace fs = std::filesystem;

std::string checkpoint_dir(const Run& run) { return (fs::path(run.out_dir) / "checkpoint").string(); }

namespace {

// The files of a Hugging Face folder beside config.json and the weights, which the model folder of a
// checkpoint carries over from where the run's model and tokenizer came from, so that transformers'
// AutoModelForCausalLM and AutoTokenizer load it as a whole.
constexpr const char* kSideFiles[] = {"generation_config.json",
                                      "tokenizer.json",
                                      "tokenizer_config.json",
                                      "tokenizer.model",
                                      "special_tokens_map.json",
                                      "chat_template.jinja",
                                      "added_tokens.json",
                                      "vocab.json",
                                      "merges.txt"};

void copy_side_files(const Run& run, const fs::path& model_dir) {
  std::vector<fs::path> sources;
  if (!run.config.model.path.empty()) {
    for (const char* name : kSideFiles) sources.push_back(fs::path(run.config.model.path) / name);
  }
  // A tokenizer from elsewhere (model.tokenizer, or the demo's trained one) wins over the checkpoint's.
  const fs::path tok = run.data.tokenizer->path();
  if (!tok.empty()) {
    if (fs::is_directory(tok)) {
      for (const char* name :
           {"tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json"}) {
        sources.push_back(tok / name);
      }
    } else {
      sources.push_back(tok);
    }
  }
  for (const auto& src : sources) {
    if (!fs::is_regular_file(src)) continue;
    std::ifstream in(src, std::ios::binary);
    std::ofstream out(model_dir / src.filename(), std::ios::binary | std::ios::trunc);
    out << in.rdbuf();
    if (!in || !out) throw RunError(src.string() + ": cannot copy into the checkpoint");
  }
}

// The names of optimizer_params(model), in its order: the model's trainable tensors, then model.extra's.
std::vector<std::string> optimizer_param_names(const ModelState& model) {
  std::vector<std::string> names;
  for (const auto& [name, t] : model.policy->named_trainable_parameters()) names.push_back(name);
  for (const auto& [name, t] : model.extra) names.push_back(name);
  return names;
}

// A replicated AdamW's state as the tensors of its pieces file, sorted by key.
std::vector<std::pair<std::string, at::Tensor>> optimizer_pieces(const ModelState& model) {
  const std::vector<at::Tensor> params = optimizer_params(model);
  const std::vector<std::string> names = optimizer_param_names(model);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (size_t i = 0; i < params.size(); ++i) {
    tensors.push_back({OptimizerPieces::key("master", names[i], 0), params[i].detach().reshape(-1)});
    auto it = model.optimizer->state().find(params[i].unsafeGetTensorImpl());
    if (it == model.optimizer->state().end()) continue;  // not stepped yet: zero moments
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*it->second);
    tensors.push_back({OptimizerPieces::key("exp_avg", names[i], 0), s.exp_avg().reshape(-1)});
    tensors.push_back({OptimizerPieces::key("exp_avg_sq", names[i], 0), s.exp_avg_sq().reshape(-1)});
  }
  std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  return tensors;
}

uint64_t weight_bytes(const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  uint64_t bytes = 0;
  for (const auto& [name, t] : tensors) bytes += t.nbytes();
  return bytes;
}

// A model state's weights (the adapters alone with LoRA) and optimizer state, as its checkpoint holds them.
// Whole weights are counted from the shapes: a sharded state at the parameters stage holds none between steps.
uint64_t state_bytes(const ModelState& model) {
  const Transformer& m = *model.policy;
  const uint64_t whole = static_cast<uint64_t>(parameter_count(m.config()));
  const uint64_t weights =
      m.has_lora() ? weight_bytes(m.named_trainable_parameters()) : whole * c10::elementSize(m.config().dtype);
  if (model.sharded) {
    uint64_t trained = whole;  // fp32 master and two moments per trained element, over every rank's pieces
    if (m.has_lora()) {
      trained = 0;
      for (const auto& [name, t] : m.named_trainable_parameters()) trained += static_cast<uint64_t>(t.numel());
    }
    for (const auto& [name, t] : model.extra) trained += static_cast<uint64_t>(t.numel());
    return weights + 3 * sizeof(float) * trained;
  }
  return weights + weight_bytes(optimizer_pieces(model));
}

FreeSpaceProbe& free_space_probe() {
  static FreeSpaceProbe probe;
  return probe;
}

uint64_t free_bytes(const std::string& dir) {
  if (free_space_probe()) return free_space_probe()(dir);
  return static_cast<uint64_t>(fs::space(dir).available);
}

// Refuses a save that the file system cannot hold, before anything is written: the new checkpoint goes
// beside the previous one, which stays until the new one is in place. With every rank writing, all refuse
// alike (the collective), so none is left waiting at the save's barriers.
void check_space(Run& run, bool every_rank) {
  const uint64_t need = checkpoint_bytes(run), free = free_bytes(run.out_dir);
  at::Tensor short_of = at::full({1}, free < need ? double(need - free) : 0.0, at::kDouble);
  if (every_rank) run.dist->all_reduce({short_of}, ReduceOp::kMax);
  if (short_of.item<double>() > 0) {
    throw RunError("checkpoint: " + checkpoint_dir(run) + " needs " + bytes_text(int64_t(need)) +
                   " and the file system of " + run.out_dir + " has " + bytes_text(int64_t(free)) + " free" +
                   (free >= need ? " (another rank's has less)" : "") +
                   ": nothing was written, the previous checkpoint is kept; free some space, or set --out "
                   "elsewhere and --resume from a copy of the folder");
  }
}

}  // namespace

uint64_t checkpoint_bytes(const Run& run) {
  uint64_t bytes = state_bytes(run.model);
  for (const auto& [name, t] : run.model.extra) bytes += t.nbytes();
  if (run.model.critic) bytes += state_bytes(run.model.critic->state);
  // train.async: the weights the next rollout samples from (with LoRA, the base merged). With rollout
  // ranks the checkpoint takes the files the rollout ranks already wrote beside it (or none): no new bytes.
  if (run.rollout.pending && !run.placement) {
    const ModelConfig& shape = run.model.policy->config();
    bytes += static_cast<uint64_t>(parameter_count(shape)) * c10::elementSize(shape.dtype);
  }
  return bytes;
}

void set_free_space_probe(FreeSpaceProbe probe) { free_space_probe() = std::move(probe); }

void save_optimizer_pieces(const ModelState& model, const std::string& dir) {
  fs::create_directories(dir);
  safetensors::write_file((fs::path(dir) / "optimizer-0.safetensors").string(), optimizer_pieces(model));
}

void load_optimizer_pieces(ModelState& model, const std::string& dir, int64_t optimizer_steps) {
  const OptimizerPieces stored(dir);
  if (stored.empty()) throw RunError(dir + ": no optimizer-*.safetensors (the optimizer state)");
  const std::vector<at::Tensor> params = optimizer_params(model);
  const std::vector<std::string> names = optimizer_param_names(model);
  const std::vector<at::Tensor> trained = model.policy->trainable_parameters();
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor p = params[i].detach();  // its values; AdamW keys its state by params[i] itself
    at::Tensor master = at::empty({p.numel()}, p.options().dtype(at::kFloat).device(at::kCPU));
    if (!stored.read("master", names[i], 0, master)) {
      throw RunError(dir + ": the optimizer state does not cover " + names[i]);
    }
    p.copy_(master.view(p.sizes()));
    if (!model.master.empty() && i < trained.size()) trained[i].detach().copy_(p);  // rounded to nearest
    at::Tensor m = at::empty_like(master), v = at::empty_like(master);
    if (!stored.read("exp_avg", names[i], 0, m) || !stored.read("exp_avg_sq", names[i], 0, v)) {
      if (optimizer_steps > 0) {
        throw RunError(dir + ": the optimizer state has no AdamW moments for " + names[i] + " after " +
                       std::to_string(optimizer_steps) + " optimizer steps");
      }
      continue;
    }
    auto s = std::make_unique<torch::optim::AdamWParamState>();
    s->step(optimizer_steps);
    s->exp_avg(m.view(p.sizes()).to(p.device(), p.scalar_type()));
    s->exp_avg_sq(v.view(p.sizes()).to(p.device(), p.scalar_type()));
    model.optimizer->state()[params[i].unsafeGetTensorImpl()] = std::move(s);
  }
}

bool checkpoint_on_every_rank(const Run& run) {
  const bool sharded = run.model.sharded || (run.model.critic && run.model.critic->state.sharded);
  return (sharded || (run.rollout.pending && run.rollout.pending->partial())) && run.dist->world() > 1;
}

void save_checkpoint(Run& run) {
  const auto& extra = run.model.extra;
  const std::string dir = checkpoint_dir(run), tmp = dir + ".tmp", old = dir + ".old";
  // A sharded state (its pieces) or rollout.partial (each rank's carried groups): every rank writes into the
  // folder rank 0 made, and rank 0 renames it once all have (the barriers). Otherwise rank 0 alone writes.
  const bool every_rank = checkpoint_on_every_rank(run);
  if (!run.lead() && !every_rank) return;
  if (run.lead()) remove_tree(tmp);  // a save cut short leaves one: its bytes are free space
  check_space(run, every_rank);
  if (run.lead()) fs::create_directories(tmp);
  if (every_rank) run.dist->barrier();
  if (run.model.sharded) run.model.sharded->gather_weights();  // the parameters stage: a collective
  if (run.lead() && run.model.policy->has_lora()) {
    // LoRA: the adapters as a PEFT folder (the base is model.path), and the dropout masks' generator.
    save_peft_adapter(*run.model.policy, (fs::path(tmp) / "adapter").string(), run.config.model.path);
    copy_side_files(run, fs::path(tmp) / "adapter");
    if (run.config.lora.dropout > 0) {
      torch::serialize::OutputArchive a;
      a.write("state", run.model.policy->lora_rng_state().cpu());
      a.save_to((fs::path(tmp) / "lora_rng.pt").string());
    }
  } else if (run.lead()) {
    run.model.policy->save((fs::path(tmp) / "model").string());  // in the model's dtype
    copy_side_files(run, fs::path(tmp) / "model");
  }
  if (run.model.sharded) {
    run.model.sharded->release_weights();
    run.model.sharded->save(tmp);
  } else if (run.lead()) {
    save_optimizer_pieces(run.model, tmp);  // masters (or the weights AdamW updates) and moments
  }
  nlohmann::json state = {{"step", run.counters.step},
                          {"optimizer_steps", run.counters.optimizer_steps},
                          {"skipped_steps", run.counters.skipped_steps},
                          {"prompts_consumed", run.data.prompts->consumed()},
                          {"old_logprobs", enum_to_string(run.old_logprobs)}};
  if (run.model.critic) save_critic(run, tmp, state);             // critic/ and its optimizer state
  if (run.rollout.pending) run.rollout.pending->save_carry(tmp);  // rollout.partial: each writing rank's carried groups
  if (every_rank) run.dist->barrier();
  if (!run.lead()) return;
  if (!extra.empty()) {
    torch::serialize::OutputArchive a;
    for (const auto& [name, t] : extra) a.write(name, t.detach().cpu());
    a.save_to((fs::path(tmp) / "extra.pt").string());
  }
  if (run.rollout.pending)
    run.rollout.pending->save(tmp, state);  // train.async: the copy the next rollout samples from
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

void save_merged_model(Run& run, const std::string& dir) {
  const Transformer& model = rollout_model(run.model, run.rollout);  // LoRA: the adapters merged; else the policy
  model.save(dir);
  copy_side_files(run, fs::path(dir));
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
    run.resumed_from = dir;
    run.counters.step = state.at("step").get<int64_t>();
    run.counters.optimizer_steps = state.at("optimizer_steps").get<int64_t>();
    run.counters.skipped_steps = state.at("skipped_steps").get<int64_t>();
    run.data.prompts->seek(state.at("prompts_consumed").get<int64_t>());
    // A switch to recompute (the rollout's log-probs missed train.old_logprobs_tol) holds for the rest of
    // the run; a checkpoint without the key keeps the config's setting.
    if (state.value("old_logprobs", std::string()) == enum_to_string(OldLogprobs::kRecompute)) {
      run.old_logprobs = OldLogprobs::kRecompute;
    }
  } catch (const nlohmann::json::exception& e) {
    throw RunError(state_path + ": " + e.what());
  }
  if (run.model.policy->has_lora()) {  // the adapters in place: the optimizer holds these tensors
    load_peft_adapter(*run.model.policy, (fs::path(dir) / "adapter").string());
    const std::string rng = (fs::path(dir) / "lora_rng.pt").string();
    if (run.config.lora.dropout > 0 && fs::exists(rng)) {
      torch::serialize::InputArchive a;
      a.load_from(rng);
      at::Tensor v;
      a.read("state", v);
      run.model.policy->set_lora_rng_state(v);
    }
  }
  if (run.rollout_rank) return;  // train.rollout_ranks: it keeps no optimizer
  try {
    if (!run.model.extra.empty()) {
      torch::serialize::InputArchive a;
      a.load_from((fs::path(dir) / "extra.pt").string());
      for (auto& [name, t] : run.model.extra) {
        at::Tensor v;
        a.read(name, v);
        at::NoGradGuard no_grad;
        t.copy_(v);
      }
    }
    // After extra.pt: the optimizer's masters of run.model.extra are the same values.
    if (run.model.sharded)
      run.model.sharded->load(dir);
    else
      load_optimizer_pieces(run.model, dir, run.counters.optimizer_steps);
  } catch (const safetensors::Error& e) {
    throw RunError(dir + ": cannot restore the optimizer state: " + e.what());
  } catch (const c10::Error& e) {
    throw RunError(dir + ": cannot restore the optimizer state: " + e.what_without_backtrace());
  }
}

}  // namespace rlt
