// The rollout ranks' protocol; see rollout_ranks.h.
#include "trainer/rollout_ranks.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <optional>
#include <thread>

#include "common/files.h"
#include "common/memory.h"
#include "common/timing.h"
#include "parallel/shard.h"
#include "parallel/transfer.h"
#include "trainer/async_rollout.h"
#include "trainer/batch.h"
#include "trainer/optim.h"

namespace fs = std::filesystem;

namespace rlt {

namespace {

using Clock = std::chrono::steady_clock;

// The checkpoint's pending rollout (pending_rollout), which the rollout ranks sample again: without
// rollout.partial's carried groups, which they do not continue.
std::optional<PendingRollout> pending_state(const Run& run) {
  std::optional<PendingRollout> p = pending_rollout(run);
  if (p && p->partial) {
    throw RunError(run.resumed_from +
                   ": the checkpoint holds the unfinished groups of rollout.partial, which train.rollout_ranks "
                   "does not continue; resume it with train.rollout_ranks: 0");
  }
  return p;
}

// The tensors the rollout decodes, in one order on both sides: the policy's, or with LoRA the merged model's.
std::vector<at::Tensor> rollout_tensors(const Transformer& model) {
  std::vector<at::Tensor> out;
  for (const auto& [name, t] : model.named_parameters()) out.push_back(t.detach());
  return out;
}

}  // namespace

namespace {

int64_t bucket_bytes(const Config& c) { return c.train.rollout_sync_mb << 20; }

}  // namespace

void check_placement(const Config& c, int world) {
  const int64_t k = c.train.rollout_ranks;
  if (k == 0) return;
  const std::string n = std::to_string(world), ks = std::to_string(k);
  if (k >= world) {
    throw RunError("train.rollout_ranks = " + ks + " leaves no training rank among the job's " + n +
                   " ranks: use fewer rollout ranks (at most " + std::to_string(world - 1) + ") or more ranks");
  }
  try {
    check_world(c, world - static_cast<int>(k));
  } catch (const RunError& e) {
    throw RunError("the " + std::to_string(world - k) + " training ranks (" + n + " less train.rollout_ranks = " + ks +
                   "): " + e.what());
  }
  if (c.train.prompts_per_step % k != 0) {
    throw RunError("train.prompts_per_step = " + std::to_string(c.train.prompts_per_step) +
                   " does not split over train.rollout_ranks = " + ks +
                   ": each rollout rank samples whole prompts; use a multiple of " + ks);
  }
}

std::shared_ptr<Placement> place(const Config& c, const std::shared_ptr<Collectives>& all) {
  if (c.train.rollout_ranks == 0) return nullptr;
  check_placement(c, all->world());
  return place_ranks(static_cast<int>(c.train.rollout_ranks),
                     std::chrono::milliseconds(static_cast<int64_t>(1000 * c.train.dist_timeout_s)), all);
}

std::string staged_rollout_weights(const Run& run) { return (fs::path(run.out_dir) / "rollout_weights.next").string(); }

// ---- The training ranks ----

RemoteRollouts::RemoteRollouts(Run& run, PlacementFault fault, std::function<void()> before_publish)
    : run_(run),
      fault_(fault),
      before_publish_(std::move(before_publish)),
      async_(run.config.train.async == AsyncMode::kOneStep) {
  TORCH_CHECK(run.placement && !run.placement->rollout, "RemoteRollouts: a training rank of train.rollout_ranks");
  const std::optional<PendingRollout> pending = pending_state(run);
  if (pending && async_) {
    run.data.prompts->seek(pending->prompts_begin);  // the rollout ranks sample the pending batch again
    published_ = true;                               // and take its weights from the checkpoint
  }
}

void RemoteRollouts::publish() {
  if (before_publish_) before_publish_();
  at::NoGradGuard no_grad;
  const GatheredWeights whole(run_.model.sharded);  // train.shard parameters: every training rank gathers
  sync_s_ = sync_bytes_ = 0;
  const int64_t n = publishes_++;
  if (!run_.placement->publish) return;            // training ranks other than 0
  if (const auto& h = run_.placement->handover) {  // both sides ready before the broadcast's collectives
    h->announce("publish" + std::to_string(n));
    h->await("ready" + std::to_string(n), run_.placement->sampling_ranks(),
             "the rollout ranks to take weights " + std::to_string(n));
  }
  SyncTiming timing;
  broadcast_in_buckets(*run_.placement->publish, rollout_tensors(rollout_model(run_.model, run_.rollout)),
                       run_.counters.step, bucket_bytes(run_.config), run_.device, timing);
  sync_s_ = timing.seconds;
  sync_bytes_ = timing.bytes;
  release_rollout_model(run_.rollout);  // LoRA: the merged copy, sent, leaves before the update
}

RolloutBatch RemoteRollouts::next() {
  const Config& cfg = run_.config;
  const int64_t P = cfg.train.prompts_per_step, G = cfg.sampling.samples_per_prompt;
  double first_s = 0, first_bytes = 0;
  if (async_ && !published_) {  // a fresh one_step run: the first two batches both sample these weights
    publish();
    first_s = sync_s_;
    first_bytes = sync_bytes_;
  }
  published_ = true;
  publish();
  sync_s_ += first_s;
  sync_bytes_ += first_bytes;

  // Every rank's records; the training ranks send none. The rollout ranks say when theirs are ready.
  const auto t0 = Clock::now();
  const Placement& pl = *run_.placement;
  if (pl.handover) {
    pl.handover->await("batch" + std::to_string(run_.counters.step + 1), pl.sampling_ranks(),
                       "the batch of step " + std::to_string(run_.counters.step + 1));
  }
  const std::vector<uint8_t> all = exchange_bytes(*pl.all, {});
  wait_s_ = seconds_since(t0);
  transfer_bytes_ = static_cast<double>(all.size());
  RolloutBatch out;
  std::vector<GroupRecord> groups(P);
  ByteReader rd(all.data(), all.size());
  bool header = false;
  int64_t consumed_after = 0;  // the prompt stream's position after the rollout ranks' draws
  while (!rd.done()) {
    if (rd.get<uint8_t>()) {  // the first rollout rank's: the rollout's figures, over every rollout rank
      header = true;
      out.seconds = rd.get<double>();
      out.stats = rd.get<RolloutStats>();
      rollout_wall_s_ = rd.get<double>();
      wait_update_s_ = rd.get<double>();
      rounds_ = rd.get<SamplingRounds>();
      consumed_after = rd.get<int64_t>();
    }
    const RewardTally tally = read_tally(rd);
    if (run_.dist->lead()) {  // reward_metrics sums the training ranks' tallies
      const double slowest = std::max(out.rewards.seconds, tally.seconds);  // the rollout ranks score at once
      out.rewards.add(tally);
      out.rewards.seconds = slowest;
    }
    for (int64_t n = rd.get<int64_t>(); n > 0; --n) {
      GroupRecord g = read_group(rd, G);
      TORCH_CHECK(g.slot >= 0 && g.slot < P && groups[g.slot].trajs.empty(), "train.rollout_ranks: a group for slot ",
                  g.slot, " of the step's ", P, " prompts, or twice");
      groups[g.slot] = std::move(g);
    }
  }
  TORCH_CHECK(header, "train.rollout_ranks: the rollout ranks sent no figures");
  // The training ranks draw the same prompts (with dynamic sampling, as many rounds as the rollout ranks
  // drew): the stream's position is theirs to checkpoint.
  std::vector<PromptExample> drawn;
  if (cfg.train.dynamic_sampling) {
    run_.data.prompts->seek(consumed_after);
  } else {
    drawn = run_.data.prompts->next(P);
    TORCH_CHECK(run_.data.prompts->consumed() == consumed_after,
                "train.rollout_ranks: the rollout ranks' prompt stream is at ", consumed_after,
                ", the training ranks' at ", run_.data.prompts->consumed());
  }
  std::vector<Trajectory> every;
  std::vector<int64_t> places;
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(static_cast<int64_t>(groups[p].trajs.size()) == G, "train.rollout_ranks: prompt ", p, " has ",
                groups[p].trajs.size(), " trajectories, not ", G);
    TORCH_CHECK(drawn.empty() || groups[p].example.prompt == drawn[p].prompt,
                "train.rollout_ranks: the rollout ranks sampled prompt ", p,
                " from another place in the prompt stream than the training ranks drew");
    for (int64_t g = 0; g < G; ++g) {
      every.push_back(groups[p].trajs[g]);
      places.push_back(p * G + g);
    }
  }
  const auto single = single_process();
  out.table = gather_table(*single, every, places, P * G);  // every training rank holds every row
  const int world = run_.dist->world();
  std::vector<int64_t> mine(P);
  std::iota(mine.begin(), mine.end(), 0);
  if (world > 1) {
    const int rank = fault_ == PlacementFault::kOneShare ? 0 : run_.dist->rank();
    mine = rank_prompts(P, step_shape(cfg).mini / G, world, rank);
  }
  for (int64_t p : mine) {
    out.examples.push_back(std::move(groups[p].example));
    for (int64_t g = 0; g < G; ++g) {
      out.trajs.push_back(std::move(groups[p].trajs[g]));
      out.trajs.back().prompt_index = static_cast<int64_t>(out.examples.size()) - 1;  // its example here
      out.index.push_back(p * G + g);
    }
  }
  return out;
}

