// LoRA (Hu et al. 2021): low-rank adapters on the decoder's projections. The base weights stay frozen;
// a targeted projection computes x W^T + (alpha / rank) (x A^T) B^T, A (rank, in) and B (out, rank).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/fields.h"

namespace rlt {

struct LoraOptions {
  int64_t rank = 0;     // 0 = off: the whole model trains
  double alpha = 16;    // the update is scaled by alpha / rank
  double dropout = 0;   // on the adapter's input, during training forwards
  // Projections that get adapters, comma-separated, among q, k, v, o, gate, up, down.
  std::string targets = "q,k,v,o,gate,up,down";

  bool enabled() const { return rank > 0; }
  // targets, split and checked; an unknown name throws std::invalid_argument naming it.
  std::vector<std::string> target_list() const;

  template <class V>
  void visit(V&& v) {
    v("rank", rank, "adapter rank; 0 = full fine-tuning", FieldRange{0, 65536});
    v("alpha", alpha, "adapter scale numerator: the update is alpha / rank x B A", FieldRange{0, 1e6});
    v("dropout", dropout, "dropout on the adapter's input while training", FieldRange{0, 1});
    v("targets", targets, "projections with adapters, comma-separated: q, k, v, o, gate, up, down");
  }
  void check(const FieldFail& fail) const;
};

}  // namespace rlt
