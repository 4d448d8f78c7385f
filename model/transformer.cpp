// The decoder forward, following the Hugging Face reference implementations operation by operation
// (RMSNorm in fp32, RoPE tables in fp32, attention softmax in fp32), so that fp32 logits agree with
// transformers to ~1e-5 (tests/model/test_transformer.cpp).
#include "model/transformer.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <mutex>
#include <tuple>

#include "model/safetensors.h"

#ifdef RLT_HAVE_CUDA
#include "model/cuda/decode_kernels.h"
#endif

namespace rlt {

namespace {

// RMSNorm over the last dim in fp32 (HF): llama-style w * x_hat cast back; gemma-style x_hat * (1 + w).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool gemma) {
  at::Tensor xf = x.to(at::kFloat);
  xf = xf * at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  if (gemma) return (xf * (1.0 + w.to(at::kFloat))).to(x.scalar_type());
  return w * xf.to(x.scalar_type());
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  return b.defined() ? at::linear(x, w, b) : at::linear(x, w);
}

// [x1, x2] -> [-x2, x1] on the last dim (RoPE's rotate_half).
at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t h = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
}

// Inverse frequencies (hd / 2) in fp32, as transformers computes them (default and llama3 rope types).
at::Tensor inv_frequencies(const ModelConfig& c, const at::Device& dev) {
  auto f32 = at::TensorOptions().dtype(at::kFloat).device(dev);
  at::Tensor exponent = at::arange(0, c.head_dim, 2, f32.dtype(at::kLong)).to(at::kFloat) / double(c.head_dim);
  at::Tensor inv = 1.0 / at::pow(at::scalar_tensor(c.rope_theta, f32), exponent);
  if (c.rope_type == "llama3") {
    const double old_ctx = double(c.rope_original_max_positions);
    const double low_wavelen = old_ctx / c.rope_low_freq_factor, high_wavelen = old_ctx / c.rope_high_freq_factor;
    at::Tensor wavelen = 2 * M_PI / inv;
    at::Tensor scaled = at::where(wavelen > low_wavelen, inv / c.rope_factor, inv);
    at::Tensor smooth =
        (old_ctx / wavelen - c.rope_low_freq_factor) / (c.rope_high_freq_factor - c.rope_low_freq_factor);
    at::Tensor smoothed = (1 - smooth) * scaled / c.rope_factor + smooth * scaled;
    at::Tensor medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen);
    inv = at::where(medium, smoothed, scaled);
  }
  return inv;
}

// The parameters of a model: HF name -> shape, in a fixed order.
std::vector<std::pair<std::string, std::vector<int64_t>>> parameter_shapes(const ModelConfig& c) {
  const int64_t D = c.hidden_size, F = c.intermediate_size, qd = c.num_heads * c.head_dim,
                kvd = c.num_kv_heads * c.head_dim;
  std::vector<std::pair<std::string, std::vector<int64_t>>> s;
  s.push_back({"model.embed_tokens.weight", {c.vocab_size, D}});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    s.push_back({p + "input_layernorm.weight", {D}});
    s.push_back({p + "self_attn.q_proj.weight", {qd, D}});
    s.push_back({p + "self_attn.k_proj.weight", {kvd, D}});
    s.push_back({p + "self_attn.v_proj.weight", {kvd, D}});
    s.push_back({p + "self_attn.o_proj.weight", {D, qd}});
    if (c.qkv_bias) {
      s.push_back({p + "self_attn.q_proj.bias", {qd}});
      s.push_back({p + "self_attn.k_proj.bias", {kvd}});
      s.push_back({p + "self_attn.v_proj.bias", {kvd}});
    }
    if (c.o_bias) s.push_back({p + "self_attn.o_proj.bias", {D}});
    if (c.qk_norm) {
      s.push_back({p + "self_attn.q_norm.weight", {c.head_dim}});
      s.push_back({p + "self_attn.k_norm.weight", {c.head_dim}});
    }
    s.push_back({p + "post_attention_layernorm.weight", {D}});
    if (c.gemma_norms) {
      s.push_back({p + "pre_feedforward_layernorm.weight", {D}});
      s.push_back({p + "post_feedforward_layernorm.weight", {D}});
    }
    s.push_back({p + "mlp.gate_proj.weight", {F, D}});
    s.push_back({p + "mlp.up_proj.weight", {F, D}});
    s.push_back({p + "mlp.down_proj.weight", {D, F}});
  }
  s.push_back({"model.norm.weight", {D}});
  if (!c.tie_word_embeddings) s.push_back({"lm_head.weight", {c.vocab_size, D}});
  return s;
}

// Activation checkpointing: the layer runs without a graph in the forward and again, with one, in the
// backward (reentrant, as torch.utils.checkpoint's original form), which accumulates the parameter
// gradients directly and returns the input's. The layer closure lives in the autograd context (a
// capsule), so it lasts exactly as long as the graph that needs it.
// `fn(x, backward)` runs the layer (backward: the recompute); `done` runs after the layer's backward.
struct LayerFnHolder : torch::CustomClassHolder {
  LayerFnHolder(std::function<at::Tensor(const at::Tensor&, bool)> f, std::function<void()> d)
      : fn(std::move(f)), done(std::move(d)) {}
  std::function<at::Tensor(const at::Tensor&, bool)> fn;
  std::function<void()> done;
};

class CheckpointFn : public torch::autograd::Function<CheckpointFn> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& h,
                                                c10::intrusive_ptr<LayerFnHolder> layer) {
    ctx->save_for_backward({h});
    at::Tensor out;
    {
      at::NoGradGuard ng;
      out = layer->fn(h, false);
    }
    ctx->saved_data["layer"] = c10::IValue::make_capsule(std::move(layer));
    return {out};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    at::Tensor h = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    auto layer = c10::static_intrusive_pointer_cast<LayerFnHolder>(ctx->saved_data["layer"].toCapsule());
    at::Tensor out;
    {
      at::AutoGradMode on(true);
      out = layer->fn(h, true);
    }
    torch::autograd::backward({out}, {grads[0]});
    if (layer->done) layer->done();
    return {h.grad(), at::Tensor()};
  }
};

}  // namespace

NoCudnnAttention::NoCudnnAttention(bool active) : active_(active) {
  if (!active_) return;
  previous_ = at::globalContext().userEnabledCuDNNSDP();
  at::globalContext().setSDPUseCuDNN(false);
}

NoCudnnAttention::~NoCudnnAttention() {
  if (active_) at::globalContext().setSDPUseCuDNN(previous_);
}

KvCache KvCache::allocate(const ModelConfig& c, int64_t batch, int64_t max_len, const at::TensorOptions& opts) {
  KvCache kv;
  kv.max_len = max_len;
  for (int64_t i = 0; i < c.num_layers; ++i) {
    kv.k.push_back(at::zeros({batch, c.num_kv_heads, max_len, c.head_dim}, opts));
    kv.v.push_back(at::zeros({batch, c.num_kv_heads, max_len, c.head_dim}, opts));
  }
  kv.positions = at::zeros({batch, max_len}, opts.dtype(at::kLong));
  return kv;
}

