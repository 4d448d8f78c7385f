// Transformer::pack_weights and pack_weights_into: the layout of PackedWeights (q, k, v; gate, up), written
// in one place.
#include "model/packed_weights.h"

#include <ATen/core/grad_mode.h>

#include "model/transformer.h"

namespace rlt {

PackedWeights Transformer::pack_weights() const {
  // Empty tensors of each group's dtype and device, which pack_weights_into sizes and fills.
  PackedWeights p;
  for (const Layer& l : layers_) {
    if (!config_.qk_norm) {
      p.qkv_w.push_back(at::empty({0}, l.q_w.options()));
      p.qkv_b.push_back(l.q_b.defined() ? at::empty({0}, l.q_b.options()) : at::Tensor());
    }
    p.gate_up_w.push_back(at::empty({0}, l.gate_w.options()));
  }
  pack_weights_into(p);
  return p;
}

void Transformer::pack_weights_into(PackedWeights& p) const {
  at::NoGradGuard no_grad;
  TORCH_CHECK(p.gate_up_w.size() == layers_.size(), "pack_weights_into: packed weights of another model");
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& l = layers_[i];
    if (!config_.qk_norm) {
      at::cat_out(p.qkv_w[i], {l.q_w, l.k_w, l.v_w}, 0);
      if (l.q_b.defined()) at::cat_out(p.qkv_b[i], {l.q_b, l.k_b, l.v_b}, 0);
    }
    at::cat_out(p.gate_up_w[i], {l.gate_w, l.up_w}, 0);
  }
}

}  // namespace rlt
