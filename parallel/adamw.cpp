// The flat AdamW step: a one-pass CPU kernel (vectorised, all cores) and ATen's ops elsewhere; and the
// optimizer offload's two drivers, the host step and the stream through the GPU. This file is compiled
// with -ffp-contract=off (trainer/CMakeLists.txt): the only fused multiply-adds are the explicit std::fma
// that mirror ATen's, so the roundings are torch::optim::AdamW's whatever the compiler or target.
#include "parallel/adamw.h"

#include "common/memory.h"

#include <ATen/TensorIterator.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#ifdef RLT_HAVE_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define RLT_ADAMW_X86 1
#endif

namespace rlt {
namespace {

void check_hyper_parameters(const AdamWStep& s) {
  TORCH_CHECK(s.step >= 1, "adamw: step must be >= 1 (the 1-based count of steps), got ", s.step);
  TORCH_CHECK(std::isfinite(s.lr) && s.lr >= 0, "adamw: lr must be finite and >= 0, got ", s.lr);
  TORCH_CHECK(s.beta1 >= 0 && s.beta1 < 1, "adamw: beta1 must be in [0, 1), got ", s.beta1);
  TORCH_CHECK(s.beta2 >= 0 && s.beta2 < 1, "adamw: beta2 must be in [0, 1), got ", s.beta2);
  TORCH_CHECK(std::isfinite(s.eps) && s.eps >= 0, "adamw: eps must be finite and >= 0, got ", s.eps);
  TORCH_CHECK(std::isfinite(s.weight_decay) && s.weight_decay >= 0, "adamw: weight_decay must be finite and >= 0, got ",
              s.weight_decay);
}

void check_slice(const char* what, const at::Tensor& t, int64_t n, const at::Device& device) {
  TORCH_CHECK(t.defined(), "adamw_step: ", what, " is undefined");
  TORCH_CHECK(t.scalar_type() == at::kFloat, "adamw_step: ", what, " must be fp32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "adamw_step: ", what, " must be contiguous");
  TORCH_CHECK(t.numel() == n, "adamw_step: ", what, " has ", t.numel(), " elements, param has ", n);
  TORCH_CHECK(t.device() == device, "adamw_step: ", what, " is on ", t.device(), ", param on ", device);
}

// The bias corrections of step t, in double as torch::optim::AdamW computes them.
double bias_correction(double beta, int64_t t) { return 1 - std::pow(beta, static_cast<double>(t)); }

// Each scalar as ATen's ops see it: computed in double, then rounded to the fp32 tensors' dtype once (a
// double Scalar meeting a float tensor becomes float).
struct Coeffs {
  float decay;  // 1 - lr wd
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float sqrt_bias_correction2;  // sqrt(1 - b2^t)
  float eps;
  float neg_step_size;  // -lr / (1 - b1^t)
};

Coeffs coeffs(const AdamWStep& s) {
  Coeffs c;
  c.decay = static_cast<float>(1 - s.lr * s.weight_decay);
  c.beta1 = static_cast<float>(s.beta1);
  c.one_minus_beta1 = static_cast<float>(1 - s.beta1);
  c.beta2 = static_cast<float>(s.beta2);
  c.one_minus_beta2 = static_cast<float>(1 - s.beta2);
  c.sqrt_bias_correction2 = static_cast<float>(std::sqrt(bias_correction(s.beta2, s.step)));
  c.eps = static_cast<float>(s.eps);
  c.neg_step_size = static_cast<float>(-(s.lr / bias_correction(s.beta1, s.step)));
  return c;
}

// What the host kernel also writes per element: nothing, the fp32 weight, or its bf16 rounding.
enum class OutKind { kNone, kFloat, kBFloat16 };

OutKind fused_out_kind(at::ScalarType t) {
  return t == at::kFloat ? OutKind::kFloat : t == at::kBFloat16 ? OutKind::kBFloat16 : OutKind::kNone;
}

// bf16 bits of x rounded to nearest even, NaN to 0x7FC0: c10::BFloat16's rounding, in a form the loop
// vectorises (integer add and shift, a blend for NaN).
inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return x != x ? uint16_t{0x7FC0} : static_cast<uint16_t>(rounded);
}

struct Arrays {
  float* p;        // (len) masters
  const float* g;  // (len) gradient
  float* m;        // (len) exp_avg
  float* v;        // (len) exp_avg_sq
  void* out;       // (len) weights in OutKind's dtype, or null
};

// One step of len elements, in the order and with the roundings of ATen's
//   p.mul_(decay); m.mul_(b1).add_(g, 1 - b1); v.mul_(b2).addcmul_(g, g, 1 - b2);
//   denom = (v.sqrt() / sqrt(bc2)).add_(eps); p.addcdiv_(m, denom, -step_size)
// on its AVX2/AVX-512 kernels: add_ is fmadd(g, alpha, m), addcmul_ fuses (alpha g) g + v, addcdiv_ is
// p + (alpha m) / denom. Only the sqrt differs: correctly rounded here, MKL's (within an ulp) in ATen.
template <OutKind kOut>
__attribute__((always_inline)) inline void adamw_elements(float* __restrict p, const float* __restrict g,
                                                          float* __restrict m, float* __restrict v,
                                                          void* __restrict out, const Coeffs& c, int64_t len) {
  float* out_f = static_cast<float*>(out);
  uint16_t* out_h = static_cast<uint16_t*>(out);
  // The five arrays never overlap (TensorIterator checks): no run-time alias checks needed to vectorise.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC ivdep
#endif
  for (int64_t i = 0; i < len; ++i) {
    const float gi = g[i];
    const float mi = std::fma(gi, c.one_minus_beta1, m[i] * c.beta1);
    const float vi = std::fma(c.one_minus_beta2 * gi, gi, v[i] * c.beta2);
    const float denom = std::sqrt(vi) / c.sqrt_bias_correction2 + c.eps;
    const float pi = p[i] * c.decay + (c.neg_step_size * mi) / denom;
    m[i] = mi;
    v[i] = vi;
    p[i] = pi;
    if constexpr (kOut == OutKind::kFloat) out_f[i] = pi;
    if constexpr (kOut == OutKind::kBFloat16) out_h[i] = bf16_bits(pi);
  }
}

template <OutKind kOut>
__attribute__((always_inline)) inline void adamw_elements(const Arrays& a, const Coeffs& c, int64_t len) {
  adamw_elements<kOut>(a.p, a.g, a.m, a.v, a.out, c, len);
}

void adamw_range_generic(const Arrays& a, const Coeffs& c, OutKind k, int64_t len) {
  switch (k) {
    case OutKind::kNone:
      return adamw_elements<OutKind::kNone>(a, c, len);
    case OutKind::kFloat:
      return adamw_elements<OutKind::kFloat>(a, c, len);
    case OutKind::kBFloat16:
      return adamw_elements<OutKind::kBFloat16>(a, c, len);
  }
}

#ifdef RLT_ADAMW_X86
// The same loop for AVX2 + FMA (every x86 server since 2013): 8 lanes and a hardware fma, where the
// baseline x86-64 build would call fmaf per element. Chosen at run time, so the binary still runs on
// older processors.
__attribute__((target("avx2,fma"))) void adamw_range_avx2(const Arrays& a, const Coeffs& c, OutKind k, int64_t len) {
  switch (k) {
    case OutKind::kNone:
      return adamw_elements<OutKind::kNone>(a, c, len);
    case OutKind::kFloat:
      return adamw_elements<OutKind::kFloat>(a, c, len);
    case OutKind::kBFloat16:
      return adamw_elements<OutKind::kBFloat16>(a, c, len);
  }
}

bool cpu_has_avx2_fma() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
#endif

void adamw_range(const Arrays& a, const Coeffs& c, OutKind k, int64_t len) {
#ifdef RLT_ADAMW_X86
  if (cpu_has_avx2_fma()) return adamw_range_avx2(a, c, k, len);
#endif
  adamw_range_generic(a, c, k, len);
}

// One pass over (n) host tensors on ATen's intra-op threads. TensorIterator's for_each runs
// at::parallel_for inside libtorch, on its OpenMP pool: at::parallel_for in this file would run serially,
// since ATen's parallel_for only forks where the caller is compiled with -fopenmp (ParallelOpenMP.h).
// out: undefined, or (n) fp32 / bf16 weights written with the masters.
void adamw_host(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
                const at::Tensor& out, const Coeffs& c) {
  const OutKind k = out.defined() ? fused_out_kind(out.scalar_type()) : OutKind::kNone;
  at::TensorIteratorConfig config;
  config.set_check_mem_overlap(true).check_all_same_dtype(false).resize_outputs(false);
  config.add_output(p).add_output(m).add_output(v);
  if (k != OutKind::kNone) config.add_output(out);
  config.add_const_input(g);
  at::TensorIterator iter = config.build();
  const int n_out = k != OutKind::kNone ? 4 : 3;
  iter.for_each(
      [&](char** data, const int64_t* strides, int64_t len, int64_t outer) {
        // Contiguous operands coalesce to one dimension: every chunk is a plain range of each array.
        TORCH_INTERNAL_ASSERT(outer == 1 && strides[0] == sizeof(float) && strides[n_out] == sizeof(float));
        const Arrays a{reinterpret_cast<float*>(data[0]), reinterpret_cast<const float*>(data[n_out]),
                       reinterpret_cast<float*>(data[1]), reinterpret_cast<float*>(data[2]),
                       k != OutKind::kNone ? data[3] : nullptr};
        adamw_range(a, c, k, len);
      },
      kAdamWCpuGrain);
}

at::TensorOptions host_options(at::ScalarType dtype) {
  // Pinned pages make the copies asynchronous; without CUDA there is nothing to pin them for.
  return at::TensorOptions().dtype(dtype).device(at::kCPU).pinned_memory(at::hasCUDA());
}

int64_t fp32_numel(const at::Tensor& master) {
  TORCH_CHECK(master.defined() && master.scalar_type() == at::kFloat,
              "OffloadedAdamW: master must be a defined fp32 tensor");
  return master.numel();
}

}  // namespace

void adamw_step(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                const AdamWStep& s) {
  TORCH_CHECK(param.defined(), "adamw_step: param is undefined");
  const int64_t n = param.numel();
  check_slice("param", param, n, param.device());
  check_slice("grad", grad, n, param.device());
  check_slice("exp_avg", exp_avg, n, param.device());
  check_slice("exp_avg_sq", exp_avg_sq, n, param.device());
  check_hyper_parameters(s);
  at::NoGradGuard no_grad;  // in-place updates of leaves
  // Off the CPU, torch::optim::AdamW's own sequence of ATen ops: the multi-tensor step over this one slice.
  if (!param.is_cpu()) {
    return adamw_step_tensors({{param.view({-1})}, {grad.view({-1})}, {exp_avg.view({-1})}, {exp_avg_sq.view({-1})}},
                              s);
  }
  adamw_host(param.view({-1}), grad.view({-1}), exp_avg.view({-1}), exp_avg_sq.view({-1}), at::Tensor(), coeffs(s));
}

namespace {

void check_tensors(const AdamWTensors& t) {
  const size_t n = t.params.size();
  TORCH_CHECK(t.grads.size() == n && t.exp_avgs.size() == n && t.exp_avg_sqs.size() == n, "adamw_step_tensors: ", n,
              " params, ", t.grads.size(), " grads, ", t.exp_avgs.size(), " exp_avgs and ", t.exp_avg_sqs.size(),
              " exp_avg_sqs");
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = t.params[i];
    TORCH_CHECK(p.defined() && at::isFloatingType(p.scalar_type()) && p.is_contiguous(), "adamw_step_tensors: param ",
                i, " must be a defined, contiguous floating tensor");
    TORCH_CHECK(p.device() == t.params.front().device() && p.scalar_type() == t.params.front().scalar_type(),
                "adamw_step_tensors: param ", i, " is ", p.scalar_type(), " on ", p.device(), ", param 0 ",
                t.params.front().scalar_type(), " on ", t.params.front().device());
    for (const at::Tensor* o : {&t.grads[i], &t.exp_avgs[i], &t.exp_avg_sqs[i]}) {
      TORCH_CHECK(o->defined() && o->is_contiguous() && o->sizes() == p.sizes() &&
                      o->scalar_type() == p.scalar_type() && o->device() == p.device(),
                  "adamw_step_tensors: the gradient and moments of param ", i, " must be contiguous, of its shape ",
                  p.sizes(), ", dtype ", p.scalar_type(), " and device ", p.device());
    }
  }
}

// One round of adamw_step_tensors: torch::optim::AdamW's ops, in its order, over the lists; each list op
// rounds as its single-tensor twin does, so the result is bit for bit torch's.
void adamw_round(std::vector<at::Tensor>& p, std::vector<at::Tensor>& g, std::vector<at::Tensor>& m,
                 std::vector<at::Tensor>& v, const AdamWStep& s) {
  const double bc1 = bias_correction(s.beta1, s.step), bc2 = bias_correction(s.beta2, s.step);
  if (s.weight_decay != 0) at::_foreach_mul_(p, 1 - s.lr * s.weight_decay);
  at::_foreach_mul_(m, s.beta1);
  at::_foreach_add_(m, g, 1 - s.beta1);
  at::_foreach_mul_(v, s.beta2);
  at::_foreach_addcmul_(v, g, g, 1 - s.beta2);
  std::vector<at::Tensor> denom = at::_foreach_sqrt(v);
  at::_foreach_div_(denom, std::sqrt(bc2));
  at::_foreach_add_(denom, s.eps);
  at::_foreach_addcdiv_(p, m, denom, -(s.lr / bc1));
}

}  // namespace

