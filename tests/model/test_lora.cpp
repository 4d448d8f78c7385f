// LoRA adapters (model/lora.h) and their PEFT folders (model/peft.h): the adapted projection and the
// gradients of A and B against a float64 loop, a float64 gradient check through the whole decoder, the
// merged weights bit for bit, the merged model's logits against the adapter model's, the adapters' dropout
// (training forwards only, replayed by the activation checkpointing's recompute), and transformers + peft
// loading our adapter folder onto the reference checkpoints with our logits. Each check runs a wrong
// variant beside it (alpha in place of alpha / rank, an adapter-less model, another mask) that must fail.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "model/config.h"
#include "model/lora.h"
#include "model/peft.h"
#include "model/safetensors.h"
#include "model/transformer.h"
#include "tests/common/check.h"
#include "tests/common/gradcheck.h"
#include "tests/common/tiny_model.h"
#include "tests/common/tmpdir.h"

namespace rlt {
namespace {

namespace fs = std::filesystem;
using rlt::testing::close;
using rlt::testing::rejects;

// fp32 projections of O(1) values summed over <= 11 terms, against float64: rounding ~1e-6 relative.
constexpr double kAtolFp32 = 1e-5, kRtolFp32 = 1e-5;
// Merged model against the adapter model, fp32 logits: the same sums grouped differently (W x + s B (A x)
// against (W + s B A) x), ~1e-7 on logits of ~0.4.
constexpr double kMergedLogitAtol = 1e-5;
// Our fp32 logits against peft's on the reference checkpoints, with the attention our decoder runs: equal
// to the last bit on the CPU (observed), so 1e-5 leaves room for other BLAS builds alone.
constexpr double kPeftLogitAtol = 1e-5;

LoraOptions options(int64_t rank, double alpha, const std::string& targets = "q,k,v,o,gate,up,down") {
  LoraOptions o;
  o.rank = rank;
  o.alpha = alpha;
  o.targets = targets;
  return o;
}

// The adapted projection and the gradients of A and B for the loss sum(y * G), in float64 loops:
// y = x W^T + b + s (x A^T) B^T;  dB = s G^T (x A^T);  dA = s B^T G^T x.
struct ProjectionReference {
  at::Tensor y, dA, dB;
};
ProjectionReference projection_reference(const at::Tensor& x, const at::Tensor& W, const at::Tensor& b,
                                         const at::Tensor& A, const at::Tensor& B, const at::Tensor& G, double s) {
  const int64_t N = x.size(0), in = x.size(1), out = W.size(0), r = A.size(0);
  auto X = x.to(at::kDouble).contiguous(), Wd = W.to(at::kDouble).contiguous(), bd = b.to(at::kDouble).contiguous();
  auto Ad = A.to(at::kDouble).contiguous(), Bd = B.to(at::kDouble).contiguous(), Gd = G.to(at::kDouble).contiguous();
  auto xa = X.accessor<double, 2>(), wa = Wd.accessor<double, 2>(), aa = Ad.accessor<double, 2>();
  auto ba = Bd.accessor<double, 2>(), ga = Gd.accessor<double, 2>();
  auto bias = bd.accessor<double, 1>();
  ProjectionReference ref{at::zeros({N, out}, at::kDouble), at::zeros({r, in}, at::kDouble),
                          at::zeros({out, r}, at::kDouble)};
  at::Tensor U = at::zeros({N, r}, at::kDouble);  // x A^T
  auto u = U.accessor<double, 2>();
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < r; ++k) {
      for (int64_t i = 0; i < in; ++i) u[n][k] += xa[n][i] * aa[k][i];
    }
  }
  auto y = ref.y.accessor<double, 2>(), dA = ref.dA.accessor<double, 2>(), dB = ref.dB.accessor<double, 2>();
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t o = 0; o < out; ++o) {
      double acc = bias[o];
      for (int64_t i = 0; i < in; ++i) acc += xa[n][i] * wa[o][i];
      for (int64_t k = 0; k < r; ++k) acc += s * u[n][k] * ba[o][k];
      y[n][o] = acc;
    }
  }
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t k = 0; k < r; ++k) {
      for (int64_t n = 0; n < N; ++n) dB[o][k] += s * ga[n][o] * u[n][k];
    }
  }
  for (int64_t k = 0; k < r; ++k) {
    for (int64_t i = 0; i < in; ++i) {
      for (int64_t n = 0; n < N; ++n) {
        double gb = 0;  // (G B)[n][k]
        for (int64_t o = 0; o < out; ++o) gb += ga[n][o] * ba[o][k];
        dA[k][i] += s * gb * xa[n][i];
      }
    }
  }
  return ref;
}

