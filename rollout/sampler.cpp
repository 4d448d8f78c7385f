// Top-k / top-p filtering, counter-based noise and Gumbel-max sampling; see sampler.h.
#include "rollout/sampler.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <utility>

#include "common/memory.h"
#include "loss/logprob.h"
#include "rollout/hash.h"

#ifdef RLT_HAVE_CUDA
#include "rollout/cuda/sample_kernels.h"
#endif

namespace rlt {

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// fmix64 (rollout/hash.h) on int64 tensors. ATen's >> on int64 is arithmetic, so a logical shift masks the
// sign-extended bits away; products wrap modulo 2^64 like uint64 arithmetic.
at::Tensor shr(const at::Tensor& z, int64_t k) {
  return at::bitwise_right_shift(z, k).bitwise_and(static_cast<int64_t>((~0ULL) >> k));
}
at::Tensor fmix64_tensor(at::Tensor z) {
  z = z.bitwise_xor(shr(z, 33));
  z = z.mul(static_cast<int64_t>(0xff51afd7ed558ccdULL));
  z = z.bitwise_xor(shr(z, 33));
  z = z.mul(static_cast<int64_t>(0xc4ceb9fe1a85ec53ULL));
  return z.bitwise_xor(shr(z, 33));
}

// Per-vocabulary-entry keys (V) on a device, made once per (V, device).
at::Tensor column_keys(int64_t vocab, at::Device device) {
  static std::mutex mu;
  static std::map<std::pair<int64_t, std::string>, at::Tensor> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto& t = cache[{vocab, device.str()}];
  if (!t.defined()) {
    at::Tensor cpu = at::empty({vocab}, at::kLong);
    auto* p = cpu.data_ptr<int64_t>();
    for (int64_t v = 0; v < vocab; ++v) p[v] = static_cast<int64_t>(column_key(v));
    t = cpu.to(device);
  }
  return t;
}

}  // namespace

at::Tensor filter_top_k_top_p(const at::Tensor& logits, int64_t top_k, double top_p) {
  TORCH_CHECK(logits.dim() == 2, "logits must be (N, V), got ", logits.sizes());
  TORCH_CHECK(top_k >= 0 && top_p > 0 && top_p <= 1, "top_k must be >= 0 and top_p in (0, 1]");
  const int64_t V = logits.size(1);
  at::Tensor x = logits;
  if (top_k > 0 && top_k < V) {
    at::Tensor kth = std::get<0>(x.topk(top_k, /*dim=*/-1)).narrow(1, top_k - 1, 1);  // (B, 1)
    x = x.masked_fill(x < kth, kNegInf);
  }
  if (top_p < 1) {
    auto [sorted, order] = x.sort(/*dim=*/-1, /*descending=*/true);  // (B, V)
    at::Tensor probs = sorted.to(at::kFloat).softmax(-1);
    // Drop a token when the more likely ones already reach top_p; the most likely token always stays.
    at::Tensor drop_sorted = (probs.cumsum(-1) - probs) >= top_p;  // (B, V) bool
    at::Tensor drop = at::zeros_like(drop_sorted).scatter(1, order, drop_sorted);
    x = x.masked_fill(drop, kNegInf);
  }
  return x;
}

at::Tensor sample_row_keys(int64_t seed, const at::Tensor& streams, const at::Tensor& counters) {
  TORCH_CHECK(streams.dim() == 1 && streams.sizes() == counters.sizes(), "streams and counters must be (N)");
  // Nested hashing keeps the triples apart whatever their magnitudes.
  const int64_t B = streams.size(0);
  at::Tensor s = streams.to(at::kCPU, at::kLong).contiguous(), c = counters.to(at::kCPU, at::kLong).contiguous();
  at::Tensor rows = at::empty({B}, at::kLong);
  for (int64_t i = 0; i < B; ++i) {
    uint64_t z = fmix64(uint64_t(seed) ^ 0x243f6a8885a308d3ULL);
    z = fmix64(z ^ uint64_t(s.data_ptr<int64_t>()[i]));
    z = fmix64(z ^ uint64_t(c.data_ptr<int64_t>()[i]) * 0xbf58476d1ce4e5b9ULL);
    rows.data_ptr<int64_t>()[i] = static_cast<int64_t>(z);
  }
  return rows;
}

at::Tensor uniforms_from_keys(const at::Tensor& row_keys, int64_t vocab) {
  TORCH_CHECK(row_keys.dim() == 1 && row_keys.scalar_type() == at::kLong, "row keys must be (N) int64");
  const int64_t B = row_keys.size(0);
  at::Tensor z =
      fmix64_tensor(row_keys.view({B, 1}).bitwise_xor(column_keys(vocab, row_keys.device()).view({1, vocab})));
  // The top 24 bits k, centred: (k + 0.5) / 2^24, never 0. float32 holds k + 0.5 exactly only below 2^23;
  // above, it rounds to an integer, and k = 2^24 - 1 would round to 2^24, a uniform of exactly 1, whose
  // Gumbel noise -log(-log u) is +inf (and NaN on a -inf logit, which argmax then picks). The clamp maps
  // that one value to the largest float32 below 1 and leaves every other draw as it was.
  constexpr float kBelowOne = 1.0f - 1.0f / 16777216.0f;
  return ((shr(z, 40).to(at::kFloat) + 0.5f) * (1.0f / 16777216.0f)).clamp_max(kBelowOne);  // (B, V)
}

at::Tensor counter_uniforms(int64_t seed, const at::Tensor& streams, const at::Tensor& counters, int64_t vocab,
                            at::Device device) {
  return uniforms_from_keys(sample_row_keys(seed, streams, counters).to(device), vocab);
}

