// The sharded training state; see shard.h.
#include "parallel/shard.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iostream>

#include "common/errors.h"
#include "common/timing.h"
#include "parallel/adamw.h"
#include "parallel/grad_reducer.h"

namespace rlt {

namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

// Chunks are whole multiples of 16 elements: collectives on aligned addresses.
constexpr int64_t kAlign = 16;
constexpr int64_t kLoadPiece = int64_t(1) << 24;  // elements a host-to-device piece of load_from_model
// Elements per piece of the gradient norm's sum of squares.
constexpr int64_t kNormChunk = int64_t(1) << 24;

// The decoder layer a tensor belongs to ("model.layers.<i>." in its name), or -1.
int64_t layer_of(const std::string& name) {
  const std::string tag = "model.layers.";
  const size_t p = name.find(tag);
  if (p == std::string::npos) return -1;
  size_t q = p + tag.size();
  int64_t layer = 0;
  bool digits = false;
  for (; q < name.size() && std::isdigit(static_cast<unsigned char>(name[q])); ++q, digits = true) {
    layer = layer * 10 + (name[q] - '0');
  }
  return digits && q < name.size() && name[q] == '.' ? layer : -1;
}

}  // namespace

// ---- OptimizerPieces ----

std::string OptimizerPieces::key(const std::string& kind, const std::string& name, int64_t begin) {
  return kind + "/" + name + "/" + std::to_string(begin);
}

OptimizerPieces::OptimizerPieces(const std::string& dir) {
  if (!fs::is_directory(dir)) return;
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string f = e.path().filename().string();
    if (f.rfind("optimizer-", 0) == 0 && e.path().extension() == ".safetensors") files.push_back(e.path().string());
  }
  std::sort(files.begin(), files.end());
  for (const auto& f : files) {
    readers_.push_back(safetensors::Reader::open(f));
    for (const auto& k : readers_.back().names()) {
      const size_t slash = k.rfind('/');
      if (slash == std::string::npos) continue;
      const int64_t begin = std::stoll(k.substr(slash + 1));
      const auto& info = readers_.back().info(k);
      int64_t count = 1;
      for (int64_t d : info.shape) count *= d;
      index_[k.substr(0, slash)].push_back({begin, count, readers_.size() - 1, k});
    }
  }
}

bool OptimizerPieces::read(const std::string& kind, const std::string& name, int64_t begin,
                           const at::Tensor& dest) const {
  const int64_t count = dest.numel(), end = begin + count;
  auto it = index_.find(kind + "/" + name);
  if (it == index_.end()) return count == 0;
  int64_t covered = 0;
  at::NoGradGuard no_grad;
  for (const Stored& s : it->second) {
    const int64_t lo = std::max(begin, s.begin), hi = std::min(end, s.begin + s.count);
    if (lo >= hi) continue;
    const at::Tensor v = readers_[s.reader].load(s.key).view(-1);
    dest.view(-1).narrow(0, lo - begin, hi - lo).copy_(v.narrow(0, lo - s.begin, hi - lo));
    covered += hi - lo;
  }
  return covered == count;  // pieces of one writer never overlap
}

// ---- ShardedState ----

