// The fused decode kernels (model/cuda/decode_kernels.h) against the ATen chains they replace, written
// out here as the model writes them, in float32, bfloat16 and float16 on odd shapes. RoPE, the SiLU gate
// and the residual add round each operation as ATen does, so they must match bit for bit; RMSNorm sums
// its squares in another order, so it must match to one rounding of the dtype and float64 to the
// dtype's precision. Each check is paired with a wrong variant (no epsilon, the other norm form, the
// rotation's sign, GELU for SiLU) that it must reject.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <functional>
#include <iostream>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#ifdef RLT_HAVE_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "common/cuda/launch.h"
#include "model/cuda/decode_kernels.h"
#include "model/tuned_gemm.h"
#include "tests/common/slow_producer.h"
#endif
#include "model/transformer.h"
#include "tests/model/kernel_types.h"

namespace rlt {
namespace {

#ifdef RLT_HAVE_CUDA
// The model's ATen forms (model/transformer.cpp).
at::Tensor aten_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool gemma) {
  at::Tensor xf = x.to(at::kFloat);
  xf = xf * at::rsqrt(xf.pow(2).mean(-1, true) + eps);
  if (gemma) return (xf * (1.0 + w.to(at::kFloat))).to(x.scalar_type());
  return w * xf.to(x.scalar_type());
}
at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t h = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
}

// RoPE's cos and sin tables (B, 1, L, hd) in `dtype`, base 10000, for positions `pos` (B, L, 1) float32.
std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& pos, int64_t hd, at::ScalarType dtype) {
  const at::Tensor inv = at::pow(10000.0, -at::arange(0, hd, 2, pos.options()) / double(hd));
  const at::Tensor emb = at::cat({pos * inv, pos * inv}, -1).unsqueeze(1);
  return {emb.cos().to(dtype), emb.sin().to(dtype)};
}

// Largest |a - b| in units of the dtype's rounding step at |b| (1 = one rounding apart). Below the
// dtype's smallest normal number the step stops shrinking (float16's subnormals start at 2^-14).
double ulps(const at::Tensor& a, const at::Tensor& b) {
  const bool half = a.scalar_type() == at::kHalf;
  const double eps = a.scalar_type() == at::kFloat ? std::ldexp(1.0, -23)
                     : half                        ? std::ldexp(1.0, -10)
                                                   : std::ldexp(1.0, -7);
  const double tiny = half ? std::ldexp(1.0, -14) : std::ldexp(1.0, -126);
  at::Tensor ad = a.to(at::kDouble), bd = b.to(at::kDouble);
  return ((ad - bd).abs() / (bd.abs().clamp_min(tiny) * eps)).max().item<double>();
}

using testing::kinds;
using testing::kTypes;

// A graph's edges with their types: cudaGraphGetEdges from CUDA 13, its _v2 form before.
cudaError_t graph_edges(cudaGraph_t g, cudaGraphNode_t* from, cudaGraphNode_t* to, cudaGraphEdgeData* data, size_t* n) {
#if CUDART_VERSION >= 13000
  return cudaGraphGetEdges(g, from, to, data, n);
#else
  return cudaGraphGetEdges_v2(g, from, to, data, n);
#endif
}
#endif

TEST(DecodeKernelsCuda, RmsNormMatchesTheAtenFormAndFloat64) {
#ifndef RLT_HAVE_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(1);
  for (auto dt : kTypes) {
    auto o = at::TensorOptions().device(at::kCUDA).dtype(dt);
    // Rows of small values, where epsilon matters (mean square ~1e-8 against eps 1e-6), and of ordinary ones.
    at::Tensor x = at::cat({at::randn({37, 29}, o) * 1e-4, at::randn({40, 29}, o)}), w = at::randn({29}, o);
    at::Tensor x896 = at::randn({5, 3, 896}, o), w896 = at::randn({896}, o);
    // Rows held in registers, 8 and 16 elements a thread (the last partly filled), and wider rows through
    // the loop: every element is compared, so a thread that skips its last elements fails.
    std::vector<std::pair<at::Tensor, at::Tensor> > cases = {{x, w}, {x896, w896}};
    for (int64_t D : {1900, 3584, 5120, 9000}) cases.emplace_back(at::randn({7, D}, o), at::randn({D}, o));
    for (bool gemma : {false, true}) {
      for (const auto& [xi, wi] : cases) {
        at::Tensor got = cuda::rms_norm(xi, wi, 1e-6, gemma), ref = aten_rms_norm(xi, wi, 1e-6, gemma);
        // float32: a few ulps (the sum's order); 16-bit: at most one rounding of the output apart.
        // (Two roundings, of x_hat and of the product, so two steps at most.)
        const double tol = dt == at::kFloat ? 64 : 2.01;
        EXPECT_LE(ulps(got, ref), tol) << dt << " gemma " << gemma << " D " << xi.size(-1);
        // float64 reference from the same inputs: within the dtype's precision.
        at::Tensor xd = xi.to(at::kDouble), wd = wi.to(at::kDouble);
        at::Tensor hat = xd * at::rsqrt(xd.pow(2).mean(-1, true) + 1e-6);
        at::Tensor exact = gemma ? hat * (1 + wd) : hat * wd;
        EXPECT_LE(ulps(got, exact), dt == at::kFloat ? 64 : 2.01) << dt << " against float64";
        // Wrong variants: no epsilon (on the small rows, where it matters), the other form.
        if (xi.size(-1) == 29) {
          EXPECT_GT(ulps(aten_rms_norm(xi, wi, 0.0, gemma), got), 100 * tol) << "epsilon dropped must be rejected";
        }
        EXPECT_GT(ulps(aten_rms_norm(xi, wi, 1e-6, !gemma), got), 100 * tol) << "the other form must be rejected";
      }
      // The residual add: h bit for bit, the norm as above.
      for (const auto& [xi, wi] : cases) {
        if (xi.size(-1) == 29) continue;
        at::Tensor b = at::randn_like(xi);
        auto [h, y] = cuda::add_rms_norm(xi, b, wi, 1e-5, gemma);
        EXPECT_TRUE(at::equal(h, xi + b)) << dt << " D " << xi.size(-1);
        EXPECT_LE(ulps(y, aten_rms_norm(xi + b, wi, 1e-5, gemma)), dt == at::kFloat ? 64 : 2.01) << dt;
        EXPECT_GT(ulps(y, aten_rms_norm(xi, wi, 1e-5, gemma)), 1000) << "a norm of a alone must be rejected";
      }
    }
  }
#endif
}

