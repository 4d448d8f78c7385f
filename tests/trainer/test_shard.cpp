// The sharded training state (parallel/shard.h) against the replicated one-process optimizer: thread ranks
// over the in-memory store, fp32, 2 and 3 ranks (3 leaves uneven chunks: a tensor straddles two ranks),
// every stage, offload. Each run takes 3 optimizer steps over the same six micro-batches a step, dealt
// round-robin to the ranks, with a value-head-like extra tensor (its own learning rate, no decay); the
// reference takes them all in one process with torch's AdamW. AdamW's epsilon is large (1e-2, against
// gradients of about 1e-3), so an update scales with its gradient: a gradient doubled or halved shows in
// the weights, where Adam's normalisation would otherwise hide it. Each deliberate mistake of ShardFault
// must move the weights by far more than the tolerance.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <set>

#include "model/safetensors.h"
#include "parallel/shard.h"
#include "tests/common/threads.h"
#include "tests/common/tiny_model.h"
#include "tests/common/tmpdir.h"
#include "tests/trainer/thread_ranks.h"
#include "tests/trainer/tiny_run.h"
#include "trainer/config.h"
#include "trainer/optim.h"
#include "trainer/run.h"

namespace rlt {
namespace {

constexpr int64_t kVocab = 97, kMicro = 6, kSteps = 3;

struct ShardSetup {
  ShardStage shard = ShardStage::kNone;
  Offload offload = Offload::kNone;
  ShardFault fault = ShardFault::kNone;
  bool tie = false;
  double clip = 0.05;  // binding: the global norm is about 0.1; 0 = off
  double lr = 3e-2;
  bool lora = false;  // rank-4 adapters on every projection: the trainable tensors are the adapters
  bool keep = false;  // rollout.keep_weights: the parameters stage keeps what it gathers
};

Run make_run(const ShardSetup& s, std::shared_ptr<Collectives> dist) {
  Run run;
  run.config = load_config("", {});
  TrainOptions& t = run.config.train;
  t.lr = s.lr;
  t.adam_eps = 1e-2;
  t.weight_decay = 0.1;
  t.grad_clip = s.clip;
  run.config.model.activation_checkpointing = true;
  run.model.policy = std::make_unique<Transformer>(testing::tiny_llama(kVocab, s.tie), at::kFloat, at::kCPU, 7);
  run.model.policy->set_activation_checkpointing(true);
  if (s.lora) {
    LoraOptions lora;
    lora.rank = 4;
    lora.alpha = 8;
    run.config.lora = lora;
    run.model.policy->attach_lora(lora, 11);
  }
  // Generators of their own: the ranks run on threads at once, and the global one is shared.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  run.model.extra["value_head.weight"] = (at::randn({32}, gen) * 0.1).requires_grad_(true);
  if (dist) run.dist = dist;
  ExtraParams extra;
  extra.lr = [](const Config& c) { return 2 * c.train.lr; };
  make_optimizer(run, extra);  // the replicated AdamW
  if (s.shard != ShardStage::kNone || s.offload != Offload::kNone) {
    t.shard = s.shard;
    t.offload = s.offload;
    run.config.rollout.keep_weights = s.keep;
    run.model.optimizer.reset();
    run.model.sharded = make_sharded_state(run, s.fault);
  }
  return run;
}

// Micro-batch `m` of optimizer step `step`: a loss of the policy and the extra tensor.
at::Tensor loss_of(Run& run, int64_t step, int64_t m) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 * step + m);
  const at::Tensor ids = at::randint(kVocab, {2, 7}, gen, at::TensorOptions().dtype(at::kLong));
  const at::Tensor pos = at::arange(7, at::TensorOptions().dtype(at::kLong)).expand({2, 7});
  const at::Tensor h = run.model.policy->forward(ids, pos, at::Tensor());
  const at::Tensor value = (h * run.model.extra.at("value_head.weight")).sum(-1);
  return run.model.policy->logits(h).logsumexp(-1).mean() + 0.1 * value.square().mean();
}