ShardedState::ShardedState(const ShardOptions& options, Collectives& dist, Transformer& model,
                           const std::vector<std::pair<std::string, at::Tensor>>& extra, StepCounters& counters,
                           ShardFault fault)
    : dist_(dist),
      model_(options.stage == ShardStage::kParameters ? &model : nullptr),
      counters_(counters),
      lead_(options.lead),
      stage_(options.stage),
      world_(dist.world()),
      rank_(dist.rank()),
      keep_(options.keep_weights),
      fault_(fault) {
  shard_world_ = stage_ == ShardStage::kNone ? 1 : world_;
  for (const auto& [name, t] : model.named_trainable_parameters()) {
    params_.push_back({name, t, t.sizes().vec(), t.numel()});
  }
  const size_t n_policy = params_.size();
  for (const auto& [name, t] : extra) params_.push_back({name, t, t.sizes().vec(), t.numel()});
  TORCH_CHECK(!params_.empty(), "ShardedState: nothing to train");
  weight_dtype_ = params_.front().leaf.scalar_type();
  const at::Device device = params_.front().leaf.device();
  device_ = device;

  // Units in the order the backward completes them: the extra tensors (after the final norm), the head and final
  // norm, the layers from the last, the embedding.
  std::map<int64_t, std::vector<size_t>> layers;
  std::vector<size_t> globals, extras, embedding;
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t l = i < n_policy ? layer_of(params_[i].name) : -2;
    if (l >= 0)
      layers[l].push_back(i);
    else if (l == -2)
      extras.push_back(i);
    else if (params_[i].name.find("embed_tokens") != std::string::npos)
      embedding.push_back(i);
    else
      globals.push_back(i);
  }
  std::reverse(globals.begin(), globals.end());
  auto add_unit = [&](const std::vector<size_t>& members, int64_t layer, int group) {
    Unit u;
    u.params = members;
    u.layer = layer;
    u.group = group;
    for (size_t i : members) {
      params_[i].offset = u.numel;
      params_[i].unit = units_.size();
      u.numel += params_[i].numel;
    }
    u.chunk = (u.numel + shard_world_ - 1) / shard_world_;
    u.chunk = (u.chunk + kAlign - 1) / kAlign * kAlign;
    u.remaining = members.size();
    units_.push_back(std::move(u));
  };
  for (size_t i : extras) add_unit({i}, -2, 1);
  for (size_t i : globals) add_unit({i}, -1, 0);
  for (auto it = layers.rbegin(); it != layers.rend(); ++it) add_unit(it->second, it->first, 0);
  for (size_t i : embedding) add_unit({i}, -1, 0);
  for (const Unit& u : units_) largest_chunk_ = std::max(largest_chunk_, u.chunk);

  // This rank's chunks, group by group, end to end.
  const bool offload = options.offload == Offload::kOptimizer;
  groups_.resize(extras.empty() ? 1 : 2);
  std::vector<int64_t> sizes(groups_.size(), 0);
  for (Unit& u : units_) {
    u.flat = sizes[u.group];
    sizes[u.group] += u.chunk;
  }
  // Made in the order that keeps construction under the steady state's peak: the chunks of weights and
  // masters (the masters on the host under offload), filled from the whole weights, which then leave under
  // shard parameters; only then the gradients and moments. A 32B model over 2 ranks would otherwise hold
  // its whole bf16 weights (61 GiB) beside an fp32 master and gradient chunk (61 GiB each).
  at::NoGradGuard no_grad;
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  for (size_t g = 0; g < groups_.size(); ++g) {
    Group& G = groups_[g];
    G.weights = at::empty({sizes[g]}, f32.dtype(weight_dtype_));
    if (offload)
      G.offload =
          std::make_unique<OffloadedAdamW>(sizes[g], OffloadOptions{options.offload_step});  // the host copy steps
    else
      G.master = at::zeros({sizes[g]}, f32);
  }
  load_from_model();
  // The gradient accumulators record their leaf's shape when first asked for: before the weights leave.
  accum_.resize(params_.size());
  done_.assign(params_.size(), false);
  for (size_t i = 0; i < params_.size(); ++i) {
    std::shared_ptr<torch::autograd::Node> acc = torch::autograd::impl::grad_accumulator(params_[i].leaf);
    TORCH_CHECK(acc, "ShardedState: ", params_[i].name, " is not a leaf that requires grad");
    hook_keys_.push_back(acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          ready(i);
          return outputs;
        })));
    accumulators_.push_back(acc);
  }
  try {
    if (stage_ == ShardStage::kParameters) {
      for (Unit& u : units_) {
        if (u.layer != -2) free_weights(u);
      }
    }
    for (size_t g = 0; g < groups_.size(); ++g) {
      Group& G = groups_[g];
      G.grad = at::zeros({sizes[g]}, f32);
      if (!offload) {
        G.exp_avg = at::zeros_like(G.master);
        G.exp_avg_sq = at::zeros_like(G.master);
      }
    }
  } catch (...) {  // no destructor will run: the hooks must not outlive this object
    for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hook_keys_[i]);
    throw;
  }
  if (stage_ == ShardStage::kParameters) model.set_residency(this);
}

ShardedState::~ShardedState() {
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hook_keys_[i]);
  if (model_) model_->set_residency(nullptr);
}

