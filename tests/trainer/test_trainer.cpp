// The GRPO and PPO trainers: group advantages, the learning-rate schedules, GAE against an independent
// reference, micro-batch accounting, the non-finite-step guard, and end-to-end runs of both algorithms on
// a tiny model with real sandboxed tool calls: metrics, checkpoints, a resumed run that reproduces the
// uninterrupted run's losses exactly, and train.old_logprobs (the rollout's log-probs against recomputed
// ones, and the switch to recompute above the tolerance).
#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <set>

#include "common/files.h"
#include "common/memory.h"
#include "model/flops.h"
#include "parallel/parking.h"
#include "tests/common/tmpdir.h"
#include "tests/trainer/thread_ranks.h"
#include "tests/trainer/tiny_run.h"
#include "trainer/checkpoint.h"
#include "trainer/config.h"
#include "trainer/critic.h"
#include "trainer/grpo.h"
#include "trainer/memory_plan.h"
#include "trainer/metrics.h"
#include "trainer/optim.h"
#include "trainer/ppo.h"
#include "trainer/run.h"
#include "trainer/warmup.h"

namespace rlt {
namespace {

using rlt::testing::read_metrics;
using rlt::testing::TempDir;
using rlt::testing::tiny_config;

// Advantages are exact arithmetic on small numbers; float64 leaves only rounding.
constexpr double kExact = 1e-12;

TEST(GroupAdvantages, GroupBatchAndNoneScaling) {
  // Group 0: rewards (1, -1, 1, -1): mean 0, unbiased std sqrt(4/3) -> A = +-sqrt(3/4).
  // Group 1: all 0.5 -> centred 0, std 0 -> divided by 1 -> A = 0 (zero advantage, zero gradient).
  at::Tensor r = at::tensor({1.0, -1.0, 1.0, -1.0, 0.5, 0.5, 0.5, 0.5}, at::kDouble).view({2, 4});
  at::Tensor g = group_advantages(r, ScaleRewards::kGroup);
  const double a = std::sqrt(0.75);
  const std::vector<double> want_g = {a, -a, a, -a, 0, 0, 0, 0};
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(g.view({-1})[i].item<double>(), want_g[i], kExact) << i;
  // none: only centred.
  at::Tensor n = group_advantages(r, ScaleRewards::kNone);
  const std::vector<double> want_n = {1, -1, 1, -1, 0, 0, 0, 0};
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(n.view({-1})[i].item<double>(), want_n[i], kExact) << i;
  // batch: centred per group, divided by the std of all 8 rewards (mean 0.25).
  double var = 0;
  for (double x : {1.0, -1.0, 1.0, -1.0, 0.5, 0.5, 0.5, 0.5}) var += (x - 0.25) * (x - 0.25);
  const double sd = std::sqrt(var / 7);
  at::Tensor b = group_advantages(r, ScaleRewards::kBatch);
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(b.view({-1})[i].item<double>(), want_n[i] / sd, kExact) << i;
}

TEST(LearningRate, WarmupConstantLinearCosine) {
  TrainOptions o;
  o.lr = 1.0;
  o.warmup_steps = 3;
  o.min_lr_ratio = 0.1;
  // Warm-up: (step + 1) / (warmup + 1) -> 0.25, 0.5, 0.75, then the schedule over the 8 remaining steps.
  o.lr_schedule = LrSchedule::kConstant;
  EXPECT_DOUBLE_EQ(learning_rate(o, 0, 11), 0.25);
  EXPECT_DOUBLE_EQ(learning_rate(o, 2, 11), 0.75);
  EXPECT_DOUBLE_EQ(learning_rate(o, 3, 11), 1.0);
  o.lr_schedule = LrSchedule::kLinear;  // 0.1 + 0.9 (1 - progress), progress = (step - 3) / 8
  EXPECT_DOUBLE_EQ(learning_rate(o, 3, 11), 1.0);
  EXPECT_NEAR(learning_rate(o, 7, 11), 0.1 + 0.9 * 0.5, kExact);
  EXPECT_NEAR(learning_rate(o, 11, 11), 0.1, kExact);
  o.lr_schedule = LrSchedule::kCosine;  // 0.1 + 0.9 * 0.5 (1 + cos(pi progress))
  EXPECT_NEAR(learning_rate(o, 7, 11), 0.1 + 0.45, kExact);
  EXPECT_NEAR(learning_rate(o, 5, 11), 0.1 + 0.45 * (1 + std::cos(M_PI * 0.25)), kExact);
  EXPECT_NEAR(learning_rate(o, 11, 11), 0.1, kExact);
}

// The textbook GAE of a sequence whose every token is an action: A_t = sum_l (gamma lambda)^l delta_{t+l}.
std::vector<double> gae_reference(const std::vector<double>& r, const std::vector<double>& v, double gamma,
                                  double lam) {
  const size_t n = r.size();
  std::vector<double> delta(n), adv(n, 0.0);
  for (size_t t = 0; t < n; ++t) delta[t] = r[t] + gamma * (t + 1 < n ? v[t + 1] : 0.0) - v[t];
  for (size_t t = 0; t < n; ++t) {
    double w = 1;
    for (size_t l = t; l < n; ++l, w *= gamma * lam) adv[t] += w * delta[l];
  }
  return adv;
}

TEST(Gae, MatchesTheClosedFormAndSkipsToolTokens) {
  const double gamma = 0.9, lam = 0.8;
  // Hand-derived one-token case: delta = r - V = 1 - 0.25 -> A = 0.75, return = 1.
  {
    auto [a, g] =
        gae_advantages(at::tensor({1.0f}).view({1, 1}), at::tensor({0.25f}).view({1, 1}), at::ones({1, 1}), gamma, lam);
    EXPECT_NEAR(a.item<double>(), 0.75, 1e-7);
    EXPECT_NEAR(g.item<double>(), 1.0, 1e-7);
  }
  // A sequence of 7 actions with tool tokens interleaved (mask 0) must equal the same 7 actions alone.
  const std::vector<double> r_act = {0, 0.5, 0, 0, -0.25, 0, 1}, v_act = {0.1, -0.3, 0.7, 0.2, 0.0, -0.6, 0.4};
  const std::vector<int> mask = {1, 1, 0, 0, 1, 1, 0, 1, 1, 0, 1, 0};  // 7 ones, then padding
  const int64_t R = static_cast<int64_t>(mask.size());
  at::Tensor rw = at::zeros({1, R}), vl = at::full({1, R}, 9.0f), mk = at::zeros({1, R});  // 9: ignored values
  for (int64_t j = 0, a = 0; j < R; ++j) {
    if (!mask[j]) continue;
    rw[0][j] = r_act[a];
    vl[0][j] = v_act[a];
    mk[0][j] = 1;
    ++a;
  }
  auto [adv, ret] = gae_advantages(rw, vl, mk, gamma, lam);
  const std::vector<double> want = gae_reference(r_act, v_act, gamma, lam);
  for (int64_t j = 0, a = 0; j < R; ++j) {
    if (!mask[j]) {
      EXPECT_EQ(adv[0][j].item<float>(), 0.0f) << "non-action token " << j;
      EXPECT_EQ(ret[0][j].item<float>(), 0.0f) << "non-action token " << j;
      continue;
    }
    EXPECT_NEAR(adv[0][j].item<double>(), want[a], 1e-6) << "action " << a;
    EXPECT_NEAR(ret[0][j].item<double>(), want[a] + v_act[a], 1e-6) << "action " << a;
    ++a;
  }
  // Known-bad input: the tool tokens' values must not leak in. Treating every token as an action gives
  // a different first advantage.
  auto [adv_all, ret_all] = gae_advantages(rw, vl, at::ones({1, R}), gamma, lam);
  EXPECT_GT(std::abs(adv_all[0][0].item<double>() - want[0]), 1e-3);
  // A reward on a non-action token is refused.
  at::Tensor bad = rw.clone();
  bad[0][2] = 1.0f;
  EXPECT_THROW(gae_advantages(bad, vl, mk, gamma, lam), c10::Error);
}

// Operand digit counts of a problem "... A ... B ...", from its exact answer's factors.
std::pair<size_t, size_t> operand_digits(const PromptExample& ex) {
  std::vector<std::string> nums;
  std::string cur;
  for (char c : ex.prompt + " ") {
    if (std::isdigit(static_cast<unsigned char>(c))) {
      cur += c;
    } else if (!cur.empty()) {
      nums.push_back(cur);
      cur.clear();
    }
  }
  EXPECT_EQ(nums.size(), 2u) << ex.prompt;
  if (nums.size() != 2) return {0, 0};
  EXPECT_EQ(std::to_string(std::stoll(nums[0]) * std::stoll(nums[1])), ex.answer) << ex.prompt;
  return {nums[0].size(), nums[1].size()};
}

TEST(Warmup, ProblemsCycleThroughOperandLengthsAndAvoidTheRlPrompts) {
  SyntheticOptions task;  // 3 x 3 digits
  task.seed = 5;
  SftOptions o;
  o.steps = 10;
  o.batch_size = 6;
  // Off (0): the task's own operand lengths.
  const auto plain = warmup_tasks(task, o);
  ASSERT_EQ(plain.size(), 60u);
  for (const auto& ex : plain) EXPECT_EQ(operand_digits(ex), std::make_pair(size_t(3), size_t(3))) << ex.prompt;
  SyntheticOptions same = task;
  same.seed = task.seed + 104729;
  same.count = 60;
  const auto expected = make_multiplication_tasks(same);
  for (size_t k = 0; k < plain.size(); ++k) EXPECT_EQ(plain[k].prompt, expected[k].prompt) << k;
  // On (2): 2x2, 2x3, 3x2, 3x3 in turn, and none of them an RL prompt of the same seed.
  o.operand_digits_min = 2;
  const auto mixed = warmup_tasks(task, o);
  ASSERT_EQ(mixed.size(), 60u);
  const std::pair<size_t, size_t> cycle[] = {{2, 2}, {2, 3}, {3, 2}, {3, 3}};
  for (size_t k = 0; k < mixed.size(); ++k) EXPECT_EQ(operand_digits(mixed[k]), cycle[k % 4]) << mixed[k].prompt;
  SyntheticOptions rl = task;
  rl.count = 500;
  std::set<std::string> rl_prompts;
  for (const auto& ex : make_multiplication_tasks(rl)) rl_prompts.insert(ex.prompt);
  size_t overlap = 0;
  for (const auto& ex : mixed) overlap += rl_prompts.count(ex.prompt);
  EXPECT_LE(overlap, 1u) << "warm-up problems are drawn apart from the RL prompts";
}

TEST(MicroBatches, RangesNeverCrossAMiniBatchAndDenominatorsAddUp) {
  // S = 10, mini 4 (mini-batches [0,4) [4,8) [8,10)), micro 3.
  const auto r = micro_batch_ranges(10, 4, 3);
  const std::vector<std::pair<int64_t, int64_t>> want = {{0, 3}, {3, 4}, {4, 7}, {7, 8}, {8, 10}};
  EXPECT_EQ(r, want);
  std::vector<Trajectory> t(3);
  t[0].loss_mask = {1, 1, 0, 1};  // 3 sampled tokens
  t[1].loss_mask = {0, 0};        // none: empty for seq-mean-token-mean
  t[2].loss_mask = {1};
  EXPECT_EQ(mini_batch_denominator(t, 0, 3, LossAgg::kTokenMean), 4);
  EXPECT_EQ(mini_batch_denominator(t, 0, 3, LossAgg::kSeqMeanTokenMean), 2);
  EXPECT_EQ(mini_batch_denominator(t, 0, 3, LossAgg::kSeqMeanTokenSum), 3);
  EXPECT_EQ(mini_batch_denominator(t, 1, 2, LossAgg::kTokenMean), 1) << "clamped to >= 1";
}

// Token-budget micro-batches (train.micro_batch_tokens) over lengths already longest first within each
// mini-batch: every sequence in exactly one range, no range across a mini-batch, each range's rows times its
// longest within the budget (a sequence longer than the budget alone) and within micro rows. Budget 0 is
// the row count's ranges.
TEST(MicroBatches, TokenBudgetsHoldEverySequenceOnceWithinTheBudget) {
  // mini 5: [0,5) [5,9)
  const std::vector<int64_t> lengths = {90, 40, 30, 30, 10, 200, 20, 20, 5};
  const int64_t mini = 5, micro = 3, budget = 100;
  const auto r = micro_batch_ranges(lengths, mini, micro, budget);
  // [0,1): 90 (a second row would make 2 x 90); [1,4): 3 x 40 = 120 > 100, so [1,3) then [3,5); 200 alone;
  // [6,9): 3 x 20.
  const std::vector<std::pair<int64_t, int64_t>> want = {{0, 1}, {1, 3}, {3, 5}, {5, 6}, {6, 9}};
  EXPECT_EQ(r, want);
  std::vector<int> seen(lengths.size(), 0);
  for (const auto& [b, e] : r) {
    EXPECT_EQ(b / mini, (e - 1) / mini) << "a range across mini-batches";
    int64_t top = 0;
    for (int64_t i = b; i < e; ++i) {
      ++seen[i];
      top = std::max(top, lengths[i]);
    }
    EXPECT_LE(e - b, micro);
    if (e - b > 1) EXPECT_LE((e - b) * top, budget);
  }
  for (int n : seen) EXPECT_EQ(n, 1);
  EXPECT_EQ(micro_batch_ranges(lengths, mini, micro, 0), micro_batch_ranges(9, mini, micro));
  // Packed (train.pack_sequences), a micro-batch holds its summed lengths: [0,1) 90 (90 + 40 > 100); [1,4)
  // 40 + 30 + 30 = 100; [4,5); 200 alone; [6,9) 45. The padded count cuts [1,3) there.
  const std::vector<std::pair<int64_t, int64_t>> packed = {{0, 1}, {1, 4}, {4, 5}, {5, 6}, {6, 9}};
  EXPECT_EQ(micro_batch_ranges(lengths, mini, micro, budget, /*packed=*/true), packed);
  // The update's order: each mini-batch longest first, its sequences kept, each place moved with its
  // trajectory; without a budget, the batch as it is.
  RolloutBatch rb;
  const std::vector<int64_t> response = {3, 9, 1, 9, 5, 2};
  for (size_t i = 0; i < response.size(); ++i) {
    Trajectory t;
    t.prompt_ids = {1, 2};
    t.response_ids.assign(response[i], 7);
    rb.trajs.push_back(t);
    rb.index.push_back(100 + int64_t(i));
  }
  const UpdateBatch u = update_batch(rb, /*mini=*/4, /*micro=*/4, /*budget=*/40);
  std::vector<int64_t> got_len, got_index;
  for (size_t i = 0; i < u.trajs().size(); ++i) {
    got_len.push_back(u.trajs()[i].window_end());
    got_index.push_back(u.index[i]);
  }
  EXPECT_EQ(got_len, std::vector<int64_t>({11, 11, 5, 3, 7, 4})) << "stable, longest first, within [0,4) and [4,6)";
  EXPECT_EQ(got_index, std::vector<int64_t>({101, 103, 100, 102, 104, 105}));
  const UpdateBatch plain = update_batch(rb, 4, 2, 0);
  EXPECT_EQ(&plain.trajs(), &rb.trajs) << "no budget: the batch itself";
  EXPECT_EQ(plain.index, rb.index);
  EXPECT_EQ(plain.micro_ranges, micro_batch_ranges(6, 4, 2));
}

// Shared prompts (train.share_prompts) under a token budget: the sort keeps each prompt's answers together
// (the groups by their tokens, A 28, C 23, B 18; each answer longest first), and a packed micro-batch
// counts the prompt once: A's answers of 14, 8 and 6 tokens over a 5-token prompt take 14 + 4 + 2 = 20
// tokens (pack()'s own count), within a budget of 20 that their summed lengths (28) exceed; and the keys
// attention gathers stay bounded.
TEST(MicroBatches, SharedPromptsKeepAPromptsAnswersTogetherAndCountItOnce) {
  const std::vector<int64_t> A = {1, 2, 3, 4, 5}, B = {1, 6}, C = {1, 7, 8};
  const std::vector<std::pair<std::vector<int64_t>, int64_t>> seqs = {{A, 3}, {B, 9}, {A, 9}, {C, 20}, {B, 5}, {A, 1}};
  RolloutBatch rb;
  for (size_t i = 0; i < seqs.size(); ++i) {
    Trajectory t;
    t.prompt_ids = seqs[i].first;
    t.response_ids.assign(seqs[i].second, 9);
    t.loss_mask.assign(seqs[i].second, 1);
    t.logprobs.assign(seqs[i].second, 0.f);
    rb.trajs.push_back(t);
    rb.index.push_back(int64_t(i));
  }
  const UpdateBatch u = update_batch(rb, /*mini=*/6, /*micro=*/6, /*budget=*/20, /*packed=*/true, /*share=*/true);
  EXPECT_EQ(u.index, std::vector<int64_t>({2, 0, 5, 3, 1, 4}));
  const std::vector<std::pair<int64_t, int64_t>> want = {{0, 3}, {3, 4}, {4, 6}};
  EXPECT_EQ(u.micro_ranges, want);
  EXPECT_EQ(pack(u.trajs(), 0, 3, at::kCPU, /*packed=*/true, /*share_prompts=*/true).L, 20);
  EXPECT_EQ(pack(u.trajs(), 4, 6, at::kCPU, true, true).L, 17);
  // Without sharing: longest first across prompts, and each answer's prompt counted.
  const UpdateBatch apart = update_batch(rb, 6, 6, 20, /*packed=*/true, /*share=*/false);
  EXPECT_EQ(apart.index, std::vector<int64_t>({3, 2, 1, 0, 4, 5}));
  const std::vector<int64_t> lengths = {14, 8, 6, 23, 11, 7};
  EXPECT_NE(micro_batch_ranges(lengths, 6, 6, 20, /*packed=*/true), want) << "the prompt counted for every answer";
  // The keys attention gathers stay within kSharedKeysPerToken x the budget: 8 answers of 30 tokens over a
  // shared 28 take 30 + 2 tokens a further answer, within a budget of 40 for 6 of them; their keys, 30 an
  // answer and the prompt's 28 once for its own sequence, reach 148 with 4 and would pass 4 x 40 with 5.
  ASSERT_EQ(kSharedKeysPerToken, 4);
  const std::vector<int64_t> thirty(8, 30), share28 = {0, 28, 28, 28, 28, 28, 28, 28};
  const std::vector<std::pair<int64_t, int64_t>> by_keys = {{0, 4}, {4, 8}};  // the tokens alone: {0, 6}, {6, 8}
  EXPECT_EQ(micro_batch_ranges(thirty, 8, 8, 40, /*packed=*/true, share28), by_keys);
}

// Two optimizer steps of two micro-batches each, with hand-made policy-loss outputs. policy_loss()
// already divides each micro-batch by its mini-batch's denominator, so a mini-batch's loss and pg_loss
// are the SUMS of its micro-batch terms, and the step reports their mean over optimizer steps. Token
// means (kl, clip_frac, ...) are weighted by each micro-batch's loss-mask tokens.
// pass@1 from k samples is the mean over problems of each one's correct share; pass@k the share of problems
// with a correct completion. Two problems, k = 4: 3 of 4 and 0 of 4 correct, so pass@1 = 0.375 (the share
// of problems solved by a majority, or by the first sample, would both read 0.5) and pass@4 = 0.5.
TEST(Evaluation, PassAtOneFromKSamplesAndPassAtK) {
  std::vector<Trajectory> t(8);
  const bool correct[8] = {true, false, true, true, false, false, false, false};
  for (int i = 0; i < 8; ++i) {
    t[i].correct = correct[i];
    t[i].tool_calls = i % 2;
  }
  const EvalResult r = summarize_evaluation(t, 4);
  EXPECT_EQ(r.k, 4);
  EXPECT_DOUBLE_EQ(r.pass1, (3.0 / 4 + 0.0) / 2);
  EXPECT_DOUBLE_EQ(r.pass_k, 0.5);
  EXPECT_DOUBLE_EQ(r.tool_use, 0.5);
  const EvalResult greedy = summarize_evaluation(t, 1);  // eight problems, one completion each
  EXPECT_DOUBLE_EQ(greedy.pass1, 3.0 / 8);
  EXPECT_DOUBLE_EQ(greedy.pass_k, greedy.pass1);
  EXPECT_EQ(greedy.pass_at.size(), 1u);
  EXPECT_THROW(summarize_evaluation(t, 3), c10::Error) << "8 completions are not groups of 3";
}

// Each evaluation set's figures from its own problems: three problems of k = 2, two in "aime-2024" (1 and 2
// correct of 2) and one in "mine" (0 of 2), interleaved as ranks and files may leave them. aime-2024:
// avg@2 = (1/2 + 1) / 2 = 0.75, pass@2 = 1; mine: 0 and 0. Twin: sets taken as consecutive runs of the
// problem list (the first two problems and the last) give aime-2024 (1/2 + 0) / 2 = 0.25.
TEST(Evaluation, EachSetFromItsOwnProblems) {
  std::vector<PromptExample> problems(3);
  problems[0].data_source = "aime-2024";
  problems[1].data_source = "mine";
  problems[2].data_source = "aime-2024";
  std::vector<Trajectory> t(6);
  const bool correct[6] = {true, false, false, false, true, true};
  for (int i = 0; i < 6; ++i) {
    t[i].prompt_index = i / 2;
    t[i].correct = correct[i];
  }
  const auto sets = summarize_evaluation_sets(t, problems, {"aime-2024", "mine"}, 2);
  ASSERT_EQ(sets.size(), 2u);
  EXPECT_DOUBLE_EQ(sets.at("aime-2024").pass1, 0.75);
  EXPECT_DOUBLE_EQ(sets.at("aime-2024").pass_k, 1.0);
  EXPECT_DOUBLE_EQ(sets.at("mine").pass1, 0.0);
  EXPECT_DOUBLE_EQ(sets.at("mine").pass_at.at(2), 0.0);
  const EvalResult consecutive = summarize_evaluation({t.begin(), t.begin() + 4}, 2);
  EXPECT_NE(consecutive.pass1, sets.at("aime-2024").pass1) << "the twin";
  // The whole evaluation is over every problem: (1/2 + 0 + 1) / 3.
  EXPECT_DOUBLE_EQ(summarize_evaluation(t, 2).pass1, 0.5);
}

// train.eval_temperature: -1 is greedy for one completion and training's temperature for more; any other
// value is taken as it is, greedy included. The seed is the evaluation's own, per step.
TEST(Evaluation, TemperatureAndSeedOfTheSamples) {
  Config c = load_config("", {"sampling.temperature=0.8", "train.seed=3"});
  auto temperature = [&](int64_t k, double t) {
    Config x = c;
    x.train.eval_samples = k;
    x.train.eval_temperature = t;
    return evaluation_sampling(x, 5).temperature;
  };
  EXPECT_EQ(temperature(1, -1), 0.0);
  EXPECT_EQ(temperature(4, -1), 0.8);
  EXPECT_EQ(temperature(1, 0.6), 0.6);
  EXPECT_EQ(temperature(4, 0.6), 0.6);
  EXPECT_EQ(temperature(4, 0.0), 0.0);
  c.train.eval_samples = 4;
  EXPECT_EQ(evaluation_sampling(c, 5).samples_per_prompt, 4);
  EXPECT_EQ(evaluation_sampling(c, 5).seed, 3 * 1000003 + 5 + (int64_t{1} << 40));
  EXPECT_NE(evaluation_sampling(c, 6).seed, evaluation_sampling(c, 5).seed) << "a step's own noise";
  EXPECT_NE(evaluation_sampling(c, 5).seed, 3 * 1000003 + 5) << "not the training rollout's stream of that step";
}

// The unbiased pass@j, counted by hand: of n = 4 completions, c correct, a draw of j = 2 without
// replacement misses every correct one with probability C(4 - c, 2) / C(4, 2): 6/6, 3/6, 1/6, 0 for c = 0,
// 1, 2, 3. Four problems with 0, 1, 2 and 4 correct: pass@1 = avg@4 = (0 + 1/4 + 2/4 + 1) / 4, pass@2 =
// (0 + 1/2 + 5/6 + 1) / 4, pass@4 = 3/4. Samples of 6 log j = 1, 2, 4 and 6. The biased 1 - (1 - c/n)^j
// (7/16 for c = 1, j = 2) is rejected.
TEST(Evaluation, UnbiasedPassAtJFromKSamples) {
  std::vector<Trajectory> t(16);
  const int correct[4] = {0, 1, 2, 4};
  for (int p = 0; p < 4; ++p) {
    for (int g = 0; g < correct[p]; ++g) t[p * 4 + g].correct = true;
  }
  const EvalResult r = summarize_evaluation(t, 4);
  ASSERT_EQ(r.pass_at.size(), 3u);
  EXPECT_DOUBLE_EQ(r.pass_at.at(1), (0 + 0.25 + 0.5 + 1) / 4);
  EXPECT_DOUBLE_EQ(r.pass_at.at(2), (0 + 0.5 + 5.0 / 6 + 1) / 4);
  EXPECT_DOUBLE_EQ(r.pass_at.at(4), 0.75);
  EXPECT_EQ(r.pass1, r.pass_at.at(1));
  EXPECT_EQ(r.pass_k, r.pass_at.at(4));
  EXPECT_DOUBLE_EQ(pass_at_estimate(4, 1, 2), 0.5);
  EXPECT_GT(std::abs(pass_at_estimate(4, 1, 2) - (1 - std::pow(1 - 0.25, 2))), 0.05) << "the biased estimator";
  EXPECT_DOUBLE_EQ(pass_at_estimate(4, 3, 2), 1.0);
  EXPECT_DOUBLE_EQ(pass_at_estimate(6, 2, 3), 1.0 - 4.0 / 20);  // C(4, 3) / C(6, 3)
  std::vector<Trajectory> six(6);
  six[0].correct = true;
  const EvalResult r6 = summarize_evaluation(six, 6);
  std::vector<int64_t> js;
  for (const auto& [j, p] : r6.pass_at) js.push_back(j);
  EXPECT_EQ(js, (std::vector<int64_t>{1, 2, 4, 6}));
  EXPECT_DOUBLE_EQ(r6.pass_at.at(4), 4.0 / 6);  // 1 - C(5, 4) / C(6, 4) = 1 - 5/15
  EXPECT_THROW(pass_at_estimate(4, 5, 1), c10::Error);
  for (int64_t n = 1; n <= 64; ++n) {  // avg@k is the correct share exactly, as metrics.jsonl names it
    for (int64_t c = 0; c <= n; ++c) ASSERT_EQ(pass_at_estimate(n, c, 1), double(c) / double(n)) << c << "/" << n;
  }
}

TEST(UpdateMetrics, LossesAddUpPerMiniBatchAndTokenMeansWeighByTokens) {
  auto scalar = [](double v) { return at::scalar_tensor(v, at::kFloat); };
  auto micro = [&](double pg, double kl, double clip, int64_t tokens, double logprob) {
    PolicyLossOutput out;
    out.loss = scalar(pg);  // no KL or entropy term: loss == pg
    out.pg_loss = scalar(pg);
    out.kl = scalar(kl);
    out.clip_frac = scalar(clip);
    out.approx_kl = scalar(0);
    out.dual_clip_frac = scalar(0);
    const at::Tensor mask = at::ones({1, tokens}, at::kFloat);
    return std::make_tuple(out, at::full({1, tokens}, logprob, at::kFloat), mask);
  };
  UpdateMetrics um(at::kCPU);
  // Optimizer step 1: micro-batches with pg terms 0.25 (3 tokens) and 0.5 (1 token) -> mini-batch 0.75.
  // Optimizer step 2: 0.125 (2 tokens) and -0.375 (2 tokens) -> -0.25. Mean over steps: (0.75 - 0.25) / 2.
  const std::vector<std::tuple<double, double, double, int64_t, double>> steps[2] = {
      {{0.25, 0.1, 0.5, 3, -1.0}, {0.5, 0.3, 0.0, 1, -2.0}}, {{0.125, 0.2, 1.0, 2, -0.5}, {-0.375, 0.0, 0.0, 2, -0.5}}};
  const double norms[2] = {2.0, 4.0};
  for (int k = 0; k < 2; ++k) {
    for (const auto& [pg, kl, clip, tokens, lp] : steps[k]) {
      auto [out, lp_t, mask] = micro(pg, kl, clip, tokens, lp);
      um.add_micro_batch(out.loss, out, lp_t, mask);
    }
    um.end_optimizer_step(norms[k]);
  }
  const auto m = um.read();
  EXPECT_NEAR(m.at("loss"), 0.25, kExact);
  EXPECT_NEAR(m.at("pg_loss"), 0.25, kExact);
  // The definition the trainers used before: each micro-batch's pg term weighted by its tokens over all
  // tokens. It gives 0.094, not the loss 0.25: a metric computed that way must fail this test.
  const double token_weighted = (0.25 * 3 + 0.5 * 1 + 0.125 * 2 - 0.375 * 2) / 8;
  EXPECT_GT(std::abs(token_weighted - m.at("pg_loss")), 0.1);
  EXPECT_NEAR(m.at("grad_norm"), 3.0, kExact);
  EXPECT_NEAR(m.at("kl"), (0.1 * 3 + 0.3 * 1 + 0.2 * 2 + 0.0 * 2) / 8, 1e-7);  // float32 inputs
  EXPECT_NEAR(m.at("clip_frac"), (0.5 * 3 + 0 + 1.0 * 2 + 0) / 8, 1e-7);
  EXPECT_NEAR(m.at("logprob_mean"), (-1.0 * 3 - 2.0 * 1 - 0.5 * 2 - 0.5 * 2) / 8, 1e-7);
  EXPECT_EQ(m.at("entropy"), 0.0) << "no micro-batch reported entropy";
}

// GSPO's clip fraction is a share of sequences: micro-batches weigh by their sequences with a loss-mask
// token. Two micro-batches: 1 of 2 sequences clipped (5 tokens), 1 of 1 clipped (1 token), one sequence
// of the first empty: 2/3 of the sequences, where token weighting would give (0.5 x 5 + 1 x 1) / 6.
TEST(UpdateMetrics, SequenceLevelClipFractionWeighsBySequences) {
  UpdateMetrics um(at::kCPU, /*clip_per_sequence=*/true);
  auto add = [&](double clip, const at::Tensor& mask) {
    PolicyLossOutput out;
    out.loss = out.pg_loss = out.kl = out.approx_kl = out.dual_clip_frac = at::scalar_tensor(0.0, at::kFloat);
    out.clip_frac = at::scalar_tensor(clip, at::kFloat);
    um.add_micro_batch(out.loss, out, at::zeros(mask.sizes()), mask);
  };
  add(0.5, at::tensor({1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0}, at::kFloat).view({3, 4}));  // third row empty
  add(1.0, at::tensor({1, 0, 0, 0}, at::kFloat).view({1, 4}));
  um.end_optimizer_step(1.0);
  const double clip = um.read().at("clip_frac");
  EXPECT_NEAR(clip, 2.0 / 3, 1e-12);
  EXPECT_GT(std::abs(clip - (0.5 * 5 + 1.0) / 6), 0.01) << "token weighting is told apart";
  EXPECT_GT(std::abs(clip - (0.5 * 3 + 1.0) / 4), 0.01) << "counting the empty sequence is told apart";
}

// A tiny run: a trained tokenizer, a 2-layer model, a short warm-up, 2 prompts x 4 samples per step with
// real sandboxed tool calls, two iterations over two mini-batches (off-policy ratios), a KL penalty (so
// the reference model is built, saved and restored).
using TrainFn = std::map<std::string, double> (*)(Run&);

void run_to(const Config& c, const std::string& dir, bool resume, TrainFn train, const ExtraParams& extra) {
  Run run = make_run(c, dir, resume, extra);
  train(run);
}

class Trainers : public ::testing::TestWithParam<bool> {  // true = PPO
 protected:
  TrainFn train() const {
    return GetParam() ? TrainFn(&train_ppo) : TrainFn([](rlt::Run& r) { return train_grpo(r); });
  }
  ExtraParams extra() const { return GetParam() ? value_head_params() : ExtraParams{}; }
};

TEST_P(Trainers, RunsEndToEndAndAResumedRunReproducesTheLossesExactly) {
  install_cpu_memory_tracking();  // the phases' peaks, below
  TempDir tmp(GetParam() ? "ppo" : "grpo");
  Config c = tiny_config();
  c.train.eval_prompts = 4;  // held out; pass@1 from 2 samples after steps 2 and 4
  c.train.eval_every = 2;
  c.train.eval_samples = 2;
  // Bit for bit needs the old log-probs recomputed: the rollout's own depend, at the rounding level
  // (~1e-7), on which rows share a decode step, which depends on when tool calls return (OldLogprobs
  // below holds the rollout's to the recomputed ones within that).
  c.train.old_logprobs = OldLogprobs::kRecompute;
  // One prompt's 4 samples at a time: the step's second prompt takes the first one's rows once they finish.
  c.rollout.max_batch = 4;
  c.train.peak_tflops = 0.5;  // the CPU has no entry in the peak table: update_mfu divides by this
  const std::string full = (tmp.path() / "full").string(), part = (tmp.path() / "part").string();
  run_to(c, full, /*resume=*/false, train(), extra());
  const auto a = read_metrics(full);
  ASSERT_EQ(a.size(), 4u);
  // The update's rates against their definitions: tokens (prompt and response, every trajectory) times the
  // iterations over the update's seconds; FLOPs over the seconds times the peak (one rank). The FLOPs'
  // products are linear in the tokens (model/flops.h, tests/model/test_flops.cpp): 3 x (the layers' over
  // every token + the head's over the sampled ones), each iteration. Attention's keys, sum of L (L + 1) / 2
  // over the n trajectories of L tokens, lie between T^2 / 2n + T / 2 (T = the tokens, equal lengths) and
  // T (max_context + 1) / 2: a head counted over every row, not the sampled ones, leaves less than that.
  const ModelConfig shape = load_model_config(full + "/checkpoint/model/config.json");
  for (const auto& row : a) {
    const double t = row["time_update_s"].get<double>(), tokens = row["tokens"].get<double>();
    EXPECT_NEAR(row["update_tokens_per_s"].get<double>(), tokens * 2 / t, 1e-9 * tokens / t);
    EXPECT_EQ(row["update_forwarded_tokens"].get<double>(), tokens) << "rows, not packed: every token forwarded";
    const double flops = row["update_flops"].get<double>();
    EXPECT_NEAR(row["update_mfu"].get<double>(), flops / (t * 0.5e12), 1e-12 * flops / t);
    EXPECT_EQ(row["update_hfu"].get<double>(), row["update_mfu"].get<double>()) << "no checkpointing: no recompute";
    const double per_token = forward_flops(shape, SequenceWork{1, 0}).projections;
    const double per_scored = forward_flops(shape, SequenceWork{0, 1}).head;
    const double products = 3 * (per_token * tokens + per_scored * row["sampled_tokens"].get<double>());
    const double per_key = 3 * 4.0 * shape.num_heads * shape.head_dim * shape.num_layers;  // a key, a pass
    const double attention = flops / 2 - products, n = double(c.train.prompts_per_step * c.sampling.samples_per_prompt);
    EXPECT_GE(attention, per_key * (tokens * tokens / (2 * n) + tokens / 2) * (1 - 1e-12)) << row.dump();
    EXPECT_LE(attention, per_key * tokens * (c.rollout.max_context + 1) / 2) << row.dump();
  }
  // The memory plan the run was checked against before loading, beside the measured peaks: its phases (the
  // persistent part plus each phase's own) and their larger; each phase's absolute peak, the step's the
  // largest of them. The wrong twin: the plan of the same run at half the context.
  const MemoryPlan plan = plan_memory(c, shape, 1);
  Config half = c;
  half.rollout.max_context /= 2;
  constexpr double kMiB = 1048576.0;
  for (const auto& row : a) {
    EXPECT_EQ(row["memory_plan_mib"].get<double>(), plan.device_total() / kMiB);
    EXPECT_EQ(row["memory_plan_rollout_mib"].get<double>(), (plan.persistent() + plan.rollout_phase()) / kMiB);
    EXPECT_EQ(row["memory_plan_update_mib"].get<double>(), (plan.persistent() + plan.update_phase()) / kMiB);
    EXPECT_NE(row["memory_plan_mib"].get<double>(), plan_memory(half, shape, 1).device_total() / kMiB);
    double top = 0;
    for (const char* phase : {"rollout", "scoring", "update"}) {
      top = std::max(top, row[std::string("memory_allocated_peak_") + phase + "_mib"].get<double>());
    }
    EXPECT_GT(top, 0) << "the CPU allocator tracked";
    EXPECT_EQ(row["memory_allocated_peak_mib"].get<double>(), top);
  }
  for (const auto& row : a) {
    for (const char* k : {"loss", "pg_loss", "kl", "entropy", "grad_norm", "reward_mean", "accuracy", "tool_use", "lr",
                          "peak_memory_mib", "time_rollout_s", "rollout_tokens_per_s", "rollout_refills",
                          "rollout_tool_latency_ms_mean", "rollout_tool_run_ms_mean", "rollout_tool_wait_passes_mean",
                          "rollout_feed_wait_passes_mean", "time_rollout_turn_s"}) {
      ASSERT_TRUE(row.contains(k) && row[k].is_number()) << k << " in " << row.dump();
      EXPECT_TRUE(std::isfinite(row[k].get<double>())) << k;
    }
    EXPECT_EQ(row["rollout_refills"].get<double>(), 1.0);
    // A call's latency as the loop sees it holds its run in the sandbox.
    if (row["tool_calls_mean"].get<double>() > 0) {
      EXPECT_GT(row["rollout_tool_latency_ms_mean"].get<double>(), 0);
      EXPECT_GE(row["rollout_tool_latency_ms_mean"].get<double>(), row["rollout_tool_run_ms_mean"].get<double>());
    }
    EXPECT_GT(row["grad_norm"].get<double>(), 0) << "the update must move the policy";
    // fp32: the rollout's log-probs are the trainer's own (tests/trainer/test_batch.cpp holds them to 1e-6).
    ASSERT_TRUE(row.contains("logprob_mismatch_max")) << row.dump();
    EXPECT_LE(row["logprob_mismatch_max"].get<double>(), 1e-5);
    EXPECT_LE(row["logprob_mismatch_mean"].get<double>(), row["logprob_mismatch_max"].get<double>());
    if (GetParam()) {
      EXPECT_TRUE(row.contains("value_loss"));
    }
  }
  EXPECT_GT(a[3]["kl"].get<double>(), 0) << "the policy moved away from the saved reference";
  for (size_t i = 0; i < 4; ++i) {
    const bool due = (i + 1) % 2 == 0;
    EXPECT_EQ(a[i].contains("eval_pass@1"), due) << "step " << i + 1;
    if (!due) continue;
    const double p1 = a[i]["eval_pass@1"].get<double>(), pk = a[i]["eval_pass@2"].get<double>();
    EXPECT_TRUE(0 <= p1 && p1 <= pk && pk <= 1) << a[i].dump();
    EXPECT_EQ(a[i]["eval_avg@2"].get<double>(), p1) << "avg@k is pass@1 from k samples";
    EXPECT_EQ(std::fmod(p1 * 8, 1.0), 0.0) << "4 problems x 2 samples: a multiple of 1/8";
  }
  double reward_std_max = 0;
  for (const auto& row : a) reward_std_max = std::max(reward_std_max, row["reward_std"].get<double>());
  EXPECT_GT(reward_std_max, 0) << "some step must have unequal rewards, so advantages are not all 0";
  EXPECT_TRUE(std::filesystem::exists(full + "/checkpoint/model/config.json"));
  EXPECT_TRUE(std::filesystem::exists(full + "/checkpoint/optimizer-0.safetensors"));
  EXPECT_TRUE(std::filesystem::exists(full + "/plot.svg"));
  EXPECT_FALSE(std::filesystem::exists(full + "/checkpoint.tmp"));

  // The same run interrupted after step 2 (--stop-after 2: checkpoint, exit), then resumed: every step's
  // loss, gradient norm and reward equal the uninterrupted run's bit for bit.
  {
    rlt::Run run = make_run(c, part, /*resume=*/false, extra());
    run.stop_after = 2;
    train()(run);
    EXPECT_EQ(run.counters.step, 2);
  }
  EXPECT_EQ(read_metrics(part).size(), 2u);
  run_to(c, part, /*resume=*/true, train(), extra());
  const auto b = read_metrics(part);
  ASSERT_EQ(b.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    for (const char* k : {"loss", "grad_norm", "reward_mean", "kl", "lr"}) {
      EXPECT_EQ(a[i][k].get<double>(), b[i][k].get<double>()) << k << " at step " << i + 1;
    }
    if (a[i].contains("eval_pass@1")) {
      EXPECT_EQ(a[i]["eval_pass@1"].get<double>(), b[i]["eval_pass@1"].get<double>()) << "step " << i + 1;
    }
  }
  // Resuming a folder without a checkpoint, and a prompt longer than the context, are input errors.
  EXPECT_THROW(make_run(c, (tmp.path() / "empty").string(), /*resume=*/true, extra()), RunError);
  Config long_prompt = c;
  long_prompt.rollout.max_context = 8;
  EXPECT_THROW(make_run(long_prompt, (tmp.path() / "long").string(), false, extra()), DataError);
}

// A bf16 model with fp32 master weights: the warm-up trains the masters and leaves the model equal to
// them rounded, so RL's first optimizer step starts from the warmed-up weights. (Masters copied before the
// warm-up would put the model back to its random initialisation at RL's first step: on the H200 learning
// check the entropy jumps from 0.26 to 5.7 nats.)
TEST(MixedPrecisionRun, WarmUpTrainsTheMastersRlStartsFrom) {
  TempDir tmp("bf16_warmup");
  Config c = tiny_config();
  c.model.dtype = DType::kBFloat16;
  c.sft.steps = 6;
  c.objective.kl_coef = 0;
  rlt::Run run = make_run(c, (tmp.path() / "run").string(), /*resume=*/false, {});
  ASSERT_FALSE(run.model.master.empty()) << "bf16 + train.master_weights fp32";
  std::vector<at::Tensor> before;
  for (const auto& m : run.model.master) before.push_back(m.clone());
  sft_warmup(run);
  const auto params = run.model.policy->parameters();
  double moved = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(at::equal(params[i], run.model.master[i].to(at::kBFloat16)))
        << "the model is the masters rounded, " << i;
    moved += (run.model.master[i] - before[i]).abs().sum().item<double>();
  }
  EXPECT_GT(moved, 0) << "the warm-up moved the masters RL starts from";
}

// The rollout's tool-call metrics against their definitions, on a batch made by hand: latencies are means
// over the step's tool calls (4 here, from the table), sat-out passes means over its trajectories (3). A
// latency divided by trajectories (20 ms, not 15) or passes divided by calls fail it.
TEST(RolloutMetrics, ToolLatencyIsPerCallAndSatOutPassesPerTrajectory) {
  TempDir tmp("rollout_metrics");
  Config c = tiny_config();
  rlt::Run run = make_run(c, (tmp.path() / "run").string(), /*resume=*/false, {});
  RolloutBatch rb;
  rb.table = at::zeros({3, kTableColumns}, at::kDouble);
  const double calls[] = {2, 0, 2};
  for (int64_t s = 0; s < 3; ++s) rb.table[s][kToolCalls] = calls[s];
  rb.seconds = 1.5;
  rb.stats.tool_latency_s = 0.060;
  rb.stats.tool_run_s = 0.046;
  rb.stats.tool_wait_row_steps = 12;
  rb.stats.feed_wait_row_steps = 6;
  rb.stats.turn_s = 0.25;
  const auto m = rollout_metrics(run, rb);
  EXPECT_NEAR(m.at("rollout_tool_latency_ms_mean"), 15.0, 1e-12);
  EXPECT_NEAR(m.at("rollout_tool_run_ms_mean"), 11.5, 1e-12);
  EXPECT_NEAR(m.at("rollout_tool_wait_passes_mean"), 4.0, 1e-12);
  EXPECT_NEAR(m.at("rollout_feed_wait_passes_mean"), 2.0, 1e-12);
  EXPECT_EQ(m.at("time_rollout_turn_s"), 0.25);
  EXPECT_NEAR(m.at("tool_calls_mean"), 4.0 / 3.0, 1e-12);
  // No call at all: zero latencies, not a division by zero.
  rb.table.zero_();
  rb.stats.tool_latency_s = rb.stats.tool_run_s = 0;
  const auto none = rollout_metrics(run, rb);
  EXPECT_EQ(none.at("rollout_tool_latency_ms_mean"), 0.0);
  EXPECT_EQ(none.at("rollout_tool_run_ms_mean"), 0.0);
}

// The speculative rollout's and the tail's metrics against their definitions, on stats made by hand: 40
// verifying forwards among 100 decode passes, 120 of 200 draft tokens taken, 150 tokens sampled by the 60
// rows that sampled in them (2.5 a row, not 150 / 80 rows fed), 30 tail passes that sampled 90 tokens. A
// config without speculation logs none of its metrics.
TEST(RolloutMetrics, SpeculationFiguresFollowTheirDefinitions) {
  TempDir tmp("rollout_metrics_spec");
  Config c = tiny_config();
  c.rollout.speculative = Speculative::kSuffix;
  rlt::Run run = make_run(c, (tmp.path() / "run").string(), /*resume=*/false, {});
  RolloutBatch rb;
  rb.table = at::zeros({2, kTableColumns}, at::kDouble);
  rb.seconds = 1.0;
  rb.stats.decode_steps = 60;
  rb.stats.verify_passes = 40;
  rb.stats.verify_rows = 80;
  rb.stats.verify_sampling_rows = 60;
  rb.stats.verify_sampled = 150;
  rb.stats.drafted_tokens = 200;
  rb.stats.accepted_tokens = 120;
  rb.stats.tail_passes = 30;
  rb.stats.tail_sampled = 90;
  rb.stats.tail_s = 0.4;
  const auto m = rollout_metrics(run, rb);
  EXPECT_EQ(m.at("rollout_verify_passes"), 40.0);
  EXPECT_NEAR(m.at("rollout_speculative_share"), 0.4, 1e-12);
  EXPECT_EQ(m.at("rollout_draft_tokens"), 200.0);
  EXPECT_EQ(m.at("rollout_draft_accepted"), 120.0);
  EXPECT_NEAR(m.at("rollout_draft_acceptance"), 0.6, 1e-12);
  EXPECT_NEAR(m.at("rollout_tokens_per_verify_row"), 2.5, 1e-12);
  EXPECT_NEAR(m.at("rollout_tail_tokens_per_pass"), 3.0, 1e-12);
  EXPECT_EQ(m.at("rollout_tail_passes"), 30.0);
  EXPECT_EQ(m.at("time_rollout_tail_s"), 0.4);
  run.config.rollout.speculative = Speculative::kNone;
  const auto off = rollout_metrics(run, rb);
  EXPECT_EQ(off.count("rollout_verify_passes"), 0u);
  EXPECT_EQ(off.count("rollout_draft_acceptance"), 0u);
  EXPECT_EQ(off.count("time_rollout_tail_s"), 1u);
}

// A step's metrics, one row per step, and the policy's parameters at the end of a run.
struct RunResult {
  std::vector<nlohmann::json> rows;
  std::vector<at::Tensor> params;
};

// The tiny run, without KL or checkpoints, warmed up so that its first RL step has unequal rewards (and a
// loss that depends on the log-probs): every warm-up trace uses the tool, so some first answers are right.
Config varied_first_step_config(int64_t steps) {
  Config c = tiny_config();
  c.objective.kl_coef = 0;
  c.train.steps = steps;
  c.train.checkpoint_every = 0;
  c.sft.tool_fraction = 1.0;
  c.sft.steps = 80;
  c.sft.warmup_steps = 8;
  return c;
}

// varied_first_step_config's model after its warm-up, saved under `dir` as the Hugging Face folder of a
// one-step run's checkpoint at lr 0, and the config whose first RL step starts from it without a warm-up of
// its own, for runs that compare paths. Their old log-probs are recomputed by the trainer: the rollout's
// depend in their last bits on which rows share a decode step, which the sandbox's timing decides, so two
// runs of one path would differ (by up to 1e-6 in the step's log-prob mean on a 16-core host). And their
// step takes AdamW eps 1e-4 (the gradients' elements are ~5e-3): at 1e-8 AdamW steps an element by about
// lr times its gradient's sign, so an element whose gradient is rounding noise moves by +-lr, while below
// 1e-4 an element steps in proportion to its gradient and gradients that agree to 1e-7 give steps that
// agree about as well. From one start, the runs then differ by their paths alone, bit for bit from run to run.
Config from_warmed_up_model(const std::filesystem::path& dir, int64_t steps) {
  Config warm = varied_first_step_config(/*steps=*/1);
  warm.train.lr = 0;
  rlt::Run run = make_run(warm, (dir / "warm_up").string(), /*resume=*/false);
  train_grpo(run);
  Config c = varied_first_step_config(steps);
  c.model.path = (dir / "warm_up" / "checkpoint" / "model").string();
  c.sft.steps = 0;
  c.train.old_logprobs = OldLogprobs::kRecompute;
  c.train.adam_eps = 1e-4;
  return c;
}

// The step's reward metrics against the trajectories the run logged (train.log_samples: all of them):
// each trajectory's overlong penalty is the shaping of its own lengths, overlong_penalty_mean their mean,
// reward_mean the mean of the shaped rewards, and groups_equal_reward the groups whose G shaped rewards
// are all equal. The twin is the mean of the rewards before shaping, which a step with a penalty must
// tell apart from reward_mean.
TEST(RewardMetrics, OverlongPenaltyAndEqualRewardGroupsAreTheLoggedTrajectories) {
  TempDir tmp("reward_metrics");
  Config c = varied_first_step_config(/*steps=*/3);
  const int64_t G = c.sampling.samples_per_prompt, S = c.train.prompts_per_step * G;
  c.train.log_samples = S;
  c.reward.overlong_buffer = 48;  // of a budget of 72 sampled tokens: most trajectories pay something
  c.reward.overlong_penalty = 0.5;
  const std::string dir = (tmp.path() / "run").string();
  {
    rlt::Run run = make_run(c, dir, /*resume=*/false, {});
    train_grpo(run);
  }
  const auto rows = read_metrics(dir);
  ASSERT_EQ(rows.size(), 3u);
  std::vector<std::vector<nlohmann::json>> samples(rows.size());
  std::ifstream f(tmp.path() / "run" / "samples.jsonl");
  for (std::string line; std::getline(f, line);) {
    const auto j = nlohmann::json::parse(line);
    samples.at(j["step"].get<size_t>() - 1).push_back(j);
  }
  int64_t penalised = 0;
  for (size_t k = 0; k < rows.size(); ++k) {
    ASSERT_EQ(static_cast<int64_t>(samples[k].size()), S) << "step " << k + 1;
    double penalty = 0, reward = 0, unshaped = 0, equal_groups = 0;
    for (int64_t g = 0; g < S / G; ++g) {
      double lo = INFINITY, hi = -INFINITY;
      for (int64_t i = g * G; i < (g + 1) * G; ++i) {
        const auto& t = samples[k][i];
        const double p = t["overlong_penalty"].get<double>(), r = t["reward"].get<double>();
        EXPECT_EQ(p, overlong_shaping(c, t["prompt_tokens"].get<int64_t>(), t["sampled_tokens"].get<int64_t>()))
            << "step " << k + 1 << ", trajectory " << i;
        penalised += p < 0;
        penalty += p;
        reward += r;
        unshaped += r - p;
        lo = std::min(lo, r);
        hi = std::max(hi, r);
      }
      equal_groups += hi - lo <= 1e-9;
    }
    const auto& m = rows[k];
    EXPECT_NEAR(m["overlong_penalty_mean"].get<double>(), penalty / S, kExact) << "step " << k + 1;
    EXPECT_NEAR(m["reward_mean"].get<double>(), reward / S, kExact) << "step " << k + 1;
    EXPECT_EQ(m["groups_equal_reward"].get<double>(), equal_groups) << "step " << k + 1;
    if (penalty < 0) {
      EXPECT_GT(std::abs(m["reward_mean"].get<double>() - unshaped / S), 1e-6) << "step " << k + 1;
    }
  }
  EXPECT_GT(penalised, 0) << "no trajectory paid a penalty: the test checks nothing";
}

// train.old_logprobs: an off-policy GRPO run (two iterations over two mini-batches) that takes the old
// log-probs from the rollout trains like the same run that recomputes them with a scoring forward: the
// two differ only by the rollout/trainer mismatch, in fp32 ~2e-7 per token on average and <= 1e-5 at
// most (measured: means 1.3e-7 to 1.8e-7, maxima 1.9e-6 to 3.3e-6). The wrong implementation it must
// reject: the trainer scoring at temperature 0.7 a rollout sampled (and its log-probs taken) at 1, so the
// rollout's log-probs are another distribution's; the same pair of runs then parts by far more than the
// tolerances.
TEST(OldLogprobs, RolloutAndRecomputeTrainAlikeInFp32) {
  TempDir tmp("old_logprobs");
  const Config base = varied_first_step_config(/*steps=*/2);  // each run sets its own
  // score_temperature 0: the trainer scores at the sampling temperature (make_run's one value).
  auto train = [&](OldLogprobs mode, double score_temperature, const std::string& name, int64_t steps) {
    Config c = base;
    c.train.old_logprobs = mode;
    c.train.steps = steps;  // 0: the warm-up only
    rlt::Run run = make_run(c, (tmp.path() / name).string(), /*resume=*/false);
    if (score_temperature > 0) run.config.loss.temperature = score_temperature;
    train_grpo(run);
    RunResult r{read_metrics((tmp.path() / name).string()), {}};
    for (const auto& p : run.model.policy->parameters()) r.params.push_back(p.detach().clone());
    return r;
  };
  // The update's share of the weights that differs between two runs: ||W_a - W_b|| / ||W_a - W_0||.
  const RunResult start = train(OldLogprobs::kRecompute, 0, "start", 0);
  auto weight_diff = [&](const RunResult& a, const RunResult& b) {
    double d = 0, u = 0;
    for (size_t i = 0; i < a.params.size(); ++i) {
      d += (a.params[i] - b.params[i]).to(at::kDouble).square().sum().item<double>();
      u += (a.params[i] - start.params[i]).to(at::kDouble).square().sum().item<double>();
    }
    return std::sqrt(d / u);
  };
  const RunResult recompute = train(OldLogprobs::kRecompute, 0, "recompute", 2);
  const RunResult rollout = train(OldLogprobs::kRollout, 0, "rollout", 2);
  ASSERT_EQ(recompute.rows.size(), 2u);
  ASSERT_EQ(rollout.rows.size(), 2u);
  ASSERT_GT(recompute.rows[0]["reward_std"].get<double>(), 1e-3) << "unequal rewards: the loss depends on the ratios";
  // A log-prob error e moves a token's ratio by e, so the loss (a mean of A * ratio terms, |A| ~ 1) by
  // about the mean mismatch, 2e-7: 1e-6 leaves 5x (measured: loss 4e-9 to 4e-8 apart, grad norm 3e-7 of
  // 0.24). The wrong implementation below parts the step-1 loss by 2.9e-2.
  constexpr double kLossTol = 1e-6, kGradRel = 1e-5;
  // AdamW's first steps move each weight by about lr whatever its gradient's size, so a weight whose
  // gradient is within rounding of 0 can move either way: compare the whole update, ||W_a - W_b|| over
  // ||W_a - W_0||, not each weight (measured: 3e-6 to 5e-6; the wrong implementation: 0.98).
  constexpr double kWeightRel = 1e-4;
  for (size_t i = 0; i < 2; ++i) {
    const auto &a = recompute.rows[i], &b = rollout.rows[i];
    EXPECT_EQ(a["old_logprobs_recomputed"].get<double>(), 1.0) << "step " << i + 1;
    EXPECT_EQ(b["old_logprobs_recomputed"].get<double>(), 0.0) << "step " << i + 1;
    EXPECT_EQ(a["reward_mean"].get<double>(), b["reward_mean"].get<double>()) << "the same rollout, step " << i + 1;
    EXPECT_NEAR(a["loss"].get<double>(), b["loss"].get<double>(), kLossTol) << "step " << i + 1;
    EXPECT_NEAR(a["grad_norm"].get<double>(), b["grad_norm"].get<double>(), kGradRel * a["grad_norm"].get<double>())
        << "step " << i + 1;
    // The rollout run measures the mismatch on its first mini-batch only (later ones see moved weights).
    EXPECT_LE(b["logprob_mismatch_max"].get<double>(), 1e-5) << "step " << i + 1;
  }
  EXPECT_LT(weight_diff(recompute, rollout), kWeightRel);

  // The wrong implementation: rollout log-probs at temperature 1 standing in for old log-probs scored at
  // 0.7. It is caught at step 1 (the following steps recompute), so step 1 must show the difference.
  const RunResult wrong_recompute = train(OldLogprobs::kRecompute, 0.7, "wrong_recompute", 2);
  const RunResult wrong_rollout = train(OldLogprobs::kRollout, 0.7, "wrong_rollout", 2);
  ASSERT_EQ(wrong_recompute.rows[0]["reward_mean"].get<double>(), wrong_rollout.rows[0]["reward_mean"].get<double>());
  EXPECT_GT(std::abs(wrong_recompute.rows[0]["loss"].get<double>() - wrong_rollout.rows[0]["loss"].get<double>()),
            kLossTol);
  EXPECT_GT(wrong_rollout.rows[0]["logprob_mismatch_mean"].get<double>(), base.train.old_logprobs_tol);
  EXPECT_EQ(wrong_rollout.rows[1]["old_logprobs_recomputed"].get<double>(), 1.0) << "switched after step 1";
  EXPECT_GT(weight_diff(wrong_recompute, wrong_rollout), kWeightRel);
}

// rollout.keep_cache: one DecodeEngine for the whole run, its cache reused in place by each step's rollout
// after the update moved the weights in place. The run is the one that makes a new policy every step: the
// same rollouts (rewards, tool use, tokens) and, with the old log-probs recomputed, the same losses bit for
// bit. A kept engine that carried anything of the last rollout into the next (a sequence's length, its
// rows) or missed the weights' update would sample other tokens.
TEST(KeepCache, ARunWithTheCacheKeptTrainsAsOneWithANewPolicyEachStep) {
  TempDir tmp("keep_cache");
  auto train = [&](bool keep, const std::string& name) {
    Config c = tiny_config();
    c.train.steps = 3;
    c.train.old_logprobs = OldLogprobs::kRecompute;
    c.rollout.engine.keep_cache = keep;
    rlt::Run run = make_run(c, (tmp.path() / name).string(), /*resume=*/false);
    train_grpo(run);
    EXPECT_EQ(run.rollout.engine != nullptr, keep) << "the kept engine outlives the steps";
    return read_metrics((tmp.path() / name).string());
  };
  const auto fresh = train(false, "fresh"), kept = train(true, "kept");
  ASSERT_EQ(fresh.size(), 3u);
  ASSERT_EQ(kept.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    for (const char* k : {"reward_mean", "tool_use", "response_length_mean", "loss", "grad_norm"}) {
      ASSERT_TRUE(fresh[i].contains(k)) << k;
      EXPECT_EQ(fresh[i][k].get<double>(), kept[i][k].get<double>()) << k << ", step " << i + 1;
    }
  }
  EXPECT_NE(fresh[0]["loss"].get<double>(), fresh[2]["loss"].get<double>()) << "the steps differ";
}

// Above train.old_logprobs_tol the run warns once and recomputes from the next step on, and a resumed
// run keeps the switch (state.json). Forced in fp32 with a tolerance of 1e-12 (the mismatch is ~2e-7);
// at the default 1e-3 the same run never switches. Without the switch saved, a resumed run would go back
// to the rollout's log-probs: a run resumed from a checkpoint whose state.json lost it must show that.
TEST_P(Trainers, AMismatchAboveTheToleranceSwitchesToRecomputeOnceAndAResumeKeepsIt) {
  TempDir tmp(GetParam() ? "ppo_switch" : "grpo_switch");
  Config c = tiny_config();
  c.objective.kl_coef = 0;
  c.train.steps = 3;
  c.train.checkpoint_every = 1;
  c.sft.steps = 20;
  const std::string kWarning = "exceeds train.old_logprobs_tol";
  auto count = [](const std::string& text, const std::string& what) {
    size_t n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  };
  auto recomputed = [](const std::vector<nlohmann::json>& rows) {
    std::vector<double> out;
    for (const auto& row : rows) out.push_back(row["old_logprobs_recomputed"].get<double>());
    return out;
  };
  auto run_captured = [&](const Config& cfg, const std::string& dir, bool resume, int64_t stop_after) {
    ::testing::internal::CaptureStderr();
    rlt::Run run = make_run(cfg, dir, resume, extra());
    run.stop_after = stop_after;
    train()(run);
    return ::testing::internal::GetCapturedStderr();
  };
  // Within the tolerance: no switch, no warning.
  const std::string calm = (tmp.path() / "calm").string();
  EXPECT_EQ(count(run_captured(c, calm, false, 0), kWarning), 0u);
  EXPECT_EQ(recomputed(read_metrics(calm)), std::vector<double>({0, 0, 0}));

  c.train.old_logprobs_tol = 1e-12;
  const std::string full = (tmp.path() / "full").string();
  EXPECT_EQ(count(run_captured(c, full, false, 0), kWarning), 1u);
  EXPECT_EQ(recomputed(read_metrics(full)), std::vector<double>({0, 1, 1}));
  EXPECT_GT(read_metrics(full)[0]["logprob_mismatch_mean"].get<double>(), 1e-12);

  // Stopped after the step that switched, then resumed: recomputes without a second warning.
  const std::string part = (tmp.path() / "part").string();
  EXPECT_EQ(count(run_captured(c, part, false, 1), kWarning), 1u);
  std::filesystem::copy(part, part + "_lost", std::filesystem::copy_options::recursive);
  EXPECT_EQ(count(run_captured(c, part, true, 0), kWarning), 0u);
  EXPECT_EQ(recomputed(read_metrics(part)), std::vector<double>({0, 1, 1}));

  // The wrong implementation: the switch not saved. The resumed run takes the rollout's again, and
  // switches (and warns) a second time.
  const std::string state_path = part + "_lost/checkpoint/state.json";
  nlohmann::json state = nlohmann::json::parse(std::ifstream(state_path));
  ASSERT_EQ(state["old_logprobs"], "recompute");
  state.erase("old_logprobs");
  std::ofstream(state_path) << state.dump();
  EXPECT_EQ(count(run_captured(c, part + "_lost", true, 0), kWarning), 1u);
  EXPECT_EQ(recomputed(read_metrics(part + "_lost")), std::vector<double>({0, 0, 1}));
}

// The ablation the README tables: every loss path and row selection on the same first RL step (one
// warm-up, same rollout) gives the same loss, log-probs and gradient norm, while the update's memory
// differs. Two iterations over two mini-batches make the second pass off-policy, so the loss depends on
// the log-probs (an on-policy first pass has ratio 1 whatever they are).
TEST(Ablation, LossPathsAgreeOnTheFirstStepWhileMemoryDiffers) {
  TempDir tmp("ablation");
  const Config base = from_warmed_up_model(tmp.path(), /*steps=*/1);
  struct Variant {
    LogprobImpl impl;
    bool response_only, loss_mask_only;
  };
  const std::vector<Variant> variants = {
      {LogprobImpl::kNaive, false, false},     {LogprobImpl::kNaive, true, false},    {LogprobImpl::kNaive, true, true},
      {LogprobImpl::kSelective, false, false}, {LogprobImpl::kSelective, true, true}, {LogprobImpl::kCce, false, false},
      {LogprobImpl::kCce, true, true},
  };
  std::vector<std::map<std::string, double>> m;
  double grads_mib = 0;  // the parameters' gradients, which the update's first backward makes in every variant
  for (size_t i = 0; i < variants.size(); ++i) {
    Config c = base;
    c.loss.impl = variants[i].impl;
    c.loss.response_only = variants[i].response_only;
    c.loss.loss_mask_only = variants[i].loss_mask_only;
    rlt::Run run = make_run(c, (tmp.path() / std::to_string(i)).string(), false);
    m.push_back(train_grpo(run));
    if (i == 0)
      for (const at::Tensor& p : run.model.policy->trainable_parameters()) grads_mib += p.nbytes() / 1048576.0;
  }
  ASSERT_GT(m[0]["reward_std"], 0) << "the first step needs unequal rewards for a non-zero loss";
  // fp32 paths that sum a vocabulary in different orders: log-probs agree to ~1e-7; the loss and the
  // gradient norm inherit that through one optimizer step.
  constexpr double kLossTol = 1e-6, kGradRel = 1e-4;
  for (size_t i = 0; i < m.size(); ++i) {
    std::printf("variant %zu: loss %.9e  logprob_mean %.9e  grad_norm %.9e  peak %.4f MiB\n", i, m[i]["loss"],
                m[i]["logprob_mean"], m[i]["grad_norm"], m[i]["peak_memory_update_mib"]);
  }
  for (size_t i = 1; i < m.size(); ++i) {
    EXPECT_NEAR(m[i]["loss"], m[0]["loss"], kLossTol) << "variant " << i;
    EXPECT_NEAR(m[i]["logprob_mean"], m[0]["logprob_mean"], kLossTol) << "variant " << i;
    EXPECT_NEAR(m[i]["grad_norm"], m[0]["grad_norm"], kGradRel * m[0]["grad_norm"]) << "variant " << i;
    EXPECT_EQ(m[i]["reward_mean"], m[0]["reward_mean"]) << "the same rollout";
  }
  EXPECT_GT(std::abs(m[0]["loss"]), 1e-4) << "an off-policy pass: the loss is not trivially 0";
  // No KL and no entropy term, two micro-batches per mini-batch: the logged pg_loss is the loss.
  for (size_t i = 0; i < m.size(); ++i) EXPECT_NEAR(m[i]["pg_loss"], m[i]["loss"], 1e-12) << "variant " << i;
  // Memory beside the gradients: full-vocabulary rows of every position (naive, all rows) vs CCE on
  // loss-mask rows.
  EXPECT_GT(m[0]["peak_memory_update_mib"] - grads_mib, 1.5 * (m[6]["peak_memory_update_mib"] - grads_mib));
  EXPECT_GT(m[0]["peak_memory_update_mib"], m[2]["peak_memory_update_mib"]) << "row selection saves memory";
}

// Token-budget micro-batches on the same first RL step, GRPO and PPO: the same mini-batches in other
// micro-batches (each mini-batch longest first, 60 padded tokens a micro-batch against 2 rows) give the
// same loss and gradient norm, because each mini-batch's global denominator makes the micro-batches' losses
// add up to its own whatever the grouping; only float32 summation order differs.
TEST(MicroBatches, ATokenBudgetTrainsTheFirstStepAsRowCountsDo) {
  TempDir tmp("micro_tokens");
  const Config base = from_warmed_up_model(tmp.path(), /*steps=*/1);
  for (bool ppo : {false, true}) {
    std::vector<std::map<std::string, double>> m;
    for (int64_t budget : {int64_t(0), int64_t(60)}) {
      Config c = base;
      c.train.micro_batch_tokens = budget;
      c.train.micro_batch_size = budget > 0 ? 4 : 2;
      rlt::Run run = make_run(c, (tmp.path() / (std::to_string(ppo) + "_" + std::to_string(budget))).string(), false,
                              ppo ? value_head_params() : ExtraParams{});
      m.push_back(ppo ? train_ppo(run) : train_grpo(run));
    }
    ASSERT_GT(m[0]["reward_std"], 0) << "the first step needs unequal rewards for a non-zero loss";
    EXPECT_EQ(m[1]["reward_mean"], m[0]["reward_mean"]) << "the same rollout";
    EXPECT_NEAR(m[1]["loss"], m[0]["loss"], 1e-6) << (ppo ? "ppo" : "grpo");
    EXPECT_NEAR(m[1]["grad_norm"], m[0]["grad_norm"], 1e-4 * m[0]["grad_norm"]) << (ppo ? "ppo" : "grpo");
    EXPECT_GT(std::abs(m[0]["loss"]), 1e-4) << "an off-policy pass: the loss is not trivially 0";
  }
}

// update_hfu counts what the recompute adds: with model.checkpoint_layers 1 of the model's layers, the
// hardware FLOPs are the model FLOPs plus that layer's share of the layers' forward (projections and
// attention) at every iteration, while update_mfu keeps the model FLOPs over the update's seconds. The
// layers' forward is a third of an iteration's model FLOPs less the head's forward over the sampled tokens
// (tests/model/test_flops.cpp checks those counts by hand). Every layer recomputed, or none, is rejected.
TEST(UpdateMetrics, HfuCountsTheCheckpointedLayersRecompute) {
  TempDir tmp("hfu");
  Config c = varied_first_step_config(/*steps=*/1);
  c.model.activation_checkpointing = true;
  c.model.checkpoint_layers = 1;
  c.train.peak_tflops = 0.5;
  rlt::Run run = make_run(c, tmp.path().string(), false, ExtraParams{});
  std::map<std::string, double> m = train_grpo(run);
  const ModelConfig& shape = run.model.policy->config();
  const double L = double(shape.num_layers);
  ASSERT_GE(L, 2) << "a layer checkpointed and one kept";
  const double per_iteration = m["update_flops"] / double(c.train.num_iterations);
  const double head = forward_flops(shape, SequenceWork{0, 1}).head * m["sampled_tokens"];
  const double layers = per_iteration / 3 - head;
  ASSERT_GT(layers, 0);
  auto ratio = [&](double recomputed) { return 1 + recomputed / L * layers / per_iteration; };
  const double got = m["update_hfu"] / m["update_mfu"];
  EXPECT_NEAR(got, ratio(1), 1e-12);
  EXPECT_NEAR(m["update_mfu"], m["update_flops"] / (m["time_update_s"] * 0.5e12), 1e-12 * m["update_mfu"]);
  EXPECT_GT(std::abs(got - ratio(L)), 1e-3) << "every layer recomputed must be rejected";
  EXPECT_GT(std::abs(got - ratio(0)), 1e-3) << "no recompute must be rejected";
}

// Packed micro-batches (train.pack_sequences) of 60 tokens, and of 160 with each prompt run once for its
// answers (train.share_prompts, the default), against right-padded rows of 2 on the same first RL
// step, GRPO and PPO (whose value head reads the packed hidden states by row): the same loss, value loss,
// log-prob mean and gradient norm; the shared layout forwards fewer tokens than the step holds, the
// others all of them (update_forwarded_tokens). One mini-batch in one pass, so that every forward runs on the
// rollout's weights: after an optimizer step AdamW's first update, about lr times the sign of each gradient element,
// turns the layouts' float32 rounding in near-zero elements into differences of 2 lr. The warm-up that
// make_run trains keeps one layout, so both runs start from the same weights.
TEST(MicroBatches, PackedMicroBatchesTrainTheFirstStepAsPaddedRowsDo) {
  TempDir tmp("micro_packed");
  for (bool ppo : {false, true}) {
    std::vector<std::map<std::string, double>> m;
    for (int layout : {0, 1, 2}) {  // padded, packed, packed with shared prompts
      const bool packed = layout > 0;
      Config c = varied_first_step_config(/*steps=*/1);
      c.train.mini_batch_size = 0;  // all, in one pass
      c.train.num_iterations = 1;
      c.train.micro_batch_tokens = layout == 2 ? 160 : packed ? 60 : 0;  // shared: room for a prompt's answers
      c.train.micro_batch_size = packed ? 8 : 2;
      rlt::Run run = make_run(c, (tmp.path() / (std::to_string(ppo) + "_" + std::to_string(layout))).string(), false,
                              ppo ? value_head_params() : ExtraParams{});
      run.config.train.pack_sequences = packed;
      run.config.train.share_prompts = layout == 2;
      m.push_back(ppo ? train_ppo(run) : train_grpo(run));
    }
    const std::string what = ppo ? "ppo" : "grpo";
    ASSERT_GT(m[0]["reward_std"], 0) << "the first step needs unequal rewards for a non-zero gradient";
    EXPECT_GT(m[0]["grad_norm"], 1e-3) << what << ": a gradient to compare";
    EXPECT_EQ(m[0]["update_forwarded_tokens"], m[0]["tokens"]) << what;
    EXPECT_EQ(m[1]["update_forwarded_tokens"], m[1]["tokens"]) << what;
    EXPECT_LT(m[2]["update_forwarded_tokens"], m[2]["tokens"]) << what << ": no prompt was shared";
    for (int layout : {1, 2}) {
      const std::string w = what + (layout == 2 ? " shared" : " packed");
      EXPECT_EQ(m[layout]["reward_mean"], m[0]["reward_mean"]) << w << ": the same rollout";
      EXPECT_NEAR(m[layout]["loss"], m[0]["loss"], 1e-6) << w;
      EXPECT_NEAR(m[layout]["logprob_mean"], m[0]["logprob_mean"], 1e-6) << w;
      EXPECT_NEAR(m[layout]["grad_norm"], m[0]["grad_norm"], 1e-4 * m[0]["grad_norm"]) << w;
      if (ppo) EXPECT_NEAR(m[layout]["value_loss"], m[0]["value_loss"], 1e-6) << w;
    }
  }
}

// Wrong data parallelism for the test below: gradients averaged over the ranks (DDP's default, which
// with denominators already summed over the ranks halves the gradient), or not reduced at all (each rank
// steps on its own half of the batch).
class WrongGradients : public testing::ForwardingCollectives {
 public:
  WrongGradients(std::shared_ptr<Collectives> inner, bool average)
      : ForwardingCollectives(std::move(inner)), average_(average) {}
  std::unique_ptr<Pending> all_reduce_start(const std::vector<at::Tensor>& t) override {
    if (average_) {
      inner_->all_reduce(t, ReduceOp::kSum);
      for (const auto& g : t) g.div_(world());
    }
    struct Done : Pending {
      void wait() override {}
    };
    return std::make_unique<Done>();
  }

