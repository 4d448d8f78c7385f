// A decoder-only transformer (llama, mistral, qwen2, qwen3, gemma2 by config) that returns hidden states
// before the LM head: the loss module (loss/logprob.h) applies the head, so CCE never builds logits.
// Parameters are plain tensors under their Hugging Face names, so loading and saving is a name-for-name
// copy; the forward is functional ATen, readable top to bottom beside transformers' modeling_llama in
// transformer.cpp. Leaves out: dropout (RL fine-tuning runs without it), MoE, rope types other than
// default and llama3.
// The members are defined by topic: transformer.cpp (the forward), transformer_io.cpp (names, load,
// save, copies), transformer_lora.cpp (adapters), transformer_checkpoint.cpp (running a layer: residency
// and activation checkpointing), transformer_mixed.cpp (the merged step and feed), packed_weights.cpp.
// The fused CUDA kernels reach the forward through LayerKernels (layer_kernels.h).
//
// Shapes: B sequences, L new positions, C cache slots (positions already cached + L), D hidden,
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
#include "model/kv_cache.h"
#include "model/lora.h"
#include "model/packed_weights.h"
#include "model/residency.h"

namespace rlt {

struct ForwardPlan;
class LayerKernels;

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
  // PPO's separate critic made from this model: the trunk cloned (detached, trainable) under a
  // *ForTokenClassification head of one output with a bias, so transformers' AutoModelForTokenClassification
  // loads its saved folder. A causal LM's head is dropped and the score layer starts at zero (every first
  // value is 0); a one-label sequence-score head (a reward model) keeps its weight beside a zero bias; a
  // one-label token-score head is cloned. Throws ModelConfigError for a score head of more labels, and
  // std::invalid_argument for a model with adapters.
  Transformer value_model() const;
  // Copies share the parameter tensors (like at::Tensor copies); the name table is rebuilt for the copy.
  Transformer(const Transformer& other) { *this = other; }
  Transformer& operator=(const Transformer& other);

