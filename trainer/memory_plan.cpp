// The memory plan; see memory_plan.h. Every figure is counted from how the code allocates; the comments
// name the place.
#include "trainer/memory_plan.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <sstream>
#include <vector>

#include "common/memory.h"
#include "loss/cce.h"
#include "parallel/adamw.h"
#include "parallel/shard.h"
#include "rollout/engine.h"
#include "rollout/reward_model.h"
#include "trainer/critic.h"
#include "trainer/optim.h"
#include "trainer/run.h"

#ifdef RLT_HAVE_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace rlt {

namespace {

constexpr double kGiB = double(int64_t{1} << 30);

std::string gib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", double(bytes) / kGiB);
  return buf;
}

// One projection of a decoder layer: its name among lora.targets, and its input and output widths.
struct Projection {
  const char* name;
  int64_t in, out;
};

std::vector<Projection> projections(const ModelConfig& m) {
  const int64_t D = m.hidden_size, F = m.intermediate_size, qd = m.num_heads * m.head_dim,
                kvd = m.num_kv_heads * m.head_dim;
  return {{"q", D, qd}, {"k", D, kvd}, {"v", D, kvd}, {"o", qd, D}, {"gate", D, F}, {"up", D, F}, {"down", F, D}};
}

// The sizes the plan is made of, in parameters.
struct Shape {
  int64_t P = 0;            // the whole model
  int64_t layer = 0;        // one decoder layer
  int64_t outer = 0;        // embedding, final norm and (untied) LM head: what every forward needs whole
  int64_t largest = 0;      // the largest tensor
  int64_t packed = 0;       // PackedWeights: [q; k; v] (+ biases) and [gate; up] of every layer
  int64_t adapters = 0;     // LoRA: rank x (in + out) per targeted projection and layer
  int64_t adapter_max = 0;  // LoRA: the largest adapter matrix
  int64_t targeted = 0;     // LoRA: in x out per targeted projection and layer (the merged copy)
};

// The projections lora.targets names (none without LoRA).
std::vector<Projection> targeted_projections(const Config& c, const ModelConfig& m) {
  if (!c.lora.enabled()) return {};
  const std::vector<std::string> targets = c.lora.target_list();
  std::vector<Projection> out;
  for (const Projection& p : projections(m)) {
    if (std::find(targets.begin(), targets.end(), p.name) != targets.end()) out.push_back(p);
  }
  return out;
}

// The elements of each parameter tensor of one decoder layer.
std::vector<int64_t> layer_tensors(const ModelConfig& m) {
  const int64_t D = m.hidden_size, hd = m.head_dim, qd = m.num_heads * hd, kvd = m.num_kv_heads * hd;
  std::vector<int64_t> t;
  for (const Projection& p : projections(m)) t.push_back(p.in * p.out);
  t.insert(t.end(), {D, D});                          // input and post-attention norms
  if (m.qkv_bias) t.insert(t.end(), {qd, kvd, kvd});  // q/k/v biases
  if (m.o_bias) t.push_back(D);                       // o_proj bias
  if (m.qk_norm) t.insert(t.end(), {hd, hd});         // q and k norms over head_dim
  if (m.gemma_norms) t.insert(t.end(), {D, D});       // pre- and post-feedforward norms
  return t;
}

// The elements of each parameter tensor outside the layers: the embedding, the final norm, and the LM
// head unless tied (or a score head: its weight, and its bias for token classification).
std::vector<int64_t> outer_tensors(const ModelConfig& m) {
  const int64_t D = m.hidden_size, V = m.vocab_size;
  std::vector<int64_t> t = {V * D, D};
  if (m.head == ModelHead::kCausalLm) {
    if (!m.tie_word_embeddings) t.push_back(V * D);
  } else {
    t.push_back(m.num_labels * D);
    if (m.head == ModelHead::kTokenScore) t.push_back(m.num_labels);
  }
  return t;
}

Shape shape_of(const Config& c, const ModelConfig& m) {
  Shape s;
  const int64_t D = m.hidden_size, V = m.vocab_size, F = m.intermediate_size, hd = m.head_dim, qd = m.num_heads * hd,
                kvd = m.num_kv_heads * hd;
  for (const Projection& p : projections(m)) s.largest = std::max(s.largest, p.in * p.out);
  for (int64_t n : layer_tensors(m)) s.layer += n;
  for (int64_t n : outer_tensors(m)) s.outer += n;
  s.largest = std::max(s.largest, V * D);
  s.P = m.num_layers * s.layer + s.outer;
  // Transformer::pack_weights: no [q; k; v] for q/k-normed models.
  const int64_t qkv = m.qk_norm ? 0 : (qd + 2 * kvd) * D + (m.qkv_bias ? qd + 2 * kvd : 0);
  s.packed = m.num_layers * (qkv + 2 * F * D);
  for (const Projection& p : targeted_projections(c, m)) {
    s.adapters += m.num_layers * c.lora.rank * (p.in + p.out);
    s.adapter_max = std::max(s.adapter_max, c.lora.rank * std::max(p.in, p.out));
    s.targeted += m.num_layers * p.in * p.out;
  }
  return s;
}

// Training forwards on CUDA run the fused layer forms (model.fused_kernels, model/layer_kernels.cpp's
// TrainKernels) wherever a norm is at most 8,192 wide; the CPU runs the ATen forms.
bool fused_forms(const Config& c, const ModelConfig& m, bool cpu) {
  return !cpu && c.model.fused_kernels && m.hidden_size <= 8192;
}

// Bytes autograd keeps per token of an RMSNorm over `width`. The ATen form (rms_norm in
// model/layer_kernels.cpp): x.to(fp32) (a copy for bf16, the input itself for fp32) saved by pow and mul,
// the rsqrt (4 bytes), and x_hat in the model dtype (for fp32 the fp32 x_hat itself) saved by the
// weight's mul. The fused form saves its input alone (the backward recomputes the rest).
int64_t norm_saved(int64_t width, int64_t s, bool fused) { return fused ? s * width : (s < 4 ? 4 + s : 8) * width + 4; }