 private:
  bool average_;
};

// Data parallelism on two thread ranks (parallel/dist.h, the store's collectives) against one process, fp32,
// same seed and config: 4 prompts x 4 samples a step, off-policy (two iterations over two mini-batches, so
// the loss depends on the log-probs), 2 ranks x 2 prompts against 1 x 4. The same trajectories, the same
// first-step loss (1e-5) and gradient norm (1e-5 relative), after 3 steps the same weights (within 1e-4 of
// the update's size) and both ranks' weights equal bit for bit. Batch shapes differ between the two (each
// rank pads its own sequences), so agreement is to fp32 rounding, not bits. The wrong implementations:
// averaged gradients (half the gradient norm) and unreduced ones (the weights part). The ranks deal each
// mini-batch's sequences by tokens (train.balance_tokens), so each trains on some sequences the other
// sampled.
TEST_P(Trainers, TwoRanksTrainLikeOneProcess) {
  TempDir tmp(GetParam() ? "ppo_dp" : "grpo_dp");
  Config c = varied_first_step_config(/*steps=*/3);
  c.train.balance_tokens = true;
  c.train.prompts_per_step = 4;
  c.train.mini_batch_size = 8;  // two prompts: one per rank
  c.train.old_logprobs = OldLogprobs::kRecompute;
  c.train.eval_prompts = 3;  // held out, shared 2 + 1 over the ranks; 2 samples each, after step 3
  c.train.eval_samples = 2;
  c.train.eval_every = 3;
  struct Result {
    std::vector<nlohmann::json> rows;
    std::vector<std::vector<at::Tensor>> params;  // per rank
  };
  auto train_on = [&](int world, const std::string& name, int64_t steps,
                      std::function<std::shared_ptr<Collectives>(std::shared_ptr<Collectives>)> wrap = nullptr) {
    Config cfg = c;
    cfg.train.steps = steps;
    const std::string dir = (tmp.path() / name).string();
    Result r;
    r.params.resize(world);
    auto body = [&](int rank, std::shared_ptr<Collectives> dist) {
      rlt::Run run = make_run(cfg, dir, /*resume=*/false, extra(), world > 1 ? dist : nullptr);
      train()(run);
      for (const auto& p : run.model.policy->parameters()) r.params[rank].push_back(p.detach().clone());
    };
    if (world == 1)
      body(0, nullptr);
    else
      rlt::testing::on_thread_ranks(world, body, std::chrono::seconds(300), wrap);
    r.rows = read_metrics(dir);
    return r;
  };
  const Result start = train_on(1, "start", 0);
  const Result one = train_on(1, "one", 3);
  const Result two = train_on(2, "two", 3);
  auto update_diff = [&](const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
    double d = 0, u = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      d += (a[i] - b[i]).to(at::kDouble).square().sum().item<double>();
      u += (a[i] - start.params[0][i]).to(at::kDouble).square().sum().item<double>();
    }
    return std::sqrt(d / u);
  };
  ASSERT_EQ(one.rows.size(), 3u);
  ASSERT_EQ(two.rows.size(), 3u) << "rank 0 alone writes metrics.jsonl";
  ASSERT_GT(one.rows[0]["reward_std"].get<double>(), 1e-3) << "unequal rewards: a non-zero gradient";
  for (size_t i = 0; i < 3; ++i) {
    for (const char* k : {"reward_mean", "accuracy", "sampled_tokens", "tokens", "response_length_max"}) {
      EXPECT_EQ(two.rows[i][k].get<double>(), one.rows[i][k].get<double>()) << k << ", step " << i + 1;
    }
    EXPECT_EQ(two.rows[i]["world_size"].get<double>(), 2.0);
  }
  EXPECT_NEAR(two.rows[0]["loss"].get<double>(), one.rows[0]["loss"].get<double>(), 1e-5);
  const double g1 = one.rows[0]["grad_norm"].get<double>();
  EXPECT_NEAR(two.rows[0]["grad_norm"].get<double>(), g1, 1e-5 * g1);
  EXPECT_NEAR(two.rows[0]["entropy"].get<double>(), one.rows[0]["entropy"].get<double>(), 1e-5);
  for (const char* k : {"eval_pass@1", "eval_pass@2", "eval_avg@2", "eval_tool_use"}) {  // summed over ranks
    ASSERT_TRUE(one.rows[2].contains(k)) << k;
    EXPECT_NEAR(two.rows[2][k].get<double>(), one.rows[2][k].get<double>(), 1e-12) << k;
  }
  for (size_t i = 0; i < two.params[0].size(); ++i) {
    ASSERT_TRUE(at::equal(two.params[0][i], two.params[1][i])) << "the ranks' weights part at " << i;
  }
  EXPECT_LT(update_diff(two.params[0], one.params[0]), 1e-4);
  std::cerr << std::scientific << std::setprecision(2) << "two ranks against one: step-1 loss "
            << two.rows[0]["loss"].get<double>() - one.rows[0]["loss"].get<double>() << ", grad norm (relative) "
            << two.rows[0]["grad_norm"].get<double>() / g1 - 1 << ", weights after 3 steps (relative to the update) "
            << update_diff(two.params[0], one.params[0]) << "\n";