std::vector<ShardedState::Piece> ShardedState::pieces() const {
  const int shard_rank = shard_world_ == 1 ? 0 : rank_;
  std::vector<Piece> out;
  for (const Unit& u : units_) {
    int64_t lo = shard_rank * u.chunk, hi = lo + u.chunk;
    if (fault_ == ShardFault::kSliceOffByOne && shard_rank > 0) lo += 1;
    for (size_t i : u.params) {
      const Param& p = params_[i];
      const int64_t b = std::max(lo, p.offset), e = std::min(hi, p.offset + p.numel);
      if (b < e) out.push_back({i, b - p.offset, e - b, u.flat + (b - shard_rank * u.chunk)});
    }
  }
  return out;
}

void ShardedState::load_from_model() {
  at::NoGradGuard no_grad;
  for (Group& G : groups_) {
    if (G.master.defined()) G.master.zero_();
  }
  for (const Piece& pc : pieces()) {
    const Param& p = params_[pc.param];
    Group& G = groups_[units_[p.unit].group];
    at::Tensor dest = G.master.defined() ? G.master : G.offload->master();
    dest.narrow(0, pc.flat, pc.count).copy_(p.leaf.detach().reshape(-1).narrow(0, pc.begin, pc.count));
  }
  for (Group& G : groups_) {
    if (G.master.defined()) {
      G.weights.copy_(G.master);
      continue;
    }
    // From the host masters in pieces: a copy that changes dtype across devices converts on the host first,
    // into a temporary the size of what it copies.
    const at::Tensor host = G.offload->master();
    for (int64_t b = 0; b < host.numel(); b += kLoadPiece) {
      const int64_t n = std::min(kLoadPiece, host.numel() - b);
      G.weights.narrow(0, b, n).copy_(host.narrow(0, b, n));
    }
  }
}

// ---- The backward ----

void ShardedState::backward(const at::Tensor& loss, bool ends_step) {
  reducing_ = stage_ != ShardStage::kOptimizer || ends_step;
  if (stage_ == ShardStage::kNone && !ends_step) reducing_ = false;
  collecting_ = true;
  loss.backward();
  collecting_ = false;
  if (reducing_) finish_backward();
  reducing_ = false;
}

void ShardedState::ready(size_t i) {
  if (!collecting_) return;  // a backward of someone else's (the warm-up's own AdamW reads the gradients)
  Param& p = params_[i];
  at::Tensor& g = p.leaf.mutable_grad();
  if (g.defined()) {
    at::NoGradGuard no_grad;
    if (!accum_[i].defined())
      accum_[i] = g.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    else
      accum_[i].add_(g);  // fp32 accumulation over the micro-batches
    g = at::Tensor();
  }
  if (!reducing_ || done_[i]) return;
  done_[i] = true;
  if (--units_[p.unit].remaining == 0) start_ready_units();
}

void ShardedState::start_ready_units() {
  for (; next_unit_ < units_.size() && units_[next_unit_].remaining == 0; ++next_unit_)
    start_reduce(units_[next_unit_]);
}

