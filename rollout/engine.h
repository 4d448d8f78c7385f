// What the rollout loop asks of a model: start S sequences from their prompts, then feed each sequence one
// token at a time and get its next-token logits. The loop (retool.h) decides which sequences are fed at
// a step: sequences waiting on a tool call are simply not fed, and the others go on, so a tool call
// never stalls the batch. New sequences may join while others run (admit), into the rows that finished
// ones released: the rollout's continuous batching under rollout.max_batch.
//
// DecodeEngine is the Transformer behind that interface, on one batched KV cache: every step writes one
// slot for every cache row; rows not fed that step write a slot that their attention mask hides. A run of
// several tokens (a tool's reply) enters in one forward over its rows only (extend). Holes are squeezed
// out (KvCache::gather) when the cache fills up, in place when that frees enough room, else into a new
// cache that drops finished rows and grows; without CUDA graphs finished rows also go once they are
// half the cache, unless rows are reserved for admits to come (reserve_rows). Memory follows the tokens actually held.
// On a GPU each decode step replays a CUDA graph captured for the cache's current shape
// (EngineSwitches::cuda_graphs). An admitted prompt is prefilled apart and its keys and values are copied into
// released rows, at slots [0, Lp), in place: the cache keeps its tensors and its captured graphs.
//
// Shapes (docs/glossary.md): S sequences, Bc rows in the cache (the live sequences, and released rows not yet dropped
// or refilled), C slots, Lp a prompt's length, V vocab.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "model/transformer.h"
#include "rollout/sampler.h"

namespace rlt {

class TokenPolicy {
 public:
  virtual ~TokenPolicy() = default;
  // Starts S = prompts.size() * repeats sequences, dropping any held before; prompt i occupies rows
  // [i * repeats, (i + 1) * repeats). Returns the logits of each sequence's first new token (S, V).
  virtual at::Tensor start(const std::vector<std::vector<int64_t>>& prompts, int64_t repeats) = 0;
  // Starts S' = prompts.size() * repeats more sequences while the others run: their ids continue after
  // the last one started (first = sequences so far), prompt i occupying [first + i * repeats,
  // first + (i + 1) * repeats). Returns their first-token logits (S', V). An engine that cannot throws (the
  // default): the rollout calls it only with rollout.max_batch set.
  virtual at::Tensor admit(const std::vector<std::vector<int64_t>>& prompts, int64_t repeats);
  // Appends tokens[j] to sequence rows[j] (rows distinct) and returns their next-token logits (rows.size(), V).
  virtual at::Tensor step(const std::vector<int64_t>& rows, const std::vector<int64_t>& tokens) = 0;
  // step(), then the draw of each listed row's next token as sample_tokens makes it, the noise from
  // row_keys (rows.size()) int64 on the CPU (sample_row_keys of each row's stream and counter). The default
  // draws from step()'s logits; DecodeEngine's graphed steps draw inside the step's CUDA graph
  // (EngineSwitches::graph_draw). next_keys (rows.size(), or undefined) are the rows' keys for the step
  // after, should each be fed the token it draws now: an engine may start that step before returning
  // (EngineSwitches::step_ahead); the default ignores them.
  virtual SampleOutput step_draw(const std::vector<int64_t>& rows, const std::vector<int64_t>& tokens,
                                 const SamplingOptions& sampling, const at::Tensor& row_keys, int64_t vocab_limit,
                                 const at::Tensor& next_keys = at::Tensor());
  // Appends runs[j] (one or more tokens: tool output, the template's framing) to sequence rows[j] (rows
  // distinct) and returns the logits after each run's last token (rows.size(), V). The default feeds the
  // runs through step(), one token per call; DecodeEngine takes them in one forward.
  virtual at::Tensor extend(const std::vector<int64_t>& rows, const std::vector<std::vector<int64_t>>& runs);
  // A speculative rollout's verifying forward (rollout.speculative): extend(), with the logits after every
  // token of every run, run after run: (sum of the runs' lengths, V). The default feeds one token per step().
  virtual at::Tensor extend_each(const std::vector<int64_t>& rows, const std::vector<std::vector<int64_t>>& runs);
  // extend_each(), then the draw of every position's token as sample_tokens makes it, the noise from keys
  // (positions) int64 on the CPU, run after run. The default draws from extend_each()'s logits;
  // DecodeEngine's graphed verifying forwards draw inside the forward's CUDA graph (graph_draw).
  virtual SampleOutput extend_each_draw(const std::vector<int64_t>& rows, const std::vector<std::vector<int64_t>>& runs,
                                        const SamplingOptions& sampling, const at::Tensor& keys, int64_t vocab_limit);
  // Takes back the last counts[j] (>= 0) tokens of sequence rows[j]'s run in the latest extend_each, before
  // any other call (a draft's rejected tokens): they leave the sequence's context, and its next token takes
  // the first one's position. An engine that cannot throws (the default).
  virtual void retract(const std::vector<int64_t>& rows, const std::vector<int64_t>& counts);
  // Sequences that will not be fed again; their memory may be reclaimed, or taken by admitted ones.
  virtual void release(const std::vector<int64_t>& rows) {}
  // A hint from a caller that will admit more sequences: keep room for `rows` sequences held at once when
  // memory is reorganised, so that admits find free rows in place (0: no more admits coming). It stays
  // set across start(); rollout() sets it at its start and clears it when it returns or throws.
  virtual void reserve_rows(int64_t rows) {}
  virtual int64_t vocab_size() const = 0;

