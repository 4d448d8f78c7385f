// AdamW, the schedule and gradient accumulation; see optim.h.
#include "trainer/optim.h"

#include "common/memory.h"
#include "parallel/parking.h"
#include "parallel/shard.h"
#include "parallel/transfer.h"
#include "trainer/batch.h"
#include "trainer/critic.h"
#include "trainer/metrics.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <iostream>
#include <map>

namespace rlt {

std::shared_ptr<ShardedState> make_sharded_state(Run& run, ShardFault fault) {
  const ShardOptions o{run.config.train.shard, run.config.train.offload, run.config.rollout.keep_weights, run.lead(),
                       offload_mode(run.config.train.offload_step, run.device.is_cuda(), 1)};
  const std::vector<std::pair<std::string, at::Tensor>> extra(run.model.extra.begin(), run.model.extra.end());
  return std::make_shared<ShardedState>(o, *run.dist, *run.model.policy, extra, run.counters, fault);
}

void make_replicated_optimizer(ModelState& model, const TrainOptions& t, double lr, double extra_lr) {
  auto o = torch::optim::AdamWOptions(lr).betas({t.beta1, t.beta2}).eps(t.adam_eps).weight_decay(t.weight_decay);
  std::vector<at::Tensor> params = model.policy->trainable_parameters();
  model.master.clear();
  if (t.master_weights == MasterWeights::kFp32 && !params.empty() && params.front().scalar_type() == at::kBFloat16) {
    for (const auto& p : params) model.master.push_back(p.detach().to(at::kFloat).clone());  // exact: bf16 < fp32
    params = model.master;
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(params, std::make_unique<torch::optim::AdamWOptions>(o));
  if (!model.extra.empty()) {
    std::vector<at::Tensor> extra_params;
    for (const auto& [name, p] : model.extra) extra_params.push_back(p);
    auto eo = o;
    eo.lr(extra_lr).weight_decay(0.0);  // a head started at zero: no decay towards it
    groups.emplace_back(extra_params, std::make_unique<torch::optim::AdamWOptions>(eo));
  }
  model.optimizer = std::make_unique<torch::optim::AdamW>(std::move(groups), o);
}

void make_optimizer(Run& run, const ExtraParams& extra) {
  const TrainOptions& t = run.config.train;
  const double extra_lr = extra.lr && extra.lr(run.config) > 0 ? extra.lr(run.config) : t.lr;
  if (!run.model.extra.empty()) run.model.extra_lr_scale = t.lr > 0 ? extra_lr / t.lr : 1.0;
  if (t.shard != ShardStage::kNone || t.offload != Offload::kNone) {
    run.model.master.clear();
    run.model.optimizer.reset();
    run.model.sharded = make_sharded_state(run);
    return;
  }
  make_replicated_optimizer(run.model, t, t.lr, extra_lr);
}

PhaseTensors phase_offload_tensors(const ModelState& model, PhaseOffload mode) {
  if (model.sharded) return model.sharded->phase_tensors(mode == PhaseOffload::kTrainingState);
  PhaseTensors out{model.master, {}};
  if (!model.optimizer) return out;
  for (const at::Tensor& p : optimizer_params(model)) {
    auto it = model.optimizer->state().find(p.unsafeGetTensorImpl());
    if (it == model.optimizer->state().end()) continue;  // not stepped yet: no moments
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*it->second);
    out.moved.push_back(s.exp_avg());
    out.moved.push_back(s.exp_avg_sq());
  }
  return out;
}

std::vector<at::Tensor> phase_offload_layout(const ModelState& model, PhaseOffload mode, bool whole) {
  if (model.sharded) {
    PhaseTensors t = model.sharded->phase_tensors(mode == PhaseOffload::kTrainingState, whole);
    t.moved.insert(t.moved.end(), t.chunks.begin(), t.chunks.end());  // parked second, after the gather
    return t.moved;
  }
  std::vector<at::Tensor> out = model.master;
  if (!model.optimizer) return out;
  for (const at::Tensor& p : optimizer_params(model)) {  // AdamW's moments: the shape and dtype of what it steps
    out.push_back(p);
    out.push_back(p);
  }
  return out;
}

namespace {

// Waits for the device's queued work (the moves' copies) so that their time is measured whole.
void synchronize_for(const Run& run) {
  if (run.device.is_cuda()) stream_synchronize(run.device);
}

// The models whose training state a phase moves: the policy's, and a separate critic's.
std::vector<ModelState*> parked_models(Run& run) {
  std::vector<ModelState*> out{&run.model};
  if (run.model.critic) out.push_back(&run.model.critic->state);
  return out;
}

}  // namespace

void reserve_phase_offload(Run& run) {
  const PhaseOffload mode = run.config.train.phase_offload;
  if (mode == PhaseOffload::kNone || run.rollout_rank) return;
  for (ModelState* m : parked_models(run)) {
    if (!m->parking) m->parking = std::make_shared<PhaseParking>();
    if (m->parking->reserved() || m->parking->parked()) continue;  // PPO's second call: the critic only
    // The policy's weights are whole while parked (ParkedTrainingState gathers them), a critic's are not.
    m->parking->reserve(phase_offload_layout(*m, mode, /*whole=*/m == &run.model));
  }
}

ParkedTrainingState::ParkedTrainingState(Run& run) {
  const PhaseOffload mode = run.config.train.phase_offload;
  if (mode == PhaseOffload::kNone || run.rollout_rank) return;
  if (run.model.parking && run.model.parking->parked()) return;  // an outer scope holds it
  double moves_s = 0;
  auto timed = [&](const auto& move) {
    const auto t0 = std::chrono::steady_clock::now();
    move();
    synchronize_for(run);
    moves_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  try {
    // The optimizer state first, then the rollout's gather (a no-op unless shard parameters; not a move),
    // which reads the weight chunks, then those: the gathered weights never sit beside the whole state.
    timed([&] {
      for (ModelState* m : parked_models(run)) {
        if (!m->parking) m->parking = std::make_shared<PhaseParking>();
        const PhaseTensors t = phase_offload_tensors(*m, mode);
        m->parking->park(t.moved, t.zeroed);
      }
    });
    if (mode == PhaseOffload::kTrainingState) {
      whole_ = std::make_unique<GatheredWeights>(run.model.sharded);
      timed([&] {
        for (ModelState* m : parked_models(run)) m->parking->park(phase_offload_tensors(*m, mode).chunks);
      });
    }
  } catch (...) {  // what was parked comes back: no scope would bring it back later
    whole_.reset();
    for (ModelState* m : parked_models(run)) {
      if (m->parking && m->parking->parked()) m->parking->unpark();
    }
    throw;
  }
  run.metrics.phase_moves_s += moves_s;
  run_ = &run;
  exceptions_ = std::uncaught_exceptions();
}

ParkedTrainingState::~ParkedTrainingState() noexcept(false) {
  if (!run_) return;
  Run& run = *run_;
  auto bring_back = [&] {
    whole_.reset();  // the gathered weights go first: they never sit beside the whole state either
    const auto t0 = std::chrono::steady_clock::now();
    for (ModelState* m : parked_models(run)) {
      if (m->parking && m->parking->parked()) m->parking->unpark();
    }
    synchronize_for(run);
    run.metrics.phase_moves_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  if (std::uncaught_exceptions() == exceptions_) {
    bring_back();
    return;
  }
  try {  // unwinding: a second exception would end the process before the first one is reported
    bring_back();
  } catch (const std::exception& e) {
    std::cerr << "train.phase_offload: the parked training state did not come back: " << e.what() << "\n";
  }
}

RolloutBatch parked_rollout(Run& run, PhasePeaks& peaks, const std::function<RolloutBatch()>& collect) {
  const bool moves = run.config.train.phase_offload != PhaseOffload::kNone;
  RolloutBatch rb;
  {
    const ParkedTrainingState parked(run);
    if (moves) peaks.end("park");
    rb = collect();
    peaks.end("rollout");
  }
  if (moves) peaks.end("unpark");
  return rb;
}

double learning_rate(const TrainOptions& o, int64_t step, int64_t total) {
  if (step < o.warmup_steps) return o.lr * double(step + 1) / double(o.warmup_steps + 1);
  const double span = std::max<int64_t>(1, total - o.warmup_steps);
  const double progress = std::min(1.0, double(step - o.warmup_steps) / span);  // 0 -> 1 after warm-up
  const double floor = o.lr * o.min_lr_ratio;
  switch (o.lr_schedule) {
    case LrSchedule::kConstant:
      return o.lr;
    case LrSchedule::kLinear:
      return floor + (o.lr - floor) * (1.0 - progress);
    case LrSchedule::kCosine:
      return floor + (o.lr - floor) * 0.5 * (1.0 + std::cos(M_PI * progress));
  }
  return o.lr;
}

void step_multi_tensor(torch::optim::AdamW& opt) {
  for (auto& group : opt.param_groups()) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
    TORCH_CHECK(!o.amsgrad(), "step_multi_tensor: amsgrad is not supported");
    std::map<int64_t, AdamWTensors> by_step;  // the group's parameters by their step count, this step included
    for (const at::Tensor& p : group.params()) {
      if (!p.grad().defined()) continue;
      auto& slot = opt.state()[p.unsafeGetTensorImpl()];
      if (!slot) {  // the state opt.step() makes at a parameter's first step
        auto fresh = std::make_unique<torch::optim::AdamWParamState>();
        fresh->step(0);
        fresh->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
        fresh->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
        slot = std::move(fresh);
      }
      auto& st = static_cast<torch::optim::AdamWParamState&>(*slot);
      st.step(st.step() + 1);
      AdamWTensors& t = by_step[st.step()];
      t.params.push_back(p);
      t.grads.push_back(p.grad().contiguous());  // a copy only where a reduction left it strided
      t.exp_avgs.push_back(st.exp_avg());
      t.exp_avg_sqs.push_back(st.exp_avg_sq());
    }
    for (const auto& [step, t] : by_step)
      adamw_step_tensors(t, {o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(), o.weight_decay(), step});
  }
}

double clip_gradients(const std::vector<at::Tensor>& params, double max_norm) {
  std::vector<at::Tensor> grads;
  for (const at::Tensor& p : params) grads.push_back(p.grad());
  return clip_grad_norm_tensors(grads, max_norm);
}

void set_learning_rate(torch::optim::AdamW& opt, double lr, double extra_lr_scale) {
  auto& groups = opt.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    static_cast<torch::optim::AdamWOptions&>(groups[g].options()).lr(g == 0 ? lr : lr * extra_lr_scale);
  }
}

std::vector<std::pair<int64_t, int64_t>> micro_batch_ranges(int64_t S, int64_t mini, int64_t micro) {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (int64_t mb = 0; mb < S; mb += mini) {
    const int64_t mb_end = std::min(S, mb + mini);
    for (int64_t b = mb; b < mb_end; b += micro) ranges.push_back({b, std::min(mb_end, b + micro)});
  }
  return ranges;
}

std::vector<std::pair<int64_t, int64_t>> micro_batch_ranges(const std::vector<int64_t>& lengths, int64_t mini,
                                                            int64_t micro, int64_t budget, bool packed,
                                                            const std::vector<int64_t>& shared) {
  const int64_t S = static_cast<int64_t>(lengths.size());
  if (budget <= 0) return micro_batch_ranges(S, mini, micro);
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (int64_t mb = 0; mb < S; mb += mini) {
    const int64_t mb_end = std::min(S, mb + mini);
    int64_t begin = mb, longest = 0, sum = 0, keys = 0;
    for (int64_t i = mb; i < mb_end; ++i) {
      const int64_t rows = i - begin + 1, top = std::max(longest, lengths[i]);
      const int64_t reused = rows > 1 && !shared.empty() ? shared[i] : 0;  // its prompt, already in the pack
      const int64_t tokens = packed ? sum + lengths[i] - reused : rows * top;
      // Keys: each sequence's whole length, and a run's prefix sequence's own once (i continues the run
      // that i - 1 opens).
      const bool opens_prefix = reused > 0 && (i - 1 == begin || shared[i - 1] == 0);
      const int64_t more_keys = lengths[i] + (opens_prefix ? reused : 0);
      const bool too_many_keys = !shared.empty() && keys + more_keys > kSharedKeysPerToken * budget;
      if (rows > 1 && (rows > micro || tokens > budget || too_many_keys)) {
        ranges.push_back({begin, i});
        begin = i;
        longest = sum = keys = lengths[i];
      } else {
        longest = top;
        sum = tokens;
        keys += more_keys;
      }
    }
    ranges.push_back({begin, mb_end});
  }
  return ranges;
}

std::vector<std::vector<std::pair<int, int64_t>>> deal_by_tokens(const std::vector<std::vector<int64_t>>& lengths,
                                                                 int64_t mini) {
  const int world = static_cast<int>(lengths.size());
  const int64_t S = world > 0 ? static_cast<int64_t>(lengths[0].size()) : 0;
  for (const auto& l : lengths) TORCH_CHECK(static_cast<int64_t>(l.size()) == S, "deal_by_tokens: unequal ranks");
  std::vector<std::vector<std::pair<int, int64_t>>> out(world);
  for (int64_t mb = 0; mb < S; mb += mini) {
    const int64_t n = std::min(S, mb + mini) - mb;  // each rank's share of this mini-batch
    std::vector<std::pair<int, int64_t>> seqs;
    for (int r = 0; r < world; ++r) {
      for (int64_t i = mb; i < mb + n; ++i) seqs.push_back({r, i});
    }
    std::stable_sort(seqs.begin(), seqs.end(), [&](const auto& x, const auto& y) {
      return lengths[x.first][x.second] > lengths[y.first][y.second];
    });
    std::vector<int64_t> tokens(world, 0), count(world, 0);
    for (const auto& [r, i] : seqs) {
      int best = -1;
      for (int d = 0; d < world; ++d) {
        if (count[d] < n && (best < 0 || tokens[d] < tokens[best])) best = d;
      }
      out[best].push_back({r, i});
      tokens[best] += lengths[r][i];
      ++count[best];
    }
  }
  return out;
}

namespace {

// This rank's trajectories and places after deal_by_tokens over `dist`'s ranks, into `out` and `out_index`:
// lengths, then the trajectories that change rank, exchanged as bytes (parallel/transfer.h).
void balance_over_ranks(const std::vector<Trajectory>& trajs, const std::vector<int64_t>& index, int64_t mini,
                        Collectives& dist, std::vector<Trajectory>& out, std::vector<int64_t>& out_index) {
  const int world = dist.world(), rank = dist.rank();
  const int64_t S = static_cast<int64_t>(trajs.size());
  ByteWriter lw;
  std::vector<int64_t> mine;
  for (const Trajectory& t : trajs) mine.push_back(t.window_end());
  lw.put_vec(mine);
  const std::vector<uint8_t> all_lengths = exchange_bytes(dist, lw.bytes);
  ByteReader lr(all_lengths.data(), all_lengths.size());
  std::vector<std::vector<int64_t>> lengths;
  for (int r = 0; r < world; ++r) lengths.push_back(lr.get_vec<int64_t>());
  const auto deal = deal_by_tokens(lengths, mini);
  // The records of this rank's trajectories that another rank takes: that rank, the place in its deal, and
  // the trajectory under its step-wide place (write_group's slot; no example travels).
  ByteWriter w;
  for (int d = 0; d < world; ++d) {
    if (d == rank) continue;
    for (size_t j = 0; j < deal[d].size(); ++j) {
      const auto [r, i] = deal[d][j];
      if (r != rank) continue;
      w.put<int64_t>(d);
      w.put<int64_t>(static_cast<int64_t>(j));
      write_group(w, index[i], PromptExample{}, &trajs[i], 1);
    }
  }
  const std::vector<uint8_t> all = exchange_bytes(dist, w.bytes);
  std::vector<Trajectory> got(S);
  std::vector<int64_t> places(S, -1);
  std::vector<bool> arrived(S, false);
  ByteReader rd(all.data(), all.size());
  while (!rd.done()) {
    const auto d = rd.get<int64_t>(), j = rd.get<int64_t>();
    GroupRecord g = read_group(rd, 1);
    if (d != rank) continue;
    TORCH_CHECK(j >= 0 && j < S && !arrived[j], "balance_tokens: a trajectory record for place ", j);
    got[j] = std::move(g.trajs[0]);
    places[j] = g.slot;
    arrived[j] = true;
  }
  for (int64_t j = 0; j < S; ++j) {
    const auto [r, i] = deal[rank][j];
    if (r != rank) {
      TORCH_CHECK(arrived[j], "balance_tokens: rank ", r, "'s trajectory ", i, " did not arrive");
      continue;
    }
    got[j] = trajs[i];
    places[j] = index[i];
  }
  out = std::move(got);
  out_index = std::move(places);
}

}  // namespace

namespace {

struct PromptLess {  // prompts by their ids
  bool operator()(const std::vector<int64_t>* a, const std::vector<int64_t>* b) const { return *a < *b; }
};

}  // namespace

UpdateBatch update_batch(const RolloutBatch& rb, int64_t mini, int64_t micro, int64_t budget, bool packed, bool share,
                         Collectives* balance) {
  const int64_t S = static_cast<int64_t>(rb.trajs.size());
  TORCH_CHECK(rb.index.size() == rb.trajs.size(), "update_batch: one place per trajectory");
  UpdateBatch u;
  u.source_ = &rb.trajs;
  u.index = rb.index;
  const bool balanced = balance && balance->world() > 1;
  if (balanced) {
    balance_over_ranks(rb.trajs, rb.index, mini, *balance, u.reordered_, u.index);  // each mini-batch longest first
  }
  share = share && packed;
  u.packed_ = packed;
  u.share_ = share;
  std::vector<int64_t> lengths;  // each trajectory's tokens, prompt and response
  for (const Trajectory& t : u.trajs()) lengths.push_back(t.window_end());
  if ((budget > 0 || (share && balanced)) && S > 0) {
    // Each mini-batch longest first; sharing prompts, its prompts' groups longest (most tokens) first and
    // each group's answers longest first, so that a prompt's answers stay next to each other.
    std::vector<int64_t> order(S), group(S), group_tokens;
    for (int64_t i = 0; i < S; ++i) order[i] = i;
    for (int64_t mb = 0; mb < S; mb += mini) {
      const int64_t mb_end = std::min(S, mb + mini);
      group_tokens.assign(mb_end - mb, 0);
      std::map<const std::vector<int64_t>*, int64_t, PromptLess> first;  // a prompt's first sequence here
      for (int64_t i = mb; i < mb_end; ++i) {  // a sequence's group: the first of the mini-batch with its prompt
        group[i] = share ? first.emplace(&u.trajs()[i].prompt_ids, i - mb).first->second : i - mb;
        group_tokens[group[i]] += lengths[i];
      }
      std::stable_sort(order.begin() + mb, order.begin() + mb_end, [&](int64_t a, int64_t b) {
        if (group[a] != group[b]) {
          return group_tokens[group[a]] != group_tokens[group[b]] ? group_tokens[group[a]] > group_tokens[group[b]]
                                                                  : group[a] < group[b];
        }
        return lengths[a] > lengths[b];
      });
    }
    std::vector<Trajectory> sorted_trajs;
    std::vector<int64_t> sorted(S), index(S);
    sorted_trajs.reserve(S);
    for (int64_t i = 0; i < S; ++i) {  // the balanced trajectories are this batch's own: moved, not copied
      sorted_trajs.push_back(u.reordered_.empty() ? rb.trajs[order[i]] : std::move(u.reordered_[order[i]]));
      index[i] = u.index[order[i]];
      sorted[i] = lengths[order[i]];
    }
    u.reordered_ = std::move(sorted_trajs);
    u.index = std::move(index);
    lengths = std::move(sorted);
  }
  std::vector<int64_t> shared;  // the prompt tokens each sequence takes from the one before it
  if (share) {
    shared.assign(S, 0);
    for (int64_t i = 1; i < S; ++i) shared[i] = shared_prompt_tokens(u.trajs()[i - 1], u.trajs()[i]);
  }
  u.micro_ranges = micro_batch_ranges(lengths, mini, micro, budget, packed, shared);
  return u;
}

std::vector<PackedBatch> UpdateBatch::micro_batches(at::Device device) const {
  std::vector<PackedBatch> batches;
  for (const auto& [b, e] : micro_ranges) batches.push_back(pack(trajs(), b, e, device, packed_, share_));
  return batches;
}

namespace {

// tokens, non-empty sequences, sequences -> the denominator of `agg`, clamped to >= 1.
double denominator(double tokens, double nonempty, double sequences, LossAgg agg) {
  switch (agg) {
    case LossAgg::kTokenMean:
      return std::max(1.0, tokens);
    case LossAgg::kSeqMeanTokenMean:
      return std::max(1.0, nonempty);
    default:
      return std::max(1.0, sequences);
  }
}

// Per mini-batch of `mini` sequences: (tokens, non-empty sequences, sequences), (n_mini, 3) float64.
at::Tensor denominator_counts(const std::vector<Trajectory>& trajs, int64_t begin, int64_t end, int64_t mini) {
  const int64_t n_mini = (end - begin + mini - 1) / mini;
  at::Tensor counts = at::zeros({n_mini, 3}, at::kDouble);
  auto c = counts.accessor<double, 2>();
  for (int64_t s = begin; s < end; ++s) {
    const int64_t n = trajs[s].sampled_tokens(), k = (s - begin) / mini;
    c[k][0] += n;
    c[k][1] += n > 0;
    c[k][2] += 1;
  }
  return counts;
}

}  // namespace

double mini_batch_denominator(const std::vector<Trajectory>& trajs, int64_t begin, int64_t end, LossAgg agg) {
  const at::Tensor c = denominator_counts(trajs, begin, end, std::max<int64_t>(1, end - begin));
  if (c.size(0) == 0) return 1.0;
  return denominator(c[0][0].item<double>(), c[0][1].item<double>(), c[0][2].item<double>(), agg);
}

std::vector<double> mini_batch_denominators(const std::vector<Trajectory>& trajs, int64_t mini, LossAgg agg,
                                            Collectives& dist) {
  at::Tensor counts = denominator_counts(trajs, 0, static_cast<int64_t>(trajs.size()), mini);
  dist.all_reduce({counts}, ReduceOp::kSum);  // the ranks' k-th mini-batches are one
  std::vector<double> out;
  auto c = counts.accessor<double, 2>();
  for (int64_t k = 0; k < counts.size(0); ++k) out.push_back(denominator(c[k][0], c[k][1], c[k][2], agg));
  return out;
}

StepShape step_shape(const Config& c, int world) {
  const TrainOptions& train = c.train;
  StepShape s;
  s.S = train.prompts_per_step * c.sampling.samples_per_prompt;
  s.mini = train.mini_batch_size > 0 ? std::min(train.mini_batch_size, s.S) : s.S;
  s.total_optimizer_steps = train.steps * train.num_iterations * ((s.S + s.mini - 1) / s.mini);
  s.S /= world;  // one rank's share (check_world)
  s.mini /= world;
  s.micro = std::min(train.micro_batch_size, s.mini);
  return s;
}

double update_comm_seconds(const ModelState& model, const GradReducer* reducer) {
  return reducer ? reducer->wait_seconds() : model.sharded ? model.sharded->comm_seconds() : 0.0;
}

void zero_gradients(ModelState& model) {
  if (model.sharded)
    model.sharded->zero_grad();
  else
    model.optimizer->zero_grad();
}

std::vector<at::Tensor> optimizer_params(const ModelState& model) {
  std::vector<at::Tensor> params = model.master.empty() ? model.policy->trainable_parameters() : model.master;
  for (const auto& [name, p] : model.extra) params.push_back(p);
  return params;
}

void accumulate_gradients(ModelState& model) {
  if (model.master.empty()) return;
  const std::vector<at::Tensor> params =
      model.policy->trainable_parameters();  // handles sharing the parameters' storage
  for (size_t i = 0; i < params.size(); ++i) accumulate_gradient(params[i], model.master[i]);
}

std::unique_ptr<GradReducer> make_reducer(const ModelState& model, Collectives& dist, int64_t bucket_bytes) {
  if (dist.world() == 1 || model.sharded) return nullptr;  // the sharded state reduces its own
  std::vector<at::Tensor> params = model.policy->trainable_parameters();
  for (const auto& [name, p] : model.extra) params.push_back(p);
  return std::make_unique<GradReducer>(dist, std::move(params), model.master, bucket_bytes);
}

std::unique_ptr<GradReducer> make_reducer(Run& run) {
  return make_reducer(run.model, *run.dist, run.config.train.dist_bucket_mb << 20);
}

void backward(ModelState& model, const at::Tensor& loss, GradReducer* reducer, bool ends_step) {
  if (model.sharded) return model.sharded->backward(loss, ends_step);
  if (reducer && ends_step) reducer->arm();
  loss.backward();
  if (reducer && ends_step) reducer->finish();
  accumulate_gradients(model);
}

void backward(Run& run, const at::Tensor& loss, GradReducer* reducer, bool ends_step) {
  backward(run.model, loss, reducer, ends_step);
}

void copy_master_weights_to_model(ModelState& model) {
  if (model.master.empty()) return;
  at::NoGradGuard no_grad;
  const std::vector<at::Tensor> params = model.policy->trainable_parameters();
  std::vector<at::Tensor> weights;
  for (const at::Tensor& p : params) weights.push_back(p.detach());
  at::_foreach_copy_(weights, model.master);  // rounded to nearest; one kernel a list on CUDA
}

OffloadMode offload_mode(OffloadStep step, bool cuda, int ranks_on_host) {
  if (step == OffloadStep::kAuto)
    return cuda && ranks_on_host > 1 ? OffloadMode::kStreamDevice : OffloadMode::kHostStep;
  return step == OffloadStep::kDevice ? OffloadMode::kStreamDevice : OffloadMode::kHostStep;
}

int64_t optimizer_memory_bytes(const ModelState& model) {
  if (model.sharded) return model.sharded->device_bytes();
  int64_t bytes = 0;
  for (const auto& m : model.master) bytes += m.nbytes() + (m.grad().defined() ? m.grad().nbytes() : 0);
  for (const auto& group : model.optimizer->param_groups()) {
    for (const auto& p : group.params()) {
      auto it = model.optimizer->state().find(p.unsafeGetTensorImpl());
      if (it == model.optimizer->state().end()) continue;
      const auto& s = static_cast<const torch::optim::AdamWParamState&>(*it->second);
      bytes += s.exp_avg().nbytes() + s.exp_avg_sq().nbytes();
    }
  }
  return bytes;
}

double step_optimizer(Run& run, ModelState& model, StepCounters& counters, const at::Tensor& loss, double lr,
                      const char* what) {
  const TrainOptions& t = run.config.train;
  if (model.sharded) {
    return model.sharded->step(
        loss, {lr, lr * model.extra_lr_scale, t.beta1, t.beta2, t.adam_eps, t.weight_decay, t.grad_clip});
  }
  accumulate_gradients(model);
  const std::vector<at::Tensor> params = optimizer_params(model);
  const double norm = clip_gradients(params, t.grad_clip > 0 ? t.grad_clip : INFINITY);
  at::Tensor total = loss.defined() ? loss.detach().clone() : loss;  // every rank's share: the loss
  if (total.defined()) run.dist->all_reduce({total}, ReduceOp::kSum);
  const bool loss_finite = !total.defined() || total.isfinite().all().item<bool>();
  if (!loss_finite || !std::isfinite(norm)) {
    model.optimizer->zero_grad();  // never applied
    ++counters.skipped_steps;
    if (run.lead()) {
      std::cerr << "warning: step " << run.counters.step + 1 << ": non-finite loss or gradient, " << what
                << " skipped\n";
    }
    return norm;
  }
  set_learning_rate(*model.optimizer, lr, model.extra_lr_scale);
  step_multi_tensor(*model.optimizer);
  copy_master_weights_to_model(model);
  ++counters.optimizer_steps;
  return norm;
}

double apply_gradients(Run& run, const at::Tensor& loss, int64_t total_optimizer_steps) {
  const double lr = learning_rate(run.config.train, run.counters.optimizer_steps, total_optimizer_steps);
  return step_optimizer(run, run.model, run.counters, loss, lr, "update");
}

}  // namespace rlt
