// The decoder forward, following the Hugging Face reference implementations operation by operation
// (transformers' modeling_llama and modeling_qwen2; modeling_gemma2 for its extra norms and soft-capping):
// RMSNorm in fp32, RoPE tables in fp32, attention softmax in fp32, so that fp32 logits agree with
// transformers to ~1e-5 (tests/model/test_transformer.cpp). The operations a fused CUDA kernel can take
// over go through LayerKernels (layer_kernels.h), whose ATen implementation is the reference; running a
// layer under residency or checkpointing is transformer_checkpoint.cpp's.
#include "model/transformer.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "common/memory.h"
#include "model/layer_kernels.h"
#include "model/tuned_gemm.h"

namespace rlt {

namespace {

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  if (tuned_gemms()) return tuned_linear(x, w, b);
  return b.defined() ? at::linear(x, w, b) : at::linear(x, w);
}

// Attention of q (B, H, L, hd) over k, v (B, Hkv, C, hd) under mask (B, 1, L, C) or (B, 1, G L, C) (G = H / Hkv
// query heads per KV head), bool or additive, or undefined: then causal (is_causal) or no restriction (a
// decode step). Returns (B, H, L, hd).
// transformers' sdpa_attention_forward, and eager_attention_forward for gemma2's soft-capped scores.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                     bool is_causal, const ModelConfig& c) {
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), hd = q.size(3), Hkv = k.size(1);
  if (c.attn_softcap > 0) {
    // gemma2: scores are soft-capped before the mask, which SDPA cannot do: the eager form.
    at::Tensor kr = k.repeat_interleave(H / Hkv, 1), vr = v.repeat_interleave(H / Hkv, 1);
    at::Tensor s = at::matmul(q, kr.transpose(2, 3)) * c.attn_scale;  // (B, H, L, C)
    s = at::tanh(s / c.attn_softcap) * c.attn_softcap;
    s = s.masked_fill(mask.logical_not(), -std::numeric_limits<float>::infinity());
    // Softmax in fp32 for bf16/fp16/fp32 activations, in float64 for float64 ones (the reference runs).
    const at::ScalarType acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    return at::matmul(at::softmax(s, -1, acc).to(q.scalar_type()), vr);
  }
  if (H != Hkv && mask.defined()) {
    // Grouped-query attention with a mask (a padded prefill, a step or a feed on a cache with holes): the
    // G = H / Hkv query heads of a KV head become G x L query positions of one head, each group seeing
    // the mask's rows again. SDPA then gets plain multi-head attention over Hkv heads, which its fused
    // masked kernel takes without repeating K and V per query head (with enable_gqa and a mask it falls
    // back to the unfused math path: ~0.5 ms of host time per layer for a 24-token feed on an H200).
    // forward() lays its masks out so once for every layer (size(2) == G L); another caller's (B', 1, L, C)
    // is laid out here. A one-token step's (B', 1, 1, C) serves every query position as it is.
    const int64_t G = H / Hkv, C = k.size(2);
    at::Tensor m = L == 1 || mask.size(2) == G * L
                       ? mask
                       : mask.unsqueeze(2).expand({mask.size(0), 1, G, L, C}).reshape({mask.size(0), 1, G * L, C});
    return at::scaled_dot_product_attention(q.reshape({B, Hkv, G * L, hd}), k, v, m, /*dropout_p=*/0.0,
                                            /*is_causal=*/false, c.attn_scale)
        .reshape({B, H, L, hd});  // not view: the memory-efficient kernel's output is not contiguous
  }
  return at::scaled_dot_product_attention(q, k, v, mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt,
                                          /*dropout_p=*/0.0, is_causal, c.attn_scale, /*enable_gqa=*/H != Hkv);
}

// (1, heads, T, hd) -> (T, heads, hd) with contiguous rows: the flash kernels' layout of packed tokens.
at::Tensor tokens_major(const at::Tensor& x) {
  at::Tensor y = x.squeeze(0).transpose(0, 1);
  return y.stride(-1) == 1 ? y : y.contiguous();
}