// Bytes one token keeps for the backward in one decoder layer, counted from what autograd saves in
// Transformer::layer_forward, in the ATen forms or the fused ones (fused_forms):
//   - the input and post-attention RMSNorms (norm_saved), and their outputs, s D each, which the
//     projections save as their input (q/k/v share one, gate/up the other);
//   - attention: q and k after RoPE and v, saved by SDPA (mul by the cos/sin tables saves only the tables,
//     so the un-rotated q and k are not kept), SDPA's output and its fp32 log-sum-exp per head: flash
//     attention on CUDA and on the CPU alike (no [L, L] scores; measured on the CPU with torch 2.11);
//   - the CPU's flash output is laid out (B, H, L, hd), so reshaping it for o_proj copies it: s qd more
//     (CUDA's is (B, L, H, hd) and the reshape is a view);
//   - the MLP: gate's output (saved by silu / gelu), the activation and up's output (saved by their
//     product), and the product (saved by down_proj): 4 s F; the fused SiLU gate saves gate's and up's
//     outputs, not the activation: 3 s F. The residual adds save nothing;
//   - qwen3's q/k norms: one RMSNorm over q and k; gemma2: two more RMSNorms over D; a soft-capped
//     attention (gemma2) runs the eager form, whose scores are quadratic in the context: per score tanh's
//     output (s), the fp32 softmax (4) and, below fp32, its cast (s) for the matmul with V; and K, V
//     repeated to H heads;
//   - LoRA (lora_update in model/lora.h): each targeted projection's x A^T, rank wide, saved by the
//     matmul with B; with lora.dropout also the dropped input and its mask, (s + 1) per input element.
int64_t layer_bytes_per_token(const Config& c, const ModelConfig& m, int64_t s, bool cpu) {
  const int64_t D = m.hidden_size, F = m.intermediate_size, H = m.num_heads, qd = H * m.head_dim,
                kvd = m.num_kv_heads * m.head_dim;
  const bool fused = fused_forms(c, m, cpu);
  int64_t b = 2 * norm_saved(D, s, fused) + 2 * s * D;
  b += s * (2 * qd + 2 * kvd) + 4 * H;
  if (cpu) b += s * qd;
  b += (fused && !m.gelu_tanh ? 3 : 4) * s * F;
  if (m.qk_norm) b += norm_saved(qd + kvd, s, fused);
  if (m.gemma_norms) b += 2 * norm_saved(D, s, fused);
  if (m.attn_softcap > 0) b += H * c.rollout.max_context * (s + 4 + (s < 4 ? s : 0)) + 2 * s * qd;
  for (const Projection& p : targeted_projections(c, m)) {
    b += s * c.lora.rank + (c.lora.dropout > 0 ? (s + 1) * p.in : 0);
  }
  return b;
}

// The loss module's peak over T' scored rows (loss/logprob.cpp and the paths it calls), what it saves
// for the backward and what its backward allocates:
//   - naive (naive_chunked, all rows at once unless loss.chunk_size): log_softmax's fp32 output is saved;
//     the backward holds the gather's [T', V] gradient and log_softmax's;
//   - selective: SelectiveFn saves every LM-head chunk's fp32 logits (only the log-softmax is avoided);
//     its backward fills one [T', V] gradient (none with inplace_backward), on the CPU through ATen
//     chunks of 2^20 logits (kChunkElems: the chunk's log-probs and probabilities), on CUDA in a kernel;
//   - cce: its backward's fp32 dE accumulator (T', D) and [rows, vocab] blocks (cce_blocks): two fp32
//     blocks on the ATen path (log-probs and probabilities), an fp32 logits block and the gradient in
//     the model dtype on the CUDA blockwise path, the gradient alone (model dtype) on the fused one;
//   - naive and selective with bf16 weights through ATen (on the CPU, or over more rows than one LM-head
//     GEMM takes, 4096 by default: kHiddenAutoRows): the rows and the head upcast to fp32, saved by the
//     matmul, and the fp32 head's gradient.
int64_t loss_bytes(const Config& c, const ModelConfig& m, int64_t T, int64_t s, bool cpu) {
  const LossOptions& L = c.loss;
  const int64_t V = m.vocab_size, D = m.hidden_size;
  const int64_t gemm_rows = L.chunk_size > 0 ? L.chunk_size : 4096;
  int64_t b = 0;
  switch (L.impl) {
    case LogprobImpl::kNaive:
      b = 3 * T * V * 4;
      break;
    case LogprobImpl::kSelective: {
      b = T * V * 4 + (L.inplace_backward ? 0 : T * V * 4);
      const int64_t aten_rows = L.chunk_size > 0 ? L.chunk_size : std::max<int64_t>(1, (int64_t{1} << 20) / V);
      if (cpu) b += 2 * std::min(T, aten_rows) * V * 4;
      break;
    }
    case LogprobImpl::kCce: {
      const bool fused = !cpu && L.cce_fused && s < 4;
      const auto [rb, vb] = cce_blocks(T, V, D, L.chunk_size, L.vocab_chunk_size, fused);
      b = T * D * 4 + (cpu ? 2 * 4 : fused ? s : 4 + s) * rb * vb;
      break;
    }
  }
  if (s < 4 && L.impl != LogprobImpl::kCce && (cpu || T > gemm_rows)) b += T * D * 4 + 2 * V * D * 4;
  return b;
}

