// train.rollout_ranks (trainer/rollout_ranks.h): thread ranks over the in-memory store, where the last ranks only
// sample and the others only train. The placed run against the colocated run of as many training ranks, in
// turn and one_step; the version each batch was sampled by; resume, across placements; the groups of
// ranks; the plans of each side; and the refusals.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <thread>

#include "model/config.h"
#include "parallel/transfer.h"
#include "tests/common/tmpdir.h"
#include "tests/trainer/thread_ranks.h"
#include "tests/trainer/tiny_run.h"
#include "trainer/grpo.h"
#include "trainer/memory_plan.h"
#include "trainer/rollout_ranks.h"
#include "trainer/run.h"

namespace rlt {
namespace {

using rlt::testing::read_metrics;
using rlt::testing::TempDir;
using rlt::testing::tiny_config;

// As test_async's: scored old log-probs and one prompt's samples at a time, so that a batch's tokens and
// updates are fixed by its weights and noise, not by which rows share a decode step.
Config placed_config(AsyncMode mode) {
  Config c = tiny_config();
  c.train.async = mode;
  c.train.old_logprobs = OldLogprobs::kRecompute;
  c.rollout.max_batch = 4;
  return c;
}

// One process, or `world` colocated thread ranks.
void train_colocated(const Config& c, const std::string& dir, int world = 1, bool resume = false,
                     int64_t stop_after = 0) {
  auto body = [&](std::shared_ptr<Collectives> dist) {
    Run run = make_run(c, dir, resume, {}, dist);
    run.stop_after = stop_after;
    train_grpo(run);
  };
  if (world == 1) return body(nullptr);
  rlt::testing::on_thread_ranks(world, [&](int, std::shared_ptr<Collectives> dist) { body(dist); });
}

// `world` thread ranks, the last c.train.rollout_ranks of them rollout ranks; all share the run folder.
// `timeout`: the store's collectives'.
void train_placed(const Config& c, const std::string& dir, int world, bool resume = false, int64_t stop_after = 0,
                  const GrpoHooks& hooks = {}, std::chrono::milliseconds timeout = std::chrono::seconds(120)) {
  rlt::testing::on_thread_ranks(
      world,
      [&](int, std::shared_ptr<Collectives> all) {
        const std::shared_ptr<Placement> p = place(c, all);
        Run run = make_run(c, dir, resume, {}, p->side, p);
        run.stop_after = stop_after;
        train_grpo(run, hooks);
      },
      timeout);
}

// `c` colocated on `colocated_world` ranks, then placed with `rollout_ranks` of `world` ranks, each in its
// own folder under `dir` ("colocated", "placed"); their metrics rows.
struct TwoRuns {
  std::vector<nlohmann::json> colocated, placed;
};
TwoRuns train_both(Config c, int rollout_ranks, int world, const std::filesystem::path& dir, int colocated_world = 1) {
  train_colocated(c, (dir / "colocated").string(), colocated_world);
  c.train.rollout_ranks = rollout_ranks;
  train_placed(c, (dir / "placed").string(), world);
  return {read_metrics((dir / "colocated").string()), read_metrics((dir / "placed").string())};
}

GrpoHooks with_fault(PlacementFault fault) {
  GrpoHooks hooks;
  hooks.placement_fault = fault;
  return hooks;
}

// The steps' figures, and where both runs log them the staleness and the evaluations.
void expect_same_rows(const std::vector<nlohmann::json>& a, const std::vector<nlohmann::json>& b, double tol) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    for (const char* k : {"loss", "pg_loss", "kl", "grad_norm", "reward_mean", "accuracy", "entropy",
                          "response_length_mean", "staleness_mean", "staleness_max", "eval_pass@1"}) {
      if (!a[i].contains(k) && !b[i].contains(k)) continue;
      if (!a[i].contains(k) || !b[i].contains(k)) {  // the colocated run in turn logs no staleness
        EXPECT_EQ(std::string(k).rfind("staleness", 0), 0u) << k << " at step " << i + 1 << " in one run only";
        continue;
      }
      const double x = a[i][k].get<double>(), y = b[i][k].get<double>();
      EXPECT_NEAR(x, y, tol * std::max(1.0, std::abs(x))) << k << " at step " << i + 1;
    }
  }
}

