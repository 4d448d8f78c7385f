// A decoder-only transformer (llama, mistral, qwen2, qwen3, gemma2 by config) that returns hidden states
// before the LM head: the loss module (loss/logprob.h) applies the head, so CCE never builds logits.
// Parameters are plain tensors under their Hugging Face names, so loading and saving is a name-for-name
// copy; the forward is functional ATen, readable top to bottom. Leaves out: dropout (RL fine-tuning
// runs without it), MoE, rope types other than default and llama3.
//
// Shapes: B sequences, L new positions, S cache slots (positions already cached + L), D hidden,
// H / Hkv query / key-value heads, hd head size, F MLP width, V vocabulary.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "model/config.h"
#include "model/lora.h"

namespace rlt {

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

// Projection weights packed for decoding, per layer: [q; k; v] (with their biases) and [gate; up] as one
// matrix each, so that a forward runs one GEMM for each group instead of three and two: a decode step's
// GEMMs are a few microseconds each, set by their launch and tile count rather than their bytes. A
// snapshot of the parameters when made (ModelPolicy makes one per rollout); it costs their size again
// (qkv and gate/up: 0.47 GB for Qwen2.5-0.5B in bf16) for as long as it lives. qkv_w is empty for models
// with q/k norms, whose fused RMSNorm needs q and k contiguous.
struct PackedWeights {
  std::vector<at::Tensor> qkv_w, qkv_b;  // per layer: ((H + 2 Hkv) hd, D) and its bias (undefined: none)
  std::vector<at::Tensor> gate_up_w;     // per layer: (2 F, D)
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
  bool fused_kernels = true;
  // With the fused kernels: a step at step_slot over every row attends through cuda::cache_attention, as a
  // feed does (keys read where they lie up to the step's own slot, split between blocks); false: SDPA
  // (cuDNN in a captured step) over the whole span. gather() passes it on.
  bool in_place_steps = true;
  static KvCache allocate(const ModelConfig& c, int64_t batch, int64_t max_len, const at::TensorOptions& opts);
  // A new cache of `max_len` slots whose row r, slot j is this cache's row rows[r], slot slots[r, j]
  // (j < slots.size(1)); length becomes slots.size(1). One primitive for dropping finished rows,
  // squeezing out holes, growing, and copying a prefilled prompt to G rows.
  // rows (B') int64, slots (B', S') int64, both on the cache's device.
  KvCache gather(const at::Tensor& rows, const at::Tensor& slots, int64_t max_len) const;
  // gather() into this cache's own tensors, every row kept, squeezing out holes: row r's slot j becomes its
  // slot slots[r, j] for j below its count of kept slots (slots (B, S) int64 on the cache's device, S <=
  // max_len: each row's kept slots in increasing order, then zeros); its slots past them hold finite values
  // of no meaning (the caller's mask hides them). length becomes S. Tensors and shapes stay, so a CUDA
  // graph captured on them stays valid. On CUDA one kernel moves every layer's slots in place
  // (cuda::squeeze_slots_).
  void squeeze_(const at::Tensor& slots);
  // Row rows[j]'s slots [0, src.length) become src's row src_rows[j]'s, keys, values and positions (a
  // prompt prefilled apart, placed into a cache row that a finished sequence left); its other slots and
  // the other rows stay as they are, and so does `length` (the caller's). The tensors stay, so a CUDA
  // graph captured on them stays valid. rows, src_rows (B') int64 on the cache's device, rows distinct;
  // src.length <= max_len.
  void put_rows_(const at::Tensor& rows, const KvCache& src, const at::Tensor& src_rows);
};

// Where a model's weights are while they are sharded over ranks (train.shard parameters, trainer/shard.h):
// forward() asks for layer i's weights before running it and hands them back after it (a checkpointed
// layer asks again in the backward, and hands them back once its backward is done); the embedding, final
// norm and head (layer -1) are asked for at the start of every forward and handed back by the owner.
class WeightResidency {
 public:
  virtual ~WeightResidency() = default;
  // `backward`: asked by a checkpointed layer's recompute, so the next layer needed is i - 1, not i + 1.
  virtual void acquire(int64_t layer, bool backward) = 0;
  virtual void release(int64_t layer) = 0;
};

class Transformer {
 public:
  // Random initialisation (normal(0, 0.02) weights, unit norms) in `dtype` on `device`.
  Transformer(ModelConfig config, at::ScalarType dtype, at::Device device, uint64_t seed = 0);
  // Loads config.json + safetensors (single or sharded) from `dir`, casting to `dtype`. Missing tensors,
  // shape mismatches and corrupt files raise an error naming the file and the tensor.
  static Transformer load(const std::string& dir, at::ScalarType dtype, at::Device device);
  // load() when `dir` holds weights (model.safetensors or its sharded index), else random weights from
  // `seed` in the shape of its config.json (the benchmarks' random checkpoints).
  static Transformer load_or_random(const std::string& dir, at::ScalarType dtype, at::Device device, uint64_t seed = 0);
  // Writes config.json (every key it was loaded with, dtype updated) and the weights under their HF
  // names (sharded above max_shard_bytes), so transformers can load the folder.
  void save(const std::string& dir, uint64_t max_shard_bytes = 5ull << 30) const;
  // A deep copy (the reference policy): same config, parameters (and adapters) cloned and detached.
  Transformer clone() const;
  // Copies share the parameter tensors (like at::Tensor copies); the name table is rebuilt for the copy.
  Transformer(const Transformer& other) { *this = other; }
  Transformer& operator=(const Transformer& other);