 protected:
  // The defaults' forward: each run fed one token per step(), the logits after each run's last token
  // (rows.size(), V) or, with each, after every token, run after run (sum of the runs' lengths, V).
  at::Tensor step_runs(const std::vector<int64_t>& rows, const std::vector<std::vector<int64_t>>& runs, bool each);
};

// The engine's switches, shared by the rollout's options (rollout.<name>, RolloutOptions::engine) and the
// engine's own (EngineOptions::switches): each default and description is written here once.
struct EngineSwitches {
  // On a CUDA device, each decode step replays a captured CUDA graph: a step of a 0.5B model is a few
  // hundred small kernels, whose launches, not the GPU, set its time. The graph is captured once per
  // cache tensors: again after each growth (a reallocation), not after an in-place squeeze. Ignored on
  // the CPU.
  bool cuda_graphs = true;
  // The cache forwards' fused CUDA kernels (model/cuda/decode_kernels.h, with the model's own switch,
  // Transformer::set_fused_kernels); off: the ATen forms. Ignored on the CPU.
  bool fused_kernels = true;
  // With fused_kernels on a GPU: the q/k/v and gate/up weights packed into one matrix each for the
  // engine's lifetime (Transformer::pack_weights), one GEMM per group. Costs those weights' size again
  // while the engine lives (0.47 GB for Qwen2.5-0.5B in bf16).
  bool packed_weights = true;
  // With fused_kernels on a GPU (bf16/fp16, head size 64 or 128): a step's attention reads each row's
  // cache in place up to the step's slot, split over the keys (cuda::cache_attention, as feeds do), so its
  // cost follows the rows' contexts. Off: SDPA over the step's whole span (cuDNN in a captured step).
  bool cache_attention = true;
  // With cuda_graphs on a GPU: step_draw's LM head, draw and log-probs run inside the step's CUDA graph,
  // over every cache row, and one copy brings the ids and log-probs to the host. Off: the graph ends at
  // the hidden states, and the head and the draw run eagerly over the fed rows.
  bool graph_draw = true;
  // With cuda_graphs on a Hopper GPU: the captured graphs join each fused kernel to the kernel before it
  // (where that is a kernel) by a programmatic edge (programmatic dependent launch, common/cuda/launch.h),
  // so that it is resident and waiting when its predecessor ends instead of launching after it. Off: plain
  // edges.
  bool dependent_launch = true;
  // With graph_draw (graphed on a GPU, or fixed_shape_step): when step_draw is given the next step's keys,
  // it starts that step, each row fed the token it just drew, before it reads the draw back, so the host's
  // turn between steps (reading the ids, the next inputs, the graph's launch) overlaps the GPU's work. The
  // next step_draw takes it when its rows are among those rows, fed those tokens with those keys, and
  // nothing else came between; a row left out becomes a hole, as a row not fed does. Anything else
  // (a feed, an admit, other rows) drops it: its slot is written again. The draws are the same either way.
  bool step_ahead = true;
  // With cuda_graphs on a GPU: the captured forwards' bf16 GEMMs (the projections and the MLP, not the LM
  // head) go through cuBLASLt with the algorithm timed fastest for their shape (model/tuned_gemm.h), each
  // shape tuned in the warm-up run before its first capture. The choice rests on timing, so runs (a resumed
  // one, another rank) may round differently. Off: ATen's at::linear, cuBLAS's heuristic.
  bool tuned_gemms = false;
  // On (with cuda_graphs, on a GPU): extend() replays a CUDA graph per (rows, tokens) bucket and span
  // (the slots filled and the feed's, rounded up to span_chunk), captured once per bucket and cache tensors. Off by
  // default: a capture costs two forwards' host time (~35 ms on an H200), and within one rollout of the ReTool
  // loop the captures cost about what the replays save (docs/benchmarks.md, the tools loop: spread_graphs).
  // Worth it once caches outlive a rollout.
  bool feed_graphs = false;
  // Keep the cache's tensors and the captured CUDA graphs from one start() to the next (one rollout to the
  // next), when the new prompts need no more rows or slots than the cache has and the model's parameters
  // are the same tensors (updated in place, as the trainer's optimizer does): start() then places them
  // into its free rows in place (the admit() path) and every graph replays at once, with no capture.
  // Costs holding the cache and the graphs' memory pools between rollouts (through a policy update, in the
  // trainer). The packed weights are packed again, in place, at every start(). Off: start() drops them.
  bool keep_cache = false;

