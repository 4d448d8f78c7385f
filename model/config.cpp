// config.json -> ModelConfig. Accepts both spellings transformers has used: rope_theta + rope_scaling
// (4.x) and rope_parameters (5.x); torch_dtype and dtype; gemma2's layer_types or its even/odd rule.
#include "model/config.h"

#include <cmath>
#include <filesystem>
#include <fstream>

namespace rlt {

namespace {

struct Json {
  const nlohmann::json& j;
  const std::string& file;

  [[noreturn]] void fail(const std::string& key, const std::string& why) const {
    throw ModelConfigError(file + ": " + key + ": " + why);
  }
  int64_t integer(const std::string& key) const {
    if (!j.contains(key)) fail(key, "missing");
    if (!j[key].is_number_integer()) fail(key, "expected an integer, got " + j[key].dump());
    return j[key].get<int64_t>();
  }
  int64_t integer(const std::string& key, int64_t dflt) const {
    return j.contains(key) && !j[key].is_null() ? integer(key) : dflt;
  }
  double number(const std::string& key, double dflt) const {
    if (!j.contains(key) || j[key].is_null()) return dflt;
    if (!j[key].is_number()) fail(key, "expected a number, got " + j[key].dump());
    return j[key].get<double>();
  }
  bool boolean(const std::string& key, bool dflt) const {
    if (!j.contains(key) || j[key].is_null()) return dflt;
    if (!j[key].is_boolean()) fail(key, "expected true or false, got " + j[key].dump());
    return j[key].get<bool>();
  }
  std::string string(const std::string& key, const std::string& dflt) const {
    if (!j.contains(key) || j[key].is_null()) return dflt;
    if (!j[key].is_string()) fail(key, "expected a string, got " + j[key].dump());
    return j[key].get<std::string>();
  }
};

at::ScalarType parse_dtype(const std::string& s, const Json& j, const std::string& key) {
  if (s == "float32" || s == "float") return at::kFloat;
  if (s == "bfloat16") return at::kBFloat16;
  if (s == "float16" || s == "half") return at::kHalf;
  j.fail(key, "unsupported dtype '" + s + "' (float32 | bfloat16 | float16)");
}

// A checkpoint's JSON file (config.json, generation_config.json), or a ModelConfigError naming it.
nlohmann::json read_json(const std::string& path, const char* what) {
  std::ifstream f(path);
  if (!f) throw ModelConfigError(path + ": cannot open " + what);
  try {
    return nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    throw ModelConfigError(path + ": not valid JSON: " + e.what());
  }
}

}  // namespace

ModelConfig load_model_config(const std::string& path_in) {
  std::string path = path_in;
  if (std::filesystem::is_directory(path)) path = (std::filesystem::path(path) / "config.json").string();
  return model_config_from_json(read_json(path, "model config"), path);
}

std::vector<int64_t> generation_eos_ids(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "generation_config.json").string();
  if (!std::filesystem::exists(path)) return {};
  const nlohmann::json j = read_json(path, "generation config");
  if (!j.is_object()) throw ModelConfigError(path + ": expected a JSON object");
  if (!j.contains("eos_token_id") || j["eos_token_id"].is_null()) return {};
  const nlohmann::json& e = j["eos_token_id"];
  std::vector<int64_t> ids;
  auto take = [&](const nlohmann::json& v) {
    if (!v.is_number_integer() || v.get<int64_t>() < 0) {
      throw ModelConfigError(path + ": eos_token_id: expected a token id or a list of them, got " + e.dump());
    }
    ids.push_back(v.get<int64_t>());
  };
  if (e.is_array()) {
    for (const auto& v : e) take(v);
  } else {
    take(e);
  }
  return ids;
}

