// The Transformer on one batched, compacting KV cache; see engine.h.
#include "rollout/engine.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

#include "common/memory.h"
#include "common/timing.h"
#include "loss/logprob.h"

#ifdef RLT_HAVE_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "common/cuda/launch.h"
#include "model/tuned_gemm.h"
#endif

namespace rlt {

namespace {

// The next-token logits the sampler draws from, computed as training computes them: the loss module's
// fp32-output LM-head GEMM (loss/logprob.h fp32_logits), then the model's softcap. A bf16 GEMM would round
// the logits to bf16 and the rollout's log-probs would disagree with the trainer's by about 1e-2.
at::Tensor next_token_logits(const Transformer& model, const at::Tensor& hidden /*(N, D)*/) {
  at::Tensor z = fp32_logits(hidden, model.lm_head());  // (N, V) fp32
  const double cap = model.config().final_softcap;
  if (cap > 0) z = at::tanh(z / cap) * cap;
  return z;
}

// The fixed shapes a feed of E rows x K tokens runs at, so that a few captured graphs serve every feed:
// tokens to a multiple of 8 up to 64 (at least 16), then to a power of two (a 17-token reply costs 7 hole
// slots, which the next in-place compaction squeezes out); rows to a power of two of at least kFeedMinRows,
// at most the cache's rows. Coarse on purpose: a capture costs two eager forwards (~20-35 ms of host time),
// and with one row bucket per power of two from 1 the ReTool loop in bench_rollout captures 14-15 feed
// graphs a rollout, which cost what their replays save. The loop's typical feed (3-4 replies of 17 tokens)
// runs as 8 x 24.
constexpr int64_t kFeedMinRows = 8;

int64_t feed_cols(int64_t K, bool verify = false) {
  if (verify && K <= 8) return K <= 2 ? 2 : K <= 4 ? 4 : 8;  // a draft of up to 7 tokens and the one before it
  if (K <= 64) return std::max<int64_t>(16, (K + 7) / 8 * 8);
  int64_t b = 128;
  while (b < K) b *= 2;
  return b;
}

// What a captured draw holds as constants: the temperature, top-k, top-p and vocabulary limit.
#ifdef RLT_HAVE_CUDA
// A packed draw's copy to pinned host memory, queued on the current stream, with `done` recorded after it.
at::Tensor copy_to_host(const at::Tensor& draw, at::cuda::CUDAEvent& done) {
  at::Tensor host = at::empty(draw.sizes(), draw.options().device(at::kCPU).pinned_memory(true));
  host.copy_(draw, /*non_blocking=*/true);
  done.record(c10::cuda::getCurrentCUDAStream(draw.device().index()));
  return host;
}
#endif

[[maybe_unused]] std::array<double, 4> draw_options(const SamplingOptions& sampling, int64_t vocab_limit) {
  return {sampling.temperature, double(sampling.top_k), sampling.top_p, double(vocab_limit)};
}

int64_t feed_rows(int64_t E, int64_t cache_rows) {
  int64_t b = kFeedMinRows;
  while (b < E) b *= 2;
  return std::min(b, cache_rows);
}

// A cache forward's KvCache fields (step_slot, step_rows, span: a fixed-shape step or feed, or an eager feed's
// rows) for its scope: set on entry, cleared on every exit, a throw included.
struct StepFields {
  KvCache& cache;
  StepFields(KvCache& c, const at::Tensor& slot, const at::Tensor& rows, int64_t span) : cache(c) {
    cache.step_slot = slot;
    cache.step_rows = rows;
    cache.span = span;
  }
  ~StepFields() {
    cache.step_slot = cache.step_rows = at::Tensor();
    cache.span = 0;
  }
  StepFields(const StepFields&) = delete;
  StepFields& operator=(const StepFields&) = delete;
};

}  // namespace

int64_t verify_bucket_positions(int64_t rows, int64_t tokens, int64_t cache_rows) {
  return feed_rows(rows, cache_rows) * feed_cols(tokens, /*verify=*/true);
}

#ifdef RLT_HAVE_CUDA
struct DecodeEngine::StepGraph {
  at::cuda::CUDAGraph graph;
  at::Tensor inputs;  // int64: what fixed_step / fixed_extend reads; written before each replay
  at::Tensor hidden;  // what it writes ((Bc, D) or (Eb Kb, D)), in the graph's private memory pool
  int64_t rows = 0, slots = 0;
};

// The events around each replay not yet read, oldest first.
struct DecodeEngine::ReplayClock {
  struct Mark {
    int64_t span = -1;  // the step's span, -1 for a feed
    at::cuda::CUDAEvent begin{cudaEventDefault}, end{cudaEventDefault};
  };
  std::deque<Mark> marks;
};
#else
struct DecodeEngine::StepGraph {};
struct DecodeEngine::ReplayClock {};
#endif

struct DecodeEngine::Ahead {
  std::vector<int64_t> rows, ids, keys;  // the sequences fed, their tokens and noise keys, in one order
  StepPlan plan;                         // pick: each of rows' cache row; pos and fed per cache row
  int64_t slot = 0, span = 0;
  std::array<double, 4> draw_key{};
  at::Tensor draw, host;  // the packed draw (2, Bc) on the device; its copy in pinned host memory (CUDA)
#ifdef RLT_HAVE_CUDA
  at::cuda::CUDAEvent ready{cudaEventDisableTiming};
#endif
};

at::Tensor TokenPolicy::step_runs(const std::vector<int64_t>& rows, const std::vector<std::vector<int64_t>>& runs,
                                  bool each) {
  TORCH_CHECK(rows.size() == runs.size() && !rows.empty(), "extend: rows and runs must be equal, non-empty lists");
  size_t K = 0;
  std::vector<int64_t> offset(rows.size() + 1, 0);  // run j's first position in the output
  for (size_t j = 0; j < runs.size(); ++j) {
    TORCH_CHECK(!runs[j].empty(), "extend: an empty run");
    K = std::max(K, runs[j].size());
    offset[j + 1] = offset[j] + static_cast<int64_t>(runs[j].size());
  }
  // Token t of every run still that long, one step per t; each run's last logits kept (each: all of them).
  std::vector<at::Tensor> out(each ? offset.back() : static_cast<int64_t>(rows.size()));
  for (size_t t = 0; t < K; ++t) {
    std::vector<int64_t> r, tok;
    std::vector<size_t> which;
    for (size_t j = 0; j < rows.size(); ++j) {
      if (t >= runs[j].size()) continue;
      r.push_back(rows[j]);
      tok.push_back(runs[j][t]);
      which.push_back(j);
    }
    at::Tensor logits = step(r, tok);
    for (size_t i = 0; i < which.size(); ++i) {
      const size_t j = which[i];
      if (each) {
        out[offset[j] + t] = logits[static_cast<int64_t>(i)];
      } else if (t + 1 == runs[j].size()) {
        out[j] = logits[static_cast<int64_t>(i)];
      }
    }
  }
  return at::stack(out);
}

at::Tensor TokenPolicy::extend(const std::vector<int64_t>& rows, const std::vector<std::vector<int64_t>>& runs) {
  return step_runs(rows, runs, /*each=*/false);
}

at::Tensor TokenPolicy::extend_each(const std::vector<int64_t>& rows, const std::vector<std::vector<int64_t>>& runs) {
  return step_runs(rows, runs, /*each=*/true);
}

void TokenPolicy::retract(const std::vector<int64_t>&, const std::vector<int64_t>&) {
  TORCH_CHECK(false, "this policy cannot take tokens back (TokenPolicy::retract); rollout.speculative needs it");
}

at::Tensor TokenPolicy::admit(const std::vector<std::vector<int64_t>>&, int64_t) {
  TORCH_CHECK(false,
              "this policy cannot start sequences while others run (TokenPolicy::admit); "
              "rollout.max_batch = 0 starts every prompt at once");
}

DecodeEngine::DecodeEngine(const Transformer& model, EngineOptions options) : model_(model), options_(options) {
  TORCH_CHECK(options_.slot_chunk >= 1, "slot_chunk must be >= 1");
  TORCH_CHECK(options_.slot_align >= 1, "slot_align must be >= 1");
  if (options_.switches.fused_kernels && options_.switches.packed_weights && model_.fused_kernels_apply()) {
    packed_ = model_.pack_weights();
    packed_fresh_ = true;
  }
}

DecodeEngine::~DecodeEngine() = default;

void DecodeEngine::read_replays(bool wait) {
#ifdef RLT_HAVE_CUDA
  if (!replay_clock_) return;
  auto& marks = replay_clock_->marks;
  while (!marks.empty() && (wait || marks.front().end.query())) {
    auto& m = marks.front();
    if (wait) m.end.synchronize();  // elapsed_time() throws on events the device has not reached
    ReplayTime& t = m.span < 0 ? feed_replay_ : step_replay_[m.span];
    t.count += 1;
    t.seconds += m.begin.elapsed_time(m.end) / 1e3;
    marks.pop_front();
  }
#else
  (void)wait;
#endif
}

const std::map<int64_t, DecodeEngine::ReplayTime>& DecodeEngine::step_replay_times() {
  read_replays(/*wait=*/true);
  return step_replay_;
}

DecodeEngine::ReplayTime DecodeEngine::feed_replay_time() {
  read_replays(/*wait=*/true);
  return feed_replay_;
}

std::vector<const void*> DecodeEngine::parameter_storage() const {
  std::vector<const void*> out;
  for (const auto& p : model_.parameters()) out.push_back(p.data_ptr());
  return out;
}

bool DecodeEngine::reuse_cache(int64_t N, int64_t P) {
  if (cache_rows() < N || cache_.max_len < P || N == 0) return false;
  // A captured graph reads the parameters at the addresses they had: a model whose tensors were replaced
  // (not updated in place) needs new graphs.
  if (parameter_storage() != cache_params_) return false;
  std::fill(seq_of_row_.begin(), seq_of_row_.end(), -1);
  cache_row_.clear();
  length_.clear();
  fed_runs_.clear();
  cache_.length = 0;
  valid_.zero_();  // every slot of every row hidden: nothing of the last rollout is seen
  return true;
}

at::Tensor DecodeEngine::start(const std::vector<std::vector<int64_t>>& prompts, int64_t repeats) {
  drop_ahead();
  if (!packed_.gate_up_w.empty() && !packed_fresh_) model_.pack_weights_into(packed_);  // in place: graphs read it
  packed_fresh_ = false;
  if (options_.switches.keep_cache) {
    int64_t P = 0;
    for (const auto& p : prompts) P = std::max<int64_t>(P, static_cast<int64_t>(p.size()));
    const int64_t N = static_cast<int64_t>(prompts.size()) * repeats;
    if (reuse_cache(N, P)) return admit(prompts, repeats);
    cache_params_ = parameter_storage();
    keep_rows_ = N;  // reallocations keep released rows up to this many, for the next start()
  }
  step_graphs_.clear();  // a graph reads the cache tensors it was captured with
  draw_graphs_.clear();
  feed_graphs_.clear();
  merged_graphs_.clear();
  verify_graphs_.clear();
  cache_ = KvCache();
  valid_ = at::Tensor();
  cache_row_.clear();
  seq_of_row_.clear();
  length_.clear();
  fed_runs_.clear();
  return admit(prompts, repeats);
}

at::Tensor DecodeEngine::admit(const std::vector<std::vector<int64_t>>& prompts, int64_t repeats) {
  at::NoGradGuard no_grad;
  drop_ahead();
  NoCudnnAttention attention(!options_.cudnn_attention);
  TORCH_CHECK(!prompts.empty() && repeats >= 1, "admit: needs at least one prompt and repeats >= 1");
  ++stamp_;
  const int64_t U = static_cast<int64_t>(prompts.size()), N = U * repeats;
  const int64_t first = static_cast<int64_t>(length_.size());  // the new sequences are [first, first + N)
  int64_t P = 0;
  for (const auto& p : prompts) {
    TORCH_CHECK(!p.empty(), "admit: a prompt has no tokens");
    P = std::max<int64_t>(P, static_cast<int64_t>(p.size()));
  }
  // Left padding: every prompt ends in the last column, whose hidden state gives the first logits.
  // Filled as host vectors, one tensor each at the end (a tensor write per token costs a dispatch each:
  // 180 ms for 64 x 256 prompt tokens, twice the prefill forward on an H200).
  std::vector<int64_t> ids(U * P, 0), pos(U * P, 0), mask(U * P, 0), lengths(N);
  for (int64_t u = 0; u < U; ++u) {
    const int64_t n = static_cast<int64_t>(prompts[u].size()), pad = P - n;
    for (int64_t j = 0; j < n; ++j) {
      ids[u * P + pad + j] = prompts[u][j];
      pos[u * P + pad + j] = j;  // from 0, whatever slots the sequence will hold
      mask[u * P + pad + j] = 1;
    }
    for (int64_t g = 0; g < repeats; ++g) lengths[u * repeats + g] = n;
  }
  const at::Tensor& head = model_.lm_head();
  const auto dev = head.device();
  auto to_dev = [&](const std::vector<int64_t>& v) { return at::tensor(v, at::kLong).view({U, P}).to(dev); };
  KvCache prefill = KvCache::allocate(model_.config(), U, P, head.options());
  prefill.fused_kernels = options_.switches.fused_kernels;  // gather() passes these on to the decode cache
  prefill.in_place_steps = options_.switches.cache_attention;
  prefill.packed = packed_.gate_up_w.empty() ? nullptr : &packed_;
  at::Tensor mask_d = to_dev(mask);
  at::Tensor hidden = model_.forward(to_dev(ids), to_dev(pos), mask_d, &prefill);  // (U, P, D)
  at::Tensor logits = next_token_logits(model_, hidden.select(1, P - 1));          // (U, V)
  // The G samples of a prompt share its prefill: its row is copied G times.
  auto lopts = at::TensorOptions().dtype(at::kLong).device(dev);
  at::Tensor rows = at::arange(U, lopts).repeat_interleave(repeats);  // (N) prefill row of each new sequence
  at::Tensor prompt_valid = (mask_d != 0).index_select(0, rows);      // (N, P)
  if (cache_rows() == 0) {
    // Nothing held (start, or every row released and dropped): the prefill's rows are the new cache.
    at::Tensor slots = at::arange(P, lopts).view({1, P}).expand({N, P});
    step_graphs_.clear();  // a graph reads the cache tensors it was captured with
    draw_graphs_.clear();
    feed_graphs_.clear();
    merged_graphs_.clear();
    verify_graphs_.clear();
    cache_ = prefill.regather(rows, slots, grown_slots(P, P + options_.slot_chunk));
    valid_ = at::zeros({N, cache_.max_len}, at::TensorOptions().dtype(at::kBool).device(dev));
    valid_.narrow(1, 0, P).copy_(prompt_valid);
    seq_of_row_.resize(N);
    for (int64_t n = 0; n < N; ++n) {
      seq_of_row_[n] = first + n;
      cache_row_.push_back(n);
    }
    length_.insert(length_.end(), lengths.begin(), lengths.end());
    return logits.repeat_interleave(repeats, 0);  // (N, V)
  }
  // Into released rows: a new cache only when there are too few of them or too few slots for the prompt.
  int64_t free_rows = 0;
  for (int64_t s : seq_of_row_) free_rows += s < 0;
  if (free_rows < N || P > cache_.max_len) compact(/*need=*/0, /*drop_released=*/true, /*add_rows=*/N, /*min_len=*/P);
  std::vector<int64_t> dst;  // (N) the cache row of each new sequence: the first free ones
  for (int64_t r = 0; r < cache_rows() && static_cast<int64_t>(dst.size()) < N; ++r) {
    if (seq_of_row_[r] < 0) dst.push_back(r);
  }
  at::Tensor dst_t = at::tensor(dst, at::kLong).to(dev);
  // The released sequence's keys and values stay in the row's other slots, hidden: its valid_ row is
  // cleared, then the prompt's slots [0, P) are set. Slots [P, length) of the row are holes, which the next
  // compaction squeezes out. A prompt longer than the filled slots moves `length` to P: slots [length, P)
  // are holes for every other row (valid_ is false past `length`; cleared again, as a guard).
  cache_.put_rows_(dst_t, prefill, rows);
  valid_.index_fill_(0, dst_t, false);
  if (P > cache_.length) {
    valid_.narrow(1, cache_.length, P - cache_.length).zero_();
    cache_.length = P;
  }
  valid_.narrow(1, 0, P).index_copy_(0, dst_t, prompt_valid);
  for (int64_t n = 0; n < N; ++n) {
    seq_of_row_[dst[n]] = first + n;
    cache_row_.push_back(dst[n]);
  }
  length_.insert(length_.end(), lengths.begin(), lengths.end());
  return logits.repeat_interleave(repeats, 0);  // (N, V)
}

DecodeEngine::StepPlan DecodeEngine::plan_step(const std::vector<int64_t>& rows, const std::vector<int64_t>& tokens,
                                               bool span_step) {
  TORCH_CHECK(rows.size() == tokens.size() && !rows.empty(), "step: rows and tokens must be equal, non-empty lists");
  ++stamp_;
  drop_released_rows();
  if (step_compacts(span_step)) compact(1);
  const int64_t Bc = cache_rows();
  // Built on the host as plain vectors (one tensor each at the end): per-element tensor writes cost a
  // dispatch each, which at 256 rows is milliseconds per decode step.
  StepPlan p;
  p.ids.assign(Bc, 0);
  p.pos.assign(Bc, 0);
  p.fed.assign(Bc, 0);
  p.pick.resize(rows.size());
  for (size_t j = 0; j < rows.size(); ++j) {
    const int64_t n = rows[j];
    TORCH_CHECK(n >= 0 && n < int64_t(cache_row_.size()) && cache_row_[n] >= 0, "step: sequence ", n,
                " was released or never started");
    const int64_t r = cache_row_[n];
    TORCH_CHECK(!p.fed[r], "step: sequence ", n, " listed twice");
    p.ids[r] = tokens[j];
    p.pos[r] = length_[n];
    p.fed[r] = 1;
    p.pick[j] = r;
  }
  return p;
}

std::vector<int64_t> DecodeEngine::fixed_step_inputs(const StepPlan& plan) const {
  std::vector<int64_t> packed = plan.ids;
  packed.insert(packed.end(), plan.pos.begin(), plan.pos.end());
  packed.insert(packed.end(), plan.fed.begin(), plan.fed.end());
  packed.push_back(cache_.length);
  return packed;
}

// Each fed sequence holds one token more once the step has run: a step that throws (a bad row, a failed
// capture) leaves the positions as they were.
void DecodeEngine::advance_step(const std::vector<int64_t>& rows) {
  for (int64_t n : rows) ++length_[n];
}

at::Tensor DecodeEngine::step(const std::vector<int64_t>& rows, const std::vector<int64_t>& tokens) {
  at::NoGradGuard no_grad;
  drop_ahead();
  const auto dev = valid_.device();
  const bool graphs = graphed();
  // A graphed step builds its attention plan once per capture, and cuDNN's decode kernel is the faster
  // one there (rollout_graph 13.3k tokens/s with it, 11.3k without, H200): only eager steps avoid it.
  NoCudnnAttention attention(!options_.cudnn_attention && !graphs);
  const bool span_step = graphs || options_.fixed_shape_step;
  const StepPlan p = plan_step(rows, tokens, span_step);
  const int64_t Bc = cache_rows();
  if (span_step) {
    step_span_slots_ += step_span();
    // One host vector, one copy: ids, positions, fed flags, the slot, then the rows to pick.
    std::vector<int64_t> packed = fixed_step_inputs(p);
    packed.insert(packed.end(), p.pick.begin(), p.pick.end());
    at::Tensor rows_picked, hidden;  // hidden (Bc, D)
#ifdef RLT_HAVE_CUDA
    if (graphs) hidden = graph_step(packed, static_cast<int64_t>(p.pick.size()), rows_picked);
#endif
    if (!graphs) {
      at::Tensor in = at::tensor(packed, at::kLong).to(dev);
      rows_picked = in.narrow(0, 3 * Bc + 1, static_cast<int64_t>(p.pick.size()));
      hidden = fixed_step(in.narrow(0, 0, 3 * Bc + 1), step_span());
    }
    cache_.length += 1;
    advance_step(rows);
    return next_token_logits(model_, hidden.index_select(0, rows_picked));  // (rows, V), outside the graph's memory
  }
  // Rows not fed write a slot nobody attends to (their own query output is discarded).
  valid_.select(1, cache_.length).copy_(at::tensor(p.fed).to(dev, at::kBool));
  at::Tensor mask = valid_.narrow(1, 0, cache_.length + 1);  // (Bc, S)
  at::Tensor hidden = model_.forward(at::tensor(p.ids).view({Bc, 1}).to(dev), at::tensor(p.pos).view({Bc, 1}).to(dev),
                                     mask, &cache_);  // (Bc, 1, D)
  advance_step(rows);                                 // forward() counted the slot in cache_.length
  return next_token_logits(model_, hidden.squeeze(1).index_select(0, at::tensor(p.pick).to(dev)));  // (rows, V)
}

SampleOutput TokenPolicy::step_draw(const std::vector<int64_t>& rows, const std::vector<int64_t>& tokens,
                                    const SamplingOptions& sampling, const at::Tensor& row_keys, int64_t vocab_limit,
                                    const at::Tensor& /*next_keys*/) {
  TORCH_CHECK(row_keys.numel() == static_cast<int64_t>(rows.size()), "step_draw: one noise key per row");
  return sample_keyed(step(rows, tokens), sampling, row_keys, vocab_limit);
}

SampleOutput DecodeEngine::step_draw(const std::vector<int64_t>& rows, const std::vector<int64_t>& tokens,
                                     const SamplingOptions& sampling, const at::Tensor& row_keys, int64_t vocab_limit,
                                     const at::Tensor& next_keys) {
  const bool graphs = graphed();
  if (!options_.switches.graph_draw || !(graphs || options_.fixed_shape_step)) {
    drop_ahead();
    return TokenPolicy::step_draw(rows, tokens, sampling, row_keys, vocab_limit);
  }
  TORCH_CHECK(row_keys.numel() == static_cast<int64_t>(rows.size()), "step_draw: one noise key per row");
  TORCH_CHECK(!next_keys.defined() || next_keys.numel() == static_cast<int64_t>(rows.size()),
              "step_draw: one next noise key per row");
  at::NoGradGuard no_grad;
  NoCudnnAttention attention(!options_.cudnn_attention && !graphs);
  const at::Tensor keys = row_keys.to(at::kCPU, at::kLong).contiguous();
  StepPlan p;
  std::unique_ptr<Ahead> taken;  // the step started ahead that is this one
  at::Tensor draw;               // (2, Bc) on the device
  if (ahead_ && take_ahead(rows, tokens, keys, sampling, vocab_limit, &p)) {
    taken = std::move(ahead_);
    draw = taken->draw;
  } else {
    drop_ahead();
    p = plan_step(rows, tokens, /*span_step=*/true);
    const int64_t span = step_span();
    step_span_slots_ += span;
    draw = run_draw(draw_inputs(p, keys.data_ptr<int64_t>()), span, sampling, vocab_limit);
    cache_.length += 1;
    advance_step(rows);
  }
  // The next step, started before this one's draw is read (its replay writes the same output buffer: the
  // copy to the host goes first).
  at::Tensor host = taken ? taken->host : at::Tensor();
  const bool ahead =
      next_keys.defined() && options_.switches.step_ahead && steps_unchanged(step_span(), sampling, vocab_limit);
#ifdef RLT_HAVE_CUDA
  at::cuda::CUDAEvent copied(cudaEventDisableTiming);
  if (ahead && graphs && !taken) host = copy_to_host(draw, copied);
#endif
  SampleOutput out;
  try {
    if (ahead) start_ahead(p, rows, draw, next_keys, sampling, vocab_limit);
    if (host.defined()) {
#ifdef RLT_HAVE_CUDA
      if (taken) {
        taken->ready.synchronize();
      } else {
        copied.synchronize();
      }
#endif
      out = unpack_draw(host, at::tensor(p.pick, at::kLong));
    } else {
      out = unpack_draw(draw, at::tensor(p.pick, at::kLong));  // waits for the step
    }
  } catch (...) {
    // A step that throws (a draw that is not finite) leaves the positions as they were: the step started
    // ahead goes, and this one's slot is written again by the next forward.
    drop_ahead();
    cache_.length -= 1;
    for (int64_t n : rows) --length_[n];
    throw;
  }
  if (ahead_) ahead_->ids.assign(out.ids.data_ptr<int64_t>(), out.ids.data_ptr<int64_t>() + out.ids.numel());
  return out;
}

bool DecodeEngine::steps_unchanged(int64_t span, const SamplingOptions& sampling, int64_t vocab_limit) const {
  // What plan_step would do before the step: drop released rows, make room, squeeze the holes out.
  if (drops_released_rows() || step_compacts(/*span_step=*/true) || span != step_span()) return false;
#ifdef RLT_HAVE_CUDA
  if (graphed()) {  // a capture waits for the device: the step is not started ahead of one
    if (draw_options(sampling, vocab_limit) != draw_key_) return false;
    const auto g = draw_graphs_.find(span);
    if (g == draw_graphs_.end() || !g->second) return false;
  }
#else
  (void)sampling;
  (void)vocab_limit;
#endif
  return true;
}

at::Tensor DecodeEngine::draw_inputs(const StepPlan& p, const int64_t* keys) const {
  std::vector<int64_t> packed = fixed_step_inputs(p);
  const size_t keys_at = packed.size();
  packed.resize(keys_at + cache_rows(), 0);
  for (size_t j = 0; j < p.pick.size(); ++j) packed[keys_at + p.pick[j]] = keys[j];
  return to_device_async(packed, valid_.device());
}

at::Tensor DecodeEngine::run_draw(const at::Tensor& inputs, int64_t span, const SamplingOptions& sampling,
                                  int64_t vocab_limit) {
#ifdef RLT_HAVE_CUDA
  if (graphed()) {
    const std::array<double, 4> key = draw_options(sampling, vocab_limit);
    if (key != draw_key_) draw_graphs_.clear();  // the options are constants of the captured draw
    draw_key_ = key;
    auto& g = draw_graphs_[span];
    replay(
        g, inputs, span,
        [this, span, sampling, vocab_limit](const at::Tensor& x) {
          return fixed_step_draw(x, span, sampling, vocab_limit);
        },
        "decode step with its draw");
    return g->hidden;
  }
#endif
  return fixed_step_draw(inputs, span, sampling, vocab_limit);
}

void DecodeEngine::start_ahead(const StepPlan& plan, const std::vector<int64_t>& rows, const at::Tensor& draw,
                               const at::Tensor& next_keys, const SamplingOptions& sampling, int64_t vocab_limit) {
  const int64_t Bc = cache_rows(), span = step_span();
  auto a = std::make_unique<Ahead>();
  a->rows = rows;
  a->slot = cache_.length;
  a->span = span;
  a->draw_key = draw_options(sampling, vocab_limit);
  a->plan.pick = plan.pick;
  a->plan.ids.assign(Bc, 0);
  a->plan.pos.assign(Bc, 0);
  a->plan.fed.assign(Bc, 0);
  for (size_t j = 0; j < rows.size(); ++j) {
    a->plan.pos[plan.pick[j]] = length_[rows[j]];
    a->plan.fed[plan.pick[j]] = 1;
  }
  const at::Tensor nk = next_keys.to(at::kCPU, at::kLong).contiguous();
  a->keys.assign(nk.data_ptr<int64_t>(), nk.data_ptr<int64_t>() + nk.numel());
  at::Tensor in = draw_inputs(a->plan, a->keys.data());  // the ids, 0 here, come from the draw
  // Each fed row's token is the one it drew; the rows not fed keep 0, as a plan gives them.
  in.narrow(0, 0, Bc).copy_(draw[0].to(at::kLong) * in.narrow(0, 2 * Bc, Bc));
  a->draw = run_draw(in, span, sampling, vocab_limit);
#ifdef RLT_HAVE_CUDA
  if (graphed()) a->host = copy_to_host(a->draw, a->ready);
#endif
  ahead_ = std::move(a);
}

bool DecodeEngine::take_ahead(const std::vector<int64_t>& rows, const std::vector<int64_t>& tokens,
                              const at::Tensor& keys, const SamplingOptions& sampling, int64_t vocab_limit,
                              StepPlan* plan) {
  const Ahead& a = *ahead_;
  if (rows.empty() || rows.size() != tokens.size() || a.ids.size() != a.rows.size()) return false;
  if (draw_options(sampling, vocab_limit) != a.draw_key || cache_.length != a.slot) return false;
  if (!steps_unchanged(a.span, sampling, vocab_limit)) return false;
  std::vector<int64_t> at_row(cache_row_.size(), -1);  // sequence -> its place in a.rows
  for (size_t k = 0; k < a.rows.size(); ++k) at_row[a.rows[k]] = static_cast<int64_t>(k);
  const int64_t* key = keys.data_ptr<int64_t>();
  std::vector<uint8_t> kept(a.rows.size(), 0);
  for (size_t j = 0; j < rows.size(); ++j) {
    const int64_t n = rows[j];
    if (n < 0 || n >= static_cast<int64_t>(at_row.size()) || at_row[n] < 0) return false;
    const size_t k = static_cast<size_t>(at_row[n]);
    if (kept[k] || a.ids[k] != tokens[j] || a.keys[k] != key[j] || cache_row_[n] != a.plan.pick[k]) return false;
    kept[k] = 1;
  }
  // Taken: the step's bookkeeping (plan_step's and step_draw's), the rows it fed that this one leaves out
  // made holes, as a step makes its rows not fed.
  ++stamp_;
  *plan = a.plan;
  plan->pick.resize(rows.size());
  for (size_t j = 0; j < rows.size(); ++j) plan->pick[j] = cache_row_[rows[j]];
  std::vector<int64_t> left;
  for (size_t k = 0; k < a.rows.size(); ++k) {
    if (!kept[k]) left.push_back(a.plan.pick[k]);
  }
  if (!left.empty() && options_.ahead_holes) {
    // Through pinned memory: a copy from pageable memory would wait for the step started ahead.
    const c10::List<std::optional<at::Tensor>> at{to_device_async(left, valid_.device()),
                                                  to_device_async(std::vector<int64_t>{a.slot}, valid_.device())};
    valid_.index_put_(at, at::zeros({}, valid_.options()));
  }
  step_span_slots_ += a.span;
  cache_.length += 1;
  advance_step(rows);
  ++ahead_taken_;
  return true;
}

void DecodeEngine::drop_ahead() {
  if (!ahead_) return;
  // Its slot is not filled: the next step or feed writes it again (a step sets every row's mark there).
  valid_.select(1, ahead_->slot).fill_(false);
  ahead_.reset();
  ++ahead_dropped_;
}

at::Tensor DecodeEngine::extend(const std::vector<int64_t>& rows, const std::vector<std::vector<int64_t>>& runs) {
  return feed(rows, runs, /*each=*/false);
}

at::Tensor DecodeEngine::extend_each(const std::vector<int64_t>& rows, const std::vector<std::vector<int64_t>>& runs) {
  return feed(rows, runs, /*each=*/true);
}

void DecodeEngine::note_run(int64_t n, int64_t first, int64_t count) {
  if (static_cast<int64_t>(fed_runs_.size()) < static_cast<int64_t>(length_.size())) fed_runs_.resize(length_.size());
  fed_runs_[n] = {stamp_, first, count};
}

SampleOutput TokenPolicy::extend_each_draw(const std::vector<int64_t>& rows,
                                           const std::vector<std::vector<int64_t>>& runs,
                                           const SamplingOptions& sampling, const at::Tensor& keys,
                                           int64_t vocab_limit) {
  return sample_keyed(extend_each(rows, runs), sampling, keys, vocab_limit);
}

SampleOutput DecodeEngine::extend_each_draw(const std::vector<int64_t>& rows,
                                            const std::vector<std::vector<int64_t>>& runs,
                                            const SamplingOptions& sampling, const at::Tensor& keys,
                                            int64_t vocab_limit) {
  const bool fixed = (graphed() && options_.switches.cuda_graphs) || options_.fixed_shape_extend;
  const bool fused = options_.switches.fused_kernels;  // the draw a decode step makes
  if (!options_.switches.graph_draw || !fixed) {
    return sample_keyed(extend_each(rows, runs), sampling, keys, vocab_limit, fused);
  }
  FeedDraw d;
  d.sampling = &sampling;
  d.keys = keys.to(at::kCPU, at::kLong).contiguous();
  d.vocab_limit = vocab_limit;
  SampleOutput out;
  const at::Tensor logits = feed(rows, runs, /*each=*/true, &d, &out);
  if (logits.defined()) return sample_keyed(logits, sampling, d.keys, vocab_limit, fused);  // one token each: a step
  return out;
}

void DecodeEngine::retract(const std::vector<int64_t>& rows, const std::vector<int64_t>& counts) {
  drop_ahead();
  TORCH_CHECK(rows.size() == counts.size(), "retract: one count per sequence");
  std::vector<int64_t> at_rows, at_slots;
  for (size_t j = 0; j < rows.size(); ++j) {
    const int64_t n = rows[j], c = counts[j];
    if (c == 0) continue;
    TORCH_CHECK(n >= 0 && n < int64_t(cache_row_.size()) && cache_row_[n] >= 0, "retract: sequence ", n,
                " was released or never started");
    TORCH_CHECK(n < int64_t(fed_runs_.size()) && fed_runs_[n].stamp == stamp_ && c > 0 && c <= fed_runs_[n].count,
                "retract: sequence ", n, " has no ", c, " tokens of the latest forward to take back");
    FedRun& r = fed_runs_[n];
    for (int64_t i = r.count - c; i < r.count; ++i) {
      at_rows.push_back(cache_row_[n]);
      at_slots.push_back(r.first + i);
    }
    r.count -= c;
    length_[n] -= c;
  }
  if (at_rows.empty()) return;
  const auto dev = valid_.device();
  const c10::List<std::optional<at::Tensor>> at{at::tensor(at_rows, at::kLong).to(dev),
                                                at::tensor(at_slots, at::kLong).to(dev)};
  valid_.index_put_(at, at::zeros({}, valid_.options()));
}

at::Tensor DecodeEngine::feed(const std::vector<int64_t>& rows, const std::vector<std::vector<int64_t>>& runs,
                              bool each, const FeedDraw* draw, SampleOutput* drawn) {
  at::NoGradGuard no_grad;
  drop_ahead();
  ++stamp_;
  TORCH_CHECK(rows.size() == runs.size() && !rows.empty(), "extend: rows and runs must be equal, non-empty lists");
  const int64_t E = static_cast<int64_t>(rows.size());
  int64_t K = 0;
  for (const auto& run : runs) {
    TORCH_CHECK(!run.empty(), "extend: an empty run");
    K = std::max<int64_t>(K, static_cast<int64_t>(run.size()));
  }
  if (K == 1) {  // one token each: a decode step (the graphed path on a GPU)
    std::vector<int64_t> tokens(E);
    for (int64_t j = 0; j < E; ++j) tokens[j] = runs[j][0];
    at::Tensor logits = step(rows, tokens);
    for (int64_t n : rows) note_run(n, cache_.length - 1, 1);  // the step wrote slot length - 1
    return logits;
  }
  const auto dev = valid_.device();
  bool graphs = false;
#ifdef RLT_HAVE_CUDA
  graphs = options_.switches.cuda_graphs && (options_.switches.feed_graphs || each) && dev.is_cuda();
  // Runs of one token beside longer ones (rollout.merge_feeds): one merged pass, a step and a feed sharing
  // their weight reads, where the model can run it.
  bool ones = false;
  for (const auto& run : runs) ones |= run.size() == 1;
  if (!each && graphs && ones && cache_.fused_kernels && model_.mixed_forward_applies()) {
    return merged_extend(rows, runs);
  }
#endif
  NoCudnnAttention attention(!options_.cudnn_attention);  // after the step above, which keeps cuDNN when graphed
  // The fixed-shape form (bucketed rows x tokens, the write slots on the device) is what a graph
  // captures; without graphs it runs eagerly at the exact shape.
  const bool fixed = graphs || options_.fixed_shape_extend;
  const int64_t Kb = fixed ? feed_cols(K, each) : K;
  drop_released_rows();
  // A verifying forward leaves its rejected tokens' slots as holes, as decode steps leave waiting rows':
  // squeezed out once they cost a chunk of the span (squeeze_holes), as before a step.
  const bool squeeze = each && options_.squeeze_holes && holes_cost_a_chunk();
  if (cache_.length + Kb > cache_.max_len || squeeze) compact(Kb);
  const int64_t L = cache_.length, Bc = cache_rows();
  const int64_t Eb = fixed ? feed_rows(E, Bc) : E;
  // Input row j is sequence rows[j]: its run at columns [0, k_j), padding after it (a hole in the cache).
  std::vector<int64_t> cache_row(Eb), ids(Eb * Kb, 0), pos(Eb * Kb, 0), fed(Eb * Kb, 0), last(E);
  std::vector<uint8_t> seen(Bc, 0);
  for (int64_t j = 0; j < E; ++j) {
    const int64_t n = rows[j];
    TORCH_CHECK(n >= 0 && n < int64_t(cache_row_.size()) && cache_row_[n] >= 0, "extend: sequence ", n,
                " was released or never started");
    const int64_t r = cache_row_[n], k = static_cast<int64_t>(runs[j].size());
    TORCH_CHECK(!seen[r], "extend: sequence ", n, " listed twice");
    seen[r] = 1;
    cache_row[j] = r;
    for (int64_t t = 0; t < Kb; ++t) {
      ids[j * Kb + t] = t < k ? runs[j][t] : 0;
      pos[j * Kb + t] = length_[n] + t;  // a padding slot's position is never read: it is a hole
      fed[j * Kb + t] = t < k;
    }
    last[j] = j * Kb + k - 1;
  }
  // The bucket's extra rows are rows not listed (there are enough: Eb <= Bc), fed nothing: the slots they
  // write stay holes, and their outputs are never read.
  for (int64_t r = 0, j = E; j < Eb; ++r) {
    if (!seen[r]) cache_row[j++] = r;
  }
  at::Tensor hidden;       // (Eb Kb, D)
  at::Tensor packed_draw;  // (2, Eb Kb), with draw
  if (fixed) {
    // One host vector, one copy: ids, positions, fed, the rows, then the first slot.
    std::vector<int64_t> packed = ids;
    packed.insert(packed.end(), pos.begin(), pos.end());
    packed.insert(packed.end(), fed.begin(), fed.end());
    packed.insert(packed.end(), cache_row.begin(), cache_row.end());
    packed.push_back(L);
    const int64_t span = span_of(L + Kb);  // the slots filled and the feed's
    feed_span_slots_ += span;
    if (draw) {
      // Then each position's noise key (0 at the padding: its draw is dropped).
      const size_t keys_at = packed.size();
      packed.resize(keys_at + Eb * Kb, 0);
      const int64_t* key = draw->keys.data_ptr<int64_t>();
      for (int64_t j = 0, at = 0; j < E; ++j) {
        for (size_t t = 0; t < runs[j].size(); ++t) packed[keys_at + j * Kb + t] = key[at++];
      }
    }
#ifdef RLT_HAVE_CUDA
    if (graphs && draw) {
      const SamplingOptions& sampling = *draw->sampling;
      const std::array<double, 4> key = draw_options(sampling, draw->vocab_limit);
      if (key != verify_key_) verify_graphs_.clear();  // the options are constants of the captured draw
      verify_key_ = key;
      auto& g = verify_graphs_[{Eb, Kb, span}];
      feed_graph_captures_ += replay(
          g, to_device_async(packed, dev), -1,
          [this, Eb, Kb, span, sampling, limit = draw->vocab_limit](const at::Tensor& x) {
            return fixed_extend_draw(x, Eb, Kb, span, sampling, limit);
          },
          "verifying forward with its draw");
      packed_draw = g->hidden;
    } else if (graphs) {
      hidden = graph_extend(packed, Eb, Kb, span);
    } else
#endif
        if (draw) {
      packed_draw =
          fixed_extend_draw(at::tensor(packed, at::kLong).to(dev), Eb, Kb, span, *draw->sampling, draw->vocab_limit);
    } else {
      hidden = fixed_extend(at::tensor(packed, at::kLong).to(dev), Eb, Kb, span);
    }
    cache_.length = L + Kb;
  } else {
    at::Tensor rows_t = at::tensor(cache_row, at::kLong).to(dev);
    // Slots [L, L + K) are holes for every row, then the runs' own slots of the listed rows.
    valid_.narrow(1, L, K).zero_();
    valid_.narrow(1, L, K).index_copy_(0, rows_t, at::tensor(fed).view({E, K}).to(dev, at::kBool));
    at::Tensor mask = valid_.narrow(1, 0, L + K).index_select(0, rows_t);  // (E, L + K)
    const StepFields on(cache_, at::Tensor(), rows_t, 0);  // no step slot: the eager feed's slots follow length
    hidden = model_.forward(at::tensor(ids).view({E, K}).to(dev), at::tensor(pos).view({E, K}).to(dev), mask, &cache_)
                 .reshape({E * K, -1});  // (E, K, D) -> (E K, D); cache_.length becomes L + K
  }
  // The runs are in the cache: each sequence holds its run's tokens more (not before: a feed that throws
  // leaves the positions as they were).
  for (int64_t j = 0; j < E; ++j) {
    length_[rows[j]] += static_cast<int64_t>(runs[j].size());
    note_run(rows[j], L, static_cast<int64_t>(runs[j].size()));
  }
  std::vector<int64_t> pick = last;  // each run's last position; each: all of them, run after run
  if (each) {
    pick.clear();
    for (int64_t j = 0; j < E; ++j) {
      for (int64_t t = 0; t < static_cast<int64_t>(runs[j].size()); ++t) pick.push_back(j * Kb + t);
    }
  }
  if (draw) {
    *drawn = unpack_draw(packed_draw, at::tensor(pick, at::kLong));  // waits for the forward
    return at::Tensor();
  }
  at::Tensor h = hidden.index_select(0, at::tensor(pick).to(dev));  // (E or the runs' tokens, D)
  return next_token_logits(model_, h);                              // (E or the runs' tokens, V)
}

#ifdef RLT_HAVE_CUDA
at::Tensor DecodeEngine::merged_extend(const std::vector<int64_t>& rows,
                                       const std::vector<std::vector<int64_t>>& runs) {
  drop_released_rows();
  int64_t K = 0;  // the longest run of more than one token
  for (const auto& run : runs) K = std::max<int64_t>(K, static_cast<int64_t>(run.size()));
  const int64_t Kb = feed_cols(K);
  if (cache_.length + 1 + Kb > cache_.max_len || (options_.squeeze_holes && holes_cost_a_chunk())) compact(1 + Kb);
  const int64_t L = cache_.length, Bc = cache_rows();
  // The step's part, per cache row: ids, positions, fed; the feed's, per input row of the bucket: its run at
  // columns [0, k), padding after it (holes).
  std::vector<int64_t> ids(Bc, 0), pos(Bc, 0), fed(Bc, 0), pick(rows.size());
  std::vector<int64_t> cache_row, f_ids, f_pos, f_fed;
  std::vector<uint8_t> in_feed(Bc, 0);
  for (size_t j = 0; j < rows.size(); ++j) {
    const int64_t n = rows[j];
    TORCH_CHECK(n >= 0 && n < int64_t(cache_row_.size()) && cache_row_[n] >= 0, "extend: sequence ", n,
                " was released or never started");
    const int64_t r = cache_row_[n], k = static_cast<int64_t>(runs[j].size());
    TORCH_CHECK(!fed[r] && !in_feed[r], "extend: sequence ", n, " listed twice");
    if (k == 1) {
      ids[r] = runs[j][0];
      pos[r] = length_[n];
      fed[r] = 1;
      pick[j] = r;
      continue;
    }
    in_feed[r] = 1;
    pick[j] = Bc + static_cast<int64_t>(cache_row.size()) * Kb + k - 1;
    cache_row.push_back(r);
    for (int64_t t = 0; t < Kb; ++t) {
      f_ids.push_back(t < k ? runs[j][t] : 0);
      f_pos.push_back(length_[n] + t);  // a padding slot's position is never read: it is a hole
      f_fed.push_back(t < k);
    }
  }
  const int64_t E = static_cast<int64_t>(cache_row.size()), Eb = feed_rows(E, Bc);
  // The bucket's extra rows are rows not in the feed, fed nothing there: hole slots, outputs never read.
  for (int64_t r = 0; static_cast<int64_t>(cache_row.size()) < Eb; ++r) {
    if (in_feed[r]) continue;
    cache_row.push_back(r);
    f_ids.insert(f_ids.end(), Kb, 0);
    f_pos.insert(f_pos.end(), Kb, 0);
    f_fed.insert(f_fed.end(), Kb, 0);
  }
  // One host vector, one copy: the step's ids, positions, fed flags and slot, then the feed's ids,
  // positions, fed flags and rows.
  std::vector<int64_t> packed = ids;
  packed.insert(packed.end(), pos.begin(), pos.end());
  packed.insert(packed.end(), fed.begin(), fed.end());
  packed.push_back(L);
  packed.insert(packed.end(), f_ids.begin(), f_ids.end());
  packed.insert(packed.end(), f_pos.begin(), f_pos.end());
  packed.insert(packed.end(), f_fed.begin(), f_fed.end());
  packed.insert(packed.end(), cache_row.begin(), cache_row.end());
  const int64_t span = span_of(L + 1 + Kb);  // the slots filled, the step's and the feed's
  feed_span_slots_ += span;
  ++merged_passes_;
  // (No NoCudnnAttention here: a graphed pass builds its attention plans once per capture, and cuDNN's
  // decode kernel is the step's faster one, as in step().)
  at::Tensor hidden = graph_extend(packed, Eb, Kb, span, /*merged=*/true);  // (Bc + Eb Kb, D)
  cache_.length = L + 1 + Kb;
  for (size_t j = 0; j < rows.size(); ++j) length_[rows[j]] += static_cast<int64_t>(runs[j].size());
  return next_token_logits(model_, hidden.index_select(0, to_device_async(pick, valid_.device())));  // (rows, V)
}

at::Tensor DecodeEngine::fixed_merged(const at::Tensor& inputs, int64_t Eb, int64_t Kb, int64_t span) {
  const int64_t Bc = cache_rows(), n = Eb * Kb, f0 = 3 * Bc + 1;
  at::Tensor ids = inputs.narrow(0, 0, Bc).view({Bc, 1}), pos = inputs.narrow(0, Bc, Bc).view({Bc, 1});
  at::Tensor fed = inputs.narrow(0, 2 * Bc, Bc).view({Bc, 1}) != 0, slot = inputs.narrow(0, 3 * Bc, 1);
  at::Tensor f_ids = inputs.narrow(0, f0, n).view({Eb, Kb}), f_pos = inputs.narrow(0, f0 + n, n).view({Eb, Kb});
  at::Tensor f_fed = inputs.narrow(0, f0 + 2 * n, n).view({Eb, Kb}) != 0, rows = inputs.narrow(0, f0 + 3 * n, Eb);
  at::Tensor slots = slot + 1 + at::arange(Kb, inputs.options());  // (Kb)
  // The step's slot for every row (rows not fed there: a hole), then the feed's slots.
  valid_.index_copy_(1, slot, fed);
  mark_feed_slots(rows, slots, f_fed);
  at::Tensor mask = valid_.narrow(1, 0, span);
  const StepFields on(cache_, slot, at::Tensor(), span);
  return model_.forward_mixed(ids, pos, mask, f_ids, f_pos, mask.index_select(0, rows), rows, slots,
                              cache_);  // (Bc + Eb Kb, D)
}
#endif

at::Tensor DecodeEngine::fixed_extend(const at::Tensor& inputs, int64_t Eb, int64_t Kb, int64_t span) {
  const int64_t n = Eb * Kb;
  at::Tensor ids = inputs.narrow(0, 0, n).view({Eb, Kb}), pos = inputs.narrow(0, n, n).view({Eb, Kb});
  at::Tensor fed = inputs.narrow(0, 2 * n, n).view({Eb, Kb}) != 0, rows = inputs.narrow(0, 3 * n, Eb);
  at::Tensor slots = inputs.narrow(0, 3 * n + Eb, 1) + at::arange(Kb, inputs.options());  // (Kb)
  mark_feed_slots(rows, slots, fed);
  at::Tensor mask = valid_.narrow(1, 0, span).index_select(0, rows);  // (Eb, span)
  const StepFields on(cache_, slots, rows, span);
  return model_.forward(ids, pos, mask, &cache_).view({n, -1});  // (Eb Kb, D)
}

at::Tensor DecodeEngine::fixed_extend_draw(const at::Tensor& inputs, int64_t Eb, int64_t Kb, int64_t span,
                                           const SamplingOptions& sampling, int64_t vocab_limit) {
  const int64_t n_in = 3 * Eb * Kb + Eb + 1;
  at::Tensor hidden = fixed_extend(inputs.narrow(0, 0, n_in), Eb, Kb, span);  // (Eb Kb, D)
  at::Tensor logits = next_token_logits(model_, hidden);                      // (Eb Kb, V)
  return pack_draw(
      draw_tokens(logits, sampling, inputs.narrow(0, n_in, Eb * Kb), vocab_limit, options_.switches.fused_kernels));
}

void DecodeEngine::mark_feed_slots(const at::Tensor& rows, const at::Tensor& slots, const at::Tensor& fed) {
  // The feed's slots are holes for every row, then the runs' own slots of the listed rows.
  valid_.index_fill_(1, slots, false);
  const c10::List<std::optional<at::Tensor>> at_slots{rows.view({rows.size(0), 1}), slots.view({1, slots.size(0)})};
  valid_.index_put_(at_slots, fed);
}

int64_t DecodeEngine::aligned_slots(int64_t slots) const {
  const int64_t a = options_.slot_align;
  return (slots + a - 1) / a * a;
}

int64_t DecodeEngine::span_of(int64_t slots) const {
  const int64_t c = options_.span_chunk;
  if (c <= 0) return cache_.max_len;
  return std::min(cache_.max_len, (slots + c - 1) / c * c);
}

int64_t DecodeEngine::step_span() const { return span_of(cache_.length + 1); }

int64_t DecodeEngine::grown_slots(int64_t least, int64_t wanted) const {
  const int64_t cap = options_.max_slots > 0 ? aligned_slots(options_.max_slots) : wanted;
  return aligned_slots(std::max(least, std::min(wanted, cap)));
}

bool DecodeEngine::squeezes_in_place(int64_t filled, int64_t need) const {
  // At the bound a new cache would be no larger: any squeeze that makes room is worth its graphs.
  const bool bounded = options_.max_slots > 0 && cache_.max_len >= aligned_slots(options_.max_slots);
  return cache_.max_len - filled >= need + (bounded ? 0 : cache_.max_len / 16);
}

bool DecodeEngine::holes_cost_a_chunk() const {
  if (options_.span_chunk <= 0) return false;
  int64_t held = 0;  // the most slots a live row fills: a squeeze leaves cache_.length there
  for (int64_t n : seq_of_row_) {
    if (n >= 0) held = std::max(held, length_[n]);
  }
  // Only where compact(1) squeezes in place (a reallocation would drop every graph).
  return step_span() >= span_of(held + 1) + options_.span_chunk && squeezes_in_place(held, 1);
}

at::Tensor DecodeEngine::fixed_step(const at::Tensor& inputs, int64_t span) {
  const int64_t Bc = cache_rows();
  at::Tensor ids = inputs.narrow(0, 0, Bc).view({Bc, 1}), pos = inputs.narrow(0, Bc, Bc).view({Bc, 1});
  at::Tensor fed = inputs.narrow(0, 2 * Bc, Bc).view({Bc, 1}) != 0, slot = inputs.narrow(0, 3 * Bc, 1);
  // Rows not fed write a slot nobody attends to (their own query output is discarded).
  valid_.index_copy_(1, slot, fed);
  const StepFields on(cache_, slot, at::Tensor(), span);
  return model_.forward(ids, pos, valid_.narrow(1, 0, span), &cache_).squeeze(1);  // (Bc, D)
}

at::Tensor DecodeEngine::fixed_step_draw(const at::Tensor& inputs, int64_t span, const SamplingOptions& sampling,
                                         int64_t vocab_limit) {
  const int64_t Bc = cache_rows();
  at::Tensor hidden = fixed_step(inputs.narrow(0, 0, 3 * Bc + 1), span);  // (Bc, D)
  at::Tensor logits = next_token_logits(model_, hidden);                  // (Bc, V)
  return pack_draw(
      draw_tokens(logits, sampling, inputs.narrow(0, 3 * Bc + 1, Bc), vocab_limit, options_.switches.fused_kernels));
}

#ifdef RLT_HAVE_CUDA
namespace {

// The stream every capture on a device runs on, its warm-up included, made once per process and used by
// nothing else (a pool stream would be handed to other code too, whose work a capture would record), and
// the lock that keeps two threads' captures off it at once. cuBLAS keeps a workspace for each (handle,
// stream) pair it runs on until the process ends (32 MiB and 1 MiB for cuBLASLt on a Hopper GPU), and the
// caching allocator reuses a freed block only on the stream it was allocated on, the graphs' shared pool
// included. A fresh pool stream for each capture left 66 MiB more allocated after every rollout that
// captured two graphs (on an H200 the 0.5B's LoRA update started 1,177, 1,544, 1,610 and 1,676 MiB up over
// four steps: 32 pool streams and 1 GiB at the limit), its reserved memory grew about 250 MiB a step, and
// each capture's pool blocks were its own.
struct CaptureStreams {
  std::mutex capturing;
  std::mutex guard;
  std::map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;