// Attention of sequences laid end to end (ForwardPlan::starts): q (1, H, T, hd) over k, v (1, Hkv, T, hd),
// each sequence causal within itself (after its prefix's tokens where it has one), on sliding layers
// (`sliding`) within the window too. Returns (1, T, H, hd). On CUDA in bf16/fp16 one variable-length flash
// kernel takes every sequence (its autograd formula is ATen's; the keys gathered by kv_index where
// prefixes are shared, the causal mask then aligned to each sequence's last key); elsewhere (CPU, fp32,
// soft-capped scores, a restricting window) each sequence goes through attention() as a row of its own,
// which is what the padded forward computes for it.
at::Tensor packed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const ForwardPlan& p,
                            bool sliding, const ModelConfig& c) {
  const int64_t hd = q.size(3);
  const at::ScalarType dt = q.scalar_type();
  const bool shared = p.kv_index.defined();
  if (q.is_cuda() && (dt == at::kBFloat16 || dt == at::kHalf) && hd % 8 == 0 && hd <= 256 && c.attn_softcap == 0 &&
      !sliding) {
    auto keys = [&](const at::Tensor& x) {
      return shared ? tokens_major(x).index_select(0, p.kv_index) : tokens_major(x);
    };
    at::Tensor out = std::get<0>(at::_flash_attention_forward(
        tokens_major(q), keys(k), keys(v), p.cu_seqlens, shared ? p.cu_seqlens_k : p.cu_seqlens, p.longest,
        p.longest_context, /*dropout_p=*/0.0, /*is_causal=*/true, /*return_debug_mask=*/false, c.attn_scale));
    return out.unsqueeze(0);  // (1, T, H, hd)
  }
  std::vector<at::Tensor> parts;
  parts.reserve(p.starts.size() - 1);
  for (size_t s = 0; s + 1 < p.starts.size(); ++s) {
    const int64_t b = p.starts[s], n = p.starts[s + 1] - b;
    const int64_t f = shared ? p.prefix_of[s] : -1, fb = f < 0 ? 0 : p.starts[f], m = f < 0 ? 0 : p.starts[f + 1] - fb;
    at::Tensor ks = k.narrow(2, b, n), vs = v.narrow(2, b, n);
    if (m > 0) ks = at::cat({k.narrow(2, fb, m), ks}, 2), vs = at::cat({v.narrow(2, fb, m), vs}, 2);
    // (1, 1, n, m + n): needed after a prefix, for soft-capped scores and for a window shorter than the context.
    at::Tensor mask;
    if (m > 0 || c.attn_softcap > 0 || (sliding && m + n > c.sliding_window)) {
      // Positions run on from the prefix's, so the window counts tokens.
      const auto longs = at::TensorOptions().dtype(at::kLong).device(q.device());
      at::Tensor dist = (at::arange(n, longs) + m).view({n, 1}) - at::arange(m + n, longs).view({1, m + n});
      mask = (dist >= 0).view({1, 1, n, m + n});
      if (sliding) mask = mask & (dist < c.sliding_window).view({1, 1, n, m + n});
    }
    parts.push_back(attention(q.narrow(2, b, n), ks, vs, mask, /*is_causal=*/!mask.defined() && n > 1, c)
                        .transpose(1, 2));  // (1, n, H, hd)
  }
  return at::cat(parts, 1);
}

