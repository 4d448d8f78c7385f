// score_rewards and reward_metrics; see rewards.h.
#include "trainer/rewards.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <mutex>
#include <set>

#include "trainer/run.h"

namespace rlt {

namespace {

// Field names of several ranks as one sorted list, through a sum all-reduce (the collectives every backend
// takes host tensors for): each rank writes its names, '\n'-joined, into its own row of a
// (world, kNameChars) table of zeros. Names past kNameChars characters on a rank are left out.
constexpr int64_t kNameChars = 2048;

std::vector<std::string> all_field_names(Collectives& dist,
                                         const std::map<std::string, std::pair<double, int64_t>>& mine) {
  std::set<std::string> names;
  for (const auto& [name, sum] : mine) names.insert(name);
  if (dist.world() == 1) return {names.begin(), names.end()};
  at::Tensor table = at::zeros({dist.world(), kNameChars}, at::kDouble);
  double* row = table.data_ptr<double>() + dist.rank() * kNameChars;
  int64_t pos = 0;
  for (const std::string& name : names) {
    if (pos + static_cast<int64_t>(name.size()) + 1 > kNameChars) break;
    for (char c : name) row[pos++] = static_cast<unsigned char>(c);
    row[pos++] = '\n';
  }
  dist.all_reduce({table}, ReduceOp::kSum);
  const double* all = table.data_ptr<double>();
  for (int64_t r = 0; r < dist.world(); ++r) {
    std::string name;
    for (int64_t i = 0; i < kNameChars && all[r * kNameChars + i] != 0; ++i) {
      const char c = static_cast<char>(static_cast<unsigned char>(all[r * kNameChars + i]));
      if (c != '\n') {
        name += c;
      } else {
        names.insert(name);
        name.clear();
      }
    }
  }
  return {names.begin(), names.end()};
}

// run.rollout.rewards, made first when `make`. The evaluation (on the step's thread) and a train.async rollout (on
// its own) may get to it at once.
std::shared_ptr<ScriptRewards> script_rewards(Run& run, bool make) {
  static std::mutex making;
  std::lock_guard<std::mutex> lock(making);
  if (!run.rollout.rewards && make)
    run.rollout.rewards = std::make_shared<ScriptRewards>(run.config.reward, run.config.sandbox);
  return run.rollout.rewards;
}

}  // namespace

RewardTally score_rewards(Run& run, std::vector<Trajectory>& trajectories, const std::vector<PromptExample>& examples) {
  const RewardOptions& options = run.config.reward;
  if (options.kind != RewardKind::kPython) {
    std::vector<std::string> answers;
    for (const PromptExample& ex : examples) answers.push_back(ex.answer);
    assign_rewards(trajectories, answers, options);
    return {};
  }
  const std::shared_ptr<ScriptRewards> rewards = script_rewards(run, /*make=*/true);
  std::vector<RewardQuery> queries;
  for (const Trajectory& t : trajectories) {
    TORCH_CHECK(t.prompt_index >= 0 && t.prompt_index < static_cast<int64_t>(examples.size()),
                "score_rewards: no prompt ", t.prompt_index);
    const PromptExample& ex = examples[t.prompt_index];
    queries.push_back({ex.prompt, t.response_text, ex.answer});
  }
  const std::vector<ScriptScore> scores = rewards->script.score(queries);
  for (size_t i = 0; i < trajectories.size(); ++i) {
    trajectories[i].reward = scores[i].reward;
    trajectories[i].correct = scores[i].correct;
  }
  RewardTally tally;
  tally.add(scores);
  return tally;
}

std::map<std::string, double> reward_metrics(Run& run, const RewardTally& tally) {
  if (run.config.reward.kind != RewardKind::kPython) return {};
  const std::vector<std::string> names = all_field_names(*run.dist, tally.fields);
  // (1 + 2 F): the failures, then each field's sum and count, summed over the ranks.
  at::Tensor sums = at::zeros({1 + 2 * static_cast<int64_t>(names.size())}, at::kDouble);
  double* s = sums.data_ptr<double>();
  s[0] = static_cast<double>(tally.failed);
  for (size_t f = 0; f < names.size(); ++f) {
    const auto it = tally.fields.find(names[f]);
    if (it == tally.fields.end()) continue;
    s[1 + 2 * f] = it->second.first;
    s[2 + 2 * f] = static_cast<double>(it->second.second);
  }
  if (run.dist->world() > 1) run.dist->all_reduce({sums}, ReduceOp::kSum);
  std::map<std::string, double> m{{"reward_errors", s[0]}};
  for (size_t f = 0; f < names.size(); ++f) {
    if (s[2 + 2 * f] > 0) m["reward/" + names[f]] = s[1 + 2 * f] / s[2 + 2 * f];
  }
  return m;
}

}  // namespace rlt
