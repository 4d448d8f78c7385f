// bench_loss: peak extra memory, time and accuracy of every log-prob path in the settings of the seed
// documents (seed000: B=16 T=1024 V=32768 logits; seed001: T=205280 V=76032 with response fractions,
// D=2560 for cce; seed002: N=8192 V=256000 D=2304 bf16 from hidden states; heads: the Qwen2.5-0.5B and
// Llama-3-8B LM heads at N=8192 with entropy). Prints a table and writes
// JSON records {case, impl, dtype, pass, rows, vocab, hidden, logits_mb, peak_extra_mb, ms,
// max_abs_err, lower_bound_mb, ...}. PyTorch peers come from scripts/bench_peers.py in the same run.
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <optional>

#include "common/config.h"
#include "common/memory.h"
#include "loss/logprob.h"
#ifdef RLT_HAVE_CUDA
#include "loss/cuda/cce_fused.h"
#endif

using namespace rlt;
using json = nlohmann::json;

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

struct Bench {
  at::Device device{at::kCPU};
  double scale = 1.0;
  int reps = 0;  // 0: 10 on CUDA, 3 on CPU
  LossOptions base;
  std::vector<std::string> impls;  // --impl: run only these rows (empty: every row)
  json records = json::array();
};

struct Variant {
  std::string impl;     // record name
  LossOptions options;  // the module's options for this row
  bool from_hidden;     // hidden + lm_head input (else logits)
  bool refill = false;  // the call overwrites its input (in-place gradient): regenerate before each rep
};

// Inputs of one measured call; tensors on the bench device.
struct Inputs {
  at::Tensor logits, hidden, lm_head, targets;
  at::Tensor rows;               // (T') the response rows to score, or undefined for every row
  std::function<void()> refill;  // regenerates logits deterministically (for in-place variants)
};

std::string dtype_name(at::ScalarType t) { return t == at::kBFloat16 ? "bf16" : t == at::kHalf ? "fp16" : "fp32"; }

// Median milliseconds of `reps` calls after `warmup`, and the peak extra bytes over those calls.
std::pair<double, int64_t> measure(Bench& b, int warmup, int reps, const std::function<void()>& before,
                                   const std::function<void()>& call) {
  for (int i = 0; i < warmup; ++i) {
    before();
    call();
  }
  device_synchronize(b.device);
  std::vector<double> ms;
  int64_t peak = 0;
  for (int i = 0; i < reps; ++i) {
    before();
    device_synchronize(b.device);
    PeakMemory mem(b.device);
    const auto t0 = std::chrono::steady_clock::now();
    call();
    device_synchronize(b.device);
    const auto t1 = std::chrono::steady_clock::now();
    peak = std::max(peak, mem.peak_extra_bytes());
    ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], peak};
}

// float64 reference log-probs (T) of every row, from logits or from hidden @ lm_head^T, in row chunks.
at::Tensor reference_logprobs(const Inputs& in, double temperature) {
  at::NoGradGuard ng;
  const bool hid = in.hidden.defined();
  const int64_t T = in.targets.size(0);
  at::Tensor out = at::empty({T}, in.targets.options().dtype(at::kDouble));
  at::Tensor w = hid ? in.lm_head.to(at::kDouble) : at::Tensor();
  for (int64_t s = 0; s < T; s += 1024) {
    const int64_t n = std::min<int64_t>(1024, T - s);
    at::Tensor x =
        hid ? at::mm(in.hidden.narrow(0, s, n).to(at::kDouble), w.t()) : in.logits.narrow(0, s, n).to(at::kDouble);
    out.narrow(0, s, n).copy_(naive_logprobs(x, in.targets.narrow(0, s, n), temperature, false).first);
  }
  return out;
}

