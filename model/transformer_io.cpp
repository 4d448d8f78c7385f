// The Transformer's parameters under their Hugging Face names: the name table, random initialisation,
// loading from and saving to a Hugging Face folder (config.json + safetensors), copies and clones.
#include <ATen/CPUGeneratorImpl.h>

#include <filesystem>
#include <fstream>
#include <stdexcept>

#include "model/safetensors.h"
#include "model/transformer.h"

namespace rlt {

namespace {

// The parameters of a model: HF name -> shape, in a fixed order.
std::vector<std::pair<std::string, std::vector<int64_t>>> parameter_shapes(const ModelConfig& c) {
  const int64_t D = c.hidden_size, F = c.intermediate_size, qd = c.num_heads * c.head_dim,
                kvd = c.num_kv_heads * c.head_dim;
  std::vector<std::pair<std::string, std::vector<int64_t>>> s;
  s.push_back({"model.embed_tokens.weight", {c.vocab_size, D}});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    s.push_back({p + "input_layernorm.weight", {D}});
    s.push_back({p + "self_attn.q_proj.weight", {qd, D}});
    s.push_back({p + "self_attn.k_proj.weight", {kvd, D}});
    s.push_back({p + "self_attn.v_proj.weight", {kvd, D}});
    s.push_back({p + "self_attn.o_proj.weight", {D, qd}});
    if (c.qkv_bias) {
      s.push_back({p + "self_attn.q_proj.bias", {qd}});
      s.push_back({p + "self_attn.k_proj.bias", {kvd}});
      s.push_back({p + "self_attn.v_proj.bias", {kvd}});
    }
    if (c.o_bias) s.push_back({p + "self_attn.o_proj.bias", {D}});
    if (c.qk_norm) {
      s.push_back({p + "self_attn.q_norm.weight", {c.head_dim}});
      s.push_back({p + "self_attn.k_norm.weight", {c.head_dim}});
    }
    s.push_back({p + "post_attention_layernorm.weight", {D}});
    if (c.gemma_norms) {
      s.push_back({p + "pre_feedforward_layernorm.weight", {D}});
      s.push_back({p + "post_feedforward_layernorm.weight", {D}});
    }
    s.push_back({p + "mlp.gate_proj.weight", {F, D}});
    s.push_back({p + "mlp.up_proj.weight", {F, D}});
    s.push_back({p + "mlp.down_proj.weight", {D, F}});
  }
  s.push_back({"model.norm.weight", {D}});
  if (c.head == ModelHead::kCausalLm && !c.tie_word_embeddings) s.push_back({"lm_head.weight", {c.vocab_size, D}});
  if (c.head != ModelHead::kCausalLm) s.push_back({"score.weight", {c.num_labels, D}});
  if (c.head == ModelHead::kTokenScore) s.push_back({"score.bias", {c.num_labels}});
  return s;
}

}  // namespace

Transformer& Transformer::operator=(const Transformer& other) {
  if (this == &other) return *this;
  config_ = other.config_;
  embed_ = other.embed_;
  final_norm_ = other.final_norm_;
  lm_head_ = other.lm_head_;
  score_ = other.score_;
  score_bias_ = other.score_bias_;
  layers_ = other.layers_;
  checkpointing_ = other.checkpointing_;
  checkpoint_layers_ = other.checkpoint_layers_;
  fused_kernels_ = other.fused_kernels_;
  training_kernels_ = other.training_kernels_;
  residency_ = other.residency_;
  lora_ = other.lora_;
  lora_gen_ = other.lora_gen_;
  bind_names();  // by_name_ must point at this object's members, not other's
  return *this;
}

Transformer Transformer::clone() const {
  Transformer t;
  t.config_ = config_;
  t.checkpointing_ = checkpointing_;
  t.checkpoint_layers_ = checkpoint_layers_;
  t.fused_kernels_ = fused_kernels_;
  t.training_kernels_ = training_kernels_;
  t.bind_names();  // points t's name table at t's own members
  for (const auto& [name, ptr] : by_name_) {
    if (ptr->defined()) *t.by_name_.at(name) = ptr->detach().clone();
  }
  if (ties_lm_head()) t.lm_head_ = t.embed_;
  t.lora_ = lora_;
  if (lora_gen_.defined()) t.lora_gen_ = lora_gen_.clone();
  for (size_t i = 0; i < layers_.size(); ++i) {
    for (int k = 0; k < kLoraTargets; ++k) {
      if (!layers_[i].lora_a[k].defined()) continue;
      t.layers_[i].lora_a[k] = layers_[i].lora_a[k].detach().clone();
      t.layers_[i].lora_b[k] = layers_[i].lora_b[k].detach().clone();
    }
  }
  return t;
}

