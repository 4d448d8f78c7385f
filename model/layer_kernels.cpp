// LayerKernels' implementations: the ATen forms (the reference, after transformers' modeling_llama and
// modeling_gemma2), the fused CUDA kernels of the cache forwards, and the training forms (those kernels
// as autograd nodes), each overriding the forms it replaces.
#include "model/layer_kernels.h"

#include <cmath>
#include <limits>

#ifdef RLT_HAVE_CUDA
#include <torch/csrc/autograd/custom_function.h>

#include "model/cuda/decode_kernels.h"
#include "model/cuda/train_kernels.h"
#endif

namespace rlt {

namespace {

// RMSNorm over the last dim in fp32 (HF): llama-style w * x_hat cast back; gemma-style x_hat * (1 + w).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool gemma) {
  at::Tensor xf = x.to(at::kFloat);
  xf = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  if (gemma) return (xf * (1.0 + w.to(at::kFloat))).to(x.scalar_type());
  return w * xf.to(x.scalar_type());
}

// [x1, x2] -> [-x2, x1] on the last dim (RoPE's rotate_half).
at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t h = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
}

class AtenKernels : public LayerKernels {
 public:
  at::Tensor norm(const at::Tensor& x, const at::Tensor& w, double eps, bool gemma) const override {
    return rms_norm(x, w, eps, gemma);
  }
  std::pair<at::Tensor, at::Tensor> add_norm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& w, double eps,
                                             bool gemma) const override {
    const at::Tensor h = b.defined() ? a + b : a;
    return {h, rms_norm(h, w, eps, gemma)};
  }
  at::Tensor add_residual(const at::Tensor& h, const at::Tensor& m, at::Tensor& pending) const override {
    return h + m;
  }
  std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_and_cache(int64_t layer, at::Tensor q, at::Tensor k, at::Tensor v,
                                                                const at::Tensor& cos, const at::Tensor& sin,
                                                                KvCache* cache) const override {
    q = q.transpose(1, 2);  // (B, H, L, hd)
    k = k.transpose(1, 2);  // (B, Hkv, L, hd)
    v = v.transpose(1, 2);  // (B, Hkv, L, hd)
    q = q * cos + rotate_half(q) * sin;
    k = k * cos + rotate_half(k) * sin;
    if (cache) std::tie(k, v) = cache->update(layer, k, v);  // (B, Hkv, C, hd)
    return {q, k, v};
  }
  at::Tensor act_mul(const at::Tensor& g, const at::Tensor& u, bool gelu_tanh) const override {
    return (gelu_tanh ? at::gelu(g, "tanh") : at::silu(g)) * u;
  }
  at::Tensor sdpa_mask(const at::Tensor& mask, at::ScalarType dtype) const override { return mask; }
  bool attends_in_place(at::ScalarType dtype, int64_t head_dim) const override { return false; }
  at::Tensor attend_in_place(int64_t layer, at::Tensor q, at::Tensor k, const at::Tensor& v, const at::Tensor& cos,
                             const at::Tensor& sin, KvCache& cache, const at::Tensor& rows, const at::Tensor& keep,
                             const at::Tensor& slots, double scale) const override {
    TORCH_CHECK(false, "attend_in_place: needs the fused CUDA kernels");
  }
};