void run_variant(Bench& b, const std::string& case_name, const Variant& v, Inputs& in, const std::string& pass,
                 const at::Tensor& ref, json extra) {
  if (!b.impls.empty() && std::find(b.impls.begin(), b.impls.end(), v.impl) == b.impls.end()) return;
  const bool fwbw = pass == "fwbw";
  const at::Tensor& src = v.from_hidden ? in.hidden : in.logits;
  const int64_t T = in.targets.size(0);
  const int64_t V = v.from_hidden ? in.lm_head.size(0) : in.logits.size(1);
  const int64_t D = v.from_hidden ? in.hidden.size(1) : 0;
  const int64_t elem = src.element_size();
  LogprobOutput first;
  bool have_first = false;
  auto before = [&] {
    if (v.from_hidden) {
      in.hidden.mutable_grad().reset();
      in.lm_head.mutable_grad().reset();
    } else {
      in.logits.mutable_grad().reset();
    }
    if (v.refill && in.refill) in.refill();
  };
  auto call = [&] {
    LogprobInputs li;
    if (v.from_hidden) {
      li.hidden = in.hidden;
      li.lm_head = in.lm_head;
    } else {
      li.logits = in.logits;
    }
    li.targets = in.targets;
    li.rows = in.rows;
    if (!fwbw) {
      at::NoGradGuard ng;
      LogprobOutput o = token_logprobs(li, v.options);
      if (!have_first) first = o, have_first = true;
      return;
    }
    LogprobOutput o = token_logprobs(li, v.options);
    at::Tensor loss = o.logprobs.sum();
    if (o.entropy.defined() && o.entropy.requires_grad()) loss = loss + o.entropy.sum();
    loss.backward();
    if (!have_first) {
      first.logprobs = o.logprobs.detach();
      have_first = true;
    }
  };
  const bool cuda = b.device.is_cuda();
  const int reps = b.reps > 0 ? b.reps : (cuda ? 10 : 3);
  json rec = {{"case", case_name},
              {"impl", v.impl},
              {"dtype", dtype_name(src.scalar_type())},
              {"pass", pass},
              {"rows", T},
              {"vocab", V},
              {"hidden", D},
              {"logits_mb", double(T) * V * elem / kMiB}};  // the logits a framework would build, in the input dtype
  // Lower bound: the output (fw) or the gradients the call must return (fwbw).
  const double grads = v.from_hidden ? double(T * D + V * D) * elem : double(T) * V * elem;
  rec["lower_bound_mb"] = fwbw ? grads / kMiB : double(T) * 4 / kMiB;
  for (auto& [k, val] : extra.items()) rec[k] = val;
  try {
    auto [ms, peak] = measure(b, cuda ? 2 : 1, reps, before, call);
    rec["ms"] = ms;
    rec["peak_extra_mb"] = double(peak) / kMiB;
    // Accuracy on the kept rows against float64 naive (computed from the same inputs).
    const at::Tensor lp = first.logprobs.to(at::kDouble), r = in.rows.defined() ? ref.index_select(0, in.rows) : ref;
    at::Tensor diff = (lp - r).abs();
    rec["max_abs_err"] =
        diff.numel() ? (at::isfinite(lp).all().item<bool>() ? diff.max().item<double>() : std::nan("")) : 0.0;
    rec["note"] = "";
  } catch (const c10::Error& e) {  // out of memory, or any failure of this one variant: record it
    const bool oom = dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr;
    std::string msg = e.what_without_backtrace();
    rec["ms"] = nullptr;
    rec["peak_extra_mb"] = nullptr;
    rec["max_abs_err"] = nullptr;
    rec["note"] = (oom ? "OOM: " : "error: ") + msg.substr(0, msg.find('\n')).substr(0, 160);
  }
  first = LogprobOutput();
  before();
  release_cached_memory(b.device);
  auto fmt = [](const json& j, int prec) {
    if (j.is_null()) return std::string("-");
    std::ostringstream os;
    os << std::setprecision(prec) << (j.is_number() ? j.get<double>() : 0.0);
    return os.str();
  };
  std::cout << std::left << std::setw(9) << case_name << std::setw(24) << rec["impl"].get<std::string>() << std::setw(6)
            << rec["dtype"].get<std::string>() << std::setw(6) << pass << std::right << std::setw(8) << T
            << std::setw(8) << V;
  if (rec.contains("response_frac"))
    std::cout << std::setw(8) << rec["response_frac"].get<double>();
  else
    std::cout << std::setw(8) << "";
  std::cout << std::setw(12) << fmt(rec["logits_mb"], 6) << std::setw(14) << fmt(rec["peak_extra_mb"], 6)
            << std::setw(12) << fmt(rec["lower_bound_mb"], 6) << std::setw(11) << fmt(rec["ms"], 4) << std::setw(12)
            << fmt(rec["max_abs_err"], 3) << "  " << rec["note"].get<std::string>() << "\n";
  b.records.push_back(rec);
}

LossOptions with(const LossOptions& base, LogprobImpl impl, std::function<void(LossOptions&)> edit = {}) {
  LossOptions o = base;
  o.impl = impl;
  if (edit) edit(o);
  return o;
}