TEST(LoraProjection, OutputAndGradientsOfAAndBMatchAFloat64Loop) {
  // Odd sizes: 5 rows, 7 inputs, 11 outputs, rank 3; alpha 6 -> scale 2.
  const int64_t N = 5, in = 7, out = 11, r = 3;
  const double alpha = 6, s = alpha / r;
  at::manual_seed(11);
  at::Tensor x = at::randn({N, in}), W = at::randn({out, in}), b = at::randn({out}), G = at::randn({N, out});
  at::Tensor A = at::randn({r, in}).requires_grad_(true), B = at::randn({out, r}).requires_grad_(true);
  at::Tensor y = at::linear(x, W, b) + lora_update(x, A, B, s);
  (y * G).sum().backward();
  const ProjectionReference ref = projection_reference(x, W, b, A.detach(), B.detach(), G, s);
  const ProjectionReference twin = projection_reference(x, W, b, A.detach(), B.detach(), G, alpha);
  RLT_EXPECT_CLOSE_REJECTING(y, twin.y, "scale alpha, not alpha / rank", ref.y, kAtolFp32, kRtolFp32, "y");
  RLT_EXPECT_CLOSE_REJECTING(A.grad(), twin.dA, "scale alpha, not alpha / rank", ref.dA, kAtolFp32, kRtolFp32, "dA");
  RLT_EXPECT_CLOSE_REJECTING(B.grad(), twin.dB, "scale alpha, not alpha / rank", ref.dB, kAtolFp32, kRtolFp32, "dB");
  // A bf16 input keeps fp32 gradients on the fp32 adapters (the cast's backward).
  at::Tensor A2 = A.detach().clone().requires_grad_(true), B2 = B.detach().clone().requires_grad_(true);
  lora_update(x.to(at::kBFloat16), A2, B2, s).sum().backward();
  EXPECT_EQ(A2.grad().scalar_type(), at::kFloat);
  EXPECT_EQ(B2.grad().scalar_type(), at::kFloat);
}

TEST(LoraProjection, DropoutZeroesInputsAtItsRateAndScalesTheRest) {
  // x of ones through A = ones (1, in), B = ones (1, 1): the output is (inputs kept) / (1 - p); p = 1/2
  // makes the scale exactly 2.
  const int64_t in = 4000;
  const double p = 0.5;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  at::Tensor y = lora_update(at::ones({1, in}), at::ones({1, in}), at::ones({1, 1}), 1.0, p, gen);
  const double kept = y.item<double>() * (1 - p);
  EXPECT_EQ(kept, std::round(kept)) << "each kept input is scaled by exactly 1 / (1 - p)";
  // Binomial(4000, 1/2): mean 2000, sd 32; 5 sd.
  EXPECT_NEAR(kept, in * (1 - p), 5 * std::sqrt(in * p * (1 - p)));
  // Another draw of the same generator: another mask.
  EXPECT_NE(lora_update(at::ones({1, in}), at::ones({1, in}), at::ones({1, 1}), 1.0, p, gen).item<double>(),
            y.item<double>());
}