void ShardedState::start_reduce(Unit& u) {
  at::NoGradGuard no_grad;
  const at::Device device = groups_[u.group].grad.device();
  const bool bounded = fault_ != ShardFault::kReducesUnbounded;
  if (bounded && in_flight_.size() == kReduceSlots) finish_oldest_reduce();
  if (slot_in_.empty()) {
    const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
    for (size_t s = 0; s < kReduceSlots; ++s) {
      slot_in_.push_back(at::empty({shard_world_ * largest_chunk_}, f32));
      if (shard_world_ > 1) slot_out_.push_back(at::empty({largest_chunk_}, f32));
    }
  }
  // Slots are taken in turn and released oldest first, so this one's previous reduce has finished.
  const size_t slot = next_slot_;
  next_slot_ = (next_slot_ + 1) % kReduceSlots;
  in_flight_.push_back(static_cast<size_t>(&u - units_.data()));
  u.reduce_in = bounded ? slot_in_[slot].narrow(0, 0, shard_world_ * u.chunk)
                        : at::empty({shard_world_ * u.chunk}, slot_in_[slot].options());
  u.reduce_in.zero_();  // the padding, and tensors the backward did not reach
  for (size_t i : u.params) {
    if (accum_[i].defined()) {
      u.reduce_in.narrow(0, params_[i].offset, params_[i].numel).copy_(accum_[i].reshape(-1));
      if (fault_ == ShardFault::kReduceTwice)
        u.reduce_in.narrow(0, params_[i].offset, params_[i].numel).add_(accum_[i].reshape(-1));
    }
    accum_[i] = at::Tensor();  // freed: the rank keeps only its chunk of the sum
  }
  if (fault_ == ShardFault::kNeverReduce) {
    u.reduce_out = u.reduce_in.narrow(0, (shard_world_ == 1 ? 0 : rank_) * u.chunk, u.chunk);
    return;
  }
  if (shard_world_ == 1) {  // offload alone: every rank steps the whole state, so the sum is all-reduced
    u.reduce_out = u.reduce_in;
    u.reduce_pending = dist_.all_reduce_start({u.reduce_in});
  } else {
    u.reduce_out = bounded ? slot_out_[slot].narrow(0, 0, u.chunk) : at::empty({u.chunk}, u.reduce_in.options());
    u.reduce_pending = dist_.reduce_scatter_start(u.reduce_out, u.reduce_in);
  }
}

void ShardedState::finish_oldest_reduce() {
  Unit& u = units_[in_flight_.front()];
  in_flight_.pop_front();
  const auto t0 = Clock::now();
  if (u.reduce_pending) u.reduce_pending->wait();
  u.reduce_pending.reset();
  comm_s_ += seconds_since(t0);
  at::NoGradGuard no_grad;
  at::Tensor out = u.reduce_out;
  if (fault_ == ShardFault::kAverage) out = out / double(shard_world_);
  unit_chunk(groups_[u.group].grad, u).add_(out);
  grads_zero_ = false;
  u.reduce_in = at::Tensor();
  u.reduce_out = at::Tensor();
}

void ShardedState::finish_backward() {
  // Tensors the backward did not reach: their gradient is what earlier micro-batches left, or zero.
  for (size_t i = 0; i < params_.size(); ++i) {
    if (done_[i]) continue;
    done_[i] = true;
    --units_[params_[i].unit].remaining;
  }
  start_ready_units();
  while (!in_flight_.empty()) finish_oldest_reduce();
  for (Unit& u : units_) u.remaining = u.params.size();
  next_unit_ = 0;
  done_.assign(params_.size(), false);
}

PhaseTensors ShardedState::phase_tensors(bool training_state, bool whole) const {
  PhaseTensors out;
  const bool gathered = stage_ != ShardStage::kParameters || pinned_ > 0 || keep_ || whole;
  for (const Group& G : groups_) {
    if (G.offload) continue;
    for (const at::Tensor* t : {&G.master, &G.exp_avg, &G.exp_avg_sq}) {
      if (t->defined()) out.moved.push_back(*t);
    }
  }
  // After every master and moment: a gradient that is not zero (none between steps) shifts nothing else.
  for (const Group& G : groups_) {
    if (!G.offload || training_state) (grads_zero_ ? out.zeroed : out.moved).push_back(G.grad);
  }
  for (const Group& G : groups_) {
    if (training_state && gathered && G.weights.defined()) out.chunks.push_back(G.weights);
  }
  return out;
}

void ShardedState::zero_grad() {
  at::NoGradGuard no_grad;
  // A backward that threw may have left reduces in flight: finished, and their results dropped.
  for (size_t i : in_flight_) {
    Unit& u = units_[i];
    if (u.reduce_pending) u.reduce_pending->wait();
    u.reduce_pending.reset();
    u.reduce_in = u.reduce_out = at::Tensor();
  }
  in_flight_.clear();
  for (Group& G : groups_) G.grad.zero_();
  grads_zero_ = true;
  for (auto& a : accum_) a = at::Tensor();
  for (Param& p : params_) p.leaf.mutable_grad() = at::Tensor();
  for (Unit& u : units_) u.remaining = u.params.size();
}

// ---- The optimizer step ----