  // ids (B, L) int64; positions (B, L) int64 RoPE positions; attention_mask (B, C) 0/1 over all slots
  // (cached + new; undefined = all 1). With a cache, the new keys/values go to slots
  // [cache->length, cache->length + L) and cache->length advances. Returns hidden states (B, L, D) after
  // the final norm.
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& attention_mask,
                     KvCache* cache = nullptr) const;

  // Sequences laid end to end with no padding (the update's and scoring's packed micro-batches): ids and
  // positions (1, T), sequence s at tokens [starts[s], starts[s + 1]) (starts: 0, then strictly rising to
  // T), each attending causally within itself only, at the RoPE positions given (each sequence's own,
  // from 0). Returns hidden states (1, T, D) after the final norm, equal to forward()'s over the same
  // sequences right-padded into rows. Attention runs as one variable-length kernel on CUDA in bf16 and
  // fp16 (ATen's flash attention over cumulative lengths), else sequence by sequence.
  // prefix_of (empty, or one entry a sequence): sequence s continues sequence prefix_of[s] (an earlier one
  // of the pack that continues none; -1: none), attending over its tokens and then causally over its own,
  // at the positions given (continuing the prefix's). Its hidden states are those of the prefix's tokens
  // followed by its own, forwarded as one sequence: answers to one prompt run the prompt's tokens once.
  // outputs (empty, or packed token indices): only those tokens' hidden states, (1, R, D) in that order,
  // equal to the same rows of the whole forward's; the last layer then runs its queries, output projection
  // and MLP for those rows alone (a reward model reads each sequence's last token).
  at::Tensor forward_packed(const at::Tensor& ids, const at::Tensor& positions, const std::vector<int64_t>& starts,
                            const std::vector<int64_t>& prefix_of = {}, const std::vector<int64_t>& outputs = {}) const;

  // A decode step and a feed in one forward (DecodeEngine's merged pass): each of the cache's Bc rows takes
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
  // A model with a score head (config().head) has none: lm_head() and logits() throw, naming its architecture.
  const at::Tensor& lm_head() const;
  // logits (…, V) from hidden states, softcap included: for tests and sampling; training uses the loss module.
  at::Tensor logits(const at::Tensor& hidden) const;
  // A score head's outputs (…, num_labels) from hidden states: hidden · score.weightᵀ (+ score.bias for
  // token classification), in the hidden states' dtype (the head cast to it: fp32 hidden states give fp32
  // scores of a bf16 model), as transformers' `score` layer. Throws for a causal LM.
  at::Tensor score(const at::Tensor& hidden) const;

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
  // the model's own on its device, seeded from `seed` too. Cache forwards with adapters run the ATen forms
  // (fused_kernels_apply() is false: the rollout decodes merged() instead); forwards without a cache take
  // the training kernels as any model does (set_training_kernels). Replaces adapters already
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
  // gradients accumulate in .grad during backward(); torch::autograd::grad cannot see through it); with
  // `layers` >= 0, only the first `layers` layers do, and the rest keep their activations.
  void set_activation_checkpointing(bool on, int64_t layers = -1) {
    checkpointing_ = on;
    checkpoint_layers_ = layers;
  }
  // Weights held elsewhere between forwards (WeightResidency); nullptr: always here. Copies share it, clones
  // do not.
  void set_residency(WeightResidency* r) { residency_ = r; }
  // No-grad forwards through a KvCache on CUDA (the rollout's prefill, decode steps and feeds) run the
  // fused RMSNorm, RoPE and SiLU-gate kernels of model/cuda/decode_kernels.h (on by default); off, they
  // run the ATen forms like every other forward. Tests compare the two; bench_model measures both.
  void set_fused_kernels(bool on) { fused_kernels_ = on; }
  bool fused_kernels() const { return fused_kernels_; }
  // Forwards without a cache on CUDA (training and scoring, grad mode on or off) run the same kernels as
  // autograd nodes with backward kernels (model/cuda/train_kernels.h; on by default, model.fused_kernels);
  // off, the ATen forms, as on the CPU. Tests compare the two; bench_update measures both.
  void set_training_kernels(bool on) { training_kernels_ = on; }
  bool training_kernels() const { return training_kernels_; }
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
  // The forward's attention plan (p.S (C), p.ops, p.cos and p.cache set): in-place attention (p.keep, p.slots)
  // for a fused feed over KvCache::step_rows or a fused step over every row (KvCache::in_place_steps),
  // else the masks of every layer (p.full_mask, p.sliding_mask, p.fast). positions (B, L), attention_mask
  // (B, C) as forward() takes them.
  void plan_attention(ForwardPlan& p, const at::Tensor& positions, const at::Tensor& attention_mask) const;
  // What forward and forward_packed share: the embedding of ids (B, L) (B, L, D); the RoPE tables of
  // positions (B, L) in `dtype` (p.cos, p.sin), with whether the adapters' dropout runs (p.dropout: in a
  // training forward); and, once p is planned, every layer and the final norm.
  at::Tensor embed_tokens(const at::Tensor& ids) const;
  // forward_packed's outputs into p (out_rows, out_kv_index, out_cu_k, out_keys, out_longest), once p.starts
  // and p.prefix_of are set; T packed tokens.
  void plan_outputs(ForwardPlan& p, const std::vector<int64_t>& outputs, int64_t T) const;
  void rope_tables(const at::Tensor& positions, at::ScalarType dtype, ForwardPlan& p) const;
  at::Tensor run_layers(at::Tensor h, const ForwardPlan& p) const;
  // The layer forms of a forward without a cache: the training kernels on CUDA with them on
  // (set_training_kernels), else the ATen forms.
  const LayerKernels* cacheless_kernels() const;
  // Layer i of a forward, with its weights resident (set_residency) and, in a training forward with
  // checkpointing on, checkpointed (transformer_checkpoint.cpp). pending: see output_and_mlp.
  at::Tensor run_layer(int64_t i, const at::Tensor& h, at::Tensor& pending, const ForwardPlan& p) const;
  // Decoder layer i of h (B, L, D): project_qkv, RoPE, the cache, attention, output_and_mlp.
  at::Tensor layer_forward(int64_t i, at::Tensor h, at::Tensor& pending, const ForwardPlan& p) const;
  // The pieces of a layer that every forward shares (forward_mixed too). Layer i's input norm and q/k/v
  // projections of h (B, L, D) (packed: one GEMM, views of its blocks), q/k normed where the model does:
  // q (B, L, H, hd), k and v (B, L, Hkv, hd). With pending defined (the pending residual of a fused forward:
  // the previous layer's MLP output, not yet added), h becomes h + pending in the input norm's kernel and
  // pending is emptied.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> project_qkv(int64_t i, at::Tensor& h, at::Tensor& pending,
                                                             const ForwardPlan& p) const;
  // Layer i after its attention: output projection of attn (B, L, H hd), residual, the MLP block and its
  // residual. Returns the layer's output (B, L, D); in a fused forward, the output less the MLP's, which is
  // left in pending (the pending residual) for the next norm to add (one kernel fewer a layer).
  at::Tensor output_and_mlp(int64_t i, const at::Tensor& h, const at::Tensor& attn, at::Tensor& pending,
                            const ForwardPlan& p) const;
  // x (…, in) through layer l's projection `target` (weight, bias b): x W^T (+ b), plus its LoRA adapter's
  // term when it has one (lora_term).
  at::Tensor project(const Layer& l, int target, const at::Tensor& x, const at::Tensor& b, bool dropout) const;
  // The adapter's term of layer l's projection `target` on x (…, in) (lora_update; with dropout: the
  // adapters' dropout, in training forwards).
  at::Tensor lora_term(const Layer& l, int target, const at::Tensor& x, bool dropout) const;

  ModelConfig config_;
  at::Tensor embed_, final_norm_, lm_head_;  // (V, D), (D), (V, D) (= embed_ when tied)
  at::Tensor score_, score_bias_;            // (num_labels, D), (num_labels): a score head's
  // The LM head is the embedding: a causal LM with tie_word_embeddings (a score head ties nothing).
  bool ties_lm_head() const { return config_.head == ModelHead::kCausalLm && config_.tie_word_embeddings; }
  std::vector<Layer> layers_;
  std::map<std::string, at::Tensor*> by_name_;  // HF name -> member
  bool checkpointing_ = false;
  int64_t checkpoint_layers_ = -1;  // the checkpointed layers are [0, this); -1: every layer
  bool fused_kernels_ = kFusedKernelsByDefault;
  bool training_kernels_ = true;
  WeightResidency* residency_ = nullptr;
  LoraOptions lora_;        // the adapters' options; rank 0: none
  at::Generator lora_gen_;  // the adapters' dropout draws, on the parameters' device
};

}  // namespace rlt
