// KvCache's writes and reorganisations, and the cuDNN guard. The ATen forms run everywhere; squeeze_ takes
// its CUDA kernel (model/cuda/decode_kernels.h) where the tensors allow it.
#include "model/kv_cache.h"

#ifdef RLT_HAVE_CUDA
#include "model/cuda/decode_kernels.h"
#endif

namespace rlt {

NoCudnnAttention::NoCudnnAttention(bool active) : active_(active) {
  if (!active_) return;
  previous_ = at::globalContext().userEnabledCuDNNSDP();
  at::globalContext().setSDPUseCuDNN(false);
}

NoCudnnAttention::~NoCudnnAttention() {
  if (active_) at::globalContext().setSDPUseCuDNN(previous_);
}

KvCache KvCache::allocate(const ModelConfig& c, int64_t batch, int64_t max_len, const at::TensorOptions& opts) {
  KvCache kv;
  kv.max_len = max_len;
  for (int64_t i = 0; i < c.num_layers; ++i) {
    kv.k.push_back(at::zeros({batch, c.num_kv_heads, max_len, c.head_dim}, opts));
    kv.v.push_back(at::zeros({batch, c.num_kv_heads, max_len, c.head_dim}, opts));
  }
  kv.positions = at::zeros({batch, max_len}, opts.dtype(at::kLong));
  return kv;
}

namespace {

// (B, Hkv, C, hd): row r's slot j is src's row r, slot slots[r, j]. src (B, Hkv, C0, hd), slots (B, C).
at::Tensor take_slots(const at::Tensor& src, const at::Tensor& slots) {
  const int64_t B = slots.size(0), C = slots.size(1);
  return src.gather(2, slots.view({B, 1, C, 1}).expand({B, src.size(1), C, src.size(3)}));
}

}  // namespace

void KvCache::squeeze_(const at::Tensor& slots) {
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == positions.size(0) && slots.size(1) <= max_len,
              "squeeze_: slots must be (B, S) with S <= ", max_len);
  const int64_t C = slots.size(1);
#ifdef RLT_HAVE_CUDA
  // One launch for every layer, moving only the slots that move (ATen's form: two kernels and a copy of
  // the layer per tensor, 1.1-1.7 ms a squeeze at 64 x 800 slots of Qwen2.5-0.5B on an H200).
  if (cuda::squeeze_slots_supports(k, v) && slots.is_contiguous()) {
    cuda::squeeze_slots_(k, v, slots);
  } else
#endif
  {
    for (auto* layers : {&k, &v}) {
      for (at::Tensor& t : *layers) t.narrow(2, 0, C).copy_(take_slots(t, slots));  // one layer's copy at a time
    }
  }
  positions.narrow(1, 0, C).copy_(positions.gather(1, slots));
  length = C;
}

void KvCache::put_rows_(const at::Tensor& rows, const KvCache& src, const at::Tensor& src_rows) {
  const int64_t C = src.length;
  TORCH_CHECK(rows.dim() == 1 && src_rows.sizes() == rows.sizes() && C <= max_len && src.k.size() == k.size(),
              "put_rows_: rows and src_rows must be (B') and src's ", C, " slots fit in ", max_len);
  for (size_t i = 0; i < k.size(); ++i) {
    k[i].narrow(2, 0, C).index_copy_(0, rows, src.k[i].narrow(2, 0, C).index_select(0, src_rows));
    v[i].narrow(2, 0, C).index_copy_(0, rows, src.v[i].narrow(2, 0, C).index_select(0, src_rows));
  }
  positions.narrow(1, 0, C).index_copy_(0, rows, src.positions.narrow(1, 0, C).index_select(0, src_rows));
}

KvCache KvCache::gather(const at::Tensor& rows, const at::Tensor& slots, int64_t new_max_len) const {
  KvCache source = *this;  // shares the tensors: regather drops only its own references
  return source.regather(rows, slots, new_max_len);
}