// The last layer's attention of forward_packed's output rows: q (1, H, R, hd), one query a row; k and v
// (1, Hkv, T, hd) over every packed token. Row r attends over the tokens p.out_kv_index lists for it (all
// of them: its own is the last), as one variable-length flash kernel on CUDA in bf16 and fp16, else row by
// row. Returns (1, R, H, hd).
at::Tensor output_rows_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const ForwardPlan& p,
                                 const ModelConfig& c) {
  const int64_t R = q.size(2), hd = q.size(3);
  const at::ScalarType dt = q.scalar_type();
  if (q.is_cuda() && (dt == at::kBFloat16 || dt == at::kHalf) && hd % 8 == 0 && hd <= 256 && c.attn_softcap == 0) {
    const at::Tensor cu_q = at::arange(R + 1, q.options().dtype(at::kInt));
    at::Tensor out = std::get<0>(at::_flash_attention_forward(
        tokens_major(q), tokens_major(k).index_select(0, p.out_kv_index),
        tokens_major(v).index_select(0, p.out_kv_index), cu_q, p.out_cu_k, 1, p.out_longest, /*dropout_p=*/0.0,
        /*is_causal=*/false, /*return_debug_mask=*/false, c.attn_scale));
    return out.unsqueeze(0);  // (1, R, H, hd)
  }
  std::vector<at::Tensor> parts;
  parts.reserve(R);
  int64_t at = 0;
  for (int64_t r = 0; r < R; ++r) {
    const at::Tensor keys = p.out_kv_index.narrow(0, at, p.out_keys[r]);
    at += p.out_keys[r];
    // Soft-capped scores take a mask: every key seen.
    const at::Tensor all =
        c.attn_softcap > 0 ? at::ones({1, 1, 1, p.out_keys[r]}, keys.options().dtype(at::kBool)) : at::Tensor();
    parts.push_back(attention(q.narrow(2, r, 1), k.index_select(2, keys), v.index_select(2, keys), all,
                              /*is_causal=*/false, c)
                        .transpose(1, 2));  // (1, 1, H, hd)
  }
  return at::cat(parts, 1);
}

}  // namespace

const at::Tensor& Transformer::lm_head() const {
  TORCH_CHECK(config_.head == ModelHead::kCausalLm, "the model (", config_.architecture,
              ") has a score head, not an LM head: it cannot give token log-probs");
  return lm_head_;
}

at::Tensor Transformer::logits(const at::Tensor& hidden) const {
  lm_head();                                        // the check above
  at::Tensor z = at::matmul(hidden, lm_head_.t());  // (…, V)
  if (config_.final_softcap > 0) z = at::tanh(z / config_.final_softcap) * config_.final_softcap;
  return z;
}

at::Tensor Transformer::score(const at::Tensor& hidden) const {
  TORCH_CHECK(config_.head != ModelHead::kCausalLm, "the model (",
              config_.architecture.empty() ? "a causal LM" : config_.architecture, ") has no score head");
  const at::ScalarType t = hidden.scalar_type();
  return score_bias_.defined() ? at::linear(hidden, score_.to(t), score_bias_.to(t)) : at::linear(hidden, score_.to(t));
}

int64_t Transformer::fused_forward_count() { return fused_forward_counts().forwards.load(); }
int64_t Transformer::in_place_feed_count() { return fused_forward_counts().in_place_feeds.load(); }
int64_t Transformer::in_place_step_count() { return fused_forward_counts().in_place_steps.load(); }

bool Transformer::fused_kernels_apply() const {
  const at::ScalarType dt = final_norm_.scalar_type();
  return fused_kernels_ && fused_layer_kernels() && !has_lora() && final_norm_.is_cuda() &&
         (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf);
}

const LayerKernels* Transformer::cacheless_kernels() const {
  const LayerKernels* train = training_layer_kernels();
  return training_kernels_ && train && embed_.is_cuda() ? train : &aten_layer_kernels();
}