  const Result averaged = train_on(2, "averaged", 1, [](std::shared_ptr<Collectives> d) {
    return std::make_shared<WrongGradients>(d, /*average=*/true);
  });
  // Half the gradient at the first optimizer step; the step's mean over its four moves with the weights.
  EXPECT_GT(std::abs(averaged.rows[0]["grad_norm"].get<double>() - g1), 0.3 * g1) << "averaging halves the gradient";
  const Result unreduced = train_on(2, "unreduced", 3, [](std::shared_ptr<Collectives> d) {
    return std::make_shared<WrongGradients>(d, /*average=*/false);
  });
  EXPECT_GT(update_diff(unreduced.params[0], one.params[0]), 1e-2);
}

INSTANTIATE_TEST_SUITE_P(GrpoAndPpo, Trainers, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Ppo" : "Grpo"; });

}  // namespace
}  // namespace rlt

namespace rlt {
namespace {

// PPO with a critic of its own (critic.shared false), end to end: the value head is gone from the policy's
// run, every first value is 0 (the critic's head starts at zero) and later ones are not, the checkpoint's
// critic/ is a token-classification folder, and a run stopped after step 2 and resumed reproduces the
// uninterrupted run bit for bit, the critic's own figures included (its weights and AdamW state come back
// from critic/ and critic_optimizer/, its step count from state.json; a count lost there fails that).
TEST(SeparateCritic, RunsEndToEndAndAResumedRunReproducesItExactly) {
  TempDir tmp("ppo_critic");
  Config c = tiny_config();
  c.critic.shared = false;
  c.critic.lr = 1e-2;
  c.train.old_logprobs = OldLogprobs::kRecompute;  // bit for bit (see Trainers above)
  c.rollout.max_batch = 4;
  // Plain generation: a sandbox reply's timing would change a decode step's rows, and with them the CPU
  // GEMMs' last bits, between the two runs.
  c.rollout.tools = false;
  const std::string full = (tmp.path() / "full").string(), part = (tmp.path() / "part").string();
  {
    rlt::Run run = make_run(c, full, /*resume=*/false, value_head_params());
    EXPECT_TRUE(run.model.extra.empty()) << "no value head on the policy's trunk";
    train_ppo(run);
    ASSERT_TRUE(run.model.critic);
    EXPECT_EQ(run.model.critic->counters.optimizer_steps, run.counters.optimizer_steps);
  }
  const auto a = read_metrics(full);
  ASSERT_EQ(a.size(), 4u);
  EXPECT_EQ(a[0]["value_mean"].get<double>(), 0.0) << "the critic's head starts at zero";
  EXPECT_NE(a[1]["value_mean"].get<double>(), 0.0) << "the critic trained";
  for (const auto& row : a) {
    for (const char* k : {"value_loss", "critic_grad_norm", "critic_lr", "value_clip_frac"}) {
      ASSERT_TRUE(row.contains(k) && row[k].is_number()) << k << " in " << row.dump();
    }
    EXPECT_GT(row["critic_grad_norm"].get<double>(), 0);
  }
  EXPECT_NEAR(a[0]["critic_lr"].get<double>(), 1e-2 / 3e-3 * a[0]["lr"].get<double>(), 1e-12)
      << "critic.lr on train.lr's schedule";
  const ModelConfig saved = load_model_config(full + "/checkpoint/critic");
  EXPECT_EQ(saved.head, ModelHead::kTokenScore);
  EXPECT_EQ(saved.num_labels, 1);
  EXPECT_TRUE(std::filesystem::exists(full + "/checkpoint/critic_optimizer/optimizer-0.safetensors"));

  {
    rlt::Run run = make_run(c, part, /*resume=*/false, value_head_params());
    run.stop_after = 2;
    train_ppo(run);
  }
  // A copy of the checkpoint whose critic lost its step count (its AdamW and schedule restart): the twin.
  const std::string twin = (tmp.path() / "twin").string();
  std::filesystem::copy(part, twin, std::filesystem::copy_options::recursive);
  {
    const std::string path = twin + "/checkpoint/state.json";
    nlohmann::json state = nlohmann::json::parse(std::ifstream(path));
    state["critic"]["optimizer_steps"] = 0;
    std::ofstream(path) << state.dump();
  }
  run_to(c, part, /*resume=*/true, &train_ppo, value_head_params());
  run_to(c, twin, /*resume=*/true, &train_ppo, value_head_params());
  const auto b = read_metrics(part), w = read_metrics(twin);
  ASSERT_EQ(b.size(), 4u);
  ASSERT_EQ(w.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    for (const char* k : {"loss", "grad_norm", "value_loss", "value_mean", "critic_grad_norm", "reward_mean"}) {
      EXPECT_EQ(a[i][k].get<double>(), b[i][k].get<double>()) << k << " at step " << i + 1;
    }
  }
  EXPECT_NE(a[3]["value_mean"].get<double>(), w[3]["value_mean"].get<double>()) << "the twin must differ";

  // Input errors: a resumed folder without critic/; grpo_train has no critic.
  remove_tree(part + "/checkpoint/critic");
  Config more = c;
  more.train.steps = 5;
  EXPECT_THROW(run_to(more, part, /*resume=*/true, &train_ppo, value_head_params()), RunError);
  EXPECT_THROW(make_run(c, (tmp.path() / "grpo").string(), false, ExtraParams{}), RunError);
}

// A critic of its own beside LoRA's adapters: a whole model (every weight trained, none shared with the
// policy) started from the policy, while the policy's base stays frozen; a run stopped after step 2 and
// resumed (the adapters from adapter/, the critic from critic/) reproduces the uninterrupted one bit for
// bit. Rejected: a critic sharing the policy's base tensors (its steps would move the policy's base).
TEST(SeparateCritic, TrainsAWholeModelBesideLoraAdapters) {
  TempDir tmp("ppo_critic_lora");
  Config c = tiny_config();
  c.critic.shared = false;
  c.critic.lr = 1e-2;
  c.lora.rank = 4;
  c.lora.alpha = 8;
  c.train.old_logprobs = OldLogprobs::kRecompute;  // bit for bit (see Trainers above)
  c.rollout.max_batch = 4;
  c.rollout.tools = false;  // plain generation, as above: the two runs decode the same rows
  const std::string full = (tmp.path() / "full").string(), part = (tmp.path() / "part").string();
  {
    rlt::Run run = make_run(c, full, /*resume=*/false, value_head_params());
    std::map<std::string, at::Tensor> base;
    for (const auto& [name, t] : run.model.policy->named_parameters()) base[name] = t.detach().clone();
    train_ppo(run);
    ASSERT_TRUE(run.model.critic);
    const Transformer& critic = *run.model.critic->state.policy;
    EXPECT_FALSE(critic.has_lora());
    EXPECT_EQ(critic.trainable_parameters().size(), critic.parameters().size()) << "every weight trained";
    std::set<const void*> policy_storage;
    for (const auto& [name, t] : run.model.policy->named_parameters()) {
      policy_storage.insert(t.data_ptr());
      EXPECT_TRUE(at::equal(t, base.at(name))) << name << ": the policy's base moved";
    }
    int64_t trained = 0;
    for (const auto& [name, t] : critic.named_parameters()) {
      EXPECT_EQ(policy_storage.count(t.data_ptr()), 0u) << name << " is the policy's tensor";
      const auto it = base.find(name);
      if (it != base.end() && !at::equal(t.detach(), it->second)) ++trained;
    }
    EXPECT_GT(trained, 0) << "the critic's trunk trained";
  }
  const auto a = read_metrics(full);
  ASSERT_EQ(a.size(), 4u);
  EXPECT_EQ(a[0]["value_mean"].get<double>(), 0.0) << "the critic's head starts at zero";
  EXPECT_NE(a[1]["value_mean"].get<double>(), 0.0) << "the critic trained";
  {
    rlt::Run run = make_run(c, part, /*resume=*/false, value_head_params());
    run.stop_after = 2;
    train_ppo(run);
  }
  EXPECT_TRUE(std::filesystem::exists(part + "/checkpoint/adapter/adapter_config.json"));
  EXPECT_EQ(load_model_config(part + "/checkpoint/critic").head, ModelHead::kTokenScore);
  run_to(c, part, /*resume=*/true, &train_ppo, value_head_params());
  const auto b = read_metrics(part);
  ASSERT_EQ(b.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    for (const char* k : {"loss", "grad_norm", "value_loss", "value_mean", "critic_grad_norm", "reward_mean"}) {
      EXPECT_EQ(a[i][k].get<double>(), b[i][k].get<double>()) << k << " at step " << i + 1;
    }
  }
}

// The pinned host memory check, through make_run and before any weight loads (a fake MemAvailable):
// train.offload's masters and moments (unsharded, each rank holds them whole) on a host with 1.5 times one
// rank's share train on one rank, and two thread ranks of that host are refused alike, naming both
// figures. Rejected: a check of one rank's share alone (the two ranks would pass).
TEST(HostMemory, RanksOfOneHostThatCannotPinTheirStateAreRefused) {
  TempDir tmp("host_memory");
  Config c = tiny_config();
  c.sft.steps = 0;
  c.train.offload = Offload::kOptimizer;
  c.train.mini_batch_size = 0;  // the whole step: two ranks split it
  int64_t share = 0;
  {
    rlt::Run run = make_run(c, (tmp.path() / "one").string(), /*resume=*/false, {});
    share = plan_memory(run.config, run.model.policy->config(), 1).host_total();
  }
  ASSERT_GT(share, 0);
  set_host_memory_probe([share] { return share * 3 / 2; });
  EXPECT_NO_THROW(make_run(c, (tmp.path() / "fits").string(), /*resume=*/false, {}));
  std::vector<std::string> errors(2);
  EXPECT_THROW(rlt::testing::on_thread_ranks(2,
                                             [&](int rank, std::shared_ptr<Collectives> dist) {
                                               try {
                                                 make_run(c, (tmp.path() / "two").string(), false, {}, dist);
                                               } catch (const RunError& e) {
                                                 errors[rank] = e.what();
                                                 throw;
                                               }
                                             }),
               RunError);
  set_host_memory_probe(nullptr);
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("pinned host memory on one host (2 ranks x " + bytes_text(share) + ")"), std::string::npos) << e;
    EXPECT_NE(e.find("the host has " + bytes_text(share * 3 / 2) + " available"), std::string::npos) << e;
  }
}