void adamw_step_tensors(const AdamWTensors& t, const AdamWStep& s, int64_t round_elems, AdamWTensorsFault fault) {
  check_tensors(t);
  check_hyper_parameters(s);
  TORCH_CHECK(round_elems >= 1, "adamw_step_tensors: round_elems must be >= 1, got ", round_elems);
  at::NoGradGuard no_grad;  // in-place updates of leaves
  std::vector<at::Tensor> p, g, m, v;
  int64_t held = 0;  // elements in the round
  auto run_round = [&] {
    if (fault == AdamWTensorsFault::kSkipRoundTail && !p.empty())
      p.pop_back(), g.pop_back(), m.pop_back(), v.pop_back();
    if (!p.empty()) adamw_round(p, g, m, v, s);
    p.clear(), g.clear(), m.clear(), v.clear();
    held = 0;
  };
  for (size_t i = 0; i < t.params.size(); ++i) {
    const int64_t n = t.params[i].numel();
    for (int64_t b = 0; b < n; b += round_elems) {
      const int64_t len = std::min(round_elems, n - b);
      if (held + len > round_elems) run_round();
      p.push_back(t.params[i].view({-1}).narrow(0, b, len));
      g.push_back(t.grads[i].view({-1}).narrow(0, fault == AdamWTensorsFault::kSliceOffsetIgnored ? 0 : b, len));
      m.push_back(t.exp_avgs[i].view({-1}).narrow(0, b, len));
      v.push_back(t.exp_avg_sqs[i].view({-1}).narrow(0, b, len));
      held += len;
    }
  }
  run_round();
}