namespace {

// (B, Hkv, S, hd): row r's slot j is src's row r, slot slots[r, j]. src (B, Hkv, S0, hd), slots (B, S).
at::Tensor take_slots(const at::Tensor& src, const at::Tensor& slots) {
  const int64_t B = slots.size(0), S = slots.size(1);
  return src.gather(2, slots.view({B, 1, S, 1}).expand({B, src.size(1), S, src.size(3)}));
}

}  // namespace

void KvCache::squeeze_(const at::Tensor& slots) {
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == positions.size(0) && slots.size(1) <= max_len,
              "squeeze_: slots must be (B, S) with S <= ", max_len);
  const int64_t S = slots.size(1);
#ifdef RLT_HAVE_CUDA
  // One launch for every layer, moving only the slots that move (ATen's form: two kernels and a copy of
  // the layer per tensor, 1.1-1.7 ms a squeeze at 64 x 800 slots of Qwen2.5-0.5B on an H200).
  if (cuda::squeeze_slots_supports(k, v) && slots.is_contiguous()) {
    cuda::squeeze_slots_(k, v, slots);
  } else
#endif
  {
    for (auto* layers : {&k, &v}) {
      for (at::Tensor& t : *layers) t.narrow(2, 0, S).copy_(take_slots(t, slots));  // one layer's copy at a time
    }
  }
  positions.narrow(1, 0, S).copy_(positions.gather(1, slots));
  length = S;
}

void KvCache::put_rows_(const at::Tensor& rows, const KvCache& src, const at::Tensor& src_rows) {
  const int64_t S = src.length;
  TORCH_CHECK(rows.dim() == 1 && src_rows.sizes() == rows.sizes() && S <= max_len && src.k.size() == k.size(),
              "put_rows_: rows and src_rows must be (B') and src's ", S, " slots fit in ", max_len);
  for (size_t i = 0; i < k.size(); ++i) {
    k[i].narrow(2, 0, S).index_copy_(0, rows, src.k[i].narrow(2, 0, S).index_select(0, src_rows));
    v[i].narrow(2, 0, S).index_copy_(0, rows, src.v[i].narrow(2, 0, S).index_select(0, src_rows));
  }
  positions.narrow(1, 0, S).index_copy_(0, rows, src.positions.narrow(1, 0, S).index_select(0, src_rows));
}

KvCache KvCache::gather(const at::Tensor& rows, const at::Tensor& slots, int64_t new_max_len) const {
  TORCH_CHECK(rows.dim() == 1 && slots.dim() == 2 && slots.size(0) == rows.size(0),
              "gather: rows must be (B') and slots (B', S')");
  const int64_t B = rows.size(0), S = slots.size(1);
  TORCH_CHECK(S <= new_max_len, "gather: ", S, " slots do not fit in ", new_max_len);
  KvCache out;
  out.packed = packed;
  out.fused_kernels = fused_kernels;
  out.in_place_steps = in_place_steps;
  out.max_len = new_max_len;
  out.length = S;
  for (size_t i = 0; i < k.size(); ++i) {
    for (const auto* src : {&k[i], &v[i]}) {
      at::Tensor dst = at::zeros({B, src->size(1), new_max_len, src->size(3)}, src->options());
      dst.narrow(2, 0, S).copy_(take_slots(src->index_select(0, rows), slots));
      (src == &k[i] ? out.k : out.v).push_back(dst);
    }
  }
  out.positions = at::zeros({B, new_max_len}, positions.options());
  out.positions.narrow(1, 0, S).copy_(positions.index_select(0, rows).gather(1, slots));
  return out;
}

Transformer& Transformer::operator=(const Transformer& other) {
  if (this == &other) return *this;
  config_ = other.config_;
  embed_ = other.embed_;
  final_norm_ = other.final_norm_;
  lm_head_ = other.lm_head_;
  layers_ = other.layers_;
  checkpointing_ = other.checkpointing_;
  fused_kernels_ = other.fused_kernels_;
  residency_ = other.residency_;
  lora_ = other.lora_;
  lora_gen_ = other.lora_gen_;
  bind_names();  // by_name_ must point at this object's members, not other's
  return *this;
}

Transformer Transformer::clone() const {
  Transformer t;
  t.config_ = config_;
  t.checkpointing_ = checkpointing_;
  t.fused_kernels_ = fused_kernels_;
  t.bind_names();  // points t's name table at t's own members
  for (const auto& [name, ptr] : by_name_) {
    if (ptr->defined()) *t.by_name_.at(name) = ptr->detach().clone();
  }
  if (config_.tie_word_embeddings) t.lm_head_ = t.embed_;
  t.lora_ = lora_;
  if (lora_gen_.defined()) t.lora_gen_ = lora_gen_.clone();
  for (size_t i = 0; i < layers_.size(); ++i) {
    for (int k = 0; k < kLoraTargets; ++k) {
      if (!layers_[i].lora_a[k].defined()) continue;
      t.layers_[i].lora_a[k] = layers_[i].lora_a[k].detach().clone();
      t.layers_[i].lora_b[k] = layers_[i].lora_b[k].detach().clone();
    }
  }
  return t;
}

at::Tensor Transformer::Layer::*const Transformer::kLoraWeights[kLoraTargets] = {
    &Layer::q_w, &Layer::k_w, &Layer::v_w, &Layer::o_w, &Layer::gate_w, &Layer::up_w, &Layer::down_w};

void Transformer::attach_lora(const LoraOptions& options, uint64_t seed) {
  const std::vector<int> targets = options.target_indices();
  if (!options.enabled() || targets.empty()) throw std::invalid_argument("attach_lora: rank 0 or no target");
  lora_ = options;
  at::NoGradGuard no_grad;
  for (const auto& [name, ptr] : by_name_) {
    if (ptr->defined()) ptr->requires_grad_(false);  // the base is frozen
  }
  const at::ScalarType dt = embed_.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto dev = embed_.device();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (Layer& l : layers_) {
    l.lora_a.fill(at::Tensor());
    l.lora_b.fill(at::Tensor());
    for (int t : targets) {
      const at::Tensor& w = l.*kLoraWeights[t];  // (out, in)
      const double bound = 1.0 / std::sqrt(static_cast<double>(w.size(1)));
      l.lora_a[t] = at::empty({options.rank, w.size(1)}, dt).uniform_(-bound, bound, gen).to(dev).requires_grad_(true);
      l.lora_b[t] =
          at::zeros({w.size(0), options.rank}, at::TensorOptions().dtype(dt).device(dev)).requires_grad_(true);
    }
  }
  // The dropout masks' stream, apart from the initialisation's.
  const uint64_t dropout_seed = seed ^ 0x9E3779B97F4A7C15ull;
  if (dev.is_cpu()) {
    lora_gen_ = at::make_generator<at::CPUGeneratorImpl>(dropout_seed);
  } else {
    lora_gen_ = at::detail::getCUDAHooks().getNewGenerator(dev.index());
    lora_gen_.set_current_seed(dropout_seed);
  }
}