// The policy's gradient carries no value term with a critic of its own: ppo.vf_coef moves nothing of the
// first step's policy update (loss, gradient norm) nor the critic's (its loss is the value loss alone). With
// the shared head (the twin) vf_coef changes the policy's loss and gradient.
TEST(SeparateCritic, TheValueLossStaysOutOfThePolicysGradient) {
  TempDir tmp("ppo_vf_coef");
  std::map<std::pair<bool, double>, nlohmann::json> first;
  auto at = [&](bool shared, double vf, const char* k) { return first[std::make_pair(shared, vf)][k].get<double>(); };
  for (bool shared : {false, true}) {
    for (double vf : {0.5, 5.0}) {
      Config c = varied_first_step_config(/*steps=*/1);
      c.critic.shared = shared;
      c.ppo.vf_coef = vf;
      c.train.old_logprobs = OldLogprobs::kRecompute;  // bit for bit (see Trainers above)
      c.rollout.max_batch = 4;
      const std::string dir = (tmp.path() / (std::to_string(shared) + "_" + std::to_string(vf))).string();
      run_to(c, dir, false, &train_ppo, value_head_params());
      first[std::make_pair(shared, vf)] = read_metrics(dir).at(0);
    }
  }
  for (const char* k : {"loss", "grad_norm", "value_loss", "critic_grad_norm"}) {
    EXPECT_EQ(at(false, 0.5, k), at(false, 5.0, k)) << k;
  }
  EXPECT_NE(at(true, 0.5, "loss"), at(true, 5.0, "loss"));
  EXPECT_NE(at(true, 0.5, "grad_norm"), at(true, 5.0, "grad_norm"));
}