// The bench's options for cases whose every row is scored: no response-row gathering, no loss-mask restriction.
LossOptions every_row(const LossOptions& base) {
  LossOptions o = base;
  o.response_only = false;
  o.loss_mask_only = false;
  return o;
}

int64_t scaled(double rows, double scale) { return std::max<int64_t>(1, std::llround(rows * scale)); }

// A peaked, LM-like next-token distribution from hidden states (documented in docs/benchmarks.md):
// C ~ N(0, 1/D) per entry, E = 13 C[y] + G with G ~ N(0, 1), so z_v = E.C_v ~ N(0, 1 + 169/D) for
// v != y and z_y ~ 13 + N(0, 1): mean p(y) is about 0.5 at V = 256000 (scripts/bench_peers.py draws the
// same, in the same order: C, targets, G). The tokens above 2^-12 are scattered over the vocabulary
// (no vocabulary sorting): the worst case for gradient filtering.
void make_lm(int64_t N, int64_t V, int64_t D, at::ScalarType dt, const at::Device& dev, Inputs& in) {
  at::manual_seed(0);
  auto f32 = at::TensorOptions().dtype(at::kFloat).device(dev);
  at::Tensor C = at::randn({V, D}, f32).div_(std::sqrt(double(D)));
  in.targets = at::randint(0, V, {N}, f32.dtype(at::kLong));
  at::Tensor E = at::randn({N, D}, f32).add_(C.index_select(0, in.targets).mul_(13.0));
  in.lm_head = C.to(dt).requires_grad_(true);
  in.hidden = E.to(dt).requires_grad_(true);
}

// Peaked like a trained LM head, built as the CCE paper's Fig. 3 describes its softmax (scripts/dev/peaked_inputs.py
// builds the same in float64 on the CPU and measures it; docs/benchmarks.md): C ~ N(0, 1/(D-1)) per entry with
// column 0 = -b ln(1 + v), a frequency prior over ids in frequency order; each row draws K = 64 token ids without
// replacement from Zipf(1) over the ids (Gumbel top-k) and gets exact logits A - b ln k on them (A = 30, b = 1.5)
// through E_n = (1, e_n), e_n the minimum-norm solution of C[t_k, 1:] e_n = A - b ln k - C[t_k, 0] - (A - 4); every
// other logit is its prior plus noise. About 77 entries a row reach 2^-12, mostly among frequent ids. Targets are
// sampled from each row's softmax (an RL rollout's tokens). Built in float64 on the device, in row chunks.
void make_peaked(int64_t N, int64_t V, int64_t D, at::ScalarType dt, const at::Device& dev, Inputs& in) {
  constexpr int64_t K = 64, kChunk = 512;
  constexpr double A = 30.0, b = 1.5, s = 1.0, tail = 4.0;
  at::manual_seed(0);
  at::NoGradGuard ng;
  auto f64 = at::TensorOptions().dtype(at::kDouble).device(dev);
  at::Tensor C = at::randn({V, D}, f64).div_(std::sqrt(double(D - 1)));
  at::Tensor ids = at::arange(V, f64);
  C.select(1, 0).copy_(ids.log1p().mul_(-b));
  const at::Tensor log_w = ids.log1p().mul_(-s);                              // Zipf(s) weights over the ids
  const at::Tensor beta = at::arange(1, K + 1, f64).log_().mul_(-b).add_(A);  // (K)
  at::Tensor E = at::empty({N, D}, f64);
  in.targets = at::empty({N}, f64.dtype(at::kLong));
  for (int64_t r0 = 0; r0 < N; r0 += kChunk) {
    const int64_t n = std::min(kChunk, N - r0);
    const at::Tensor gumbel = at::rand({n, V}, f64).clamp_min_(1e-300).log_().neg_().log_().neg_();
    const at::Tensor tok = std::get<1>(at::topk(log_w + gumbel, K, 1));  // (n, K): drawn in order, without replacement
    const at::Tensor Ct = C.index_select(0, tok.flatten()).view({n, K, D});
    const at::Tensor rhs = beta.view({1, K}) - Ct.select(2, 0) - (A - tail);  // (n, K)
    const at::Tensor M = Ct.narrow(2, 1, D - 1);                              // (n, K, D - 1)
    const at::Tensor e =
        at::matmul(M.transpose(1, 2), at::linalg_solve(at::matmul(M, M.transpose(1, 2)), rhs.unsqueeze(2)));
    at::Tensor rows = E.narrow(0, r0, n);
    rows.select(1, 0).fill_(1.0);
    rows.narrow(1, 1, D - 1).copy_(e.squeeze(2));
    in.targets.narrow(0, r0, n).copy_(at::multinomial(at::softmax(at::mm(rows, C.t()), 1), 1).squeeze(1));
  }
  in.lm_head = C.to(dt).requires_grad_(true);
  in.hidden = E.to(dt).requires_grad_(true);
}