TEST(Lora, AttachFreezesTheBaseAndNamesTheAdaptersAsPeft) {
  Transformer m(testing::tiny_llama(50), at::kFloat, at::kCPU, 3);
  m.attach_lora(options(4, 8, "q,v,down"), 7);
  for (const auto& [name, t] : m.named_parameters()) EXPECT_FALSE(t.requires_grad()) << name;
  const auto named = m.named_trainable_parameters();
  ASSERT_EQ(named.size(), 2u * 3 * 2);  // 2 layers x 3 targets x (A, B)
  EXPECT_EQ(named[0].first, "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight");
  for (const auto& [name, t] : named) {
    EXPECT_TRUE(t.requires_grad()) << name;
    EXPECT_EQ(t.scalar_type(), at::kFloat) << name;
    EXPECT_NE(name.find("model.layers."), std::string::npos) << name;
    if (name.find("lora_B") != std::string::npos) {
      EXPECT_EQ(t.abs().max().item<double>(), 0.0) << name << " starts at zero";
    } else {
      // PEFT's kaiming-uniform (a = sqrt 5): U(-1/sqrt(in), 1/sqrt(in)); in = 32 (q, v) or 64 (down).
      const double bound = 1.0 / std::sqrt(static_cast<double>(t.size(1)));
      EXPECT_LE(t.abs().max().item<double>(), bound) << name;
      EXPECT_GT(t.abs().max().item<double>(), 0.9 * bound) << name;
    }
  }
  EXPECT_EQ(named[1].first, "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight");
  EXPECT_EQ(named[1].second.sizes(), at::IntArrayRef({32, 4}));  // (out = D, rank)
  // The same seed draws the same A; another seed another.
  Transformer m2(testing::tiny_llama(50), at::kFloat, at::kCPU, 3), m3 = m2.clone();
  m2.attach_lora(options(4, 8, "q,v,down"), 7);
  m3.attach_lora(options(4, 8, "q,v,down"), 8);
  EXPECT_TRUE(at::equal(m2.named_trainable_parameters()[0].second, named[0].second));
  EXPECT_FALSE(at::equal(m3.named_trainable_parameters()[0].second, named[0].second));
  EXPECT_THROW(m.attach_lora(options(4, 8, "q,proj"), 7), std::invalid_argument);
}

// Random non-zero adapters (B too), from `seed`.
void randomize_adapters(Transformer& m, uint64_t seed, double scale = 0.3) {
  at::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (auto& [name, t] : m.named_trainable_parameters()) {
    t.copy_(at::randn(t.sizes(), gen, at::TensorOptions().dtype(at::kDouble)).mul_(scale));
  }
}

at::Tensor positions(int64_t B, int64_t L) { return at::arange(L, at::kLong).unsqueeze(0).expand({B, L}).contiguous(); }

TEST(Lora, ZeroBLeavesTheForwardBitForBit) {
  // With B = 0 the adapters add exactly zero: hidden states equal the base model's bit for bit.
  Transformer base = testing::tiny_model("qwen2", 4, at::kCPU, at::kFloat);  // q/k/v biases
  Transformer adapted = base.clone();
  adapted.attach_lora(options(2, 4), 1);
  at::NoGradGuard no_grad;
  at::manual_seed(2);
  at::Tensor ids = at::randint(400, {2, 9}, at::kLong);
  EXPECT_TRUE(
      at::equal(adapted.forward(ids, positions(2, 9), at::Tensor()), base.forward(ids, positions(2, 9), at::Tensor())));
}

TEST(Lora, DecoderGradientsOfAAndBFollowTheMergedWeightsGradient) {
  // Through the whole decoder, in float64 (float64 adapters on a float64 model), every target, rank 2:
  // the adapter model computes the merged model's function with W' = W + s B A, so by the chain rule
  // dA = s B^T dW' and dB = s dW' A^T, where dW' is the merged model's weight gradient (its own graph, no
  // adapter in it). The twin: the same identities with the scale alpha instead of alpha / rank.
  // (Central differences cannot check this model: its RMSNorm and RoPE run in fp32 even on float64.)
  Transformer m = testing::tiny_model("llama", 9, at::kCPU, at::kDouble);
  const double alpha = 3, rank = 2, s = alpha / rank;
  m.attach_lora(options(2, alpha), 2);
  randomize_adapters(m, 4, 0.05);
  Transformer merged = m.merged();
  at::manual_seed(5);
  const at::Tensor ids = at::randint(400, {2, 6}, at::kLong);
  const at::Tensor R = at::randn({2, 6, m.config().hidden_size}, at::kDouble);
  const auto base_named = m.named_parameters();
  const std::map<std::string, at::Tensor> base(base_named.begin(), base_named.end());
  std::map<std::string, at::Tensor> merged_w;  // the targeted weights: the merged model's own tensors
  for (auto& [name, t] : merged.named_parameters()) {
    if (!t.is_same(base.at(name))) merged_w[name] = t;
  }
  for (auto& [name, t] : merged_w) t.requires_grad_(true);
  (m.forward(ids, positions(2, 6), at::Tensor()) * R).sum().backward();
  (merged.forward(ids, positions(2, 6), at::Tensor()) * R).sum().backward();
  const auto named = m.named_trainable_parameters();
  std::map<std::string, at::Tensor> ad(named.begin(), named.end());
  ASSERT_EQ(merged_w.size(), 2u * 7);
  for (const auto& [name, w] : merged_w) {
    const std::string a = "base_model.model." + name.substr(0, name.size() - 7) + ".lora_A.weight";
    const std::string b = a.substr(0, a.size() - 13) + "lora_B.weight";
    const at::Tensor A = ad.at(a), B = ad.at(b), dW = w.grad();
    ASSERT_TRUE(A.grad().defined() && B.grad().defined()) << name;
    // float64 chains whose values pass through fp32 norms: agreement ~1e-7 relative.
    RLT_EXPECT_CLOSE_REJECTING(A.grad(), alpha * at::mm(B.detach().t(), dW), "scale alpha",
                               s * at::mm(B.detach().t(), dW), 1e-9, 1e-6, name + " dA");
    RLT_EXPECT_CLOSE_REJECTING(B.grad(), alpha * at::mm(dW, A.detach().t()), "scale alpha",
                               s * at::mm(dW, A.detach().t()), 1e-9, 1e-6, name + " dB");
  }
}