// A critic of its own over two thread ranks trains as one process does: unsharded (its gradients through a
// reducer of its own) and at shard stage gradients (a sharded state of its own): the first step's value loss
// and the critic's weights after 2 steps (within 1e-4 of their update), both ranks' equal bit for bit.
TEST(SeparateCritic, TwoRanksTrainTheCriticLikeOneProcess) {
  TempDir tmp("ppo_critic_dp");
  Config c = varied_first_step_config(/*steps=*/2);
  c.critic.shared = false;
  c.critic.lr = 1e-2;
  c.train.prompts_per_step = 4;
  c.train.mini_batch_size = 8;
  c.train.old_logprobs = OldLogprobs::kRecompute;
  struct Result {
    std::vector<nlohmann::json> rows;
    std::vector<std::vector<at::Tensor>> critic;  // per rank
  };
  auto train_on = [&](int world, const std::string& name, int64_t steps, CriticShard shard) {
    Config cfg = c;
    cfg.train.steps = steps;
    cfg.critic.shard = shard;
    const std::string dir = (tmp.path() / name).string();
    Result r;
    r.critic.resize(world);
    auto body = [&](int rank, std::shared_ptr<Collectives> dist) {
      rlt::Run run = make_run(cfg, dir, /*resume=*/false, value_head_params(), world > 1 ? dist : nullptr);
      train_ppo(run);
      for (const auto& p : run.model.critic->state.policy->parameters()) r.critic[rank].push_back(p.detach().clone());
    };
    if (world == 1)
      body(0, nullptr);
    else
      rlt::testing::on_thread_ranks(world, body, std::chrono::seconds(300));
    r.rows = read_metrics(dir);
    return r;
  };
  const Result start = train_on(1, "start", 0, CriticShard::kNone);
  const Result one = train_on(1, "one", 2, CriticShard::kNone);
  auto update_diff = [&](const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
    double d = 0, u = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      d += (a[i] - b[i]).to(at::kDouble).square().sum().item<double>();
      u += (a[i] - start.critic[0][i]).to(at::kDouble).square().sum().item<double>();
    }
    return std::sqrt(d / u);
  };
  for (CriticShard shard : {CriticShard::kNone, CriticShard::kGradients}) {
    const Result two = train_on(2, std::string("two_") + enum_to_string(shard), 2, shard);
    const std::string what = enum_to_string(shard);
    ASSERT_EQ(two.rows.size(), 2u) << what;
    EXPECT_NEAR(two.rows[0]["value_loss"].get<double>(), one.rows[0]["value_loss"].get<double>(), 1e-5) << what;
    const double g = one.rows[0]["critic_grad_norm"].get<double>();
    EXPECT_NEAR(two.rows[0]["critic_grad_norm"].get<double>(), g, 1e-5 * g) << what;
    for (size_t i = 0; i < two.critic[0].size(); ++i) {
      ASSERT_TRUE(at::equal(two.critic[0][i], two.critic[1][i])) << what << ": the ranks' critics part at " << i;
    }
    EXPECT_LT(update_diff(two.critic[0], one.critic[0]), 1e-4) << what;
  }
}

}  // namespace
}  // namespace rlt

