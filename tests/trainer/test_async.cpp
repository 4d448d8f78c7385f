// train.async one_step (trainer/async_rollout.h): which weights sample which step, the threaded run against
// the same schedule on one thread, resume, and data parallelism; with rollout.partial, each token's version
// and log-prob, the step's figures against their definitions, and resume on one and two ranks.
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <nlohmann/json.hpp>

#include "tests/common/tmpdir.h"
#include "tests/trainer/thread_ranks.h"
#include "tests/trainer/tiny_run.h"
#include "trainer/async_rollout.h"
#include "trainer/batch.h"
#include "trainer/grpo.h"
#include "trainer/run.h"

namespace rlt {
namespace {

using rlt::testing::read_metrics;
using rlt::testing::TempDir;
using rlt::testing::tiny_config;

Config async_config() {
  Config c = tiny_config();
  c.train.async = AsyncMode::kOneStep;
  // Bit for bit needs scored old log-probs: the rollout's own depend at the rounding level on which rows
  // share a decode step (test_trainer.cpp), and one prompt's samples at a time keeps the refills fixed.
  c.train.old_logprobs = OldLogprobs::kRecompute;
  c.rollout.max_batch = 4;
  return c;
}

std::vector<at::Tensor> snapshot(const Transformer& model) {
  std::vector<at::Tensor> out;
  for (const auto& [name, t] : model.named_parameters()) out.push_back(t.detach().clone());
  return out;
}

// The largest gap between the trajectories' sampling log-probs and those `weights` give them (the loss
// module's scoring, on a model holding those weights).
double logprob_gap(Run& run, const std::vector<Trajectory>& trajs, const std::vector<at::Tensor>& weights) {
  at::NoGradGuard no_grad;
  Transformer model = run.model.policy->clone();
  const auto params = model.named_parameters();
  for (size_t i = 0; i < params.size(); ++i) params[i].second.copy_(weights[i]);
  const PackedBatch b = pack(trajs, 0, static_cast<int64_t>(trajs.size()), run.device);
  const at::Tensor lp = response_logprobs(model, b, run.config.loss).logprobs;
  return ((lp - b.logprobs_rollout) * b.loss_mask.to(at::kFloat)).abs().max().item<double>();
}

// Four steps of the schedule with a stand-in update (every weight moved by noise), each rollout held until
// the update beside it has moved the weights, so a rollout that read the trained weights would see them
// moved. Returns, per step, the trajectories' version and the log-prob gap to each snapshot w0..w3.
struct Observed {
  std::vector<int64_t> version;
  std::vector<std::vector<double>> gap;  // [step][snapshot]
};
Observed run_schedule(AsyncFault fault, const std::string& dir) {
  Config c = async_config();
  c.sft.steps = 10;  // only the sampling matters here
  Run run = make_run(c, dir, /*resume=*/false, {});
  std::vector<std::promise<void>> moved(5);
  std::vector<std::vector<at::Tensor>> weights{snapshot(*run.model.policy)};
  AsyncRollouts async(
      run,
      [&](Run& r) {
        // The rollout of step s (its run.counters.step + 1) starts after step s - 1's update moved the weights.
        const int64_t step = r.data.prompts->consumed() / r.config.train.prompts_per_step + 1;
        if (step >= 2) moved[step - 1].get_future().wait();
        return collect_rollouts(r);
      },
      /*threaded=*/true, fault);
  Observed o;
  at::manual_seed(7);
  for (int64_t t = 1; t <= 4; ++t) {
    RolloutBatch rb = async.next();
    o.version.push_back(rb.trajs.front().weights_version);
    for (const auto& tr : rb.trajs) EXPECT_EQ(tr.weights_version, o.version.back());
    std::vector<double> gaps;
    for (const auto& w : weights) gaps.push_back(logprob_gap(run, rb.trajs, w));
    o.gap.push_back(gaps);
    {
      at::NoGradGuard no_grad;
      for (const auto& [name, p] : run.model.policy->named_parameters()) p.add_(at::randn_like(p), 0.05);
    }
    weights.push_back(snapshot(*run.model.policy));
    run.counters.step = t;
    if (t < 4) moved[t].set_value();
  }
  return o;
}

// Which snapshot the step's trajectories were sampled by: the one whose log-probs they match (fp32: the
// rollout's are the trainer's to ~1e-6; a moved weight differs by far more).
int64_t sampled_by(const std::vector<double>& gaps) {
  int64_t best = -1;
  for (size_t v = 0; v < gaps.size(); ++v) {
    if (gaps[v] < 1e-4) {
      EXPECT_EQ(best, -1) << "two snapshots match";
      best = static_cast<int64_t>(v);
    }
  }
  return best;
}

TEST(AsyncOneStep, EachStepIsSampledByTheWeightsPublishedAfterTheStepBeforeTheLast) {
  TempDir tmp("async_schedule");
  const Observed o = run_schedule(AsyncFault::kNone, (tmp.path() / "run").string());
  // Step t trains on w(t-2) (the first two steps on w0), and the trajectories say so.
  const std::vector<int64_t> expected{0, 0, 1, 2};
  EXPECT_EQ(o.version, expected);
  for (size_t t = 0; t < 4; ++t) EXPECT_EQ(sampled_by(o.gap[t]), expected[t]) << "step " << t + 1;
}

TEST(AsyncOneStep, RejectsARolloutThatReadsTheTrainedWeights) {
  TempDir tmp("async_live");
  const Observed o = run_schedule(AsyncFault::kLiveWeights, (tmp.path() / "run").string());
  // Steps 2 to 4 read the weights the update beside them had moved: w(t-1), not the published w(t-2).
  EXPECT_NE(sampled_by(o.gap[1]), 0);
  EXPECT_NE(sampled_by(o.gap[2]), 1);
  EXPECT_NE(sampled_by(o.gap[3]), 2);
}

TEST(AsyncOneStep, RejectsACopyThatIsNeverPublishedAgain) {
  TempDir tmp("async_nopublish");
  const Observed o = run_schedule(AsyncFault::kNoPublish, (tmp.path() / "run").string());
  EXPECT_EQ(o.version[3], 2) << "the bookkeeping alone says w2";
  EXPECT_EQ(sampled_by(o.gap[3]), 0) << "the check reads what sampled them";
  EXPECT_NE(sampled_by(o.gap[3]), 2);
}

void train(const Config& c, const std::string& dir, bool resume = false, const GrpoHooks& hooks = {},
           int64_t stop_after = 0) {
  Run run = make_run(c, dir, resume, {});
  run.stop_after = stop_after;
  train_grpo(run, hooks);
}

void expect_same_rows(const std::vector<nlohmann::json>& a, const std::vector<nlohmann::json>& b, size_t from) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = from; i < a.size(); ++i) {
    for (const char* k : {"loss", "pg_loss", "kl", "grad_norm", "reward_mean", "accuracy", "entropy"}) {
      EXPECT_EQ(a[i][k].get<double>(), b[i][k].get<double>()) << k << " at step " << i + 1;
    }
  }
}

