// train.async one_step (trainer/async_rollout.h): which weights sample which step, the threaded run against
// the same schedule on one thread, resume, and data parallelism.
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

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
  Transformer model = run.policy->clone();
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
  std::vector<std::vector<at::Tensor>> weights{snapshot(*run.policy)};
  AsyncRollouts async(
      run,
      [&](Run& r) {
        // The rollout of step s (its run.step + 1) starts after step s - 1's update moved the weights.
        const int64_t step = r.prompts->consumed() / r.config.train.prompts_per_step + 1;
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
      for (const auto& [name, p] : run.policy->named_parameters()) p.add_(at::randn_like(p), 0.05);
    }
    weights.push_back(snapshot(*run.policy));
    run.step = t;
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

}  // namespace
}  // namespace rlt