  c10::cuda::CUDAStream stream(c10::DeviceIndex device) {
    const std::lock_guard<std::mutex> lock(guard);
    auto it = streams.find(device);
    if (it == streams.end()) {
      const c10::cuda::CUDAGuard on(device);
      cudaStream_t raw = nullptr;  // kept for the process
      C10_CUDA_CHECK(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));
      it = streams.emplace(device, c10::cuda::getStreamFromExternal(raw, device)).first;
    }
    return it->second;
  }
};

CaptureStreams& capture_streams() {
  static CaptureStreams streams;
  return streams;
}

c10::cuda::CUDAStream capture_stream(const at::Device& device) {
  return capture_streams().stream(device.index() < 0 ? c10::cuda::current_device() : device.index());
}

}  // namespace

std::unique_ptr<DecodeEngine::StepGraph> DecodeEngine::capture(const at::Tensor& inputs,
                                                               const std::function<at::Tensor(const at::Tensor&)>& run,
                                                               const char* what) {
  // A step or a feed is idempotent (it rewrites the same slots with the same values), so the warm-up run
  // that cuBLAS and SDPA need before a capture leaves the state as one run would; the capture itself runs
  // nothing, and the caller's replay computes the output.
  const auto dev = valid_.device();
  const auto t0 = std::chrono::steady_clock::now();
  auto g = std::make_unique<StepGraph>();
  g->rows = cache_rows();
  g->slots = cache_.max_len;
  g->inputs = inputs.clone();
  stream_synchronize(dev);
  {
    const std::lock_guard<std::mutex> one_capture(capture_streams().capturing);
    c10::cuda::CUDAStreamGuard side(capture_stream(dev));
    const TunedGemmScope tuned(options_.switches.tuned_gemms);  // shapes tuned in the warm-up, used in the capture
    run(g->inputs);
    stream_synchronize(dev);
    // Thread-local capture: with train.async the update's thread keeps allocating and launching on its own
    // stream while this one captures, which a global capture would forbid.
    if (!any_graph()) graph_pool_ = at::cuda::graph_pool_handle();
    g->graph.capture_begin(graph_pool_, cudaStreamCaptureModeThreadLocal);
    const cuda::DependentLaunchScope dependent(options_.switches.dependent_launch);
    try {
      g->hidden = run(g->inputs);
    } catch (const std::exception& e) {
      try {
        g->graph.capture_end();  // leave the stream out of capture mode; the partial graph is dropped
      } catch (...) {
      }
      throw std::runtime_error(std::string("DecodeEngine: capturing the ") + what + " as a CUDA graph failed (" +
                               e.what() + "); rollout.cuda_graphs=false runs it eagerly");
    }
    g->graph.capture_end();
  }
  stream_synchronize(dev);
  ++graph_captures_;
  capture_s_ += seconds_since(t0);
  return g;
}