// float64 reference of a merged weight, rounded once to `dt`: W + s sum_k B[o][k] A[k][i].
at::Tensor merged_reference(const at::Tensor& W, const at::Tensor& A, const at::Tensor& B, double s,
                            at::ScalarType dt) {
  at::Tensor Wd = W.to(at::kDouble).contiguous(), Ad = A.to(at::kDouble).contiguous();
  at::Tensor Bd = B.to(at::kDouble).contiguous(), out = Wd.clone();
  auto o = out.accessor<double, 2>(), a = Ad.accessor<double, 2>(), b = Bd.accessor<double, 2>();
  for (int64_t i = 0; i < out.size(0); ++i) {
    for (int64_t j = 0; j < out.size(1); ++j) {
      double d = 0;
      for (int64_t k = 0; k < A.size(0); ++k) d += b[i][k] * a[k][j];
      o[i][j] += s * d;
    }
  }
  return out.to(dt);
}

TEST(Lora, MergedWeightsAreWPlusScaledBABitForBit) {
  // fp32: A and B hold multiples of 1/8 in [-2, 2], so every product, sum and the scale 2 (alpha 8 /
  // rank 4) are exact in fp32, and the float64 reference rounded once equals the fp32 result bit for bit.
  Transformer m(testing::tiny_llama(50), at::kFloat, at::kCPU, 3);
  m.attach_lora(options(4, 8), 1);
  {
    at::NoGradGuard no_grad;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(6);
    for (auto& [name, t] : m.named_trainable_parameters()) {
      t.copy_(at::randint(-16, 17, t.sizes(), gen, at::TensorOptions().dtype(at::kFloat)).div_(8));
    }
  }
  const Transformer merged = m.merged();
  EXPECT_FALSE(merged.has_lora());
  const auto base = m.named_parameters(), mp = merged.named_parameters();
  const auto adapters = m.named_trainable_parameters();
  std::map<std::string, at::Tensor> ad(adapters.begin(), adapters.end());
  int64_t targeted = 0;
  for (size_t k = 0; k < base.size(); ++k) {
    const std::string& name = base[k].first;
    ASSERT_EQ(name, mp[k].first);
    const std::string a = "base_model.model." + name.substr(0, name.size() - 7) + ".lora_A.weight";
    if (!ad.count(a)) {
      EXPECT_TRUE(mp[k].second.is_same(base[k].second)) << name << ": untargeted tensors are shared, not copied";
      continue;
    }
    ++targeted;
    const at::Tensor A = ad.at(a), B = ad.at(a.substr(0, a.size() - 13) + "lora_B.weight");
    const at::Tensor want = merged_reference(base[k].second, A, B, 2.0, at::kFloat);
    const at::Tensor twin = merged_reference(base[k].second, A, B, 8.0, at::kFloat);  // alpha, not alpha / rank
    EXPECT_TRUE(at::equal(mp[k].second, want)) << name;
    EXPECT_FALSE(at::equal(twin, want)) << name << ": the check must reject a scale of alpha";
  }
  EXPECT_EQ(targeted, 2 * 7);
  // merge_into rewrites the copy in place after the adapters move: same tensors, new values.
  const at::Tensor q = merged.named_parameters()[0].second;
  Transformer into = m.merged();
  std::vector<const void*> before;
  for (const auto& [name, t] : into.named_parameters()) before.push_back(t.data_ptr());
  {
    at::NoGradGuard no_grad;
    for (auto& [name, t] : m.named_trainable_parameters()) t.mul_(0.5);
  }
  m.merge_into(into);
  const Transformer fresh = m.merged();
  const auto ip = into.named_parameters(), fp = fresh.named_parameters();
  for (size_t k = 0; k < ip.size(); ++k) {
    EXPECT_EQ(ip[k].second.data_ptr(), before[k]) << ip[k].first;
    EXPECT_TRUE(at::equal(ip[k].second, fp[k].second)) << ip[k].first;
  }
  // Without a model of its own the merge would overwrite the base: refused.
  Transformer shared = m;
  EXPECT_THROW(m.merge_into(shared), c10::Error);
}