TEST(AsyncOneStep, TheThreadedRunEqualsItsScheduleOnOneThreadAndLogsItsTiming) {
  TempDir tmp("async_train");
  const Config c = async_config();
  const std::string threaded = (tmp.path() / "threaded").string(), serial = (tmp.path() / "serial").string(),
                    sync = (tmp.path() / "sync").string();
  train(c, threaded);
  GrpoHooks one_thread;
  one_thread.async_threaded = false;
  train(c, serial, false, one_thread);
  const auto a = read_metrics(threaded), b = read_metrics(serial);
  ASSERT_EQ(a.size(), 4u);
  expect_same_rows(a, b, 0);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i]["staleness_mean"].get<double>(), i == 0 ? 0.0 : 1.0) << "step " << i + 1;
    for (const char* k : {"overlap_s", "wait_rollout_s", "wait_update_s"}) {
      ASSERT_TRUE(a[i].contains(k)) << k;
      EXPECT_GE(a[i][k].get<double>(), 0) << k;
    }
    // Both are parts of the rollout thread's span (the generation's time_rollout_s leaves out the thread's
    // start and the reward gathering, so it is no bound).
    const double wall = a[i]["time_rollout_wall_s"].get<double>();
    EXPECT_LE(a[i]["overlap_s"].get<double>(), wall);
    EXPECT_LE(a[i]["wait_rollout_s"].get<double>(), wall);
    EXPECT_GE(wall, a[i]["time_rollout_s"].get<double>());
    EXPECT_FALSE(a[i].contains("logprob_mismatch_mean")) << "no pass runs on the rollout's weights";
  }
  EXPECT_GT(a[1]["overlap_s"].get<double>(), 0) << "step 2's rollout ran beside step 1's update";
  // The twin: the same run in turn trains on fresh trajectories from step 2 on.
  Config in_turn = c;
  in_turn.train.async = AsyncMode::kOff;
  train(in_turn, sync);
  const auto s = read_metrics(sync);
  EXPECT_EQ(s[0]["loss"].get<double>(), a[0]["loss"].get<double>()) << "step 1 is sampled by w0 either way";
  EXPECT_NE(s[2]["loss"].get<double>(), a[2]["loss"].get<double>());
}