double clip_grad_norm_tensors(const std::vector<at::Tensor>& grads, double max_norm) {
  std::vector<at::Tensor> defined;
  for (const at::Tensor& g : grads)
    if (g.defined()) defined.push_back(g);
  if (defined.empty()) return 0.0;
  at::NoGradGuard no_grad;
  const std::vector<at::Tensor> norms = at::_foreach_norm(defined, 2);
  const at::Tensor total = norms.size() == 1 ? norms.front() : at::stack(norms).norm(2);
  if (!std::isinf(max_norm)) {  // a scale of at most 1, as clip_grad_norm_ computes it
    const at::Tensor coef = at::clamp(max_norm / (total + 1e-6), std::nullopt, 1.0);
    at::_foreach_mul_(defined, coef);
  }
  return total.item<double>();
}

OffloadedAdamW::OffloadedAdamW(const at::Tensor& master, OffloadOptions options)
    : OffloadedAdamW(fp32_numel(master), options) {
  master_.copy_(master.reshape({-1}));
}

OffloadedAdamW::OffloadedAdamW(int64_t numel, OffloadOptions options) : options_(options) {
  TORCH_CHECK(numel >= 0, "OffloadedAdamW: numel must be >= 0, got ", numel);
  TORCH_CHECK(options.chunk_elems >= 1, "OffloadedAdamW: chunk_elems must be >= 1, got ", options.chunk_elems);
  // The run's state, kept to its end: exactly its size, zeros as mapped (pinned_host_zeros). The staging
  // chunks below come from torch's pinned allocator, whose events keep a chunk until its copies have run.
  master_ = pinned_host_zeros({numel}, at::kFloat);
  exp_avg_ = pinned_host_zeros({numel}, at::kFloat);
  exp_avg_sq_ = pinned_host_zeros({numel}, at::kFloat);
}