at::Tensor DecodeEngine::graph_step(const std::vector<int64_t>& packed, int64_t picks, at::Tensor& pick) {
  const auto dev = valid_.device();
  const int64_t Bc = cache_rows(), n_in = 3 * Bc + 1, span = step_span();
  at::Tensor in = to_device_async(packed, dev);  // (3 Bc + 1 + picks)
  pick = in.narrow(0, n_in, picks);
  auto& g = step_graphs_[span];
  replay(
      g, in.narrow(0, 0, n_in), span, [this, span](const at::Tensor& x) { return fixed_step(x, span); }, "decode step");
  return g->hidden;
}

bool DecodeEngine::replay(std::unique_ptr<StepGraph>& g, const at::Tensor& inputs, int64_t span,
                          const std::function<at::Tensor(const at::Tensor&)>& run, const char* what) {
  const bool captures = !g;
  if (g) {  // start() and compact() drop the graphs whenever the cache tensors change
    TORCH_CHECK(g->rows == cache_rows() && g->slots == cache_.max_len, "DecodeEngine: stale ", what, " graph");
    g->inputs.copy_(inputs);
  } else {
    g = capture(inputs, run, what);
  }
  timed_replay(*g, span);
  return captures;
}

void DecodeEngine::timed_replay(StepGraph& g, int64_t span) {
  if (!replay_clock_) replay_clock_ = std::make_unique<ReplayClock>();
  read_replays(/*wait=*/false);
  ReplayClock::Mark m;
  m.span = span;
  const auto stream = c10::cuda::getCurrentCUDAStream(valid_.device().index());
  m.begin.record(stream);
  g.graph.replay();
  m.end.record(stream);
  replay_clock_->marks.push_back(std::move(m));  // kept only once both events are recorded
}