// Steps [first, last) on one rank: micro-batches rank, rank + world, ... of each. A replicated state over
// several ranks sums its gradients with the run's GradReducer, as the trainers do.
void train(Run& run, int64_t first, int64_t last) {
  const int world = run.dist->world(), rank = run.dist->rank();
  std::unique_ptr<GradReducer> reducer = make_reducer(run);
  for (int64_t step = first; step < last; ++step) {
    zero_gradients(run.model);
    at::Tensor total = at::zeros({});
    std::vector<int64_t> mine;
    for (int64_t m = rank; m < kMicro; m += world) mine.push_back(m);
    for (size_t k = 0; k < mine.size(); ++k) {
      const at::Tensor loss = loss_of(run, step, mine[k]);
      total = total + loss.detach();
      backward(run, loss, reducer.get(), k + 1 == mine.size());
    }
    apply_gradients(run, total, kSteps);
  }
}

// Every trainable tensor, whole, by name (the parameters stage gathers them).
std::map<std::string, at::Tensor> weights(Run& run) {
  const GatheredWeights whole(run.model.sharded);
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, t] : run.model.policy->named_parameters()) out[name] = t.detach().clone();
  for (const auto& [name, t] : run.model.policy->named_trainable_parameters()) out[name] = t.detach().clone();
  for (const auto& [name, t] : run.model.extra) out[name] = t.detach().clone();
  return out;
}

// max over tensors of max |a - b| / max |b|.
double rel_diff(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b) {
  double worst = 0;
  EXPECT_EQ(a.size(), b.size());
  for (const auto& [name, t] : b) {
    const at::Tensor x = a.at(name);
    EXPECT_EQ(x.sizes(), t.sizes()) << name;
    if (x.sizes() != t.sizes()) return INFINITY;
    worst = std::max(worst, (x - t).abs().max().item<double>() / std::max(1e-12, t.abs().max().item<double>()));
  }
  return worst;
}

std::map<std::string, at::Tensor> reference(bool tie = false, double clip = 0.05, double lr = 3e-2, bool lora = false) {
  ShardSetup s;
  s.lora = lora;
  s.tie = tie;
  s.clip = clip;
  s.lr = lr;
  rlt::Run run = make_run(s, nullptr);
  train(run, 0, kSteps);
  return weights(run);
}

// The weights of every rank after `kSteps` steps of `s` over `world` thread ranks.
std::vector<std::map<std::string, at::Tensor>> sharded(const ShardSetup& s, int world) {
  std::vector<std::map<std::string, at::Tensor>> out(world);
  testing::on_thread_ranks(world, [&](int r, std::shared_ptr<Collectives> c) {
    at::set_num_threads(1);
    rlt::Run run = make_run(s, c);
    train(run, 0, kSteps);
    out[r] = weights(run);
  });
  return out;
}

class ShardStages : public ::testing::TestWithParam<std::tuple<ShardStage, int>> {};

TEST_P(ShardStages, EqualTheReplicatedRunAndRejectEachMistake) {
  const testing::IntraOpThreads one(1);
  const auto [stage, world] = GetParam();
  const auto ref = reference();
  ShardSetup s;
  s.shard = stage;
  for (const auto& w : sharded(s, world)) EXPECT_LT(rel_diff(w, ref), 1e-6);
  // The mistakes: each must be far off (one rank's view suffices). Clipping off: a gradient scaled as a
  // whole (reduced twice, averaged) would otherwise be clipped back to the same norm; and a smaller
  // learning rate, as the unclipped updates are larger.
  const auto ref_unclipped = reference(false, 0, 1e-2);
  s.clip = 0;
  s.lr = 1e-2;
  for (const auto& w : sharded(s, world)) EXPECT_LT(rel_diff(w, ref_unclipped), 1e-6);
  for (ShardFault f : {ShardFault::kReduceTwice, ShardFault::kNeverReduce, ShardFault::kSliceOffByOne,
                       ShardFault::kAverage, ShardFault::kMomentWrongSlice}) {
    s.fault = f;
    EXPECT_GT(rel_diff(sharded(s, world)[world - 1], ref_unclipped), 1e-3) << "fault " << int(f);
  }
}