namespace rlt {
namespace {

// train.phase_offload: the training state leaves for host memory during each rollout and evaluation and
// comes back bit for bit, so a run trains exactly as the resident one does.
struct PhaseRun {
  std::vector<nlohmann::json> metrics;
  std::vector<at::Tensor> weights;  // rank 0's after the run
};

Config phase_offload_config(int world) {
  Config c = varied_first_step_config(/*steps=*/3);
  c.train.old_logprobs = OldLogprobs::kRecompute;  // bit for bit (see Trainers above)
  c.rollout.max_batch = 4;
  c.train.eval_prompts = 2;  // an evaluation after the last step: parked too
  c.train.eval_every = 3;
  if (world > 1) {
    c.train.prompts_per_step = 4;  // a mini-batch of two prompts: one per rank
    c.train.mini_batch_size = 8;
  }
  return c;
}

PhaseRun train_phases(const Config& cfg, int world, const std::string& dir,
                      PhaseParking::Fault fault = PhaseParking::Fault::kNone) {
  std::vector<std::vector<at::Tensor>> params(world);
  auto body = [&](int rank, std::shared_ptr<Collectives> dist) {
    rlt::Run run = make_run(cfg, dir, /*resume=*/false, ExtraParams{}, world > 1 ? dist : nullptr);
    if (fault != PhaseParking::Fault::kNone) run.model.parking = std::make_shared<PhaseParking>(fault);
    train_grpo(run);
    const GatheredWeights whole(run.model.sharded);  // shard parameters: the chunks as whole weights
    for (const auto& p : run.model.policy->parameters()) params[rank].push_back(p.detach().clone());
  };
  if (world == 1)
    body(0, nullptr);
  else
    rlt::testing::on_thread_ranks(world, body, std::chrono::seconds(300));
  return {read_metrics(dir), params[0]};
}

bool same_weights(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_GT(a[i].numel(), 0) << "a weight read outside its gather";
    if (!at::equal(a[i], b[i])) return false;
  }
  return true;
}

// Each of a parked run's 3 steps has the resident run's loss and gradient norm and logs its moves.
void expect_same_steps(const PhaseRun& parked, const PhaseRun& resident, const std::string& what) {
  ASSERT_EQ(parked.metrics.size(), 3u) << what;
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(parked.metrics[i]["loss"].get<double>(), resident.metrics[i]["loss"].get<double>()) << what << " " << i;
    EXPECT_EQ(parked.metrics[i]["grad_norm"].get<double>(), resident.metrics[i]["grad_norm"].get<double>()) << what;
    ASSERT_TRUE(parked.metrics[i].contains("time_phase_moves_s")) << parked.metrics[i].dump();
    EXPECT_GT(parked.metrics[i]["time_phase_moves_s"].get<double>(), 0);
    EXPECT_FALSE(resident.metrics[i].contains("time_phase_moves_s"));
    // The moves out and back are phases of their own: the rollout's phase runs with the state parked (the
    // GPU table of docs/benchmarks.md measures it; this model's state is smaller than its rollout's noise).
    for (const char* k : {"memory_allocated_peak_park_mib", "memory_allocated_peak_unpark_mib"}) {
      EXPECT_TRUE(parked.metrics[i].contains(k)) << k << " in " << parked.metrics[i].dump();
      EXPECT_FALSE(resident.metrics[i].contains(k));
    }
  }
  EXPECT_TRUE(same_weights(parked.weights, resident.weights)) << what << ": the weights after 3 steps";
}