// One micro-batch's forward and backward: micro sequences of rollout.max_context tokens (pack() pads a
// micro-batch to its longest sequence), or as many tokens as train.micro_batch_tokens holds, every token a
// scored row (response rows are at most all rows).
// The backward runs the loss first, then the layers from the last: their working sets never meet. So the
// peak is what the layers saved plus the larger of
//   - the head's part: the final norm, the hidden states it returns, the scored rows (index_select), the
//     policy loss's (S, R) fp32 terms (about ten: ratio, clipped ratio, KL...) and the loss module's;
//   - a layer's backward: the MLP's gradients, three of s F at once in the product's backward (the
//     product's, the activation's and up's) while down_proj's saved input is already freed: 2 s F more
//     than the layer saved; and two of s D (the residual stream's, the MLP input's). With checkpointing
//     this comes on top of the layer's recompute: what it saves again, less its input where that is the
//     tensor CheckpointFn saved.
int64_t activation_bytes(const Config& c, const ModelConfig& m, int world, int64_t s, bool cpu) {
  // train.micro_batch_tokens caps a micro-batch's padded tokens, but a sequence longer than it runs alone.
  int64_t T = step_shape(c, world).micro * c.rollout.max_context;
  if (c.train.micro_batch_tokens > 0) T = std::min(T, std::max(c.train.micro_batch_tokens, c.rollout.max_context));
  const int64_t D = m.hidden_size, F = m.intermediate_size, layers = m.num_layers;
  const int64_t per_layer = layer_bytes_per_token(c, m, s, cpu);
  const int64_t ckpt = checkpointed_layers(c.model, layers);  // the first ckpt layers save their input only
  // Saved through the whole backward: every layer's activations (with checkpointing, each layer's input,
  // which CheckpointFn saves), the RoPE cos/sin tables, and the attention masks forward() builds when
  // SDPA cannot run causal alone (soft-capping, or a sliding window shorter than the context): the full
  // and the sliding one, bool per slot on the CPU, additive in the model dtype on CUDA, repeated over
  // the G query heads of a KV head unless soft-capped.
  const int64_t S = c.rollout.max_context;
  const bool sliding = m.sliding_window > 0 && S > m.sliding_window;
  const int64_t G = m.num_heads / std::max<int64_t>(1, m.num_kv_heads);
  const int64_t masks = m.attn_softcap > 0 || sliding ? 2 * S * (cpu ? 1 : s) * (m.attn_softcap > 0 ? 1 : G) : 0;
  const int64_t kept = T * (2 * s * m.head_dim + masks);
  // Shared prompts (train.share_prompts): attention gathers each answer's prompt keys and values before
  // its own, up to kSharedKeysPerToken x the budget (micro_batch_ranges), or every sequence's whole length
  // without one; a layer saves them for its backward, beyond the T tokens' own.
  const bool shared = c.train.pack_sequences && c.train.share_prompts;
  const int64_t rows_keys = step_shape(c, world).micro * c.rollout.max_context;
  const int64_t keys = c.train.micro_batch_tokens > 0
                           ? std::min(rows_keys, kSharedKeysPerToken * c.train.micro_batch_tokens)
                           : rows_keys;
  const int64_t gathered = shared ? std::max<int64_t>(0, keys - T) * 2 * m.num_kv_heads * m.head_dim * s : 0;
  const int64_t saved = T * (ckpt * s * D + (layers - ckpt) * per_layer) + (layers - ckpt) * gathered + kept;
  const bool fused = fused_forms(c, m, cpu);
  const int64_t head = T * (norm_saved(D, s, fused) + 2 * s * D + 10 * 4) + loss_bytes(c, m, T, s, cpu);
  const int64_t working = T * (2 * s * F + 2 * s * D);
  // The backward meets the head and a layer that kept its activations with everything saved; the last
  // checkpointed layer (ckpt - 1) after the kept ones have freed theirs (with none kept, that is everything
  // saved), with its recompute on top.
  int64_t peak = saved + std::max(head, ckpt < layers ? working : int64_t{0});
  if (ckpt > 0) {
    // Less the recompute's input, which CheckpointFn saved: the fused input norm saves that tensor, and so
    // does the ATen one in fp32 (x.to(fp32) is x itself).
    const int64_t recompute = T * (per_layer - (fused ? s * D : s == 4 ? 4 * D : 0)) + gathered;
    peak = std::max(peak, T * ckpt * s * D + kept + recompute + working);
  }
  return peak;
}

// The sequences one rank's training rollout has in play: its share of the step's, and with rollout.partial
// its share of the extra groups.
int64_t rollout_sequences(const Config& c, int world) {
  const int64_t prompts = c.train.prompts_per_step + (c.rollout.partial ? partial_extra_prompts(c, world) : 0);
  return prompts * c.sampling.samples_per_prompt / world;
}

// Cache rows of a rollout of `samples` sequences (G per prompt) under rollout.max_batch: the rollout
// starts at least one whole prompt.
int64_t cache_rows(const RolloutOptions& r, int64_t samples, int64_t G) {
  if (r.max_batch <= 0) return samples;
  return std::min(samples, std::max(r.max_batch, G));
}

// train.rollout_ranks: a bucket of the weights' broadcast, up to train.rollout_sync_mb or the largest tensor,
// and at most the whole model.
int64_t sync_bucket_bytes(const Config& c, const Shape& sh, int64_t s) {
  return std::min(s * sh.P, std::max<int64_t>(c.train.rollout_sync_mb << 20, s * sh.largest));
}

}  // namespace

int64_t parameter_count(const ModelConfig& m) {
  Config c;
  return shape_of(c, m).P;
}

std::string count_text(int64_t n) {
  if (n < 100000) return std::to_string(n);
  const double x = double(n) / (n >= 1000000000 ? 1e9 : 1e6);
  const char unit = n >= 1000000000 ? 'B' : 'M';
  char buf[32];
  std::snprintf(buf, sizeof buf, x >= 100 ? "%.0f%c" : x >= 10 ? "%.1f%c" : "%.2f%c", x, unit);
  return buf;
}

std::string bytes_text(int64_t bytes) {
  static const char* const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double x = double(bytes);
  int u = 0;
  while (x >= 1024 && u < 4) {
    x /= 1024;
    ++u;
  }
  if (u == 0) return std::to_string(bytes) + " B";
  char buf[32];
  std::snprintf(buf, sizeof buf, x >= 100 ? "%.0f %s" : x >= 10 ? "%.1f %s" : "%.2f %s", x, units[u]);
  return buf;
}

int64_t MemoryPlan::device_total() const {
  return persistent() + (phases_overlap ? rollout_phase() + update_phase() : std::max(rollout_phase(), update_phase()));
}