Transformer Transformer::merged() const {
  Transformer m = *this;  // shares every tensor; the targeted weights are replaced below
  m.lora_ = LoraOptions();
  m.lora_gen_ = at::Generator();
  for (size_t i = 0; i < layers_.size(); ++i) {
    Layer& ml = m.layers_[i];
    for (int k = 0; k < kLoraTargets; ++k) {
      if (ml.lora_a[k].defined()) {
        ml.*kLoraWeights[k] = lora_merged_weight(ml.*kLoraWeights[k], ml.lora_a[k], ml.lora_b[k], lora_.scale());
      }
      ml.lora_a[k] = ml.lora_b[k] = at::Tensor();
    }
  }
  return m;
}

void Transformer::merge_into(Transformer& dst) const {
  TORCH_CHECK(!dst.has_lora() && dst.layers_.size() == layers_.size(),
              "merge_into: dst must be merged() of this model");
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& l = layers_[i];
    for (int k = 0; k < kLoraTargets; ++k) {
      if (!l.lora_a[k].defined()) continue;
      at::Tensor& w = dst.layers_[i].*kLoraWeights[k];
      const at::Tensor& base = l.*kLoraWeights[k];
      TORCH_CHECK(w.sizes() == base.sizes() && !w.is_same(base), "merge_into: layer ", i, " ", lora_module_path(k),
                  ": dst's weight is this model's base weight or of another shape; make dst with merged()");
      w.copy_(lora_merged_weight(base, l.lora_a[k], l.lora_b[k], lora_.scale()));
    }
  }
}

Transformer Transformer::adapter_snapshot() const {
  TORCH_CHECK(has_lora(), "adapter_snapshot: the model has no adapters");
  Transformer s = *this;
  if (lora_gen_.defined()) s.lora_gen_ = lora_gen_.clone();
  for (Layer& l : s.layers_) {
    for (int k = 0; k < kLoraTargets; ++k) {
      if (!l.lora_a[k].defined()) continue;
      l.lora_a[k] = l.lora_a[k].detach().clone();
      l.lora_b[k] = l.lora_b[k].detach().clone();
    }
  }
  return s;
}

at::Tensor Transformer::lora_rng_state() const {
  if (!lora_gen_.defined()) return at::Tensor();
  at::Generator gen = lora_gen_;
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void Transformer::set_lora_rng_state(const at::Tensor& state) {
  TORCH_CHECK(lora_gen_.defined(), "set_lora_rng_state: the model has no adapters");
  at::Generator gen = lora_gen_;
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

at::Tensor Transformer::project(const Layer& l, int target, const at::Tensor& x, const at::Tensor& b,
                                bool dropout) const {
  at::Tensor y = linear(x, l.*kLoraWeights[target], b);
  if (!l.lora_a[target].defined()) return y;
  const double p = dropout ? lora_.dropout : 0.0;
  return y + lora_update(x, l.lora_a[target], l.lora_b[target], lora_.scale(), p,
                         p > 0 ? std::optional<at::Generator>(lora_gen_) : std::nullopt);
}

void Transformer::bind_names() {
  const ModelConfig& c = config_;
  by_name_.clear();
  layers_.resize(c.num_layers);
  by_name_["model.embed_tokens.weight"] = &embed_;
  by_name_["model.norm.weight"] = &final_norm_;
  if (!c.tie_word_embeddings) by_name_["lm_head.weight"] = &lm_head_;
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    Layer& l = layers_[i];
    by_name_[p + "input_layernorm.weight"] = &l.input_norm;
    by_name_[p + "self_attn.q_proj.weight"] = &l.q_w;
    by_name_[p + "self_attn.k_proj.weight"] = &l.k_w;
    by_name_[p + "self_attn.v_proj.weight"] = &l.v_w;
    by_name_[p + "self_attn.o_proj.weight"] = &l.o_w;
    by_name_[p + "self_attn.q_proj.bias"] = &l.q_b;
    by_name_[p + "self_attn.k_proj.bias"] = &l.k_b;
    by_name_[p + "self_attn.v_proj.bias"] = &l.v_b;
    by_name_[p + "self_attn.o_proj.bias"] = &l.o_b;
    by_name_[p + "self_attn.q_norm.weight"] = &l.q_norm;
    by_name_[p + "self_attn.k_norm.weight"] = &l.k_norm;
    by_name_[p + "post_attention_layernorm.weight"] = &l.post_attn_norm;
    by_name_[p + "pre_feedforward_layernorm.weight"] = &l.pre_ff_norm;
    by_name_[p + "post_feedforward_layernorm.weight"] = &l.post_ff_norm;
    by_name_[p + "mlp.gate_proj.weight"] = &l.gate_w;
    by_name_[p + "mlp.up_proj.weight"] = &l.up_w;
    by_name_[p + "mlp.down_proj.weight"] = &l.down_w;
  }
}

Transformer::Transformer(ModelConfig config, at::ScalarType dtype, at::Device device, uint64_t seed)
    : config_(std::move(config)) {
  bind_names();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (const auto& [name, shape] : parameter_shapes(config_)) {
    const bool norm = name.find("norm") != std::string::npos, bias = name.find(".bias") != std::string::npos;
    at::Tensor t = at::empty(shape, at::kFloat);
    if (bias)
      t.zero_();
    else if (norm)
      t.fill_(config_.gemma_norms ? 0.0 : 1.0);  // gemma scales by (1 + w)
    else
      t.normal_(0.0, 0.02, gen);
    *by_name_.at(name) = t.to(device, dtype).requires_grad_(true);
  }
  if (config_.tie_word_embeddings) lm_head_ = embed_;
  config_.dtype = dtype;
}

Transformer Transformer::load_or_random(const std::string& dir, at::ScalarType dtype, at::Device device,
                                        uint64_t seed) {
  namespace fs = std::filesystem;
  const bool weights =
      fs::exists(fs::path(dir) / "model.safetensors") || fs::exists(fs::path(dir) / "model.safetensors.index.json");
  if (weights) return load(dir, dtype, device);
  return Transformer(load_model_config(dir), dtype, device, seed);
}

Transformer Transformer::load(const std::string& dir, at::ScalarType dtype, at::Device device) {
  Transformer t;
  t.config_ = load_model_config(dir);
  t.bind_names();
  const auto reader = safetensors::Reader::open(dir);
  for (const auto& [name, shape] : parameter_shapes(t.config_)) {
    *t.by_name_.at(name) = reader.load(name, shape, dtype).to(device).requires_grad_(true);
  }
  if (t.config_.tie_word_embeddings) t.lm_head_ = t.embed_;
  t.config_.dtype = dtype;
  return t;
}

void Transformer::save(const std::string& dir, uint64_t max_shard_bytes) const {
  std::filesystem::create_directories(dir);
  nlohmann::json cfg = config_.raw;
  const char* dt = config_.dtype == at::kBFloat16 ? "bfloat16" : config_.dtype == at::kHalf ? "float16" : "float32";
  cfg[cfg.contains("torch_dtype") && !cfg.contains("dtype") ? "torch_dtype" : "dtype"] = dt;
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  {
    std::ofstream f(path + ".tmp");
    f << cfg.dump(2) << "\n";
    if (!f) throw std::runtime_error(path + ": cannot write");
  }
  std::filesystem::rename(path + ".tmp", path);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [name, t] : named_parameters()) tensors.emplace_back(name, t.detach().to(at::kCPU).contiguous());
  safetensors::write_checkpoint(dir, tensors, max_shard_bytes);
}