  template <class V>
  void visit(V&& v) {
    v("cuda_graphs", cuda_graphs, "replay each decode step from a CUDA graph (GPU only)");
    v("fused_kernels", fused_kernels, "fused CUDA kernels in the rollout's forwards (false: ATen forms; GPU only)");
    v("packed_weights", packed_weights,
      "one GEMM for q/k/v and one for gate/up during the rollout (GPU; costs those weights' size again)");
    v("cache_attention", cache_attention,
      "a decode step attends over each row's cache in place, split over the keys (false: SDPA over the span; GPU)");
    v("graph_draw", graph_draw,
      "a graphed decode step also runs the LM head and the draw of the next tokens inside its graph (GPU only)");
    v("dependent_launch", dependent_launch,
      "the captured graphs launch each fused kernel while the kernel before it ends (Hopper GPUs)");
    v("step_ahead", step_ahead,
      "a graphed decode step starts the next one on the ids it drew before the host reads them (GPU only)");
    v("tuned_gemms", tuned_gemms,
      "captured steps' projection GEMMs take cuBLASLt's algorithm timed fastest for their shape (GPU only)");
    v("feed_graphs", feed_graphs, "multi-token feeds replay CUDA graphs per (rows, tokens) bucket and span (GPU only)");
    v("keep_cache", keep_cache,
      "the rollout's KV cache and CUDA graphs outlive each step (no recapture; held through the update)");
  }
};

struct EngineOptions {
  EngineSwitches switches;
  int64_t slot_chunk = 256;  // cache slots added at least when it grows
  // The most slots a row's cache grows to (rollout.max_context: no sequence holds more), unless a step
  // needs more; at this size a compaction squeezes the holes in place whatever it frees. The memory plan
  // counts the cache at this size. 0: no bound (a growth adds a quarter or slot_chunk, whichever is more).
  int64_t max_slots = 0;
  // A new cache's slots are a multiple of this. A step's span can end at the cache's last slot, and a span
  // of odd length costs the graphed step's attention (cuDNN, masked) 12-22% on an H200: 1.83-2.0 ms a step
  // at 737-969 slots against 1.64 ms at 962-984 (bench_rollout's step_gpu_by_span).
  int64_t slot_align = 64;
  // A graphed step attends over the slots in use (the filled ones and the one it writes) rounded up to a
  // multiple of this, not over every slot of the cache: one step graph per such span and cache tensors.
  // A cache kept from an earlier rollout (keep_cache), or grown ahead, is then read only as far as it
  // is filled. 0: every slot, one step graph per cache tensors.
  int64_t span_chunk = 256;
  // Holes (tool replies' feeds pad every other row; rows waiting on a tool skip steps) make the slots in
  // use outgrow what the rows hold, and a step reads its whole span: with span_chunk, a step first squeezes
  // the holes out in place (the graphs stay) once that lowers its span by a chunk or more. Off: the holes
  // go only when the cache is full.
  bool squeeze_holes = true;
  // step() at the graphs' fixed shape (write slot on the device, attention over the span) also without
  // graphs (on the CPU: the tests check that form against the full forward).
  bool fixed_shape_step = false;
  // The tests' wrong twin of step_ahead: false leaves a row that a taken step leaves out marked as fed in
  // that step's slot, so its next forwards see what the step wrote there. Always true otherwise.
  bool ahead_holes = true;
  // Off: the engine's eager forwards (prefill, feeds, steps without graphs) keep attention off cuDNN
  // (NoCudnnAttention), whose per-shape plans cost ~40 ms each, and their shapes change every call.
  // Captured steps keep cuDNN: their plan is built once per capture.
  bool cudnn_attention = false;
  // extend() at the bucketed fixed shape that the CUDA graphs capture, also without graphs (on the CPU:
  // the tests check that form against the full forward). With feed_graphs (and cuda_graphs) on a GPU it
  // is always used.
  bool fixed_shape_extend = false;
};

// The positions a verifying forward (DecodeEngine::extend_each_draw) of `rows` rows, with runs of up to
// `tokens` (<= 8) tokens, runs at on a GPU: its bucket, rows to a power of two of at least 8 and at most
// cache_rows, times the run to 2, 4 or 8. Its graph draws at every one of them.
int64_t verify_bucket_positions(int64_t rows, int64_t tokens, int64_t cache_rows);

class DecodeEngine : public TokenPolicy {
 public:
  DecodeEngine(const Transformer& model, EngineOptions options = {});
  ~DecodeEngine() override;
  // A new cache holding the prompts' prefill, every captured graph dropped: admit() on an empty engine.
  // With keep_cache, when the cache has the rows and slots (and the parameters are the same tensors):
  // every sequence held is released, and the prompts go into the cache's rows in place (admit()).
  at::Tensor start(const std::vector<std::vector<int64_t>>& prompts, int64_t repeats) override;
  // One prefill of the prompts (the G samples of a prompt share it), whose keys and values go into cache
  // rows that released sequences left, at slots [0, Lp) (Lp: the longest new prompt, left-padded), in place:
  // the rows' other slots are hidden (valid_), the cache's tensors and graphs stay; the RoPE positions of
  // a new sequence start at 0 whatever its slots. When fewer rows are free than new sequences, or the
  // cache has fewer than P slots, a new cache of the live rows and the new ones (compact). With an empty
  // cache, the prefill's rows are the cache, as at start().
  at::Tensor admit(const std::vector<std::vector<int64_t>>& prompts, int64_t repeats) override;
  at::Tensor step(const std::vector<int64_t>& rows, const std::vector<int64_t>& tokens) override;
  // With graph_draw, in a graphed (or fixed-shape) step: the step, the LM head over every cache row and the
  // draw (draw_tokens) in one CUDA graph per span and sampling options; rows not fed draw a token nobody
  // reads. Otherwise TokenPolicy's.
  SampleOutput step_draw(const std::vector<int64_t>& rows, const std::vector<int64_t>& tokens,
                         const SamplingOptions& sampling, const at::Tensor& row_keys, int64_t vocab_limit,
                         const at::Tensor& next_keys = at::Tensor()) override;
  // step_draw's steps started ahead (EngineSwitches::step_ahead): taken by the next step_draw, and dropped.
  int64_t steps_ahead_taken() const { return ahead_taken_; }
  int64_t steps_ahead_dropped() const { return ahead_dropped_; }
  // One forward over the listed rows only (KvCache::step_rows): K = the longest run's slots are added to
  // the cache, the shorter runs and the rows not listed leave holes there. With feed_graphs on a GPU, the
  // feed runs at a bucketed shape (rows to a power of two of at least 8, K to a multiple of 8 of at least
  // 16 up to 64, then a power of two; 2, 4 or 8 for a verifying forward's runs: fixed_extend) over the span in use,
  // whose CUDA graph is captured once per bucket, span and cache tensors and replayed.
  at::Tensor extend(const std::vector<int64_t>& rows, const std::vector<std::vector<int64_t>>& runs) override;
  // extend()'s forward (never the merged pass), every position's logits. With cuda_graphs on a GPU it
  // replays extend()'s bucketed graphs whatever feed_graphs says: a verifying forward is a decode step's
  // size, not a reply's.
  at::Tensor extend_each(const std::vector<int64_t>& rows, const std::vector<std::vector<int64_t>>& runs) override;
  // With graph_draw, at the fixed shape (graphed on a GPU, or fixed_shape_extend): the forward, the LM head
  // over every position of the bucket and the draw in one CUDA graph per bucket, span and sampling options,
  // one copy to the host. Otherwise TokenPolicy's.
  SampleOutput extend_each_draw(const std::vector<int64_t>& rows, const std::vector<std::vector<int64_t>>& runs,
                                const SamplingOptions& sampling, const at::Tensor& keys, int64_t vocab_limit) override;
  // The taken-back slots become holes (valid_), squeezed out as a reply's padding is.
  void retract(const std::vector<int64_t>& rows, const std::vector<int64_t>& counts) override;
  void release(const std::vector<int64_t>& rows) override;
  // A reallocation (a growing compaction) makes at least this many rows: the live ones, then free rows
  // (all slots hidden), so the next admit needs no new cache (and no recapture). Without graphs, released
  // rows are not dropped at half the cache while it is set.
  void reserve_rows(int64_t rows) override { reserve_rows_ = rows; }
  int64_t vocab_size() const override { return model_.config().vocab_size; }
  const Transformer& model() const { return model_; }

