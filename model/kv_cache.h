// The decoder's key/value cache (KvCache) for incremental decoding, and the guard that keeps SDPA off
// cuDNN while a rollout runs (NoCudnnAttention). Transformer::forward writes the cache through update();
// the rollout (rollout/engine.h) allocates, gathers, squeezes and refills it between forwards.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "model/config.h"
#include "model/packed_weights.h"

namespace rlt {

// Whether forwards through a cache run the fused kernels of model/cuda/decode_kernels.h unless told
// otherwise: the default of KvCache::fused_kernels and of Transformer::set_fused_kernels.
constexpr bool kFusedKernelsByDefault = true;

// Keys and values of every layer for incremental decoding, allocated once for B sequences of up to
// max_len slots. Every forward writes its L new positions to slots [length, length + L) of all rows; a
// row with nothing to add writes a slot that its attention mask then hides, so rows may hold holes.
// Slots carry the RoPE position they were written with, and sliding windows are measured in positions,
// not slots, so holes never shrink a window.
// While alive, scaled_dot_product_attention skips cuDNN (flash or memory-efficient attention take the
// calls); the previous setting comes back at the end of the scope. cuDNN's attention builds an execution
// plan for every new shape and stride and then caches it: about 40 ms each on an H200 (bench_model
// --trace), where the whole forward of a tool reply's feed takes 3 ms of GPU time. A rollout's shapes
// change at every step (rows, context length, the feed's width), so it would pay that cost almost every
// time. The setting is process-wide: use the guard on the thread that runs the model, around forwards.
class NoCudnnAttention {
 public:
  explicit NoCudnnAttention(bool active = true);
  ~NoCudnnAttention();
  NoCudnnAttention(const NoCudnnAttention&) = delete;
  NoCudnnAttention& operator=(const NoCudnnAttention&) = delete;

 private:
  bool active_, previous_ = true;
};

struct KvCache {
  std::vector<at::Tensor> k, v;  // per layer: (B, Hkv, max_len, hd)
  at::Tensor positions;          // (B, max_len) int64: the position each slot was written with
  int64_t length = 0;            // slots filled so far
  int64_t max_len = 0;
  // Set for a step whose work must not depend on `length`, so that a captured CUDA graph can replay it:
  // (L) int64 on the cache's device, the slots the step's L tokens write, in order. The step then attends
  // over slots [0, span) (all max_len when span is 0; its attention mask must cover them and hide the
  // unwritten ones), and forward leaves `length` to the caller. With step_rows too, only those rows are written (a
  // fixed-shape feed).
  at::Tensor step_slot;
  // Set for a forward over some of the cache's rows only (a multi-token feed of a few sequences while
  // the others wait): (B') int64 on the cache's device, the cache row of each input row. The new keys
  // and values go to those rows' slots [length, length + L) (or step_slot's); the other rows' slots there
  // are left as they are (the caller's mask hides them), and length advances for all rows (unless
  // step_slot is set: then the caller moves it).
  at::Tensor step_rows;
  // With step_slot: the step (or the feed, with step_rows) attends over slots [0, span) only (its mask is
  // (B, span)); 0 = all max_len. Graphed decode steps and feeds are captured per span bucket, so they read
  // only the cache in use.
  int64_t span = 0;
  // Packed projection weights for this cache's fused forwards (Transformer::set_fused_kernels), or none.
  // Not owned; gather() passes it on.
  const PackedWeights* packed = nullptr;
  // This cache's forwards may run the fused kernels (with Transformer::fused_kernels); gather() passes it on.
  bool fused_kernels = kFusedKernelsByDefault;
  // With the fused kernels: a step at step_slot over every row attends through cuda::cache_attention, as a
  // feed does (keys read where they lie up to the step's own slot, split between blocks); false: SDPA
  // (cuDNN in a captured step) over the whole span. gather() passes it on.
  bool in_place_steps = true;
  static KvCache allocate(const ModelConfig& c, int64_t batch, int64_t max_len, const at::TensorOptions& opts);
  // A new cache of `max_len` slots whose row r, slot j is this cache's row rows[r], slot slots[r, j]
  // (j < slots.size(1)); length becomes slots.size(1). One primitive for dropping finished rows,
  // squeezing out holes, growing, and copying a prefilled prompt to G rows.
  // rows (B') int64, slots (B', C') int64, both on the cache's device.
  KvCache gather(const at::Tensor& rows, const at::Tensor& slots, int64_t max_len) const;
  // gather(), releasing this cache's tensors layer by layer as their copy is made: the two caches never
  // coexist whole (a cache that grows holds its new size and one layer of the old, not both). This cache
  // is left empty.
  KvCache regather(const at::Tensor& rows, const at::Tensor& slots, int64_t max_len);
  // gather() into this cache's own tensors, every row kept, squeezing out holes: row r's slot j becomes its
  // slot slots[r, j] for j below its count of kept slots (slots (B, C) int64 on the cache's device, C <=
  // max_len: each row's kept slots in increasing order, then zeros); its slots past them hold finite values
  // of no meaning (the caller's mask hides them). length becomes C. Tensors and shapes stay, so a CUDA
  // graph captured on them stays valid. On CUDA one kernel moves every layer's slots in place
  // (cuda::squeeze_slots_).
  void squeeze_(const at::Tensor& slots);
  // Row rows[j]'s slots [0, src.length) become src's row src_rows[j]'s, keys, values and positions (a
  // prompt prefilled apart, placed into a cache row that a finished sequence left); its other slots and
  // the other rows stay as they are, and so does `length` (the caller's). The tensors stay, so a CUDA
  // graph captured on them stays valid. rows, src_rows (B') int64 on the cache's device, rows distinct;
  // src.length <= max_len.
  void put_rows_(const at::Tensor& rows, const KvCache& src, const at::Tensor& src_rows);

  // The slots a step at step_slot attends over: [0, span), or every slot when span is 0.
  int64_t step_span() const { return span > 0 ? span : max_len; }
  // Records a forward's RoPE positions (B, L) for its L new slots: [length, length + L) or step_slot's, of
  // every row or of step_rows'. Leaves `length` to the forward.
  void write_positions(const at::Tensor& new_positions);
  // Writes layer `layer`'s new keys and values k_new, v_new (B, Hkv, L, hd) where write_positions puts
  // their positions, and returns the keys and values the forward's queries attend over, (B, Hkv, C, hd)
  // each: slots [0, length + L), or [0, step_span()) with step_slot; of step_rows' rows when set (as
  // Hugging Face's Cache.update does for one layer).
  std::pair<at::Tensor, at::Tensor> update(int64_t layer, const at::Tensor& k_new, const at::Tensor& v_new);
};

}  // namespace rlt