TEST(DecodeKernelsCuda, RopeAndSiluGateAreTheAtenFormsBitForBit) {
#ifndef RLT_HAVE_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(2);
  // Head dims 10: one pair a thread; 16: 16-byte loads of each half (the packed views' heads start at
  // multiples of 16 elements too).
  for (const auto& [dt, hd] : kinds({10, 16})) {
    SCOPED_TRACE(::testing::Message() << dt << ", head dim " << hd);
    auto o = at::TensorOptions().device(at::kCUDA).dtype(dt);
    const int64_t B = 3, L = 5, H = 6, Hkv = 2;
    at::Tensor q = at::randn({B, L, H, hd}, o), k = at::randn({B, L, Hkv, hd}, o);
    at::Tensor pos = at::randint(0, 4000, {B, L}, o.dtype(at::kFloat)).unsqueeze(-1);
    at::Tensor cos, sin;  // (B, 1, L, hd)
    std::tie(cos, sin) = rope_tables(pos, hd, dt);
    at::Tensor qt = q.transpose(1, 2), kt = k.transpose(1, 2);
    at::Tensor q_ref = qt * cos + rotate_half(qt) * sin, k_ref = kt * cos + rotate_half(kt) * sin;
    at::Tensor q_wrong = qt * cos - rotate_half(qt) * sin;  // the rotation's sign flipped
    at::Tensor q2 = q.clone(), k2 = k.clone();
    cuda::rope_(q2, k2, cos, sin);
    EXPECT_TRUE(at::equal(q2.transpose(1, 2), q_ref)) << dt << " q: " << ulps(q2.transpose(1, 2), q_ref) << " ulps";
    EXPECT_TRUE(at::equal(k2.transpose(1, 2), k_ref)) << dt << " k";
    EXPECT_FALSE(at::equal(q2.transpose(1, 2), q_wrong)) << "a flipped rotation must be rejected";
    // The decode step's form: k rotated and v written to the cache at the step's slots (here L = 5 slots
    // of 9), q rotated in place, k left as it was; the ATen form rotates, then index_copy_ into the cache.
    const int64_t S = 9;
    at::Tensor v = at::randn({B, L, Hkv, hd}, o), slots = at::tensor({7, 1, 4, 0, 8}, o.dtype(at::kLong));
    at::Tensor kc = at::randn({B, Hkv, S, hd}, o), vc = at::randn({B, Hkv, S, hd}, o);
    const at::Tensor kc0 = kc.clone();
    at::Tensor kc_ref = kc.clone().index_copy_(2, slots, k_ref),
               vc_ref = vc.clone().index_copy_(2, slots, v.transpose(1, 2));
    at::Tensor q3 = q.clone(), k3 = k.clone();
    cuda::rope_write_cache(q3, k3, v, cos, sin, kc, vc, slots);
    EXPECT_TRUE(at::equal(q3.transpose(1, 2), q_ref)) << dt << " q (cache form)";
    EXPECT_TRUE(at::equal(k3, k)) << dt << " k must be left as it was";
    EXPECT_TRUE(at::equal(kc, kc_ref)) << dt << " k cache";
    EXPECT_TRUE(at::equal(vc, vc_ref)) << dt << " v cache";
    at::Tensor kc_off = kc0.clone().index_copy_(2, (slots + 1) % S, k_ref);  // every write one slot later
    EXPECT_FALSE(at::equal(kc, kc_off)) << "a write one slot off must be rejected";
    // Views of one packed projection's output (PackedWeights: [q | k | v] per row): the same results.
    at::Tensor qkv = at::randn({B, L, (H + 2 * Hkv) * hd}, o);
    at::Tensor qv = qkv.narrow(-1, 0, H * hd).view({B, L, H, hd}),
               kv = qkv.narrow(-1, H * hd, Hkv * hd).view({B, L, Hkv, hd});
    at::Tensor vv = qkv.narrow(-1, (H + Hkv) * hd, Hkv * hd).view({B, L, Hkv, hd});
    at::Tensor qp_ref = qv.transpose(1, 2) * cos + rotate_half(qv.transpose(1, 2)) * sin;
    at::Tensor kp_ref = kv.transpose(1, 2) * cos + rotate_half(kv.transpose(1, 2)) * sin;
    at::Tensor kc2 = kc0.clone(), vc2 = vc.clone();
    at::Tensor vc2_ref = vc.clone().index_copy_(2, slots, vv.transpose(1, 2));
    at::Tensor kc2_ref = kc0.clone().index_copy_(2, slots, kp_ref);
    cuda::rope_write_cache(qv, kv, vv, cos, sin, kc2, vc2, slots);
    EXPECT_TRUE(at::equal(qv.transpose(1, 2), qp_ref)) << dt << " q (packed view)";
    EXPECT_TRUE(at::equal(kc2, kc2_ref)) << dt << " k cache (packed view)";
    EXPECT_TRUE(at::equal(vc2, vc2_ref)) << dt << " v cache (packed view)";
    // k a packed view, v contiguous: each tensor's own row stride.
    at::Tensor kc3 = kc0.clone(), vc3 = vc.clone(), q4 = qkv.narrow(-1, 0, H * hd).view({B, L, H, hd}).clone();
    at::Tensor kv2 = at::randn({B, L, (H + 2 * Hkv) * hd}, o).narrow(-1, H * hd, Hkv * hd).view({B, L, Hkv, hd});
    at::Tensor kp2_ref = kv2.transpose(1, 2) * cos + rotate_half(kv2.transpose(1, 2)) * sin;
    cuda::rope_write_cache(q4, kv2, v, cos, sin, kc3, vc3, slots);
    EXPECT_TRUE(at::equal(kc3, kc0.clone().index_copy_(2, slots, kp2_ref))) << dt << " k cache (mixed strides)";
    EXPECT_TRUE(at::equal(vc3, vc.clone().index_copy_(2, slots, v.transpose(1, 2))))
        << dt << " v cache (mixed strides)";
    // A feed of some cache rows (rows given): input row b goes to cache row rows[b] of a 5-row cache; the
    // ATen form is the feed's index_put_ over rows x heads x slots.
    at::Tensor rows = at::tensor({4, 0, 2}, o.dtype(at::kLong));
    at::Tensor kc5 = at::randn({5, Hkv, S, hd}, o), vc5 = at::randn({5, Hkv, S, hd}, o);
    const at::Tensor kc5_0 = kc5.clone();
    const c10::List<std::optional<at::Tensor> > at_rs{
        rows.view({B, 1, 1}), at::arange(Hkv, rows.options()).view({1, Hkv, 1}), slots.view({1, 1, L})};
    at::Tensor kc5_ref = kc5.clone().index_put_(at_rs, k_ref),
               vc5_ref = vc5.clone().index_put_(at_rs, v.transpose(1, 2));
    at::Tensor q5 = q.clone(), k5 = k.clone();
    cuda::rope_write_cache(q5, k5, v, cos, sin, kc5, vc5, slots, rows);
    EXPECT_TRUE(at::equal(q5.transpose(1, 2), q_ref)) << dt << " q (rows form)";
    EXPECT_TRUE(at::equal(kc5, kc5_ref)) << dt << " k cache (rows form)";
    EXPECT_TRUE(at::equal(vc5, vc5_ref)) << dt << " v cache (rows form)";
    const c10::List<std::optional<at::Tensor> > at_first{at::arange(B, rows.options()).view({B, 1, 1}),
                                                         at::arange(Hkv, rows.options()).view({1, Hkv, 1}),
                                                         slots.view({1, 1, L})};
    EXPECT_FALSE(at::equal(kc5, kc5_0.clone().index_put_(at_first, k_ref)))
        << "writing input row b to cache row b must be rejected";
    at::Tensor g = at::randn({7, 3, 131}, o) * 3, u = at::randn({7, 3, 131}, o);
    at::Tensor got = cuda::silu_mul(g, u);
    EXPECT_TRUE(at::equal(got, at::silu(g) * u)) << dt << ": " << ulps(got, at::silu(g) * u) << " ulps";
    EXPECT_FALSE(at::equal(got, at::gelu(g, "tanh") * u)) << "GELU in place of SiLU must be rejected";
    // The halves of a packed gate/up output.
    at::Tensor gu = at::randn({7, 3, 262}, o) * 3;
    at::Tensor gh = gu.narrow(-1, 0, 131), uh = gu.narrow(-1, 131, 131);
    EXPECT_TRUE(at::equal(cuda::silu_mul(gh, uh), at::silu(gh) * uh)) << dt << " (packed halves)";
    at::Tensor uc = at::randn({7, 3, 131}, o);  // g a packed half, u contiguous
    EXPECT_TRUE(at::equal(cuda::silu_mul(gh, uc), at::silu(gh) * uc)) << dt << " (mixed strides)";
    EXPECT_FALSE(at::equal(cuda::silu_mul(gh, uh), at::silu(uh) * gh)) << "swapped halves must be rejected";
    // Rows of 136 elements, 16-byte aligned: 16-byte loads, contiguous, packed halves and mixed strides; and
    // halves of 132 (in 2-byte types the second starts 8 bytes off 16: one element a thread again).
    for (const int64_t F : {136, 132}) {
      SCOPED_TRACE(::testing::Message() << F << " columns");
      at::Tensor g2 = at::randn({9, 4, F}, o) * 3, u2 = at::randn({9, 4, F}, o);
      EXPECT_TRUE(at::equal(cuda::silu_mul(g2, u2), at::silu(g2) * u2)) << dt;
      at::Tensor gu2 = at::randn({9, 4, 2 * F}, o) * 3;
      at::Tensor gh2 = gu2.narrow(-1, 0, F), uh2 = gu2.narrow(-1, F, F);
      EXPECT_TRUE(at::equal(cuda::silu_mul(gh2, uh2), at::silu(gh2) * uh2)) << dt << " (packed halves)";
      EXPECT_TRUE(at::equal(cuda::silu_mul(gh2, u2), at::silu(gh2) * u2)) << dt << " (mixed strides)";
      EXPECT_FALSE(at::equal(cuda::silu_mul(gh2, uh2), at::silu(gh2) * uh2.roll(1, -1)))
          << "u read one column off must be rejected";
    }
  }
#endif
}

