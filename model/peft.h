// A Transformer's LoRA adapters as a PEFT adapter folder, the format peft's PeftModel.from_pretrained
// loads onto the base checkpoint: adapter_config.json (peft_type LORA, r, lora_alpha, lora_dropout,
// target_modules, base_model_name_or_path, bias "none", task_type CAUSAL_LM) and
// adapter_model.safetensors (fp32 lora_A / lora_B weights under PEFT's names, lora_weight_name()).
// Leaves out: PEFT's other adapter types and options (DoRA, rsLoRA, rank or alpha patterns, modules to
// save), which read_peft_config refuses by name.
#pragma once

#include <string>

#include "model/lora.h"
#include "model/transformer.h"

namespace rlt {

// Writes `dir` (created if needed): adapter_config.json and adapter_model.safetensors of `model`'s
// adapters. base_model: the base checkpoint's folder or hub name (adapter_config's
// base_model_name_or_path; empty: null, for a base made from a seed).
void save_peft_adapter(const Transformer& model, const std::string& dir, const std::string& base_model);

// The LoRA options of `dir`/adapter_config.json (r, lora_alpha, lora_dropout, target_modules). Throws
// ModelConfigError naming the file and the key: a missing or ill-typed key, another peft_type, a target
// module we do not adapt, or a PEFT option this model leaves out (use_dora, use_rslora, rank_pattern ...).
LoraOptions read_peft_config(const std::string& dir);

// Copies `dir`'s adapter weights into `model`'s adapters, in place (an optimizer holding them keeps
// them). The folder's rank, alpha and targets must be the model's (ModelConfigError naming both); a
// missing tensor or a shape that differs is a safetensors::Error naming the file and the tensor.
void load_peft_adapter(Transformer& model, const std::string& dir);

}  // namespace rlt