TEST(Placement, OneStepOnARolloutRankEqualsTheColocatedRun) {
  TempDir tmp("placement_async");
  Config c = placed_config(AsyncMode::kOneStep);
  const std::string stale = (tmp.path() / "stale").string();
  const auto [a, b] = train_both(c, 1, 2, tmp.path());
  c.train.rollout_ranks = 1;
  ASSERT_EQ(b.size(), 4u);
  // The same batches from the same weights (the rollout rank's are the broadcast bits), the same updates.
  expect_same_rows(a, b, 0);
  for (size_t i = 0; i < b.size(); ++i) {
    EXPECT_EQ(b[i]["staleness_mean"].get<double>(), i == 0 ? 0.0 : 1.0) << "step " << i + 1;
    EXPECT_GT(b[i]["transfer_mb"].get<double>(), 0);
    // The buckets' time and the exchange's are parts of the step's; the sampling's is within its span.
    const double sync = b[i]["time_weight_sync_s"].get<double>(), wait = b[i]["wait_rollout_s"].get<double>();
    EXPECT_GT(sync, 0);
    EXPECT_GT(b[i]["weight_sync_gbps"].get<double>(), 0);
    EXPECT_LE(sync + wait, b[i]["time_step_s"].get<double>()) << "step " << i + 1;
    EXPECT_GE(b[i]["wait_update_s"].get<double>(), 0);
    EXPECT_GE(b[i]["time_rollout_wall_s"].get<double>(), b[i]["time_rollout_s"].get<double>());
  }
  // The twin: a rollout rank that keeps the first weights samples steps 3 and 4 from w0, not w1 and w2.
  train_placed(c, stale, 2, false, 0, with_fault(PlacementFault::kStaleWeights));
  const auto s = read_metrics(stale);
  ASSERT_EQ(s.size(), 4u);
  EXPECT_EQ(s[1]["loss"].get<double>(), b[1]["loss"].get<double>()) << "steps 1-2 sample w0 either way";
  EXPECT_NE(s[2]["loss"].get<double>(), b[2]["loss"].get<double>());
}

// Two training ranks beside one rollout rank against two colocated ranks: the rollout rank samples the
// step's four prompts where each colocated rank samples two, one prompt's samples at a time either way.
TEST(Placement, InTurnTwoTrainingRanksBesideARolloutRankEqualTwoColocatedRanks) {
  TempDir tmp("placement_sync");
  Config c = placed_config(AsyncMode::kOff);
  c.train.checkpoint_every = 0;
  c.train.prompts_per_step = 4;
  c.train.mini_batch_size = 8;  // two prompts: one per training rank
  const std::string one_share = (tmp.path() / "one_share").string();
  const auto [a, b] = train_both(c, 1, 3, tmp.path(), /*colocated_world=*/2);
  c.train.rollout_ranks = 1;
  ASSERT_EQ(b.size(), 4u);
  expect_same_rows(a, b, 0);
  for (size_t i = 0; i < b.size(); ++i) EXPECT_EQ(b[i]["staleness_mean"].get<double>(), 0.0) << "step " << i + 1;
  // The twin: each training rank trains on the first share of the batch.
  train_placed(c, one_share, 3, false, 0, with_fault(PlacementFault::kOneShare));
  const auto o = read_metrics(one_share);
  ASSERT_EQ(o.size(), 4u);
  double most = 0;  // step 1's rewards are all equal (no gradient): the later updates tell
  for (size_t i = 0; i < o.size(); ++i) {
    most = std::max(most, std::abs(o[i]["grad_norm"].get<double>() - b[i]["grad_norm"].get<double>()));
  }
  EXPECT_GT(most, 1e-3);
}

// LoRA: rank 0 publishes the merged weights, which the rollout rank decodes; the training rank's own
// evaluations (every 2 steps) run while the rollout rank samples or waits.
TEST(Placement, WithLoraAndEvaluationsOnTheTrainingRankEqualsTheColocatedRun) {
  TempDir tmp("placement_lora");
  Config c = placed_config(AsyncMode::kOneStep);
  c.lora.rank = 4;
  c.lora.alpha = 8;
  c.train.eval_prompts = 4;
  c.train.eval_every = 2;
  const auto [a, b] = train_both(c, 1, 2, tmp.path());
  ASSERT_EQ(b.size(), 4u);
  ASSERT_TRUE(b[1].contains("eval_pass@1"));
  expect_same_rows(a, b, 0);
}

// DAPO's dynamic sampling on two rollout ranks: their rounds, the equal-reward filter and the groups they
// pass between them give the training rank the colocated run's batches, stream position and figures.
class PlacementDapo : public ::testing::TestWithParam<AsyncMode> {};