#ifdef RLT_HAVE_CUDA
// cache_attention's definition (decode_kernels.h) in float64 on the CPU, and the wrong variants it must be
// told apart from: query l of input row e, head h, sees slot j < span of cache row rows[e], KV head h / G,
// iff j == slots[l] or (j <= slots[l] and keep[e, j]); scores scaled, softmax, values averaged.
// kDropsFirstBlock: the keys of the first block (64 slots at hd 64, 32 at hd 128) unseen but a query's own, as
// a combine that drops the first split's share would leave them.
enum class Variant { kRight, kSeesNextSlot, kInputRowIsCacheRow, kNoScale, kNoKeep, kKvHeadModulo, kDropsFirstBlock };
at::Tensor attention_reference(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& rows,
                               const at::Tensor& keep, const at::Tensor& slots, int64_t span, double scale, Variant w) {
  auto cpu = [](const at::Tensor& t) { return t.to(at::kCPU, at::kDouble); };
  const int64_t E = q.size(0), L = q.size(1), H = q.size(2), Hkv = kc.size(1), G = H / Hkv;
  at::Tensor r = w == Variant::kInputRowIsCacheRow ? at::arange(E, at::kLong) : rows.to(at::kCPU);
  at::Tensor heads =
      w == Variant::kKvHeadModulo ? at::arange(H, at::kLong) % Hkv : at::arange(H, at::kLong).div(G, "floor");
  at::Tensor k = cpu(kc).index_select(0, r).narrow(2, 0, span).index_select(1, heads);  // (E, H, span, hd)
  at::Tensor v = cpu(vc).index_select(0, r).narrow(2, 0, span).index_select(1, heads);
  at::Tensor j = at::arange(span, at::kLong).view({1, 1, 1, span});
  at::Tensor own = slots.to(at::kCPU).view({1, 1, L, 1}) + (w == Variant::kSeesNextSlot ? 1 : 0);
  at::Tensor kept = w == Variant::kNoKeep ? at::ones({E, 1, 1, span}, at::kBool)
                                          : keep.to(at::kCPU).narrow(1, 0, span).view({E, 1, 1, span});
  at::Tensor seen = (j == slots.to(at::kCPU).view({1, 1, L, 1})) | ((j <= own) & kept);  // (E, 1, L, span)
  if (w == Variant::kDropsFirstBlock)
    seen = seen & ((j >= 4096 / kc.size(3)) | (j == slots.to(at::kCPU).view({1, 1, L, 1})));
  at::Tensor scores = at::matmul(cpu(q).transpose(1, 2), k.transpose(2, 3)) * (w == Variant::kNoScale ? 1.0 : scale);
  scores = scores.masked_fill(seen.logical_not(), -std::numeric_limits<double>::infinity());
  return at::matmul(at::softmax(scores, -1), v).transpose(1, 2);  // (E, L, H, hd)
}
#endif