TEST(Lora, Bf16MergedWeightsAreRoundedOnce) {
  // bf16 base, fp32 adapters of random values: W + s B A in fp32, rounded once to bf16. Summing in bf16
  // (the delta rounded first) moves some elements by an ulp: the check rejects it.
  Transformer m(testing::tiny_llama(50), at::kBFloat16, at::kCPU, 3);
  m.attach_lora(options(4, 8, "gate"), 1);
  randomize_adapters(m, 3, 0.2);
  const Transformer merged = m.merged();
  const auto named = m.named_trainable_parameters();  // layer 0's A, B, then layer 1's
  for (int64_t layer = 0; layer < 2; ++layer) {
    const std::string w = "model.layers." + std::to_string(layer) + ".mlp.gate_proj.weight";
    at::Tensor W, got;
    for (const auto& [name, t] : m.named_parameters()) {
      if (name == w) W = t;
    }
    for (const auto& [name, t] : merged.named_parameters()) {
      if (name == w) got = t;
    }
    const at::Tensor A = named[2 * layer].second, B = named[2 * layer + 1].second;
    ASSERT_EQ(got.scalar_type(), at::kBFloat16);
    const at::Tensor want = merged_reference(W, A, B, 2.0, at::kBFloat16);
    const at::Tensor twice = W + (at::mm(B, A) * 2.0).to(at::kBFloat16);  // rounded, then summed in bf16
    EXPECT_TRUE(at::equal(got, want)) << w;
    EXPECT_FALSE(at::equal(twice, want)) << w << ": the check must reject a sum in bf16";
  }
}

TEST(Lora, MergedModelLogitsEqualTheAdapterModels) {
  // Tiny models of every family at their initialisation (weights of std 0.02), adapters on every target
  // with B non-zero: s B A (~0.04 an element) outweighs the base weights, so the logits (~0.4) are mostly
  // the adapters' doing and the twin (the same adapters scaled by alpha, 4x) moves them by ~0.4.
  for (const std::string family : {"llama", "qwen2", "qwen3", "gemma2"}) {
    SCOPED_TRACE(family);
    Transformer m(model_config_from_json(testing::tiny_family_config(family), family), at::kFloat, at::kCPU, 8);
    Transformer twin_src = m.clone();
    m.attach_lora(options(4, 8), 1);
    randomize_adapters(m, 2, 0.05);
    // The twin: the same adapter values at alpha 32, i.e. scaled by alpha (8 x rank / rank).
    twin_src.attach_lora(options(4, 32), 1);
    {
      at::NoGradGuard no_grad;
      const auto src = m.named_trainable_parameters(), dst = twin_src.named_trainable_parameters();
      for (size_t k = 0; k < src.size(); ++k) dst[k].second.copy_(src[k].second);
    }
    at::NoGradGuard no_grad;
    at::manual_seed(3);
    const at::Tensor ids = at::randint(m.config().vocab_size, {2, 11}, at::kLong);
    const at::Tensor want = m.logits(m.forward(ids, positions(2, 11), at::Tensor()));
    const Transformer merged = m.merged(), twin = twin_src.merged();
    const at::Tensor got = merged.logits(merged.forward(ids, positions(2, 11), at::Tensor()));
    const at::Tensor wrong = twin.logits(twin.forward(ids, positions(2, 11), at::Tensor()));
    RLT_EXPECT_CLOSE_REJECTING(got, wrong, "merged with scale alpha", want, kMergedLogitAtol, 0.0, "merged logits");
  }
}