std::map<std::string, double> RemoteRollouts::metrics(const RolloutBatch& batch) const {
  const Staleness st = batch_staleness(run_, *run_.dist, batch);
  return {{"staleness_mean", st.mean},
          {"staleness_max", st.max},
          {"time_weight_sync_s", sync_s_},
          {"weight_sync_gbps", sync_s_ > 0 ? sync_bytes_ / sync_s_ / 1e9 : 0.0},
          {"wait_rollout_s", wait_s_},
          {"transfer_mb", transfer_bytes_ / (1 << 20)},
          {"time_rollout_wall_s", rollout_wall_s_},
          {"wait_update_s", wait_update_s_}};
}

void RemoteRollouts::save(const std::string& dir, nlohmann::json& state) {
  if (!async_) return;  // no rollout is pending: the next one samples the weights as they are
  // The first rollout rank staged the weights of the pending rollout before it sent this step's batch.
  const std::string staged = staged_rollout_weights(run_);
  if (!fs::exists(fs::path(staged) / "config.json")) {
    throw RunError(staged + ": missing; the first rollout rank stages the weights of the pending rollout there");
  }
  fs::rename(staged, fs::path(dir) / kRolloutWeightsDir);
  const int64_t begin = run_.data.prompts->consumed();
  state["async"] = {{"version", run_.counters.step - 1}, {"prompts_begin", begin}, {"partial", false}};
  // As a colocated run's: while a rollout is pending (steps remain), the stream's position is after its draw
  // (with dynamic sampling its rounds are not known yet: the position where it begins).
  if (run_.counters.step < run_.last_step() && !run_.config.train.dynamic_sampling) {
    state["prompts_consumed"] = begin + run_.config.train.prompts_per_step;
  }
}