at::Tensor DecodeEngine::graph_extend(const std::vector<int64_t>& packed, int64_t Eb, int64_t Kb, int64_t span,
                                      bool merged) {
  auto& g = (merged ? merged_graphs_ : feed_graphs_)[{Eb, Kb, span}];
  const bool captured = replay(
      g, to_device_async(packed, valid_.device()), -1,
      [this, Eb, Kb, span, merged](const at::Tensor& x) {
        return merged ? fixed_merged(x, Eb, Kb, span) : fixed_extend(x, Eb, Kb, span);
      },
      merged ? "merged pass" : "multi-token feed");
  feed_graph_captures_ += captured;
  return g->hidden;
}
#endif

bool DecodeEngine::any_graph() const {
  auto holds = [](const auto& graphs) {
    return std::any_of(graphs.begin(), graphs.end(), [](const auto& g) { return g.second != nullptr; });
  };
  return holds(step_graphs_) || holds(draw_graphs_) || holds(feed_graphs_) || holds(merged_graphs_) ||
         holds(verify_graphs_);
}

int64_t DecodeEngine::graph_pool_bytes() const {
  int64_t bytes = 0;
#ifdef RLT_HAVE_CUDA
  if (!any_graph()) return 0;
  const auto snapshot = c10::cuda::CUDACachingAllocator::snapshot(graph_pool_, /*include_traces=*/false);
  for (const auto& s : snapshot.segments) {
    if (s.owner_private_pool_id == graph_pool_) bytes += static_cast<int64_t>(s.total_size);
  }
#endif
  return bytes;
}