// How much a gradient filter at eps (loss.grad_filter_eps, 2^-12 by default) can skip on these inputs (the
// operands as given, fp32 logits, temperature 1 as every case here): entries >= eps a row, the target's mean p,
// and the fraction of the fused backward's 64-row x 256-entry tiles it keeps (an entry >= eps or a target in
// them; dE's GEMM computes 128-row tiles, so a larger fraction there). On an sm_90 GPU also the fraction the backward
// kernel itself flags in the first vocabulary block (4096 entries), beside this count for that block. Printed, and
// stored with each record of the case.
json filter_stats(const Inputs& in, double eps) {
  at::NoGradGuard ng;
  const int64_t N = in.hidden.size(0), V = in.lm_head.size(0), kChunk = 512, kBlock = std::min<int64_t>(4096, V);
  const at::Tensor C = in.lm_head.detach().to(at::kFloat);
  double above = 0, p_target = 0, kept = 0, tiles = 0, kept0 = 0, tiles0 = 0, kept_pairs = 0;
  at::Tensor lse = at::empty({N}, C.options());
  for (int64_t r0 = 0; r0 < N; r0 += kChunk) {
    const int64_t n = std::min(kChunk, N - r0), n64 = (n + 63) / 64 * 64, v256 = (V + 255) / 256 * 256;
    const at::Tensor z = at::mm(in.hidden.detach().narrow(0, r0, n).to(at::kFloat), C.t());
    lse.narrow(0, r0, n).copy_(z.logsumexp(1));
    const at::Tensor p = at::softmax(z, 1);
    const at::Tensor y = in.targets.narrow(0, r0, n).unsqueeze(1);
    at::Tensor keep = p.ge(eps);
    above += keep.sum().item<double>();
    p_target += p.gather(1, y).sum().item<double>();
    keep.scatter_(1, y, true);
    keep = at::constant_pad_nd(keep.to(at::kByte), {0, v256 - V, 0, n64 - n}).view({n64 / 64, 64, v256 / 256, 256});
    const at::Tensor t = keep.amax({1, 3});  // (n64 / 64, v256 / 256)
    kept += t.sum().item<double>();
    tiles += double(t.numel());
    // dE's GEMM multiplies 128-row tiles: a column of a pair of flag rows is computed when either is flagged.
    const at::Tensor pairs = at::constant_pad_nd(t, {0, 0, 0, t.size(0) % 2}).view({-1, 2, t.size(1)}).amax(1);
    kept_pairs += 2 * pairs.sum().item<double>();
    const int64_t c0 = (kBlock + 255) / 256;
    kept0 += t.narrow(1, 0, c0).sum().item<double>();
    tiles0 += double(t.size(0) * c0);
  }
  json j = {{"filter_eps", eps},          {"above_per_row", above / N},          {"p_target_mean", p_target / N},
            {"tiles_kept", kept / tiles}, {"tiles_kept_dE", kept_pairs / tiles}, {"tiles_kept_block0", kept0 / tiles0}};
  std::cout << "# filter at " << eps << ": " << j["above_per_row"].get<double>() << " entries a row, mean p(target) "
            << j["p_target_mean"].get<double>() << ", 64 x 256 tiles kept " << j["tiles_kept"].get<double>()
            << " (dE's 128-row tiles: " << j["tiles_kept_dE"].get<double>() << "; first block "
            << j["tiles_kept_block0"].get<double>() << ")";
#ifdef RLT_HAVE_CUDA
  if (cuda::cce_fused_available(in.hidden)) {
    const auto opt = in.hidden.options();
    at::Tensor flags = at::zeros({(N + 63) / 64, (kBlock + 255) / 256}, opt.dtype(at::kInt));
    at::Tensor g = at::empty({N, kBlock}, opt);
    cuda::cce_fused_backward(in.hidden.detach(), in.lm_head.detach().narrow(0, 0, kBlock), 0, 0.0, 1.0, lse,
                             at::Tensor(), at::ones({N}, opt.dtype(at::kFloat)), at::Tensor(), in.targets, eps, g,
                             flags, 1);
    j["kernel_tiles_kept_block0"] = flags.eq(1).to(at::kDouble).mean().item<double>();
    std::cout << "; the backward kernel flags " << j["kernel_tiles_kept_block0"].get<double>()
              << " of the first block's";
  }
#endif
  std::cout << "\n";
  return j;
}

