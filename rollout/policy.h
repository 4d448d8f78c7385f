// What the rollout loop asks of a model: start N sequences from their prompts, then feed each sequence one
// token at a time and get its next-token logits. The loop (retool.h) decides which sequences are fed at
// a step: sequences waiting on a tool call are simply not fed, and the others go on, so a tool call
// never stalls the batch.
//
// ModelPolicy is the Transformer behind that interface, on one batched KV cache: every step writes one
// slot for every cache row; rows not fed that step write a slot that their attention mask hides. A run of
// several tokens (a tool's reply) enters in one forward over its rows only (extend). Holes
// and finished rows are squeezed out (KvCache::gather) when the cache fills up or half its rows are
// finished, and the cache grows on demand, so memory follows the tokens actually held. On a GPU each
// decode step replays a CUDA graph captured for the cache's current shape (ModelPolicyOptions::cuda_graphs).
//
// Shapes: N sequences, Bc rows in the cache (N minus released rows, after compaction), S slots, V vocab.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "model/transformer.h"

namespace rlt {

class TokenPolicy {
 public:
  virtual ~TokenPolicy() = default;
  // Starts N = prompts.size() * repeats sequences; prompt i occupies rows [i * repeats, (i + 1) * repeats).
  // Returns the logits of each sequence's first new token (N, V).
  virtual at::Tensor start(const std::vector<std::vector<int64_t>>& prompts, int64_t repeats) = 0;
  // Appends tokens[j] to sequence rows[j] (rows distinct) and returns their next-token logits (rows.size(), V).
  virtual at::Tensor step(const std::vector<int64_t>& rows, const std::vector<int64_t>& tokens) = 0;
  // Appends runs[j] (one or more tokens: tool output, the template's framing) to sequence rows[j] (rows
  // distinct) and returns the logits after each run's last token (rows.size(), V). The default feeds the
  // runs through step(), one token per call; ModelPolicy takes them in one forward.
  virtual at::Tensor extend(const std::vector<int64_t>& rows, const std::vector<std::vector<int64_t>>& runs);
  // Sequences that will not be fed again; their memory may be reclaimed.
  virtual void release(const std::vector<int64_t>& rows) {}
  virtual int64_t vocab_size() const = 0;
};

struct ModelPolicyOptions {
  int64_t slot_chunk = 256;  // cache slots added at least when it grows
  // On a CUDA device, each decode step replays a captured CUDA graph: a step of a 0.5B model is a few
  // hundred small kernels, whose launches, not the GPU, set its time. The graph is captured once per
  // cache shape (rows x slots), so again after each compaction or growth. Ignored on the CPU.
  bool cuda_graphs = true;
};

class ModelPolicy : public TokenPolicy {
 public:
  ModelPolicy(const Transformer& model, ModelPolicyOptions options = {});
  ~ModelPolicy() override;
  at::Tensor start(const std::vector<std::vector<int64_t>>& prompts, int64_t repeats) override;
  at::Tensor step(const std::vector<int64_t>& rows, const std::vector<int64_t>& tokens) override;
  // One forward over the listed rows only (KvCache::step_rows): K = the longest run's slots are added to
  // the cache, the shorter runs and the rows not listed leave holes there. Eager, also on a GPU: a feed's
  // shape changes with every tool reply, so no graph would be replayed twice.
  at::Tensor extend(const std::vector<int64_t>& rows, const std::vector<std::vector<int64_t>>& runs) override;
  void release(const std::vector<int64_t>& rows) override;
  int64_t vocab_size() const override { return model_.config().vocab_size; }

  // Cache slots allocated now and at most so far (for tests and memory reports).
  int64_t cache_slots() const { return cache_.max_len; }
  int64_t cache_rows() const { return cache_.k.empty() ? 0 : cache_.k[0].size(0); }
  int64_t compactions() const { return compactions_; }
  // CUDA graphs captured so far (0 on the CPU or with cuda_graphs off).
  int64_t graph_captures() const { return graph_captures_; }

 private:
  struct StepGraph;  // a captured decode step and its input/output buffers (CUDA builds)

  // Drops released rows and squeezes holes; leaves room for at least `need` more slots.
  void compact(int64_t need);
  // One decode step at a fixed shape (mask over every slot, write slot on the device), the form a CUDA
  // graph captures. inputs (3 Bc + 1) int64 on the device: ids, positions, fed (0/1) per cache row, then
  // the slot. Returns the hidden states (Bc, D).
  at::Tensor fixed_step(const at::Tensor& inputs);
  // The graph path of step() (CUDA builds): copies the packed host inputs (fixed_step's, then the rows to
  // pick) in, captures a graph when the cache changed, replays it. Returns the hidden states (Bc, D) and,
  // through `pick`, the picked rows on the device.
  at::Tensor graph_step(const std::vector<int64_t>& packed, int64_t picks, at::Tensor& pick);

  const Transformer& model_;
  ModelPolicyOptions options_;
  KvCache cache_;
  at::Tensor valid_;                 // (Bc, S) bool on the model's device: slot holds a token of the row
  std::vector<int64_t> cache_row_;   // (N) sequence -> cache row, -1 once released
  std::vector<int64_t> seq_of_row_;  // (Bc) cache row -> sequence, -1 once released
  std::vector<int64_t> length_;      // (N) tokens held per sequence = the next token's RoPE position
  int64_t compactions_ = 0;
  std::unique_ptr<StepGraph> graph_;
  int64_t graph_captures_ = 0;
};

}  // namespace rlt