#ifdef RLT_HAVE_CUDA
// Each override launches the kernel of model/cuda/decode_kernels.h that stands in for the ATen chain,
// value for value.
class FusedKernels final : public AtenKernels {
 public:
  at::Tensor norm(const at::Tensor& x, const at::Tensor& w, double eps, bool gemma) const override {
    return cuda::rms_norm(x, w, eps, gemma);
  }
  std::pair<at::Tensor, at::Tensor> add_norm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& w, double eps,
                                             bool gemma) const override {
    if (!b.defined()) return {a, cuda::rms_norm(a, w, eps, gemma)};
    return cuda::add_rms_norm(a, b, w, eps, gemma);
  }
  at::Tensor add_residual(const at::Tensor& h, const at::Tensor& m, at::Tensor& pending) const override {
    pending = m;
    return h;
  }
  std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_and_cache(int64_t layer, at::Tensor q, at::Tensor k, at::Tensor v,
                                                                const at::Tensor& cos, const at::Tensor& sin,
                                                                KvCache* cache) const override {
    if (cache && cache->step_slot.defined() && !cache->step_rows.defined()) {
      // A decode step at the cache's step slot (the graphed step): RoPE writes k and v to the cache.
      cuda::rope_write_cache(q, k, v, cos, sin, cache->k[layer], cache->v[layer], cache->step_slot);
      const int64_t span = cache->step_span();
      return {q.transpose(1, 2), cache->k[layer].narrow(2, 0, span), cache->v[layer].narrow(2, 0, span)};
    }
    cuda::rope_(q, k, cos, sin);                             // in place, on the (B, L, heads, hd) layout
    q = q.transpose(1, 2);                                   // (B, H, L, hd)
    k = k.transpose(1, 2);                                   // (B, Hkv, L, hd)
    v = v.transpose(1, 2);                                   // (B, Hkv, L, hd)
    if (cache) std::tie(k, v) = cache->update(layer, k, v);  // (B, Hkv, C, hd)
    return {q, k, v};
  }
  at::Tensor act_mul(const at::Tensor& g, const at::Tensor& u, bool gelu_tanh) const override {
    return gelu_tanh ? AtenKernels::act_mul(g, u, gelu_tanh) : cuda::silu_mul(g, u);
  }
  at::Tensor sdpa_mask(const at::Tensor& mask, at::ScalarType dtype) const override {
    if (!mask.defined()) return mask;
    return at::zeros(mask.sizes(), mask.options().dtype(dtype))
        .masked_fill_(mask.logical_not(), -std::numeric_limits<double>::infinity());
  }
  bool attends_in_place(at::ScalarType dtype, int64_t head_dim) const override {
    return cuda::cache_attention_supports(dtype, head_dim);
  }
  at::Tensor attend_in_place(int64_t layer, at::Tensor q, at::Tensor k, const at::Tensor& v, const at::Tensor& cos,
                             const at::Tensor& sin, KvCache& cache, const at::Tensor& rows, const at::Tensor& keep,
                             const at::Tensor& slots, double scale) const override {
    return cuda::rope_cache_attention(q, k, v, cos, sin, cache.k[layer], cache.v[layer], rows, keep, slots,
                                      keep.size(1), scale);
  }
};

// The training forms: each chain one autograd node whose forward is the fused kernel above and whose
// backward is model/cuda/train_kernels.h's (RoPE's: the inverse rotation).
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The gradient of norm(h) given gy (undefined: none) and h's own gradient gh (undefined: none), as both
// norm autograd nodes take it: {grad_h, grad_w}.
std::pair<at::Tensor, at::Tensor> norm_backward(AutogradContext* ctx, const at::Tensor& gy, const at::Tensor& gh,
                                                int64_t w_input) {
  const auto saved = ctx->get_saved_variables();
  const at::Tensor& h = saved[0];
  return cuda::rms_norm_backward(gy.defined() ? gy.contiguous() : at::zeros_like(h), h, saved[1],
                                 ctx->saved_data["eps"].toDouble(), ctx->saved_data["gemma"].toBool(),
                                 gh.defined() ? gh.contiguous() : at::Tensor(), ctx->needs_input_grad(w_input));
}

void save_norm(AutogradContext* ctx, const at::Tensor& h, const at::Tensor& w, double eps, bool gemma) {
  ctx->save_for_backward({h, w});
  ctx->saved_data["eps"] = eps;
  ctx->saved_data["gemma"] = gemma;
}