TEST(AsyncOneStep, AResumedRunSamplesThePendingRolloutAgainAndReproducesTheRun) {
  TempDir tmp("async_resume");
  const Config c = async_config();
  const std::string full = (tmp.path() / "full").string(), part = (tmp.path() / "part").string(),
                    fresh = (tmp.path() / "fresh").string();
  train(c, full);
  train(c, part, false, {}, /*stop_after=*/2);
  ASSERT_TRUE(std::filesystem::exists(part + "/checkpoint/rollout_weights/config.json"));
  std::filesystem::copy(part, fresh, std::filesystem::copy_options::recursive);
  train(c, part, /*resume=*/true);
  expect_same_rows(read_metrics(full), read_metrics(part), 0);
  // The twin: a resume that forgets the pending rollout (no async state) samples step 3 from w2.
  const std::string state = fresh + "/checkpoint/state.json";
  nlohmann::json j = nlohmann::json::parse(std::ifstream(state));
  j.erase("async");
  std::ofstream(state) << j.dump(2);
  train(c, fresh, /*resume=*/true);
  const auto f = read_metrics(fresh), g = read_metrics(full);
  ASSERT_EQ(f.size(), 4u);
  EXPECT_NE(f[2]["loss"].get<double>(), g[2]["loss"].get<double>());
}

// Each rank's rollout thread gathers rewards on its own fork of the collectives while the update reduces
// gradients on the run's. Agreement is to fp32 rounding (each rank pads its own rows), as in test_trainer.
TEST(AsyncOneStep, TwoRanksMatchOneProcess) {
  TempDir tmp("async_dp");
  Config c = async_config();
  c.train.checkpoint_every = 0;
  c.train.prompts_per_step = 4;
  c.train.mini_batch_size = 8;  // two prompts: one per rank
  const std::string one = (tmp.path() / "one").string();
  train(c, one);
  rlt::testing::on_thread_ranks(2, [&](int, std::shared_ptr<Collectives> dist) {
    rlt::Run run = make_run(c, (tmp.path() / "two").string(), /*resume=*/false, {}, dist);  // rank 0 writes
    train_grpo(run);
  });
  const auto a = read_metrics(one), b = read_metrics((tmp.path() / "two").string());
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    for (const char* k : {"loss", "grad_norm", "reward_mean", "staleness_mean"}) {
      const double x = a[i][k].get<double>(), y = b[i][k].get<double>();
      EXPECT_NEAR(x, y, 1e-5 * std::max(1.0, std::abs(x))) << k << " at step " << i + 1;
    }
  }
}

// ---- rollout.partial ----

