// Loading and rendering a checkpoint's chat template; see hf_chat.h.
#include "data/hf_chat.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "data/dataset.h"

namespace rlt {

namespace {

nlohmann::ordered_json read_json(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw DataError(path + ": cannot open");
  try {
    return nlohmann::ordered_json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    throw DataError(path + ": not valid JSON: " + e.what());
  }
}

// "<s>", {"content": "<s>", ...} or null, as tokenizer_config.json writes a special token.
std::string token_text(const nlohmann::ordered_json& cfg, const char* key) {
  if (!cfg.contains(key) || cfg[key].is_null()) return "";
  if (cfg[key].is_string()) return cfg[key].get<std::string>();
  if (cfg[key].is_object() && cfg[key].contains("content")) return cfg[key]["content"].get<std::string>();
  return "";
}

}  // namespace

HfChatTemplate HfChatTemplate::from_source(const std::string& source, const std::string& bos_token,
                                           const std::string& eos_token, const std::string& where) {
  HfChatTemplate t;
  t.source_ = source;
  t.bos_ = bos_token;
  t.eos_ = eos_token;
  t.where_ = where;
  try {
    t.template_ = std::make_shared<jinja::Template>(source);
  } catch (const jinja::TemplateError& e) {
    throw DataError(where + ": chat template: " + e.what());
  }
  return t;
}

HfChatTemplate HfChatTemplate::from_folder(const std::string& dir, const std::string& name) {
  namespace fs = std::filesystem;
  const std::string cfg_path = (fs::path(dir) / "tokenizer_config.json").string();
  const std::string jinja_path = (fs::path(dir) / "chat_template.jinja").string();
  nlohmann::ordered_json cfg = fs::exists(cfg_path) ? read_json(cfg_path) : nlohmann::ordered_json::object();
  const std::string bos = token_text(cfg, "bos_token"), eos = token_text(cfg, "eos_token");
  if (fs::exists(jinja_path)) {
    std::ifstream f(jinja_path, std::ios::binary);
    std::stringstream text;
    text << f.rdbuf();
    return from_source(text.str(), bos, eos, jinja_path);
  }
  if (!fs::exists(cfg_path)) throw DataError(dir + ": holds neither chat_template.jinja nor tokenizer_config.json");
  if (!cfg.contains("chat_template") || cfg["chat_template"].is_null()) {
    throw DataError(cfg_path + ": no chat_template (a base model's tokenizer has none; use the fixed chat.prompt)");
  }
  const auto& ct = cfg["chat_template"];
  if (ct.is_string()) return from_source(ct.get<std::string>(), bos, eos, cfg_path);
  if (ct.is_array()) {
    for (const auto& entry : ct) {
      if (entry.value("name", "") == name && entry.contains("template")) {
        return from_source(entry["template"].get<std::string>(), bos, eos, cfg_path + " (" + name + ")");
      }
    }
    throw DataError(cfg_path + ": chat_template has no template named '" + name + "'");
  }
  throw DataError(cfg_path + ": chat_template is neither a string nor a list of named templates");
}

std::string HfChatTemplate::render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                                   bool add_generation_prompt, const nlohmann::ordered_json& extra) const {
  // The variables transformers passes: messages, tools, documents, add_generation_prompt, then the
  // tokenizer's special tokens and the caller's kwargs.
  nlohmann::ordered_json ctx = nlohmann::ordered_json::object();
  ctx["messages"] = messages;
  ctx["tools"] = tools;
  ctx["documents"] = nullptr;
  ctx["add_generation_prompt"] = add_generation_prompt;
  ctx["bos_token"] = bos_;
  ctx["eos_token"] = eos_;
  for (const auto& [k, v] : extra.items()) ctx[k] = v;
  try {
    return template_->render(ctx);
  } catch (const jinja::TemplateError& e) {
    throw DataError(where_ + ": chat template: " + e.what());
  }
}

}  // namespace rlt