  // Cache slots allocated now and at most so far (for tests and memory reports), and filled now.
  int64_t cache_slots() const { return cache_.max_len; }
  int64_t cache_length() const { return cache_.length; }
  int64_t cache_rows() const { return cache_.k.empty() ? 0 : cache_.k[0].size(0); }
  int64_t compactions() const { return compactions_; }
  // Cache slots the graphed (or fixed-shape) steps attended over, summed over the steps: its mean is the
  // span a step read.
  int64_t step_span_slots() const { return step_span_slots_; }
  // The same for the fixed-shape (graphed) feeds: the slots each attended over, summed.
  int64_t feed_span_slots() const { return feed_span_slots_; }
  // Of them, those that made new cache tensors (dropping released rows, growing); the others squeezed
  // the holes out in place, keeping every captured graph.
  int64_t reallocations() const { return reallocations_; }
  // CUDA graphs captured so far (0 on the CPU or with cuda_graphs off).
  int64_t graph_captures() const { return graph_captures_; }
  int64_t feed_graph_captures() const { return feed_graph_captures_; }  // of them, extend()'s and extend_each_draw()'s
  // extend() calls that ran as one merged pass (a step and a feed in one forward; merged_extend).
  int64_t merged_passes() const { return merged_passes_; }
  // Host seconds spent capturing them (the warm-up run and the capture, synchronised), step and feed graphs.
  double capture_seconds() const { return capture_s_; }
  // Host seconds in compactions (in-place squeezes and reallocations; each reads a count back, so the time
  // includes the device's work).
  double compact_seconds() const { return compact_s_; }
  // Device time of the replayed graphs, from CUDA events around each replay: the graphed decode steps by
  // span (slots read; steps started ahead and dropped included), and the graphed feeds. Where a step's wall time
  // exceeds its device time, the host (dispatch, the LM head outside the graph, other processes) set the pace. Empty on
  // the CPU.
  struct ReplayTime {
    int64_t count = 0;
    double seconds = 0;
  };
  const std::map<int64_t, ReplayTime>& step_replay_times();  // span -> steps, device seconds
  ReplayTime feed_replay_time();
  // Device bytes the memory pool of the captured graphs reserves now (its segments: every graph's
  // intermediates, which the graphs share), 0 while no graph lives or on the CPU.
  int64_t graph_pool_bytes() const;