// The async run with partial rollouts, without tools: which groups complete first then depends on the
// tokens alone, not on when a sandbox replies, so reruns and resumes cut at the same places.
Config partial_config() {
  Config c = async_config();
  c.rollout.partial = true;
  c.rollout.tools = false;
  c.rollout.stop = "*";     // lengths vary: a multiplication sign ends a trajectory
  c.rollout.max_batch = 0;  // every group in play at once: the last ones are cut
  c.rollout.partial_extra_prompts = 2;
  c.sampling.max_new_tokens = 64;
  c.train.steps = 6;
  return c;
}

// Every sampled token's log-prob under each snapshot (the loss module's scoring): [snapshot] -> (S, R).
std::vector<at::Tensor> scored(Run& run, const std::vector<Trajectory>& trajs,
                               const std::vector<std::vector<at::Tensor>>& weights) {
  at::NoGradGuard no_grad;
  Transformer model = run.model.policy->clone();
  const auto params = model.named_parameters();
  const PackedBatch b = pack(trajs, 0, static_cast<int64_t>(trajs.size()), run.device);
  std::vector<at::Tensor> out;
  for (const auto& w : weights) {
    for (size_t i = 0; i < params.size(); ++i) params[i].second.copy_(w[i]);
    out.push_back(response_logprobs(model, b, run.config.loss).logprobs);
  }
  return out;
}

TEST(AsyncPartial, EachTokenHasTheLogprobOfTheWeightsItsVersionNames) {
  // Six steps of the schedule with a stand-in update (noise on every weight), each rollout held until the
  // update beside it has moved the weights. Every batch holds the step's P groups; every sampled token's
  // log-prob is that of the snapshot its version names (fp32 scoring: 1e-4, where a moved weight is off by
  // more), and the trajectories that span two versions fail that check against their first version alone.
  // The step's figures are their definitions over the batch's tokens.
  TempDir tmp("async_partial");
  const Config c = partial_config();
  rlt::Run run = make_run(c, (tmp.path() / "run").string(), /*resume=*/false, {});
  begin_training(run);  // the warm-up: completions of varied lengths
  const int64_t P = c.train.prompts_per_step, G = c.sampling.samples_per_prompt;
  std::vector<std::promise<void>> moved(7);
  std::vector<std::vector<at::Tensor>> weights{snapshot(*run.model.policy)};
  std::atomic<int64_t> calls{0};
  AsyncRollouts async(run, [&](rlt::Run& r) {
    const int64_t step = ++calls;  // the rollout of step `step` starts after step - 1's update moved the weights
    if (step >= 2) moved[step - 1].get_future().wait();
    return collect_rollouts(r);
  });
  at::manual_seed(7);
  int64_t spanning = 0, resumed = 0;
  double worst_first = 0;
  for (int64_t t = 1; t <= 6; ++t) {
    RolloutBatch rb = async.next();
    ASSERT_EQ(static_cast<int64_t>(rb.trajs.size()), P * G) << "step " << t;
    ASSERT_EQ(static_cast<int64_t>(rb.examples.size()), P);
    const std::vector<at::Tensor> lp = scored(run, rb.trajs, weights);
    double stale = 0, most = 0, tokens = 0, span = 0;
    for (size_t i = 0; i < rb.trajs.size(); ++i) {
      const Trajectory& tr = rb.trajs[i];
      ASSERT_EQ(tr.versions.size(), tr.response_ids.size());
      EXPECT_EQ(tr.prompt_index, static_cast<int64_t>(i) / G);
      const int64_t lo = *std::min_element(tr.versions.begin(), tr.versions.end());
      const int64_t hi = *std::max_element(tr.versions.begin(), tr.versions.end());
      EXPECT_EQ(lo, tr.weights_version);
      EXPECT_LE(hi - lo + 1, c.rollout.max_staleness);
      span += hi > lo;
      for (size_t k = 0; k < tr.response_ids.size(); ++k) {
        if (!tr.loss_mask[k]) continue;
        const int64_t v = tr.versions[k];
        ASSERT_LT(v, static_cast<int64_t>(weights.size()));
        EXPECT_NEAR(lp[v][i][k].item<double>(), tr.logprobs[k], 1e-4) << "step " << t << " token " << k << " v" << v;
        if (hi > lo) worst_first = std::max(worst_first, std::abs(lp[lo][i][k].item<double>() - tr.logprobs[k]));
        stale += static_cast<double>(run.counters.step - v);
        most = std::max(most, static_cast<double>(run.counters.step - v));
        tokens += 1;
      }
    }
    const auto m = async.metrics(rb);
    EXPECT_DOUBLE_EQ(m.at("staleness_mean"), stale / tokens) << "step " << t;
    EXPECT_EQ(m.at("staleness_max"), most);
    EXPECT_LE(most, c.rollout.max_staleness) << "a token trained more than max_staleness versions behind";
    EXPECT_EQ(m.at("partial_spanning"), span);
    EXPECT_EQ(m.at("partial_resumed"), static_cast<double>(rb.stats.resumed));
    EXPECT_EQ(m.at("partial_cut"), static_cast<double>(rb.stats.cut));
    spanning += static_cast<int64_t>(span);
    resumed += rb.stats.resumed;
    {
      at::NoGradGuard no_grad;
      for (const auto& [name, p] : run.model.policy->named_parameters()) p.add_(at::randn_like(p), 0.05);
    }
    weights.push_back(snapshot(*run.model.policy));
    run.counters.step = t;
    if (t < 6) moved[t].set_value();
  }
  EXPECT_GT(resumed, 0) << "no rollout continued a trajectory";
  EXPECT_GT(spanning, 0) << "no trajectory spans two versions";
  EXPECT_GT(worst_first, 1e-3) << "the check must reject the first version's weights for every token";
}

