// DAPO's dynamic sampling: rounds, the equal-reward filter, the slots, and the trajectories sent between
// ranks; see dynamic_sampling.h.
#include "trainer/dynamic_sampling.h"

#include <algorithm>
#include <iostream>
#include <numeric>

#include "parallel/transfer.h"
#include "trainer/optim.h"

namespace rlt {

namespace {

void add_stats(RolloutStats& into, const RolloutStats& s) {
  into.decode_steps += s.decode_steps;
  into.fed_rows += s.fed_rows;
  into.feed_steps += s.feed_steps;
  into.feed_tokens += s.feed_tokens;
  into.forced_tokens += s.forced_tokens;
  into.refills += s.refills;
  into.prefill_s += s.prefill_s;
  into.decode_s += s.decode_s;
  into.feed_s += s.feed_s;
  into.sample_s += s.sample_s;
  into.turn_s += s.turn_s;
  into.tool_wait_s += s.tool_wait_s;
  into.tool_latency_s += s.tool_latency_s;
  into.tool_run_s += s.tool_run_s;
  into.tool_wait_row_steps += s.tool_wait_row_steps;
  into.feed_wait_row_steps += s.feed_wait_row_steps;
  into.total_s += s.total_s;
  into.resumed += s.resumed;
  into.cut += s.cut;
  into.verify_passes += s.verify_passes;
  into.verify_rows += s.verify_rows;
  into.drafted_tokens += s.drafted_tokens;
  into.accepted_tokens += s.accepted_tokens;
  into.verify_sampled += s.verify_sampled;
  into.verify_sampling_rows += s.verify_sampling_rows;
  into.tail_passes += s.tail_passes;
  into.tail_sampled += s.tail_sampled;
  into.tail_s += s.tail_s;
}

}  // namespace

std::vector<bool> varied_groups(const at::Tensor& table, int64_t G) {
  TORCH_CHECK(table.dim() == 2 && table.size(1) == kTableColumns && table.scalar_type() == at::kDouble,
              "varied_groups: the table must be (P * G, kTableColumns) float64");
  TORCH_CHECK(G >= 1 && table.size(0) % G == 0, "varied_groups: ", table.size(0), " rows are not groups of ", G);
  const at::Tensor rewards = table.select(1, kReward).contiguous().view({-1, G});                       // (P, G)
  const at::Tensor spread = std::get<0>(rewards.max(/*dim=*/1)) - std::get<0>(rewards.min(/*dim=*/1));  // (P)
  const auto s = spread.accessor<double, 1>();
  std::vector<bool> out(static_cast<size_t>(spread.size(0)));
  for (int64_t p = 0; p < spread.size(0); ++p) out[p] = s[p] > kEqualRewardTol;
  return out;
}

DynamicSampling::DynamicSampling(const Config& config, int64_t prompts_per_mini)
    : enabled_(config.train.dynamic_sampling),
      P_(config.train.prompts_per_step),
      G_(config.sampling.samples_per_prompt),
      max_rounds_(config.train.max_sampling_rounds),
      prompts_per_mini_(prompts_per_mini > 0 ? prompts_per_mini
                                             : step_shape(config).mini / config.sampling.samples_per_prompt) {}

void DynamicSampling::record(const SamplingRounds& rounds) {
  std::lock_guard<std::mutex> lock(mutex_);
  last_ = rounds;
  unreported_.push_back(rounds);
}

RolloutBatch DynamicSampling::collect(Run& run) {
  if (!enabled_) return collect_rollouts(run);
  return collect([&run] { return collect_rollouts(run); }, rollout_collectives(run));  // train.async: its fork
}

RolloutBatch DynamicSampling::collect(const std::function<RolloutBatch()>& next_round, Collectives& dist,
                                      const GroupFilter& filter) {
  const int64_t P = P_, G = G_;
  const int world = dist.world(), rank = dist.rank();
  // owner[p]: the rank that samples prompt p of every round, and trains slot p of the step (rank_prompts).
  std::vector<int> owner(P, 0);
  std::vector<int64_t> mine(P);
  std::iota(mine.begin(), mine.end(), 0);
  if (world > 1) {
    for (int r = 0; r < world; ++r) {
      for (int64_t p : rank_prompts(P, prompts_per_mini_, world, r)) owner[p] = r;
    }
    mine = rank_prompts(P, prompts_per_mini_, world, rank);
  }

  // The rounds: (round, prompt) of every varied and every equal-reward group, in draw order.
  struct Group {
    int64_t round, p;
  };
  std::vector<RolloutBatch> rounds;
  std::vector<Group> varied, equal;
  double correct = 0;
  do {
    rounds.push_back(next_round());
    const RolloutBatch& b = rounds.back();
    TORCH_CHECK(b.table.dim() == 2 && b.table.size(0) == P * G, "dynamic sampling: a round of ", b.table.size(0),
                " table rows, expected P * G = ", P * G);
    TORCH_CHECK(b.trajs.size() == b.index.size() && b.trajs.size() == b.examples.size() * G,
                "dynamic sampling: a round's examples, trajectories and places disagree");
    const std::vector<bool> keep = filter(b.table, G);
    TORCH_CHECK(static_cast<int64_t>(keep.size()) == P, "dynamic sampling: the filter decided ", keep.size(),
                " groups of ", P);
    const int64_t r = static_cast<int64_t>(rounds.size()) - 1;
    for (int64_t p = 0; p < P; ++p) (keep[p] ? varied : equal).push_back({r, p});
    correct += b.table.select(1, kCorrect).sum().item<double>();
  } while (static_cast<int64_t>(varied.size()) < P && static_cast<int64_t>(rounds.size()) < max_rounds_);

  SamplingRounds s;
  s.rounds = static_cast<int64_t>(rounds.size());
  s.prompts_sampled = s.rounds * P;
  s.groups_kept = std::min<int64_t>(P, static_cast<int64_t>(varied.size()));
  s.groups_surplus = static_cast<int64_t>(varied.size()) - s.groups_kept;
  s.groups_filtered = static_cast<int64_t>(equal.size());
  s.sampled_accuracy = correct / static_cast<double>(s.prompts_sampled * G);
  const int64_t K = s.groups_kept;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    last_ = s;
    unreported_.push_back(s);
    if (K < P && !warned_ && dist.lead()) {
      std::cerr << "warning: dynamic sampling kept " << K << " of " << P
                << " groups with varied rewards in train.max_sampling_rounds = " << max_rounds_ << " rounds ("
                << s.prompts_sampled << " prompts); the step trains on those" << (K == 0 ? " (none: no update)" : "")
                << ". Warned once per run; the metrics groups_kept and sampling_rounds show every step\n";
    }
    if (K < P) warned_ = true;
  }