double ShardedState::step(const at::Tensor& loss, const StepSettings& t) {
  if (stage_ == ShardStage::kOptimizer || stage_ == ShardStage::kNone) {
    // The optimizer stage reduces in the last micro-batch's backward; a step whose backward ran without
    // it (apply_gradients alone, as the warm-up's callers never do) reduces here.
    bool pending = false;
    for (const auto& a : accum_) pending = pending || a.defined();
    if (pending) {
      reducing_ = true;
      finish_backward();
      reducing_ = false;
    }
  }
  slot_in_.clear();  // the backwards are over: the optimizer step and the rollout reuse their memory
  slot_out_.clear();
  next_slot_ = 0;
  at::NoGradGuard no_grad;
  const at::Device device = groups_.front().grad.device();
  // The sum of squares of this rank's gradient chunks, and the loss: summed over the ranks at once (the
  // chunks of a replicated state, shard none, are whole: only the loss is summed then).
  at::Tensor sums = at::zeros({2}, at::TensorOptions().dtype(at::kDouble).device(device));
  at::Tensor sq = sums.narrow(0, 0, 1);
  for (const Group& G : groups_) {  // in chunks: a square of the whole would cost 4 bytes an element
    for (int64_t b = 0; b < G.grad.numel(); b += kNormChunk) {
      sq.add_(at::sum(G.grad.narrow(0, b, std::min(kNormChunk, G.grad.numel() - b)).square(), at::kDouble));
    }
  }
  if (loss.defined()) sums.narrow(0, 1, 1).add_(loss.detach().to(at::kDouble).sum());
  if (shard_world_ == 1) {
    at::Tensor l = sums.narrow(0, 1, 1).clone();
    dist_.all_reduce({l}, ReduceOp::kSum);
    sums.narrow(0, 1, 1).copy_(l);
  } else {
    dist_.all_reduce({sums}, ReduceOp::kSum);
  }
  const at::Tensor host = sums.cpu();
  const double norm = std::sqrt(host[0].item<double>()), loss_sum = host[1].item<double>();
  if (!std::isfinite(norm) || !std::isfinite(loss_sum)) {
    zero_grad();
    ++counters_.skipped_steps;
    if (lead_) std::cerr << "warning: step " << counters_.step + 1 << ": non-finite loss or gradient, update skipped\n";
    return norm;
  }
  // As torch::nn::utils::clip_grad_norm_: scaled by clip / (norm + 1e-6), at most 1.
  if (t.grad_clip > 0) {
    const double coef = std::min(1.0, t.grad_clip / (norm + 1e-6));
    for (Group& G : groups_) G.grad.mul_(coef);
  }
  for (size_t g = 0; g < groups_.size(); ++g) {
    Group& G = groups_[g];
    AdamWStep s{g == 0 ? t.lr : t.extra_lr,   t.beta1, t.beta2, t.eps, g == 0 ? t.weight_decay : 0.0,
                counters_.optimizer_steps + 1};
    if (G.offload) {
      G.offload->step(G.grad, s, G.weights);
    } else if (fault_ == ShardFault::kMomentWrongSlice && G.master.numel() > 1) {
      const int64_t n = G.master.numel() - 1;
      adamw_step(G.master.narrow(0, 0, n), G.grad.narrow(0, 0, n), G.exp_avg.narrow(0, 1, n),
                 G.exp_avg_sq.narrow(0, 1, n), s);
      G.weights.copy_(G.master);
    } else {
      adamw_step(G.master, G.grad, G.exp_avg, G.exp_avg_sq, s);
      G.weights.copy_(G.master);  // rounded to nearest
    }
  }
  ++counters_.optimizer_steps;
  zero_grad();
  if (stage_ != ShardStage::kParameters) {
    write_whole_weights();
  } else {
    // The gathered weights are stale: kept ones (rollout.keep_weights, or inside gather_weights) are
    // gathered again, the others freed.
    for (Unit& u : units_) {
      if (u.layer == -2 || !u.resident) continue;
      if (pinned_ > 0 || keep_) {
        start_gather(u);
      } else {
        free_weights(u);
      }
    }
    for (Unit& u : units_) {
      if (u.gather_pending) install(u);
    }
    write_whole_weights(/*extra_only=*/true);  // the extra tensors are never sharded as weights
  }
  return norm;
}