TEST(DecodeKernelsCuda, CacheAttentionMatchesFloat64AndRejectsWrongMasksRowsAndHeads) {
#ifndef RLT_HAVE_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(3);
  struct Case {
    at::ScalarType dt;
    int64_t H, Hkv, hd, L, E;
    bool packed, shuffled;  // q a view of a packed projection; slots out of order (a step's form)
    bool all_rows = false;  // a decode step: one query per cache row, no rows tensor (row e is cache row e)
    int64_t span = 200;     // the slots attended over
  };
  // Qwen2.5-0.5B's heads (14 over 2, hd 64) and Llama-3's shape of group (hd 128); G L of 140 and 84 query
  // rows take several blocks of 64, and a span of 200 several blocks of keys (64 at hd 64, 32 at hd 128).
  // Three rows leave the GPU idle: the kernel splits the keys between blocks and adds their shares; 70 rows
  // fill it, one block per query tile (on an H200's 132 SMs). Decode steps over every cache row, as the
  // rollout's steps run: 47 rows split the keys (94 blocks of one tile), 5 rows at hd 128 more so, 300 rows
  // (600 tiles, two waves already) split them in two at 4 blocks an SM, and over a span of 64 (one key
  // block) take one split, the warps' shares written out directly. Short feeds whose G L query rows fit one
  // warp's 16 (2 x 7, 4 x 4, and 16 positions of one head each), where the warps split each key block
  // between them as a step's do. Over long spans (1,500 slots; the queries at slot 1,470 walk 23 key blocks
  // at hd 64, 46 at hd 128), steps and a feed of 21 positions whose splits each walk several key blocks.
  const Case cases[] = {{at::kBFloat16, 14, 2, 64, 1, 64, false, false, true, 1500},
                        {at::kHalf, 8, 2, 128, 1, 40, true, false, true, 1500},
                        {at::kBFloat16, 8, 2, 128, 21, 30, false, false, false, 1500},
                        {at::kBFloat16, 14, 2, 64, 1, 300, false, false, true, 64},
                        {at::kBFloat16, 14, 2, 64, 20, 3, true, false},
                        {at::kHalf, 14, 2, 64, 20, 3, false, true},
                        {at::kBFloat16, 8, 2, 128, 21, 3, false, false},
                        {at::kHalf, 8, 2, 128, 7, 3, true, true},
                        {at::kBFloat16, 14, 2, 64, 20, 70, false, false},
                        {at::kBFloat16, 14, 2, 64, 1, 47, true, false, true},
                        {at::kHalf, 8, 2, 128, 1, 5, false, false, true},
                        {at::kBFloat16, 14, 2, 64, 2, 3, true, true},
                        {at::kHalf, 8, 2, 128, 4, 3, false, false},
                        {at::kBFloat16, 4, 4, 64, 16, 3, false, true},
                        {at::kBFloat16, 14, 2, 64, 1, 300, false, false, true}};
  for (const Case& cs : cases) {
    auto o = at::TensorOptions().device(at::kCUDA).dtype(cs.dt);
    const int64_t Bc = cs.E + (cs.all_rows ? 0 : 3), span = cs.span, S = span + 24, E = cs.E, L = cs.L, H = cs.H,
                  Hkv = cs.Hkv, hd = cs.hd;
    const double scale = 1.0 / std::sqrt(double(hd));
    at::Tensor rows =
        cs.all_rows ? at::arange(Bc, o.dtype(at::kLong)) : at::randperm(Bc, o.dtype(at::kLong)).narrow(0, 0, E);
    at::Tensor slots = at::arange(span - 30, span - 30 + L, o.dtype(at::kLong));  // a feed's slots, or a step's slot
    if (cs.shuffled) slots = at::randperm(span, o.dtype(at::kLong)).narrow(0, 0, L);
    // Scores of a few units, values in [-1, 1], a tenth of the slots kept: each query sees about 20 keys, so
    // one key more or less moves some outputs well past the tolerance.
    at::Tensor kc = at::randn({Bc, Hkv, S, hd}, o), vc = at::rand({Bc, Hkv, S, hd}, o) * 2 - 1;
    at::Tensor keep = at::rand({E, span + 9}, o.dtype(at::kFloat)) < std::min(0.1, 20.0 / span);
    // Over a long span, about 20 kept as well, and the first key block's first 8 (the dropped-block twin's).
    if (span > 200) keep.narrow(1, 0, 8).fill_(true);
    // Every query's next slot kept, whatever the draw: a kernel letting a query see one slot past its own
    // then reads a key that moves its output (with few queries, a tenth kept might leave none to see).
    keep.index_fill_(1, slots + 1, true);
    at::Tensor q = at::randn({E, L, H, hd}, o);
    if (cs.packed) {
      at::Tensor qkv = at::zeros({E, L, (H + 2 * Hkv) * hd}, o);
      qkv.narrow(-1, 0, H * hd).copy_(q.view({E, L, H * hd}));
      q = qkv.narrow(-1, 0, H * hd).view({E, L, H, hd});
    }
    // Both scratch layouts of the kernel's warps (set_attention_lean_scratch); the wrong variants against the
    // default's.
    cuda::set_attention_lean_scratch(false);
    at::Tensor full = cuda::cache_attention(q, kc, vc, cs.all_rows ? at::Tensor() : rows, keep, slots, span, scale)
                          .to(at::kCPU, at::kDouble);
    cuda::set_attention_lean_scratch(true);
    at::Tensor got = cuda::cache_attention(q, kc, vc, cs.all_rows ? at::Tensor() : rows, keep, slots, span, scale)
                         .to(at::kCPU, at::kDouble);
    ASSERT_EQ(got.sizes(), at::IntArrayRef({E, L, H, hd}));
    // The output's rounding (u |out|) and the probabilities' (u each, times values of at most 1): u the
    // dtype's unit roundoff; twice that bound, against float32 sums' noise.
    const double u = cs.dt == at::kHalf ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
    const at::Tensor ref = attention_reference(q, kc, vc, rows, keep, slots, span, scale, Variant::kRight);
    auto excess = [&](Variant w, const at::Tensor& out) {  // the largest error over its bound (<= 1: within)
      const at::Tensor r =
          w == Variant::kRight ? ref : attention_reference(q, kc, vc, rows, keep, slots, span, scale, w);
      return ((out - r).abs() / (2 * u * (r.abs() + 1))).max().item<double>();
    };
    const double right_full = excess(Variant::kRight, full);
    EXPECT_LE(right_full, 1.0) << cs.dt << " hd " << hd << " E " << E << ": full scratch, error " << right_full;
    const double right = excess(Variant::kRight, got);
    EXPECT_LE(right, 1.0) << cs.dt << " hd " << hd << " E " << E << ": error " << right << " of the bound";
    std::cout << cs.dt << " hd " << hd << " E " << E << ": error " << right << " of the bound; wrong variants";
    for (Variant w : {Variant::kSeesNextSlot, Variant::kInputRowIsCacheRow, Variant::kNoScale, Variant::kNoKeep,
                      Variant::kKvHeadModulo, Variant::kDropsFirstBlock}) {
      if (cs.all_rows && w == Variant::kInputRowIsCacheRow) continue;  // the same thing there
      if (cs.H == cs.Hkv && w == Variant::kKvHeadModulo) continue;     // one query head a KV head: the same
      const double x = excess(w, got);
      std::cout << " " << x;
      EXPECT_GT(x, 3.0) << cs.dt << " hd " << hd << " E " << E << ": wrong variant " << int(w) << " must be rejected";
    }
    std::cout << "\n";
  }
#endif
}

// rope_cache_attention (the rotation and the cache write inside the attention kernel) against the two
// kernels it stands for, rope_write_cache then cache_attention: the output and both caches equal bit for
// bit. Decode steps over every cache row (G 7 at hd 64 and 4 at hd 128, whose queries fit one warp; 28 over
// one KV head, past it), and with a rows tensor; feeds whose G L fills one tile (9 x 7 = 63) or not (10 x 7:
// the two kernels, which rotate q in place), and one whose new slots (511-519) lie in two splits of one key
// block each (3 rows over 9 blocks); spans of one key block and of many split between blocks; q, k
// and v as views of one packed projection. q left unrotated shows which form ran. The comparison rejects
// the queries attended unrotated and the new key written one slot late.
TEST(DecodeKernelsCuda, RopeInsideTheAttentionIsTheTwoKernelsBitForBit) {
#ifndef RLT_HAVE_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(8);
  struct Case {
    at::ScalarType dt;
    int64_t H, Hkv, hd, L, E, span;
    bool all_rows;  // a decode step over every cache row: no rows tensor
  };
  const Case cases[] = {{at::kBFloat16, 14, 2, 64, 1, 16, 600, true},  {at::kHalf, 14, 2, 64, 1, 3, 2000, true},
                        {at::kBFloat16, 8, 2, 128, 1, 5, 40, true},    {at::kBFloat16, 28, 1, 128, 1, 4, 700, true},
                        {at::kHalf, 8, 2, 128, 1, 6, 300, false},      {at::kBFloat16, 14, 2, 64, 9, 3, 500, false},
                        {at::kBFloat16, 14, 2, 64, 10, 3, 500, false}, {at::kHalf, 8, 2, 128, 4, 2, 64, false},
                        {at::kBFloat16, 14, 2, 64, 9, 3, 520, false}};
  for (const Case& cs : cases) {
    SCOPED_TRACE(::testing::Message() << cs.dt << " " << cs.H << " over " << cs.Hkv << " hd " << cs.hd << " L " << cs.L
                                      << " E " << cs.E << " span " << cs.span);
    auto o = at::TensorOptions().device(at::kCUDA).dtype(cs.dt);
    const int64_t E = cs.E, L = cs.L, H = cs.H, Hkv = cs.Hkv, hd = cs.hd, span = cs.span, S = span + 40;
    const int64_t Bc = cs.all_rows ? E : E + 3;
    const at::Tensor rows =
        cs.all_rows ? at::Tensor() : at::randperm(Bc, o.dtype(at::kLong)).narrow(0, 0, E).contiguous();
    // The new positions' slots at the span's end, out of order for a feed.
    const at::Tensor slots = at::randperm(L, o.dtype(at::kLong)) + (span - L);
    at::Tensor cos, sin;
    std::tie(cos, sin) = rope_tables(at::randint(0, 4000, {E, L, 1}, o.dtype(at::kFloat)), hd, cs.dt);
    const at::Tensor qkv = at::randn({E, L, (H + 2 * Hkv) * hd}, o);
    auto part = [&](int64_t at_head, int64_t heads) {
      return qkv.narrow(-1, at_head * hd, heads * hd).view({E, L, heads, hd});
    };
    const at::Tensor v = part(H + Hkv, Hkv);
    const at::Tensor k0 = at::randn({Bc, Hkv, S, hd}, o), v0 = at::randn({Bc, Hkv, S, hd}, o);
    const at::Tensor keep = at::rand({E, span}, o.dtype(at::kFloat)) < 0.5;
    const double scale = 1.0 / std::sqrt(double(hd));
    // The two kernels.
    at::Tensor q1 = part(0, H).clone(), k1 = part(H, Hkv), kc1 = k0.clone(), vc1 = v0.clone();
    cuda::rope_write_cache(q1, k1, v, cos, sin, kc1, vc1, slots, rows);
    const at::Tensor want = cuda::cache_attention(q1, kc1, vc1, rows, keep, slots, span, scale);
    // One kernel, on the packed views.
    at::Tensor q2 = part(0, H), k2 = part(H, Hkv), kc2 = k0.clone(), vc2 = v0.clone();
    const at::Tensor q_before = q2.clone();
    const at::Tensor got = cuda::rope_cache_attention(q2, k2, v, cos, sin, kc2, vc2, rows, keep, slots, span, scale);
    EXPECT_TRUE(at::equal(got, want)) << "attention";
    EXPECT_TRUE(at::equal(kc2, kc1)) << "k cache";
    EXPECT_TRUE(at::equal(vc2, vc1)) << "v cache";
    EXPECT_EQ(at::equal(q2, q_before), H / Hkv * L <= 64) << "one kernel where a row's queries fit one tile";
    // What the comparison rejects.
    EXPECT_FALSE(at::equal(got, cuda::cache_attention(q_before, kc1, vc1, rows, keep, slots, span, scale)))
        << "the queries attended unrotated";
    at::Tensor q3 = part(0, H).clone(), kc3 = k0.clone(), vc3 = v0.clone();
    cuda::rope_write_cache(q3, k1, v, cos, sin, kc3, vc3, slots + 1, rows);
    EXPECT_FALSE(at::equal(kc2, kc3)) << "the new key one slot late";
  }
  // Off for the process: the two kernels, q rotated in place.
  cuda::set_rope_in_attention(false);
  {
    auto o = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
    at::Tensor q = at::randn({4, 1, 14, 64}, o), k = at::randn({4, 1, 2, 64}, o), v = at::randn({4, 1, 2, 64}, o);
    at::Tensor kc = at::randn({4, 2, 128, 64}, o), vc = at::randn({4, 2, 128, 64}, o);
    at::Tensor cos, sin;
    std::tie(cos, sin) = rope_tables(at::full({4, 1, 1}, 99.0, o.dtype(at::kFloat)), 64, at::kBFloat16);
    const at::Tensor q_before = q.clone();
    cuda::rope_cache_attention(q, k, v, cos, sin, kc, vc, at::Tensor(), at::ones({4, 100}, o.dtype(at::kBool)),
                               at::full({1}, 99, o.dtype(at::kLong)), 100, 0.125);
    EXPECT_FALSE(at::equal(q, q_before)) << "set_rope_in_attention(false): the two kernels";
  }
  cuda::set_rope_in_attention(true);
#endif
}