std::vector<std::pair<std::string, at::Tensor>> Transformer::named_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& [name, ptr] : by_name_) {  // std::map: sorted by name
    if (ptr->defined()) out.emplace_back(name, *ptr);
  }
  return out;
}

std::vector<at::Tensor> Transformer::parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& [name, t] : named_parameters()) out.push_back(t);
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> Transformer::named_trainable_parameters() const {
  if (!has_lora()) return named_parameters();
  std::map<std::string, at::Tensor> adapters;  // sorted by name, as named_parameters()
  for (size_t i = 0; i < layers_.size(); ++i) {
    for (int k = 0; k < kLoraTargets; ++k) {
      if (!layers_[i].lora_a[k].defined()) continue;
      adapters[lora_weight_name(static_cast<int64_t>(i), k, false)] = layers_[i].lora_a[k];
      adapters[lora_weight_name(static_cast<int64_t>(i), k, true)] = layers_[i].lora_b[k];
    }
  }
  return {adapters.begin(), adapters.end()};
}

std::vector<at::Tensor> Transformer::trainable_parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& [name, t] : named_trainable_parameters()) out.push_back(t);
  return out;
}

const at::Tensor& Transformer::lm_head() const { return lm_head_; }

namespace {
std::atomic<int64_t> fused_forwards{0};
std::atomic<int64_t> in_place_feeds{0};
std::atomic<int64_t> in_place_steps{0};

#ifdef RLT_HAVE_CUDA
// A mask (rows, slots) as cuda::cache_attention reads its `keep`: bool on `dev`, each row's flags
// contiguous; the mask itself where it already is so (a step's view of the cache's valid-slot flags).
at::Tensor kept_slots(const at::Tensor& mask, const at::Device& dev) {
  at::Tensor keep = mask.to(dev, at::kBool);
  return keep.stride(1) == 1 ? keep : keep.contiguous();
}
#endif
}  // namespace

int64_t Transformer::fused_forward_count() { return fused_forwards.load(); }
int64_t Transformer::in_place_feed_count() { return in_place_feeds.load(); }
int64_t Transformer::in_place_step_count() { return in_place_steps.load(); }

bool Transformer::fused_kernels_apply() const {
#ifdef RLT_HAVE_CUDA
  const at::ScalarType dt = final_norm_.scalar_type();
  return fused_kernels_ && !has_lora() && final_norm_.is_cuda() &&
         (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf);
#else
  return false;
#endif
}

PackedWeights Transformer::pack_weights() const {
  // Empty tensors of each group's dtype and device, which pack_weights_into sizes and fills: the layout
  // (q, k, v; gate, up) is written in one place.
  PackedWeights p;
  for (const Layer& l : layers_) {
    if (!config_.qk_norm) {
      p.qkv_w.push_back(at::empty({0}, l.q_w.options()));
      p.qkv_b.push_back(l.q_b.defined() ? at::empty({0}, l.q_b.options()) : at::Tensor());
    }
    p.gate_up_w.push_back(at::empty({0}, l.gate_w.options()));
  }
  pack_weights_into(p);
  return p;
}

void Transformer::pack_weights_into(PackedWeights& p) const {
  at::NoGradGuard no_grad;
  TORCH_CHECK(p.gate_up_w.size() == layers_.size(), "pack_weights_into: packed weights of another model");
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& l = layers_[i];
    if (!config_.qk_norm) {
      at::cat_out(p.qkv_w[i], {l.q_w, l.k_w, l.v_w}, 0);
      if (l.q_b.defined()) at::cat_out(p.qkv_b[i], {l.q_b, l.k_b, l.v_b}, 0);
    }
    at::cat_out(p.gate_up_w[i], {l.gate_w, l.up_w}, 0);
  }
}

at::Tensor Transformer::logits(const at::Tensor& hidden) const {
  at::Tensor z = at::matmul(hidden, lm_head_.t());  // (…, V)
  if (config_.final_softcap > 0) z = at::tanh(z / config_.final_softcap) * config_.final_softcap;
  return z;
}