std::string MemoryPlan::table() const {
  std::ostringstream o;
  auto line = [&](const char* name, int64_t bytes, const std::string& note = "") {
    char buf[64];
    std::snprintf(buf, sizeof buf, "  %-16s %9s GiB", name, gib(bytes).c_str());
    o << buf << (note.empty() ? "" : "  " + note) << "\n";
  };
  o << "memory plan per rank (" << count_text(parameters) << " parameters, " << count_text(trainable) << " trained, "
    << world << " rank" << (world == 1 ? "" : "s") << "):\n";
  line("weights", weights);
  line("gradients", gradients);
  line("grad buffers", grad_buffers);
  line("masters", masters);
  line("moments", moments);
  line("optimizer step", optimizer_step);
  line("reference", reference);
  line("rollout weights", rollout_weights);
  line("kv cache", kv_cache);
  if (graph_pool > 0) line("graph pool", graph_pool, "(the rollout's CUDA graphs: logits and temporaries)");
  line("activations", activations);
  if (reward_model > 0) line("reward model", reward_model, "(reward.model_path: its weights and one scoring forward)");
  if (critic > 0)
    line("critic", critic, "(critic.shared false: its weights, masters and moments, and a sharded state's gradients)");
  if (critic_gradients > 0) line("critic grads", critic_gradients, "(through the update)");
  if (workspaces > 0) line("cuBLAS", workspaces, "(a workspace for each stream and thread that runs GEMMs)");
  if (parked > 0) line("parked", parked, "(of the above, in pinned host memory while the rollout runs)");
  line("device total", device_total(),
       std::string("(weights to reference") +
           (gradients_persist ? (workspaces > 0 ? ", the gradients" : " and the gradients") : "") +
           (workspaces > 0 ? " and cuBLAS" : "") + ", plus " + (phases_overlap ? "the sum" : "the larger") +
           " of the rollout's " + gib(rollout_phase()) + " and the update's " + gib(update_phase()) + ")");
  if (host_total() > 0) {
    line("host memory", host_total(),
         "(pinned: " +
             std::string(host_optimizer > 0 ? "train.offload's masters and moments " + gib(host_optimizer) : "") +
             (host_optimizer > 0 && parked > 0 ? ", " : "") +
             (parked > 0 ? "train.phase_offload's parked state " + gib(parked) : "") + ", each buffer whole pages " +
             gib(host_rounding) + ")");
  }
  return o.str();
}

int64_t reward_model_bytes(const Config& c) {
  if (!c.reward.uses(RewardKind::kModel) || c.reward.model_path.empty()) return 0;
  const ModelConfig rm = load_model_config(c.reward.model_path);
  const int64_t s = c.model.dtype == DType::kBFloat16 ? 2 : 4;
  // The weights, and one scoring forward without gradients: the hidden states and the residual, and the
  // largest layer temporaries (q/k/v, attention's output and the keys and values gathered for shared
  // prefixes, up to RewardModel::kKeysPerToken a token; or gate/up and their product).
  const int64_t D = rm.hidden_size, F = rm.intermediate_size, qkv = (rm.num_heads + 2 * rm.num_kv_heads) * rm.head_dim;
  const int64_t gathered = RewardModel::kKeysPerToken * 2 * rm.num_kv_heads * rm.head_dim;
  const int64_t per_token = 2 * D + std::max(qkv + rm.num_heads * rm.head_dim + gathered, 3 * F);
  return s * parameter_count(rm) + s * c.reward.model_batch_tokens * per_token;
}

int64_t graph_pool_bytes(const Config& c, const ModelConfig& m, int64_t rows) {
  const bool cuda = c.model.device.rfind("cuda", 0) == 0;
  if (!cuda || !c.rollout.engine.cuda_graphs || rows <= 0) return 0;
  int64_t positions = rows;
  if (c.rollout.speculative != Speculative::kNone) {
    positions =
        std::max(positions, verify_bucket_positions(c.rollout.speculative_max_rows, c.rollout.draft_tokens + 1, rows));
  }
  return 2 * positions * m.vocab_size * 4 + kGraphPoolTemporaries;
}

int cublas_workspace_pairs(const Config& c, bool rollout_rank) {
  if (c.model.device.rfind("cuda", 0) != 0) return 0;
  const bool async = !rollout_rank && c.train.rollout_ranks == 0 && c.train.async != AsyncMode::kOff;
  const bool graphs = c.rollout.engine.cuda_graphs;
  // With train.async the rollout's thread captures; an evaluation captures from the training thread.
  const bool evaluates = c.train.eval_prompts > 0 || !c.data.eval_path.empty();
  return (rollout_rank ? 1 : 2) + (graphs ? 1 : 0) + (async ? 1 : 0) + (async && graphs && evaluates ? 1 : 0);
}