at::Tensor Transformer::forward(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& attention_mask,
                                KvCache* cache) const {
  TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong, "ids must be (B, L) int64, got ", ids.sizes());
  TORCH_CHECK(positions.sizes() == ids.sizes(), "positions must be shaped like ids");
  const int64_t B = ids.size(0), L = ids.size(1);
  // A fixed-shape step (KvCache::step_slot): L tokens per row written at slots held on the device (of
  // the step_rows rows only, if set), attention over slots [0, span) (KvCache::span; 0: every slot);
  // nothing in it depends on a host-side length.
  const bool fixed = cache && cache->step_slot.defined();
  const int64_t span = fixed ? cache->step_span() : 0;
  TORCH_CHECK(!fixed || (span <= cache->max_len && cache->step_slot.numel() == L && attention_mask.defined() &&
                         attention_mask.size(1) == span),
              "a step at KvCache::step_slot takes one slot per input column and a mask over its ", span, " slots");
  const int64_t past = cache ? cache->length : 0, S = fixed ? span : past + L;  // S is C, the slots attended over
  TORCH_CHECK(!cache || S <= cache->max_len, "KV cache full: ", S, " > ", cache->max_len, " slots");
  const bool some_rows = cache && cache->step_rows.defined();
  TORCH_CHECK(!some_rows || (cache->step_rows.size(0) == B && attention_mask.defined() && attention_mask.size(0) == B &&
                             attention_mask.size(1) == S),
              "a forward over KvCache::step_rows takes one input row per listed row and an attention mask over its ", S,
              " slots");
  if (residency_) residency_->acquire(-1, false);
  if (cache) cache->write_positions(positions);

  at::Tensor h = embed_tokens(ids);  // (B, L, D)
  ForwardPlan p;
  p.cache = cache;
  p.S = S;
  rope_tables(positions, h.scalar_type(), p);
  // A no-grad forward through a cache on CUDA (the rollout's) runs the fused kernels. Forwards without a
  // cache (training and scoring) run the fused forms with backward kernels, grad mode on or off, so the
  // trainer's log-probs are bit-identical to the scoring forward's; the CPU keeps the ATen forms.
  const bool fused = fused_kernels_apply() && cache && cache->fused_kernels && !at::GradMode::is_enabled() &&
                     final_norm_.scalar_type() == h.scalar_type();
  p.ops = fused ? fused_layer_kernels() : cache ? &aten_layer_kernels() : cacheless_kernels();
  p.packed = fused ? cache->packed : nullptr;
  if (fused) ++fused_forward_counts().forwards;
  plan_attention(p, positions, attention_mask);
  h = run_layers(h, p);
  if (cache && !fixed) cache->length = S;
  return h;
}

at::Tensor Transformer::forward_packed(const at::Tensor& ids, const at::Tensor& positions,
                                       const std::vector<int64_t>& starts, const std::vector<int64_t>& prefix_of,
                                       const std::vector<int64_t>& outputs) const {
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == 1 && ids.scalar_type() == at::kLong,
              "forward_packed: ids must be (1, T) int64, got ", ids.sizes());
  TORCH_CHECK(positions.sizes() == ids.sizes(), "forward_packed: positions must be shaped like ids");
  const int64_t T = ids.size(1);
  TORCH_CHECK(starts.size() >= 2 && starts.front() == 0 && starts.back() == T,
              "forward_packed: starts must run from 0 to the ", T, " tokens");
  ForwardPlan p;
  for (size_t s = 1; s < starts.size(); ++s) {
    TORCH_CHECK(starts[s] > starts[s - 1], "forward_packed: sequence ", s - 1, " is empty");
    p.longest = std::max(p.longest, starts[s] - starts[s - 1]);
  }
  if (residency_) residency_->acquire(-1, false);
  at::Tensor h = embed_tokens(ids);  // (1, T, D)
  p.S = p.longest;                   // a sliding window restricts only a sequence longer than it
  p.starts = starts;
  // From pinned memory without waiting: a pageable copy would wait for the stream to drain.
  p.cu_seqlens = to_device_async(at::tensor(starts, at::kLong).to(at::kInt), embed_.device());
  p.longest_context = p.longest;
  if (!prefix_of.empty()) {
    const int64_t S = static_cast<int64_t>(starts.size()) - 1;
    TORCH_CHECK(static_cast<int64_t>(prefix_of.size()) == S, "forward_packed: prefix_of must name one prefix (or -1) ",
                "for each of the ", S, " sequences, got ", prefix_of.size());
    std::vector<int64_t> index, cu_k{0};
    for (int64_t s = 0; s < S; ++s) {
      const int64_t f = prefix_of[s];
      TORCH_CHECK(f >= -1 && f < s && (f < 0 || prefix_of[f] < 0), "forward_packed: sequence ", s, "'s prefix ", f,
                  " is not an earlier sequence without a prefix of its own");
      for (const int64_t part : {f, s}) {
        if (part < 0) continue;
        for (int64_t t = starts[part]; t < starts[part + 1]; ++t) index.push_back(t);
      }
      cu_k.push_back(static_cast<int64_t>(index.size()));
      p.longest_context = std::max(p.longest_context, cu_k.back() - cu_k[cu_k.size() - 2]);
    }
    p.prefix_of = prefix_of;
    p.kv_index = to_device_async(index, embed_.device());
    p.cu_seqlens_k = to_device_async(at::tensor(cu_k, at::kLong).to(at::kInt), embed_.device());
  }
  if (!outputs.empty()) plan_outputs(p, outputs, T);
  p.ops = cacheless_kernels();
  rope_tables(positions, h.scalar_type(), p);
  return run_layers(h, p);
}

