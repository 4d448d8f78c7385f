// score_rewards and reward_metrics (trainer/rewards.h): a run's trajectories scored by reward.script with
// each trajectory's own prompt and answer, only the training scorings counted in the step's metrics, and
// those metrics summed over two thread ranks whose scripts returned different fields. Each check also runs
// on a wrong twin it must reject.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "rollout/reward_model.h"
#include "tests/common/fixtures.h"
#include "tests/common/tmpdir.h"
#include "tests/trainer/thread_ranks.h"
#include "trainer/rewards.h"
#include "trainer/run.h"

namespace rlt {
namespace {

// A run with only what scoring reads: the reward and sandbox sections.
rlt::Run python_run(const std::string& script) {
  rlt::Run run;
  run.config.reward.kind = RewardKind::kPython;
  run.config.reward.script = script;
  run.config.reward.correct = 1.0;
  run.config.reward.wrong = -0.75;
  run.config.sandbox.workers = 2;
  run.config.sandbox.timeout_s = 2.0;
  return run;
}

std::string write_script(const testing::TempDir& dir, const std::string& text) {
  const std::string path = (dir.path() / "reward.py").string();
  std::ofstream(path) << text;
  return path;
}

// The response's number of characters, plus 10 when the answer is in it, plus the prompt's length / 100;
// 'bad' raises. A field 'hit'.
constexpr const char* kScript = R"PY(
def reward(prompt, response, answer):
    if response == 'bad':
        raise ValueError('bad response')
    hit = answer in response
    return {'score': len(response) + (10 if hit else 0) + len(prompt) / 100, 'hit': 1.0 if hit else 0.0}
)PY";

TEST(ScoreRewards, EachTrajectoryGetsItsPromptsAnswerAndOnlyTrainingIsCounted) {
  testing::TempDir dir("score_rewards");
  rlt::Run run = python_run(write_script(dir, kScript));
  const std::vector<PromptExample> examples{{"abcd", "42", "test:1", {}}, {"ab", "7", "test:2", {}}};
  std::vector<Trajectory> trajs(5);
  const std::vector<std::pair<int64_t, std::string>> rows{{0, "42"}, {0, "x"}, {1, "7 7"}, {1, "bad"}, {1, "42"}};
  for (size_t i = 0; i < rows.size(); ++i) {
    trajs[i].prompt_index = rows[i].first;
    trajs[i].response_text = rows[i].second;
  }
  ::testing::internal::CaptureStderr();
  const RewardTally step = score_rewards(run, trajs, examples);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("ValueError: bad response"), std::string::npos) << err;
  // "42" for "42": 2 + 10 + 0.04; "x": 1 + 0.04; "7 7" for "7": 3 + 10 + 0.02; "bad": reward.wrong; "42" for
  // "7": 2 + 0.02. Correct: score >= 1.
  const std::vector<double> want{12.04, 1.04, 13.02, -0.75, 2.02};
  const std::vector<bool> correct{true, true, true, false, true};
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_NEAR(trajs[i].reward, want[i], 1e-12) << i;  // len(prompt) / 100 is a rounded float64 division
    EXPECT_EQ(trajs[i].correct, correct[i]) << i;
  }
  std::vector<Trajectory> eval = trajs;
  score_rewards(run, eval, examples);  // an evaluation: its tally joins no step's

  const auto check = [](const std::map<std::string, double>& m) -> std::string {
    if (!m.count("reward_errors") || m.at("reward_errors") != 1) return "reward_errors";
    // 'hit' over the 4 trajectories that returned it: 1, 0, 1, 0.
    if (!m.count("reward/hit") || m.at("reward/hit") != 0.5) return "reward/hit";
    return "";
  };
  EXPECT_EQ(check(reward_metrics(run, step)), "");
  // Twin: the evaluation's scoring counted too (its failure makes 2; the mean of hit stays 0.5).
  EXPECT_NE(check({{"reward_errors", 2}, {"reward/hit", 0.5}}), "");
}

TEST(ScoreRewards, OtherKindsAreTheBuiltInMatcherAndHaveNoScriptMetrics) {
  rlt::Run run;
  run.config.reward.kind = RewardKind::kBoxed;
  std::vector<Trajectory> trajs(2);
  trajs[0].response_text = "so \\boxed{6}";
  trajs[1].response_text = "so \\boxed{5}";
  score_rewards(run, trajs, {{"What is 2 * 3?", "6", "test:1", {}}});
  EXPECT_EQ(trajs[0].reward, 1.0);
  EXPECT_TRUE(trajs[0].correct);
  EXPECT_EQ(trajs[1].reward, -1.0);
  EXPECT_FALSE(run.rollout.rewards);
  // Only the scoring's time: no script metrics, no terms.
  const auto m = reward_metrics(run, {});
  EXPECT_EQ(m.size(), 1u);
  EXPECT_EQ(m.count("time_reward_s"), 1u);
}

// Each rank's tally of the step's batch: rank 1 has a field rank 0 never saw.
RewardTally rank_tally(int rank) {
  RewardTally t;
  if (rank == 0) {
    t.scored = 4, t.failed = 1, t.seconds = 0.5;
    t.fields["a"] = {3.0, 2};
  } else {
    t.scored = 4, t.failed = 2, t.seconds = 1.25;
    t.fields["a"] = {1.0, 1};
    t.fields["b"] = {4.0, 2};
  }
  return t;
}