MemoryPlan plan_memory(const Config& c, const ModelConfig& m, int world) {
  MemoryPlan p;
  const Shape sh = shape_of(c, m);
  const int64_t N = std::max(1, world);
  const int64_t s = c.model.dtype == DType::kBFloat16 ? 2 : 4;
  const bool cuda = c.model.device.rfind("cuda", 0) == 0;
  const ShardStage stage = c.train.shard;
  const bool lora = c.lora.enabled();
  const bool gathers = stage == ShardStage::kParameters && N > 1;
  const StepShape shape = step_shape(c, world);
  const bool accumulates = shape.micro < shape.mini;  // several backwards per optimizer step
  int64_t chunks = 0;                                 // a sharded state's weight chunks in the model's dtype
  p.parameters = sh.P;
  p.world = world;
  // What the optimizer updates: the model, or its fp32 adapters (the base frozen in the model dtype).
  const int64_t T = lora ? sh.adapters : sh.P;
  const int64_t w = lora ? 4 : s;  // bytes of a trainable weight
  p.trainable = T;
  p.weights = s * sh.P + (lora ? 4 * sh.adapters : 0);
  // A tied embedding is used twice, by the LM head and by the embedding: the backward holds the head's
  // gradient, in the trained weight's dtype, until the embedding's arrives and the two are summed, so the
  // three are alive at once where an untied model holds one (the 0.5B's 259 MiB on an H200).
  const int64_t tied =
      !lora && m.head == ModelHead::kCausalLm && m.tie_word_embeddings ? w * m.vocab_size * m.hidden_size : 0;

  if (stage == ShardStage::kNone && c.train.offload == Offload::kNone) {
    // make_optimizer's torch::optim::AdamW. A bf16 model with train.master_weights fp32: fp32 masters,
    // whose fp32 gradients accumulate the micro-batches (accumulate_gradients), and fp32 moments; the bf16
    // gradients of a backward wait whole until it ends (optim.cpp backward) before they are added in, so
    // with several micro-batches a step they sit beside the fp32 sums of the previous ones. Otherwise the
    // model's (or the adapters') own gradients and moments, in their dtype; autograd accumulates the
    // micro-batches in place.
    const bool masters = !lora && s == 2 && c.train.master_weights == MasterWeights::kFp32;
    const int64_t stepped = masters ? 4 : w;
    p.gradients = stepped * T;
    p.grad_buffers = (masters && accumulates ? 2 * T : 0) + tied;
    p.masters = masters ? 4 * T : 0;
    p.moments = 2 * stepped * T;
    // step_multi_tensor's denominator, the square roots of exp_avg_sq over a round of at most
    // kAdamWRoundElems elements (parallel/adamw.h), scaled in place: one temporary.
    p.optimizer_step = stepped * std::min<int64_t>(kAdamWRoundElems, T);
  } else {
    // ShardedState (parallel/shard.h): the trainable tensors in units (a decoder layer's, or one other
    // tensor), each split into Ns chunks (Ns = 1 for train.offload alone). A rank holds the fp32 chunks
    // of the masters, the moments and the summed gradient (G.master, G.exp_avg/_sq, G.grad) and a chunk of
    // the weights in their dtype (G.weights: the weights themselves under shard parameters, else the
    // rounded masters that are all-gathered into the model). The backward adds each gradient into an
    // fp32 whole as it is produced (no wait for the backward's end); under shard optimizer those wholes
    // live through the step's micro-batches, under gradients and parameters a unit is reduce-scattered
    // and freed once complete: the unit being summed, and two in flight (ShardedState's reduce slots), each
    // an fp32 whole and its chunk. Under shard none and optimizer the wholes of every tensor meet the two
    // slots in the last backward (made at its first reduce, freed by the step). Beside them, the gradient
    // the backward hands over in the trained weight's dtype, before it is added in: the largest tensor's,
    // and a tied embedding's held one.
    const int64_t Ns = stage == ShardStage::kNone ? 1 : N;
    const int64_t unit = lora ? sh.adapters / std::max<int64_t>(1, m.num_layers) : std::max(sh.layer, sh.largest);
    if (gathers && !lora) {
      // The rank's chunk, and gathered: two layers (the next one's gather starts before the current one
      // is freed) and the embedding, final norm and head for the whole micro-batch.
      p.weights = s * sh.P / N + s * (2 * sh.layer + sh.outer);
      chunks = s * sh.P / N;
    } else {
      p.weights += w * T / Ns;
      chunks = w * T / Ns;
    }
    p.gradients = 4 * T / Ns;
    const int64_t slots = int64_t(ShardedState::kReduceSlots) * (4 * unit + (Ns > 1 ? 4 * unit / Ns : 0));
    p.grad_buffers = (stage >= ShardStage::kGradients && N > 1 ? 2 * (4 + 4) * unit : 4 * T + slots) +
                     w * (lora ? sh.adapter_max : sh.largest) + tied;
    p.masters = 4 * T / Ns;
    p.moments = 8 * T / Ns;
    // ShardedState::step's gradient norm, at::sum(chunk.square(), kDouble) over 2^24 elements at a time
    // (kNormChunk): the squares in fp32 and their float64 cast (a reduction to another dtype casts its
    // input first), 12 bytes an element. It runs on the device even with train.offload, and before
    // adamw_step, whose one temporary (the denominator over at most 2^24 elements, kAdamWRoundElems) is smaller.
    p.optimizer_step = 12 * std::min<int64_t>(int64_t{1} << 24, T / Ns);
  }
  // The pinned host buffers behind host_optimizer and parked, in bytes.
  std::vector<int64_t> pinned;
  const bool sharded_state = !(stage == ShardStage::kNone && c.train.offload == Offload::kNone);
  // The masters and moments as their buffers: a sharded state's three chunks, or the replicated AdamW's
  // per trainable tensor (the adapters' with LoRA).
  auto state_buffers = [&] {
    if (sharded_state) {
      pinned.insert(pinned.end(), {p.masters, p.moments / 2, p.moments / 2});
      return;
    }
    const int64_t stepped = p.masters > 0 ? 4 : w;
    std::vector<int64_t> tensors;
    if (lora) {
      for (const Projection& q : targeted_projections(c, m)) {
        for (int64_t l = 0; l < m.num_layers; ++l)
          tensors.insert(tensors.end(), {c.lora.rank * q.in, q.out * c.lora.rank});
      }
    } else {
      for (int64_t l = 0; l < m.num_layers; ++l) {
        for (int64_t n : layer_tensors(m)) tensors.push_back(n);
      }
      for (int64_t n : outer_tensors(m)) tensors.push_back(n);
    }
    for (int64_t n : tensors) {
      if (p.masters > 0) pinned.push_back(4 * n);
      pinned.insert(pinned.end(), {stepped * n, stepped * n});
    }
  };
  if (c.train.offload == Offload::kOptimizer) {
    // OffloadedAdamW: masters and moments in pinned host memory, stepped there (parallel/adamw.h).
    p.host_optimizer = p.masters + p.moments;
    state_buffers();
    p.masters = p.moments = 0;
    // offload_step device: a step streams the masters and moments through chunk slots made for the step.
    // The run resolves auto before it plans; unresolved, the plan counts the slots as the bound.
    if (cuda && c.train.offload_step != OffloadStep::kHost) {
      p.optimizer_step = std::max(p.optimizer_step, stream_step_device_bytes(T / (stage == ShardStage::kNone ? 1 : N)));
    }
  }
  // ensure_reference: a clone of the whole model.
  if (c.objective.kl_coef > 0) p.reference = s * sh.P;

  // The rollout: DecodeEngine's packed weights (fused kernels on CUDA), the merged LoRA projections, and
  // under shard parameters the whole weights gathered.
  const int64_t packed = cuda && c.rollout.engine.fused_kernels && c.rollout.engine.packed_weights ? s * sh.packed : 0;
  const int64_t gathered = gathers && !lora ? s * sh.P : 0;
  p.rollout_weights = packed + (lora ? s * sh.targeted : 0) + gathered;
  // With train.rollout_ranks the training ranks decode the evaluation alone, in turn with the update, and
  // rank 0 makes a bucket of the weights' broadcast before the update.
  const bool samples = c.train.rollout_ranks == 0;
  if (!samples) p.rollout_weights += sync_bucket_bytes(c, sh, s);
  // train.async: the rollout's own copy of the weights (with LoRA the merged copy above; under shard
  // parameters it takes the place of the gathered weights), held through the update.
  p.phases_overlap = samples && c.train.async != AsyncMode::kOff;
  if (p.phases_overlap && !lora) p.rollout_weights += s * sh.P - gathered;
  // KvCache::allocate: k and v per layer (rows, Hkv, slots, hd) in the model dtype, int64 positions, and
  // DecodeEngine's bool slot mask. The training rollout's rows (one rank's share), or an evaluation's
  // (train.eval_prompts x eval_samples over the ranks), whichever is more.
  const int64_t G = c.sampling.samples_per_prompt;
  const int64_t slot = 2 * m.num_layers * m.num_kv_heads * m.head_dim * s + 8 + 1;
  const int64_t train_rows = samples ? cache_rows(c.rollout, rollout_sequences(c, N), G) : 0;
  const int64_t k = c.train.eval_samples;
  const int64_t eval_rows = cache_rows(c.rollout, (c.train.eval_prompts + N - 1) / N * k, k);
  p.kv_cache = std::max(train_rows, eval_rows) * c.rollout.max_context * slot;
  p.graph_pool = graph_pool_bytes(c, m, std::max(train_rows, eval_rows));
  if (c.rollout.engine.keep_cache && samples)  // with LoRA the merged copy that the kept engine decodes too
    p.held_through_update += train_rows * c.rollout.max_context * slot + packed + graph_pool_bytes(c, m, train_rows) +
                             (lora ? s * sh.targeted : 0);
  if (c.rollout.keep_weights) p.held_through_update += gathered;

  p.activations = activation_bytes(c, m, world, s, !cuda);
  p.reward_model = reward_model_bytes(c);
  p.workspaces = cublas_workspace_pairs(c) * cublas_workspace_bytes();
  if (!c.critic.shared) {
    // The critic's own training state, planned as a run of it alone at its stage; no rollout, reference or
    // offload of its own.
    Config cc = c;
    cc.critic.shared = true;
    cc.train.shard = c.critic.stage(c.train.shard);
    cc.train.offload = Offload::kNone;
    cc.objective.kl_coef = 0;
    cc.lora = LoraOptions{};  // beside LoRA's adapters, a whole model of its own
    // Its weight chunks stay under the parameters stage: nothing gathers its weights for the rollout.
    if (cc.train.shard == ShardStage::kParameters && cc.train.phase_offload == PhaseOffload::kTrainingState)
      cc.train.phase_offload = PhaseOffload::kOptimizer;
    const MemoryPlan q = plan_memory(cc, critic_model_config(c, m), world);
    p.critic = q.weights + q.masters + q.moments + (q.gradients_persist ? q.gradients : 0);
    p.critic_gradients = (q.gradients_persist ? 0 : q.gradients) + q.grad_buffers;
    p.activations = std::max(p.activations, q.activations);
    p.optimizer_step = std::max(p.optimizer_step, q.optimizer_step);
    p.parked += q.parked;
    p.host_rounding += q.host_rounding;
  }
  // train.phase_offload: the masters and moments in host memory while the rollout runs (the sharded state's
  // gradient chunk leaves too, freed as it is zero between steps: it is the update's alone then, as the
  // replicated optimizer's gradients always are); training_state adds the weight chunks.
  p.gradients_persist = sharded_state && c.train.phase_offload == PhaseOffload::kNone;
  if (c.train.phase_offload != PhaseOffload::kNone) {
    p.parked += p.masters + p.moments;
    if (p.masters + p.moments > 0) state_buffers();
  }
  if (c.train.phase_offload == PhaseOffload::kTrainingState) {
    p.parked += chunks;
    pinned.push_back(chunks);
  }
  // Each buffer whole pages (pinned_host_zeros).
  for (int64_t b : pinned) p.host_rounding += pinned_host_bytes(b) - b;
  return p;
}