void ShardedState::write_whole_weights(bool extra_only) {
  at::NoGradGuard no_grad;
  const auto t0 = Clock::now();
  // One unit's whole at a time, in one buffer: each all-gather starts after the copies out of the last one
  // (NCCL's stream waits for the device's), and a buffer per unit would stay allocated until NCCL's stream
  // was done with it: with the host ahead, most of the model.
  at::Tensor buffer;
  for (Unit& u : units_) {
    if (extra_only && u.layer != -2) continue;
    const at::Tensor chunk = unit_chunk(groups_[u.group].weights, u);
    at::Tensor whole = chunk;
    if (shard_world_ > 1) {
      if (!buffer.defined()) buffer = at::empty({shard_world_ * largest_chunk_}, chunk.options());
      whole = buffer.narrow(0, 0, shard_world_ * u.chunk);
      dist_.all_gather_start(whole, chunk)->wait();
    }
    for (size_t i : u.params) {
      Param& p = params_[i];
      p.leaf.detach().copy_(whole.narrow(0, p.offset, p.numel).view(p.shape));
    }
  }
  comm_s_ += seconds_since(t0);
}

// ---- The parameters stage: weights gathered on demand ----

void ShardedState::start_gather(Unit& u) {
  const at::Tensor chunk = unit_chunk(groups_[u.group].weights, u);
  u.gather_buf = at::empty({shard_world_ * u.chunk}, chunk.options());
  u.gather_pending = dist_.all_gather_start(u.gather_buf, chunk);
}

void ShardedState::install(Unit& u) {
  const auto t0 = Clock::now();
  u.gather_pending->wait();
  u.gather_pending.reset();
  comm_s_ += seconds_since(t0);
  at::NoGradGuard no_grad;
  for (size_t i : u.params) {
    Param& p = params_[i];
    p.leaf.set_data(u.gather_buf.narrow(0, p.offset, p.numel).view(p.shape));
  }
  u.resident = true;
}

void ShardedState::free_weights(Unit& u) {
  at::NoGradGuard no_grad;
  for (size_t i : u.params) {
    Param& p = params_[i];
    p.leaf.set_data(at::empty({0}, p.leaf.options()));
  }
  u.gather_buf = at::Tensor();
  u.resident = false;
}

void ShardedState::acquire_unit(Unit& u) {
  if (u.resident) return;
  if (!u.gather_pending) start_gather(u);
  install(u);
}

std::vector<size_t> ShardedState::units_of_layer(int64_t layer) const {
  std::vector<size_t> out;
  for (size_t k = 0; k < units_.size(); ++k) {
    if (units_[k].layer == layer) out.push_back(k);
  }
  return out;
}

void ShardedState::acquire(int64_t layer, bool backward) {
  if (stage_ != ShardStage::kParameters) return;
  for (size_t k : units_of_layer(layer)) {
    if (!units_[k].resident && !units_[k].gather_pending) start_gather(units_[k]);
  }
  // The next layer's gather runs while this one computes.
  const int64_t next = layer < 0 ? -1 : backward ? layer - 1 : layer + 1;
  if (next >= 0) {
    for (size_t k : units_of_layer(next)) {
      if (!units_[k].resident && !units_[k].gather_pending) start_gather(units_[k]);
    }
  }
  for (size_t k : units_of_layer(layer)) acquire_unit(units_[k]);
}

void ShardedState::release(int64_t layer) {
  if (stage_ != ShardStage::kParameters || pinned_ > 0 || keep_ || layer < 0) return;
  for (size_t k : units_of_layer(layer)) free_weights(units_[k]);
}

void ShardedState::gather_weights() {
  if (pinned_++ > 0 || stage_ != ShardStage::kParameters) return;
  for (Unit& u : units_) {
    if (u.layer != -2 && !u.resident && !u.gather_pending) start_gather(u);
  }
  for (Unit& u : units_) {
    if (u.layer != -2 && !u.resident) install(u);
  }
}

void ShardedState::release_weights() {
  TORCH_CHECK(pinned_ > 0, "ShardedState::release_weights without gather_weights");
  if (--pinned_ > 0 || stage_ != ShardStage::kParameters || keep_) return;
  for (Unit& u : units_) {
    if (u.layer != -2 && u.resident) free_weights(u);
  }
}