TEST(AsyncPartial, AResumedRunContinuesTheCarriedGroupsAndReproducesTheRun) {
  // Stopped after step 2 and resumed: the pending rollout is sampled again from the groups it began with
  // (partial_rank0.json), and every step's figures are the uninterrupted run's. The twin: a checkpoint whose
  // carry is emptied draws other prompts and trains on other trajectories.
  TempDir tmp("async_partial_resume");
  const Config c = partial_config();
  const std::string full = (tmp.path() / "full").string(), part = (tmp.path() / "part").string(),
                    lost = (tmp.path() / "lost").string();
  train(c, full);
  train(c, part, false, {}, /*stop_after=*/2);
  const std::string carry = part + "/checkpoint/partial_rank0.json";
  ASSERT_TRUE(std::filesystem::exists(carry));
  EXPECT_FALSE(nlohmann::json::parse(std::ifstream(carry)).at("groups").empty());
  std::filesystem::copy(part, lost, std::filesystem::copy_options::recursive);
  train(c, part, /*resume=*/true);
  const auto f = read_metrics(full), p = read_metrics(part);
  expect_same_rows(f, p, 0);
  for (size_t i = 0; i < f.size(); ++i) {
    for (const char* k : {"staleness_mean", "partial_resumed", "partial_cut", "partial_spanning"}) {
      EXPECT_EQ(f[i][k].get<double>(), p[i][k].get<double>()) << k << " at step " << i + 1;
    }
  }
  // samples.jsonl names the versions that sampled each logged trajectory's first and last tokens.
  std::ifstream samples(full + "/samples.jsonl");
  int64_t lines = 0, continued = 0;
  for (std::string line; std::getline(samples, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    const int64_t first = j.at("weights_version").get<int64_t>(), last = j.at("weights_version_last").get<int64_t>();
    EXPECT_GE(last, first);
    EXPECT_LE(last - first + 1, c.rollout.max_staleness);
    EXPECT_LE(last, j.at("step").get<int64_t>() - 1) << "a version the update had not reached";
    continued += last > first;
    ++lines;
  }
  EXPECT_GT(lines, 0);
  EXPECT_GT(continued, 0) << "no logged trajectory was continued under newer weights";
  std::ofstream(lost + "/checkpoint/partial_rank0.json") << R"({"groups": []})";
  train(c, lost, /*resume=*/true);
  const auto l = read_metrics(lost);
  ASSERT_EQ(l.size(), f.size());
  bool differs = false;
  for (size_t i = 2; i < l.size(); ++i) differs |= l[i]["loss"].get<double>() != f[i]["loss"].get<double>();
  EXPECT_TRUE(differs) << "a resume that lost the carried groups must train on other trajectories";
}

TEST(AsyncPartial, TwoRanksResumeEachRanksCarry) {
  // Two thread ranks, each carrying its own groups: a run stopped after step 2 and resumed (each rank reads
  // its partial_rank<R>.json) gives the uninterrupted two-rank run's figures.
  TempDir tmp("async_partial_dp");
  Config c = partial_config();
  c.train.prompts_per_step = 4;
  c.train.mini_batch_size = 8;
  auto two = [&](const std::string& dir, bool resume, int64_t stop_after) {
    rlt::testing::on_thread_ranks(2, [&](int, std::shared_ptr<Collectives> dist) {
      rlt::Run run = make_run(c, dir, resume, {}, dist);
      run.stop_after = stop_after;
      train_grpo(run);
    });
  };
  const std::string full = (tmp.path() / "full").string(), part = (tmp.path() / "part").string();
  two(full, false, 0);
  two(part, false, 2);
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(std::filesystem::exists(part + "/checkpoint/partial_rank" + std::to_string(r) + ".json")) << r;
  }
  two(part, true, 0);
  const auto f = read_metrics(full), p = read_metrics(part);
  expect_same_rows(f, p, 0);
  double cut = 0;
  for (const auto& row : f) cut += row["partial_cut"].get<double>();
  EXPECT_GT(cut, 0) << "no rank carried a group";
}

