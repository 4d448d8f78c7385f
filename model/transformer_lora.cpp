// The Transformer's LoRA adapters: attaching them, their term in a targeted projection, the merged model
// the rollout decodes, snapshots, and the dropout generator's state. The adapter arithmetic itself is
// model/lora.h's; reading and writing PEFT folders is model/peft.h's.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <ATen/detail/CUDAHooksInterface.h>

#include <cmath>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>

#include "model/transformer.h"

namespace rlt {

at::Tensor Transformer::Layer::*const Transformer::kLoraWeights[kLoraTargets] = {
    &Layer::q_w, &Layer::k_w, &Layer::v_w, &Layer::o_w, &Layer::gate_w, &Layer::up_w, &Layer::down_w};

void Transformer::attach_lora(const LoraOptions& options, uint64_t seed) {
  const std::vector<int> targets = options.target_indices();
  if (!options.enabled() || targets.empty()) throw std::invalid_argument("attach_lora: rank 0 or no target");
  lora_ = options;
  at::NoGradGuard no_grad;
  for (const auto& [name, ptr] : by_name_) {
    if (ptr->defined()) ptr->requires_grad_(false);  // the base is frozen
  }
  const at::ScalarType dt = embed_.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto dev = embed_.device();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (Layer& l : layers_) {
    l.lora_a.fill(at::Tensor());
    l.lora_b.fill(at::Tensor());
    for (int t : targets) {
      const at::Tensor& w = l.*kLoraWeights[t];  // (out, in)
      const double bound = 1.0 / std::sqrt(static_cast<double>(w.size(1)));
      l.lora_a[t] = at::empty({options.rank, w.size(1)}, dt).uniform_(-bound, bound, gen).to(dev).requires_grad_(true);
      l.lora_b[t] =
          at::zeros({w.size(0), options.rank}, at::TensorOptions().dtype(dt).device(dev)).requires_grad_(true);
    }
  }
  // The dropout masks' stream, apart from the initialisation's.
  const uint64_t dropout_seed = seed ^ 0x9E3779B97F4A7C15ull;
  if (dev.is_cpu()) {
    lora_gen_ = at::make_generator<at::CPUGeneratorImpl>(dropout_seed);
  } else {
    lora_gen_ = at::detail::getCUDAHooks().getNewGenerator(dev.index());
    lora_gen_.set_current_seed(dropout_seed);
  }
}

at::Tensor Transformer::lora_term(const Layer& l, int target, const at::Tensor& x, bool dropout) const {
  const double p = dropout ? lora_.dropout : 0.0;
  return lora_update(x, l.lora_a[target], l.lora_b[target], lora_.scale(), p,
                     p > 0 ? std::optional<at::Generator>(lora_gen_) : std::nullopt);
}

Transformer Transformer::merged() const {
  Transformer m = *this;  // shares every tensor; the targeted weights are replaced below
  m.lora_ = LoraOptions();
  m.lora_gen_ = at::Generator();
  for (size_t i = 0; i < layers_.size(); ++i) {
    Layer& ml = m.layers_[i];
    for (int k = 0; k < kLoraTargets; ++k) {
      if (ml.lora_a[k].defined()) {
        ml.*kLoraWeights[k] = lora_merged_weight(ml.*kLoraWeights[k], ml.lora_a[k], ml.lora_b[k], lora_.scale());
      }
      ml.lora_a[k] = ml.lora_b[k] = at::Tensor();
    }
  }
  return m;
}

void Transformer::merge_into(Transformer& dst) const {
  TORCH_CHECK(!dst.has_lora() && dst.layers_.size() == layers_.size(),
              "merge_into: dst must be merged() of this model");
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& l = layers_[i];
    for (int k = 0; k < kLoraTargets; ++k) {
      if (!l.lora_a[k].defined()) continue;
      at::Tensor& w = dst.layers_[i].*kLoraWeights[k];
      const at::Tensor& base = l.*kLoraWeights[k];
      TORCH_CHECK(w.sizes() == base.sizes() && !w.is_same(base), "merge_into: layer ", i, " ", lora_module_path(k),
                  ": dst's weight is this model's base weight or of another shape; make dst with merged()");
      w.copy_(lora_merged_weight(base, l.lora_a[k], l.lora_b[k], lora_.scale()));
    }
  }
}

Transformer Transformer::adapter_snapshot() const {
  TORCH_CHECK(has_lora(), "adapter_snapshot: the model has no adapters");
  Transformer s = *this;
  if (lora_gen_.defined()) s.lora_gen_ = lora_gen_.clone();
  for (Layer& l : s.layers_) {
    for (int k = 0; k < kLoraTargets; ++k) {
      if (!l.lora_a[k].defined()) continue;
      l.lora_a[k] = l.lora_a[k].detach().clone();
      l.lora_b[k] = l.lora_b[k].detach().clone();
    }
  }
  return s;
}

at::Tensor Transformer::lora_rng_state() const {
  if (!lora_gen_.defined()) return at::Tensor();
  at::Generator gen = lora_gen_;
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void Transformer::set_lora_rng_state(const at::Tensor& state) {
  TORCH_CHECK(lora_gen_.defined(), "set_lora_rng_state: the model has no adapters");
  at::Generator gen = lora_gen_;
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

std::vector<std::pair<std::string, at::Tensor>> Transformer::named_trainable_parameters() const {
  if (!has_lora()) return named_parameters();
  std::map<std::string, at::Tensor> adapters;  // sorted by name, as named_parameters()
  for (size_t i = 0; i < layers_.size(); ++i) {
    for (int k = 0; k < kLoraTargets; ++k) {
      if (!layers_[i].lora_a[k].defined()) continue;
      adapters[lora_weight_name(static_cast<int64_t>(i), k, false)] = layers_[i].lora_a[k];
      adapters[lora_weight_name(static_cast<int64_t>(i), k, true)] = layers_[i].lora_b[k];
    }
  }
  return {adapters.begin(), adapters.end()};
}

std::vector<at::Tensor> Transformer::trainable_parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& [name, t] : named_trainable_parameters()) out.push_back(t);
  return out;
}

}  // namespace rlt