// The split count of cache_attention (host arithmetic: runs without a GPU in a CUDA build), on an H200's
// 132 SMs x 3 resident blocks. 48 decode rows over 2 KV heads (96 tiles) at 33 key blocks: 4 splits fill
// one wave of 384 blocks of 9 key blocks each (cost 10); 5 (enough for three blocks per SM, rounding up)
// spill 84 blocks into a second wave (2 x 8). 64 rows: 3 splits (one wave of 11 blocks). 256 rows over 8
// key blocks: 512 tiles already take more than a wave, and 2 splits (3 waves of 4 + 1) beat 1 (2 waves of
// 8 + 1). Few tiles take one key block per split; one key block is never split.
TEST(DecodeKernels, CacheAttentionSplitsFillWholeWaves) {
#ifndef RLT_HAVE_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  const int64_t resident = 132 * 3;
  EXPECT_EQ(cuda::cache_attention_splits(96, 33, resident), 4);
  EXPECT_EQ(cuda::cache_attention_splits(128, 33, resident), 3);
  EXPECT_EQ(cuda::cache_attention_splits(512, 8, resident), 2);
  EXPECT_EQ(cuda::cache_attention_splits(10, 4, resident), 4);
  EXPECT_EQ(cuda::cache_attention_splits(1000, 1, resident), 1);
  // The rule of three blocks per SM rounded up (splits = ceil(resident / units), at most the key blocks)
  // would give 5, 4 and 1 for the first three: a second wave, or a wave two thirds idle.
  for (int64_t units : {96, 128}) {
    const int64_t rounded_up = std::min<int64_t>((resident + units - 1) / units, 33);
    EXPECT_NE(cuda::cache_attention_splits(units, 33, resident), rounded_up) << units << " tiles";
  }
#endif
}

// The squeeze of a kept cache (KvCache::squeeze_, as DecodeEngine::compact calls it): every layer's kept
// slots moved down in place by one kernel must equal ATen's gather of them, bit for bit, in three dtypes
// and three slot sizes, with rows of no hole, of no kept slot, and of long moves across several of the
// kernel's chunks. The tensors stay where they were, and the slots past the kept ones are left as they were
// (which also shows that KvCache::squeeze_ took the kernel: ATen's form writes them). An order shifted by
// one slot in one row, and two rows' orders swapped, must each fail the same comparison.
TEST(DecodeKernelsCuda, SqueezeMovesEveryLayersKeptSlotsInPlaceAsAtenGathersThem) {
#ifndef RLT_HAVE_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(4);
  struct Case {
    at::ScalarType dtype;
    int64_t hd;
  };
  for (const Case& c : {Case{at::kFloat, 8}, Case{at::kBFloat16, 64}, Case{at::kHalf, 128}}) {
    const int64_t layers = 3, B = 6, Hkv = 2, max_len = 400, L = 380;
    auto o = at::TensorOptions().device(at::kCUDA).dtype(c.dtype);
    auto lo = at::TensorOptions().device(at::kCUDA).dtype(at::kLong);
    // Row 0 keeps every slot, row 1 none; rows 2-4 keep 60% at random; row 5 only its last 100.
    at::Tensor valid = at::rand({B, L}, at::TensorOptions().device(at::kCUDA)) < 0.6;
    valid[0].fill_(true);
    valid[1].fill_(false);
    valid[5].fill_(false);
    valid[5].narrow(0, L - 100, 100).fill_(true);
    // As DecodeEngine::compact makes it: each row's kept slots in order, then zeros.
    at::Tensor n = valid.sum(1);
    const int64_t S = n.max().item<int64_t>();
    at::Tensor slot = at::arange(L, lo).view({1, L});
    at::Tensor order = std::get<0>(at::where(valid, slot, slot + L).sort(1)).narrow(1, 0, S);
    at::Tensor keep = at::arange(S, lo).view({1, S}) < n.view({B, 1});
    order = at::where(keep, order, at::zeros_like(order)).contiguous();
    std::vector<at::Tensor> k0, v0;
    for (int64_t i = 0; i < layers; ++i) {
      k0.push_back(at::randn({B, Hkv, max_len, c.hd}, o));
      v0.push_back(at::randn({B, Hkv, max_len, c.hd}, o));
    }
    auto copies = [](const std::vector<at::Tensor>& ts) {
      std::vector<at::Tensor> out;
      for (const auto& t : ts) out.push_back(t.clone());
      return out;
    };
    at::Tensor kept = keep.view({B, 1, S, 1});
    // True when every tensor's kept slots equal ATen's gather by `order` of the tensor as it was, and its
    // slots from S on are untouched.
    auto agrees = [&](const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& was, const at::Tensor& by) {
      bool ok = true;
      for (size_t i = 0; i < got.size(); ++i) {
        at::Tensor want = was[i].gather(2, by.view({B, 1, S, 1}).expand({B, Hkv, S, c.hd}));
        ok = ok && ((got[i].narrow(2, 0, S) == want) | kept.logical_not()).all().item<bool>();
        ok = ok && got[i].narrow(2, S, max_len - S).equal(was[i].narrow(2, S, max_len - S));
      }
      return ok;
    };
    std::vector<at::Tensor> k = copies(k0), v = copies(v0);
    const void* where = k[1].data_ptr();
    ASSERT_TRUE(cuda::squeeze_slots_supports(k, v));
    cuda::squeeze_slots_(k, v, order);
    EXPECT_EQ(k[1].data_ptr(), where);
    EXPECT_TRUE(agrees(k, k0, order)) << c.dtype << " hd " << c.hd << ": keys";
    EXPECT_TRUE(agrees(v, v0, order)) << c.dtype << " hd " << c.hd << ": values";
    // Past a row's kept slots (below S) the kernel leaves the cache as it was.
    at::Tensor past = (keep.logical_not()).view({B, 1, S, 1});
    EXPECT_TRUE(((k[2].narrow(2, 0, S) == k0[2].narrow(2, 0, S)) | past.logical_not()).all().item<bool>());

    // KvCache::squeeze_ takes the kernel on CUDA: the same result everywhere, the untouched slots included.
    KvCache cache;
    cache.k = copies(k0), cache.v = copies(v0);
    cache.positions = at::arange(max_len, lo).repeat({B, 1});
    cache.max_len = max_len;
    cache.length = L;
    cache.squeeze_(order);
    EXPECT_EQ(cache.length, S);
    for (int64_t i = 0; i < layers; ++i) EXPECT_TRUE(cache.k[i].equal(k[i]) && cache.v[i].equal(v[i])) << i;
    EXPECT_TRUE(((cache.positions.narrow(1, 0, S) == order) | keep.logical_not()).all().item<bool>());

    // Wrong orders: row 3's kept slots read one further on; rows 2 and 4 exchanged.
    at::Tensor shifted = order.clone();
    const int64_t n3 = n[3].item<int64_t>();
    shifted[3].narrow(0, 0, n3 - 1).copy_(order[3].narrow(0, 1, n3 - 1));
    at::Tensor swapped = order.index_select(0, at::tensor({0, 1, 4, 3, 2, 5}, lo));
    for (const at::Tensor& bad : {shifted, swapped}) {
      std::vector<at::Tensor> kb = copies(k0), vb = copies(v0);
      cuda::squeeze_slots_(kb, vb, bad.contiguous());
      EXPECT_FALSE(agrees(kb, k0, order)) << "a wrong order passed";
    }
  }
#endif
}