void Transformer::plan_outputs(ForwardPlan& p, const std::vector<int64_t>& outputs, int64_t T) const {
  const ModelConfig& c = config_;
  const int64_t window = c.sliding_layers[c.num_layers - 1] ? c.sliding_window : 0;
  std::vector<int64_t> index, cu_k{0};
  for (const int64_t t : outputs) {
    TORCH_CHECK(t >= 0 && t < T, "forward_packed: output token ", t, " is outside the ", T, " packed tokens");
    // The sequence that holds t, then the tokens its query sees: its prefix's, then its own up to t.
    const int64_t s = std::upper_bound(p.starts.begin(), p.starts.end(), t) - p.starts.begin() - 1;
    const int64_t f = p.prefix_of.empty() ? -1 : p.prefix_of[s];
    std::vector<int64_t> keys;
    if (f >= 0) {
      for (int64_t k = p.starts[f]; k < p.starts[f + 1]; ++k) keys.push_back(k);
    }
    for (int64_t k = p.starts[s]; k <= t; ++k) keys.push_back(k);
    const int64_t first = window > 0 ? std::max<int64_t>(0, static_cast<int64_t>(keys.size()) - window) : 0;
    index.insert(index.end(), keys.begin() + first, keys.end());
    p.out_keys.push_back(static_cast<int64_t>(keys.size()) - first);
    cu_k.push_back(static_cast<int64_t>(index.size()));
    p.out_longest = std::max(p.out_longest, p.out_keys.back());
  }
  const at::Device dev = embed_.device();
  p.out_rows = to_device_async(outputs, dev);
  p.out_kv_index = to_device_async(index, dev);
  p.out_cu_k = to_device_async(at::tensor(cu_k, at::kLong).to(at::kInt), dev);
}

at::Tensor Transformer::embed_tokens(const at::Tensor& ids) const {
  const ModelConfig& c = config_;
  at::Tensor h = embed_.index_select(0, ids.reshape({-1})).view({ids.size(0), ids.size(1), c.hidden_size});
  if (c.gemma_norms) h = h * at::scalar_tensor(std::sqrt(double(c.hidden_size)), h.options());
  return h;
}

void Transformer::rope_tables(const at::Tensor& positions, at::ScalarType dtype, ForwardPlan& p) const {
  const auto dev = embed_.device();
  // The adapters' dropout runs in training forwards only (grad mode on as the forward starts: a
  // checkpointed layer's first run is no-grad, yet part of a training forward).
  p.dropout = has_lora() && lora_.dropout > 0 && at::GradMode::is_enabled();
  // RoPE tables (B, 1, L, hd) in fp32, then the activation dtype.
  at::Tensor freqs =
      positions.to(dev).to(at::kFloat).unsqueeze(-1) * rope_inv_frequencies(config_, dev);  // (B, L, hd/2)
  at::Tensor emb = at::cat({freqs, freqs}, -1).unsqueeze(1);
  p.cos = emb.cos().to(dtype);
  p.sin = emb.sin().to(dtype);
}