KvCache KvCache::regather(const at::Tensor& rows, const at::Tensor& slots, int64_t new_max_len) {
  TORCH_CHECK(rows.dim() == 1 && slots.dim() == 2 && slots.size(0) == rows.size(0),
              "gather: rows must be (B') and slots (B', S')");
  const int64_t B = rows.size(0), C = slots.size(1);
  TORCH_CHECK(C <= new_max_len, "gather: ", C, " slots do not fit in ", new_max_len);
  KvCache out;
  out.packed = packed;
  out.fused_kernels = fused_kernels;
  out.in_place_steps = in_place_steps;
  out.max_len = new_max_len;
  out.length = C;
  for (size_t i = 0; i < k.size(); ++i) {
    for (at::Tensor* src : {&k[i], &v[i]}) {
      at::Tensor dst = at::zeros({B, src->size(1), new_max_len, src->size(3)}, src->options());
      dst.narrow(2, 0, C).copy_(take_slots(src->index_select(0, rows), slots));
      (src == &k[i] ? out.k : out.v).push_back(dst);
      *src = at::Tensor();
    }
  }
  out.positions = at::zeros({B, new_max_len}, positions.options());
  out.positions.narrow(1, 0, C).copy_(positions.index_select(0, rows).gather(1, slots));
  k.clear();
  v.clear();
  positions = at::Tensor();
  max_len = length = 0;
  return out;
}

void KvCache::write_positions(const at::Tensor& new_positions) {
  const int64_t B = new_positions.size(0), L = new_positions.size(1);
  const auto dev = positions.device();
  if (step_slot.defined() && step_rows.defined()) {
    const c10::List<std::optional<at::Tensor>> at_slots{step_rows.view({B, 1}), step_slot.view({1, L})};
    positions.index_put_(at_slots, new_positions.to(dev));
  } else if (step_slot.defined()) {
    positions.index_copy_(1, step_slot, new_positions);
  } else if (step_rows.defined()) {
    positions.narrow(1, length, L).index_copy_(0, step_rows, new_positions.to(dev));
  } else {
    positions.narrow(1, length, L).copy_(new_positions);
  }
}

std::pair<at::Tensor, at::Tensor> KvCache::update(int64_t layer, const at::Tensor& k_new, const at::Tensor& v_new) {
  const int64_t B = k_new.size(0), Hkv = k_new.size(1), L = k_new.size(2);
  at::Tensor &k_cache = k[layer], &v_cache = v[layer];  // (B, Hkv, max_len, hd)
  if (step_slot.defined() && step_rows.defined()) {
    // Rows x slots of the listed rows (distinct rows, so the writes do not collide), then those rows'
    // cache over the span.
    at::Tensor heads = at::arange(Hkv, step_rows.options()).view({1, Hkv, 1});
    const c10::List<std::optional<at::Tensor>> at_slots{step_rows.view({B, 1, 1}), heads, step_slot.view({1, 1, L})};
    k_cache.index_put_(at_slots, k_new);
    v_cache.index_put_(at_slots, v_new);
    return {k_cache.narrow(2, 0, step_span()).index_select(0, step_rows),  // (B, Hkv, span, hd)
            v_cache.narrow(2, 0, step_span()).index_select(0, step_rows)};
  }
  if (step_slot.defined()) {
    k_cache.index_copy_(2, step_slot, k_new);
    v_cache.index_copy_(2, step_slot, v_new);
    return {k_cache.narrow(2, 0, step_span()), v_cache.narrow(2, 0, step_span())};  // (B, Hkv, span, hd)
  }
  if (step_rows.defined()) {
    k_cache.narrow(2, length, L).index_copy_(0, step_rows, k_new);
    v_cache.narrow(2, length, L).index_copy_(0, step_rows, v_new);
    return {k_cache.narrow(2, 0, length + L).index_select(0, step_rows),  // (B, Hkv, C, hd)
            v_cache.narrow(2, 0, length + L).index_select(0, step_rows)};
  }
  k_cache.narrow(2, length, L).copy_(k_new);
  v_cache.narrow(2, length, L).copy_(v_new);
  return {k_cache.narrow(2, 0, length + L), v_cache.narrow(2, 0, length + L)};  // (B, Hkv, C, hd)
}

}  // namespace rlt