void header() {
  std::cout << std::left << std::setw(9) << "case" << std::setw(24) << "impl" << std::setw(6) << "dtype" << std::setw(6)
            << "pass" << std::right << std::setw(8) << "rows" << std::setw(8) << "vocab" << std::setw(8) << "resp"
            << std::setw(12) << "logits_MiB" << std::setw(14) << "peak_extra" << std::setw(12) << "lower_bnd"
            << std::setw(11) << "ms" << std::setw(12) << "max_err"
            << "\n";
}

void case_seed000(Bench& b) {
  const int64_t T = scaled(16 * 1024, b.scale), V = 32768;
  for (auto dt : {at::kFloat, at::kBFloat16}) {
    Inputs in;
    auto fill = [&, dt] {
      at::manual_seed(0);
      at::NoGradGuard ng;
      if (!in.logits.defined()) {
        in.logits = at::randn({T, V}, at::TensorOptions().dtype(at::kFloat).device(b.device)).to(dt);
      } else {
        in.logits.copy_(at::randn({T, V}, at::TensorOptions().dtype(at::kFloat).device(b.device)));
      }
      in.targets = at::randint(0, V, {T}, at::TensorOptions().dtype(at::kLong).device(b.device));
    };
    fill();
    in.logits.requires_grad_(true);
    in.refill = fill;
    const at::Tensor ref = reference_logprobs(in, 1.0);
    LossOptions base = every_row(b.base);
    std::vector<Variant> vs = {
        {"naive", with(base, LogprobImpl::kNaive, [](LossOptions& o) { o.chunk_size = 0; }), false},
        {"naive_chunked", with(base, LogprobImpl::kNaive, [](LossOptions& o) { o.chunk_size = 1024; }), false},
        {"selective", with(base, LogprobImpl::kSelective), false},
        {"selective_inplace", with(base, LogprobImpl::kSelective, [](LossOptions& o) { o.inplace_backward = true; }),
         false, true},
    };
    for (const auto& v : vs) {
      for (const char* pass : {"fw", "fwbw"}) {
        if (v.refill && std::string(pass) == "fw") continue;  // same forward as "selective"
        run_variant(b, "seed000", v, in, pass, ref, json::object());
      }
    }
  }
}

void case_seed001(Bench& b) {
  const int64_t T = scaled(205280, b.scale), V = 76032, D = 2560, L = 2048;
  for (double frac : {1.0, 0.5, 0.25, 0.0625}) {
    // Packed sequences of L positions, each ending in a response of frac * L tokens: its rows.
    std::vector<int64_t> w;
    for (int64_t s = 0; s < T; s += L) {
      const int64_t len = std::min(L, T - s), resp = std::max<int64_t>(1, std::llround(len * frac));
      for (int64_t t = s + len - resp; t < s + len; ++t) w.push_back(t);
    }
    const at::Tensor response_rows = at::tensor(w, at::kLong).to(b.device);  // (T')
    LossOptions base = b.base;
    base.response_only = true;
    base.loss_mask_only = false;
    base.entropy = EntropyMode::kGrad;
    json extra = {{"response_frac", frac}};
    {  // logits paths: the (T, V) fp32 logits are the input (58 GiB at scale 1)
      Inputs in;
      auto fill = [&] {
        at::manual_seed(1);
        at::NoGradGuard ng;
        if (!in.logits.defined()) in.logits = at::empty({T, V}, at::TensorOptions().device(b.device));
        in.logits.normal_();
      };
      fill();
      in.logits.requires_grad_(true);
      in.refill = fill;
      in.targets = at::randint(0, V, {T}, at::TensorOptions().dtype(at::kLong).device(b.device));
      in.rows = response_rows;
      const at::Tensor ref = reference_logprobs(in, 1.0);
      run_variant(b, "seed001", {"naive", with(base, LogprobImpl::kNaive), false}, in, "fwbw", ref, extra);
      run_variant(b, "seed001", {"selective", with(base, LogprobImpl::kSelective), false}, in, "fwbw", ref, extra);
      run_variant(b, "seed001",
                  {"selective_inplace",
                   with(base, LogprobImpl::kSelective, [](LossOptions& o) { o.inplace_backward = true; }), false, true},
                  in, "fwbw", ref, extra);
    }
    release_cached_memory(b.device);
    {  // cce from hidden states (T, D) and the LM head (V, D), fp32
      Inputs in;
      make_lm(T, V, D, at::kFloat, b.device, in);
      in.rows = response_rows;
      const at::Tensor ref = reference_logprobs(in, 1.0);
      run_variant(b, "seed001", {"cce", with(base, LogprobImpl::kCce), true}, in, "fwbw", ref, extra);
    }
    release_cached_memory(b.device);
  }
}