// optimizer: one process (AdamW's moments; fp32 has no masters) and two thread ranks at shard stage
// gradients (the masters and moments; the gradient chunks freed as zeros), 3 steps, the weights equal bit
// for bit. The twin's host copies are written once (later rollouts return step-1 moments), and it must
// part from the resident run.
TEST(PhaseOffload, ARunTrainsAsTheResidentOneAndAWrongReturnDoesNot) {
  TempDir tmp("phase_offload");
  for (int world : {1, 2}) {
    const std::string w = std::to_string(world);
    Config c = phase_offload_config(world);
    if (world > 1) c.train.shard = ShardStage::kGradients;
    const PhaseRun resident = train_phases(c, world, (tmp.path() / ("resident" + w)).string());
    c.train.phase_offload = PhaseOffload::kOptimizer;
    expect_same_steps(train_phases(c, world, (tmp.path() / ("parked" + w)).string()), resident, w + " rank(s)");
    if (world == 1) {
      const PhaseRun wrong =
          train_phases(c, world, (tmp.path() / ("wrong" + w)).string(), PhaseParking::Fault::kStaleCopy);
      EXPECT_FALSE(same_weights(wrong.weights, resident.weights)) << "the twin must fail";
    }
  }
}

// training_state on two thread ranks in fp32, at shard stage parameters (the weight chunks leave once the
// rollout's whole weights are gathered) and under train.offload optimizer (the gradient and weight chunks
// it leaves on the device): 3 steps equal the resident run's bit for bit. Twins: the state put back one
// element over (as moments on the wrong slice), and the host copies written once (a stale weight chunk
// gathered for a later rollout and update).
TEST(PhaseOffload, TheTrainingStateLeavesAndARunTrainsAsTheResidentOne) {
  TempDir tmp("phase_training_state");
  for (const std::string stage : {"parameters", "offload"}) {
    Config c = phase_offload_config(2);
    if (stage == "parameters") {
      c.train.shard = ShardStage::kParameters;
      c.model.activation_checkpointing = true;  // the stage gathers each layer again for its backward
    } else {
      c.train.shard = ShardStage::kGradients;
      c.train.offload = Offload::kOptimizer;
    }
    const PhaseRun resident = train_phases(c, 2, (tmp.path() / ("resident_" + stage)).string());
    c.train.phase_offload = PhaseOffload::kTrainingState;
    expect_same_steps(train_phases(c, 2, (tmp.path() / ("parked_" + stage)).string()), resident, stage);
    if (stage != "parameters") continue;
    for (const auto fault : {PhaseParking::Fault::kWrongSlice, PhaseParking::Fault::kStaleCopy}) {
      const std::string name = fault == PhaseParking::Fault::kWrongSlice ? "wrong_slice" : "stale";
      const PhaseRun wrong = train_phases(c, 2, (tmp.path() / name).string(), fault);
      EXPECT_FALSE(same_weights(wrong.weights, resident.weights)) << name << ": the twin must fail";
    }
  }
}

}  // namespace
}  // namespace rlt