at::Tensor gumbel_argmax_keyed(const at::Tensor& logits, double temperature, const at::Tensor& row_keys, bool fused) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "gumbel_argmax: logits must be (N, V) float32");
  TORCH_CHECK(temperature > 0, "gumbel_argmax: temperature must be > 0");
  TORCH_CHECK(row_keys.device() == logits.device() && row_keys.numel() == logits.size(0),
              "gumbel_argmax: one row key per row, on the logits' device");
#ifdef RLT_HAVE_CUDA
  if (fused && logits.is_cuda() && logits.stride(1) == 1) return cuda::gumbel_argmax(logits, row_keys, temperature);
#else
  (void)fused;
#endif
  at::Tensor u = uniforms_from_keys(row_keys, logits.size(1));
  // Gumbel-max: argmax(logits / temperature + g), g = -log(-log u).
  return (logits / temperature - (-u.log()).log()).argmax(-1);
}

at::Tensor gumbel_argmax(const at::Tensor& logits, double temperature, int64_t seed, const at::Tensor& streams,
                         const at::Tensor& counters, bool fused) {
  return gumbel_argmax_keyed(logits, temperature,
                             to_device_async(sample_row_keys(seed, streams, counters), logits.device()), fused);
}

DeviceDraw draw_tokens(const at::Tensor& logits, const SamplingOptions& options, const at::Tensor& row_keys,
                       int64_t vocab_limit, bool fused) {
  TORCH_CHECK(logits.dim() == 2, "logits must be (N, V), got ", logits.sizes());
  TORCH_CHECK(options.top_k >= 0 && options.top_p > 0 && options.top_p <= 1, "top_k must be >= 0 and top_p in (0, 1]");
  at::NoGradGuard no_grad;
  const int64_t V = logits.size(1);
  // Columns past the limit are never drawn, so they are never looked at: the draw over the first
  // `vocab_limit` columns is the one over all V with the rest at -inf (column v's noise depends on v only),
  // at a fraction of the work when a 151936-entry embedding sits behind a small tokenizer.
  const int64_t Vs = vocab_limit > 0 && vocab_limit < V ? vocab_limit : V;
  at::Tensor x = logits.narrow(1, 0, Vs).to(at::kFloat);  // (B, Vs)
  const bool greedy = options.temperature == 0;
  DeviceDraw d;
  if (greedy) {
    d.ids = x.argmax(-1);
  } else {
    // Filtering works on the tempered logits; without it the draw applies the temperature itself (on a
    // GPU inside its one pass).
    const bool filter = (options.top_k > 0 && options.top_k < Vs) || options.top_p < 1;
    d.ids = filter ? gumbel_argmax_keyed(filter_top_k_top_p(x / options.temperature, options.top_k, options.top_p), 1.0,
                                         row_keys, fused)
                   : gumbel_argmax_keyed(x, options.temperature, row_keys, fused);
  }
  // The recorded log-prob: the full temperature softmax of the model's logits, through the loss module.
  LogprobInputs in;
  in.logits = logits;
  in.targets = d.ids;
  LossOptions lo;
  lo.impl = LogprobImpl::kSelective;
  lo.response_only = false;
  lo.temperature = greedy ? 1.0 : options.temperature;
  d.logprobs = token_logprobs(in, lo).logprobs;  // (B)
  return d;
}

at::Tensor pack_draw(const DeviceDraw& draw) {
  return at::stack({draw.ids.to(at::kDouble), draw.logprobs.to(at::kDouble)});  // (2, B)
}

SampleOutput unpack_draw(const at::Tensor& packed, const at::Tensor& pick, const at::Tensor& logits) {
  TORCH_CHECK(packed.dim() == 2 && packed.size(0) == 2, "unpack_draw: a packed draw is (2, B)");
  at::Tensor host = packed.to(at::kCPU);
  if (pick.defined()) host = host.index_select(1, pick);
  at::Tensor ids = host[0].to(at::kLong), lps = host[1].to(at::kFloat).contiguous();
  // Non-finite logits would be drawn from silently (argmax takes a NaN); say so here, not many steps later.
  // (A loop over B floats: the ATen form costs three dispatches per decode step.)
  const float* lp = lps.data_ptr<float>();
  if (!std::all_of(lp, lp + lps.numel(), [](float v) { return std::isfinite(v); })) {
    if (logits.defined()) {
      TORCH_CHECK(false, "sample_tokens: the policy's logits hold ", logits.isnan().sum().item<int64_t>(), " NaN and ",
                  logits.isinf().sum().item<int64_t>(), " infinite values");
    }
    TORCH_CHECK(false,
                "sample_tokens: the policy's logits are not finite (a drawn token's log-prob is NaN or infinite)");
  }
  return {ids, lps};
}

SampleOutput sample_keyed(const at::Tensor& logits, const SamplingOptions& options, const at::Tensor& row_keys,
                          int64_t vocab_limit, bool fused) {
  const DeviceDraw d = draw_tokens(logits, options, to_device_async(row_keys, logits.device()), vocab_limit, fused);
  return unpack_draw(pack_draw(d), at::Tensor(), logits);
}

SampleOutput sample_tokens(const at::Tensor& logits, const SamplingOptions& options, const at::Tensor& streams,
                           const at::Tensor& counters, int64_t vocab_limit, bool fused) {
  return sample_keyed(logits, options, sample_row_keys(options.seed, streams, counters), vocab_limit, fused);
}

}  // namespace rlt