namespace {

// The family's token-classification class: the architecture's own stem (Qwen2ForCausalLM ->
// Qwen2ForTokenClassification), else the model_type's.
std::string token_classification_class(const ModelConfig& c) {
  for (const char* suffix : {"ForCausalLM", "ForSequenceClassification", "ForTokenClassification"}) {
    const std::string s = suffix;
    const std::string& a = c.architecture;
    if (a.size() > s.size() && a.compare(a.size() - s.size(), s.size(), s) == 0) {
      return a.substr(0, a.size() - s.size()) + "ForTokenClassification";
    }
  }
  switch (c.type) {
    case ModelType::kLlama:
      return "LlamaForTokenClassification";
    case ModelType::kMistral:
      return "MistralForTokenClassification";
    case ModelType::kQwen2:
      return "Qwen2ForTokenClassification";
    case ModelType::kQwen3:
      return "Qwen3ForTokenClassification";
    case ModelType::kGemma2:
      return "Gemma2ForTokenClassification";
  }
  return "LlamaForTokenClassification";
}

}  // namespace

Transformer Transformer::value_model() const {
  if (has_lora()) throw std::invalid_argument("value_model: a model with adapters (merge them first)");
  if (config_.head != ModelHead::kCausalLm && config_.num_labels != 1) {
    throw ModelConfigError("a critic needs one output: this " + config_.architecture + " has " +
                           std::to_string(config_.num_labels) + " labels (id2label)");
  }
  Transformer t;
  t.config_ = config_;
  ModelConfig& c = t.config_;
  c.head = ModelHead::kTokenScore;
  c.num_labels = 1;
  c.architecture = token_classification_class(config_);
  c.raw["architectures"] = nlohmann::json::array({c.architecture});
  c.raw["id2label"] = {{"0", "LABEL_0"}};
  c.raw["label2id"] = {{"LABEL_0", 0}};
  c.raw.erase("num_labels");
  t.checkpointing_ = checkpointing_;
  t.checkpoint_layers_ = checkpoint_layers_;
  t.fused_kernels_ = fused_kernels_;
  t.training_kernels_ = training_kernels_;
  t.bind_names();
  for (const auto& [name, ptr] : t.by_name_) {
    auto it = by_name_.find(name);
    if (it != by_name_.end() && it->second->defined()) *ptr = it->second->detach().clone().requires_grad_(true);
  }
  const auto opts = embed_.options();
  if (!t.score_.defined()) t.score_ = at::zeros({1, c.hidden_size}, opts).requires_grad_(true);
  if (!t.score_bias_.defined()) t.score_bias_ = at::zeros({1}, opts).requires_grad_(true);
  return t;
}

