// Transformer::forward_mixed: a decode step and a feed in one forward (DecodeEngine's merged pass), which
// runs the fused CUDA kernels only (model/cuda/decode_kernels.h); a build without CUDA has none.
#include <ATen/core/grad_mode.h>

#include <cmath>

#include "model/layer_kernels.h"
#include "model/transformer.h"

#ifdef RLT_HAVE_CUDA
#include "model/cuda/decode_kernels.h"
#endif

namespace rlt {

bool Transformer::mixed_forward_applies() const {
  const ModelConfig& c = config_;
  bool sliding = false;
  for (int64_t i = 0; i < c.num_layers; ++i) sliding |= c.sliding_layers[i];
  return fused_kernels_apply() && fused_layer_kernels()->attends_in_place(final_norm_.scalar_type(), c.head_dim) &&
         c.attn_softcap == 0 && !sliding && !c.qk_norm && !at::GradMode::is_enabled();
}

at::Tensor Transformer::forward_mixed(const at::Tensor& step_ids, const at::Tensor& step_pos,
                                      const at::Tensor& step_mask, const at::Tensor& feed_ids,
                                      const at::Tensor& feed_pos, const at::Tensor& feed_keep,
                                      const at::Tensor& feed_rows, const at::Tensor& feed_slots, KvCache& cache) const {
  TORCH_CHECK(mixed_forward_applies() && cache.fused_kernels,
              "forward_mixed: needs the fused CUDA kernels (the model's and the cache's) in bf16/fp16 (hd 64 or "
              "128), no soft-capping, sliding window or q/k norm, no grad");
#ifdef RLT_HAVE_CUDA
  const ModelConfig& c = config_;
  const int64_t Bc = step_ids.size(0), E = feed_ids.size(0), K = feed_ids.size(1), T = Bc + E * K;
  const int64_t H = c.num_heads, Hkv = c.num_kv_heads, hd = c.head_dim, G = H / Hkv, span = cache.span;
  TORCH_CHECK(step_ids.sizes() == at::IntArrayRef({Bc, 1}) && step_pos.sizes() == step_ids.sizes() &&
                  feed_pos.sizes() == feed_ids.sizes() && cache.step_slot.numel() == 1 && span > 0 &&
                  span <= cache.max_len && step_mask.sizes() == at::IntArrayRef({Bc, span}) &&
                  feed_keep.sizes() == at::IntArrayRef({E, span}) && feed_rows.numel() == E &&
                  feed_slots.numel() == K && !cache.k.empty() && cache.k[0].size(0) == Bc,
              "forward_mixed: shapes disagree (step (Bc, 1) over every cache row, feed (E, K), masks over span)");
  FusedForwardCounts& counts = fused_forward_counts();
  ++counts.forwards;
  ++counts.in_place_feeds;
  const auto dev = embed_.device();
  const at::ScalarType dt = final_norm_.scalar_type();
  cache.positions.index_copy_(1, cache.step_slot, step_pos);
  const c10::List<std::optional<at::Tensor>> at_slots{feed_rows.view({E, 1}), feed_slots.view({1, K})};
  cache.positions.index_put_(at_slots, feed_pos);

  at::Tensor ids = at::cat({step_ids.reshape({-1}), feed_ids.reshape({-1})});  // (T)
  at::Tensor h = embed_.index_select(0, ids).view({1, T, c.hidden_size});      // (1, T, D)
  if (c.gemma_norms) h = h * at::scalar_tensor(std::sqrt(double(c.hidden_size)), h.options());
  at::Tensor pos = at::cat({step_pos.reshape({-1}), feed_pos.reshape({-1})}).to(at::kFloat);  // (T)
  at::Tensor freqs = pos.unsqueeze(-1) * rope_inv_frequencies(c, dev);                        // (T, hd/2)
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  at::Tensor cos = emb.cos().to(dt), sin = emb.sin().to(dt);  // (T, hd)
  at::Tensor cos_s = cos.narrow(0, 0, Bc).view({Bc, 1, 1, hd}), sin_s = sin.narrow(0, 0, Bc).view({Bc, 1, 1, hd});
  at::Tensor cos_f = cos.narrow(0, Bc, E * K).view({E, 1, K, hd}), sin_f = sin.narrow(0, Bc, E * K).view({E, 1, K, hd});
  ForwardPlan p;  // the pieces of a layer that forward() runs too: norms, projections, attention, the MLP
  p.ops = fused_layer_kernels();
  p.cache = &cache;
  p.packed = cache.packed;
  // The step's mask: kept slots for the in-place attention, else additive (SDPA would convert a boolean
  // one in every layer); the feed's, as kept slots.
  at::Tensor step_keep = kept_slots(step_mask, dev), step_add;
  if (cache.in_place_steps) {
    ++counts.in_place_steps;
  } else {
    step_add = p.ops->sdpa_mask(step_keep.view({Bc, 1, 1, span}), dt);
  }
  at::Tensor keep = kept_slots(feed_keep, dev);
  at::Tensor pending;  // the pending residual: a layer's MLP output, which the next norm's kernel adds
  for (int64_t i = 0; i < c.num_layers; ++i) {
    auto [q, k, v] = project_qkv(i, h, pending, p);  // (1, T, H, hd), (1, T, Hkv, hd) x 2
    auto step_part = [&](const at::Tensor& x, int64_t heads) { return x.narrow(1, 0, Bc).view({Bc, 1, heads, hd}); };
    auto feed_part = [&](const at::Tensor& x, int64_t heads) { return x.narrow(1, Bc, E * K).view({E, K, heads, hd}); };
    // The step, as a graphed step runs it: its keys and values rotated and written at the step slot of every
    // row, with attention over the rows' cache in place, or masked attention over the span (a KV head's
    // G = H / Hkv query heads as G positions of it).
    at::Tensor qs = step_part(q, H), ks = step_part(k, Hkv), vs = step_part(v, Hkv), a_s;
    if (cache.in_place_steps) {
      a_s = p.ops
                ->attend_in_place(i, qs, ks, vs, cos_s, sin_s, cache, at::Tensor(), step_keep, cache.step_slot,
                                  c.attn_scale)
                .view({Bc, H * hd});
    } else {
      cuda::rope_write_cache(qs, ks, vs, cos_s, sin_s, cache.k[i], cache.v[i], cache.step_slot);
      a_s = at::scaled_dot_product_attention(qs.transpose(1, 2).reshape({Bc, Hkv, G, hd}),
                                             cache.k[i].narrow(2, 0, span), cache.v[i].narrow(2, 0, span), step_add,
                                             /*dropout_p=*/0.0, /*is_causal=*/false, c.attn_scale)
                .reshape({Bc, H * hd});
    }
    // The feed, as a fused feed runs it: into its rows' slots, then attention over their cache in place.
    at::Tensor a_f = p.ops
                         ->attend_in_place(i, feed_part(q, H), feed_part(k, Hkv), feed_part(v, Hkv), cos_f, sin_f,
                                           cache, feed_rows, keep, feed_slots, c.attn_scale)
                         .view({E * K, H * hd});
    h = output_and_mlp(i, h, at::cat({a_s, a_f}).view({1, T, H * hd}), pending, p);
  }
  return p.ops->add_norm(h, pending, final_norm_, c.rms_norm_eps, c.gemma_norms).second.view({T, c.hidden_size});
#else
  return at::Tensor();
#endif
}

}  // namespace rlt
