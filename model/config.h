// The decoder's configuration, read from a Hugging Face config.json: one struct for the llama, mistral,
// qwen2, qwen3 and gemma2 families, with each family's switches set from its model_type. The parsed
// JSON is kept so that a saved checkpoint writes back every key it was given.
#pragma once

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <stdexcept>
#include <string>
#include <vector>

namespace rlt {

enum class ModelType { kLlama, kMistral, kQwen2, kQwen3, kGemma2 };

// What sits on the trunk, from config.json's architectures: the LM head (*ForCausalLM, and a config that
// names no architecture), or a `score` linear layer of num_labels outputs (*ForSequenceClassification:
// no bias, read at each sequence's last token; *ForTokenClassification: with a bias, at every token).
enum class ModelHead { kCausalLm, kSequenceScore, kTokenScore };

class ModelConfigError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct ModelConfig {
  ModelType type = ModelType::kLlama;
  std::string model_type = "llama";
  ModelHead head = ModelHead::kCausalLm;
  std::string architecture;       // architectures[0] as written, "" when absent
  int64_t num_labels = 0;         // a score head's outputs: id2label's size (transformers' default of 2 without it)
  int64_t pad_token_id = -1;      // -1 when config.json names none
  int64_t vocab_size = 0;         // V
  int64_t hidden_size = 0;        // D
  int64_t intermediate_size = 0;  // F
  int64_t num_layers = 0;
  int64_t num_heads = 0;     // H
  int64_t num_kv_heads = 0;  // Hkv (GQA: H % Hkv == 0)
  int64_t head_dim = 0;      // hd
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  // RoPE: theta and optional llama3-style frequency scaling.
  double rope_theta = 10000.0;
  std::string rope_type = "default";  // default | llama3
  double rope_factor = 1.0, rope_low_freq_factor = 1.0, rope_high_freq_factor = 4.0;
  int64_t rope_original_max_positions = 8192;
  // Family switches.
  bool qkv_bias = false;  // qwen2: q/k/v projections have a bias; llama attention_bias: q/k/v/o
  bool o_bias = false;
  bool qk_norm = false;               // qwen3: RMSNorm over head_dim on q and k before RoPE
  bool gemma_norms = false;           // gemma2: RMSNorm scales by (1 + w); embeddings scaled by sqrt(D);
                                      // post-attention, pre- and post-feedforward norms
  bool gelu_tanh = false;             // MLP activation: gelu (tanh approximation) instead of silu
  double attn_scale = 0.0;            // softmax scale; gemma2: query_pre_attn_scalar^-1/2, else hd^-1/2
  double attn_softcap = 0.0;          // gemma2: scores = cap * tanh(scores / cap); 0 = none
  double final_softcap = 0.0;         // gemma2: logits = cap * tanh(logits / cap); applied by the loss module
  int64_t sliding_window = 0;         // 0 = none
  std::vector<bool> sliding_layers;   // per layer: uses the sliding window
  at::ScalarType dtype = at::kFloat;  // torch_dtype / dtype of the checkpoint
  nlohmann::json raw;                 // every key as read, written back on save
};

// Reads `path` (a config.json, or a folder holding one). Throws ModelConfigError naming the file and
// the key for a missing or ill-typed required key, an unknown model_type or inconsistent sizes.
ModelConfig load_model_config(const std::string& path);
// The same from parsed JSON; `where` names its origin in errors.
ModelConfig model_config_from_json(const nlohmann::json& j, const std::string& where);

// What a checkpoint's generation_config.json says about stopping: every id of eos_token_id (a single id
// or a list; Qwen2.5/3 instruct models list <|im_end|> and <|endoftext|>, Llama-3.1 three ids). Empty
// when the folder has no generation_config.json or it names none. A file that is not JSON, or an
// eos_token_id that is not an id or a list of ids, is a ModelConfigError naming the file.
std::vector<int64_t> generation_eos_ids(const std::string& dir);

}  // namespace rlt
