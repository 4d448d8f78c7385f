// A 2-layer llama-architecture config small enough for CPU tests of the trainer's pieces.
#pragma once

#include <cstdint>

#include <nlohmann/json.hpp>

#include "model/config.h"

namespace rlt::testing {

inline ModelConfig tiny_llama(int64_t vocab_size) {
  const nlohmann::json j = {{"model_type", "llama"},        {"vocab_size", vocab_size},     {"hidden_size", 32},
                            {"intermediate_size", 64},      {"num_hidden_layers", 2},       {"num_attention_heads", 2},
                            {"num_key_value_heads", 1},     {"rms_norm_eps", 1e-6},         {"rope_theta", 10000.0},
                            {"tie_word_embeddings", false}, {"max_position_embeddings", 64}};
  return model_config_from_json(j, "tiny");
}

}  // namespace rlt::testing
