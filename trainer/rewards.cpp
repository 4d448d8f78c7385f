// score_rewards and reward_metrics; see rewards.h.
#include "trainer/rewards.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <set>

#include "rollout/reward_model.h"
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

// run.rollout.reward_model, loaded at the first call (the evaluation and a train.async rollout may get to it at
// once), on this rank's device in model.dtype.
std::shared_ptr<RewardModel> reward_model(Run& run) {
  static std::mutex making;
  std::lock_guard<std::mutex> lock(making);
  if (!run.rollout.reward_model) {
    const RewardOptions& options = run.config.reward;
    run.rollout.reward_model = std::make_shared<RewardModel>(RewardModel::load(
        options.model_path, scalar_type(run.config.model.dtype), run.device, options.model_batch_tokens));
  }
  return run.rollout.reward_model;
}

}  // namespace

RewardTally score_rewards(Run& run, std::vector<Trajectory>& trajectories, const std::vector<PromptExample>& examples) {
  const auto began = std::chrono::steady_clock::now();
  const RewardOptions& options = run.config.reward;
  for (const Trajectory& t : trajectories) {
    TORCH_CHECK(t.prompt_index >= 0 && t.prompt_index < static_cast<int64_t>(examples.size()),
                "score_rewards: no prompt ", t.prompt_index);
  }
  std::vector<std::string> answers;
  for (const PromptExample& ex : examples) answers.push_back(ex.answer);
  const size_t n = trajectories.size();
  RewardTally tally;
  // One term's unweighted values, and its verdicts where it has them (a rule's; a model term has none).
  auto term_values = [&](RewardKind kind, std::vector<double>& values, std::vector<uint8_t>& correct) {
    values.assign(n, 0.0);
    correct.assign(n, 0);
    if (kind == RewardKind::kBoxed || kind == RewardKind::kBoxedToolShaping) {
      RewardOptions rule = options;
      rule.kind = kind;
      assign_rewards(trajectories, answers, rule);
      for (size_t i = 0; i < n; ++i) values[i] = trajectories[i].reward, correct[i] = trajectories[i].correct;
    } else if (kind == RewardKind::kPython) {
      const std::shared_ptr<ScriptRewards> rewards = script_rewards(run, /*make=*/true);
      std::vector<RewardQuery> queries;
      for (const Trajectory& t : trajectories) {
        const PromptExample& ex = examples[t.prompt_index];
        queries.push_back({ex.prompt, t.response_text, ex.answer});
      }
      const std::vector<ScriptScore> scores = rewards->script.score(queries);
      for (size_t i = 0; i < n; ++i) values[i] = scores[i].reward, correct[i] = scores[i].correct;
      tally.add(scores);
    } else {
      const std::shared_ptr<RewardModel> rm = reward_model(run);
      std::vector<RewardModel::Text> texts;
      for (const Trajectory& t : trajectories) {
        const PromptExample& ex = examples[t.prompt_index];
        texts.push_back({ex.messages, ex.prompt, t.response_text});
      }
      values = rm->score_texts(texts);
    }
  };
  std::vector<double> total(n, 0.0), values;
  std::vector<uint8_t> correct, verdict;
  bool judged = false;  // `correct` holds the first rule term's verdicts
  for (const RewardTerm& term : options.terms()) {
    term_values(term.kind, values, verdict);
    for (size_t i = 0; i < n; ++i) total[i] += term.weight * values[i];
    if (term.kind != RewardKind::kModel && !judged) correct = verdict, judged = true;
    if (!options.single_rule()) {
      auto& [sum, count] = tally.terms[enum_to_string(term.kind)];
      for (double v : values) sum += v;
      count += static_cast<int64_t>(n);
    }
  }
  // A reward of model terms only: accuracy stays the boxed matcher's verdict against the reference answer.
  if (!judged) {
    RewardOptions rule = options;
    rule.kind = RewardKind::kBoxed;
    assign_rewards(trajectories, answers, rule);
    for (size_t i = 0; i < n; ++i) correct.push_back(trajectories[i].correct);
  }
  for (size_t i = 0; i < n; ++i) {
    trajectories[i].reward = total[i];
    trajectories[i].correct = correct[i] != 0;
  }
  tally.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  return tally;
}

std::map<std::string, double> reward_metrics(Run& run, const RewardTally& tally) {
  const RewardOptions& options = run.config.reward;
  std::map<std::string, double> m;
  // The slowest rank's scoring time.
  at::Tensor seconds = at::full({1}, tally.seconds, at::kDouble);
  if (run.dist->world() > 1) run.dist->all_reduce({seconds}, ReduceOp::kMax);
  m["time_reward_s"] = seconds.item<double>();
  if (!options.single_rule()) {
    // Each term's mean over the step's trajectories, unweighted; the kinds are the config's on every rank.
    const std::vector<RewardTerm> terms = options.terms();
    at::Tensor sums = at::zeros({2 * static_cast<int64_t>(terms.size())}, at::kDouble);
    double* t = sums.data_ptr<double>();
    for (size_t k = 0; k < terms.size(); ++k) {
      const auto it = tally.terms.find(enum_to_string(terms[k].kind));
      if (it == tally.terms.end()) continue;
      t[2 * k] = it->second.first;
      t[2 * k + 1] = static_cast<double>(it->second.second);
    }
    if (run.dist->world() > 1) run.dist->all_reduce({sums}, ReduceOp::kSum);
    for (size_t k = 0; k < terms.size(); ++k) {
      if (t[2 * k + 1] > 0) m[std::string("reward_terms/") + enum_to_string(terms[k].kind)] = t[2 * k] / t[2 * k + 1];
    }
  }
  if (!options.uses(RewardKind::kPython)) return m;
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
  m["reward_errors"] = s[0];
  for (size_t f = 0; f < names.size(); ++f) {
    if (s[2 + 2 * f] > 0) m["reward/" + names[f]] = s[1 + 2 * f] / s[2 + 2 * f];
  }
  return m;
}

}  // namespace rlt
