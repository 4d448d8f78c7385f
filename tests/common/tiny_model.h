// Tiny random models for CPU tests: a 2-layer llama config for the trainer's pieces, and 2-layer models of
// each supported family (llama, qwen2, qwen3, gemma2) for the rollout's cache and decode paths.
#pragma once

#include <ATen/core/grad_mode.h>

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "model/transformer.h"

namespace rlt::testing {

// A 2-layer llama-architecture config small enough for CPU tests of the trainer's pieces.
inline ModelConfig tiny_llama(int64_t vocab_size, bool tie_word_embeddings = false) {
  const nlohmann::json j = {{"model_type", "llama"},
                            {"vocab_size", vocab_size},
                            {"hidden_size", 32},
                            {"intermediate_size", 64},
                            {"num_hidden_layers", 2},
                            {"num_attention_heads", 2},
                            {"num_key_value_heads", 1},
                            {"rms_norm_eps", 1e-6},
                            {"rope_theta", 10000.0},
                            {"tie_word_embeddings", tie_word_embeddings},
                            {"max_position_embeddings", 64}};
  return model_config_from_json(j, "tiny");
}

// The config.json of a 2-layer model of family `type` (model_type), 400 tokens, four query heads over two
// KV heads. gemma2's sliding window (4 slots) is shorter than the tests' sequences, so it is exercised.
inline nlohmann::json tiny_family_config(const std::string& type) {
  nlohmann::json j = {{"model_type", type},       {"vocab_size", 400},      {"hidden_size", 32},
                      {"intermediate_size", 64},  {"num_hidden_layers", 2}, {"num_attention_heads", 4},
                      {"num_key_value_heads", 2}, {"rms_norm_eps", 1e-6},   {"tie_word_embeddings", false},
                      {"rope_theta", 10000.0}};
  if (type == "gemma2") {
    j["head_dim"] = 8;
    j["query_pre_attn_scalar"] = 8;
    j["sliding_window"] = 4;
    j["attn_logit_softcapping"] = 50.0;
    j["final_logit_softcapping"] = 30.0;
    j["hidden_activation"] = "gelu_pytorch_tanh";
  }
  return j;
}

// tiny_family_config(type) with random weights from `seed`, scaled to std 0.2: logits far from uniform, so
// errors in a cached forward show.
inline Transformer tiny_model(const std::string& type, uint64_t seed, at::Device device = at::kCPU,
                              at::ScalarType dtype = at::kDouble) {
  Transformer m(model_config_from_json(tiny_family_config(type), "tiny " + type), dtype, device, seed);
  at::NoGradGuard no_grad;
  for (auto& p : m.parameters()) p.mul_(10.0);
  return m;
}

}  // namespace rlt::testing