// norm(x). Saves the input and the weight; mean(x^2) is recomputed in the backward.
class NormFn : public torch::autograd::Function<NormFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, double eps, bool gemma) {
    const at::Tensor xc = x.contiguous();
    save_norm(ctx, xc, w, eps, gemma);
    return cuda::rms_norm(xc, w, eps, gemma);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto [gx, gw] = norm_backward(ctx, grads[0], at::Tensor(), 1);
    return {gx, gw, at::Tensor(), at::Tensor()};
  }
};

// {h, norm(h)} of h = a + b: h's gradient and the norm's reach a and b alike, in one kernel.
class AddNormFn : public torch::autograd::Function<AddNormFn> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b, const at::Tensor& w,
                               double eps, bool gemma) {
    auto [h, y] = cuda::add_rms_norm(a.contiguous(), b.contiguous(), w, eps, gemma);
    save_norm(ctx, h, w, eps, gemma);
    return {h, y};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto [gx, gw] = norm_backward(ctx, grads[1], grads[0], 2);
    return {gx, gx, gw, at::Tensor(), at::Tensor()};
  }
};

class RopeFn : public torch::autograd::Function<RopeFn> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                               const at::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["q_sizes"] = q.sizes().vec();
    ctx->saved_data["k_sizes"] = k.sizes().vec();
    auto [qr, kr] = cuda::rope(q, k, cos, sin);
    return {qr, kr};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::TensorOptions o = (grads[0].defined() ? grads[0] : grads[1]).options();
    auto dense = [&](const at::Tensor& g, const char* sizes) {
      return g.defined() ? g.contiguous() : at::zeros(ctx->saved_data[sizes].toIntVector(), o);
    };
    const at::Tensor gq = dense(grads[0], "q_sizes"), gk = dense(grads[1], "k_sizes");
    auto [dq, dk] = cuda::rope(gq, gk, saved[0], saved[1], /*inverse=*/true);
    return {dq, dk, at::Tensor(), at::Tensor()};
  }
};

class SiluMulFn : public torch::autograd::Function<SiluMulFn> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& g, const at::Tensor& u) {
    const at::Tensor gc = g.contiguous(), uc = u.contiguous();
    ctx->save_for_backward({gc, uc});
    return cuda::silu_mul(gc, uc);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto [dg, du] = cuda::silu_mul_backward(grads[0].contiguous(), saved[0], saved[1]);
    return {dg, du};
  }
};

// Training and scoring forwards without a cache on CUDA: every forward of the update and of the
// old-policy and reference scoring takes these, so their log-probs stay bit-identical to each other.
// The residual add is deferred into the next norm's kernel, as in the fused decode forms. Shapes the
// kernels do not take (a norm wider than 8,192, weights in another dtype than the activations, the GELU
// gate, float64, a cache) keep the ATen forms.
class TrainKernels final : public AtenKernels {
 public:
  at::Tensor norm(const at::Tensor& x, const at::Tensor& w, double eps, bool gemma) const override {
    if (!takes(x, w)) return AtenKernels::norm(x, w, eps, gemma);
    return NormFn::apply(x, w, eps, gemma);
  }
  std::pair<at::Tensor, at::Tensor> add_norm(const at::Tensor& a, const at::Tensor& b, const at::Tensor& w, double eps,
                                             bool gemma) const override {
    if (!takes(a, w) || (b.defined() && (b.sizes() != a.sizes() || b.scalar_type() != a.scalar_type()))) {
      return AtenKernels::add_norm(a, b, w, eps, gemma);
    }
    if (!b.defined()) return {a, NormFn::apply(a, w, eps, gemma)};
    const variable_list hy = AddNormFn::apply(a, b, w, eps, gemma);
    return {hy[0], hy[1]};
  }
  at::Tensor add_residual(const at::Tensor& h, const at::Tensor& m, at::Tensor& pending) const override {
    if (!takes(m, at::Tensor())) return AtenKernels::add_residual(h, m, pending);
    pending = m;
    return h;
  }
  std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_and_cache(int64_t layer, at::Tensor q, at::Tensor k, at::Tensor v,
                                                                const at::Tensor& cos, const at::Tensor& sin,
                                                                KvCache* cache) const override {
    if (cache || !takes(q, at::Tensor()) || cos.scalar_type() != q.scalar_type() || !cos.is_contiguous() ||
        !sin.is_contiguous()) {
      return AtenKernels::rope_and_cache(layer, q, k, v, cos, sin, cache);
    }
    const variable_list qk = RopeFn::apply(q.contiguous(), k.contiguous(), cos, sin);
    return {qk[0].transpose(1, 2), qk[1].transpose(1, 2), v.transpose(1, 2)};
  }
  at::Tensor act_mul(const at::Tensor& g, const at::Tensor& u, bool gelu_tanh) const override {
    if (gelu_tanh || !takes(g, at::Tensor())) return AtenKernels::act_mul(g, u, gelu_tanh);
    return SiluMulFn::apply(g, u);
  }