void case_seed002(Bench& b) {
  const int64_t N = scaled(8192, b.scale), V = 256000, D = 2304;
  Inputs in;
  make_lm(N, V, D, at::kBFloat16, b.device, in);
  const at::Tensor ref = reference_logprobs(in, 1.0);
  LossOptions base = every_row(b.base);
  std::vector<Variant> vs = {
      {"naive", with(base, LogprobImpl::kNaive, [](LossOptions& o) { o.chunk_size = 0; }), true},
      {"selective", with(base, LogprobImpl::kSelective), true},
      {"cce", with(base, LogprobImpl::kCce), true},
      {"cce_nofilter", with(base, LogprobImpl::kCce, [](LossOptions& o) { o.grad_filter = false; }), true},
      // The tile-filtered GEMMs with every tile kept (a threshold no entry misses): their speed against cuBLAS's
      // (cce_nofilter) when nothing can be skipped.
      {"cce_tiles_all", with(base, LogprobImpl::kCce, [](LossOptions& o) { o.grad_filter_eps = 1e-30; }), true},
      // The blockwise path (cuBLAS GEMM blocks through HBM + epilogue kernels) beside the fused kernels.
      {"cce_blockwise", with(base, LogprobImpl::kCce, [](LossOptions& o) { o.cce_fused = false; }), true},
      // The fused kernels' other schedule: MMA warp groups on alternate tiles (loss.cce_pingpong: true).
      {"cce_pingpong", with(base, LogprobImpl::kCce, [](LossOptions& o) { o.cce_pingpong = true; }), true},
  };
  const json stats = filter_stats(in, b.base.grad_filter_eps);
  for (const auto& v : vs) {
    for (const char* pass : {"fw", "fwbw"}) {
      // Filtering is backward-only.
      if ((v.impl == "cce_nofilter" || v.impl == "cce_tiles_all") && std::string(pass) == "fw") continue;
      run_variant(b, "seed002", v, in, pass, ref, stats);
    }
  }
}

// seed002's shape on make_peaked's inputs: what gradient filtering skips on a trained-model-like softmax.
// Not in --case all (its float64 inputs take 5 GiB and minutes on a CPU).
void case_peaked(Bench& b) {
  const int64_t N = scaled(8192, b.scale), V = 256000, D = 2304;
  Inputs in;
  make_peaked(N, V, D, at::kBFloat16, b.device, in);
  const at::Tensor ref = reference_logprobs(in, 1.0);
  LossOptions base = every_row(b.base);
  const std::vector<Variant> vs = {
      {"cce", with(base, LogprobImpl::kCce), true},
      {"cce_nofilter", with(base, LogprobImpl::kCce, [](LossOptions& o) { o.grad_filter = false; }), true},
      {"cce_blockwise", with(base, LogprobImpl::kCce, [](LossOptions& o) { o.cce_fused = false; }), true},
  };
  const json stats = filter_stats(in, b.base.grad_filter_eps);
  for (const auto& v : vs) {
    for (const char* pass : {"fw", "fwbw"}) {
      if (v.impl == "cce_nofilter" && std::string(pass) == "fw") continue;
      run_variant(b, "peaked", v, in, pass, ref, stats);
    }
  }
}