INSTANTIATE_TEST_SUITE_P(, ShardStages,
                         ::testing::Combine(::testing::Values(ShardStage::kOptimizer, ShardStage::kGradients,
                                                              ShardStage::kParameters),
                                            ::testing::Values(2, 3)),
                         [](const auto& info) {
                           return std::string(enum_to_string(std::get<0>(info.param))) + "_" +
                                  std::to_string(std::get<1>(info.param)) + "_ranks";
                         });

TEST(ShardedState, TiedEmbeddingsKeptWeightsAndOffloadEqualTheReplicatedRun) {
  const testing::IntraOpThreads one(1);
  const auto ref = reference(/*tie=*/true);
  ShardSetup s;
  s.tie = true;
  s.shard = ShardStage::kParameters;
  for (const auto& w : sharded(s, 2)) EXPECT_LT(rel_diff(w, ref), 1e-6);
  s.keep = true;  // gathered once, kept, gathered again after each step
  for (const auto& w : sharded(s, 3)) EXPECT_LT(rel_diff(w, ref), 1e-6);
  s.keep = false;
  s.shard = ShardStage::kGradients;
  s.offload = Offload::kOptimizer;
  for (const auto& w : sharded(s, 3)) EXPECT_LT(rel_diff(w, ref), 1e-6);
  s.shard = ShardStage::kNone;  // offload alone: a replicated state on the host
  for (const auto& w : sharded(s, 2)) EXPECT_LT(rel_diff(w, ref), 1e-6);
}

// train.offload_step: auto streams through the GPU where the run's ranks share a host; set, as set.
TEST(OffloadStep, AutoStreamsThroughTheDeviceWhereRanksShareAHost) {
  EXPECT_EQ(offload_mode(OffloadStep::kAuto, /*cuda=*/true, /*ranks_on_host=*/2), OffloadMode::kStreamDevice);
  EXPECT_EQ(offload_mode(OffloadStep::kAuto, true, 1), OffloadMode::kHostStep);
  EXPECT_EQ(offload_mode(OffloadStep::kAuto, false, 8), OffloadMode::kHostStep) << "no GPU to stream through";
  EXPECT_EQ(offload_mode(OffloadStep::kHost, true, 8), OffloadMode::kHostStep);
  EXPECT_EQ(offload_mode(OffloadStep::kDevice, true, 1), OffloadMode::kStreamDevice);
}

// make_run decides auto once, alike on every rank: two ranks of one host on the CPU step on the host.
TEST(OffloadStep, TheRunDecidesAutoOnEveryRank) {
  const testing::TempDir tmp("offload_step");
  Config c = rlt::testing::tiny_task_config();
  c.train.offload = Offload::kOptimizer;
  c.train.mini_batch_size = 8;  // a prompt for each rank
  std::vector<OffloadStep> decided(2, OffloadStep::kAuto);
  rlt::testing::on_thread_ranks(2, [&](int rank, std::shared_ptr<Collectives> dist) {
    const rlt::Run run = make_run(c, (tmp.path() / "run").string(), /*resume=*/false, {}, dist);
    decided[rank] = run.config.train.offload_step;
  });
  for (const OffloadStep s : decided) EXPECT_EQ(s, OffloadStep::kHost) << enum_to_string(s);
  c.train.offload = Offload::kNone;  // nothing offloaded: nothing to decide
  const rlt::Run run = make_run(c, (tmp.path() / "none").string(), /*resume=*/false, {});
  EXPECT_EQ(run.config.train.offload_step, OffloadStep::kAuto);
}