// "" when m is the two ranks' totals: 3 failures; a = (3 + 1) / (2 + 1); b = 4 / 2; the slower rank's time.
std::string check_two_ranks(const std::map<std::string, double>& m) {
  if (!m.count("reward_errors") || m.at("reward_errors") != 3) return "reward_errors";
  if (!m.count("time_reward_s") || m.at("time_reward_s") != 1.25) return "time_reward_s";
  if (!m.count("reward/a") || std::abs(m.at("reward/a") - 4.0 / 3.0) > 1e-15) return "reward/a";
  if (!m.count("reward/b") || m.at("reward/b") != 2.0) return "reward/b";
  return m.size() == 4 ? "" : "extra metrics";
}

TEST(ScoreRewards, MetricsAreSummedOverRanksWithDifferentFields) {
  testing::TempDir dir("score_rewards_ranks");
  const std::string script = write_script(dir, kScript);
  std::vector<std::map<std::string, double>> got(2);
  rlt::testing::on_thread_ranks(2, [&](int r, std::shared_ptr<Collectives> c) {
    rlt::Run run = python_run(script);
    run.config.sandbox.prestart = false;
    run.dist = c;
    got[r] = reward_metrics(run, rank_tally(r));
  });
  EXPECT_EQ(check_two_ranks(got[0]), "");
  EXPECT_EQ(check_two_ranks(got[1]), "");
  // Twin: each rank's own totals, never exchanged (rank 0 has 1 failure, a = 1.5 and no b).
  std::map<std::string, double> local{{"reward_errors", 1}, {"time_reward_s", 0.5}};
  for (const auto& [name, sum_count] : rank_tally(0).fields)
    local["reward/" + name] = sum_count.first / sum_count.second;
  EXPECT_NE(check_two_ranks(local), "");
}

// The reward model's folder over Qwen3's published tokenizer (tests/rollout/reward_model_reference.py, made
// by the ctest fixture) and the scores transformers gives its conversations.
const std::string kChatModel = std::string(RLT_REWARD_MODEL_REFS) + "/qwen3_chat";

// Conversations 0 (a boxed 42) and 2 (an empty answer) of the reference, as two trajectories of two prompts.
struct ChatBatch {
  std::vector<Trajectory> trajs;
  std::vector<PromptExample> examples;
  std::vector<double> model_scores;  // transformers'
};
ChatBatch chat_batch() {
  std::ifstream f(kChatModel + "/reference.json");
  const nlohmann::json ref = nlohmann::json::parse(f);
  ChatBatch b;
  for (int c : {0, 2}) {
    const auto& conv = ref["conversations"][c];
    b.examples.push_back({conv[0]["content"], c == 0 ? "42" : "1", "test:" + std::to_string(c), {}});
    Trajectory t;
    t.prompt_index = static_cast<int64_t>(b.trajs.size());
    t.response_text = conv[1]["content"];
    b.trajs.push_back(t);
    b.model_scores.push_back(ref["scores"][c].get<double>());
  }
  return b;
}

// reward.combine: each trajectory's reward is 1 x the boxed matcher's + 0.5 x transformers' score of its
// conversation; accuracy is the matcher's; each term's unweighted mean is logged. Twin: the weights swapped.
TEST(ScoreRewards, CombineSumsWeightedTermsAndLogsEachTerm) {
  RLT_SKIP_WITHOUT_FIXTURES();
  rlt::Run run;
  run.config.reward.model_path = kChatModel;
  run.config.reward.combine = {{RewardKind::kBoxed, 1.0}, {RewardKind::kModel, 0.5}};
  ChatBatch b = chat_batch();
  const RewardTally tally = score_rewards(run, b.trajs, b.examples);
  const double boxed[2] = {1.0, -1.0};
  for (int i = 0; i < 2; ++i) {
    EXPECT_NEAR(b.trajs[i].reward, boxed[i] + 0.5 * b.model_scores[i], 1e-5) << i;
    EXPECT_GT(std::abs(b.trajs[i].reward - (0.5 * boxed[i] + b.model_scores[i])), 1e-2) << "twin " << i;
  }
  EXPECT_TRUE(b.trajs[0].correct);
  EXPECT_FALSE(b.trajs[1].correct);
  const auto m = reward_metrics(run, tally);
  EXPECT_EQ(m.at("reward_terms/boxed"), 0.0);
  EXPECT_NEAR(m.at("reward_terms/model"), (b.model_scores[0] + b.model_scores[1]) / 2, 1e-5);
  EXPECT_EQ(m.count("reward_errors"), 0u);
}

// reward.kind model alone: the reward is the model's score, and accuracy still the boxed matcher's verdict.
TEST(ScoreRewards, ModelKindIsTheScoreAndAccuracyStaysTheMatchers) {
  RLT_SKIP_WITHOUT_FIXTURES();
  rlt::Run run;
  run.config.reward.kind = RewardKind::kModel;
  run.config.reward.model_path = kChatModel;
  run.config.reward.model_batch_tokens = 40;  // one conversation a forward
  ChatBatch b = chat_batch();
  const RewardTally tally = score_rewards(run, b.trajs, b.examples);
  for (int i = 0; i < 2; ++i) EXPECT_NEAR(b.trajs[i].reward, b.model_scores[i], 1e-5) << i;
  EXPECT_TRUE(b.trajs[0].correct);
  EXPECT_FALSE(b.trajs[1].correct);
  EXPECT_NEAR(reward_metrics(run, tally).at("reward_terms/model"), (b.model_scores[0] + b.model_scores[1]) / 2, 1e-5);
  ASSERT_TRUE(run.rollout.reward_model);
  EXPECT_EQ(run.rollout.reward_model->token_budget(), 40);
}

}  // namespace
}  // namespace rlt