 private:
  struct StepGraph;    // a captured decode step and its input/output buffers (CUDA builds)
  struct ReplayClock;  // CUDA events around the replays, read once they have completed (CUDA builds)

  // Squeezes holes out, in place when that frees a sixteenth of the slots beyond `need` (and released rows
  // need not go, nor rows be added); otherwise makes a new cache of the live rows, then
  // max(add_rows, reserve_rows - live) free rows (for admit), with room for at least `need` more slots and at least
  // min_len slots in all.
  void compact(int64_t need, bool drop_released = false, int64_t add_rows = 0, int64_t min_len = 0);
  // Without CUDA graphs and with no rows reserved, drops the released rows once they are half the cache
  // (called before a forward, not by release(): the rollout refills released rows right after releasing
  // them).
  void drop_released_rows();
  bool drops_released_rows() const;  // whether drop_released_rows() would drop them now
  // Whether a step (span_step: a graphed or fixed-shape one) first compacts: no slot left, or the holes
  // cost its span a chunk.
  bool step_compacts(bool span_step) const;
  bool graphed() const;  // steps replay CUDA graphs
  // keep_cache: empties the cache for start() in place (every row free, nothing filled, the graphs kept)
  // when it has S rows and Lp slots and the parameters are still the tensors it was built on; else false.
  bool reuse_cache(int64_t N, int64_t P);
  std::vector<const void*> parameter_storage() const;
  // One decode step at a fixed shape (mask over slots [0, span), write slot on the device), the form a
  // CUDA graph captures. inputs (3 Bc + 1) int64 on the device: ids, positions, fed (0/1) per cache row,
  // then the slot. Returns the hidden states (Bc, D).
  at::Tensor fixed_step(const at::Tensor& inputs, int64_t span);
  // fixed_step, then the LM head over every cache row and the draw: inputs are fixed_step's, then each cache
  // row's noise key (Bc). Returns the packed draw (2, Bc) (pack_draw).
  at::Tensor fixed_step_draw(const at::Tensor& inputs, int64_t span, const SamplingOptions& sampling,
                             int64_t vocab_limit);
  // The host side of a step: the rows checked (each held, none twice), room made in the cache, and each
  // cache row's token, position and fed flag, with `pick` the cache row of each listed sequence.
  struct StepPlan {
    std::vector<int64_t> ids, pos, pick;
    std::vector<uint8_t> fed;
  };
  StepPlan plan_step(const std::vector<int64_t>& rows, const std::vector<int64_t>& tokens, bool span_step);
  // fixed_step's inputs (3 Bc + 1) of a plan: ids, positions, fed flags, then the slot written.
  std::vector<int64_t> fixed_step_inputs(const StepPlan& plan) const;
  // The step's bookkeeping once it ran: each fed sequence one token longer.
  void advance_step(const std::vector<int64_t>& rows);
  // A step started ahead by step_draw (EngineSwitches::step_ahead): it feeds `rows` (sequences) the tokens
  // `ids` with noise keys `keys`, at slot `slot` over `span`, drawn with the options `draw_key`; `draw` is
  // its packed draw on the device (the step graph's output), `host` the copy on its way to the host, and
  // `ready` marks the copy's end (CUDA builds).
  struct Ahead;
  std::unique_ptr<Ahead> ahead_;
  int64_t ahead_taken_ = 0, ahead_dropped_ = 0;
  // The step a normal step_draw would make next is free of host-side changes to the cache: no released
  // rows dropped, no compaction, the step's span `span`, and (graphed) its graph captured for these draw
  // options.
  bool steps_unchanged(int64_t span, const SamplingOptions& sampling, int64_t vocab_limit) const;
  // Starts the step after the one that drew `draw` (packed, on the device): every row of `plan` fed again,
  // its drawn token, the keys `next_keys`. The caller has advanced the positions and the slot.
  void start_ahead(const StepPlan& plan, const std::vector<int64_t>& rows, const at::Tensor& draw,
                   const at::Tensor& next_keys, const SamplingOptions& sampling, int64_t vocab_limit);
  // The step started ahead as this step_draw's, if it is one (its rows among the started ones, the same
  // tokens, keys and options, nothing changed since): the rows left out become holes, the bookkeeping of
  // a step is done, and *plan holds the step's; false (and nothing done) otherwise.
  bool take_ahead(const std::vector<int64_t>& rows, const std::vector<int64_t>& tokens, const at::Tensor& keys,
                  const SamplingOptions& sampling, int64_t vocab_limit, StepPlan* plan);
  // step_draw's inputs on the device: fixed_step_inputs(p), then each cache row's noise key, keys[j] at
  // p.pick[j] (0 for the rows not fed: their draw is dropped).
  at::Tensor draw_inputs(const StepPlan& p, const int64_t* keys) const;
  // A step with its draw on `inputs` (draw_inputs) over `span`: graphed, the span's graph for these draw
  // options replayed (captured first when it has none), else fixed_step_draw eagerly. Returns the packed draw (2, Bc).
  at::Tensor run_draw(const at::Tensor& inputs, int64_t span, const SamplingOptions& sampling, int64_t vocab_limit);
  // Drops a step started ahead, if any: its slot is not filled (valid_ cleared there). Every call that
  // forwards, moves the cache or starts sequences drops it first.
  void drop_ahead();
  // The slots the next step attends over: the filled ones and the one it writes, rounded up to a multiple
  // of options_.span_chunk (at most max_len; span_chunk 0: max_len).
  int64_t step_span() const;
  int64_t span_of(int64_t slots) const;        // `slots` rounded up to span_chunk, at most max_len
  int64_t aligned_slots(int64_t slots) const;  // `slots` rounded up to slot_align: a new cache's length
  // A new cache's slots: `wanted`, at most options_.max_slots, at least `least`; aligned.
  int64_t grown_slots(int64_t least, int64_t wanted) const;
  // Whether compact() squeezes in place (keeping the tensors and graphs) when the rows fill at most
  // `filled` slots and `need` more are wanted: it frees a sixteenth of the slots beyond them (any room,
  // at options_.max_slots).
  bool squeezes_in_place(int64_t filled, int64_t need) const;
  // Whether squeezing the holes out (in place) would lower step_span() by span_chunk or more.
  bool holes_cost_a_chunk() const;
  // The graph path of step() (CUDA builds): copies the packed host inputs (fixed_step's, then the rows to
  // pick) in, captures a graph when the cache changed, replays it. Returns the hidden states (Bc, D) and,
  // through `pick`, the picked rows on the device.
  at::Tensor graph_step(const std::vector<int64_t>& packed, int64_t picks, at::Tensor& pick);
  // A feed at a fixed shape: Eb rows x Kb tokens written at slots [L, L + Kb) of the listed rows (the slot
  // and rows on the device), attention over slots [0, span) (span >= L + Kb). inputs (3 Eb Kb + Eb + 1) int64
  // on the device: ids, positions, fed (0/1), each (Eb, Kb) row-major, then the cache rows, then L. Returns
  // (Eb Kb, D).
  at::Tensor fixed_extend(const at::Tensor& inputs, int64_t Eb, int64_t Kb, int64_t span);
  // A feed's slots (Kb) in valid_: holes for every row, then fed (Eb, Kb) for the rows (Eb) it lists.
  void mark_feed_slots(const at::Tensor& rows, const at::Tensor& slots, const at::Tensor& fed);
  // extend() and extend_each(): each, every position's logits. With draw (a verifying forward's draw, at
  // the fixed shape), the draw of every position into *drawn instead (the logits returned undefined).
  struct FeedDraw {
    const SamplingOptions* sampling = nullptr;
    at::Tensor keys;  // (positions) int64 on the CPU, run after run
    int64_t vocab_limit = 0;
  };
  at::Tensor feed(const std::vector<int64_t>& rows, const std::vector<std::vector<int64_t>>& runs, bool each,
                  const FeedDraw* draw = nullptr, SampleOutput* drawn = nullptr);
  // fixed_extend, then the LM head over all Eb Kb positions and their draw: inputs are fixed_extend's, then
  // each position's noise key (Eb Kb). Returns the packed draw (2, Eb Kb) (pack_draw).
  at::Tensor fixed_extend_draw(const at::Tensor& inputs, int64_t Eb, int64_t Kb, int64_t span,
                               const SamplingOptions& sampling, int64_t vocab_limit);
  // Sequence n's latest run: its slots [first, first + count) in the cache as it was after forward `stamp`
  // (retract's bookkeeping).
  void note_run(int64_t n, int64_t first, int64_t count);
  // extend() with runs of one token beside longer ones, on a GPU with feed graphs (CUDA builds): one merged
  // pass (Transformer::forward_mixed), the one-token rows as a step at slot L and the longer runs as a feed
  // at slots [L + 1, L + 1 + Kb) in the feed's buckets, replayed from a graph per (Eb, Kb, span).
  at::Tensor merged_extend(const std::vector<int64_t>& rows, const std::vector<std::vector<int64_t>>& runs);
  // Its fixed-shape form. inputs: the step's (fixed_step's 3 Bc + 1), then the feed's ids, positions and fed
  // (Eb Kb each) and rows (Eb). Returns (Bc + Eb Kb, D).
  at::Tensor fixed_merged(const at::Tensor& inputs, int64_t Eb, int64_t Kb, int64_t span);
  // The graph path of extend() (CUDA builds): one graph per (Eb, Kb, span) for the current cache, of
  // fixed_extend or (merged) of fixed_merged.
  at::Tensor graph_extend(const std::vector<int64_t>& packed, int64_t Eb, int64_t Kb, int64_t span,
                          bool merged = false);
  // Replays g between two CUDA events; span: the step's, or -1 for a feed (CUDA builds).
  void timed_replay(StepGraph& g, int64_t span);
  // Copies `inputs` into g's input buffer and replays it (timed_replay), capturing `run` on them first when
  // g is empty (`what` names it in errors); returns whether it captured (CUDA builds).
  bool replay(std::unique_ptr<StepGraph>& g, const at::Tensor& inputs, int64_t span,
              const std::function<at::Tensor(const at::Tensor&)>& run, const char* what);
  // Adds the device time of the replays whose events have completed (wait: of every replay) to
  // step_replay_ and feed_replay_.
  void read_replays(bool wait);
  // Captures `run` on `inputs` (a copy kept as the graph's input buffer) after one warm-up run. Every graph
  // is captured on one stream into one memory pool, so a graph's output may lie in memory another graph's
  // replay reuses: each caller reads (or enqueues its read of) a replay's output before the next replay.
  std::unique_ptr<StepGraph> capture(const at::Tensor& inputs, const std::function<at::Tensor(const at::Tensor&)>& run,
                                     const char* what);