// LoRA: the base is frozen and replicated, the adapters train; replicated over 2 ranks (the GradReducer)
// and sharded (optimizer, gradients) over 2 and 3, against one process. The base must not move.
TEST(ShardedState, LoraAdaptersEqualTheReplicatedRunWithAndWithoutSharding) {
  const testing::IntraOpThreads one(1);
  const auto ref = reference(false, 0.05, 3e-2, /*lora=*/true);
  ShardSetup s;
  s.lora = true;
  for (const auto& w : sharded(s, 2)) EXPECT_LT(rel_diff(w, ref), 1e-6) << "replicated, 2 ranks";
  for (ShardStage stage : {ShardStage::kOptimizer, ShardStage::kGradients}) {
    s.shard = stage;
    for (int world : {2, 3}) {
      for (const auto& w : sharded(s, world)) EXPECT_LT(rel_diff(w, ref), 1e-6) << enum_to_string(stage) << world;
    }
  }
  const auto untrained = [&] {
    rlt::Run run = make_run(s, nullptr);
    return weights(run);
  }();
  double adapters_moved = 0;
  for (const auto& [name, t] : untrained) {
    if (name.find("lora") == std::string::npos && name != "value_head.weight") {
      EXPECT_TRUE(at::equal(ref.at(name), t)) << name << ": the frozen base moved";
    } else {
      adapters_moved = std::max(adapters_moved, (ref.at(name) - t).abs().max().item<double>());
    }
  }
  EXPECT_GT(adapters_moved, 1e-3) << "the adapters train";
  // Twin: a unit reduced twice, clipping off.
  const auto ref_unclipped = reference(false, 0, 1e-2, /*lora=*/true);
  s.shard = ShardStage::kGradients;
  s.clip = 0;
  s.lr = 1e-2;
  EXPECT_LT(rel_diff(sharded(s, 2)[1], ref_unclipped), 1e-6);
  s.fault = ShardFault::kReduceTwice;
  EXPECT_GT(rel_diff(sharded(s, 2)[1], ref_unclipped), 1e-3);
}

// Collectives that count the reduce-scatters started and not yet waited for.
class CountingCollectives : public testing::ForwardingCollectives {
 public:
  using ForwardingCollectives::ForwardingCollectives;
  std::unique_ptr<Pending> reduce_scatter_start(const at::Tensor& out, const at::Tensor& in) override {
    most = std::max(most, ++open);
    return std::make_unique<Counted>(inner_->reduce_scatter_start(out, in), this);
  }
  int open = 0, most = 0;

 private:
  struct Counted : Pending {
    Counted(std::unique_ptr<Pending> p, CountingCollectives* o) : inner(std::move(p)), owner(o) {}
    void wait() override {
      inner->wait();
      --owner->open;
    }
    std::unique_ptr<Pending> inner;
    CountingCollectives* owner;
  };
};

// A backward holds at most two units' reduce buffers however many units the model has: the host may run
// far ahead of the device, and buffers each reduce kept until the backward's end were most of a gradient
// (a Qwen2.5-7B under shard gradients on 4 GPUs: 83 GiB at the peak, against 55 with two). The weights
// still equal the replicated run's (ShardStages runs the same slots); the twin that waits for none until
// the end holds every unit's.
TEST(ShardedState, HoldsAtMostTwoReducesInFlight) {
  const testing::IntraOpThreads one(1);
  for (const ShardFault fault : {ShardFault::kNone, ShardFault::kReducesUnbounded}) {
    std::vector<int> most(2);
    testing::on_thread_ranks(
        2,
        [&](int r, std::shared_ptr<Collectives> c) {
          at::set_num_threads(1);
          ShardSetup s;
          s.shard = ShardStage::kGradients;
          s.fault = fault;
          rlt::Run run = make_run(s, c);
          train(run, 0, 1);
          most[r] = static_cast<CountingCollectives&>(*c).most;
        },
        std::chrono::seconds(120),
        [](std::shared_ptr<Collectives> c) { return std::make_shared<CountingCollectives>(c); });
    for (int r = 0; r < 2; ++r) {
      if (fault == ShardFault::kNone) {
        EXPECT_EQ(most[r], 2) << "rank " << r;
      } else {
        EXPECT_GT(most[r], 4) << "rank " << r << ": the twin holds every unit's buffers";
      }
    }
  }
}

