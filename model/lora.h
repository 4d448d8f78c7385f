// LoRA (Hu et al. 2021): low-rank adapters on the decoder's projections. The base weights stay frozen;
// a targeted projection computes x W^T + (alpha / rank) (x A^T) B^T, A (rank, in) and B (out, rank).
// This file holds the options, the target names (ours, the HF module paths, PEFT's tensor names) and the
// adapter arithmetic; the Transformer (model/transformer.h) carries the adapters, model/peft.h reads and
// writes them as a PEFT adapter folder. Leaves out: DoRA, rsLoRA scaling, per-layer ranks, adapters on
// the embedding or the LM head.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/fields.h"

namespace rlt {

// The projections adapters can go on, by index: q, k, v, o, gate, up, down.
constexpr int kLoraTargets = 7;
// "q", "k", ..., "down": the names lora.targets lists.
const char* lora_target_name(int target);
// The module path under a decoder layer, "self_attn.q_proj" ... "mlp.down_proj".
const char* lora_module_path(int target);
// The module's own name, "q_proj" ... "down_proj" (PEFT's target_modules).
const char* lora_module_name(int target);
// PEFT's name of layer `layer`'s adapter on `target` in adapter_model.safetensors:
// base_model.model.model.layers.<layer>.<module path>.lora_A.weight (lora_B for b).
std::string lora_weight_name(int64_t layer, int target, bool b);

struct LoraOptions {
  int64_t rank = 0;
  double alpha = 16;
  double dropout = 0;
  std::string targets = "q,k,v,o,gate,up,down";

  bool enabled() const { return rank > 0; }
  double scale() const { return alpha / static_cast<double>(rank); }
  // targets, split and checked; an unknown name throws std::invalid_argument naming it.
  std::vector<std::string> target_list() const;
  // The same as indices (lora_target_name's), in increasing order.
  std::vector<int> target_indices() const;

  template <class V>
  void visit(V&& v) {
    v("rank", rank, "adapter rank; 0 = full fine-tuning", FieldRange{0, 65536});
    v("alpha", alpha, "adapter scale numerator: the update is alpha / rank x B A", FieldRange{0, 1e6});
    v("dropout", dropout, "dropout on the adapter's input while training", FieldRange{0, 1});
    v("targets", targets, "projections with adapters, comma-separated: q, k, v, o, gate, up, down");
  }
  void check(const FieldFail& fail) const;
};

// The adapter's term of a targeted projection: scale * dropout(x) A^T B^T, (…, out), in x's dtype.
// x (…, in); A (rank, in) and B (out, rank), cast to x's dtype (fp32 adapters on a bf16 model: the cast's
// backward hands fp32 gradients to A and B). dropout_p > 0 zeroes each input element with probability p
// (drawn from `gen`) and scales the rest by 1 / (1 - p), as torch.nn.Dropout does in training.
at::Tensor lora_update(const at::Tensor& x, const at::Tensor& A, const at::Tensor& B, double scale,
                       double dropout_p = 0, std::optional<at::Generator> gen = std::nullopt);

// W + scale * B A computed in fp32 (float64 for a float64 W) and rounded once to W's dtype: the weight of
// a merged model. W (out, in), A (rank, in), B (out, rank); the result is a new tensor without gradient.
at::Tensor lora_merged_weight(const at::Tensor& W, const at::Tensor& A, const at::Tensor& B, double scale);

}  // namespace rlt
