// PEFT adapter folders; see peft.h.
#include "model/peft.h"

#include <ATen/core/grad_mode.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "model/config.h"
#include "model/safetensors.h"

namespace rlt {

namespace fs = std::filesystem;

namespace {

constexpr const char* kConfigFile = "adapter_config.json";
constexpr const char* kWeightsFile = "adapter_model.safetensors";

// A number as JSON: an integer when it is one (PEFT writes lora_alpha and r as integers).
nlohmann::ordered_json number(double x) {
  if (std::floor(x) == x && std::abs(x) < 1e15) return static_cast<int64_t>(x);
  return x;
}

}  // namespace

void save_peft_adapter(const Transformer& model, const std::string& dir, const std::string& base_model) {
  TORCH_CHECK(model.has_lora(), "save_peft_adapter: the model has no adapters");
  const LoraOptions& o = model.lora();
  fs::create_directories(dir);
  nlohmann::ordered_json modules = nlohmann::ordered_json::array();
  for (int t : o.target_indices()) modules.push_back(lora_module_name(t));
  // The keys PEFT's LoraConfig reads to rebuild these adapters; the ones it defaults are written with
  // their defaults, so that the file states what the weights mean.
  nlohmann::ordered_json cfg = {
      {"peft_type", "LORA"},
      {"task_type", "CAUSAL_LM"},
      {"base_model_name_or_path", base_model.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(base_model)},
      {"r", o.rank},
      {"lora_alpha", number(o.alpha)},
      {"lora_dropout", o.dropout},
      {"target_modules", modules},
      {"bias", "none"},
      {"fan_in_fan_out", false},
      {"init_lora_weights", true},
      {"inference_mode", true},
      {"use_dora", false},
      {"use_rslora", false},
      {"modules_to_save", nullptr},
      {"layers_to_transform", nullptr},
      {"rank_pattern", nlohmann::ordered_json::object()},
      {"alpha_pattern", nlohmann::ordered_json::object()}};
  const fs::path path = fs::path(dir) / kConfigFile;
  {
    std::ofstream f(path.string() + ".tmp");
    f << cfg.dump(2) << "\n";
    if (!f) throw ModelConfigError(path.string() + ": cannot write");
  }
  fs::rename(path.string() + ".tmp", path);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [name, t] : model.named_trainable_parameters()) tensors.emplace_back(name, t.detach());
  safetensors::write_file((fs::path(dir) / kWeightsFile).string(), tensors);
}

LoraOptions read_peft_config(const std::string& dir) {
  const std::string path = (fs::path(dir) / kConfigFile).string();
  std::ifstream f(path);
  if (!f) throw ModelConfigError(path + ": missing (not a PEFT adapter folder)");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    throw ModelConfigError(path + ": not JSON: " + e.what());
  }
  auto fail = [&](const std::string& key, const std::string& why) -> ModelConfigError {
    return ModelConfigError(path + ": " + key + ": " + why);
  };
  if (j.value("peft_type", std::string()) != "LORA") throw fail("peft_type", "must be \"LORA\"");
  LoraOptions o;
  if (!j.contains("r") || !j["r"].is_number_integer() || j["r"].get<int64_t>() <= 0) {
    throw fail("r", "must be a positive integer");
  }
  o.rank = j["r"].get<int64_t>();
  if (!j.contains("lora_alpha") || !j["lora_alpha"].is_number()) throw fail("lora_alpha", "must be a number");
  o.alpha = j["lora_alpha"].get<double>();
  o.dropout = j.contains("lora_dropout") && j["lora_dropout"].is_number() ? j["lora_dropout"].get<double>() : 0.0;
  // What these adapters mean and we do not compute: refused rather than read as plain LoRA.
  for (const char* key : {"use_dora", "use_rslora", "fan_in_fan_out"}) {
    if (j.contains(key) && j[key].is_boolean() && j[key].get<bool>()) throw fail(key, "true is not supported");
  }
  for (const char* key : {"rank_pattern", "alpha_pattern"}) {
    if (j.contains(key) && !j[key].is_null() && !j[key].empty()) throw fail(key, "per-module values are not supported");
  }
  for (const char* key : {"modules_to_save", "layers_to_transform", "layers_pattern"}) {
    if (j.contains(key) && !j[key].is_null() && !j[key].empty()) throw fail(key, "must be null");
  }
  if (j.contains("bias") && j["bias"] != "none") throw fail("bias", "must be \"none\"");
  if (!j.contains("target_modules") || !j["target_modules"].is_array() || j["target_modules"].empty()) {
    throw fail("target_modules",
               "must be a list of module names (q_proj, k_proj, v_proj, o_proj, gate_proj, "
               "up_proj, down_proj)");
  }
  std::set<int> targets;
  for (const auto& m : j["target_modules"]) {
    int found = -1;
    for (int t = 0; t < kLoraTargets; ++t) {
      if (m.is_string() && m.get<std::string>() == lora_module_name(t)) found = t;
    }
    if (found < 0) throw fail("target_modules", m.dump() + " is not a projection this model adapts");
    targets.insert(found);
  }
  o.targets.clear();
  for (int t : targets) o.targets += std::string(o.targets.empty() ? "" : ",") + lora_target_name(t);
  return o;
}

void load_peft_adapter(Transformer& model, const std::string& dir) {
  TORCH_CHECK(model.has_lora(), "load_peft_adapter: the model has no adapters");
  const LoraOptions saved = read_peft_config(dir), &mine = model.lora();
  const std::string path = (fs::path(dir) / kConfigFile).string();
  if (saved.rank != mine.rank || saved.alpha != mine.alpha || saved.target_indices() != mine.target_indices()) {
    throw ModelConfigError(path + ": adapters of rank " + std::to_string(saved.rank) + ", alpha " +
                           std::to_string(saved.alpha) + " on " + saved.targets + "; the model's are rank " +
                           std::to_string(mine.rank) + ", alpha " + std::to_string(mine.alpha) + " on " + mine.targets +
                           " (lora.rank, lora.alpha, lora.targets)");
  }
  const std::string file = (fs::path(dir) / kWeightsFile).string();
  const auto reader = safetensors::Reader::open(file);
  const auto named = model.named_trainable_parameters();
  std::set<std::string> known;
  for (const auto& [name, t] : named) known.insert(name);
  for (const auto& name : reader.names()) {
    if (!known.count(name)) throw safetensors::Error(file + ": " + name + " is not an adapter of this model");
  }
  at::NoGradGuard no_grad;
  for (const auto& [name, t] : named) t.copy_(reader.load(name, t.sizes(), t.scalar_type()));
}

}  // namespace rlt