bool DecodeEngine::graphed() const {
#ifdef RLT_HAVE_CUDA
  return options_.switches.cuda_graphs && valid_.defined() && valid_.is_cuda();
#else
  return false;
#endif
}

void DecodeEngine::release(const std::vector<int64_t>& rows) {
  for (int64_t n : rows) {
    TORCH_CHECK(n >= 0 && n < int64_t(cache_row_.size()), "release: no sequence ", n);
    if (cache_row_[n] < 0) continue;
    seq_of_row_[cache_row_[n]] = -1;
    cache_row_[n] = -1;
  }
}

void DecodeEngine::drop_released_rows() {
  // Finished rows still cost a slot per step: drop them once they are half the cache. Not when steps
  // replay CUDA graphs: a step is launch-bound, so a dead row costs it little, while new cache tensors
  // cost a recapture (two forwards of host time); they go at the next reallocation.
  // With admits to come (or the next start(), keep_cache), released rows are kept for them.
  if (drops_released_rows()) compact(0, /*drop_released=*/true);
}

bool DecodeEngine::drops_released_rows() const {
  if (graphed() || reserve_rows_ > 0 || keep_rows_ > 0) return false;
  int64_t released = 0;
  for (int64_t s : seq_of_row_) released += s < 0;
  return released > 0 && 2 * released >= cache_rows();
}