TEST(AsyncPartial, TheStepsFiguresCoverEveryRanksBatch) {
  // Rank 0's batch: one trajectory of versions 1, 1 (sampled, sampled); rank 1's: one of versions 0, 1, 1
  // (sampled, tool, sampled), so it spans two. At update version 2 both ranks log staleness_mean (1 + 1 + 2
  // + 1) / 4 = 1.25, staleness_max 2 and partial_spanning 1; rank 0's own batch alone would give 1, 1, 0.
  TempDir tmp("async_partial_figures");
  Config c = partial_config();
  c.train.mini_batch_size = 8;
  std::vector<std::map<std::string, double>> got(2);
  rlt::testing::on_thread_ranks(2, [&](int rank, std::shared_ptr<Collectives> dist) {
    rlt::Run run = make_run(c, (tmp.path() / "run").string(), /*resume=*/false, {}, dist);
    run.counters.step = 2;
    AsyncRollouts async(
        run, [](rlt::Run&) { return RolloutBatch(); }, /*threaded=*/false);
    RolloutBatch rb;
    Trajectory t;
    t.weights_version = rank == 0 ? 1 : 0;
    t.response_ids = rank == 0 ? std::vector<int64_t>{5, 6} : std::vector<int64_t>{5, 6, 7};
    t.loss_mask = rank == 0 ? std::vector<uint8_t>{1, 1} : std::vector<uint8_t>{1, 0, 1};
    t.versions = rank == 0 ? std::vector<int64_t>{1, 1} : std::vector<int64_t>{0, 1, 1};
    t.logprobs.assign(t.response_ids.size(), -1.0f);
    rb.trajs.push_back(t);
    got[rank] = async.metrics(rb);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_DOUBLE_EQ(got[r].at("staleness_mean"), 1.25) << "rank " << r;
    EXPECT_EQ(got[r].at("staleness_max"), 2.0) << "rank " << r;
    EXPECT_EQ(got[r].at("partial_spanning"), 1.0) << "rank " << r;
  }
}

}  // namespace
}  // namespace rlt