 private:
  // x in a dtype the kernels take, on CUDA, with a norm's weight (if any) in its dtype and of a width
  // the backward takes.
  static bool takes(const at::Tensor& x, const at::Tensor& w) {
    const at::ScalarType dt = x.scalar_type();
    if (!x.is_cuda() || (dt != at::kFloat && dt != at::kBFloat16 && dt != at::kHalf)) return false;
    return !w.defined() || (w.scalar_type() == dt && cuda::rms_norm_backward_supports(x.size(-1)));
  }
};
#endif

}  // namespace

const LayerKernels& aten_layer_kernels() {
  static const AtenKernels kernels{};
  return kernels;
}

const LayerKernels* fused_layer_kernels() {
#ifdef RLT_HAVE_CUDA
  static const FusedKernels kernels{};
  return &kernels;
#else
  return nullptr;
#endif
}

const LayerKernels* training_layer_kernels() {
#ifdef RLT_HAVE_CUDA
  static const TrainKernels kernels{};
  return &kernels;
#else
  return nullptr;
#endif
}

// Inverse frequencies (hd / 2) in fp32, as transformers computes them (default and llama3 rope types).
at::Tensor rope_inv_frequencies(const ModelConfig& c, const at::Device& dev) {
  auto f32 = at::TensorOptions().dtype(at::kFloat).device(dev);
  at::Tensor exponent = at::arange(0, c.head_dim, 2, f32.dtype(at::kLong)).to(at::kFloat) / double(c.head_dim);
  at::Tensor inv = 1.0 / at::pow(at::scalar_tensor(c.rope_theta, f32), exponent);
  if (c.rope_type == "llama3") {
    const double old_ctx = double(c.rope_original_max_positions);
    const double low_wavelen = old_ctx / c.rope_low_freq_factor, high_wavelen = old_ctx / c.rope_high_freq_factor;
    at::Tensor wavelen = 2 * M_PI / inv;
    at::Tensor scaled = at::where(wavelen > low_wavelen, inv / c.rope_factor, inv);
    at::Tensor smooth =
        (old_ctx / wavelen - c.rope_low_freq_factor) / (c.rope_high_freq_factor - c.rope_low_freq_factor);
    at::Tensor smoothed = (1 - smooth) * scaled / c.rope_factor + smooth * scaled;
    at::Tensor medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen);
    inv = at::where(medium, smoothed, scaled);
  }
  return inv;
}

at::Tensor kept_slots(const at::Tensor& mask, const at::Device& dev) {
  at::Tensor keep = mask.to(dev, at::kBool);
  return keep.stride(1) == 1 ? keep : keep.contiguous();
}

FusedForwardCounts& fused_forward_counts() {
  static FusedForwardCounts counts;
  return counts;
}

}  // namespace rlt