  // ids (B, L) int64; positions (B, L) int64 RoPE positions; attention_mask (B, S) 0/1 over all slots
  // (cached + new; undefined = all 1). With a cache, the new keys/values go to slots
  // [cache->length, cache->length + L) and cache->length advances. Returns hidden states (B, L, D) after
  // the final norm.
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& attention_mask,
                     KvCache* cache = nullptr) const;

  // A decode step and a feed in one forward (ModelPolicy's merged pass): each of the cache's Bc rows takes
  // one token (step_ids, step_pos (Bc, 1)) at slot cache.step_slot (1), attending over step_mask (Bc, span)
  // as a graphed step does; feed_ids, feed_pos (E, K) enter rows feed_rows (E) at slots feed_slots (K),
  // attending in place over feed_keep (E, span) (cuda::cache_attention) as a fused feed does. The two
  // share every weight read: norms, projections and the MLP run once over Bc + E K tokens. cache.span is
  // the span (both parts); cache.length is left to the caller. feed_rows must not hold a row whose step
  // token is fed (its slot in the step is a hole). Needs mixed_forward_applies(). Returns the hidden states
  // (Bc + E K, D): the step's rows, then the feed's tokens row-major.
  at::Tensor forward_mixed(const at::Tensor& step_ids, const at::Tensor& step_pos, const at::Tensor& step_mask,
                           const at::Tensor& feed_ids, const at::Tensor& feed_pos, const at::Tensor& feed_keep,
                           const at::Tensor& feed_rows, const at::Tensor& feed_slots, KvCache& cache) const;
  // The merged pass can run: the fused kernels apply, in bf16 or fp16 at a head size cache_attention takes,
  // without soft-capping, sliding windows or q/k norms, and with no grad.
  bool mixed_forward_applies() const;

  // The packed projection weights of the current parameters (PackedWeights), on their device.
  PackedWeights pack_weights() const;
  // The same, written into `p`'s tensors (made by pack_weights() on this model), so that a CUDA graph
  // that reads them sees the parameters as they are now.
  void pack_weights_into(PackedWeights& p) const;

  // (V, D): the LM head (the embedding when tied). Its final-logit softcap (0 = none) is config().final_softcap.
  const at::Tensor& lm_head() const;
  // logits (…, V) from hidden states, softcap included: for tests and sampling; training uses the loss module.
  at::Tensor logits(const at::Tensor& hidden) const;