TEST(ShardedState, EveryElementIsOwnedByExactlyOneRank) {
  const testing::IntraOpThreads one(1);
  for (int world : {2, 3}) {
    std::vector<std::vector<ShardedState::Piece>> pieces(world);
    std::vector<std::string> names;
    std::vector<int64_t> sizes;
    testing::on_thread_ranks(world, [&](int r, std::shared_ptr<Collectives> c) {
      ShardSetup s;
      s.shard = ShardStage::kGradients;
      rlt::Run run = make_run(s, c);
      pieces[r] = run.model.sharded->pieces();
      if (r == 0) {
        for (const auto& [name, t] : run.model.policy->named_trainable_parameters()) sizes.push_back(t.numel());
        sizes.push_back(run.model.extra.at("value_head.weight").numel());
      }
    });
    std::vector<at::Tensor> count;
    for (int64_t n : sizes) count.push_back(at::zeros({n}, at::kInt));
    bool straddles = false;  // some tensor split between two ranks
    std::vector<std::set<int>> owners(sizes.size());
    for (int r = 0; r < world; ++r) {
      for (const auto& p : pieces[r]) {
        count[p.param].narrow(0, p.begin, p.count).add_(1);
        owners[p.param].insert(r);
      }
    }
    for (size_t i = 0; i < sizes.size(); ++i) {
      EXPECT_TRUE(at::all(count[i] == 1).item<bool>()) << "tensor " << i << " over " << world << " ranks";
      straddles |= owners[i].size() > 1;
    }
    EXPECT_TRUE(straddles) << world << " ranks";
  }
}

// Two ranks of the gradients stage save after 2 steps; three ranks of the parameters stage load that and
// take the third: the weights equal the uninterrupted run's. The twin resumes from the masters alone (the
// moments dropped, as a load that skipped them would): far off.
TEST(ShardedState, ResumesOnOtherRanksAndStage) {
  const testing::IntraOpThreads one(1);
  const auto ref = reference();
  const testing::TempDir dir("shard_resume"), masters_only("shard_masters");
  ShardSetup two;
  two.shard = ShardStage::kGradients;
  testing::on_thread_ranks(2, [&](int r, std::shared_ptr<Collectives> c) {
    at::set_num_threads(1);
    rlt::Run run = make_run(two, c);
    train(run, 0, 2);
    run.model.sharded->save(dir.path().string());
  });
  for (const auto& f : std::filesystem::directory_iterator(dir.path())) {
    const auto reader = safetensors::Reader::open(f.path().string());
    std::vector<std::pair<std::string, at::Tensor>> kept;
    for (const auto& name : reader.names()) {
      if (name.rfind("master/", 0) == 0) kept.push_back({name, reader.load(name)});
    }
    safetensors::write_file((masters_only.path() / f.path().filename()).string(), kept);
  }
  auto resumed = [&](const std::string& from, int64_t steps_done) {
    ShardSetup three;
    three.shard = ShardStage::kParameters;
    std::vector<std::map<std::string, at::Tensor>> out(3);
    testing::on_thread_ranks(3, [&](int r, std::shared_ptr<Collectives> c) {
      at::set_num_threads(1);
      rlt::Run run = make_run(three, c);
      run.counters.optimizer_steps = steps_done;
      run.model.sharded->load(from);
      run.counters.optimizer_steps = 2;
      train(run, 2, 3);
      out[r] = weights(run);
    });
    return out;
  };
  for (const auto& w : resumed(dir.path().string(), 2)) EXPECT_LT(rel_diff(w, ref), 1e-6);
  EXPECT_GT(rel_diff(resumed(masters_only.path().string(), 0)[0], ref), 1e-3);
}

}  // namespace
}  // namespace rlt
