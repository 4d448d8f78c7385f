// Training FLOPs from a decoder's shape and the GPUs' peak rates; see flops.h.
#include "model/flops.h"

#include <algorithm>
#include <utility>

namespace rlt {

ForwardFlops forward_flops(const ModelConfig& c, const SequenceWork& s) {
  const double D = double(c.hidden_size), F = double(c.intermediate_size), hd = double(c.head_dim);
  const double H = double(c.num_heads), Hkv = double(c.num_kv_heads), L = double(s.tokens);
  ForwardFlops f;
  // q (H hd x D), k and v (Hkv hd x D each), o (D x H hd), gate and up (F x D each), down (D x F).
  const double per_token = 2.0 * (D * H * hd + 2.0 * D * Hkv * hd + H * hd * D + 3.0 * D * F);
  f.projections = per_token * L * double(c.num_layers);
  for (int64_t i = 0; i < c.num_layers; ++i) {
    // Position t (1-based) sees t keys, or the window's on a sliding layer: scores and the value product
    // are 2 hd FLOPs a key and head each. keys(n): the keys positions 1..n see.
    const bool sliding = c.sliding_window > 0 && i < int64_t(c.sliding_layers.size()) && c.sliding_layers[i];
    auto keys = [&](double n) {
      const double W = sliding ? double(c.sliding_window) : n, full = std::min(n, W);
      return full * (full + 1) / 2 + (n - full) * W;  // positions 1..full see t keys, the rest W
    };
    const double before = double(s.context);
    f.attention += 4.0 * H * hd * (keys(before + L) - keys(before));
  }
  f.head = 2.0 * double(c.vocab_size) * D * double(s.scored);
  return f;
}

PassFlops training_flops(const ModelConfig& c, const std::vector<SequenceWork>& seqs, bool weight_grads,
                         int64_t recomputed_layers) {
  PassFlops p;
  const double products_backward = weight_grads ? 2.0 : 1.0;
  const double share =
      c.num_layers > 0 ? double(std::clamp<int64_t>(recomputed_layers, 0, c.num_layers)) / c.num_layers : 0;
  for (const SequenceWork& s : seqs) {
    const ForwardFlops f = forward_flops(c, s);
    const double pass = (f.projections + f.head) * (1.0 + products_backward) + f.attention * 3.0;
    p.model += pass;
    p.hardware += pass + share * f.layers();
  }
  return p;
}

double bf16_peak_flops(const std::string& name) {
  // Dense bf16 with float32 accumulation, from NVIDIA's data sheets (SXM parts at their full clocks).
  static const std::pair<const char*, double> kPeaks[] = {
      {"H200", 989.4e12}, {"GH200", 989.4e12}, {"H100 PCIe", 756.0e12}, {"H100 NVL", 835.0e12},
      {"H100", 989.4e12}, {"A100", 312.0e12},  {"L40S", 362.05e12},     {"A10G", 70.0e12}};
  for (const auto& [key, peak] : kPeaks) {
    if (name.find(key) != std::string::npos) return peak;
  }
  return 0;
}

}  // namespace rlt