  const Transformer& model_;
  EngineOptions options_;
  PackedWeights packed_;       // when options_.switches.packed_weights applies: the cache's forwards read it
  bool packed_fresh_ = false;  // packed_ holds the weights as they are (just packed)
  std::vector<const void*> cache_params_;  // parameter_storage() when the cache was made (keep_cache)
  KvCache cache_;
  at::Tensor valid_;                 // (Bc, C) bool on the model's device: slot holds a token of the row
  std::vector<int64_t> cache_row_;   // (S) sequence -> cache row, -1 once released
  std::vector<int64_t> seq_of_row_;  // (Bc) cache row -> sequence, -1 once released
  std::vector<int64_t> length_;      // (S) tokens held per sequence = the next token's RoPE position
  // Moves of the cache's slots (forwards, compactions) so far, and each sequence's latest run: the forward
  // it was fed in, its first slot and its tokens (note_run, for retract).
  int64_t stamp_ = 0;
  struct FedRun {
    int64_t stamp = -1, first = 0, count = 0;
  };
  std::vector<FedRun> fed_runs_;
  int64_t compactions_ = 0, reallocations_ = 0, step_span_slots_ = 0, feed_span_slots_ = 0;
  int64_t reserve_rows_ = 0;  // reserve_rows()
  int64_t keep_rows_ = 0;     // keep_cache: the rows the cache was made with, kept through reallocations
  // CUDA builds: the memory pool the engine's graphs are captured into, one while any graph lives (a new
  // one once none does: a pool whose graphs are all gone is released). The graphs replay one at a time
  // and each output is read before the next replay, so they can share it; a pool each reserves a segment
  // each (under expandable segments, address space the size of the device), and a speculative rollout's
  // verifying buckets ran out of it.
  std::pair<unsigned long long, unsigned long long> graph_pool_{0, 0};
  bool any_graph() const;                                      // a captured graph lives
  std::map<int64_t, std::unique_ptr<StepGraph>> step_graphs_;  // span -> step graph (of the current cache)
  std::map<int64_t, std::unique_ptr<StepGraph>> draw_graphs_;  // span -> step_draw's graph (of the current cache)
  std::array<double, 4> draw_key_{};  // the temperature, top-k, top-p and vocabulary limit draw_graphs_ hold
  std::map<std::array<int64_t, 3>, std::unique_ptr<StepGraph>> feed_graphs_;    // (Eb, Kb, span) -> feed graph
  std::map<std::array<int64_t, 3>, std::unique_ptr<StepGraph>> merged_graphs_;  // (Eb, Kb, span) -> merged pass
  std::map<std::array<int64_t, 3>, std::unique_ptr<StepGraph>> verify_graphs_;  // (Eb, Kb, span) -> feed and draw
  std::array<double, 4> verify_key_{};  // the sampling options verify_graphs_ hold (as draw_key_)
  int64_t merged_passes_ = 0;
  int64_t graph_captures_ = 0, feed_graph_captures_ = 0;
  double capture_s_ = 0, compact_s_ = 0;
  std::unique_ptr<ReplayClock> replay_clock_;
  std::map<int64_t, ReplayTime> step_replay_;  // span -> graphed steps' device time, read so far
  ReplayTime feed_replay_;
};

}  // namespace rlt