TEST_P(PlacementDapo, DynamicSamplingOnTheRolloutRanksEqualsTheColocatedRun) {
  TempDir tmp("placement_dapo");
  Config c = placed_config(GetParam());
  c.train.dynamic_sampling = true;
  c.train.max_sampling_rounds = 3;
  c.train.checkpoint_every = 2;
  const auto [a, b] = train_both(c, 2, 3, tmp.path());
  ASSERT_EQ(b.size(), 4u);
  expect_same_rows(a, b, 0);
  double rounds = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    for (const char* k : {"groups_kept", "groups_filtered", "groups_surplus", "sampling_rounds", "prompts_sampled",
                          "sampled_accuracy", "update_skipped"}) {
      EXPECT_EQ(a[i][k].get<double>(), b[i][k].get<double>()) << k << " at step " << i + 1;
    }
    rounds += b[i]["sampling_rounds"].get<double>();
  }
  EXPECT_GT(rounds, 4) << "no step sampled a second round: the test checks one round only";
  const auto state = [&](const char* run) {
    return nlohmann::json::parse(std::ifstream(tmp.path() / run / "checkpoint/state.json"))["prompts_consumed"]
        .get<int64_t>();
  };
  EXPECT_EQ(state("colocated"), state("placed")) << "the last step's checkpoint: no rollout pending";
}

INSTANTIATE_TEST_SUITE_P(Modes, PlacementDapo, ::testing::Values(AsyncMode::kOff, AsyncMode::kOneStep),
                         [](const auto& info) { return std::string(enum_to_string(info.param)); });

// Two rollout ranks split the step's prompts; one training rank trains on both shares.
TEST(Placement, TwoRolloutRanksSplitTheStepForOneTrainingRank) {
  TempDir tmp("placement_two_samplers");
  Config c = placed_config(AsyncMode::kOneStep);
  c.train.checkpoint_every = 0;
  const auto [a, b] = train_both(c, 2, 3, tmp.path());
  expect_same_rows(a, b, 0);
}

TEST(Placement, AResumedRunReproducesTheRunWithEitherPlacement) {
  TempDir tmp("placement_resume");
  Config c = placed_config(AsyncMode::kOneStep);
  c.train.rollout_ranks = 1;
  const std::string full = (tmp.path() / "full").string(), part = (tmp.path() / "part").string(),
                    moved = (tmp.path() / "moved").string();
  train_placed(c, full, 2);
  train_placed(c, part, 2, false, /*stop_after=*/2);
  ASSERT_TRUE(std::filesystem::exists(part + "/checkpoint/rollout_weights/config.json"));
  EXPECT_FALSE(std::filesystem::exists(part + "/rollout_weights.next")) << "moved into the checkpoint";
  std::filesystem::copy(part, moved, std::filesystem::copy_options::recursive);
  train_placed(c, part, 2, /*resume=*/true);
  expect_same_rows(read_metrics(full), read_metrics(part), 0);
  // The checkpoint is a colocated one_step run's: one process resumes it and continues alike.
  Config colocated = c;
  colocated.train.rollout_ranks = 0;
  train_colocated(colocated, moved, 1, /*resume=*/true);
  expect_same_rows(read_metrics(full), read_metrics(moved), 0);
}

// A colocated one_step checkpoint taken while a rollout was pending (a run killed after it) records the
// stream after that rollout's draw, and where the rollout's prompts began: the placed resume samples the
// pending batch from there.
TEST(Placement, ResumesAColocatedCheckpointWithARolloutPending) {
  TempDir tmp("placement_pending");
  Config c = placed_config(AsyncMode::kOneStep);
  const std::string full = (tmp.path() / "full").string(), part = (tmp.path() / "part").string();
  train_colocated(c, full);
  train_colocated(c, part, 1, false, /*stop_after=*/2);
  const std::string state = part + "/checkpoint/state.json";
  nlohmann::json j = nlohmann::json::parse(std::ifstream(state));
  ASSERT_EQ(j["prompts_consumed"].get<int64_t>(), j["async"]["prompts_begin"].get<int64_t>());
  j["prompts_consumed"] = j["prompts_consumed"].get<int64_t>() + c.train.prompts_per_step;  // drawn by step 3's
  std::ofstream(state) << j.dump(2);
  c.train.rollout_ranks = 1;
  train_placed(c, part, 2, /*resume=*/true);
  expect_same_rows(read_metrics(full), read_metrics(part), 0);
}