int64_t OffloadedAdamW::host_bytes() const {
  int64_t bytes = master_.nbytes() + exp_avg_.nbytes() + exp_avg_sq_.nbytes();
  if (grad_stage_.defined()) bytes += grad_stage_.nbytes();
  if (out_stage_.defined()) bytes += out_stage_.nbytes();
  return bytes;
}

namespace {
// Elements per chunk of a step over n elements.
int64_t chunk_of(int64_t n, const OffloadOptions& options) {
  return std::max<int64_t>(1, std::min(options.chunk_elems, n));
}
}  // namespace

int64_t stream_step_device_bytes(int64_t n, const OffloadOptions& options) {
  const int64_t C = chunk_of(n, options);
  return int64_t(sizeof(float)) * (3 * 3 * C + std::min(C, kAdamWRoundElems));
}

void OffloadedAdamW::step(const at::Tensor& grad, const AdamWStep& s, at::Tensor out) {
  const int64_t n = master_.numel();
  TORCH_CHECK(grad.defined() && grad.scalar_type() == at::kFloat && grad.is_contiguous() && grad.numel() == n,
              "OffloadedAdamW::step: grad must be a contiguous fp32 tensor of ", n, " elements, got ",
              grad.defined() ? grad.toString() : "undefined", " ", grad.defined() ? grad.sizes() : at::IntArrayRef{});
  TORCH_CHECK(out.defined() && out.is_contiguous() && out.numel() == n,
              "OffloadedAdamW::step: out must be a contiguous tensor of ", n, " elements");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kHalf,
              "OffloadedAdamW::step: out must be fp32, bf16 or fp16, got ", out.scalar_type());
  TORCH_CHECK(grad.is_cpu() || grad.is_cuda(), "OffloadedAdamW::step: grad must be on the CPU or CUDA, got ",
              grad.device());
  TORCH_CHECK(out.is_cpu() || out.is_cuda(), "OffloadedAdamW::step: out must be on the CPU or CUDA, got ",
              out.device());
  TORCH_CHECK(grad.is_cpu() || out.is_cpu() || grad.device() == out.device(), "OffloadedAdamW::step: grad (",
              grad.device(), ") and out (", out.device(), ") are on different GPUs");
  check_hyper_parameters(s);
  at::NoGradGuard no_grad;  // in-place updates of leaves
  if (options_.mode == OffloadMode::kStreamDevice) {
    step_through_device(grad, s, out);
  } else {
    step_on_host(grad, s, out);
  }
}