// Programmatic dependent launch (common/cuda/launch.h): captured under DependentLaunchScope, each of a chain
// of fused kernels (residual add + RMSNorm, RoPE with the cache write, in-place attention and, where it
// splits the keys, its combine, the SiLU gate, RMSNorm) that follows another kernel joins it by a
// programmatic edge, and the graph's replays compute what eager launches do, bit for bit; captured without
// the scope, every edge is plain. Three widths: D = 256 (the norm's 8 elements a thread in registers, one
// warp's query rows split the keys), 1,536 (16 a thread) and 3,584 (the norm's loop; 28 query heads over
// one KV head, past one warp's 16 query rows). The wrong twin it rejects: the same capture with the scope off, whose
// graph has no programmatic edge.
TEST(DecodeKernelsCuda, DependentLaunchJoinsTheKernelsByProgrammaticEdges) {
#ifndef RLT_HAVE_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(5);
  auto o = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  struct Shape {
    int64_t H, Hkv, hd;
  };
  for (const Shape sh : {Shape{4, 2, 64}, Shape{12, 2, 128}, Shape{28, 1, 128}}) {
    const int64_t B = 16, H = sh.H, Hkv = sh.Hkv, hd = sh.hd, S = 640, D = H * hd, span = 600;
    SCOPED_TRACE(::testing::Message() << "D " << D);
    const at::Tensor x = at::randn({B, 1, D}, o), r = at::randn({B, 1, D}, o), w = at::rand({D}, o) + 0.5;
    const at::Tensor w_qkv = at::randn({(H + 2 * Hkv) * hd, D}, o) / std::sqrt(double(D));
    at::Tensor cos, sin;  // lambdas below read them: not structured bindings
    std::tie(cos, sin) = rope_tables(at::full({B, 1, 1}, double(span - 1), o.dtype(at::kFloat)), hd, at::kBFloat16);
    const at::Tensor k0 = at::randn({B, Hkv, S, hd}, o), v0 = at::randn({B, Hkv, S, hd}, o);
    const at::Tensor keep = at::rand({B, S}, o.dtype(at::kFloat)) < 0.9,
                     slots = at::full({1}, span - 1, o.dtype(at::kLong));
    at::Tensor kc = at::empty_like(k0), vc = at::empty_like(v0);
    // One layer's chain as a decode step runs it (the projection by cuBLAS between the fused kernels).
    auto chain = [&] {
      kc.copy_(k0);
      vc.copy_(v0);
      auto [h, n] = cuda::add_rms_norm(x, r, w, 1e-6, false);
      at::Tensor qkv = at::linear(n, w_qkv);
      at::Tensor q = qkv.narrow(-1, 0, H * hd).view({B, 1, H, hd}),
                 k = qkv.narrow(-1, H * hd, Hkv * hd).view({B, 1, Hkv, hd}),
                 v = qkv.narrow(-1, (H + Hkv) * hd, Hkv * hd).view({B, 1, Hkv, hd});
      cuda::rope_write_cache(q, k, v, cos, sin, kc, vc, slots);
      at::Tensor a = cuda::cache_attention(q, kc, vc, at::Tensor(), keep, slots, span, 1.0 / std::sqrt(double(hd)))
                         .view({B, 1, D});
      at::Tensor g = cuda::silu_mul(a, h);
      return cuda::rms_norm(g, w, 1e-6, false);
    };
    const at::Tensor eager = chain().clone();
    // cuBLAS launches its own kernels with the attribute on some versions: its edges are the same in both
    // captures, so the fused kernels' are the difference.
    int64_t plain_programmatic = -1;
    for (bool on : {false, true}) {
      SCOPED_TRACE(on ? "dependent launch" : "plain launch");
      const int64_t before = cuda::dependent_launch_count();
      at::cuda::CUDAGraph graph(/*keep_graph=*/true);
      at::Tensor out;
      {
        c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
        graph.capture_begin();
        {
          const cuda::DependentLaunchScope scope(on);
          out = chain();
        }
        graph.capture_end();
      }
      const int64_t launched = cuda::dependent_launch_count() - before;
      size_t n_edges = 0;
      C10_CUDA_CHECK(graph_edges(graph.raw_cuda_graph(), nullptr, nullptr, nullptr, &n_edges));
      std::vector<cudaGraphNode_t> from(n_edges), to(n_edges);
      std::vector<cudaGraphEdgeData> data(n_edges);
      C10_CUDA_CHECK(graph_edges(graph.raw_cuda_graph(), from.data(), to.data(), data.data(), &n_edges));
      int64_t programmatic = 0;
      for (const cudaGraphEdgeData& e : data) programmatic += e.type == cudaGraphDependencyTypeProgrammatic;
      if (on) {
        // Five or six fused kernels (the combine where the keys are split); add_rms_norm follows the copies,
        // each of the others a kernel.
        EXPECT_GE(launched, 5);
        EXPECT_EQ(programmatic - plain_programmatic, launched - 1) << n_edges << " edges";
      } else {
        EXPECT_EQ(launched, 0);
        plain_programmatic = programmatic;
      }
      graph.instantiate();
      for (int rep = 0; rep < 20; ++rep) {
        out.zero_();
        graph.replay();
        ASSERT_TRUE(at::equal(out, eager)) << "replay " << rep << " differs from the eager launches";
      }
      std::cout << "D " << D << (on ? ", dependent launch: " : ", plain: ") << n_edges << " edges, " << programmatic
                << " programmatic\n";
    }
  }
#endif
}