ModelConfig model_config_from_json(const nlohmann::json& raw, const std::string& path) {
  ModelConfig c;
  c.raw = raw;
  if (!c.raw.is_object()) throw ModelConfigError(path + ": expected a JSON object");
  const Json j{c.raw, path};
  c.model_type = j.string("model_type", "");
  if (c.model_type == "llama")
    c.type = ModelType::kLlama;
  else if (c.model_type == "mistral")
    c.type = ModelType::kMistral;
  else if (c.model_type == "qwen2")
    c.type = ModelType::kQwen2;
  else if (c.model_type == "qwen3")
    c.type = ModelType::kQwen3;
  else if (c.model_type == "gemma2")
    c.type = ModelType::kGemma2;
  else
    j.fail("model_type", "unsupported '" + c.model_type + "' (llama | mistral | qwen2 | qwen3 | gemma2)");

  c.vocab_size = j.integer("vocab_size");
  c.hidden_size = j.integer("hidden_size");
  c.intermediate_size = j.integer("intermediate_size");
  c.num_layers = j.integer("num_hidden_layers");
  c.num_heads = j.integer("num_attention_heads");
  c.num_kv_heads = j.integer("num_key_value_heads", c.num_heads);
  if (c.num_heads <= 0 || c.hidden_size <= 0) j.fail("num_attention_heads", "must be > 0");
  c.head_dim = j.integer("head_dim", c.hidden_size / c.num_heads);
  for (auto [key, v] : {std::pair<const char*, int64_t>{"vocab_size", c.vocab_size},
                        {"hidden_size", c.hidden_size},
                        {"intermediate_size", c.intermediate_size},
                        {"num_hidden_layers", c.num_layers},
                        {"num_key_value_heads", c.num_kv_heads},
                        {"head_dim", c.head_dim}}) {
    if (v <= 0) j.fail(key, "must be > 0, got " + std::to_string(v));
  }
  if (c.num_heads % c.num_kv_heads != 0) j.fail("num_key_value_heads", "must divide num_attention_heads");
  if (c.head_dim % 2 != 0) j.fail("head_dim", "must be even for RoPE");
  c.rms_norm_eps = j.number("rms_norm_eps", 1e-6);
  c.tie_word_embeddings = j.boolean("tie_word_embeddings", c.type == ModelType::kGemma2);

  // RoPE: 5.x puts theta and scaling in rope_parameters; 4.x has rope_theta + rope_scaling.
  nlohmann::json rope = nlohmann::json::object();
  std::string rope_key = "rope_scaling";
  if (c.raw.contains("rope_parameters") && c.raw["rope_parameters"].is_object()) {
    rope = c.raw["rope_parameters"];
    rope_key = "rope_parameters";
  } else if (c.raw.contains("rope_scaling") && c.raw["rope_scaling"].is_object()) {
    rope = c.raw["rope_scaling"];
  }
  const Json r{rope, path};
  c.rope_theta = r.number("rope_theta", j.number("rope_theta", 10000.0));
  c.rope_type = r.string("rope_type", r.string("type", "default"));
  if (c.rope_type == "llama3") {
    c.rope_factor = r.number("factor", 1.0);
    c.rope_low_freq_factor = r.number("low_freq_factor", 1.0);
    c.rope_high_freq_factor = r.number("high_freq_factor", 4.0);
    c.rope_original_max_positions = r.integer("original_max_position_embeddings", 8192);
  } else if (c.rope_type != "default") {
    j.fail(rope_key + ".rope_type", "unsupported '" + c.rope_type + "' (default | llama3)");
  }

  const std::string act = j.string("hidden_activation", j.string("hidden_act", "silu"));
  if (act == "gelu_pytorch_tanh")
    c.gelu_tanh = true;
  else if (act != "silu")
    j.fail("hidden_act", "unsupported '" + act + "' (silu | gelu_pytorch_tanh)");

  switch (c.type) {
    case ModelType::kLlama:
    case ModelType::kMistral:
      c.qkv_bias = c.o_bias = j.boolean("attention_bias", false);
      break;
    case ModelType::kQwen2:
      c.qkv_bias = true;
      break;
    case ModelType::kQwen3:
      c.qkv_bias = c.o_bias = j.boolean("attention_bias", false);
      c.qk_norm = true;
      break;
    case ModelType::kGemma2:
      c.qkv_bias = c.o_bias = j.boolean("attention_bias", false);
      c.gemma_norms = true;
      c.attn_softcap = j.number("attn_logit_softcapping", 0.0);
      c.final_softcap = j.number("final_logit_softcapping", 0.0);
      break;
  }
  const double qscalar =
      c.type == ModelType::kGemma2 ? j.number("query_pre_attn_scalar", double(c.head_dim)) : double(c.head_dim);
  c.attn_scale = 1.0 / std::sqrt(qscalar);

  // Sliding window: mistral on every layer when set; gemma2 per layer_types (or even layers); qwen2 only
  // with use_sliding_window.
  c.sliding_layers.assign(c.num_layers, false);
  const int64_t window = j.integer("sliding_window", 0);
  const bool qwen_sliding = c.type != ModelType::kQwen2 || j.boolean("use_sliding_window", false);
  if (window > 0 && qwen_sliding && c.type != ModelType::kLlama) {
    c.sliding_window = window;
    if (c.raw.contains("layer_types") && c.raw["layer_types"].is_array()) {
      const auto& lt = c.raw["layer_types"];
      if (int64_t(lt.size()) != c.num_layers) j.fail("layer_types", "needs one entry per layer");
      for (int64_t i = 0; i < c.num_layers; ++i) c.sliding_layers[i] = lt[i] == "sliding_attention";
    } else {
      for (int64_t i = 0; i < c.num_layers; ++i) {
        c.sliding_layers[i] = c.type == ModelType::kGemma2 ? i % 2 == 0 : true;
      }
    }
  }
  const std::string dt = j.string("dtype", j.string("torch_dtype", "float32"));
  c.dtype = parse_dtype(dt, j, c.raw.contains("dtype") ? "dtype" : "torch_dtype");

  if (c.raw.contains("architectures") && c.raw["architectures"].is_array() && !c.raw["architectures"].empty()) {
    if (!c.raw["architectures"][0].is_string()) j.fail("architectures", "expected a list of class names");
    c.architecture = c.raw["architectures"][0].get<std::string>();
  }
  auto ends_with = [&](const char* suffix) {
    const std::string s = suffix;
    return c.architecture.size() >= s.size() &&
           c.architecture.compare(c.architecture.size() - s.size(), s.size(), s) == 0;
  };
  if (ends_with("ForSequenceClassification"))
    c.head = ModelHead::kSequenceScore;
  else if (ends_with("ForTokenClassification"))
    c.head = ModelHead::kTokenScore;
  else if (!c.architecture.empty() && !ends_with("ForCausalLM"))
    j.fail("architectures", "unsupported '" + c.architecture +
                                "' (a *ForCausalLM, *ForSequenceClassification or *ForTokenClassification)");
  if (c.head != ModelHead::kCausalLm) {
    if (c.raw.contains("id2label") && !c.raw["id2label"].is_null()) {
      if (!c.raw["id2label"].is_object()) j.fail("id2label", "expected a mapping of label ids to names");
      c.num_labels = static_cast<int64_t>(c.raw["id2label"].size());
    } else {
      c.num_labels = j.integer("num_labels", 2);
    }
    if (c.num_labels <= 0) j.fail("id2label", "a score head needs at least one label");
  }
  if (c.raw.contains("pad_token_id") && c.raw["pad_token_id"].is_number_integer())
    c.pad_token_id = c.raw["pad_token_id"].get<int64_t>();
  return c;
}

}  // namespace rlt