// Chunk k of C elements: the device copies it to a pinned half of grad_stage_ on a side stream while the
// host steps chunk k - 1; the host writes the rounded weights to a pinned half of out_stage_, which a
// second side stream (the other copy engine) sends to `out`. Tensors already on the host are read and
// written in place.
void OffloadedAdamW::step_on_host(const at::Tensor& grad, const AdamWStep& s, at::Tensor& out) {
  const int64_t n = master_.numel();
  const int64_t C = chunk_of(n, options_);
  const int64_t chunks = (n + C - 1) / C;
  const bool stage_grad = !grad.is_cpu(), stage_out = !out.is_cpu();
  const OutKind fused = fused_out_kind(out.scalar_type());
  const Coeffs c = coeffs(s);
#ifdef RLT_HAVE_CUDA
  const at::Device device = stage_grad ? grad.device() : out.device();
  std::optional<c10::cuda::CUDAGuard> guard;
  std::optional<c10::cuda::CUDAStream> d2h, h2d;
  at::cuda::CUDAEvent grad_in[2], out_sent[2];
  if (stage_grad || stage_out) {
    guard.emplace(device);
    d2h = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index());
    h2d = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index());
  }
  if (stage_grad || stage_out) {
    // The gradient is complete, and `out` free to overwrite (the caller's kernels that write or read it
    // are done), once the caller's stream reaches this point.
    at::cuda::CUDAEvent ready;
    ready.record(c10::cuda::getCurrentCUDAStream(device.index()));
    if (stage_grad) ready.block(*d2h);
    if (stage_out) ready.block(*h2d);
  }
  if (stage_grad && (!grad_stage_.defined() || grad_stage_.size(1) != C))
    grad_stage_ = at::empty({2, C}, host_options(at::kFloat));
  if (stage_out && (!out_stage_.defined() || out_stage_.size(1) != C || out_stage_.scalar_type() != out.scalar_type()))
    out_stage_ = at::empty({2, C}, host_options(out.scalar_type()));
  auto fetch = [&](int64_t k) {
    const int64_t b = k * C, len = std::min(C, n - b);
    c10::cuda::CUDAStreamGuard on(*d2h);
    grad_stage_[k % 2].narrow(0, 0, len).copy_(grad.narrow(0, b, len), /*non_blocking=*/true);
    grad_in[k % 2].record(*d2h);
  };
  if (stage_grad && chunks > 0) fetch(0);
