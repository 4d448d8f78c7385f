// train.advantage (rloo, reinforce_pp, reinforce_pp_baseline), DAPO's overlong shaping
// (reward.overlong_buffer / overlong_penalty) and train.mask_truncated, each against a hand-written
// float64 reference and paired with a wrong twin the same check rejects.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <vector>

#include "data/reward.h"
#include "trainer/batch.h"
#include "trainer/config.h"
#include "trainer/grpo.h"

namespace rlt {
namespace {

constexpr double kExact = 1e-12;

// Rewards of 2 prompts x 3 samples, unequal groups so group and batch statistics differ.
const std::vector<std::vector<double>> kRewards = {{1.0, 0.0, 2.0}, {-1.0, 3.0, 4.0}};

at::Tensor rewards_tensor() {
  std::vector<double> flat;
  for (const auto& g : kRewards) flat.insert(flat.end(), g.begin(), g.end());
  return at::tensor(flat, at::kDouble).view({2, 3});
}

// True when every entry of a (2, 3) tensor is within kExact of want.
bool matches(const at::Tensor& a, const std::vector<std::vector<double>>& want) {
  for (int p = 0; p < 2; ++p) {
    for (int g = 0; g < 3; ++g) {
      if (std::abs(a[p][g].item<double>() - want[p][g]) > kExact) return false;
    }
  }
  return true;
}

// The leave-one-out definition, loop by loop.
std::vector<std::vector<double>> rloo_reference(bool include_self) {
  std::vector<std::vector<double>> out = kRewards;
  for (size_t p = 0; p < kRewards.size(); ++p) {
    const auto& r = kRewards[p];
    for (size_t i = 0; i < r.size(); ++i) {
      double sum = 0;
      int n = 0;
      for (size_t j = 0; j < r.size(); ++j) {
        if (j == i && !include_self) continue;
        sum += r[j];
        ++n;
      }
      out[p][i] = r[i] - sum / n;
    }
  }
  return out;
}

TEST(Advantages, RlooIsLeaveOneOut) {
  // Group 0, sample 0: 1 - (0 + 2) / 2 = 0; sample 2: 2 - (1 + 0) / 2 = 1.5.
  const auto want = rloo_reference(/*include_self=*/false);
  EXPECT_NEAR(want[0][0], 0.0, kExact);
  EXPECT_NEAR(want[0][2], 1.5, kExact);
  const at::Tensor a = estimate_advantages(rewards_tensor(), Advantage::kRloo, ScaleRewards::kGroup);
  EXPECT_TRUE(matches(a, want));
  // Twin: the group mean with the sample itself in it (GRPO's centring, unscaled) is rejected.
  EXPECT_FALSE(matches(a, rloo_reference(/*include_self=*/true)));
  EXPECT_FALSE(matches(group_advantages(rewards_tensor(), ScaleRewards::kNone), want));
}

TEST(Advantages, RlooNeedsTwoSamples) {
  EXPECT_THROW(estimate_advantages(at::ones({2, 1}, at::kDouble), Advantage::kRloo, ScaleRewards::kGroup), c10::Error);
  try {
    load_config(std::vector<std::string>{},
                std::vector<std::string>{"train.advantage=rloo", "sampling.samples_per_prompt=1"});
    FAIL() << "no ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("sampling.samples_per_prompt"), std::string::npos) << e.what();
  }
}

// (x - mean) / unbiased std over the given sets of (p, g) entries of `x`.
std::vector<std::vector<double>> normalise_over(const std::vector<std::vector<double>>& x, bool per_group) {
  std::vector<std::vector<double>> out = x;
  auto norm = [&](const std::vector<std::pair<int, int>>& cells) {
    double mean = 0, var = 0;
    for (auto [p, g] : cells) mean += x[p][g];
    mean /= cells.size();
    for (auto [p, g] : cells) var += (x[p][g] - mean) * (x[p][g] - mean);
    const double sd = std::sqrt(var / (cells.size() - 1));
    for (auto [p, g] : cells) out[p][g] = (x[p][g] - mean) / sd;
  };
  if (per_group) {
    for (int p = 0; p < 2; ++p) norm({{p, 0}, {p, 1}, {p, 2}});
  } else {
    norm({{0, 0}, {0, 1}, {0, 2}, {1, 0}, {1, 1}, {1, 2}});
  }
  return out;
}

TEST(Advantages, ReinforcePpNormalisesOverTheBatch) {
  // Batch of 6: mean 1.5, squared deviations 0.25 + 2.25 + 0.25 + 6.25 + 2.25 + 6.25 = 17.5, std sqrt(3.5).
  const auto want = normalise_over(kRewards, /*per_group=*/false);
  EXPECT_NEAR(want[0][0], -0.5 / std::sqrt(3.5), kExact);
  const at::Tensor a = estimate_advantages(rewards_tensor(), Advantage::kReinforcePp, ScaleRewards::kGroup);
  EXPECT_TRUE(matches(a, want));
  // Twin: normalised within each group.
  EXPECT_FALSE(matches(a, normalise_over(kRewards, /*per_group=*/true)));
}

TEST(Advantages, ReinforcePpBaselineCentresGroupsThenNormalisesOverTheBatch) {
  std::vector<std::vector<double>> centred = kRewards;
  for (auto& g : centred) {
    const double mean = (g[0] + g[1] + g[2]) / 3;
    for (double& x : g) x -= mean;
  }
  const auto want = normalise_over(centred, /*per_group=*/false);
  const at::Tensor a = estimate_advantages(rewards_tensor(), Advantage::kReinforcePpBaseline, ScaleRewards::kGroup);
  EXPECT_TRUE(matches(a, want));
  // Twins: the raw rewards normalised over the batch (no baseline), and the centred ones per group (GRPO).
  EXPECT_FALSE(matches(a, normalise_over(kRewards, /*per_group=*/false)));
  EXPECT_FALSE(matches(a, normalise_over(centred, /*per_group=*/true)));
}

TEST(Advantages, GrpoIsGroupAdvantages) {
  const at::Tensor r = rewards_tensor();
  for (ScaleRewards s : {ScaleRewards::kGroup, ScaleRewards::kBatch, ScaleRewards::kNone}) {
    EXPECT_TRUE(at::equal(estimate_advantages(r, Advantage::kGrpo, s), group_advantages(r, s)));
  }
}

// DAPO's soft overlong punishment, written from its definition.
double overlong_reference(int64_t n, int64_t budget, int64_t L, double P) {
  if (n <= budget - L) return 0.0;
  if (n <= budget) return -P * static_cast<double>(n - (budget - L)) / static_cast<double>(L);
  return -P;
}

TEST(OverlongShaping, PenaltyAroundTheBufferAndTheBudget) {
  RewardOptions o;
  o.overlong_buffer = 4;
  o.overlong_penalty = 0.5;
  const int64_t B = 20, L = 4;
  // Hand values: 16 tokens (B - L) cost nothing; 17 cost 0.5 / 4; 20 (B) cost 0.5; 21 cost 0.5.
  const std::vector<std::pair<int64_t, double>> hand = {{15, 0.0},    {16, 0.0},  {17, -0.125},
                                                        {19, -0.375}, {20, -0.5}, {21, -0.5}};
  for (auto [n, want] : hand) {
    EXPECT_NEAR(overlong_penalty(n, B, o), want, kExact) << n;
    EXPECT_NEAR(overlong_reference(n, B, L, 0.5), want, kExact) << n;
  }
  // L - 1, L and L + 1 tokens from the budget: the ramp's start and its first step.
  for (int64_t n : {B - (L - 1), B - L, B - (L + 1), B - 1, B, B + 1}) {
    EXPECT_NEAR(overlong_penalty(n, B, o), overlong_reference(n, B, L, 0.5), kExact) << n;
  }
  // Twin: the ramp starting one token early (n - (B - L) + 1) misses at B - L and inside the ramp.
  auto off_by_one = [&](int64_t n) {
    if (n < B - L) return 0.0;
    if (n < B) return -0.5 * static_cast<double>(n - (B - L) + 1) / L;
    return -0.5;
  };
  int caught = 0;
  for (int64_t n : {B - (L + 1), B - L, B - (L - 1)})
    caught += std::abs(off_by_one(n) - overlong_penalty(n, B, o)) > kExact;
  EXPECT_GE(caught, 2);
  // Off: no buffer, no penalty, whatever the length.
  o.overlong_buffer = 0;
  EXPECT_EQ(overlong_penalty(1000, B, o), 0.0);
}

TEST(OverlongShaping, BudgetIsTheSmallerOfContextAndTurns) {
  // 100-token prompt, 1024 context: 924 left; 4 turns x 256 = 1024 -> 924. One turn of 256 -> 256.
  EXPECT_EQ(overlong_budget(100, 1024, 4, 256), 924);
  EXPECT_EQ(overlong_budget(100, 1024, 1, 256), 256);
  Config c;
  c.rollout.max_context = 1024;
  c.rollout.max_turns = 4;
  c.rollout.tools = false;  // one turn
  c.sampling.max_new_tokens = 256;
  c.reward.overlong_buffer = 56;
  EXPECT_EQ(overlong_shaping(c, 100, 200), 0.0);
  EXPECT_NEAR(overlong_shaping(c, 100, 228), -0.5, kExact);
  c.rollout.tools = true;  // the context binds: 924
  EXPECT_EQ(overlong_shaping(c, 100, 868), 0.0);
  EXPECT_NEAR(overlong_shaping(c, 100, 896), -0.5, kExact);
}

Trajectory make_traj(std::vector<uint8_t> mask, bool truncated) {
  Trajectory t;
  t.prompt_ids = {1, 2};
  for (size_t i = 0; i < mask.size(); ++i) t.response_ids.push_back(3 + static_cast<int64_t>(i));
  t.loss_mask = mask;
  t.logprobs.assign(mask.size(), -0.5f);
  t.truncated = truncated;
  return t;
}

TEST(MaskTruncated, ZeroesOnlyTruncatedRows) {
  std::vector<Trajectory> trajs = {make_traj({1, 0, 1}, false), make_traj({1, 1, 0, 1}, true),
                                   make_traj({1, 1}, false)};
  const PackedBatch before = pack(trajs, 0, 3, at::kCPU);
  auto check = [&](const std::function<void(std::vector<Trajectory>&)>& masker) {
    std::vector<Trajectory> t = trajs;
    masker(t);
    const PackedBatch b = pack(t, 0, 3, at::kCPU);
    const bool truncated_zero = b.loss_mask[1].sum().item<double>() == 0;
    const bool others_kept =
        at::equal(b.loss_mask[0], before.loss_mask[0]) && at::equal(b.loss_mask[2], before.loss_mask[2]);
    return truncated_zero && others_kept;
  };
  EXPECT_EQ(before.loss_mask.sum().item<double>(), 2 + 3 + 2);
  EXPECT_TRUE(check(mask_truncated));
  // Twin: every row masked.
  EXPECT_FALSE(check([](std::vector<Trajectory>& t) {
    for (auto& x : t) std::fill(x.loss_mask.begin(), x.loss_mask.end(), uint8_t{0});
  }));
  // Nothing done: the truncated row keeps its loss.
  EXPECT_FALSE(check([](std::vector<Trajectory>&) {}));
}

TEST(AdvantageConfig, ReadsTheKey) {
  const Config c = load_config(std::vector<std::string>{}, std::vector<std::string>{"train.advantage=reinforce_pp"});
  EXPECT_EQ(c.train.advantage, Advantage::kReinforcePp);
}

}  // namespace
}  // namespace rlt
