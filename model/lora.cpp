// LoRA adapters; see lora.h.
#include "model/lora.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <sstream>
#include <stdexcept>

namespace rlt {

namespace {

const char* const kTargets[kLoraTargets] = {"q", "k", "v", "o", "gate", "up", "down"};
const char* const kModulePaths[kLoraTargets] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                "self_attn.o_proj", "mlp.gate_proj",    "mlp.up_proj",
                                                "mlp.down_proj"};

}  // namespace

const char* lora_target_name(int target) { return kTargets[target]; }
const char* lora_module_path(int target) { return kModulePaths[target]; }
const char* lora_module_name(int target) {
  const char* p = kModulePaths[target];
  const char* dot = p;
  while (*dot && *dot != '.') ++dot;
  return *dot ? dot + 1 : p;
}

std::string lora_weight_name(int64_t layer, int target, bool b) {
  return "base_model.model.model.layers." + std::to_string(layer) + "." + kModulePaths[target] +
         (b ? ".lora_B.weight" : ".lora_A.weight");
}

std::vector<std::string> LoraOptions::target_list() const {
  std::vector<std::string> out;
  std::stringstream ss(targets);
  std::string t;
  while (std::getline(ss, t, ',')) {
    const size_t b = t.find_first_not_of(" \t"), e = t.find_last_not_of(" \t");
    t = b == std::string::npos ? std::string() : t.substr(b, e - b + 1);
    bool known = false;
    for (const char* k : kTargets) known = known || t == k;
    if (!known) throw std::invalid_argument("unknown target '" + t + "' (known: q, k, v, o, gate, up, down)");
    for (const auto& o : out) {
      if (o == t) throw std::invalid_argument("target '" + t + "' listed twice");
    }
    out.push_back(t);
  }
  return out;
}

std::vector<int> LoraOptions::target_indices() const {
  const std::vector<std::string> names = target_list();
  std::vector<int> out;
  for (int t = 0; t < kLoraTargets; ++t) {
    for (const auto& n : names) {
      if (n == kTargets[t]) out.push_back(t);
    }
  }
  return out;
}

void LoraOptions::check(const FieldFail& fail) const {
  try {
    if (target_list().empty()) fail("targets", "names no projection");
  } catch (const std::invalid_argument& e) {
    fail("targets", e.what());
  }
  // p = 1 leaves nothing to scale by 1 / (1 - p).
  if (dropout >= 1) fail("dropout", "must be below 1 (1 drops every input of the adapters)");
}

at::Tensor lora_update(const at::Tensor& x, const at::Tensor& A, const at::Tensor& B, double scale, double dropout_p,
                       std::optional<at::Generator> gen) {
  TORCH_CHECK(A.dim() == 2 && B.dim() == 2 && B.size(1) == A.size(0) && x.size(-1) == A.size(1),
              "lora_update: x (..., in), A (rank, in), B (out, rank); got ", x.sizes(), ", ", A.sizes(), ", ",
              B.sizes());
  const at::ScalarType dt = x.scalar_type();
  at::Tensor xd = x;  // (…, in)
  if (dropout_p > 0) {
    at::Tensor keep = at::empty_like(x).bernoulli_(1.0 - dropout_p, gen);
    xd = x * keep.div_(1.0 - dropout_p);
  }
  // PEFT's order (lora_B(lora_A(dropout(x))) * scaling), so that our logits follow peft's rounding.
  return at::linear(at::linear(xd, A.to(dt)), B.to(dt)) * scale;  // (…, out)
}

at::Tensor lora_merged_weight(const at::Tensor& W, const at::Tensor& A, const at::Tensor& B, double scale) {
  TORCH_CHECK(W.dim() == 2 && A.dim() == 2 && B.dim() == 2 && A.size(1) == W.size(1) && B.size(0) == W.size(0) &&
                  B.size(1) == A.size(0),
              "lora_merged_weight: W (out, in), A (rank, in), B (out, rank); got ", W.sizes(), ", ", A.sizes(), ", ",
              B.sizes());
  at::NoGradGuard no_grad;
  const at::ScalarType acc = W.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor delta = at::mm(B.detach().to(acc), A.detach().to(acc));  // (out, in)
  delta.mul_(scale);
  return (W.detach().to(acc) + delta).to(W.scalar_type());  // one rounding to W's dtype
}

}  // namespace rlt