at::Tensor Transformer::run_layers(at::Tensor h, const ForwardPlan& p) const {
  const ModelConfig& c = config_;
  at::Tensor pending;  // fused: the pending residual, a layer's MLP output that the next norm's kernel adds
  for (int64_t i = 0; i < c.num_layers; ++i) h = run_layer(i, h, pending, p);
  return p.ops->add_norm(h, pending, final_norm_, c.rms_norm_eps, c.gemma_norms).second;  // (B, L, D): the final norm
}

void Transformer::plan_attention(ForwardPlan& p, const at::Tensor& positions, const at::Tensor& attention_mask) const {
  const ModelConfig& c = config_;
  const KvCache* cache = p.cache;
  // S is C, the slots attended over.
  const int64_t B = positions.size(0), L = positions.size(1), S = p.S, past = cache ? cache->length : 0;
  const bool fixed = cache && cache->step_slot.defined(), some_rows = cache && cache->step_rows.defined();
  const auto dev = embed_.device();
  const auto lopts = at::TensorOptions().dtype(at::kLong).device(dev);
  const at::ScalarType dt = p.cos.scalar_type();
  bool any_sliding = false;  // a layer whose window restricts this forward
  for (int64_t i = 0; i < c.num_layers; ++i) any_sliding |= c.sliding_layers[i] && S > c.sliding_window;

  // A feed of some rows (KvCache::step_rows), or a step at step_slot over every row, with the fused kernels:
  // attention reads the rows' cache in place (LayerKernels::attend_in_place), under the mask that `keep`
  // (their rows of attention_mask) and the new positions' slots make; no mask tensor is built, no row of
  // the cache gathered, and no key past the last slot a query sees is read. Not for soft-capped scores,
  // sliding windows that restrict this forward, or dtypes and head sizes the kernel lacks.
  const bool in_place_step = fixed && !some_rows && cache->in_place_steps;
  if ((some_rows || in_place_step) && c.attn_softcap == 0 && !any_sliding && p.ops->attends_in_place(dt, c.head_dim)) {
    p.keep = kept_slots(attention_mask, dev);  // (B, C)
    p.slots = fixed ? cache->step_slot : at::arange(past, S, lopts);
    ++(some_rows ? fused_forward_counts().in_place_feeds : fused_forward_counts().in_place_steps);
    return;
  }

  // Which slots each new position may attend to (B, 1, L, C): causal by slot, padding from the mask, and
  // on sliding layers only the last `window` slots. A position may always see itself, so a padded
  // position's row is never empty (an empty row would make NaNs that 0-weights cannot cancel).
  // Without padding, a prefill from an empty cache is plain causal and a one-token decode step sees every
  // slot: a layer without a restricting window then needs no mask, and SDPA can take its fused (flash)
  // kernels.
  const bool unpadded = !attention_mask.defined();
  p.fast = unpadded && (past == 0 || L == 1) && c.attn_softcap == 0;
  if (p.fast && !any_sliding) return;
  at::Tensor q_slot = fixed ? cache->step_slot.view({L, 1}) : at::arange(past, S, lopts).view({L, 1});
  at::Tensor k_slot = at::arange(0, S, lopts).view({1, S});
  at::Tensor causal = (k_slot <= q_slot).view({1, 1, L, S});
  at::Tensor keep =
      unpadded ? at::ones({B, 1, 1, S}, causal.options()) : (attention_mask.to(dev) != 0).view({B, 1, 1, S});
  at::Tensor self = (k_slot == q_slot).view({1, 1, L, S});
  p.full_mask = (causal & keep) | self;
  if (c.sliding_window > 0) {
    // The window counts positions: a cached row may hold holes, so slot distance can exceed it.
    at::Tensor k_pos = !cache      ? positions.to(dev)
                       : some_rows ? cache->positions.narrow(1, 0, S).index_select(0, cache->step_rows)
                                   : cache->positions.narrow(1, 0, S);  // (B, C)
    at::Tensor q_pos = positions.to(dev);                               // (B, L)
    at::Tensor in_window = k_pos.view({B, 1, 1, S}) > (q_pos - c.sliding_window).view({B, 1, L, 1});
    p.sliding_mask = (causal & keep & in_window) | self;
  }
  // Grouped-query attention with a mask (attention()) sees the L positions of a KV head's G = H / Hkv query
  // heads as G L positions of one head, so the mask (B, 1, L, C) is repeated G times along them: once here,
  // for every layer, rather than in each layer. Soft-capped scores take the boolean mask as it is.
  if (c.attn_softcap > 0) return;
  const int64_t G = c.num_heads / c.num_kv_heads;  // H / Hkv query heads per KV head
  for (at::Tensor* m : {&p.full_mask, &p.sliding_mask}) *m = p.ops->sdpa_mask(*m, dt);
  for (at::Tensor* m : {&p.full_mask, &p.sliding_mask}) {
    if (m->defined() && G > 1 && L > 1) {
      *m = m->unsqueeze(2).expand({m->size(0), 1, G, L, S}).reshape({m->size(0), 1, G * L, S});
    }
  }
}

