// The backward kernels of training forwards (model/cuda/train_kernels.h, and decode_kernels.h's rope with
// `inverse`) against ATen's autograd through the forms the model writes, and against float64 autograd
// of the same formulas. RoPE's gradient rounds as ATen's autograd does, so it must match bit for bit; the
// RMSNorm and SiLU-gate gradients compute in float32 and round once, so in float32 they must match ATen
// to a few roundings, and in 16 bits they must be as accurate against float64 as ATen's gradients are.
// Each check is paired with a wrong variant it must reject: the norm's scale treated as a constant, a
// dropped row of the weight's gradient, the other norm form, the residual's gradient left out, the
// forward rotation as its own gradient, and SiLU's derivative taken as the sigmoid alone.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <iostream>
#include <vector>

#ifdef RLT_HAVE_CUDA
#include "model/cuda/decode_kernels.h"
#include "model/cuda/train_kernels.h"
#endif
#include "tests/model/kernel_types.h"

namespace rlt {
namespace {

#ifdef RLT_HAVE_CUDA
at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t h = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
}

// Gradients of sum(f(inputs) * g) with respect to inputs, by ATen's autograd in the inputs' dtype.
std::vector<at::Tensor> grads_of(const std::function<at::Tensor(const std::vector<at::Tensor>&)>& f,
                                 std::vector<at::Tensor> inputs, const at::Tensor& g) {
  for (auto& t : inputs) t = t.detach().clone().requires_grad_(true);
  const at::Tensor y = f(inputs);
  return torch::autograd::grad({y}, inputs, {g.to(y.scalar_type())});
}

// Largest |a - b| over the largest |b|: a normwise relative error, in float64.
double rel(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor bd = b.to(at::kDouble);
  return (a.to(at::kDouble) - bd).abs().max().item<double>() / bd.abs().max().item<double>();
}

double unit(at::ScalarType dt) {
  return dt == at::kFloat ? std::ldexp(1.0, -24) : dt == at::kHalf ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
}

using testing::kinds;
using testing::kTypes;
#endif

TEST(TrainKernelsCuda, RmsNormBackwardMatchesAutogradAndFloat64) {
#ifndef RLT_HAVE_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(3);
  for (auto dt : kTypes) {
    auto o = at::TensorOptions().device(at::kCUDA).dtype(dt);
    // Widths of every launch shape (64 threads x 4 to 256 x 32, the last ones partly filled); rows of
    // small values, where epsilon matters; more rows than the grid's blocks, so blocks walk several.
    std::vector<at::Tensor> xs = {at::cat({at::randn({37, 29}, o) * 1e-4, at::randn({40, 29}, o)}),
                                  at::randn({3000, 128}, o)};
    for (int64_t D : {896, 1900, 3584, 5120}) xs.push_back(at::randn({2, 5, D}, o));
    for (bool gemma : {false, true}) {
      for (const at::Tensor& x : xs) {
        const int64_t D = x.size(-1);
        SCOPED_TRACE(::testing::Message() << dt << " gemma " << gemma << " D " << D);
        // A gradient that correlates with x w, so that the scale's own gradient (mean(gy x_hat)) is large.
        const at::Tensor w = at::randn({D}, o), extra = at::randn_like(x);
        const at::Tensor xf = x.to(at::kFloat);
        const at::Tensor g = (at::randn_like(xf) + xf / xf.pow(2).mean(-1, true).sqrt() * w.to(at::kFloat)).to(dt);
        auto form = [&](at::ScalarType t, bool detach_scale) {
          return [=](const std::vector<at::Tensor>& in) {
            at::Tensor xf = in[0].to(t == at::kDouble ? at::kDouble : at::kFloat);
            at::Tensor r = at::rsqrt(xf.pow(2).mean(-1, true) + 1e-6);
            if (detach_scale) r = r.detach();
            xf = xf * r;
            if (gemma) return (xf * (1.0 + in[1].to(xf.scalar_type()))).to(t);
            return in[1] * xf.to(t);
          };
        };
        const auto exact = grads_of(form(at::kDouble, false), {x.to(at::kDouble), w.to(at::kDouble)}, g);
        const auto aten = grads_of(form(dt, false), {x, w}, g);
        const auto [gx, gw] = cuda::rms_norm_backward(g, x, w, 1e-6, gemma, at::Tensor(), true);
        ASSERT_EQ(gx.scalar_type(), dt);
        ASSERT_EQ(gw.scalar_type(), dt);
        // Against float64: as accurate as ATen's gradients, within 25% plus two roundings of the dtype.
        const double bx = 1.25 * rel(aten[0], exact[0]) + 2 * unit(dt);
        const double bw = 1.25 * rel(aten[1], exact[1]) + 2 * unit(dt);
        EXPECT_LE(rel(gx, exact[0]), bx) << "grad_x; ATen's " << rel(aten[0], exact[0]);
        EXPECT_LE(rel(gw, exact[1]), bw) << "grad_w; ATen's " << rel(aten[1], exact[1]);
        if (dt == at::kFloat) {  // against ATen in float32: a few roundings
          EXPECT_LE(rel(gx, aten[0]), 1e-5);
          EXPECT_LE(rel(gw, aten[1]), 1e-5);
        }
        // Wrong variants: the scale's own gradient dropped; rows left out of grad_w (the last one, against
        // float32's bound; half of them, as a grid too small would, against every dtype's); the other form.
        // (The scale's gradient and the residual's are checked on rows of ordinary values: on the rows of
        // small ones the scale is about 1 / sqrt(eps), and grad_x dwarfs both.)
        const bool small_rows = D == 29;
        const auto frozen = grads_of(form(at::kDouble, true), {x.to(at::kDouble), w.to(at::kDouble)}, g);
        if (!small_rows) {
          EXPECT_GT(rel(frozen[0], exact[0]), 2 * bx) << "a constant scale must be rejected";
        }
        const int64_t rows = x.numel() / D;
        auto grad_w_over = [&](int64_t n) {
          return grads_of(form(at::kDouble, false),
                          {x.reshape({-1, D}).narrow(0, 0, n).to(at::kDouble), w.to(at::kDouble)},
                          g.reshape({-1, D}).narrow(0, 0, n))[1];
        };
        if (dt == at::kFloat) {
          EXPECT_GT(rel(grad_w_over(rows - 1), aten[1]), 1e-5) << "a dropped row must be rejected";
        }
        EXPECT_GT(rel(grad_w_over(rows / 2), exact[1]), 2 * bw) << "half the rows must be rejected";
        const auto [ox, ow] = cuda::rms_norm_backward(g, x, w, 1e-6, !gemma, at::Tensor(), true);
        EXPECT_GT(rel(ox, exact[0]), 2 * bx) << "the other form must be rejected";
        // The residual's gradient added; a frozen weight gets none.
        const auto [ex, ew] = cuda::rms_norm_backward(g, x, w, 1e-6, gemma, extra, false);
        EXPECT_FALSE(ew.defined());
        const at::Tensor exact_e = exact[0] + extra.to(at::kDouble);
        EXPECT_LE(rel(ex, exact_e), 1.25 * rel(aten[0] + extra, exact_e) + 2 * unit(dt));
        if (!small_rows) {
          EXPECT_GT(rel(gx, exact_e), 2 * bx) << "the residual's gradient left out must be rejected";
        }
      }
    }
  }
#endif
}

TEST(TrainKernelsCuda, RopeGradientIsAutogradsBitForBit) {
#ifndef RLT_HAVE_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(4);
  // Head dims 10: one pair a thread; 16: 16-byte loads of each half.
  for (const auto& [dt, hd] : kinds({10, 16})) {
    SCOPED_TRACE(::testing::Message() << dt << ", head dim " << hd);
    auto o = at::TensorOptions().device(at::kCUDA).dtype(dt);
    const int64_t B = 3, L = 7, H = 6, Hkv = 2;
    const at::Tensor q = at::randn({B, L, H, hd}, o), k = at::randn({B, L, Hkv, hd}, o);
    at::Tensor pos = at::randint(0, 4000, {B, L}, o.dtype(at::kFloat)).unsqueeze(-1);
    at::Tensor inv = at::pow(10000.0, -at::arange(0, hd, 2, o.dtype(at::kFloat)) / double(hd));
    at::Tensor emb = at::cat({pos * inv, pos * inv}, -1).unsqueeze(1);  // (B, 1, L, hd)
    const at::Tensor cos = emb.cos().to(dt), sin = emb.sin().to(dt);
    // The model's form on (B, H, L, hd) views; the gradients arrive in that layout.
    const at::Tensor gq = at::randn({B, H, L, hd}, o), gk = at::randn({B, Hkv, L, hd}, o);
    auto form = [&](const std::vector<at::Tensor>& in) {
      const at::Tensor qt = in[0].transpose(1, 2), kt = in[1].transpose(1, 2);
      return at::cat({(qt * cos + rotate_half(qt) * sin).flatten(), (kt * cos + rotate_half(kt) * sin).flatten()});
    };
    const auto aten = grads_of(form, {q, k}, at::cat({gq.flatten(), gk.flatten()}));
    // The forward out of place: the ATen form bit for bit, q and k unchanged.
    const at::Tensor q0 = q.clone();
    auto [qr, kr] = cuda::rope(q, k, cos, sin);
    EXPECT_TRUE(at::equal(q, q0));
    EXPECT_TRUE(at::equal(qr.transpose(1, 2), q.transpose(1, 2) * cos + rotate_half(q.transpose(1, 2)) * sin));
    // The gradient: the inverse rotation of the gradients, brought to (B, L, heads, hd).
    auto [dq, dk] = cuda::rope(gq.transpose(1, 2).contiguous(), gk.transpose(1, 2).contiguous(), cos, sin, true);
    EXPECT_TRUE(at::equal(dq, aten[0])) << rel(dq, aten[0]);
    EXPECT_TRUE(at::equal(dk, aten[1])) << rel(dk, aten[1]);
    auto [wq, wk] = cuda::rope(gq.transpose(1, 2).contiguous(), gk.transpose(1, 2).contiguous(), cos, sin, false);
    EXPECT_GT(rel(wq, aten[0]), 0.1) << "the forward rotation as its own gradient must be rejected";
  }
#endif
}

TEST(TrainKernelsCuda, SiluGateBackwardMatchesAutogradAndFloat64) {
#ifndef RLT_HAVE_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(5);
  // 301 columns: one element a thread; 304: 16-byte loads (the element count a multiple of 8).
  for (const auto& [dt, F] : kinds({301, 304})) {
    SCOPED_TRACE(::testing::Message() << dt << ", " << F << " columns");
    auto o = at::TensorOptions().device(at::kCUDA).dtype(dt);
    const at::Tensor g = at::randn({5, 37, F}, o) * 3, u = at::randn_like(g), dy = at::randn_like(g);
    auto form = [](const std::vector<at::Tensor>& in) { return at::silu(in[0]) * in[1]; };
    const auto exact = grads_of(form, {g.to(at::kDouble), u.to(at::kDouble)}, dy);
    const auto aten = grads_of(form, {g, u}, dy);
    const auto [dg, du] = cuda::silu_mul_backward(dy, g, u);
    EXPECT_TRUE(at::equal(du, aten[1])) << "grad_u: " << rel(du, aten[1]);
    const double bound = 1.25 * rel(aten[0], exact[0]) + 2 * unit(dt);
    EXPECT_LE(rel(dg, exact[0]), bound) << "ATen's " << rel(aten[0], exact[0]);
    if (dt == at::kFloat) {
      EXPECT_LE(rel(dg, aten[0]), 1e-6);
    }
    // SiLU's derivative taken as the sigmoid alone must be rejected.
    const at::Tensor gd = g.to(at::kDouble);
    const at::Tensor wrong = dy.to(at::kDouble) * u.to(at::kDouble) * at::sigmoid(gd);
    EXPECT_GT(rel(wrong, exact[0]), 2 * bound);
  }
#endif
}

}  // namespace
}  // namespace rlt