TEST(Lora, DropoutRunsInTrainingForwardsOnlyAndTheRecomputeReplaysItsMasks) {
  Transformer m = testing::tiny_model("llama", 8, at::kCPU, at::kFloat);
  LoraOptions o = options(4, 8);
  o.dropout = 0.3;
  m.attach_lora(o, 1);
  randomize_adapters(m, 2);
  at::manual_seed(4);
  const at::Tensor ids = at::randint(400, {2, 7}, at::kLong), pos = positions(2, 7);
  at::Tensor plain;
  {
    at::NoGradGuard no_grad;
    plain = m.forward(ids, pos, at::Tensor());
    EXPECT_TRUE(at::equal(m.forward(ids, pos, at::Tensor()), plain)) << "no dropout without grad mode";
  }
  EXPECT_FALSE(at::equal(m.forward(ids, pos, at::Tensor()).detach(), plain)) << "dropout in a training forward";
  // Gradients with and without activation checkpointing, from the same generator state: the recompute
  // must draw the first run's masks. The control starts from another state (other masks) and must differ.
  const at::Tensor R = at::randn({2, 7, m.config().hidden_size});
  auto grads = [&](bool checkpointing, const at::Tensor& rng) {
    m.set_activation_checkpointing(checkpointing);
    m.set_lora_rng_state(rng);
    for (auto& [name, t] : m.named_trainable_parameters()) t.mutable_grad() = at::Tensor();
    (m.forward(ids, pos, at::Tensor()) * R).sum().backward();
    std::vector<at::Tensor> flat;
    for (auto& [name, t] : m.named_trainable_parameters()) flat.push_back(t.grad().view({-1}).clone());
    return at::cat(flat);
  };
  const at::Tensor rng = m.lora_rng_state();
  const at::Tensor stored = grads(false, rng);
  const at::Tensor after_stored = m.lora_rng_state();
  const at::Tensor recomputed = grads(true, rng);
  EXPECT_TRUE(at::equal(m.lora_rng_state(), after_stored))
      << "the recompute puts the generator back where the forward left it";
  const at::Tensor other = grads(false, after_stored);  // other masks
  RLT_EXPECT_CLOSE_REJECTING(recomputed, other, "other dropout masks", stored, 1e-6, 1e-5, "checkpointed gradients");
}

// On a GPU: bf16 base, fp32 adapters, dropout from the model's CUDA generator under activation
// checkpointing (the recompute replays its masks: gradients equal a stored forward's bit for bit, another
// generator state's differ), and the merged copy runs the fused decode kernels the adapter model may not.
TEST(Lora, CudaBf16AdaptersTrainAndTheMergedCopyTakesTheFusedKernels) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  Transformer m = testing::tiny_model("llama", 8, at::kCUDA, at::kBFloat16);
  LoraOptions o = options(4, 8);
  o.dropout = 0.2;
  m.attach_lora(o, 1);
  randomize_adapters(m, 2, 0.05);
  const auto named = m.named_trainable_parameters();
  EXPECT_TRUE(named[0].second.is_cuda());
  EXPECT_EQ(named[0].second.scalar_type(), at::kFloat);
  const at::Tensor ids = at::randint(400, {2, 7}, at::TensorOptions().dtype(at::kLong).device(at::kCUDA));
  const at::Tensor pos = positions(2, 7).cuda();
  const at::Tensor R = at::randn({2, 7, m.config().hidden_size}, at::TensorOptions().device(at::kCUDA));
  auto grads = [&](bool checkpointing, const at::Tensor& rng) {
    m.set_activation_checkpointing(checkpointing);
    m.set_lora_rng_state(rng);
    for (auto& [name, t] : m.named_trainable_parameters()) t.mutable_grad() = at::Tensor();
    (m.forward(ids, pos, at::Tensor()).to(at::kFloat) * R).sum().backward();
    std::vector<at::Tensor> flat;
    for (auto& [name, t] : m.named_trainable_parameters()) flat.push_back(t.grad().view({-1}).clone());
    return at::cat(flat);
  };
  const at::Tensor rng = m.lora_rng_state();
  const at::Tensor stored = grads(false, rng), after = m.lora_rng_state();
  const at::Tensor recomputed = grads(true, rng), other = grads(false, after);
  EXPECT_EQ(stored.scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(recomputed, stored)) << "the recompute draws the first run's masks";
  EXPECT_FALSE(at::equal(other, stored)) << "another generator state draws other masks";
  EXPECT_FALSE(m.fused_kernels_apply());
  const Transformer merged = m.merged();
#ifdef RLT_HAVE_CUDA
  EXPECT_TRUE(merged.fused_kernels_apply());
#endif
}