// Checkpoints and the disk: checkpoint_bytes is the tensors a save writes, byte for byte (the safetensors
// files' payloads); a save the file system cannot hold is refused before it writes anything, with the
// numbers, and the previous checkpoint stays whole: a resumed run finishes from it.
namespace rlt {
namespace {

// The tensor bytes of every .safetensors file under dir: each file less its 8-byte length and header.
uint64_t safetensors_payload(const std::string& dir) {
  uint64_t bytes = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (e.path().extension() != ".safetensors") continue;
    std::ifstream f(e.path(), std::ios::binary);
    uint64_t header = 0;
    f.read(reinterpret_cast<char*>(&header), 8);
    bytes += std::filesystem::file_size(e.path()) - 8 - header;
  }
  return bytes;
}

TEST(Checkpoint, ASaveTheDiskCannotHoldIsRefusedAndThePreviousOneStaysWhole) {
  TempDir tmp("disk");
  Config c = tiny_config();  // 4 steps, a checkpoint every 2
  const std::string dir = (tmp.path() / "run").string();
  std::vector<uint64_t> needed;
  rlt::Run* current = nullptr;
  // The first save finds room; the second finds 1 KiB free.
  set_free_space_probe([&](const std::string&) -> uint64_t {
    needed.push_back(checkpoint_bytes(*current));
    return needed.size() == 1 ? (uint64_t(1) << 50) : 1024;
  });
  std::string message;
  {
    rlt::Run run = make_run(c, dir, /*resume=*/false);
    current = &run;
    try {
      train_grpo(run);
    } catch (const RunError& e) {
      message = e.what();
    }
  }
  set_free_space_probe(nullptr);
  ASSERT_EQ(needed.size(), 2u);
  const std::string need = "needs " + bytes_text(int64_t(needed[1])) + " and";
  for (const std::string part : {std::string("checkpoint"), need, std::string("has 1.00 KiB free"),
                                 std::string("nothing was written"), std::string("previous checkpoint is kept")}) {
    EXPECT_NE(message.find(part), std::string::npos) << part << " in: " << message;
  }
  const std::string ckpt = dir + "/checkpoint";
  EXPECT_FALSE(std::filesystem::exists(ckpt + ".tmp")) << "nothing was written";
  const nlohmann::json state = nlohmann::json::parse(std::ifstream(ckpt + "/state.json"));
  EXPECT_EQ(state["step"].get<int64_t>(), 2) << "the previous checkpoint is the one kept";
  // The estimate is the payload to the byte: the weights, then the optimizer's masters (here the fp32
  // weights themselves) and both moments. An estimate that missed a tensor, or counted one twice, fails.
  EXPECT_EQ(needed[0], safetensors_payload(ckpt));
  EXPECT_EQ(needed[1], needed[0]) << "the same state at step 4";
  {
    rlt::Run run = make_run(c, dir, /*resume=*/true);
    EXPECT_EQ(run.counters.step, 2);
    train_grpo(run);
    EXPECT_EQ(run.counters.step, 4);
  }
  EXPECT_EQ(nlohmann::json::parse(std::ifstream(ckpt + "/state.json"))["step"].get<int64_t>(), 4);
}

}  // namespace
}  // namespace rlt