  // The slots: kept groups, spread when fewer than P, and equal-reward groups (masked) in the rest.
  std::vector<Group> slot(P, Group{-1, -1});
  std::vector<bool> filler(P, false);
  for (int64_t i = 0; i < K; ++i) slot[i * P / K] = varied[i];
  for (int64_t q = 0, e = 0; q < P; ++q) {
    if (slot[q].round >= 0) continue;
    slot[q] = equal[e++];  // K < P: at least P - K rounds' groups were equal (rounds * P = varied + equal)
    filler[q] = true;
  }

  // Where each round's local groups are: (round, prompt) -> position in that round's examples.
  std::vector<std::vector<int64_t>> local(rounds.size(), std::vector<int64_t>(P, -1));
  for (size_t r = 0; r < rounds.size(); ++r) {
    for (size_t i = 0; i < rounds[r].examples.size(); ++i) local[r][rounds[r].index[i * G] / G] = i;
  }

  // Groups that train on another rank than the one that sampled them: sent.
  std::map<int64_t, GroupRecord> received;  // slot -> the group
  if (world > 1) {
    ByteWriter w;
    for (int64_t q = 0; q < P; ++q) {
      const Group& gr = slot[q];
      if (owner[gr.p] != rank || owner[q] == rank) continue;
      const int64_t i = local[gr.round][gr.p];
      TORCH_CHECK(i >= 0, "dynamic sampling: prompt ", gr.p, " of round ", gr.round, " is not on rank ", rank);
      write_group(w, q, rounds[gr.round].examples[i], &rounds[gr.round].trajs[i * G], G);
    }
    const std::vector<uint8_t> all = exchange_bytes(dist, w.bytes);
    ByteReader rd(all.data(), all.size());
    while (!rd.done()) {
      GroupRecord d = read_group(rd, G);
      const int64_t q = d.slot;
      TORCH_CHECK(q >= 0 && q < P, "dynamic sampling: a group record for slot ", q);
      if (owner[q] == rank) received[q] = std::move(d);
    }
  }