bool DecodeEngine::step_compacts(bool span_step) const {
  return cache_.length + 1 > cache_.max_len || (span_step && options_.squeeze_holes && holes_cost_a_chunk());
}

void DecodeEngine::compact(int64_t need, bool drop_released, int64_t add_rows, int64_t min_len) {
  at::NoGradGuard no_grad;
  ++compactions_;
  ++stamp_;       // slots move: no run can be taken back
  struct Timed {  // adds the call's host seconds to compact_s_ on every return
    double& total;
    std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
    ~Timed() { total += seconds_since(t0); }
  } timed{compact_s_};
  const auto dev = valid_.device();
  const int64_t Bc = cache_rows(), L = cache_.length;
  auto lopts = at::TensorOptions().dtype(at::kLong).device(dev);
  std::vector<int64_t> alive;
  std::vector<uint8_t> is_alive(Bc);
  for (int64_t r = 0; r < Bc; ++r) {
    is_alive[r] = seq_of_row_[r] >= 0;
    if (is_alive[r]) alive.push_back(r);
  }
  // Each row's valid slots in order, first (a released row keeps none): sort slot numbers with holes
  // pushed past L. Over every row, for the in-place form; the reallocation keeps the live rows' part.
  at::Tensor v = valid_.narrow(1, 0, L) & at::tensor(is_alive).to(dev, at::kBool).view({Bc, 1});  // (Bc, L)
  at::Tensor n = v.sum(1);                                                                        // (Bc)
  const int64_t S = Bc > 0 ? n.max().item<int64_t>() : 0;
  at::Tensor slot = at::arange(L, lopts).view({1, L});
  at::Tensor order = std::get<0>(at::where(v, slot, slot + L).sort(/*dim=*/1)).narrow(1, 0, S);  // (Bc, S)
  at::Tensor keep = at::arange(S, lopts).view({1, S}) < n.view({Bc, 1});                         // (Bc, S)
  order = at::where(keep, order, at::zeros_like(order));
  // In place, when squeezing the holes frees enough (a sixteenth of the slots beyond what is needed): the
  // cache keeps its tensors, rows and shape, so every captured graph stays valid. A tool reply's feed
  // leaves holes in every other row; without this each compaction after feeds meant new tensors and
  // recaptured graphs. An in-place squeeze costs a gather of the cache (about 1 ms for Qwen2.5-0.5B at 64
  // x 800 slots on an H200), a recapture two forwards of host time (tens of ms).
  if (!drop_released && add_rows == 0 && min_len <= cache_.max_len && squeezes_in_place(S, need)) {
    cache_.squeeze_(order);
    valid_.zero_();
    valid_.narrow(1, 0, S).copy_(keep);
    return;
  }
  // A new cache of the live rows with room to grow: new tensors, so the graphs go. The added rows (for
  // admit) copy row 0's slots, all hidden: free rows, as a released row is.
  ++reallocations_;
  const int64_t B = static_cast<int64_t>(alive.size());
  add_rows = std::max(add_rows, std::max(reserve_rows_, keep_rows_) - B);  // free rows for admits, the next start
  const int64_t Bn = B + add_rows;
  TORCH_CHECK(Bn == 0 || Bc > 0, "compact: rows to add to a cache of none");
  std::vector<int64_t> from = alive;
  from.resize(Bn, 0);
  at::Tensor rows = at::tensor(from, at::kLong).to(dev);  // (B' + added)
  keep = keep.index_select(0, rows);
  keep.narrow(0, B, add_rows).zero_();
  order = order.index_select(0, rows);
  const int64_t least = std::max(S, min_len) + need;
  const int64_t len = grown_slots(least, least + std::max(options_.slot_chunk, S / 4));
  step_graphs_.clear();  // a graph reads the cache tensors it was captured with
  draw_graphs_.clear();
  feed_graphs_.clear();
  merged_graphs_.clear();
  verify_graphs_.clear();
  cache_ = cache_.regather(rows, order, len);  // the old cache leaves layer by layer as the new one fills
  valid_ = at::zeros({Bn, len}, at::TensorOptions().dtype(at::kBool).device(dev));
  valid_.narrow(1, 0, S).copy_(keep);
  std::vector<int64_t> seq_of_row(Bn, -1);
  for (int64_t r = 0; r < B; ++r) {
    seq_of_row[r] = seq_of_row_[alive[r]];
    cache_row_[seq_of_row[r]] = r;
  }
  seq_of_row_ = std::move(seq_of_row);
}

}  // namespace rlt