// Each fused kernel waits for the kernel ahead of it before it reads what that kernel writes
// (cuda::wait_for_inputs). Here the kernel ahead is a slow producer (tests/common/slow_producer.h): it lets
// the next kernel launch at once and writes one of that kernel's inputs (or outputs written in place) 200 us
// later. Each case is captured with dependent launch on and replayed, as the engine's step graphs are
// (launched on a stream, the next kernel on an H200 does not start early). Every fused kernel must compute,
// bit for bit, what it computes from inputs written beforehand, whichever of its inputs comes late. The wrong twin it
// must catch: a copy kernel that does not wait, which reads its input before the producer has written it. The draw's
// kernels (rollout/cuda/sample_kernels.cu) are not here: an ATen fill stands between its logits and its first kernel.
TEST(DecodeKernelsCuda, DependentLaunchWaitsForASlowProducer) {
#ifndef RLT_HAVE_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(6);
  auto o = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  // A zeroed tensor the slow producer fills with t: the input of the kernel launched next.
  auto late = [](const at::Tensor& t) {
    at::Tensor x = at::zeros_like(t);
    probe::slow_copy_(x, t, 200);
    return x;
  };
  // body()'s outputs, captured as one CUDA graph with dependent launch on and replayed once (cloned: the
  // graph goes).
  auto replayed = [](const std::function<std::vector<at::Tensor>()>& body) {
    at::cuda::CUDAGraph graph;
    std::vector<at::Tensor> out;
    {
      c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
      graph.capture_begin();
      {
        const cuda::DependentLaunchScope scope(true);
        out = body();
      }
      graph.capture_end();
    }
    graph.replay();
    std::vector<at::Tensor> kept;
    for (const at::Tensor& t : out) kept.push_back(t.clone());
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    return kept;
  };
  {
    const at::Tensor src = at::randn({1 << 16}, o);
    const int64_t before = cuda::dependent_launch_count();
    const at::Tensor early = replayed([&] { return std::vector<at::Tensor>{probe::copy_without_wait(late(src))}; })[0];
    ASSERT_EQ(cuda::dependent_launch_count() - before, 1);
    EXPECT_FALSE(at::equal(early, src)) << "a kernel that does not wait read the late input as written";
  }
  auto same = [](const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
    for (size_t i = 0; i < a.size(); ++i) {
      if (!at::equal(a[i], b[i])) return false;
    }
    return true;
  };
  // Norms: 8 and 16 elements a thread in registers, in blocks of 128 threads (D 256, 1,536) and of 512
  // (D 3,584, 5,120), and the loop of rows past 8,192 (D 9,000).
  for (const int64_t D : {int64_t(256), int64_t(1536), int64_t(3584), int64_t(5120), int64_t(9000)}) {
    SCOPED_TRACE(::testing::Message() << "D " << D);
    const at::Tensor x = at::randn({16, D}, o), r = at::randn({16, D}, o), w = at::rand({D}, o) + 0.5;
    const at::Tensor norm = cuda::rms_norm(x, w, 1e-6, false);
    EXPECT_TRUE(
        at::equal(replayed([&] { return std::vector<at::Tensor>{cuda::rms_norm(late(x), w, 1e-6, false)}; })[0], norm))
        << "rms_norm";
    const auto [h, n] = cuda::add_rms_norm(x, r, w, 1e-6, false);
    for (int which = 0; which < 2; ++which) {
      const std::vector<at::Tensor> out = replayed([&] {
        const auto [h2, n2] = which == 0 ? cuda::add_rms_norm(late(x), r, w, 1e-6, false)
                                         : cuda::add_rms_norm(x, late(r), w, 1e-6, false);
        return std::vector<at::Tensor>{h2, n2};
      });
      EXPECT_TRUE(same(out, {h, n})) << "add_rms_norm, input " << which << " late";
    }
  }
  // A decode step's RoPE with the cache write, its attention (split over the keys) and the SiLU gate.
  const int64_t B = 16, H = 4, Hkv = 2, hd = 64, S = 640, span = 600;
  const at::Tensor q0 = at::randn({B, 1, H, hd}, o), v = at::randn({B, 1, Hkv, hd}, o);
  at::Tensor k = at::randn({B, 1, Hkv, hd}, o);  // rope_write_cache takes it by reference, and leaves it
  at::Tensor cos, sin;                           // lambdas below read them: not structured bindings
  std::tie(cos, sin) = rope_tables(at::full({B, 1, 1}, double(span - 1), o.dtype(at::kFloat)), hd, at::kBFloat16);
  const at::Tensor k0 = at::randn({B, Hkv, S, hd}, o), v0 = at::randn({B, Hkv, S, hd}, o);
  const at::Tensor slots = at::full({1}, span - 1, o.dtype(at::kLong));
  at::Tensor q_ref = q0.clone(), kc_ref = k0.clone(), vc_ref = v0.clone();
  cuda::rope_write_cache(q_ref, k, v, cos, sin, kc_ref, vc_ref, slots);
  // The caches are written in place: late, the slot the kernel writes must not be overwritten by the copy.
  const char* rope_inputs[] = {"q", "k", "v", "cos", "sin", "slots", "k cache", "v cache"};
  for (int which = 0; which < 8; ++which) {
    const std::vector<at::Tensor> out = replayed([&] {
      at::Tensor q = q0.clone(), kc = k0.clone(), vc = v0.clone();
      at::Tensor in[] = {q, k, v, cos, sin, slots};
      if (which == 0 || which >= 6) {
        at::Tensor& mine = which == 0 ? q : which == 6 ? kc : vc;  // rotated or written in place
        mine.zero_();
        probe::slow_copy_(mine, which == 0 ? q0 : which == 6 ? k0 : v0, 200);
      } else {
        in[which] = late(in[which]);
      }
      cuda::rope_write_cache(q, in[1], in[2], in[3], in[4], kc, vc, in[5]);
      return std::vector<at::Tensor>{q, kc, vc};
    });
    EXPECT_TRUE(same(out, {q_ref, kc_ref, vc_ref})) << "rope_write_cache, " << rope_inputs[which] << " late";
  }
  // The attention over the cache: 4 query heads over 2 KV heads at hd 64 and 28 over 4 at hd 128 (the 7B's:
  // one warp's query rows split the keys), and 28 over one at hd 128 (past one warp's 16 rows); the keys
  // split between blocks, whose shares the combine kernel adds (its wait is tested behind the attention
  // kernel, not behind the slow producer).
  const at::Tensor keep = at::rand({B, S}, o.dtype(at::kFloat)) < 0.9;
  struct Heads {
    int64_t H, Hkv, hd;
  };
  for (const Heads sh : {Heads{H, Hkv, hd}, Heads{28, 4, 128}, Heads{28, 1, 128}}) {
    SCOPED_TRACE(::testing::Message() << sh.H << " heads over " << sh.Hkv << ", hd " << sh.hd);
    const at::Tensor q = at::randn({B, 1, sh.H, sh.hd}, o), kc = at::randn({B, sh.Hkv, S, sh.hd}, o),
                     vc = at::randn({B, sh.Hkv, S, sh.hd}, o);
    const double scale = 1.0 / std::sqrt(double(sh.hd));
    const at::Tensor attn = cuda::cache_attention(q, kc, vc, at::Tensor(), keep, slots, span, scale);
    const char* attention_inputs[] = {"q", "k cache", "v cache", "keep", "slots"};
    for (int which = 0; which < 5; ++which) {
      const at::Tensor out = replayed([&] {
        at::Tensor in[] = {q, kc, vc, keep, slots};
        in[which] = late(in[which]);
        return std::vector<at::Tensor>{
            cuda::cache_attention(in[0], in[1], in[2], at::Tensor(), in[3], in[4], span, scale)};
      })[0];
      EXPECT_TRUE(at::equal(out, attn)) << "cache_attention, " << attention_inputs[which] << " late";
    }
  }
  // RoPE inside the attention, each input late (q, k, v, the tables, the slots, keep, or a cache, written in
  // place): the two kernels' output and caches.
  {
    const at::Tensor keep_r = at::rand({B, span}, o.dtype(at::kFloat)) < 0.9;
    at::Tensor q1 = q0.clone(), kc1 = k0.clone(), vc1 = v0.clone();
    cuda::rope_write_cache(q1, k, v, cos, sin, kc1, vc1, slots);
    const at::Tensor want = cuda::cache_attention(q1, kc1, vc1, at::Tensor(), keep_r, slots, span, 0.125);
    const char* inputs[] = {"q", "k", "v", "cos", "sin", "slots", "keep", "k cache", "v cache"};
    for (int which = 0; which < 9; ++which) {
      const std::vector<at::Tensor> out = replayed([&] {
        at::Tensor kc = k0.clone(), vc = v0.clone();
        at::Tensor in[] = {q0.clone(), k, v, cos, sin, slots, keep_r};
        if (which >= 7) {
          at::Tensor& mine = which == 7 ? kc : vc;
          mine.zero_();
          probe::slow_copy_(mine, which == 7 ? k0 : v0, 200);
        } else {
          in[which] = late(in[which]);
        }
        const at::Tensor a = cuda::rope_cache_attention(in[0], in[1], in[2], in[3], in[4], kc, vc, at::Tensor(), in[6],
                                                        in[5], span, 0.125);
        return std::vector<at::Tensor>{a, kc, vc};
      });
      EXPECT_TRUE(same(out, {want, kc1, vc1})) << "rope_cache_attention, " << inputs[which] << " late";
    }
  }
  const at::Tensor g = at::randn({B, 1, 1024}, o), u = at::randn({B, 1, 1024}, o);
  const at::Tensor gated = cuda::silu_mul(g, u);
  for (int which = 0; which < 2; ++which) {
    const at::Tensor out = replayed([&] {
      return std::vector<at::Tensor>{which == 0 ? cuda::silu_mul(late(g), u) : cuda::silu_mul(g, late(u))};
    })[0];
    EXPECT_TRUE(at::equal(out, gated)) << "silu_mul, input " << which << " late";
  }
#endif
}