  const ModelConfig& config() const { return config_; }
  // Every parameter under its HF name (tied models have no "lm_head.weight"), sorted by name.
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;
  std::vector<at::Tensor> parameters() const;
  // What training updates, under names, in a fixed order: the LoRA adapters when the model has them, else
  // every parameter (named_parameters()).
  std::vector<std::pair<std::string, at::Tensor>> named_trainable_parameters() const;
  std::vector<at::Tensor> trainable_parameters() const;
  // LoRA (model/lora.h): an adapter on each of options.targets' projections of every layer. A (rank, in)
  // is drawn as PEFT draws it by default, kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in)),
  // from a CPU generator seeded with `seed`, layer by layer, target by target; B (out, rank) is zero, so
  // the model's outputs do not move until B trains. Both are fp32 (float64 on a float64 model: the
  // references' runs) and require grad; every base parameter stops requiring grad, and
  // named_trainable_parameters() becomes the adapters. The adapters' dropout draws from a generator of
  // the model's own on its device, seeded from `seed` too. Forwards with adapters run the ATen forms only
  // (fused_kernels_apply() is false): the rollout decodes merged() instead. Replaces adapters already
  // attached. Throws std::invalid_argument for options that name no target.
  void attach_lora(const LoraOptions& options, uint64_t seed);
  bool has_lora() const { return lora_.enabled(); }
  // The adapters' options (rank 0: none).
  const LoraOptions& lora() const { return lora_; }
  // A model without adapters whose targeted weights are W + (alpha / rank) B A, computed in fp32 and
  // rounded once to the model's dtype (lora_merged_weight); every other tensor is shared with this model,
  // not copied. Without adapters, a copy sharing every tensor.
  Transformer merged() const;
  // Rewrites `dst`'s targeted weights in place with this model's merged ones (dst made by merged(): its
  // other tensors are this model's), so a rollout built on dst keeps its tensors and graphs.
  void merge_into(Transformer& dst) const;
  // A copy that shares the frozen base weights and holds detached clones of the adapters: the model as it
  // is now, which later updates of this one do not move (the LoRA run's reference policy). Needs adapters.
  Transformer adapter_snapshot() const;
  // The state of the adapters' dropout generator (a resumed run draws the masks the uninterrupted one
  // would), and its restoration. Undefined without adapters.
  at::Tensor lora_rng_state() const;
  void set_lora_rng_state(const at::Tensor& state);
  // Recompute each layer's activations in the backward instead of storing them (reentrant: parameter
  // gradients accumulate in .grad during backward(); torch::autograd::grad cannot see through it).
  void set_activation_checkpointing(bool on) { checkpointing_ = on; }
  // Weights held elsewhere between forwards (WeightResidency); nullptr: always here. Copies share it, clones
  // do not.
  void set_residency(WeightResidency* r) { residency_ = r; }
  // No-grad forwards through a KvCache on CUDA (the rollout's prefill, decode steps and feeds) run the
  // fused RMSNorm, RoPE and SiLU-gate kernels of model/cuda/decode_kernels.h (on by default); off, they
  // run the ATen forms like every other forward. Tests compare the two; bench_model measures both.
  void set_fused_kernels(bool on) { fused_kernels_ = on; }
  bool fused_kernels() const { return fused_kernels_; }
  // The fused kernels are on and can run this model: a CUDA build, parameters on a CUDA device in
  // float32, bfloat16 or float16. (A forward runs them when, besides, it is no-grad and goes through a
  // cache that allows them.)
  bool fused_kernels_apply() const;
  // Forwards that ran the fused kernels so far, in this process (tests check the path was taken: in
  // float32 its results can equal the ATen forms' bit for bit).
  static int64_t fused_forward_count();
  // Of them, the feeds over some cache rows whose attention read those rows' cache in place
  // (cuda::cache_attention), and the steps over every row that did (KvCache::in_place_steps).
  static int64_t in_place_feed_count();
  static int64_t in_place_step_count();