at::Tensor Transformer::layer_forward(int64_t i, at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
                                      const at::Tensor& mask, bool is_causal, KvCache* cache, bool fused,
                                      const at::Tensor& keep, const at::Tensor& slots, bool dropout,
                                      at::Tensor* carry) const {
  const ModelConfig& c = config_;
  const int64_t B = h.size(0), L = h.size(1), H = c.num_heads, Hkv = c.num_kv_heads, hd = c.head_dim;
  const PackedWeights* packed = fused && cache ? cache->packed : nullptr;
  auto [q, k, v_new] = project_qkv(i, h, packed, fused, dropout, carry);  // (B, L, H, hd), (B, L, Hkv, hd) x 2
  at::Tensor attn;                                                        // (B, L, H hd)
#ifdef RLT_HAVE_CUDA
  if (keep.defined()) {
    // A feed of some cache rows, or a step over every row (forward() chose it): RoPE and the cache write in
    // one kernel, then attention over the rows' cache where it lies; the mask is `keep` and the slots, read
    // in the kernel.
    cuda::rope_write_cache(q, k, v_new, cos, sin, cache->k[i], cache->v[i], slots, cache->step_rows);
    attn = cuda::cache_attention(q, cache->k[i], cache->v[i], cache->step_rows, keep, slots, keep.size(1), c.attn_scale)
               .view({B, L, H * hd});
  } else
#endif
  {
    at::Tensor v = v_new.transpose(1, 2);  // (B, Hkv, L, hd)
    // A decode step at the cache's step slot (the graphed step): the fused RoPE writes k and v to the cache.
    const bool step_write = fused && cache && cache->step_slot.defined() && !cache->step_rows.defined();
#ifdef RLT_HAVE_CUDA
    if (step_write) {
      cuda::rope_write_cache(q, k, v_new, cos, sin, cache->k[i], cache->v[i], cache->step_slot);
      q = q.transpose(1, 2);
    } else if (fused) {
      cuda::rope_(q, k, cos, sin);  // in place, on the (B, L, heads, hd) layout
      q = q.transpose(1, 2);        // (B, H, L, hd)
      k = k.transpose(1, 2);        // (B, Hkv, L, hd)
    } else
#endif
    {
      q = q.transpose(1, 2);  // (B, H, L, hd)
      k = k.transpose(1, 2);  // (B, Hkv, L, hd)
      q = q * cos + rotate_half(q) * sin;
      k = k * cos + rotate_half(k) * sin;
    }
    if (cache && cache->step_slot.defined() && cache->step_rows.defined()) {
      // Rows x slots of the listed rows (distinct rows, so the writes do not collide), then those rows'
      // cache over the span: (B, Hkv, span, hd).
      const auto& rows = cache->step_rows;
      at::Tensor heads = at::arange(Hkv, rows.options()).view({1, Hkv, 1});
      const c10::List<std::optional<at::Tensor>> at_slots{rows.view({B, 1, 1}), heads,
                                                          cache->step_slot.view({1, 1, L})};
      cache->k[i].index_put_(at_slots, k);
      cache->v[i].index_put_(at_slots, v);
      const int64_t span = cache->span > 0 ? cache->span : cache->max_len;
      k = cache->k[i].narrow(2, 0, span).index_select(0, rows);  // (B, Hkv, span, hd)
      v = cache->v[i].narrow(2, 0, span).index_select(0, rows);
    } else if (cache && cache->step_slot.defined()) {
      if (!step_write) {
        cache->k[i].index_copy_(2, cache->step_slot, k);
        cache->v[i].index_copy_(2, cache->step_slot, v);
      }
      const int64_t span = cache->span > 0 ? cache->span : cache->max_len;
      k = cache->k[i].narrow(2, 0, span);  // (B, Hkv, span, hd)
      v = cache->v[i].narrow(2, 0, span);
    } else if (cache && cache->step_rows.defined()) {
      const int64_t past = cache->length;
      cache->k[i].narrow(2, past, L).index_copy_(0, cache->step_rows, k);
      cache->v[i].narrow(2, past, L).index_copy_(0, cache->step_rows, v);
      k = cache->k[i].narrow(2, 0, past + L).index_select(0, cache->step_rows);  // (B, Hkv, S, hd)
      v = cache->v[i].narrow(2, 0, past + L).index_select(0, cache->step_rows);
    } else if (cache) {
      const int64_t past = cache->length;
      cache->k[i].narrow(2, past, L).copy_(k);
      cache->v[i].narrow(2, past, L).copy_(v);
      k = cache->k[i].narrow(2, 0, past + L);  // (B, Hkv, S, hd)
      v = cache->v[i].narrow(2, 0, past + L);
    }
    at::Tensor a;  // (B, H, L, hd)
    if (c.attn_softcap > 0) {
      // gemma2: scores are soft-capped before the mask, which SDPA cannot do: the eager form.
      at::Tensor kr = k.repeat_interleave(H / Hkv, 1), vr = v.repeat_interleave(H / Hkv, 1);
      at::Tensor s = at::matmul(q, kr.transpose(2, 3)) * c.attn_scale;  // (B, H, L, S)
      s = at::tanh(s / c.attn_softcap) * c.attn_softcap;
      s = s.masked_fill(mask.logical_not(), -std::numeric_limits<float>::infinity());
      // Softmax in fp32 for bf16/fp16/fp32 activations, in float64 for float64 ones (the reference runs).
      const at::ScalarType acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
      a = at::matmul(at::softmax(s, -1, acc).to(q.scalar_type()), vr);
    } else if (H != Hkv && mask.defined()) {
      // Grouped-query attention with a mask (a padded prefill, a step or a feed on a cache with holes): the
      // G = H / Hkv query heads of a KV head become G x L query positions of one head, each group seeing
      // the mask's rows again. SDPA then gets plain multi-head attention over Hkv heads, which its fused
      // masked kernel takes without repeating K and V per query head (with enable_gqa and a mask it falls
      // back to the unfused math path: ~0.5 ms of host time per layer for a 24-token feed on an H200).
      // forward() lays its masks out so once for every layer (size(2) == G L); another caller's (B', 1, L, S)
      // is laid out here. A one-token step's (B', 1, 1, S) serves every query position as it is.
      const int64_t G = H / Hkv, S = k.size(2);
      at::Tensor m = L == 1 || mask.size(2) == G * L
                         ? mask
                         : mask.unsqueeze(2).expand({mask.size(0), 1, G, L, S}).reshape({mask.size(0), 1, G * L, S});
      a = at::scaled_dot_product_attention(q.reshape({B, Hkv, G * L, hd}), k, v, m, /*dropout_p=*/0.0,
                                           /*is_causal=*/false, c.attn_scale)
              .reshape({B, H, L, hd});  // not view: the memory-efficient kernel's output is not contiguous
    } else {
      a = at::scaled_dot_product_attention(q, k, v, mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt,
                                           /*dropout_p=*/0.0, is_causal, c.attn_scale, /*enable_gqa=*/H != Hkv);
    }
    attn = a.transpose(1, 2).reshape({B, L, H * hd});
  }
  return output_and_mlp(i, h, attn, packed, fused, dropout, carry);
}