// A phase on one side longer than train.dist_timeout_s (here each publish, then each sampling, waits 3 s
// against a 1.5 s timeout, the store's collectives' too) is waited through while the other side shows signs
// of life; a rollout rank that falls silent is named once the timeout has passed.
TEST(Placement, ASideWaitsThroughTheOthersLongPhaseAndNamesASilentRank) {
  TempDir tmp("placement_handover");
  Config c = placed_config(AsyncMode::kOneStep);
  c.train.rollout_ranks = 1;
  c.train.steps = 2;
  c.train.checkpoint_every = 0;
  c.train.dist_timeout_s = 1.5;
  const auto timeout = std::chrono::milliseconds(1500);
  const std::string slow = (tmp.path() / "slow").string(), silent = (tmp.path() / "silent").string();
  GrpoHooks delayed;
  delayed.before_publish = [] { std::this_thread::sleep_for(std::chrono::seconds(3)); };
  train_placed(c, slow, 2, false, 0, delayed, timeout);
  // One_step with the rollout longer than the update: rank 0 waits for the rollout ranks before it publishes.
  GrpoHooks long_rollout;
  long_rollout.before_sample = [] { std::this_thread::sleep_for(std::chrono::seconds(3)); };
  train_placed(c, slow, 2, false, 0, long_rollout, timeout);
  EXPECT_EQ(read_metrics(slow).size(), 2u);
  try {
    train_placed(c, silent, 2, false, 0, with_fault(PlacementFault::kSilent), timeout);
    ADD_FAILURE() << "a silent rollout rank went unnoticed";
  } catch (const DistError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 showed no sign of life"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("the batch of step 1"), std::string::npos) << e.what();
  }
}

TEST(Placement, GroupsReduceOverTheirMembersAlone) {
  rlt::testing::on_thread_ranks(3, [](int rank, std::shared_ptr<Collectives> all) {
    const std::shared_ptr<Collectives> outer = all->group("outer", {0, 2});
    const std::shared_ptr<Collectives> inner = all->group("inner", {1});
    at::Tensor v = at::tensor({double(rank + 1)}, at::kDouble);
    if (outer) outer->all_reduce({v}, ReduceOp::kSum);
    EXPECT_EQ(v.item<double>(), rank == 1 ? 2.0 : 4.0) << "ranks 0 and 2 add 1 + 3; rank 1 is not a member";
    ASSERT_EQ(outer == nullptr, rank == 1);
    ASSERT_EQ(inner == nullptr, rank != 1);
    if (outer) {
      EXPECT_EQ(outer->world(), 2);
      EXPECT_EQ(outer->rank(), rank / 2);
    }
    EXPECT_THROW(all->group("bad", {2, 0}), c10::Error);
  });
}

// Buckets of one dtype up to the size, a tensor larger than the size alone in its bucket: every receiver ends
// with the root's tensors, and the version with them.
TEST(Placement, TheWeightsBroadcastFillsEveryTensorBucketByBucket) {
  rlt::testing::on_thread_ranks(3, [](int rank, std::shared_ptr<Collectives> all) {
    // Each rank its own values (its own generator: the ranks are threads), which the receivers' must become
    // rank 0's.
    auto draw = [](uint64_t seed) {
      at::Generator g = at::make_generator<at::CPUGeneratorImpl>(seed);
      return std::vector<at::Tensor>{at::randn({5, 3}, g), at::randn({40}, g), at::randn({2}, g),
                                     at::randn({4}, g, at::kDouble), at::randn({3, 2}, g)};
    };
    std::vector<at::Tensor> t = draw(rank), root = draw(0);
    SyncTiming timing;
    // 64 bytes: {5x3}, {40} (160 bytes, alone), {2}, {4} (another dtype), {3x2} in five buckets.
    const int64_t version = broadcast_in_buckets(*all, t, rank == 0 ? 7 : -1, 64, at::kCPU, timing);
    EXPECT_EQ(version, 7);
    EXPECT_EQ(timing.buckets, 5);
    EXPECT_EQ(timing.bytes, (15 + 40 + 2 + 6) * 4 + 4 * 8);
    for (size_t i = 0; i < t.size(); ++i)
      EXPECT_TRUE(at::equal(t[i], root[i])) << "tensor " << i << " on rank " << rank;
  });
}

