// save_checkpoint / load_checkpoint; see checkpoint.h.
#include "trainer/checkpoint.h"

#include <torch/serialize.h>

#include <filesystem>
#include <fstream>
#include <vector>

#include "common/files.h"

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
  const fs::path tok = run.tokenizer->path();
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

}  // namespace

void save_checkpoint(Run& run) {
  const auto& extra = run.extra;
  const std::string dir = checkpoint_dir(run), tmp = dir + ".tmp", old = dir + ".old";
  remove_tree(tmp);
  fs::create_directories(tmp);
  run.policy->save((fs::path(tmp) / "model").string());  // in the model's dtype
  copy_side_files(run, fs::path(tmp) / "model");
  torch::save(*run.optimizer, (fs::path(tmp) / "optimizer.pt").string());
  if (!run.master.empty()) {  // the fp32 weights AdamW updates: the bf16 model folder is their rounding
    torch::serialize::OutputArchive a;
    const auto named = run.policy->named_trainable_parameters();
    for (size_t i = 0; i < named.size(); ++i) a.write(named[i].first, run.master[i].detach().cpu());
    a.save_to((fs::path(tmp) / "master.pt").string());
  }
  if (!extra.empty()) {
    torch::serialize::OutputArchive a;
    for (const auto& [name, t] : extra) a.write(name, t.detach().cpu());
    a.save_to((fs::path(tmp) / "extra.pt").string());
  }
  nlohmann::json state = {{"step", run.step},
                          {"optimizer_steps", run.optimizer_steps},
                          {"skipped_steps", run.skipped_steps},
                          {"prompts_consumed", run.prompts->consumed()},
                          {"old_logprobs", enum_to_string(run.old_logprobs)}};
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
    // A switch to recompute (the rollout's log-probs missed train.old_logprobs_tol) holds for the rest of
    // the run; a checkpoint without the key keeps the config's setting.
    if (state.value("old_logprobs", std::string()) == enum_to_string(OldLogprobs::kRecompute)) {
      run.old_logprobs = OldLogprobs::kRecompute;
    }
  } catch (const nlohmann::json::exception& e) {
    throw RunError(state_path + ": " + e.what());
  }
  try {
    torch::load(*run.optimizer, (fs::path(dir) / "optimizer.pt").string());
    if (!run.master.empty()) {
      const std::string path = (fs::path(dir) / "master.pt").string();
      if (!fs::exists(path)) throw RunError(path + ": missing; a bf16 run with fp32 master weights saves it");
      torch::serialize::InputArchive a;
      a.load_from(path);
      const auto named = run.policy->named_trainable_parameters();
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < named.size(); ++i) {
        at::Tensor v;
        a.read(named[i].first, v);
        run.master[i].copy_(v);
        named[i].second.detach().copy_(run.master[i]);
      }
    }
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

}  // namespace rlt