at::Tensor Transformer::norm(const at::Tensor& x, const at::Tensor& w, bool gemma, bool fused) const {
  // The fused kernels (model/cuda/decode_kernels.h) stand in for the ATen chains, value for value.
#ifdef RLT_HAVE_CUDA
  if (fused) return cuda::rms_norm(x, w, config_.rms_norm_eps, gemma);
#endif
  return rms_norm(x, w, config_.rms_norm_eps, gemma);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> Transformer::project_qkv(int64_t i, at::Tensor& h,
                                                                        const PackedWeights* packed, bool fused,
                                                                        bool dropout, at::Tensor* carry) const {
  const ModelConfig& c = config_;
  const Layer& l = layers_[i];
  const int64_t B = h.size(0), L = h.size(1), H = c.num_heads, Hkv = c.num_kv_heads, hd = c.head_dim;
  at::Tensor x;  // (B, L, D)
#ifdef RLT_HAVE_CUDA
  if (carry && carry->defined()) {
    std::tie(h, x) = cuda::add_rms_norm(h, *carry, l.input_norm, c.rms_norm_eps, c.gemma_norms);
    *carry = at::Tensor();
  } else
#endif
  {
    TORCH_CHECK(!carry || !carry->defined(), "project_qkv: a residual to carry needs the fused kernels");
    x = norm(h, l.input_norm, c.gemma_norms, fused);
  }
  at::Tensor q, k, v;
  if (packed && !packed->qkv_w.empty()) {
    // One GEMM, then views of its three column blocks (rows strided by (H + 2 Hkv) hd).
    at::Tensor qkv = linear(x, packed->qkv_w[i], packed->qkv_b[i]);
    q = qkv.narrow(-1, 0, H * hd).view({B, L, H, hd});
    k = qkv.narrow(-1, H * hd, Hkv * hd).view({B, L, Hkv, hd});
    v = qkv.narrow(-1, (H + Hkv) * hd, Hkv * hd).view({B, L, Hkv, hd});
  } else {
    q = project(l, 0, x, l.q_b, dropout).view({B, L, H, hd});
    k = project(l, 1, x, l.k_b, dropout).view({B, L, Hkv, hd});
    v = project(l, 2, x, l.v_b, dropout).view({B, L, Hkv, hd});
  }
  if (c.qk_norm) {
    q = norm(q, l.q_norm, false, fused);
    k = norm(k, l.k_norm, false, fused);
  }
  return {q, k, v};
}

at::Tensor Transformer::output_and_mlp(int64_t i, const at::Tensor& h, const at::Tensor& attn,
                                       const PackedWeights* packed, bool fused, bool dropout, at::Tensor* carry) const {
  const ModelConfig& c = config_;
  const Layer& l = layers_[i];
  const bool gemma = c.gemma_norms;
  at::Tensor o = project(l, 3, attn, l.o_b, dropout);  // (B, L, D)
  if (gemma) o = norm(o, l.post_attn_norm, true, fused);
  at::Tensor h2, x;

  // MLP block: down(act(gate(x)) * up(x)).
  const at::Tensor& ff_norm = gemma ? l.pre_ff_norm : l.post_attn_norm;
#ifdef RLT_HAVE_CUDA
  if (fused) {
    std::tie(h2, x) = cuda::add_rms_norm(h, o, ff_norm, c.rms_norm_eps, gemma);
  } else
#endif
  {
    h2 = h + o;
    x = rms_norm(h2, ff_norm, c.rms_norm_eps, gemma);
  }
  at::Tensor g, u, m;  // (B, L, F) x 2, (B, L, D)
  if (packed) {
    at::Tensor gu = at::linear(x, packed->gate_up_w[i]);  // one GEMM; rows strided by 2 F
    const int64_t F = gu.size(-1) / 2;
    g = gu.narrow(-1, 0, F);
    u = gu.narrow(-1, F, F);
  } else {
    g = project(l, 4, x, at::Tensor(), dropout);
    u = project(l, 5, x, at::Tensor(), dropout);
  }
#ifdef RLT_HAVE_CUDA
  if (fused && !c.gelu_tanh) {
    m = project(l, 6, cuda::silu_mul(g, u), at::Tensor(), dropout);
  } else
#endif
  {
    g = c.gelu_tanh ? at::gelu(g, "tanh") : at::silu(g);
    m = project(l, 6, g * u, at::Tensor(), dropout);
  }
  if (gemma) m = norm(m, l.post_ff_norm, true, fused);
  if (carry) {
    *carry = m;
    return h2;
  }
  return h2 + m;
}

at::Tensor Transformer::final_norm(const at::Tensor& h, const at::Tensor& carry, bool fused) const {
  const ModelConfig& c = config_;
#ifdef RLT_HAVE_CUDA
  if (carry.defined()) return cuda::add_rms_norm(h, carry, final_norm_, c.rms_norm_eps, c.gemma_norms).second;
#endif
  TORCH_CHECK(!carry.defined(), "final_norm: a residual to carry needs the fused kernels");
  return norm(h, final_norm_, c.gemma_norms, fused);
}

bool Transformer::mixed_forward_applies() const {
#ifdef RLT_HAVE_CUDA
  const ModelConfig& c = config_;
  bool sliding = false;
  for (int64_t i = 0; i < c.num_layers; ++i) sliding |= c.sliding_layers[i];
  return fused_kernels_apply() && cuda::cache_attention_supports(final_norm_.scalar_type(), c.head_dim) &&
         c.attn_softcap == 0 && !sliding && !c.qk_norm && !at::GradMode::is_enabled();
#else
  return false;
#endif
}

at::Tensor Transformer::forward_mixed(const at::Tensor& step_ids, const at::Tensor& step_pos,
                                      const at::Tensor& step_mask, const at::Tensor& feed_ids,
                                      const at::Tensor& feed_pos, const at::Tensor& feed_keep,
                                      const at::Tensor& feed_rows, const at::Tensor& feed_slots, KvCache& cache) const {
  TORCH_CHECK(mixed_forward_applies() && cache.fused_kernels,
              "forward_mixed: needs the fused CUDA kernels (the model's and the cache's) in bf16/fp16 (hd 64 or "
              "128), no soft-capping, sliding window or q/k norm, no grad");
#ifdef RLT_HAVE_CUDA
  const ModelConfig& c = config_;
  const int64_t Bc = step_ids.size(0), E = feed_ids.size(0), K = feed_ids.size(1), T = Bc + E * K;
  const int64_t H = c.num_heads, Hkv = c.num_kv_heads, hd = c.head_dim, G = H / Hkv, span = cache.span;
  TORCH_CHECK(step_ids.sizes() == at::IntArrayRef({Bc, 1}) && step_pos.sizes() == step_ids.sizes() &&
                  feed_pos.sizes() == feed_ids.sizes() && cache.step_slot.numel() == 1 && span > 0 &&
                  span <= cache.max_len && step_mask.sizes() == at::IntArrayRef({Bc, span}) &&
                  feed_keep.sizes() == at::IntArrayRef({E, span}) && feed_rows.numel() == E &&
                  feed_slots.numel() == K && !cache.k.empty() && cache.k[0].size(0) == Bc,
              "forward_mixed: shapes disagree (step (Bc, 1) over every cache row, feed (E, K), masks over span)");
  ++fused_forwards;
  ++in_place_feeds;
  const auto dev = embed_.device();
  const at::ScalarType dt = final_norm_.scalar_type();
  cache.positions.index_copy_(1, cache.step_slot, step_pos);
  const c10::List<std::optional<at::Tensor>> at_slots{feed_rows.view({E, 1}), feed_slots.view({1, K})};
  cache.positions.index_put_(at_slots, feed_pos);

  at::Tensor ids = at::cat({step_ids.reshape({-1}), feed_ids.reshape({-1})});  // (T)
  at::Tensor h = embed_.index_select(0, ids).view({1, T, c.hidden_size});      // (1, T, D)
  if (c.gemma_norms) h = h * at::scalar_tensor(std::sqrt(double(c.hidden_size)), h.options());
  at::Tensor pos = at::cat({step_pos.reshape({-1}), feed_pos.reshape({-1})}).to(at::kFloat);  // (T)
  at::Tensor freqs = pos.unsqueeze(-1) * inv_frequencies(c, dev);                             // (T, hd/2)
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  at::Tensor cos = emb.cos().to(dt), sin = emb.sin().to(dt);  // (T, hd)
  at::Tensor cos_s = cos.narrow(0, 0, Bc).view({Bc, 1, 1, hd}), sin_s = sin.narrow(0, 0, Bc).view({Bc, 1, 1, hd});
  at::Tensor cos_f = cos.narrow(0, Bc, E * K).view({E, 1, K, hd}), sin_f = sin.narrow(0, Bc, E * K).view({E, 1, K, hd});
  // The step's mask: kept slots for the in-place attention, else additive (SDPA would convert a boolean
  // one in every layer); the feed's, as kept slots.
  at::Tensor step_keep = kept_slots(step_mask, dev), step_add;
  if (cache.in_place_steps) {
    ++in_place_steps;
  } else {
    step_add =
        at::zeros({Bc, 1, 1, span}, h.options())
            .masked_fill_(step_keep.logical_not().view({Bc, 1, 1, span}), -std::numeric_limits<double>::infinity());
  }
  at::Tensor keep = kept_slots(feed_keep, dev);
  const PackedWeights* packed = cache.packed;
  at::Tensor carry;  // a layer's MLP output, added to the residual by the next norm's kernel
  for (int64_t i = 0; i < c.num_layers; ++i) {
    auto [q, k, v] = project_qkv(i, h, packed, true, false, &carry);  // (1, T, H, hd), (1, T, Hkv, hd) x 2
    auto step_part = [&](const at::Tensor& x, int64_t heads) { return x.narrow(1, 0, Bc).view({Bc, 1, heads, hd}); };
    auto feed_part = [&](const at::Tensor& x, int64_t heads) { return x.narrow(1, Bc, E * K).view({E, K, heads, hd}); };
    // The step, as a graphed step runs it: RoPE writes its keys and values at the step slot of every row,
    // then attention over the rows' cache in place, or masked attention over the span (the group's G query
    // heads as G positions of one KV head).
    at::Tensor qs = step_part(q, H), ks = step_part(k, Hkv);
    cuda::rope_write_cache(qs, ks, step_part(v, Hkv), cos_s, sin_s, cache.k[i], cache.v[i], cache.step_slot);
    at::Tensor a_s = cache.in_place_steps ? cuda::cache_attention(qs, cache.k[i], cache.v[i], at::Tensor(), step_keep,
                                                                  cache.step_slot, span, c.attn_scale)
                                                .view({Bc, H * hd})
                                          : at::scaled_dot_product_attention(
                                                qs.transpose(1, 2).reshape({Bc, Hkv, G, hd}),
                                                cache.k[i].narrow(2, 0, span), cache.v[i].narrow(2, 0, span), step_add,
                                                /*dropout_p=*/0.0, /*is_causal=*/false, c.attn_scale)
                                                .reshape({Bc, H * hd});
    // The feed, as a fused feed runs it: into its rows' slots, then attention over their cache in place.
    at::Tensor qf = feed_part(q, H), kf = feed_part(k, Hkv);
    cuda::rope_write_cache(qf, kf, feed_part(v, Hkv), cos_f, sin_f, cache.k[i], cache.v[i], feed_slots, feed_rows);
    at::Tensor a_f = cuda::cache_attention(qf, cache.k[i], cache.v[i], feed_rows, keep, feed_slots, span, c.attn_scale)
                         .view({E * K, H * hd});
    h = output_and_mlp(i, h, at::cat({a_s, a_f}).view({1, T, H * hd}), packed, true, false, &carry);
  }
  return final_norm(h, carry, true).view({T, c.hidden_size});
#else
  return at::Tensor();
#endif
}

at::Tensor Transformer::forward(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& attention_mask,
                                KvCache* cache) const {
  const ModelConfig& c = config_;
  TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong, "ids must be (B, L) int64, got ", ids.sizes());
  TORCH_CHECK(positions.sizes() == ids.sizes(), "positions must be shaped like ids");
  const int64_t B = ids.size(0), L = ids.size(1);
  // A fixed-shape step (KvCache::step_slot): L tokens per row written at slots held on the device (of
  // the step_rows rows only, if set), attention over slots [0, span) (KvCache::span; 0: every slot);
  // nothing in it depends on a host-side length.
  const bool fixed = cache && cache->step_slot.defined();
  const int64_t span = fixed && cache->span > 0 ? cache->span : fixed ? cache->max_len : 0;
  TORCH_CHECK(!fixed || (span <= cache->max_len && cache->step_slot.numel() == L && attention_mask.defined() &&
                         attention_mask.size(1) == span),
              "a step at KvCache::step_slot takes one slot per input column and a mask over its ", span, " slots");
  const int64_t past = cache ? cache->length : 0, S = fixed ? span : past + L;
  TORCH_CHECK(!cache || S <= cache->max_len, "KV cache full: ", S, " > ", cache->max_len, " slots");
  const bool some_rows = cache && cache->step_rows.defined();
  TORCH_CHECK(!some_rows || (cache->step_rows.size(0) == B && attention_mask.defined() && attention_mask.size(0) == B &&
                             attention_mask.size(1) == S),
              "a forward over KvCache::step_rows takes one input row per listed row and an attention mask over its ", S,
              " slots");
  if (residency_) residency_->acquire(-1, false);
  const auto dev = embed_.device();
  // The adapters' dropout runs in training forwards only (grad mode on as the forward starts: a
  // checkpointed layer's first run is no-grad, yet part of a training forward).
  const bool dropout = has_lora() && lora_.dropout > 0 && at::GradMode::is_enabled();
  if (fixed && some_rows) {
    const c10::List<std::optional<at::Tensor>> at_slots{cache->step_rows.view({B, 1}), cache->step_slot.view({1, L})};
    cache->positions.index_put_(at_slots, positions.to(dev));
  } else if (fixed) {
    cache->positions.index_copy_(1, cache->step_slot, positions);
  } else if (some_rows) {
    cache->positions.narrow(1, past, L).index_copy_(0, cache->step_rows, positions.to(dev));
  } else if (cache) {
    cache->positions.narrow(1, past, L).copy_(positions);
  }

  at::Tensor h = embed_.index_select(0, ids.reshape({-1})).view({B, L, c.hidden_size});  // (B, L, D)
  if (c.gemma_norms) h = h * at::scalar_tensor(std::sqrt(double(c.hidden_size)), h.options());

  // RoPE tables (B, 1, L, hd) in fp32, then the activation dtype.
  at::Tensor freqs = positions.to(dev).to(at::kFloat).unsqueeze(-1) * inv_frequencies(c, dev);  // (B, L, hd/2)
  at::Tensor emb = at::cat({freqs, freqs}, -1).unsqueeze(1);
  at::Tensor cos = emb.cos().to(h.scalar_type()), sin = emb.sin().to(h.scalar_type());

  // Which slots each new position may attend to (B, 1, L, S): causal by slot, padding from the mask, and
  // on sliding layers only the last `window` slots. A position may always see itself, so a padded
  // position's row is never empty (an empty row would make NaNs that 0-weights cannot cancel).
  // Without padding, a prefill from an empty cache is plain causal and a one-token decode step sees every
  // slot: no mask is built and SDPA can take its fused (flash) kernels.
  const bool unpadded = !attention_mask.defined();
  const bool fast = unpadded && (past == 0 || L == 1) && c.attn_softcap == 0;
  at::Tensor full_mask, sliding_mask;
  auto build_masks = [&] {
    auto lopts = at::TensorOptions().dtype(at::kLong).device(dev);
    at::Tensor q_slot = fixed ? cache->step_slot.view({L, 1}) : at::arange(past, S, lopts).view({L, 1});
    at::Tensor k_slot = at::arange(0, S, lopts).view({1, S});
    at::Tensor causal = (k_slot <= q_slot).view({1, 1, L, S});
    at::Tensor keep =
        unpadded ? at::ones({B, 1, 1, S}, causal.options()) : (attention_mask.to(dev) != 0).view({B, 1, 1, S});
    at::Tensor self = (k_slot == q_slot).view({1, 1, L, S});
    full_mask = (causal & keep) | self;
    if (c.sliding_window > 0) {
      // The window counts positions: a cached row may hold holes, so slot distance can exceed it.
      at::Tensor k_pos = !cache      ? positions.to(dev)
                         : some_rows ? cache->positions.narrow(1, 0, S).index_select(0, cache->step_rows)
                                     : cache->positions.narrow(1, 0, S);  // (B, S)
      at::Tensor q_pos = positions.to(dev);                               // (B, L)
      at::Tensor in_window = k_pos.view({B, 1, 1, S}) > (q_pos - c.sliding_window).view({B, 1, L, 1});
      sliding_mask = (causal & keep & in_window) | self;
    }
  };

  // Grouped-query attention with a mask (layer_forward) sees each query head group's L positions as G L
  // positions of one head, so the mask (B, 1, L, S) is repeated G times along them: once here, for every
  // layer, rather than in each layer.
  auto group = [&](at::Tensor& m) {
    const int64_t G = c.num_heads / c.num_kv_heads;
    if (m.defined() && G > 1 && L > 1 && c.attn_softcap == 0)
      m = m.unsqueeze(2).expand({m.size(0), 1, G, L, S}).reshape({m.size(0), 1, G * L, S});
  };

  // A no-grad forward through a cache on CUDA (the rollout's) runs the fused kernels; training, scoring
  // and the CPU keep the ATen forms, so the trainer's log-probs are bit-identical to the scoring forward's.
  bool fused = false;
  at::Tensor keep, slots;  // set for a fused feed over some rows (below)
#ifdef RLT_HAVE_CUDA
  const at::ScalarType dt = h.scalar_type();
  fused = fused_kernels_apply() && cache && cache->fused_kernels && !at::GradMode::is_enabled() &&
          final_norm_.scalar_type() == dt;
  if (fused) ++fused_forwards;
  bool any_sliding = false;  // a layer whose window restricts this forward (the loop below reads its mask)
  for (int64_t i = 0; i < c.num_layers; ++i) any_sliding |= c.sliding_layers[i] && S > c.sliding_window;
  // A feed of some rows (KvCache::step_rows), or a step at step_slot over every row, with the fused kernels:
  // attention reads the rows' cache in place (cuda::cache_attention), under the mask that `keep` (their
  // rows of attention_mask) and the new positions' slots make; no mask tensor is built, no row of the cache
  // gathered, and no key past the last slot a query sees is read. Not for soft-capped scores, sliding
  // windows that restrict this forward, or dtypes and head sizes the kernel lacks.
  const bool in_place_step = fixed && !some_rows && cache->in_place_steps;
  if (fused && (some_rows || in_place_step) && c.attn_softcap == 0 && !any_sliding &&
      cuda::cache_attention_supports(dt, c.head_dim)) {
    keep = kept_slots(attention_mask, dev);  // (B, S)
    slots = fixed ? cache->step_slot : at::arange(past, S, at::TensorOptions().dtype(at::kLong).device(dev));
    ++(some_rows ? in_place_feeds : in_place_steps);
  }
  if (fused && c.attn_softcap == 0 && !keep.defined()) {
    // SDPA turns a boolean mask into an additive one at every call (two kernels per layer): once here.
    auto additive = [&](at::Tensor& m) {
      if (m.defined()) {
        m = at::zeros(m.sizes(), m.options().dtype(dt))
                .masked_fill_(m.logical_not(), -std::numeric_limits<double>::infinity());
      }
    };
    if (!fast || any_sliding) {
      build_masks();
      additive(full_mask);
      additive(sliding_mask);
      group(full_mask);
      group(sliding_mask);
    }
  }
#endif
  // A checkpointed layer's gradients reach its weights only through its input: the layers' input must
  // require grad even when the embedding is frozen (LoRA), or the first layer's output would not, and
  // the adapters would get no gradient (torch.utils.checkpoint's reentrant form has the same need).
  if (checkpointing_ && !cache && at::GradMode::is_enabled() && !h.requires_grad()) {
    h = h.detach().requires_grad_(true);
  }
  // Fused: a layer's MLP output, added to the residual by the next norm's kernel rather than on its own.
  at::Tensor carry;
  for (int64_t i = 0; i < c.num_layers; ++i) {
    // The window restricts nothing while all S slots fit in it.
    const bool sliding = c.sliding_layers[i] && S > c.sliding_window;
    at::Tensor mask;
    bool is_causal = false;
    if (keep.defined()) {
      // cache_attention makes the mask itself
    } else if (fast && !sliding) {
      is_causal = L > 1;  // prefill: causal; a decode step: every slot
    } else {
      if (!full_mask.defined()) {
        build_masks();
        group(full_mask);
        group(sliding_mask);
      }
      mask = sliding ? sliding_mask : full_mask;
    }
    if (checkpointing_ && !cache && at::GradMode::is_enabled()) {
      WeightResidency* res = residency_;
      // With adapter dropout the recompute must draw the masks the first run drew: it starts from the
      // generator's state as that run began (`drawn`), then puts back the state it found, so the forwards
      // that follow draw on as if no recompute had run (torch.utils.checkpoint's preserve_rng_state).
      auto drawn = std::make_shared<at::Tensor>();
      at::Generator gen = lora_gen_;
      auto layer = c10::make_intrusive<LayerFnHolder>(
          [this, i, cos, sin, mask, is_causal, res, dropout, drawn, gen](const at::Tensor& x, bool backward) mutable {
            if (res) res->acquire(i, backward);
            at::Tensor found;
            if (dropout) {
              std::lock_guard<std::mutex> lock(gen.mutex());  // not held while drawing: bernoulli_ takes it
              if (backward) {
                found = gen.get_state();
                gen.set_state(*drawn);
              } else {
                *drawn = gen.get_state();
              }
            }
            at::Tensor y =
                layer_forward(i, x, cos, sin, mask, is_causal, nullptr, false, at::Tensor(), at::Tensor(), dropout);
            if (found.defined()) {
              std::lock_guard<std::mutex> lock(gen.mutex());
              gen.set_state(found);
            }
            if (res && !backward) res->release(i);  // the recompute's graph needs them until its backward
            return y;
          },
          res ? std::function<void()>([res, i] { res->release(i); }) : std::function<void()>());
      h = CheckpointFn::apply(h, std::move(layer))[0];
    } else {
      // A layer's weights go back after it: its graph must not need them (no grad, or a recompute above).
      TORCH_CHECK(!residency_ || !at::GradMode::is_enabled(),
                  "a forward with gradients over sharded weights needs activation checkpointing");
      if (residency_) residency_->acquire(i, false);
      h = layer_forward(i, h, cos, sin, mask, is_causal, cache, fused, keep, slots, dropout, fused ? &carry : nullptr);
      if (residency_) residency_->release(i);
    }
  }
  if (cache && !fixed) cache->length = S;
  return final_norm(h, carry, fused);
}

}  // namespace rlt