at::Tensor Transformer::layer_forward(int64_t i, at::Tensor h, at::Tensor& pending, const ForwardPlan& p) const {
  const ModelConfig& c = config_;
  const int64_t B = h.size(0), L = h.size(1), H = c.num_heads, hd = c.head_dim;
  // Self-attention block: input norm, q/k/v projections (q/k norms), then RoPE, the cache, attention.
  at::Tensor q, k, v;
  std::tie(q, k, v) = project_qkv(i, h, pending, p);  // (B, L, H, hd), (B, L, Hkv, hd) x 2
  at::Tensor attn;                                    // (B, L, H hd)
  if (p.keep.defined()) {
    // A fused feed of some cache rows, or a fused step over every row (plan_attention): RoPE, the cache
    // write and the attention over the rows' cache where it lies (one kernel where a row's queries fit one
    // tile, cuda::rope_cache_attention).
    attn = p.ops->attend_in_place(i, q, k, v, p.cos, p.sin, *p.cache, p.cache->step_rows, p.keep, p.slots, c.attn_scale)
               .view({B, L, H * hd});
  } else if (!p.starts.empty()) {
    // Packed sequences (forward_packed): each attends causally within itself.
    std::tie(q, k, v) = p.ops->rope_and_cache(i, q, k, v, p.cos, p.sin, nullptr);  // (1, H, T, hd), (1, Hkv, T, hd) x 2
    if (p.out_rows.defined() && i == c.num_layers - 1) {
      // The last layer of a forward that returns some rows: their queries alone, and the rest of the layer
      // over those rows.
      const int64_t R = p.out_rows.size(0);
      h = h.index_select(1, p.out_rows);
      attn = output_rows_attention(q.index_select(2, p.out_rows), k, v, p, c).view({B, R, H * hd});
    } else {
      attn = packed_attention(q, k, v, p, c.sliding_layers[i] && p.longest_context > c.sliding_window, c)
                 .view({B, L, H * hd});
    }
  } else {
    // The window restricts nothing while all C slots fit in it. Without a mask: causal for a prefill, every
    // slot for a decode step.
    const bool sliding = c.sliding_layers[i] && p.S > c.sliding_window, unmasked = p.fast && !sliding;
    const at::Tensor mask = unmasked ? at::Tensor() : sliding ? p.sliding_mask : p.full_mask;
    std::tie(q, k, v) = p.ops->rope_and_cache(i, q, k, v, p.cos, p.sin, p.cache);  // (B, H, L, hd), (B, Hkv, C, hd) x 2
    attn = attention(q, k, v, mask, /*is_causal=*/unmasked && L > 1, c).transpose(1, 2).reshape({B, L, H * hd});
  }
  return output_and_mlp(i, h, attn, pending, p);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> Transformer::project_qkv(int64_t i, at::Tensor& h, at::Tensor& pending,
                                                                        const ForwardPlan& p) const {
  const ModelConfig& c = config_;
  const Layer& l = layers_[i];
  const int64_t B = h.size(0), L = h.size(1), H = c.num_heads, Hkv = c.num_kv_heads, hd = c.head_dim;
  at::Tensor x;                                                                               // (B, L, D)
  std::tie(h, x) = p.ops->add_norm(h, pending, l.input_norm, c.rms_norm_eps, c.gemma_norms);  // input_layernorm
  pending = at::Tensor();
  at::Tensor q, k, v;
  if (p.packed && !p.packed->qkv_w.empty()) {
    // One GEMM, then views of its three column blocks (rows strided by (H + 2 Hkv) hd).
    at::Tensor qkv = linear(x, p.packed->qkv_w[i], p.packed->qkv_b[i]);
    q = qkv.narrow(-1, 0, H * hd).view({B, L, H, hd});
    k = qkv.narrow(-1, H * hd, Hkv * hd).view({B, L, Hkv, hd});
    v = qkv.narrow(-1, (H + Hkv) * hd, Hkv * hd).view({B, L, Hkv, hd});
  } else {
    q = project(l, 0, x, l.q_b, p.dropout).view({B, L, H, hd});
    k = project(l, 1, x, l.k_b, p.dropout).view({B, L, Hkv, hd});
    v = project(l, 2, x, l.v_b, p.dropout).view({B, L, Hkv, hd});
  }
  if (c.qk_norm) {
    q = p.ops->norm(q, l.q_norm, c.rms_norm_eps, /*gemma=*/false);
    k = p.ops->norm(k, l.k_norm, c.rms_norm_eps, /*gemma=*/false);
  }
  return {q, k, v};
}

at::Tensor Transformer::output_and_mlp(int64_t i, const at::Tensor& h, const at::Tensor& attn, at::Tensor& pending,
                                       const ForwardPlan& p) const {
  const ModelConfig& c = config_;
  const Layer& l = layers_[i];
  const bool gemma = c.gemma_norms;
  at::Tensor o = project(l, 3, attn, l.o_b, p.dropout);  // (B, L, D)
  if (gemma) o = p.ops->norm(o, l.post_attn_norm, c.rms_norm_eps, true);
  // Residual, then the MLP block's norm (post_attention_layernorm; gemma2: pre_feedforward_layernorm).
  const at::Tensor& ff_norm = gemma ? l.pre_ff_norm : l.post_attn_norm;
  auto [h2, x] = p.ops->add_norm(h, o, ff_norm, c.rms_norm_eps, gemma);  // (B, L, D) x 2

  // MLP block: down(act(gate(x)) * up(x)).
  at::Tensor g, u;  // (B, L, F) x 2
  if (p.packed) {
    at::Tensor gu = linear(x, p.packed->gate_up_w[i], at::Tensor());  // one GEMM; rows strided by 2 F
    const int64_t F = gu.size(-1) / 2;
    g = gu.narrow(-1, 0, F);
    u = gu.narrow(-1, F, F);
  } else {
    g = project(l, 4, x, at::Tensor(), p.dropout);
    u = project(l, 5, x, at::Tensor(), p.dropout);
  }
  at::Tensor m = project(l, 6, p.ops->act_mul(g, u, c.gelu_tanh), at::Tensor(), p.dropout);  // (B, L, D)
  if (gemma) m = p.ops->norm(m, l.post_ff_norm, c.rms_norm_eps, true);
  return p.ops->add_residual(h2, m, pending);
}

at::Tensor Transformer::project(const Layer& l, int target, const at::Tensor& x, const at::Tensor& b,
                                bool dropout) const {
  at::Tensor y = linear(x, l.*kLoraWeights[target], b);
  return l.lora_a[target].defined() ? y + lora_term(l, target, x, dropout) : y;
}

}  // namespace rlt