GatheredWeights::GatheredWeights(const std::shared_ptr<ShardedState>& s) : s_(s) {
  if (s_) s_->gather_weights();
}

GatheredWeights::~GatheredWeights() {
  if (s_) s_->release_weights();
}

// ---- Checkpoints ----

void ShardedState::save(const std::string& dir) const {
  if (shard_world_ == 1 && rank_ != 0) return;  // a replicated state: rank 0's is every rank's
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const Piece& pc : pieces()) {
    const Param& p = params_[pc.param];
    const Group& G = groups_[units_[p.unit].group];
    const at::Tensor master = G.offload ? G.offload->master() : G.master;
    const at::Tensor m = G.offload ? G.offload->exp_avg() : G.exp_avg;
    const at::Tensor v = G.offload ? G.offload->exp_avg_sq() : G.exp_avg_sq;
    tensors.push_back({OptimizerPieces::key("master", p.name, pc.begin), master.narrow(0, pc.flat, pc.count)});
    tensors.push_back({OptimizerPieces::key("exp_avg", p.name, pc.begin), m.narrow(0, pc.flat, pc.count)});
    tensors.push_back({OptimizerPieces::key("exp_avg_sq", p.name, pc.begin), v.narrow(0, pc.flat, pc.count)});
  }
  std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  const int shard_rank = shard_world_ == 1 ? 0 : rank_;
  safetensors::write_file((fs::path(dir) / ("optimizer-" + std::to_string(shard_rank) + ".safetensors")).string(),
                          tensors);
}

void ShardedState::load(const std::string& dir) {
  const OptimizerPieces stored(dir);
  if (stored.empty()) throw RunError(dir + ": no optimizer-*.safetensors (the optimizer state)");
  at::NoGradGuard no_grad;
  for (const Piece& pc : pieces()) {
    const Param& p = params_[pc.param];
    Group& G = groups_[units_[p.unit].group];
    const at::Tensor master = G.offload ? G.offload->master() : G.master;
    const at::Tensor m = G.offload ? G.offload->exp_avg() : G.exp_avg;
    const at::Tensor v = G.offload ? G.offload->exp_avg_sq() : G.exp_avg_sq;
    if (!stored.read("master", p.name, pc.begin, master.narrow(0, pc.flat, pc.count))) {
      throw RunError(dir + ": the optimizer state does not cover " + p.name + " (elements " + std::to_string(pc.begin) +
                     " to " + std::to_string(pc.begin + pc.count) + ")");
    }
    const bool moments = stored.read("exp_avg", p.name, pc.begin, m.narrow(0, pc.flat, pc.count)) &&
                         stored.read("exp_avg_sq", p.name, pc.begin, v.narrow(0, pc.flat, pc.count));
    if (!moments && counters_.optimizer_steps > 0) {
      throw RunError(dir + ": the optimizer state has no AdamW moments for " + p.name + " after " +
                     std::to_string(counters_.optimizer_steps) + " optimizer steps");
    }
  }
  for (Group& G : groups_) G.weights.copy_(G.offload ? G.offload->master() : G.master);
  if (stage_ != ShardStage::kParameters) {
    write_whole_weights();
  } else {
    write_whole_weights(/*extra_only=*/true);
    for (Unit& u : units_) {
      if (u.layer != -2 && u.resident) free_weights(u);
    }
  }
}

int64_t ShardedState::device_bytes() const {
  int64_t bytes = 0;
  for (const Group& G : groups_) {
    for (const at::Tensor* t : {&G.master, &G.grad, &G.exp_avg, &G.exp_avg_sq}) {
      if (t->defined() && t->device() == device_) bytes += t->nbytes();  // not while parked in host memory
    }
    if (stage_ == ShardStage::kParameters) bytes += G.weights.nbytes();
  }
  for (const auto& a : accum_) bytes += a.defined() ? a.nbytes() : 0;
  return bytes;
}

int64_t ShardedState::host_bytes() const {
  int64_t bytes = 0;
  for (const Group& G : groups_) bytes += G.offload ? G.offload->host_bytes() : 0;
  return bytes;
}

}  // namespace rlt
