// DAPO's dynamic sampling (trainer/dynamic_sampling.h) on hand-made rounds, no model: which groups are
// kept, the round bound and its one warning, the equal-reward tolerance, surplus groups dropped, a step with
// no group kept, two thread ranks against one process, and the config keys refused where they mean nothing.
// Each check runs beside a wrong implementation that must fail it.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "tests/trainer/thread_ranks.h"
#include "trainer/config.h"
#include "trainer/dynamic_sampling.h"
#include "trainer/grpo.h"

namespace rlt {
namespace {

using Rewards = std::vector<std::vector<double>>;  // (P, G) one round's rewards

// One round as collect_rollouts makes it on `dist`'s rank: this rank's prompts (rank_prompts), their G
// trajectories, and the whole (P * G) table gathered over the ranks. Every field says where it came from
// (round r, prompt p, sample g), so a selected or sent trajectory can be traced. gather = false: the
// table holds this rank's rows only (a wrong implementation: decisions from local rewards).
RolloutBatch fake_round(int64_t r, const Rewards& rewards, int64_t prompts_per_mini, Collectives& dist,
                        bool gather = true) {
  const int64_t P = static_cast<int64_t>(rewards.size()), G = static_cast<int64_t>(rewards[0].size());
  std::vector<int64_t> mine(P);
  std::iota(mine.begin(), mine.end(), 0);
  if (dist.world() > 1) mine = rank_prompts(P, prompts_per_mini, dist.world(), dist.rank());
  RolloutBatch b;
  for (int64_t p : mine) {
    PromptExample ex;
    ex.prompt = "round " + std::to_string(r) + " prompt " + std::to_string(p);
    ex.answer = std::to_string(p);
    ex.source = "fake:" + std::to_string(r * 100 + p);
    ex.messages = {{"user", ex.prompt}};
    const int64_t local = static_cast<int64_t>(b.examples.size());
    b.examples.push_back(ex);
    for (int64_t g = 0; g < G; ++g) {
      Trajectory t;
      t.prompt_index = local;
      t.sample_index = g;
      t.prompt_ids = {1, 100 + r, 200 + p};
      t.response_ids = {300 + g, 7, 8, 9};
      t.loss_mask = {1, 1, 0, 1};
      t.logprobs = {-0.5f * static_cast<float>(g + 1), -0.25f, 0.f, -1.5f};
      t.finish = g % 2 ? FinishReason::kEos : FinishReason::kAnswer;
      t.truncated = g == 1;
      t.turns = 1 + g;
      t.tool_calls = p;
      t.feedback_turns = r;
      t.tool_timeouts = g;
      t.response_text = "r" + std::to_string(r) + "p" + std::to_string(p) + "g" + std::to_string(g);
      t.reward = rewards[p][g];
      t.correct = rewards[p][g] >= 1;
      t.overlong_penalty = -0.125 * g;
      t.weights_version = 40 + r;
      t.versions = {40 + r, 40 + r, 41 + r, 41 + r};
      b.trajs.push_back(t);
      b.index.push_back(p * G + g);
    }
  }
  b.table = gather_table(gather ? dist : *single_process(), b.trajs, b.index, P * G);
  b.seconds = 1.5;
  b.stats.decode_steps = 10;
  b.stats.decode_s = 0.25;
  return b;
}

Config ds_config(int64_t P, int64_t G, int64_t max_rounds, int64_t mini_batch_size = 0) {
  Config c = load_config("", {});
  c.train.dynamic_sampling = true;
  c.train.prompts_per_step = P;
  c.sampling.samples_per_prompt = G;
  c.train.max_sampling_rounds = max_rounds;
  c.train.mini_batch_size = mini_batch_size;
  return c;
}

// A step over `rounds` (one process unless `dist`): the batch, and how many rounds it drew.
struct Step {
  RolloutBatch batch;
  int64_t drawn = 0;
};
Step run_step(DynamicSampling& ds, const std::vector<Rewards>& rounds, const GroupFilter& filter,
              Collectives* dist = nullptr, int64_t prompts_per_mini = 1, bool gather = true) {
  std::shared_ptr<Collectives> one = single_process();
  Collectives& d = dist ? *dist : *one;
  Step s;
  s.batch = ds.collect(
      [&] {
        // Past the test's rounds (a wrong implementation may ask): the last again; `drawn` tells.
        const int64_t r = std::min<int64_t>(s.drawn++, static_cast<int64_t>(rounds.size()) - 1);
        return fake_round(r, rounds[r], prompts_per_mini, d, gather);
      },
      d, filter);
  return s;
}

// Which (round, prompt) a slot's trajectories came from, read back from their prompt ids.
std::pair<int64_t, int64_t> origin(const Trajectory& t) { return {t.prompt_ids[1] - 100, t.prompt_ids[2] - 200}; }

// A filter that keeps every group, equal rewards included (the wrong implementation of the checks below).
std::vector<bool> keep_all(const at::Tensor& table, int64_t G) {
  return std::vector<bool>(static_cast<size_t>(table.size(0) / G), true);
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += x + "\n";
  return s;
}

// P = 2 prompts x G = 3 samples, up to 3 rounds:
//   round 0: p0 (1, 1, 1) all equal -> dropped;  p1 (0, 0, 1) one differs -> kept
//   round 1: p0 (0, 1, 1) kept;                  p1 (1, 0, 0) kept, but the step has its 2: surplus
// so 2 rounds (not 3), slots [round 0 p1, round 1 p0]. grpo advantages (group std, unbiased) of
// (0, 0, 1): mean 1/3, centred (-1/3, -1/3, 2/3), std sqrt((1/9 + 1/9 + 4/9) / 2) = 1/sqrt(3), so
// A = (-1, -1, 2) / sqrt(3); of (0, 1, 1): (-2, 1, 1) / sqrt(3). Correct (reward >= 1): 3 + 1 in round 0,
// 2 + 1 in round 1: sampled_accuracy 7/12.
std::vector<std::string> kept_and_dropped_problems(const GroupFilter& filter) {
  const std::vector<Rewards> rounds = {{{1, 1, 1}, {0, 0, 1}}, {{0, 1, 1}, {1, 0, 0}}, {{0, 1, 0}, {1, 1, 0}}};
  DynamicSampling ds(ds_config(/*P=*/2, /*G=*/3, /*max_rounds=*/3));
  const Step s = run_step(ds, rounds, filter);
  std::vector<std::string> problems;
  const SamplingRounds m = ds.last();
  if (s.drawn != 2 || m.rounds != 2) problems.push_back("rounds: drew " + std::to_string(s.drawn) + ", want 2");
  if (m.prompts_sampled != 4) problems.push_back("prompts_sampled " + std::to_string(m.prompts_sampled));
  if (m.groups_filtered != 1) problems.push_back("groups_filtered " + std::to_string(m.groups_filtered));
  if (m.groups_kept != 2) problems.push_back("groups_kept " + std::to_string(m.groups_kept));
  if (m.groups_surplus != 1) problems.push_back("groups_surplus " + std::to_string(m.groups_surplus));
  if (m.sampled_accuracy != 7.0 / 12) problems.push_back("sampled_accuracy " + std::to_string(m.sampled_accuracy));
  if (s.batch.trajs.size() != 6) return problems.push_back("not 6 trajectories"), problems;
  const std::pair<int64_t, int64_t> want[2] = {{0, 1}, {1, 0}};
  for (int64_t q = 0; q < 2; ++q) {
    for (int64_t g = 0; g < 3; ++g) {
      const Trajectory& t = s.batch.trajs[q * 3 + g];
      if (origin(t) != want[q]) problems.push_back("slot " + std::to_string(q) + " holds another group");
      if (t.prompt_index != q || t.sample_index != g || s.batch.index[q * 3 + g] != q * 3 + g) {
        problems.push_back("slot " + std::to_string(q) + ": prompt_index / index out of place");
      }
      if (t.sampled_tokens() != 3) problems.push_back("a kept group's loss mask was changed");
    }
    if (s.batch.examples[q].source != "fake:" + std::to_string(want[q].first * 100 + want[q].second)) {
      problems.push_back("slot " + std::to_string(q) + ": another example");
    }
  }
  const at::Tensor advantages = estimate_advantages(s.batch.table.select(1, kReward).view({2, 3}), Advantage::kGrpo,
                                                    ScaleRewards::kGroup);  // (2, 3)
  const double r3 = std::sqrt(3.0);
  const at::Tensor expected = at::tensor({-1 / r3, -1 / r3, 2 / r3, -2 / r3, 1 / r3, 1 / r3}, at::kDouble).view({2, 3});
  // Float64 rounding of a mean, a std and a division: a few ulps of O(1) values.
  if (!at::allclose(advantages, expected, /*rtol=*/0, /*atol=*/1e-14)) problems.push_back("advantages differ");
  if (s.batch.seconds != 3.0 || s.batch.stats.decode_steps != 20) problems.push_back("times not summed over rounds");
  return problems;
}

TEST(DynamicSampling, KeepsAGroupWithOneDifferentRewardAndDropsAnAllEqualOne) {
  EXPECT_EQ(join(kept_and_dropped_problems(varied_groups)), "");
  EXPECT_NE(join(kept_and_dropped_problems(keep_all)), "") << "a filter that keeps all-equal groups must fail";
}

// Surplus groups are not carried over: the next step starts from its own first round.
TEST(DynamicSampling, SurplusGroupsAreNotCarriedIntoTheNextStep) {
  DynamicSampling ds(ds_config(2, 3, 3));
  run_step(ds, {{{1, 1, 1}, {0, 0, 1}}, {{0, 1, 1}, {1, 0, 0}}}, varied_groups);  // round 1's p1 is surplus
  const Step next = run_step(ds, {{{0, 1, 0}, {1, 1, 0}}}, varied_groups);
  ASSERT_EQ(next.batch.trajs.size(), 6u);
  EXPECT_EQ(origin(next.batch.trajs[0]), (std::pair<int64_t, int64_t>{0, 0}));
  EXPECT_EQ(origin(next.batch.trajs[3]), (std::pair<int64_t, int64_t>{0, 1}));
  EXPECT_EQ(ds.last().rounds, 1);
  EXPECT_EQ(ds.last().groups_surplus, 0);
}

// P = 2, G = 2, at most 2 rounds: round 0 (1, 1), (0, 0); round 1 (0, 1), (1, 1). One group kept of 2:
// the bound stops the step after 2 rounds, a warning once, and the kept group at slot floor(0 * 2 / 1) = 0,
// the first dropped group (round 0 p0) in slot 1 with its loss mask zeroed. A second such step warns no more.
std::vector<std::string> round_bound_problems(const GroupFilter& filter) {
  const std::vector<Rewards> rounds = {{{1, 1}, {0, 0}}, {{0, 1}, {1, 1}}};
  DynamicSampling ds(ds_config(2, 2, /*max_rounds=*/2));
  std::vector<std::string> problems;
  ::testing::internal::CaptureStderr();
  const Step s = run_step(ds, rounds, filter);
  const std::string first = ::testing::internal::GetCapturedStderr();
  ::testing::internal::CaptureStderr();
  run_step(ds, rounds, filter);
  const std::string second = ::testing::internal::GetCapturedStderr();
  const SamplingRounds m = ds.last();
  if (s.drawn != 2) problems.push_back("drew " + std::to_string(s.drawn) + " rounds, the bound is 2");
  if (m.groups_kept != 1 || m.groups_filtered != 3 || m.groups_surplus != 0 || m.prompts_sampled != 4) {
    problems.push_back("kept / filtered / surplus / sampled: " + std::to_string(m.groups_kept) + " " +
                       std::to_string(m.groups_filtered) + " " + std::to_string(m.groups_surplus) + " " +
                       std::to_string(m.prompts_sampled));
  }
  if (first.find("kept 1 of 2 groups") == std::string::npos) problems.push_back("no warning: " + first);
  if (!second.empty()) problems.push_back("warned twice: " + second);
  if (s.batch.trajs.size() != 4) return problems.push_back("not 4 trajectories"), problems;
  if (origin(s.batch.trajs[0]) != std::pair<int64_t, int64_t>{1, 0} || s.batch.trajs[0].sampled_tokens() != 3) {
    problems.push_back("slot 0 is not the kept group, whole");
  }
  if (origin(s.batch.trajs[2]) != std::pair<int64_t, int64_t>{0, 0} || s.batch.trajs[2].sampled_tokens() != 0 ||
      s.batch.trajs[3].sampled_tokens() != 0) {
    problems.push_back("slot 1 is not the first dropped group, masked");
  }
  if (ds.iterations(2) != 2 || ds.metrics().at("update_skipped") != 0) problems.push_back("the update is skipped");
  return problems;
}

TEST(DynamicSampling, TheRoundBoundStopsTheStepAndWarnsOnce) {
  EXPECT_EQ(join(round_bound_problems(varied_groups)), "");
  EXPECT_NE(join(round_bound_problems(keep_all)), "") << "a filter that keeps all-equal groups must fail";
}

// No group kept: the slots hold the dropped groups in draw order, all masked, the advantages are finite
// (0: every group equal), and the update is skipped.
TEST(DynamicSampling, AStepWithNoGroupKeptSkipsItsUpdate) {
  DynamicSampling ds(ds_config(2, 2, 2));
  ::testing::internal::CaptureStderr();
  const Step s = run_step(ds, {{{1, 1}, {0, 0}}, {{0.5, 0.5}, {1, 1}}}, varied_groups);
  EXPECT_NE(::testing::internal::GetCapturedStderr().find("kept 0 of 2"), std::string::npos);
  EXPECT_EQ(ds.last().groups_kept, 0);
  EXPECT_EQ(ds.last().groups_filtered, 4);
  EXPECT_EQ(ds.iterations(3), 0);
  EXPECT_EQ(ds.metrics().at("update_skipped"), 1);
  for (const Trajectory& t : s.batch.trajs) EXPECT_EQ(t.sampled_tokens(), 0);
  EXPECT_EQ(origin(s.batch.trajs[0]), (std::pair<int64_t, int64_t>{0, 0}));
  EXPECT_EQ(origin(s.batch.trajs[2]), (std::pair<int64_t, int64_t>{0, 1}));
  const at::Tensor a =
      estimate_advantages(s.batch.table.select(1, kReward).view({2, 2}), Advantage::kGrpo, ScaleRewards::kGroup);
  EXPECT_TRUE(at::equal(a, at::zeros({2, 2}, at::kDouble)));
  DynamicSampling off(load_config("", {}));
  EXPECT_EQ(off.iterations(3), 3);
  EXPECT_TRUE(off.metrics().empty());
}

// train.async one_step collects step t + 1's batch while step t trains: step t's passes and metrics must be
// its own batch's, not those of the batch collected last. Step t keeps no group, step t + 1 both of its.
TEST(DynamicSampling, FiguresWaitForTheirStepWhileTheNextBatchIsCollected) {
  DynamicSampling ds(ds_config(2, 2, 1));
  ::testing::internal::CaptureStderr();
  run_step(ds, {{{1, 1}, {0, 0}}}, varied_groups);  // step t
  run_step(ds, {{{0, 1}, {1, 0}}}, varied_groups);  // step t + 1, collected ahead
  ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(ds.last().groups_kept, 2) << "the batch collected last";
  EXPECT_EQ(ds.iterations(3), 0) << "step t kept no group";
  const auto t = ds.metrics();
  EXPECT_EQ(t.at("groups_kept"), 0);
  EXPECT_EQ(t.at("update_skipped"), 1);
  EXPECT_EQ(ds.iterations(3), 3);
  EXPECT_EQ(ds.metrics().at("groups_kept"), 2);
  EXPECT_TRUE(ds.metrics().empty()) << "every batch reported";
}

// The tolerance: a spread of 5e-10 is rounding (dropped), 2e-9 is signal (kept), and 0.1 + 0.2 against 0.3
// (5.6e-17 apart) is one reward summed two ways (dropped). The wrong implementation, exact equality, keeps
// the two rounding groups.
std::vector<bool> exact_equality(const at::Tensor& table, int64_t G) {
  const at::Tensor r = table.select(1, kReward).contiguous().view({-1, G});
  const at::Tensor differ = (std::get<0>(r.max(1)) != std::get<0>(r.min(1)));
  std::vector<bool> out;
  for (int64_t p = 0; p < differ.size(0); ++p) out.push_back(differ[p].item<bool>());
  return out;
}

TEST(DynamicSampling, RewardsWithinTheToleranceAreEqual) {
  auto decide = [](const GroupFilter& f) {
    const Rewards rewards = {{0.3, 0.3, 0.3 + 5e-10}, {0.3, 0.3 + 2e-9, 0.3}, {0.1 + 0.2, 0.3, 0.3}};
    auto one = single_process();
    return f(fake_round(0, rewards, 1, *one).table, 3);
  };
  EXPECT_EQ(decide(varied_groups), (std::vector<bool>{false, true, false}));
  EXPECT_NE(decide(exact_equality), (std::vector<bool>{false, true, false})) << "exact equality must fail";
}

// Two thread ranks against one process: P = 4 prompts in mini-batches of 2 (rank 0 samples prompts 0 and 2
// of every round, rank 1 prompts 1 and 3). Step A: round 0 keeps p1 and p3, round 1 p0, p2 and p3 (one
// surplus); slots [r0 p1, r0 p3, r1 p0, r1 p2], so slot 0 (rank 0's) comes from rank 1 and slot 3 (rank 1's)
// from rank 0. Step B: one round, p1 and p3 kept, at slots 0 and 2, equal groups masked at 1 and 3. Every
// rank's trajectories, examples, places and table must be the one process's, field by field. The wrong
// implementation decides from a rank's own rows (the table not gathered).
std::vector<std::string> two_rank_problems(bool gather) {
  const std::vector<std::vector<Rewards>> steps = {
      {{{1, 1}, {0, 1}, {0, 0}, {1, 0}}, {{0, 1}, {1, 1}, {1, 0}, {0, 1}}},
      {{{1, 1}, {1, 0}, {0, 0}, {0, 1}}},
  };
  const int64_t max_rounds[2] = {3, 1};
  std::vector<std::string> problems;
  for (size_t k = 0; k < steps.size(); ++k) {
    const Config c = ds_config(4, 2, max_rounds[k], /*mini_batch_size=*/4);  // 2 prompts a mini-batch
    DynamicSampling single(c);
    ::testing::internal::CaptureStderr();
    const RolloutBatch want = run_step(single, steps[k], varied_groups).batch;
    std::vector<RolloutBatch> got(2);
    std::vector<SamplingRounds> figures(2);
    try {
      rlt::testing::on_thread_ranks(
          2,
          [&](int r, std::shared_ptr<Collectives> dist) {
            DynamicSampling ds(c);
            got[r] = run_step(ds, steps[k], varied_groups, dist.get(), /*prompts_per_mini=*/2, gather).batch;
            figures[r] = ds.last();
          },
          std::chrono::seconds(20));
    } catch (const std::exception& e) {
      problems.push_back(std::string("a rank failed: ") + e.what());
    }
    ::testing::internal::GetCapturedStderr();
    const std::string step = "step " + std::to_string(k) + ": ";
    for (int r = 0; r < 2; ++r) {
      const RolloutBatch& b = got[r];
      const std::string rank = step + "rank " + std::to_string(r) + ": ";
      if (figures[r].groups_kept != single.last().groups_kept || figures[r].rounds != single.last().rounds) {
        problems.push_back(rank + "other figures");
      }
      if (!b.table.defined() || !at::equal(b.table, want.table)) problems.push_back(rank + "another table");
      if (b.trajs.size() != 4 || b.index.size() != 4 || b.examples.size() != 2) {
        problems.push_back(rank + "not 2 groups");
        continue;
      }
      for (size_t i = 0; i < b.trajs.size(); ++i) {
        const Trajectory& t = b.trajs[i];
        const Trajectory& w = want.trajs[b.index[i]];
        const bool same = t.prompt_ids == w.prompt_ids && t.response_ids == w.response_ids &&
                          t.loss_mask == w.loss_mask && t.logprobs == w.logprobs && t.finish == w.finish &&
                          t.truncated == w.truncated && t.turns == w.turns && t.tool_calls == w.tool_calls &&
                          t.feedback_turns == w.feedback_turns && t.tool_timeouts == w.tool_timeouts &&
                          t.response_text == w.response_text && t.reward == w.reward && t.correct == w.correct &&
                          t.overlong_penalty == w.overlong_penalty && t.weights_version == w.weights_version &&
                          t.versions == w.versions && t.sample_index == w.sample_index &&
                          t.prompt_index == static_cast<int64_t>(i) / 2;
        if (!same) problems.push_back(rank + "trajectory " + std::to_string(i) + " differs");
        const PromptExample& e = b.examples[i / 2];
        const PromptExample& we = want.examples[b.index[i] / 2];
        if (e.prompt != we.prompt || e.answer != we.answer || e.source != we.source ||
            e.messages.size() != we.messages.size() || e.messages[0].content != we.messages[0].content) {
          problems.push_back(rank + "example " + std::to_string(i / 2) + " differs");
        }
      }
      const std::vector<int64_t> slots = rank_prompts(4, 2, 2, r);
      for (size_t j = 0; j < slots.size(); ++j) {
        if (b.index[2 * j] != slots[j] * 2) problems.push_back(rank + "slots out of rank_prompts' place");
      }
    }
  }
  return problems;
}

TEST(DynamicSampling, TwoRanksKeepAndTrainWhatOneProcessDoes) {
  EXPECT_EQ(join(two_rank_problems(/*gather=*/true)), "");
  EXPECT_NE(join(two_rank_problems(/*gather=*/false)), "") << "decisions from a rank's own rows must fail";
}

TEST(DynamicSampling, RefusedWhereItMeansNothing) {
  auto error_of = [](const std::vector<std::string>& sets) {
    try {
      load_config("", sets);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error_of({"train.dynamic_sampling=true", "sampling.samples_per_prompt=1"}).find("train.dynamic_sampling"),
            std::string::npos);
  EXPECT_NE(error_of({"train.dynamic_sampling=true", "train.max_sampling_rounds=0"}).find("train.max_sampling_rounds"),
            std::string::npos);
  EXPECT_EQ(error_of({"train.dynamic_sampling=true", "sampling.samples_per_prompt=2"}), "");
}

}  // namespace
}  // namespace rlt