// tuned_linear (model/tuned_gemm.h) on a decode step's shapes and odd ones: bf16 products within the
// dtype's rounding of float64's (as at::linear's are), the bias added once, and, captured into a CUDA graph
// once its shape is tuned, replayed bit for bit as run. The check rejects a product without its bias and
// one whose output is read as the transposed layout.
TEST(TunedGemmCuda, ProductsMatchFloat64AndReplayInAGraph) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
#ifdef RLT_HAVE_CUDA
  at::manual_seed(11);
  const auto o = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  struct Shape {
    int64_t M, N, K;
    bool bias;
  };
  const TunedGemmCounts before = tuned_gemm_counts();
  // Twice: as timed (ATen's call may win a shape), then with ATen's call left out, so that every shape runs a
  // cuBLASLt algorithm, the bias epilogue's included.
  for (const bool without_aten : {false, true}) {
    tuned_gemms_without_aten(without_aten);
    for (const Shape sh : {Shape{1, 1152, 896, true}, Shape{16, 9728, 896, false}, Shape{16, 896, 4864, false},
                           Shape{64, 896, 896, true}, Shape{3, 200, 72, true}, Shape{5, 64, 40, false}}) {
      SCOPED_TRACE(::testing::Message() << sh.M << " x " << sh.N << " x " << sh.K << (sh.bias ? ", bias" : "")
                                        << (without_aten ? ", ATen's call left out" : ""));
      const at::Tensor x = at::randn({1, sh.M, sh.K}, o), w = at::randn({sh.N, sh.K}, o) * 0.05;
      const at::Tensor b = sh.bias ? at::randn({sh.N}, o) : at::Tensor();
      at::Tensor want = at::matmul(x.to(at::kDouble), w.to(at::kDouble).t());
      if (sh.bias) want = want + b.to(at::kDouble);
      // A bf16 output is within half an ulp of its sum; the sum's rounding (split-K partial sums may be
      // rounded to bf16 too, as cuBLAS's are) within a small share of the products' magnitudes.
      at::Tensor magnitude = at::matmul(x.to(at::kDouble).abs(), w.to(at::kDouble).abs().t());
      auto off = [&](const at::Tensor& y) {
        return ((y.to(at::kDouble) - want).abs() - want.abs() * std::ldexp(1.0, -7) - magnitude * std::ldexp(1.0, -10))
            .max()
            .item<double>();
      };
      const at::Tensor got = tuned_linear(x, w, b);
      ASSERT_EQ(got.sizes(), (std::vector<int64_t>{1, sh.M, sh.N}));
      EXPECT_LE(off(got), 0.0);
      EXPECT_LE(off(at::linear(x, w, b.defined() ? std::optional<at::Tensor>(b) : std::nullopt)), 0.0);
      if (sh.bias) EXPECT_GT(off(got - b), 0.0) << "the product without its bias";
      if (sh.M > 1)
        EXPECT_GT(off(got.reshape({sh.N, sh.M}).t().reshape({1, sh.M, sh.N})), 0.0) << "the transposed layout";
      at::cuda::CUDAGraph graph;
      at::Tensor replay_in = x.clone(), replayed;
      {
        c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
        graph.capture_begin();
        replayed = tuned_linear(replay_in, w, b);
        graph.capture_end();
      }
      graph.replay();
      C10_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_TRUE(at::equal(replayed, got)) << "the captured call";
      replay_in.copy_(x * 2);
      graph.replay();
      C10_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_TRUE(at::equal(replayed, tuned_linear(x * 2, w, b))) << "the captured call on new inputs";
    }
  }
  tuned_gemms_without_aten(false);
  EXPECT_EQ(tuned_gemm_counts().shapes - before.shapes, 12) << "each shape tuned once a pass, outside the capture";
  EXPECT_GE(tuned_gemm_counts().lt_chosen - before.lt_chosen, 6) << "the second pass chose cuBLASLt algorithms";
  // A shape first seen inside a capture takes ATen's call.
  const at::Tensor x = at::randn({7, 96}, o), w = at::randn({48, 96}, o);
  at::cuda::CUDAGraph graph;
  at::Tensor y;
  {
    c10::cuda::CUDAStreamGuard side(c10::cuda::getStreamFromPool());
    graph.capture_begin();
    y = tuned_linear(x, w, at::Tensor());
    graph.capture_end();
  }
  graph.replay();
  C10_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_TRUE(at::equal(y, at::linear(x, w)));
  EXPECT_EQ(tuned_gemm_counts().shapes - before.shapes, 12);
#endif
}

}  // namespace
}  // namespace rlt