 private:
  struct Layer {
    at::Tensor input_norm, q_w, q_b, k_w, k_b, v_w, v_b, o_w, o_b, q_norm, k_norm;
    at::Tensor post_attn_norm, pre_ff_norm, post_ff_norm, gate_w, up_w, down_w;
    // LoRA adapters by target (lora_target_name's order): A (rank, in), B (out, rank); undefined: none.
    std::array<at::Tensor, kLoraTargets> lora_a, lora_b;
  };
  // The base weight each LoRA target adapts: &Layer::q_w, ..., &Layer::down_w.
  static at::Tensor Layer::*const kLoraWeights[kLoraTargets];
  Transformer() = default;
  void bind_names();
  // mask (B, 1, L, S), bool or additive, or undefined: then causal (is_causal) or no restriction (a decode
  // step). forward() passes a grouped-query mask already laid out as (B, 1, G L, S). keep (B, S) bool and
  // slots (L) int64, both on the device, set only for a fused feed over KvCache::step_rows or a fused step
  // over every row (KvCache::in_place_steps): the new keys go to `slots` of those rows, and the attention
  // (cuda::cache_attention) reads their cache in place under the causal mask that keep and slots make
  // (mask is then unused). carry: see project_qkv and output_and_mlp.
  at::Tensor layer_forward(int64_t i, at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
                           const at::Tensor& mask, bool is_causal, KvCache* cache, bool fused,
                           const at::Tensor& keep = at::Tensor(), const at::Tensor& slots = at::Tensor(),
                           bool dropout = false, at::Tensor* carry = nullptr) const;
  // The pieces of a layer that every forward shares. RMSNorm, fused or the ATen form.
  at::Tensor norm(const at::Tensor& x, const at::Tensor& w, bool gemma, bool fused) const;
  // Layer i's input norm and q/k/v projections of h (B, L, D) (packed: one GEMM, views of its blocks), q/k
  // normed where the model does: q (B, L, H, hd), k and v (B, L, Hkv, hd). With *carry defined (a fused
  // forward: the previous layer's MLP output, not yet added), h becomes h + *carry in the input norm's
  // kernel (cuda::add_rms_norm) and *carry is emptied.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> project_qkv(int64_t i, at::Tensor& h, const PackedWeights* packed,
                                                             bool fused, bool dropout = false,
                                                             at::Tensor* carry = nullptr) const;
  // Layer i after its attention: output projection of attn (B, L, H hd), residual, the MLP block and its
  // residual. Returns the layer's output (B, L, D); with carry, the output less the MLP's, which is left in
  // *carry for the next norm to add (one kernel fewer a layer).
  at::Tensor output_and_mlp(int64_t i, const at::Tensor& h, const at::Tensor& attn, const PackedWeights* packed,
                            bool fused, bool dropout = false, at::Tensor* carry = nullptr) const;
  // The final norm of h (B, L, D), or with carry defined of h + carry (fused forwards).
  at::Tensor final_norm(const at::Tensor& h, const at::Tensor& carry, bool fused) const;
  // x (…, in) through layer l's projection `target` (weight, bias b): x W^T (+ b), plus its LoRA adapter's
  // term when it has one (with dropout: the adapters' dropout, in training forwards).
  at::Tensor project(const Layer& l, int target, const at::Tensor& x, const at::Tensor& b, bool dropout) const;

  ModelConfig config_;
  at::Tensor embed_, final_norm_, lm_head_;  // (V, D), (D), (V, D) (= embed_ when tied)
  std::vector<Layer> layers_;
  std::map<std::string, at::Tensor*> by_name_;  // HF name -> member
  bool checkpointing_ = false;
  bool fused_kernels_ = true;
  WeightResidency* residency_ = nullptr;
  LoraOptions lora_;        // the adapters' options; rank 0: none
  at::Generator lora_gen_;  // the adapters' dropout draws, on the parameters' device
};

}  // namespace rlt