// The LM heads of real models, N = 8192 rows, bf16, log-prob and entropy with their gradients:
// Qwen2.5-0.5B (D=896, V=151936) and Llama-3-8B (D=4096, V=128256), inputs built as seed002's (a peaked
// softmax, target logit ~13). scripts/bench_peers.py --case heads measures the peers on the same shapes.
void case_heads(Bench& b) {
  struct Head {
    const char* model;
    int64_t D, V;
  };
  for (const Head& h : {Head{"qwen2.5-0.5b", 896, 151936}, Head{"llama3-8b", 4096, 128256}}) {
    const int64_t N = scaled(8192, b.scale);
    Inputs in;
    make_lm(N, h.V, h.D, at::kBFloat16, b.device, in);
    const at::Tensor ref = reference_logprobs(in, 1.0);
    LossOptions base = every_row(b.base);
    base.entropy = EntropyMode::kGrad;
    const std::vector<Variant> vs = {
        {"naive", with(base, LogprobImpl::kNaive, [](LossOptions& o) { o.chunk_size = 0; }), true},
        {"cce", with(base, LogprobImpl::kCce), true},
        {"cce_nofilter", with(base, LogprobImpl::kCce, [](LossOptions& o) { o.grad_filter = false; }), true},
        {"cce_blockwise", with(base, LogprobImpl::kCce, [](LossOptions& o) { o.cce_fused = false; }), true},
        {"cce_pingpong", with(base, LogprobImpl::kCce, [](LossOptions& o) { o.cce_pingpong = true; }), true},
    };
    json extra = filter_stats(in, b.base.grad_filter_eps);
    extra["model"] = h.model;
    extra["entropy"] = true;
    for (const auto& v : vs) {
      for (const char* pass : {"fw", "fwbw"}) {
        if (v.impl == "cce_nofilter" && std::string(pass) == "fw") continue;
        run_variant(b, "heads", v, in, pass, ref, extra);
      }
    }
    release_cached_memory(b.device);
  }
}

}  // namespace

// bench_loss reads one section, the loss module's options (the same keys as the trainer's `loss:`).
struct BenchLossConfig {
  LossOptions loss;
  template <class V>
  void visit_sections(V&& v) {
    v("loss", loss, "log-prob module: paths, row selection, chunking, entropy");
  }
};

int main(int argc, char** argv) {
  CLI::App app{"bench_loss: memory, time and accuracy of the log-prob paths in the seed documents' settings"};
  ConfigCli cc;
  add_config_flags(app, cc);
  std::string device = "cpu", which = "all", json_path;
  Bench b;
  app.add_option("--device", device, "cpu | cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option(
         "--case", which,
         "seed000 | seed001 | seed002 | heads (Qwen2.5-0.5B and Llama-3-8B LM heads) | peaked (seed002's shape, "
         "a trained-model-like softmax; not in all) | all")
      ->check(CLI::IsMember({"seed000", "seed001", "seed002", "heads", "peaked", "all"}));
  app.add_option("--scale", b.scale, "multiply the row count of every case (CPU runs: 0.01 or less)")
      ->check(CLI::Range(1e-6, 1.0));
  app.add_option("--reps", b.reps, "timed repetitions (median reported); 0 = 10 on CUDA, 3 on CPU")
      ->check(CLI::Range(0, 1000));
  app.add_option("--json", json_path, "write the records to this JSON file");
  app.add_option("--impl", b.impls, "run only these rows (e.g. --impl cce cce_blockwise); default: every row");
  if (int rc = parse_cli(app, argc, argv); rc >= 0) return rc;
  BenchLossConfig cfg;
  if (!load_cli_config(cc, cfg)) return 2;
  if (cc.print) return 0;
  b.base = cfg.loss;
  if (device == "cuda") {
    if (!at::hasCUDA()) {
      std::cerr << "bench_loss: --device cuda but no CUDA device is available\n";
      return 2;
    }
    b.device = at::Device(at::kCUDA, 0);
  } else {
    install_cpu_memory_tracking();
    b.device = at::Device(at::kCPU);
  }
  header();
  if (which == "seed000" || which == "all") case_seed000(b);
  if (which == "seed001" || which == "all") case_seed001(b);
  if (which == "seed002" || which == "all") case_seed002(b);
  if (which == "heads" || which == "all") case_heads(b);
  if (which == "peaked") case_peaked(b);
  if (!json_path.empty()) {
    const auto parent = std::filesystem::path(json_path).parent_path();
    std::error_code ec;
    if (!parent.empty()) std::filesystem::create_directories(parent, ec);
    std::ofstream f(json_path);
    if (!f) {
      std::cerr << "bench_loss: cannot write " << json_path << "\n";
      return 2;
    }
    f << b.records.dump(1) << "\n";
  }
  return 0;
}