void Transformer::bind_names() {
  const ModelConfig& c = config_;
  by_name_.clear();
  layers_.resize(c.num_layers);
  by_name_["model.embed_tokens.weight"] = &embed_;
  by_name_["model.norm.weight"] = &final_norm_;
  if (c.head == ModelHead::kCausalLm && !c.tie_word_embeddings) by_name_["lm_head.weight"] = &lm_head_;
  if (c.head != ModelHead::kCausalLm) by_name_["score.weight"] = &score_;
  if (c.head == ModelHead::kTokenScore) by_name_["score.bias"] = &score_bias_;
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    Layer& l = layers_[i];
    by_name_[p + "input_layernorm.weight"] = &l.input_norm;
    by_name_[p + "self_attn.q_proj.weight"] = &l.q_w;
    by_name_[p + "self_attn.k_proj.weight"] = &l.k_w;
    by_name_[p + "self_attn.v_proj.weight"] = &l.v_w;
    by_name_[p + "self_attn.o_proj.weight"] = &l.o_w;
    by_name_[p + "self_attn.q_proj.bias"] = &l.q_b;
    by_name_[p + "self_attn.k_proj.bias"] = &l.k_b;
    by_name_[p + "self_attn.v_proj.bias"] = &l.v_b;
    by_name_[p + "self_attn.o_proj.bias"] = &l.o_b;
    by_name_[p + "self_attn.q_norm.weight"] = &l.q_norm;
    by_name_[p + "self_attn.k_norm.weight"] = &l.k_norm;
    by_name_[p + "post_attention_layernorm.weight"] = &l.post_attn_norm;
    by_name_[p + "pre_feedforward_layernorm.weight"] = &l.pre_ff_norm;
    by_name_[p + "post_feedforward_layernorm.weight"] = &l.post_ff_norm;
    by_name_[p + "mlp.gate_proj.weight"] = &l.gate_w;
    by_name_[p + "mlp.up_proj.weight"] = &l.up_w;
    by_name_[p + "mlp.down_proj.weight"] = &l.down_w;
  }
}

Transformer::Transformer(ModelConfig config, at::ScalarType dtype, at::Device device, uint64_t seed)
    : config_(std::move(config)) {
  bind_names();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (const auto& [name, shape] : parameter_shapes(config_)) {
    const bool norm = name.find("norm") != std::string::npos, bias = name.find(".bias") != std::string::npos;
    at::Tensor t = at::empty(shape, at::kFloat);
    if (bias)
      t.zero_();
    else if (norm)
      t.fill_(config_.gemma_norms ? 0.0 : 1.0);  // gemma scales by (1 + w)
    else
      t.normal_(0.0, 0.02, gen);
    *by_name_.at(name) = t.to(device, dtype).requires_grad_(true);
  }
  if (ties_lm_head()) lm_head_ = embed_;
  config_.dtype = dtype;
}

Transformer Transformer::load_or_random(const std::string& dir, at::ScalarType dtype, at::Device device,
                                        uint64_t seed) {
  namespace fs = std::filesystem;
  const bool weights =
      fs::exists(fs::path(dir) / "model.safetensors") || fs::exists(fs::path(dir) / "model.safetensors.index.json");
  if (weights) return load(dir, dtype, device);
  return Transformer(load_model_config(dir), dtype, device, seed);
}

Transformer Transformer::load(const std::string& dir, at::ScalarType dtype, at::Device device) {
  Transformer t;
  t.config_ = load_model_config(dir);
  t.bind_names();
  const auto reader = safetensors::Reader::open(dir);
  for (const auto& [name, shape] : parameter_shapes(t.config_)) {
    *t.by_name_.at(name) = reader.load(name, shape, dtype).to(device).requires_grad_(true);
  }
  if (t.ties_lm_head()) t.lm_head_ = t.embed_;
  t.config_.dtype = dtype;
  return t;
}

void Transformer::save(const std::string& dir, uint64_t max_shard_bytes) const {
  std::filesystem::create_directories(dir);
  nlohmann::json cfg = config_.raw;
  const char* dt = config_.dtype == at::kBFloat16 ? "bfloat16" : config_.dtype == at::kHalf ? "float16" : "float32";
  cfg[cfg.contains("torch_dtype") && !cfg.contains("dtype") ? "torch_dtype" : "dtype"] = dt;
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  {
    std::ofstream f(path + ".tmp");
    f << cfg.dump(2) << "\n";
    if (!f) throw std::runtime_error(path + ": cannot write");
  }
  std::filesystem::rename(path + ".tmp", path);
  // The tensors where they live: the writer copies one at a time to the host, so a GPU model is never
  // held on the host whole.
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [name, t] : named_parameters()) tensors.emplace_back(name, t.detach());
  safetensors::write_checkpoint(dir, tensors, max_shard_bytes);
}

std::vector<std::pair<std::string, at::Tensor>> Transformer::named_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& [name, ptr] : by_name_) {  // std::map: sorted by name
    if (ptr->defined()) out.emplace_back(name, *ptr);
  }
  return out;
}

std::vector<at::Tensor> Transformer::parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& [name, t] : named_parameters()) out.push_back(t);
  return out;
}

}  // namespace rlt