MemoryPlan plan_rollout_rank(const Config& c, const ModelConfig& m, int rollout_ranks) {
  MemoryPlan p;
  const Shape sh = shape_of(c, m);
  const int64_t s = c.model.dtype == DType::kBFloat16 ? 2 : 4;
  const bool cuda = c.model.device.rfind("cuda", 0) == 0;
  p.parameters = sh.P;
  p.world = rollout_ranks;
  // The model as loaded (with LoRA its adapters too, in fp32, and the merged projections it decodes), the
  // packed weights of the fused kernels, and the cache of its share of the step's rows.
  p.weights = s * sh.P + (c.lora.enabled() ? 4 * sh.adapters : 0);
  // With them, one bucket of the weights' broadcast (train.rollout_sync_mb, or a larger tensor alone).
  const int64_t packed = cuda && c.rollout.engine.fused_kernels && c.rollout.engine.packed_weights ? s * sh.packed : 0;
  p.rollout_weights = packed + (c.lora.enabled() ? s * sh.targeted : 0) + sync_bucket_bytes(c, sh, s);
  const int64_t G = c.sampling.samples_per_prompt;
  const int64_t slot = 2 * m.num_layers * m.num_kv_heads * m.head_dim * s + 8 + 1;
  const int64_t rows = cache_rows(c.rollout, c.train.prompts_per_step * G / std::max(1, rollout_ranks), G);
  p.kv_cache = rows * c.rollout.max_context * slot;
  p.graph_pool = graph_pool_bytes(c, m, rows);
  p.reward_model = reward_model_bytes(c);
  p.workspaces = cublas_workspace_pairs(c, /*rollout_rank=*/true) * cublas_workspace_bytes();
  return p;
}

