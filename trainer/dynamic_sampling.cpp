// DAPO's dynamic sampling: rounds, the equal-reward filter, the slots, and the trajectories sent between
// ranks; see dynamic_sampling.h.
#include "trainer/dynamic_sampling.h"

#include <algorithm>
#include <cstring>
#include <iostream>
#include <numeric>
#include <type_traits>

#include "trainer/optim.h"

namespace rlt {

namespace {

// ---- A group's example and trajectories as bytes, for the rank that trains its slot ----

class Writer {
 public:
  template <class T>
  void put(T v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    bytes.insert(bytes.end(), p, p + sizeof(T));
  }
  template <class T>
  void put_vec(const std::vector<T>& v) {
    put<int64_t>(static_cast<int64_t>(v.size()));
    const auto* p = reinterpret_cast<const uint8_t*>(v.data());
    bytes.insert(bytes.end(), p, p + v.size() * sizeof(T));
  }
  void put_str(const std::string& s) { put_vec(std::vector<char>(s.begin(), s.end())); }
  std::vector<uint8_t> bytes;
};

class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : p_(data), end_(data + size) {}
  bool done() const { return p_ == end_; }
  template <class T>
  T get() {
    T v;
    take(&v, sizeof(T));
    return v;
  }
  template <class T>
  std::vector<T> get_vec() {
    const auto n = get<int64_t>();
    TORCH_CHECK(n >= 0, "dynamic sampling: a corrupt group record");
    std::vector<T> v(static_cast<size_t>(n));
    take(v.data(), v.size() * sizeof(T));
    return v;
  }
  std::string get_str() {
    const std::vector<char> c = get_vec<char>();
    return std::string(c.begin(), c.end());
  }

 private:
  void take(void* out, size_t n) {
    TORCH_CHECK(static_cast<size_t>(end_ - p_) >= n, "dynamic sampling: a group record runs past its buffer");
    if (n) std::memcpy(out, p_, n);
    p_ += n;
  }
  const uint8_t* p_;
  const uint8_t* end_;
};

// Every field of the example and of each trajectory (rollout/retool.h's Trajectory).
void write_group(Writer& w, int64_t slot, const PromptExample& ex, const Trajectory* trajs, int64_t G) {
  w.put<int64_t>(slot);
  w.put_str(ex.prompt);
  w.put_str(ex.answer);
  w.put_str(ex.source);
  w.put<int64_t>(static_cast<int64_t>(ex.messages.size()));
  for (const ChatMessage& m : ex.messages) {
    w.put_str(m.role);
    w.put_str(m.content);
  }
  for (int64_t g = 0; g < G; ++g) {
    const Trajectory& t = trajs[g];
    w.put<int64_t>(t.prompt_index);
    w.put<int64_t>(t.sample_index);
    w.put_vec(t.prompt_ids);
    w.put_vec(t.response_ids);
    w.put_vec(t.loss_mask);
    w.put_vec(t.logprobs);
    w.put<int64_t>(static_cast<int64_t>(t.finish));
    w.put<uint8_t>(t.truncated);
    w.put<int64_t>(t.turns);
    w.put<int64_t>(t.tool_calls);
    w.put<int64_t>(t.feedback_turns);
    w.put<int64_t>(t.tool_timeouts);
    w.put_str(t.response_text);
    w.put<double>(t.reward);
    w.put<uint8_t>(t.correct);
    w.put<double>(t.overlong_penalty);
    w.put<int64_t>(t.weights_version);
    w.put_vec(t.versions);
  }
}

struct GroupData {
  PromptExample example;
  std::vector<Trajectory> trajs;  // (G)
};

GroupData read_group(Reader& r, int64_t G, int64_t& slot) {
  GroupData d;
  slot = r.get<int64_t>();
  d.example.prompt = r.get_str();
  d.example.answer = r.get_str();
  d.example.source = r.get_str();
  const auto n_messages = r.get<int64_t>();
  for (int64_t i = 0; i < n_messages; ++i) {
    ChatMessage m;
    m.role = r.get_str();
    m.content = r.get_str();
    d.example.messages.push_back(std::move(m));
  }
  for (int64_t g = 0; g < G; ++g) {
    Trajectory t;
    t.prompt_index = r.get<int64_t>();
    t.sample_index = r.get<int64_t>();
    t.prompt_ids = r.get_vec<int64_t>();
    t.response_ids = r.get_vec<int64_t>();
    t.loss_mask = r.get_vec<uint8_t>();
    t.logprobs = r.get_vec<float>();
    t.finish = static_cast<FinishReason>(r.get<int64_t>());
    t.truncated = r.get<uint8_t>() != 0;
    t.turns = r.get<int64_t>();
    t.tool_calls = r.get<int64_t>();
    t.feedback_turns = r.get<int64_t>();
    t.tool_timeouts = r.get<int64_t>();
    t.response_text = r.get_str();
    t.reward = r.get<double>();
    t.correct = r.get<uint8_t>() != 0;
    t.overlong_penalty = r.get<double>();
    t.weights_version = r.get<int64_t>();
    t.versions = r.get_vec<int64_t>();
    d.trajs.push_back(std::move(t));
  }
  return d;
}

// Every rank's `mine` bytes, concatenated in rank order, on every rank: the sizes, then the bytes, each
// all_reduce a sum in which every other rank adds zeros. Every rank makes the same calls.
std::vector<uint8_t> exchange_bytes(Collectives& dist, const std::vector<uint8_t>& mine) {
  const int world = dist.world(), rank = dist.rank();
  at::Tensor sizes = at::zeros({world}, at::kDouble);
  sizes[rank] = static_cast<double>(mine.size());
  dist.all_reduce({sizes}, ReduceOp::kSum);
  const auto s = sizes.accessor<double, 1>();
  int64_t total = 0, offset = 0;
  for (int r = 0; r < world; ++r) {
    if (r < rank) offset += static_cast<int64_t>(s[r]);
    total += static_cast<int64_t>(s[r]);
  }
  if (total == 0) return {};
  at::Tensor buf = at::zeros({total}, at::kByte);
  if (!mine.empty()) std::memcpy(buf.data_ptr<uint8_t>() + offset, mine.data(), mine.size());
  dist.all_reduce({buf}, ReduceOp::kSum);
  const uint8_t* b = buf.data_ptr<uint8_t>();
  return std::vector<uint8_t>(b, b + total);
}

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

DynamicSampling::DynamicSampling(const Config& config)
    : enabled_(config.train.dynamic_sampling),
      P_(config.train.prompts_per_step),
      G_(config.sampling.samples_per_prompt),
      max_rounds_(config.train.max_sampling_rounds),
      prompts_per_mini_(step_shape(config).mini / config.sampling.samples_per_prompt) {}

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
  std::map<int64_t, GroupData> received;  // slot -> the group
  if (world > 1) {
    Writer w;
    for (int64_t q = 0; q < P; ++q) {
      const Group& gr = slot[q];
      if (owner[gr.p] != rank || owner[q] == rank) continue;
      const int64_t i = local[gr.round][gr.p];
      TORCH_CHECK(i >= 0, "dynamic sampling: prompt ", gr.p, " of round ", gr.round, " is not on rank ", rank);
      write_group(w, q, rounds[gr.round].examples[i], &rounds[gr.round].trajs[i * G], G);
    }
    const std::vector<uint8_t> all = exchange_bytes(dist, w.bytes);
    Reader rd(all.data(), all.size());
    while (!rd.done()) {
      int64_t q = -1;
      GroupData d = read_group(rd, G, q);
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