// ---- The rollout ranks ----

void serve_rollouts(Run& run, PlacementFault fault, const std::function<void()>& before_sample) {
  TORCH_CHECK(run.placement && run.placement->rollout, "serve_rollouts: a rollout rank of train.rollout_ranks");
  const Config& cfg = run.config;
  const Placement& pl = *run.placement;
  const bool async = cfg.train.async == AsyncMode::kOneStep;
  // What it decodes: the policy's weights, or with LoRA a merged copy, overwritten by every publish.
  at::NoGradGuard no_grad;
  const Transformer& target = rollout_model(run.model, run.rollout);
  const std::vector<at::Tensor> tensors = rollout_tensors(target);
  std::vector<at::Tensor> scratch;  // kStaleWeights: where the weights after the first go instead
  int64_t version = -1, received = 0;
  double wait_s = 0;
  auto receive = [&] {
    const auto t0 = Clock::now();
    const int64_t n = received++;
    if (pl.handover) {
      pl.handover->announce("ready" + std::to_string(n));
      pl.handover->await("publish" + std::to_string(n), {0}, "weights " + std::to_string(n));
    }
    SyncTiming timing;
    const bool ignore = fault == PlacementFault::kStaleWeights && version >= 0;
    if (ignore && scratch.empty()) {
      for (const auto& t : tensors) scratch.push_back(at::empty_like(t));
    }
    version = broadcast_in_buckets(*pl.publish, ignore ? scratch : tensors, -1, bucket_bytes(cfg), run.device, timing);
    wait_s = seconds_since(t0) - timing.seconds;
  };
  const std::optional<PendingRollout> pending = pending_state(run);
  if (pending && async) {  // the checkpoint's pending rollout: its prompts and its weights, from the checkpoint
    run.data.prompts->seek(pending->prompts_begin);
    const Transformer saved = Transformer::load(pending->weights, tensors.front().scalar_type(), run.device);
    const std::vector<at::Tensor> from = rollout_tensors(saved);
    TORCH_CHECK(from.size() == tensors.size(), run.resumed_from, "/rollout_weights: ", from.size(),
                " tensors, the rollout decodes ", tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) tensors[i].copy_(from[i]);
    version = pending->version;
  } else if (async && run.counters.step < run.last_step()) {
    receive();  // the weights the first two batches sample
  }
  // Dynamic sampling's rounds over the rollout ranks, which split each round's prompts contiguously.
  DynamicSampling sampling(cfg, cfg.train.prompts_per_step);
  const int64_t first_step = run.counters.step + 1;
  for (int64_t t = first_step; t <= run.last_step(); ++t) {
    if (!async) receive();
    const auto t0 = Clock::now();
    RolloutSource source;
    source.model = &target;
    source.engine = &run.rollout.engine;
    source.dist = run.dist.get();
    source.step = t - 1;
    source.version = version;
    RolloutBatch b;
    if (before_sample) before_sample();
    {
      const RolloutSourceScope scope(source);
      b = sampling.collect(run);  // train.dynamic_sampling: its rounds; else one collect_rollouts
    }
    const SamplingRounds rounds = sampling.last();
    sampling.metrics();  // reported by the training ranks, which receive them
    const double wall_s = seconds_since(t0);
    if (async) {
      receive();                                           // w(t - 1): the next batch samples it
      if (run.checkpoint_due_at(t) && run.dist->lead()) {  // what step t's checkpoint resumes the rollout from
        const std::string staged = staged_rollout_weights(run);
        remove_tree(staged + ".tmp");
        target.save(staged + ".tmp");
        remove_tree(staged);
        fs::rename(staged + ".tmp", staged);
      }
    }
    ByteWriter w;
    w.put<uint8_t>(run.dist->lead());
    if (run.dist->lead()) {
      w.put<double>(b.seconds);
      w.put(b.stats);
      w.put<double>(wall_s);
      w.put<double>(wait_s);
      w.put(rounds);
      w.put<int64_t>(run.data.prompts->consumed());
    }
    write_tally(w, b.rewards);
    const int64_t G = cfg.sampling.samples_per_prompt;
    w.put<int64_t>(static_cast<int64_t>(b.examples.size()));
    for (size_t i = 0; i < b.examples.size(); ++i) {
      write_group(w, b.index[i * G] / G, b.examples[i], &b.trajs[i * G], G);
    }
    if (fault == PlacementFault::kSilent && t == first_step && pl.handover) {
      pl.handover->fall_silent();
      std::this_thread::sleep_for(3 * std::chrono::milliseconds(static_cast<int64_t>(1000 * cfg.train.dist_timeout_s)));
    }
    if (pl.handover) pl.handover->announce("batch" + std::to_string(t));
    exchange_bytes(*pl.all, w.bytes);
    run.counters.step = t;
  }
}

}  // namespace rlt