namespace {

struct Change {
  std::string what;                    // "train.shard: gradients"
  std::function<void(Config&)> apply;  // makes it
};

// The changes to try, each alone: only those that alter the config.
std::vector<Change> single_changes(const Config& c, int world) {
  std::vector<Change> out;
  if (world > 1) {
    for (ShardStage st : {ShardStage::kOptimizer, ShardStage::kGradients, ShardStage::kParameters}) {
      if (st <= c.train.shard) continue;
      out.push_back({std::string("train.shard: ") + enum_to_string(st), [st](Config& x) { x.train.shard = st; }});
    }
  }
  // train.offload and phase_offload optimizer exclude each other: with both in a combination, train.offload's
  // holds. training_state goes with either, once a sharded state exists (train.shard or train.offload).
  if (c.train.offload == Offload::kNone) {
    out.push_back({"train.offload: optimizer", [](Config& x) {
                     x.train.offload = Offload::kOptimizer;
                     if (x.train.phase_offload == PhaseOffload::kOptimizer) x.train.phase_offload = PhaseOffload::kNone;
                   }});
  }
  const bool phases_take_turns = c.train.async == AsyncMode::kOff && c.train.rollout_ranks == 0;
  if (c.train.phase_offload == PhaseOffload::kNone && c.train.offload == Offload::kNone && phases_take_turns) {
    out.push_back({"train.phase_offload: optimizer", [](Config& x) {
                     if (x.train.offload == Offload::kNone && x.train.phase_offload == PhaseOffload::kNone)
                       x.train.phase_offload = PhaseOffload::kOptimizer;
                   }});
  }
  if (c.train.phase_offload != PhaseOffload::kTrainingState && phases_take_turns &&
      (world > 1 || c.train.offload != Offload::kNone)) {
    out.push_back({"train.phase_offload: training_state", [](Config& x) {
                     if (x.train.shard != ShardStage::kNone || x.train.offload != Offload::kNone)
                       x.train.phase_offload = PhaseOffload::kTrainingState;
                   }});
  }
  if (!c.model.activation_checkpointing)
    out.push_back({"model.activation_checkpointing: true", [](Config& x) { x.model.activation_checkpointing = true; }});
  if (c.loss.impl != LogprobImpl::kCce)
    out.push_back({"loss.impl: cce", [](Config& x) { x.loss.impl = LogprobImpl::kCce; }});
  if (!c.lora.enabled()) out.push_back({"lora.rank: 64", [](Config& x) { x.lora.rank = 64; }});
  return out;
}

// The most rows of `field` in [1, current) for which the plan of `c` (with `set`) fits, or 0.
int64_t most_rows_that_fit(const Config& c, const ModelConfig& m, int world, int64_t budget, int64_t current,
                           const std::function<void(Config&, int64_t)>& set) {
  int64_t lo = 0, hi = current - 1;  // lo: fits (0: none known); hi: the largest to try
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    Config x = c;
    set(x, mid);
    if (plan_memory(x, m, world).device_total() <= budget)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

}  // namespace

void check_memory_plan(const MemoryPlan& plan, const Config& c, const ModelConfig& m, int world, int64_t device_bytes) {
  if (device_bytes <= 0 || plan.device_total() <= device_bytes) return;
  std::ostringstream msg;
  msg << "the run needs " << gib(plan.device_total()) << " GiB per rank on " << c.model.device << ", which has "
      << gib(device_bytes) << " GiB (train.shard " << enum_to_string(c.train.shard) << ", " << world
      << (world == 1 ? " rank" : " ranks") << "):\n"
      << plan.table();
  std::vector<std::string> fits;
  auto planned = [&](const Config& x) { return plan_memory(x, m, world).device_total(); };
  for (const Change& ch : single_changes(c, world)) {
    Config x = c;
    ch.apply(x);
    const int64_t need = planned(x);
    if (need <= device_bytes) fits.push_back(ch.what + " (" + gib(need) + " GiB)");
  }
  // Fewer rows: the rollout's cache rows, the update's micro-batch.
  const int64_t rows = c.rollout.max_batch > 0 ? c.rollout.max_batch : rollout_sequences(c, std::max(1, world));
  const int64_t mb =
      most_rows_that_fit(c, m, world, device_bytes, rows, [](Config& x, int64_t n) { x.rollout.max_batch = n; });
  if (mb > 0) {
    Config x = c;
    x.rollout.max_batch = mb;
    fits.push_back("rollout.max_batch: " + std::to_string(mb) + " (" + gib(planned(x)) + " GiB)");
  }
  const int64_t micro = step_shape(c, world).micro;
  const int64_t mu =
      most_rows_that_fit(c, m, world, device_bytes, micro, [](Config& x, int64_t n) { x.train.micro_batch_size = n; });
  if (mu > 0) {
    Config x = c;
    x.train.micro_batch_size = mu;
    fits.push_back("train.micro_batch_size: " + std::to_string(mu) + " (" + gib(planned(x)) + " GiB)");
  }
  // A token budget under the micro-batch's tokens (train.micro_batch_tokens): the largest on a 1,024-token grid
  // that fits, when it holds more than one sequence of rollout.max_context.
  const int64_t tokens_now = c.train.micro_batch_tokens > 0
                                 ? std::min(c.train.micro_batch_tokens, micro * c.rollout.max_context)
                                 : micro * c.rollout.max_context;
  const int64_t bt = most_rows_that_fit(c, m, world, device_bytes, tokens_now,
                                        [](Config& x, int64_t n) { x.train.micro_batch_tokens = n; }) /
                     1024 * 1024;
  if (bt > c.rollout.max_context) {
    Config x = c;
    x.train.micro_batch_tokens = bt;
    fits.push_back("train.micro_batch_tokens: " + std::to_string(bt) + " (" + gib(planned(x)) + " GiB)");
  }
  if (fits.empty()) {
    // No change alone: the one that saves most, then the next on top of it, ..., then the most cache rows
    // that fit under them; then each change is dropped again where the rest fits without it.
    std::vector<Change> pool = single_changes(c, world), chosen;
    Config x = c;
    while (planned(x) > device_bytes && !pool.empty()) {
      size_t best = 0;
      int64_t best_need = 0;
      for (size_t i = 0; i < pool.size(); ++i) {
        Config y = x;
        pool[i].apply(y);
        const int64_t need = planned(y);
        if (i == 0 || need < best_need) best = i, best_need = need;
      }
      pool[best].apply(x);
      chosen.push_back(pool[best]);
      pool.erase(pool.begin() + best);
    }
    auto with = [&](const std::vector<Change>& changes) {
      Config y = c;
      for (const Change& ch : changes) ch.apply(y);
      return y;
    };
    int64_t rows_fit = 0;
    if (planned(x) > device_bytes) {
      rows_fit =
          most_rows_that_fit(x, m, world, device_bytes, rows, [](Config& y, int64_t v) { y.rollout.max_batch = v; });
      if (rows_fit > 0) {
        const int64_t n = rows_fit;
        chosen.push_back({"rollout.max_batch: " + std::to_string(n), [n](Config& y) { y.rollout.max_batch = n; }});
        x = with(chosen);
      }
    }
    if (planned(x) <= device_bytes) {
      for (size_t i = chosen.size(); i-- > 0;) {
        if (chosen[i].what.rfind("rollout.max_batch", 0) == 0) continue;
        std::vector<Change> fewer = chosen;
        fewer.erase(fewer.begin() + i);
        if (planned(with(fewer)) <= device_bytes) chosen = fewer;
      }
      x = with(chosen);
    }
    std::string combined;
    for (const Change& ch : chosen) combined += (combined.empty() ? "" : ", ") + ch.what;
    if (!chosen.empty() && planned(x) <= device_bytes) {
      msg << "No single change fits; together, " << combined << " plan " << gib(planned(x)) << " GiB.";
    } else {
      msg << "Nothing fits: even with " << (combined.empty() ? "every saving on" : combined) << " the plan needs "
          << gib(planned(x))
          << " GiB; use more ranks (with train.shard), fewer rollout.max_context tokens or a smaller model.";
    }
  } else {
    msg << "What fits (each re-planned alone):";
    for (const auto& f : fits) msg << "\n  " << f;
  }
  throw RunError(msg.str());
}

void check_host_memory(const MemoryPlan& plan, int ranks, int64_t host_bytes) {
  const int64_t need = int64_t(ranks) * plan.host_total();
  if (host_bytes <= 0 || need <= host_bytes) return;
  throw RunError("the memory plan needs " + bytes_text(need) + " of pinned host memory on one host (" +
                 std::to_string(ranks) + " rank" + (ranks == 1 ? "" : "s") + " x " + bytes_text(plan.host_total()) +
                 ") and the host has " + bytes_text(host_bytes) + " available (MemAvailable):\n" + plan.table() +
                 "spread the ranks over more hosts (each holds its own ranks' share), train fewer parameters "
                 "(lora.rank), or leave train.offload and train.phase_offload off");
}

static std::function<int64_t()>& host_memory_probe() {
  static std::function<int64_t()> probe;
  return probe;
}

void set_host_memory_probe(std::function<int64_t()> probe) { host_memory_probe() = std::move(probe); }

int64_t host_memory_bytes() {
  if (host_memory_probe()) return host_memory_probe()();
  std::ifstream f("/proc/meminfo");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind("MemAvailable:", 0) == 0) return std::stoll(line.substr(13)) * 1024;  // "... kB"
  }
  return 0;
}