#else
  TORCH_CHECK(!stage_grad && !stage_out, "OffloadedAdamW::step: built without CUDA, grad and out must be CPU tensors");
#endif
  for (int64_t k = 0; k < chunks; ++k) {
    const int64_t b = k * C, len = std::min(C, n - b);
    at::Tensor g = grad.narrow(0, b, len);
    at::Tensor dst = out.narrow(0, b, len);  // where the host writes the weights
#ifdef RLT_HAVE_CUDA
    if (stage_grad) {
      if (k + 1 < chunks) fetch(k + 1);  // its half held chunk k - 1, already stepped
      grad_in[k % 2].synchronize();
      g = grad_stage_[k % 2].narrow(0, 0, len);
    }
    if (stage_out) {
      if (k >= 2) out_sent[k % 2].synchronize();  // chunk k - 2 has left this half
      dst = out_stage_[k % 2].narrow(0, 0, len);
    }
#endif
    at::Tensor pc = master_.narrow(0, b, len);
    adamw_host(pc, g, exp_avg_.narrow(0, b, len), exp_avg_sq_.narrow(0, b, len),
               fused == OutKind::kNone ? at::Tensor() : dst, c);
    if (fused == OutKind::kNone) dst.copy_(pc);  // fp16: ATen's rounding
#ifdef RLT_HAVE_CUDA
    if (stage_out) {
      c10::cuda::CUDAStreamGuard on(*h2d);
      out.narrow(0, b, len).copy_(dst, /*non_blocking=*/true);
      out_sent[k % 2].record(*h2d);
    }
#endif
  }
