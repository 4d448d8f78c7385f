// Data-parallel pieces on the CPU (parallel/dist.h): torchrun's variables, how a step's prompts split over
// the ranks, the store's collectives on thread ranks (sums, maxima, broadcast, a late rank named), the
// loss denominators summed over ranks, the trajectory table, and the shapes a world size refuses.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <map>
#include <numeric>
#include <set>

#include "tests/common/threads.h"
#include "tests/common/tiny_model.h"
#include "tests/trainer/thread_ranks.h"
#include "trainer/config.h"
#include "trainer/optim.h"
#include "trainer/run.h"

namespace rlt {
namespace {

using rlt::testing::on_thread_ranks;

DistEnv env_of(const std::map<std::string, std::string>& vars) {
  return dist_env([&](const char* n) -> const char* {
    auto it = vars.find(n);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

std::string error_of(const std::map<std::string, std::string>& vars) {
  try {
    env_of(vars);
  } catch (const RunError& e) {
    return e.what();
  }
  return "";
}

TEST(DistEnv, ReadsTorchrunsVariablesAndRefusesPartialOrBadSets) {
  EXPECT_FALSE(env_of({}).launched) << "no variables: one process";
  const std::map<std::string, std::string> full = {
      {"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29511"}};
  const DistEnv e = env_of(full);
  EXPECT_TRUE(e.launched);
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.world, 2);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.master_addr, "10.0.0.1");
  EXPECT_EQ(e.master_port, 29511);
  auto with = [&](const std::string& k, const std::string& v) {
    auto m = full;
    m[k] = v;
    return m;
  };
  auto without = [&](const std::string& k) {
    auto m = full;
    m.erase(k);
    return m;
  };
  EXPECT_NE(error_of(without("MASTER_PORT")).find("MASTER_PORT is not set"), std::string::npos);
  EXPECT_NE(error_of(without("LOCAL_RANK")).find("LOCAL_RANK is not set"), std::string::npos);
  EXPECT_NE(error_of(with("RANK", "2")).find("RANK=2"), std::string::npos) << "rank outside the world";
  EXPECT_NE(error_of(with("WORLD_SIZE", "two")).find("WORLD_SIZE=two"), std::string::npos);
  EXPECT_NE(error_of(with("MASTER_PORT", "70000")).find("MASTER_PORT=70000"), std::string::npos);
  EXPECT_NE(error_of(with("RANK", "1x")).find("RANK=1x"), std::string::npos);
}

// A step of P = 8 prompts in mini-batches of 4 over 2 ranks: each rank samples half of every mini-batch,
// so the ranks' k-th local mini-batches together are the one-process k-th mini-batch. The plain split
// (rank 0 the first half of the step) would put a whole mini-batch on one rank and change what each
// optimizer step sees: the property below rejects it.
TEST(RankPrompts, EveryMiniBatchSplitsOverTheRanks) {
  const int64_t P = 8, ppm = 4;
  const int world = 2;
  auto holds = [&](const std::vector<std::vector<int64_t>>& share) {
    std::set<int64_t> all;
    for (int r = 0; r < world; ++r) {
      if (static_cast<int64_t>(share[r].size()) != P / world) return false;
      all.insert(share[r].begin(), share[r].end());
      // The k-th local mini-batch (ppm / world prompts) lies inside the k-th global one.
      for (size_t j = 0; j < share[r].size(); ++j) {
        if (share[r][j] / ppm != static_cast<int64_t>(j) / (ppm / world)) return false;
      }
    }
    return static_cast<int64_t>(all.size()) == P;
  };
  std::vector<std::vector<int64_t>> share;
  for (int r = 0; r < world; ++r) share.push_back(rank_prompts(P, ppm, world, r));
  EXPECT_EQ(share[0], (std::vector<int64_t>{0, 1, 4, 5}));
  EXPECT_EQ(share[1], (std::vector<int64_t>{2, 3, 6, 7}));
  EXPECT_TRUE(holds(share));
  EXPECT_FALSE(holds({{0, 1, 2, 3}, {4, 5, 6, 7}})) << "the plain split must fail the property";
  EXPECT_EQ(rank_prompts(4, 4, 1, 0), (std::vector<int64_t>{0, 1, 2, 3})) << "one rank: the step in order";
  EXPECT_THROW(rank_prompts(6, 3, 2, 0), c10::Error) << "3 prompts do not split over 2 ranks";
}

// The sequences of each step-wide mini-batch (every rank's k-th) dealt over the ranks by tokens: each rank
// keeps its count, every sequence lands once in its own mini-batch, and the ranks' tokens differ by at most
// the longest sequence's. Where they were sampled (the wrong twin: no deal) the first mini-batch's differ by
// 240 tokens, past that bound.
TEST(BalanceTokens, TheDealKeepsEachMiniBatchAndEvensTheRanksTokens) {
  const std::vector<std::vector<int64_t>> lengths = {{100, 90, 80, 5, 5, 5}, {10, 10, 10, 70, 60, 50}};
  const int64_t mini = 3;
  // spread of mini-batch k's tokens over the ranks under `deal`, or -1 when the deal breaks a rule.
  auto spread = [&](const std::vector<std::vector<std::pair<int, int64_t>>>& deal, int64_t k) -> int64_t {
    std::set<std::pair<int, int64_t>> seen;
    int64_t lo = INT64_MAX, hi = 0, longest = 0;
    for (const auto& mine : deal) {
      if (mine.size() != lengths[0].size()) return -1;
      int64_t tokens = 0;
      for (int64_t j = k * mini; j < (k + 1) * mini; ++j) {
        const auto [r, i] = mine[j];
        if (i / mini != k || !seen.insert({r, i}).second) return -1;  // another mini-batch, or twice
        tokens += lengths[r][i];
        longest = std::max(longest, lengths[r][i]);
      }
      lo = std::min(lo, tokens);
      hi = std::max(hi, tokens);
    }
    if (static_cast<int64_t>(seen.size()) != 2 * mini) return -1;
    return hi - lo <= longest ? hi - lo : -2;
  };
  const auto deal = deal_by_tokens(lengths, mini);
  EXPECT_EQ(deal[0], (std::vector<std::pair<int, int64_t>>{{0, 0}, {1, 0}, {1, 1}, {1, 3}, {0, 3}, {0, 4}}));
  EXPECT_EQ(spread(deal, 0), 60);  // 120 and 180 tokens, against 270 and 30 where sampled
  EXPECT_GE(spread(deal, 1), 0);
  std::vector<std::vector<std::pair<int, int64_t>>> kept(2);
  for (int r = 0; r < 2; ++r) {
    for (int64_t i = 0; i < 6; ++i) kept[r].push_back({r, i});
  }
  EXPECT_EQ(spread(kept, 0), -2) << "the sampled split must fail the bound";
  EXPECT_EQ(deal_by_tokens({{4, 3}}, 2), (std::vector<std::vector<std::pair<int, int64_t>>>{{{0, 0}, {0, 1}}}))
      << "one rank: its own order, longest first";
}

TEST(StoreCollectives, SumsMaximaAndBroadcastAgreeOnEveryRank) {
  const int world = 3;
  std::vector<at::Tensor> sums(world), maxima(world), cast(world);
  on_thread_ranks(world, [&](int r, std::shared_ptr<Collectives> c) {
    EXPECT_EQ(c->rank(), r);
    EXPECT_EQ(c->world(), world);
    // Two tensors of two dtypes in one call, as a gradient bucket might hold.
    at::Tensor a = at::tensor({1.0 * (r + 1), 0.1 * r}, at::kDouble);
    at::Tensor b = at::full({2, 2}, static_cast<float>(r), at::kFloat);
    c->all_reduce({a, b}, ReduceOp::kSum);
    at::Tensor m = at::tensor({double(r), -double(r)}, at::kDouble);
    c->all_reduce({m}, ReduceOp::kMax);
    at::Tensor x = at::full({3}, 10.0 * r, at::kFloat);
    c->broadcast({x}, /*root=*/1);
    c->barrier();
    sums[r] = at::cat({a, b.flatten().to(at::kDouble)});
    maxima[r] = m;
    cast[r] = x;
  });
  // Rank order 0 + 1 + 2, on every rank the same bits.
  const at::Tensor expect_sum = at::tensor({6.0, (0.0 + 0.1) + 0.2, 3.0, 3.0, 3.0, 3.0}, at::kDouble);
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(at::equal(sums[r], sums[0])) << "rank " << r;
    EXPECT_TRUE(at::equal(maxima[r], at::tensor({2.0, 0.0}, at::kDouble))) << "rank " << r;
    EXPECT_TRUE(at::equal(cast[r], at::full({3}, 10.0f, at::kFloat))) << "rank 1's values on rank " << r;
  }
  EXPECT_TRUE(at::equal(sums[0], expect_sum)) << sums[0];
}

// Rank 1 marks where it is and never joins the collective: rank 0 gives up after the timeout with a
// DistError naming rank 1 and its mark.
TEST(StoreCollectives, ALateRankIsNamedWithWhereItWas) {
  std::string message;
  on_thread_ranks(
      2,
      [&](int r, std::shared_ptr<Collectives> c) {
        c->mark(r == 0 ? "step 3: update" : "step 3: rollout");
        if (r == 1) return;
        at::Tensor t = at::ones({1});
        try {
          c->all_reduce({t}, ReduceOp::kSum);
        } catch (const DistError& e) {
          message = e.what();
        }
      },
      std::chrono::milliseconds(300));
  EXPECT_NE(message.find("rank 1 did not reach collective 0"), std::string::npos) << message;
  EXPECT_NE(message.find("step 3: rollout"), std::string::npos) << message;
}

Trajectory traj(int64_t sampled) {
  Trajectory t;
  t.response_ids.assign(sampled + 1, 5);
  t.loss_mask.assign(sampled + 1, 0);
  for (int64_t i = 0; i < sampled; ++i) t.loss_mask[i] = 1;
  return t;
}

// One process with sequences of 3, 0, 5, 2 sampled tokens in one mini-batch, against two ranks holding
// (3, 0) and (5, 2): each rank's denominator must be the whole mini-batch's. Each rank's own (the wrong
// implementation: local means, then gradients summed) would double the gradient.
TEST(MiniBatchDenominators, AreTheWholeMiniBatchsOverRanks) {
  const std::vector<Trajectory> all = {traj(3), traj(0), traj(5), traj(2)};
  for (LossAgg agg : {LossAgg::kTokenMean, LossAgg::kSeqMeanTokenMean, LossAgg::kSeqMeanTokenSum}) {
    const double one = mini_batch_denominator(all, 0, 4, agg);
    std::vector<double> got(2);
    on_thread_ranks(2, [&](int r, std::shared_ptr<Collectives> c) {
      const std::vector<Trajectory> mine(all.begin() + 2 * r, all.begin() + 2 * r + 2);
      got[r] = mini_batch_denominators(mine, 2, agg, *c).at(0);
    });
    EXPECT_EQ(got[0], one) << static_cast<int>(agg);
    EXPECT_EQ(got[1], one) << static_cast<int>(agg);
    const std::vector<Trajectory> rank1(all.begin() + 2, all.end());
    EXPECT_NE(mini_batch_denominator(rank1, 0, 2, agg), one) << "a rank's own denominator differs";
  }
  // Two mini-batches per rank: the k-th of each rank together.
  std::vector<std::vector<double>> two(2);
  on_thread_ranks(2, [&](int r, std::shared_ptr<Collectives> c) {
    const std::vector<Trajectory> mine =
        r == 0 ? std::vector<Trajectory>{traj(1), traj(2)} : std::vector<Trajectory>{traj(4), traj(8)};
    two[r] = mini_batch_denominators(mine, 1, LossAgg::kTokenMean, *c);
  });
  EXPECT_EQ(two[0], (std::vector<double>{1 + 4, 2 + 8}));
  EXPECT_EQ(two[1], two[0]);
}

// Each rank's trajectories land in their rows of the step's table on every rank; a row no rank fills stays
// zero, and a place outside the step is refused.
TEST(GatherTable, EveryRanksRowsInTheirPlaces) {
  std::vector<at::Tensor> tables(2);
  on_thread_ranks(2, [&](int r, std::shared_ptr<Collectives> c) {
    std::vector<Trajectory> t = {traj(2 + r), traj(7)};
    t[0].reward = r == 0 ? 1.0 : -0.5;
    t[1].tool_calls = 3;
    t[1].correct = r == 1;
    tables[r] = gather_table(*c, t, {r == 0 ? 0 : 2, r == 0 ? 1 : 3}, 4);
  });
  ASSERT_TRUE(at::equal(tables[0], tables[1]));
  const at::Tensor& t = tables[0];
  EXPECT_EQ(t[0][kReward].item<double>(), 1.0);
  EXPECT_EQ(t[2][kReward].item<double>(), -0.5);
  EXPECT_EQ(t[0][kSampledTokens].item<double>(), 2);
  EXPECT_EQ(t[2][kSampledTokens].item<double>(), 3);
  EXPECT_EQ(t[1][kToolCalls].item<double>(), 3);
  EXPECT_EQ(t[3][kCorrect].item<double>(), 1);
  EXPECT_EQ(t[1][kCorrect].item<double>(), 0);
  auto one = single_process();
  EXPECT_THROW(gather_table(*one, {traj(1)}, {4}, 4), c10::Error);
}

// update_batch with balance over two thread ranks: each rank's trajectories arrive whole with their
// step-wide places (the union per mini-batch is the step's), and the ranks' tokens are evened.
TEST(BalanceTokens, UpdateBatchSendsTrajectoriesWithTheirPlaces) {
  std::vector<RolloutBatch> rb(2);
  for (int r = 0; r < 2; ++r) {
    for (int64_t i = 0; i < 4; ++i) {
      Trajectory t = traj(r == 0 ? 40 - 10 * i : 2 + i);  // rank 0 long, rank 1 short
      t.prompt_ids = {1, 2, 3};
      t.response_ids.assign(t.loss_mask.size(), 100 * r + i);  // names its origin
      t.logprobs.assign(t.loss_mask.size(), -0.5f);
      t.reward = r + 0.1 * i;
      rb[r].trajs.push_back(t);
      rb[r].index.push_back(8 * r + i);
    }
  }
  std::vector<std::vector<Trajectory>> got(2);
  std::vector<std::vector<int64_t>> places(2);
  on_thread_ranks(2, [&](int r, std::shared_ptr<Collectives> c) {
    const UpdateBatch ub = update_batch(rb[r], /*mini=*/2, /*micro=*/2, /*budget=*/0, false, false, c.get());
    got[r] = ub.trajs();
    places[r] = ub.index;
  });
  int64_t tokens[2] = {0, 0};
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(got[r].size(), 4u);
    for (size_t j = 0; j < 4; ++j) {
      const Trajectory& t = got[r][j];
      const int64_t place = places[r][j], from = place / 8, i = place % 8;
      const Trajectory& want = rb[from].trajs[i];
      EXPECT_EQ(t.response_ids, want.response_ids) << "rank " << r << " place " << place;
      EXPECT_EQ(t.loss_mask, want.loss_mask);
      EXPECT_EQ(t.reward, want.reward);
      EXPECT_EQ(static_cast<int64_t>(j) / 2, i / 2) << "moved out of its mini-batch";
      tokens[r] += t.window_end();
    }
  }
  std::set<int64_t> all(places[0].begin(), places[0].end());
  all.insert(places[1].begin(), places[1].end());
  EXPECT_EQ(all, (std::set<int64_t>{0, 1, 2, 3, 8, 9, 10, 11}));
  EXPECT_LE(std::abs(tokens[0] - tokens[1]), 44) << "at most the longest sequence apart";
}

TEST(CheckWorld, StepsThatDoNotSplitAreRefusedNamingTheKey) {
  Config c = load_config("", {});
  c.train.prompts_per_step = 6;
  c.sampling.samples_per_prompt = 4;
  c.train.mini_batch_size = 0;
  EXPECT_NO_THROW(check_world(c, 2));
  EXPECT_NO_THROW(check_world(c, 3));
  auto message = [&](const Config& cfg, int world) {
    try {
      check_world(cfg, world);
    } catch (const RunError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message(c, 4).find("train.prompts_per_step = 6"), std::string::npos);
  c.train.mini_batch_size = 12;  // 3 prompts: not over 2 ranks
  EXPECT_NE(message(c, 2).find("train.mini_batch_size = 12"), std::string::npos);
  c.train.mini_batch_size = 6;  // not whole prompts
  EXPECT_NE(message(c, 2).find("train.mini_batch_size = 6"), std::string::npos);
  c.train.prompts_per_step = 8;
  c.train.mini_batch_size = 8;  // 2 prompts per mini-batch, 4 mini-batches
  EXPECT_NO_THROW(check_world(c, 2));
  EXPECT_NO_THROW(check_world(c, 1));
  const StepShape s = step_shape(c, 2);
  EXPECT_EQ(s.S, 16);
  EXPECT_EQ(s.mini, 4);
  EXPECT_EQ(s.total_optimizer_steps, step_shape(c, 1).total_optimizer_steps) << "the schedule counts global steps";
}

// Counts the gradient buckets started, and on which thread: the reducer's hooks start them while the
// backward runs (on the autograd engine's device thread for CUDA).
class CountingCollectives : public testing::ForwardingCollectives {
 public:
  using ForwardingCollectives::ForwardingCollectives;
  std::unique_ptr<Pending> all_reduce_start(const std::vector<at::Tensor>& t) override {
    ++started;
    tensors += static_cast<int64_t>(t.size());
    return inner_->all_reduce_start(t);
  }
  int64_t started = 0, tensors = 0;
};

// A bf16 model with fp32 master weights, two micro-batches: the reducer, armed for the second, starts
// every bucket from its hooks before loss.backward() returns, and leaves the master gradients exactly
// what a plain backward + accumulate_gradients leaves (one rank: the sum is the gradient itself). On the
// GPU its collectives are NCCL's (one rank), launched from the autograd engine's device thread. Wrong
// implementations it rejects: a reducer that also reduced the first micro-batch (buckets counted twice),
// or whose hooks took the bf16 gradient of the armed backward alone (the first micro-batch's lost).
// A bf16 llama-style model with fp32 master weights (1 MiB gradient buckets), and a loss of it per seed.
struct TinyBf16 {
  at::Device device;
  Run make(std::shared_ptr<Collectives> dist) const {
    Run run;
    run.config = load_config("", {});
    run.config.train.dist_bucket_mb = 1;
    run.device = device;
    run.model.policy =
        std::make_unique<Transformer>(testing::tiny_llama(97, /*tie_word_embeddings=*/true), at::kBFloat16, device, 7);
    if (dist) run.dist = dist;
    make_optimizer(run, {});
    return run;
  }
  // The ids come from a generator of the seed's own: ranks on threads would race on the global one.
  at::Tensor loss(Run& run, int64_t seed) const {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    const at::Tensor ids = at::randint(97, {2, 9}, gen, at::TensorOptions().dtype(at::kLong)).to(device);
    const at::Tensor pos = at::arange(9, at::TensorOptions().dtype(at::kLong)).expand({2, 9}).to(device);
    const at::Tensor h = run.model.policy->forward(ids, pos, at::Tensor());
    return run.model.policy->logits(h).to(at::kFloat).logsumexp(-1).mean();
  }
};

void reducer_matches_plain_backward(at::Device device, std::shared_ptr<Collectives> inner) {
  const TinyBf16 tiny{device};
  auto make = [&](std::shared_ptr<Collectives> dist) { return tiny.make(dist); };
  auto loss_of = [&](Run& run, int64_t seed) { return tiny.loss(run, seed); };
  Run plain = make(nullptr);
  backward(plain, loss_of(plain, 1), nullptr, false);
  backward(plain, loss_of(plain, 2), nullptr, true);

  auto counting = std::make_shared<CountingCollectives>(inner);
  Run run = make(counting);
  ASSERT_EQ(run.model.master.size(), run.model.policy->parameters().size()) << "bf16 with fp32 masters";
  GradReducer reducer(*run.dist, run.model.policy->trainable_parameters(), run.model.master,
                      4096);  // small buckets: several of them
  ASSERT_GT(reducer.buckets(), 2);
  backward(run, loss_of(run, 1), &reducer, false);
  EXPECT_EQ(counting->started, 0) << "the first micro-batch accumulates locally";
  reducer.arm();
  loss_of(run, 2).backward();
  EXPECT_EQ(counting->started, reducer.buckets()) << "every bucket starts during the backward";
  reducer.finish();
  accumulate_gradients(run.model);
  EXPECT_EQ(counting->tensors, static_cast<int64_t>(run.model.master.size())) << "each gradient in one bucket, once";
  for (size_t i = 0; i < run.model.master.size(); ++i) {
    ASSERT_TRUE(run.model.master[i].grad().defined()) << i;
    EXPECT_TRUE(at::equal(run.model.master[i].grad().cpu(), plain.model.master[i].grad().cpu())) << "parameter " << i;
    EXPECT_FALSE(run.model.policy->parameters()[i].grad().defined()) << "bf16 gradient released, " << i;
  }
  // The second micro-batch's gradient alone (the first's lost) is far from the sum.
  Run second = make(nullptr);
  backward(second, loss_of(second, 2), nullptr, true);
  double diff = 0;
  for (size_t i = 0; i < run.model.master.size(); ++i) {
    diff += (second.model.master[i].grad() - plain.model.master[i].grad()).abs().sum().item<double>();
  }
  EXPECT_GT(diff, 1e-3);
}

TEST(GradReducer, StartsEveryBucketDuringTheBackwardAndSumsLikeAPlainBackward) {
  reducer_matches_plain_backward(at::kCPU, single_process());
}

// Two thread ranks, each one micro-batch of its own: after the reducer every rank's fp32 master gradient
// is exactly the fp32 sum of the two ranks' master gradients (rank order), the sum one process would
// accumulate. Summing the bf16 gradients instead (before they reach the masters) rounds the sum to bf16,
// which the bit-exact comparison rejects; the test shows that rounding is visible here. Every thread that
// computes (the reference's and each rank's) runs one intra-op thread: with OpenMP the count is per
// calling thread, so a rank's thread could split a CPU reduction another way than the main thread, which
// changes the last bit (this failed on the 16-core GPU host, not on 2 cores).
TEST(GradReducer, TwoRanksSumTheirFp32MasterGradients) {
  const testing::IntraOpThreads one(1);
  const TinyBf16 tiny{at::kCPU};
  std::vector<std::vector<at::Tensor>> own(2), reduced(2);
  for (int r = 0; r < 2; ++r) {
    rlt::Run run = tiny.make(nullptr);
    backward(run, tiny.loss(run, 10 + r), nullptr, true);
    for (const auto& m : run.model.master) own[r].push_back(m.grad().clone());
  }
  rlt::testing::on_thread_ranks(2, [&](int r, std::shared_ptr<Collectives> c) {
    at::set_num_threads(1);
    rlt::Run run = tiny.make(c);
    GradReducer reducer(*run.dist, run.model.policy->trainable_parameters(), run.model.master, 4096);
    backward(run, tiny.loss(run, 10 + r), &reducer, true);
    for (const auto& m : run.model.master) reduced[r].push_back(m.grad().clone());
  });
  bool bf16_sum_differs = false;
  for (size_t i = 0; i < own[0].size(); ++i) {
    const at::Tensor sum = own[0][i] + own[1][i];
    EXPECT_TRUE(at::equal(reduced[0][i], sum)) << "parameter " << i;
    EXPECT_TRUE(at::equal(reduced[1][i], sum)) << "parameter " << i;
    bf16_sum_differs |= !at::equal(sum.to(at::kBFloat16).to(at::kFloat), sum);
  }
  EXPECT_TRUE(bf16_sum_differs) << "a bf16 sum would be told apart";
}

TEST(GradReducerCuda, NcclOfOneRankFromTheDeviceThread) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(nccl_available()) << "a CUDA host builds NCCL (nccl.h from the nvidia-nccl wheel)";
  const at::Device dev(at::kCUDA, 0);
  auto nccl = nccl_collectives(thread_store(), 0, 1, dev, std::chrono::seconds(60));
  // The collectives themselves: host tensors go through the device and come back; one rank's sum and
  // maximum are its values, its broadcast keeps them.
  at::Tensor host = at::tensor({1.5, -2.0}, at::kDouble);
  at::Tensor gpu = at::tensor({3.0f, 4.0f}).to(dev);
  nccl->all_reduce({host, gpu}, ReduceOp::kSum);
  nccl->all_reduce({host}, ReduceOp::kMax);
  nccl->broadcast({gpu}, 0);
  nccl->barrier();
  EXPECT_TRUE(at::equal(host, at::tensor({1.5, -2.0}, at::kDouble)));
  EXPECT_TRUE(at::equal(gpu.cpu(), at::tensor({3.0f, 4.0f})));
  reducer_matches_plain_backward(dev, nccl);
}

// train.cpu_threads: a launched rank keeps the user's OMP_NUM_THREADS, not torchrun's default 1, and
// otherwise shares the host's CPUs with the run's other ranks there.
TEST(CpuThreads, ALaunchedRankKeepsTheUsersCountElseSharesTheHost) {
  const HostCpus all{32, 32};
  EXPECT_EQ(rank_cpu_threads(/*configured=*/0, /*user=*/0, all, /*ranks_on_host=*/2), 16);
  EXPECT_EQ(rank_cpu_threads(0, 0, all, 1), 32);
  EXPECT_EQ(rank_cpu_threads(0, 0, HostCpus{4, 4}, 8), 1) << "at least one";
  EXPECT_EQ(rank_cpu_threads(0, 0, HostCpus{16, 128}, 8), 16) << "bound to 16 CPUs of its own: not shared again";
  EXPECT_EQ(rank_cpu_threads(0, 3, all, 2), 3) << "the user's count";
  EXPECT_EQ(rank_cpu_threads(6, 3, all, 2), 6) << "train.cpu_threads over all";
  std::map<std::string, std::string> vars;
  auto env = [&](const char* k) -> const char* {
    const auto it = vars.find(k);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
  EXPECT_EQ(user_omp_threads(env), 0) << "unset";
  vars["OMP_NUM_THREADS"] = "1";
  EXPECT_EQ(user_omp_threads(env), 1) << "set by the user, no torchrun";
  vars["TORCHELASTIC_RUN_ID"] = "none";
  EXPECT_EQ(user_omp_threads(env), 0) << "torchrun's default";
  vars["OMP_NUM_THREADS"] = "4";
  EXPECT_EQ(user_omp_threads(env), 4) << "set by the user under torchrun";
  for (const char* bad : {"", "0", "-2", "4x", "all"}) {
    vars["OMP_NUM_THREADS"] = bad;
    EXPECT_EQ(user_omp_threads(env), 0) << "'" << bad << "'";
  }
  const HostCpus here = host_cpus();
  EXPECT_GE(here.allowed, 1);
  EXPECT_LE(here.allowed, here.online);
}

}  // namespace
}  // namespace rlt
