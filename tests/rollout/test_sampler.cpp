// Sampler: top-k / top-p keep exactly the expected sets, draws follow the known (filtered, tempered)
// distribution, noise is a pure function of (seed, stream, counter), log-probs match float64.
#include "rollout/sampler.h"

#include <gtest/gtest.h>

#include <cmath>

namespace rlt {
namespace {

// Probabilities 0.5, 0.2, 0.15, 0.1, 0.05 as logits.
at::Tensor known_logits(int64_t rows) {
  at::Tensor p = at::tensor({0.5, 0.2, 0.15, 0.1, 0.05}, at::kDouble);
  return p.log().to(at::kFloat).view({1, 5}).expand({rows, 5}).contiguous();
}

std::vector<bool> kept(const at::Tensor& filtered_row) {
  std::vector<bool> out;
  for (int64_t v = 0; v < filtered_row.size(0); ++v) out.push_back(std::isfinite(filtered_row[v].item<float>()));
  return out;
}

TEST(Sampler, TopKTopPKeepTheExpectedSets) {
  at::Tensor x = known_logits(1);
  EXPECT_EQ(kept(filter_top_k_top_p(x, 2, 1.0)[0]), (std::vector<bool>{1, 1, 0, 0, 0}));
  EXPECT_EQ(kept(filter_top_k_top_p(x, 0, 1.0)[0]), (std::vector<bool>{1, 1, 1, 1, 1}));
  // top_p 0.75: mass before token 2 is 0.7 < 0.75 (kept); before token 3 it is 0.85 (dropped).
  EXPECT_EQ(kept(filter_top_k_top_p(x, 0, 0.75)[0]), (std::vector<bool>{1, 1, 1, 0, 0}));
  // top_p 0.4: the most likely token always stays, even alone.
  EXPECT_EQ(kept(filter_top_k_top_p(x, 0, 0.4)[0]), (std::vector<bool>{1, 0, 0, 0, 0}));
  // Both: top_k 4 then top_p 0.75 of the original mass.
  EXPECT_EQ(kept(filter_top_k_top_p(x, 4, 0.75)[0]), (std::vector<bool>{1, 1, 1, 0, 0}));
  // Ties at the k-th value are kept; order of the vocabulary does not matter.
  at::Tensor tie = at::tensor({1.0f, 3.0f, 2.0f, 2.0f, 0.0f}).view({1, 5});
  EXPECT_EQ(kept(filter_top_k_top_p(tie, 2, 1.0)[0]), (std::vector<bool>{0, 1, 1, 1, 0}));
  // Kept logits are unchanged.
  at::Tensor f = filter_top_k_top_p(x, 3, 1.0);
  EXPECT_TRUE(at::equal(f.narrow(1, 0, 3), x.narrow(1, 0, 3)));
}

// Draws over many independent streams match the filtered, renormalised, tempered distribution.
void expect_frequencies(double temperature, int64_t top_k, double top_p, const std::vector<double>& expected) {
  const int64_t n = 40000;
  SamplingOptions o;
  o.temperature = temperature;
  o.top_k = top_k;
  o.top_p = top_p;
  o.seed = 7;
  SampleOutput s = sample_tokens(known_logits(n), o, at::arange(n, at::kLong), at::zeros({n}, at::kLong));
  std::vector<double> count(5, 0);
  for (int64_t i = 0; i < n; ++i) count[s.ids[i].item<int64_t>()] += 1;
  for (int v = 0; v < 5; ++v) {
    const double p = expected[v], f = count[v] / n;
    // 5 binomial standard deviations: a false alarm about once in 3.5 million; a wrong filter or
    // temperature moves some frequency by far more (>= 0.03 here, over 10 sigma).
    const double tol = 5 * std::sqrt(p * (1 - p) / n);
    EXPECT_NEAR(f, p, tol) << "token " << v << " T=" << temperature << " k=" << top_k << " p=" << top_p;
    if (p == 0) {
      EXPECT_EQ(count[v], 0) << "a filtered token was sampled";
    }
  }
}

TEST(Sampler, DrawsFollowTheKnownDistribution) {
  expect_frequencies(1.0, 0, 1.0, {0.5, 0.2, 0.15, 0.1, 0.05});
  expect_frequencies(1.0, 3, 1.0, {0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0});
  expect_frequencies(1.0, 0, 0.75, {0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0});
  // Temperature 2: p_i^(1/2) renormalised.
  const double z = std::sqrt(0.5) + std::sqrt(0.2) + std::sqrt(0.15) + std::sqrt(0.1) + std::sqrt(0.05);
  expect_frequencies(
      2.0, 0, 1.0,
      {std::sqrt(0.5) / z, std::sqrt(0.2) / z, std::sqrt(0.15) / z, std::sqrt(0.1) / z, std::sqrt(0.05) / z});
}

TEST(Sampler, NoiseIsAFunctionOfSeedStreamAndCounter) {
  const int64_t V = 1000;
  at::Tensor streams = at::tensor(std::vector<int64_t>{5, 9, 5, 123456789012345}, at::kLong);
  at::Tensor counters = at::tensor(std::vector<int64_t>{0, 0, 1, 77}, at::kLong);
  at::Tensor u = counter_uniforms(3, streams, counters, V, at::kCPU);
  ASSERT_EQ(u.sizes(), (at::IntArrayRef{4, V}));
  EXPECT_GT(u.min().item<float>(), 0.0f);
  EXPECT_LT(u.max().item<float>(), 1.0f);
  EXPECT_NEAR(u.mean().item<float>(), 0.5, 0.02);
  // Row by row, whatever else is in the batch.
  for (int64_t i = 0; i < 4; ++i) {
    at::Tensor alone = counter_uniforms(3, streams.narrow(0, i, 1), counters.narrow(0, i, 1), V, at::kCPU);
    EXPECT_TRUE(at::equal(alone[0], u[i])) << "row " << i;
  }
  EXPECT_FALSE(at::equal(u[0], u[1])) << "streams differ";
  EXPECT_FALSE(at::equal(u[0], u[2])) << "counters differ";
  EXPECT_FALSE(at::equal(u, counter_uniforms(4, streams, counters, V, at::kCPU))) << "seeds differ";
  // Neighbouring rows and columns are uncorrelated (|r| < 0.05 over 1000 pairs: 1.6 sigma of noise is 0.03).
  at::Tensor a = u[0] - 0.5, b = u[1] - 0.5;
  EXPECT_LT(
      std::abs((a * b).sum().item<float>() / std::sqrt((a * a).sum().item<float>() * (b * b).sum().item<float>())),
      0.1);
  at::Tensor c0 = u[3].narrow(0, 0, V - 1) - 0.5, c1 = u[3].narrow(0, 1, V - 1) - 0.5;
  EXPECT_LT(std::abs((c0 * c1).sum().item<float>() / (c0 * c0).sum().item<float>()), 0.1);
}

TEST(Sampler, SameInputsSameTokensAndLogprobsMatchFloat64) {
  at::Tensor logits = at::randn({6, 50}, at::TensorOptions().dtype(at::kFloat)) * 3;
  SamplingOptions o;
  o.temperature = 0.7;
  o.seed = 11;
  at::Tensor streams = at::arange(6, at::kLong), counters = at::full({6}, 3, at::kLong);
  SampleOutput a = sample_tokens(logits, o, streams, counters), b = sample_tokens(logits, o, streams, counters);
  EXPECT_TRUE(at::equal(a.ids, b.ids));
  // One row alone draws what it drew in the batch.
  SampleOutput one = sample_tokens(logits.narrow(0, 4, 1), o, streams.narrow(0, 4, 1), counters.narrow(0, 4, 1));
  EXPECT_EQ(one.ids[0].item<int64_t>(), a.ids[4].item<int64_t>());
  // Log-probs: log softmax(logits / T) in float64 at the drawn ids (float32 result: 1e-5 absolute).
  at::Tensor ref = (logits.to(at::kDouble) / 0.7).log_softmax(-1).gather(1, a.ids.view({6, 1})).view({6});
  EXPECT_LT((a.logprobs.to(at::kDouble) - ref).abs().max().item<double>(), 1e-5);
  // Greedy: argmax, log-probs at temperature 1.
  o.temperature = 0;
  SampleOutput g = sample_tokens(logits, o, streams, counters);
  EXPECT_TRUE(at::equal(g.ids, logits.argmax(-1)));
  at::Tensor ref1 = logits.to(at::kDouble).log_softmax(-1).gather(1, g.ids.view({6, 1})).view({6});
  EXPECT_LT((g.logprobs.to(at::kDouble) - ref1).abs().max().item<double>(), 1e-5);
}

TEST(Sampler, VocabLimitIsNeverSampled) {
  // The largest logits sit past the tokenizer's vocabulary (a checkpoint whose embedding is larger).
  at::Tensor logits = at::zeros({200, 10});
  logits.narrow(1, 6, 4).fill_(20);
  SamplingOptions o;
  SampleOutput s = sample_tokens(logits, o, at::arange(200, at::kLong), at::zeros({200}, at::kLong), 6);
  EXPECT_LT(s.ids.max().item<int64_t>(), 6);
  o.temperature = 0;
  EXPECT_LT(
      sample_tokens(logits, o, at::arange(200, at::kLong), at::zeros({200}, at::kLong), 6).ids.max().item<int64_t>(),
      6);
  // A Qwen-sized embedding (151936) behind a small trained tokenizer, as grpo_train builds it.
  at::Tensor big = at::randn({64, 151936});
  big.narrow(1, 368, 151936 - 368).add_(1.0);
  o.temperature = 1.0;
  // Among these 64 x 151936 draws one has k = 2^24 - 1, which float32 rounds to a uniform of exactly 1.
  at::Tensor u = counter_uniforms(o.seed, at::arange(64, at::kLong), at::zeros({64}, at::kLong), 151936, at::kCPU);
  EXPECT_LT(u.max().item<float>(), 1.0f);
  EXPECT_GT(u.min().item<float>(), 0.0f);
  s = sample_tokens(big, o, at::arange(64, at::kLong), at::zeros({64}, at::kLong), 368);
  EXPECT_LT(s.ids.max().item<int64_t>(), 368);
  EXPECT_TRUE(s.logprobs.isfinite().all().item<bool>());
}

// The fused CUDA draw (rollout/cuda/sample_kernels.cu) against the ATen form on the same device, bit for
// bit: odd shapes, a temperature, a strided view (a vocabulary limit), filtered rows, more rows than a
// grid's y-dimension holds, and the 64 x 151936 draw that holds the one uniform float32 rounds to 1.
TEST(SamplerCuda, FusedDrawIsTheAtenDrawBitForBit) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const auto cuda = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  auto check = [&](const at::Tensor& x, double T, int64_t seed, const char* what) {
    const int64_t N = x.size(0);
    at::Tensor streams = at::arange(N, at::kLong) * 7 + 3, counters = at::arange(N, at::kLong) % 5;
    at::Tensor fused = gumbel_argmax(x, T, seed, streams, counters, /*fused=*/true).cpu();
    at::Tensor ref = gumbel_argmax(x, T, seed, streams, counters, /*fused=*/false).cpu();
    EXPECT_TRUE(at::equal(fused, ref)) << what << ": " << (fused != ref).sum().item<int64_t>() << " of " << N
                                       << " rows drew another token";
    return std::make_pair(fused, ref);
  };
  at::manual_seed(5);
  at::Tensor x = at::randn({37, 1013}, cuda) * 3;
  auto [fused, ref] = check(x, 0.7, 11, "37 x 1013, T 0.7");
  // The comparison has teeth: the draw with another counter, or without the temperature, differs.
  at::Tensor streams = at::arange(37, at::kLong) * 7 + 3, counters = at::arange(37, at::kLong) % 5;
  const int64_t moved_counter = (gumbel_argmax(x, 0.7, 11, streams, counters + 1).cpu() != ref).sum().item<int64_t>();
  const int64_t moved_temp = (gumbel_argmax(x, 1.0, 11, streams, counters).cpu() != ref).sum().item<int64_t>();
  EXPECT_GT(moved_counter, 20) << "a draw with the next counter must differ in most rows";
  EXPECT_GT(moved_temp, 2) << "a draw without the temperature must differ in some rows";
  // The draw depends on the logits: the argmax of the noise alone is another token in most rows.
  EXPECT_GT((gumbel_argmax(at::zeros_like(x), 0.7, 11, streams, counters).cpu() != ref).sum().item<int64_t>(), 20);
  at::Tensor wide = at::randn({9, 4099}, cuda);
  check(wide.narrow(1, 0, 3001), 1.3, 2, "a strided view (vocabulary limit)");
  check(filter_top_k_top_p(x / 0.7, 5, 0.9), 1.0, 4, "top-k 5, top-p 0.9");
  check(at::randn({70000, 5}, cuda), 1.0, 9, "70000 rows");
  at::Tensor big = at::randn({64, 151936}, cuda);
  auto [f_big, r_big] = check(big, 1.0, 0, "64 x 151936");
  // Those rows with temperature 1 on the CPU: the same draws (x / 1 is exact on either device).
  at::Tensor cpu = gumbel_argmax(big.cpu(), 1.0, 0, at::arange(64, at::kLong) * 7 + 3, at::arange(64, at::kLong) % 5);
  EXPECT_TRUE(at::equal(f_big, cpu));
}

}  // namespace
}  // namespace rlt