// A rollout rank's reward tally crosses to the training ranks as bytes beside its groups: read back, it
// is the tally written (counts, each field's and term's sum and count, the time), and the record after it
// starts where the tally ends. A tally cut short is an error, not a tally of zeros.
TEST(Placement, TheRewardTallyCrossesAsWritten) {
  RewardTally t;
  t.scored = 96;
  t.failed = 3;
  t.fields["format"] = {41.5, 90};
  t.fields["length"] = {-2.25, 93};
  t.terms["boxed"] = {12.0, 96};
  t.terms["model"] = {-30.5, 96};
  t.seconds = 0.625;
  ByteWriter w;
  write_tally(w, t);
  w.put<int64_t>(7);  // what follows the tally in a batch's record
  ByteReader r(w.bytes.data(), w.bytes.size());
  const RewardTally got = read_tally(r);
  EXPECT_EQ(got.scored, 96);
  EXPECT_EQ(got.failed, 3);
  EXPECT_EQ(got.fields, t.fields);
  EXPECT_EQ(got.terms, t.terms);
  EXPECT_EQ(got.seconds, 0.625);
  EXPECT_EQ(r.get<int64_t>(), 7);
  EXPECT_TRUE(r.done());
  ByteReader cut(w.bytes.data(), w.bytes.size() - sizeof(int64_t) - 1);
  EXPECT_THROW(read_tally(cut), c10::Error);
}

TEST(Placement, RefusesWhatCannotSplit) {
  Config c = placed_config(AsyncMode::kOneStep);
  c.train.rollout_ranks = 2;
  EXPECT_THROW(check_placement(c, 2), RunError);  // no training rank
  c.train.rollout_ranks = 1;
  c.train.prompts_per_step = 3;
  c.train.mini_batch_size = 0;
  EXPECT_NO_THROW(check_placement(c, 2));
  c.train.rollout_ranks = 2;
  try {
    check_placement(c, 3);
    ADD_FAILURE() << "3 prompts over 2 rollout ranks";
  } catch (const RunError& e) {
    EXPECT_NE(std::string(e.what()).find("train.rollout_ranks = 2"), std::string::npos) << e.what();
  }
  c.train.prompts_per_step = 4;
  c.train.rollout_ranks = 1;
  try {
    check_placement(c, 4);  // 3 training ranks cannot split 4 prompts
    ADD_FAILURE() << "4 prompts over 3 training ranks";
  } catch (const RunError& e) {
    EXPECT_NE(std::string(e.what()).find("3 training ranks"), std::string::npos) << e.what();
  }
  EXPECT_THROW(load_config("", {"train.rollout_ranks=1", "train.async=one_step", "rollout.partial=true"}), ConfigError);
}

// A rollout rank holds the weights it decodes and its share's cache; the training ranks hold no training
// rollout's cache and no copy beside the update.
TEST(Placement, EachSidePlansWhatItHolds) {
  Config c = placed_config(AsyncMode::kOneStep);
  c.train.prompts_per_step = 8;
  c.rollout.max_batch = 0;
  c.train.eval_prompts = 0;
  const ModelConfig m = model_config_from_json(nlohmann::json{{"model_type", "llama"},
                                                              {"vocab_size", 320},
                                                              {"hidden_size", 64},
                                                              {"intermediate_size", 128},
                                                              {"num_hidden_layers", 2},
                                                              {"num_attention_heads", 2},
                                                              {"num_key_value_heads", 1},
                                                              {"tie_word_embeddings", true}},
                                               "test");
  const MemoryPlan colocated = plan_memory(c, m, 1);
  c.train.rollout_ranks = 2;
  const MemoryPlan trainer = plan_memory(c, m, 1), sampler = plan_rollout_rank(c, m, 2);
  const int64_t slot = 2 * m.num_layers * m.num_kv_heads * m.head_dim * 4 + 8 + 1;
  const int64_t rows = c.train.prompts_per_step * c.sampling.samples_per_prompt;
  EXPECT_TRUE(colocated.phases_overlap);
  EXPECT_FALSE(trainer.phases_overlap);
  EXPECT_EQ(colocated.kv_cache, rows * c.rollout.max_context * slot);
  EXPECT_EQ(trainer.kv_cache, 0);
  EXPECT_EQ(sampler.kv_cache, rows / 2 * c.rollout.max_context * slot) << "half the step's rows each";
  EXPECT_EQ(sampler.weights, 4 * parameter_count(m));
  EXPECT_EQ(sampler.gradients + sampler.masters + sampler.moments + sampler.activations, 0);
  // A bucket of the weights' broadcast: at most train.rollout_sync_mb, here the whole (tiny) model.
  const int64_t bucket = std::min<int64_t>(c.train.rollout_sync_mb << 20, 4 * parameter_count(m));
  EXPECT_EQ(sampler.rollout_weights, bucket);
  EXPECT_EQ(trainer.rollout_weights, bucket) << "rank 0's bucket, no copy beside the update";
  EXPECT_EQ(trainer.moments, colocated.moments);
  EXPECT_LT(trainer.device_total(), colocated.device_total());
}

}  // namespace
}  // namespace rlt