#ifdef RLT_HAVE_CUDA
  // Waiting here frees the staging halves for the next step and makes `out` current for every stream.
  if (stage_out) h2d->synchronize();
#endif
}

// Chunk k passes through device slot k % 3: uploaded on one side stream, stepped by adamw_step on the
// caller's stream (which also rounds it into `out`), downloaded on another side stream; three slots keep
// upload, step and download of consecutive chunks in flight together. The slots (9 chunks of fp32, 144 MiB
// at 4M elements) live through the step only: between steps the device holds none of the optimizer.
void OffloadedAdamW::step_through_device(const at::Tensor& grad, const AdamWStep& s, at::Tensor& out) {
  TORCH_CHECK(grad.is_cuda() && out.is_cuda(),
              "OffloadedAdamW::step: OffloadMode::kStreamDevice needs grad and out on a CUDA device, got ",
              grad.device(), " and ", out.device());
#ifdef RLT_HAVE_CUDA
  TORCH_CHECK(master_.is_pinned(),
              "OffloadedAdamW::step: kStreamDevice needs the host state pinned (CUDA was not "
              "available when this OffloadedAdamW was made)");
  const int64_t n = master_.numel();
  const int64_t C = chunk_of(n, options_);
  const int64_t chunks = (n + C - 1) / C;
  const at::Device device = grad.device();
  c10::cuda::CUDAGuard guard(device);
  const at::Tensor slots = at::empty({3, 3, C}, at::TensorOptions().dtype(at::kFloat).device(device));
  const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream(device.index());
  const c10::cuda::CUDAStream h2d = c10::cuda::getStreamFromPool(false, device.index());
  const c10::cuda::CUDAStream d2h = c10::cuda::getStreamFromPool(false, device.index());
  // The slots come from the caller's stream, whose queued kernels may still use their memory: the uploads
  // start once that stream reaches this point.
  at::cuda::CUDAEvent free_to_write;
  free_to_write.record(compute);
  free_to_write.block(h2d);
  at::cuda::CUDAEvent loaded[3], stepped[3], stored[3];
  at::Tensor host[3] = {master_, exp_avg_, exp_avg_sq_};
  for (int64_t k = 0; k < chunks; ++k) {
    const int64_t b = k * C, len = std::min(C, n - b), slot = k % 3;
    at::Tensor dev[3];
    for (int j = 0; j < 3; ++j) dev[j] = slots[slot][j].narrow(0, 0, len);
    {
      c10::cuda::CUDAStreamGuard on(h2d);
      if (k >= 3) stored[slot].block(h2d);  // chunk k - 3 has left the slot
      for (int j = 0; j < 3; ++j) dev[j].copy_(host[j].narrow(0, b, len), /*non_blocking=*/true);
      loaded[slot].record(h2d);
    }
    loaded[slot].block(compute);
    adamw_step(dev[0], grad.narrow(0, b, len), dev[1], dev[2], s);
    out.narrow(0, b, len).copy_(dev[0]);
    stepped[slot].record(compute);
    {
      c10::cuda::CUDAStreamGuard on(d2h);
      stepped[slot].block(d2h);
      for (int j = 0; j < 3; ++j) host[j].narrow(0, b, len).copy_(dev[j], /*non_blocking=*/true);
      stored[slot].record(d2h);
    }
  }
  // The host state is current when step returns, and the slots free: every side-stream use of them ends
  // before the download stream's last copy.
  d2h.synchronize();
#else
  TORCH_CHECK(false, "OffloadedAdamW::step: OffloadMode::kStreamDevice needs a build with CUDA");
#endif
}

}  // namespace rlt