int64_t fewest_checkpointed_layers(const Config& c, const ModelConfig& m, int world, int64_t device_bytes) {
  const int64_t layers = m.num_layers;
  if (device_bytes <= 0 || checkpointed_layers(c.model, layers) < layers || layers == 0) return -1;
  // Sharded at parameters (the policy, or a separate critic) a layer's weights are gathered again for its
  // backward, so every layer recomputes: a count is a config error there.
  if (c.train.shard == ShardStage::kParameters ||
      (!c.critic.shared && c.critic.stage(c.train.shard) == ShardStage::kParameters))
    return -1;
  auto fits = [&](int64_t n) {
    Config x = c;
    x.model.checkpoint_layers = n;
    return plan_memory(x, m, world).device_total() <= device_bytes / 10 * 9;
  };
  if (!fits(layers)) return -1;
  int64_t lo = 0, hi = layers;  // hi fits; find the fewest that does (the plan shrinks as n grows)
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (fits(mid))
      hi = mid;
    else
      lo = mid + 1;
  }
  return hi < layers ? hi : -1;
}

int64_t device_memory_bytes(const at::Device& device) {
#ifdef RLT_HAVE_CUDA
  if (device.is_cuda()) {
    const c10::DeviceIndex idx = device.index() < 0 ? 0 : device.index();
    c10::cuda::CUDAGuard guard(idx);
    // The caching allocator's statistics exist once it has served the device (before, it refuses the
    // device as invalid): one small allocation makes sure.
    (void)at::empty({1}, at::TensorOptions().device(at::Device(at::kCUDA, idx)));
    size_t free = 0, total = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(idx);
    return static_cast<int64_t>(free) + stats.reserved_bytes[0].current;  // index 0: aggregate over pools
  }
#endif
  (void)device;
  return 0;
}

}  // namespace rlt