TEST(Peft, AdapterFolderRoundTripsAndRefusesWhatItCannotRead) {
  const testing::TempDir dir("peft");
  Transformer m(testing::tiny_llama(50), at::kFloat, at::kCPU, 3);
  m.attach_lora(options(4, 8, "v,q,up"), 1);
  randomize_adapters(m, 2);
  save_peft_adapter(m, (dir.path() / "a").string(), "/models/base");
  std::ifstream f(dir.path() / "a" / "adapter_config.json");
  const nlohmann::json cfg = nlohmann::json::parse(f);
  EXPECT_EQ(cfg["peft_type"], "LORA");
  EXPECT_EQ(cfg["r"], 4);
  EXPECT_EQ(cfg["lora_alpha"], 8);
  EXPECT_EQ(cfg["target_modules"], nlohmann::json::array({"q_proj", "v_proj", "up_proj"}));
  EXPECT_EQ(cfg["base_model_name_or_path"], "/models/base");
  const LoraOptions read = read_peft_config((dir.path() / "a").string());
  EXPECT_EQ(read.rank, 4);
  EXPECT_EQ(read.alpha, 8);
  EXPECT_EQ(read.targets, "q,v,up");
  Transformer m2(testing::tiny_llama(50), at::kFloat, at::kCPU, 3);
  m2.attach_lora(options(4, 8, "q,v,up"), 9);
  load_peft_adapter(m2, (dir.path() / "a").string());
  const auto x = m.named_trainable_parameters(), y = m2.named_trainable_parameters();
  for (size_t k = 0; k < x.size(); ++k) EXPECT_TRUE(at::equal(x[k].second, y[k].second)) << x[k].first;
  // Another rank, another alpha: an error naming both.
  Transformer m3(testing::tiny_llama(50), at::kFloat, at::kCPU, 3);
  m3.attach_lora(options(2, 8, "q,v,up"), 9);
  EXPECT_THROW(load_peft_adapter(m3, (dir.path() / "a").string()), ModelConfigError);
  // Options PEFT has and these adapters do not compute are refused by name.
  nlohmann::json dora = cfg;
  dora["use_dora"] = true;
  fs::create_directories(dir.path() / "b");
  std::ofstream(dir.path() / "b" / "adapter_config.json") << dora.dump();
  try {
    read_peft_config((dir.path() / "b").string());
    ADD_FAILURE() << "use_dora accepted";
  } catch (const ModelConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("use_dora"), std::string::npos) << e.what();
  }
}

// transformers + peft on the CPU load our adapter folder onto each reference checkpoint
// (tests/model/make_reference.py) and must give our fp32 logits; check_peft.py also runs the twin (the
// folder with lora_alpha doubled) and requires it to miss.
TEST(Peft, TransformersWithPeftGiveOurLogits) {
  if (std::system((std::string(RLT_PYTHON) + " -c 'import peft' 2>/dev/null").c_str()) != 0) {
    // The GPU host carries no registry and may lack peft; CI installs it (scripts/setup.sh).
    if (at::hasCUDA()) GTEST_SKIP() << "peft not importable on this GPU host";
    FAIL() << "peft not importable: scripts/setup.sh installs it";
  }
  const testing::TempDir dir("peft_parity");
  std::string args;
  for (const std::string c : {"llama_tied", "qwen2", "qwen3", "gemma2"}) {
    const fs::path base = fs::path(RLT_MODEL_REFS) / c, out = dir.path() / c;
    Transformer m = Transformer::load(base.string(), at::kFloat, at::kCPU);
    m.attach_lora(options(4, 8), 3);
    randomize_adapters(m, 5, 0.2);
    save_peft_adapter(m, (out / "adapter").string(), base.string());
    at::NoGradGuard no_grad;
    at::manual_seed(7);
    const at::Tensor ids = at::randint(m.config().vocab_size, {2, 13}, at::kLong);
    const at::Tensor logits = m.logits(m.forward(ids, positions(2, 13), at::Tensor()));
    safetensors::write_file((out / "ours.safetensors").string(), {{"ids", ids}, {"logits", logits}});
    args += " " + base.string() + " " + (out / "adapter").string() + " " + (out / "ours.safetensors").string();
  }
  const std::string cmd = std::string(RLT_PYTHON) + " " + RLT_SOURCE_DIR + "/tests/model/check_peft.py " +
                          std::to_string(kPeftLogitAtol) + args;
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

}  // namespace
}  // namespace rlt