  RolloutBatch out;
  at::Tensor rows = at::empty({P * G}, at::kLong);  // the step's table row -> its row in the rounds' tables
  at::Tensor tables = at::cat([&] {
    std::vector<at::Tensor> t;
    for (const auto& b : rounds) t.push_back(b.table);
    return t;
  }());  // (rounds * P * G, kTableColumns)
  auto rows_a = rows.accessor<int64_t, 1>();
  for (int64_t q = 0; q < P; ++q) {
    for (int64_t g = 0; g < G; ++g) rows_a[q * G + g] = (slot[q].round * P + slot[q].p) * G + g;
  }
  out.table = tables.index_select(0, rows);
  for (int64_t q : mine) {
    const Group& gr = slot[q];
    const int64_t j = static_cast<int64_t>(out.examples.size());  // the local slot
    if (owner[gr.p] == rank) {
      const int64_t i = local[gr.round][gr.p];
      TORCH_CHECK(i >= 0, "dynamic sampling: prompt ", gr.p, " of round ", gr.round, " is not on rank ", rank);
      RolloutBatch& b = rounds[gr.round];
      out.examples.push_back(std::move(b.examples[i]));
      for (int64_t g = 0; g < G; ++g) out.trajs.push_back(std::move(b.trajs[i * G + g]));
    } else {
      auto it = received.find(q);
      TORCH_CHECK(it != received.end(), "dynamic sampling: slot ", q, " was not sent to rank ", rank);
      out.examples.push_back(std::move(it->second.example));
      for (Trajectory& t : it->second.trajs) out.trajs.push_back(std::move(t));
    }
    for (int64_t g = 0; g < G; ++g) {
      Trajectory& t = out.trajs[j * G + g];
      t.prompt_index = j;
      // An empty slot's group adds nothing to the loss and no token to a denominator.
      if (filler[q]) std::fill(t.loss_mask.begin(), t.loss_mask.end(), uint8_t{0});
      out.index.push_back(q * G + g);
    }
  }
  for (const auto& b : rounds) {
    out.seconds += b.seconds;
    add_stats(out.stats, b.stats);
    out.rewards.add(b.rewards);  // every round's scoring, dropped groups included
  }
  return out;
}

int64_t DynamicSampling::iterations(int64_t num_iterations) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return !unreported_.empty() && unreported_.front().groups_kept == 0 ? 0 : num_iterations;
}

std::map<std::string, double> DynamicSampling::metrics() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!enabled_ || unreported_.empty()) return {};
  const SamplingRounds s = unreported_.front();
  unreported_.pop_front();
  return {{"groups_filtered", double(s.groups_filtered)},    {"groups_kept", double(s.groups_kept)},
          {"groups_surplus", double(s.groups_surplus)},      {"sampling_rounds", double(s.rounds)},
          {"prompts_sampled", double(s.prompts_sampled)},    {"sampled_accuracy", s.sampled_accuracy},
          {"update_skipped", s.groups_kept == 0 ? 1.0 : 0.0}};
}

SamplingRounds DynamicSampling::last() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return last_;
}

}  // namespace rlt
