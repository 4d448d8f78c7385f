// tuned_linear on CUDA (model/tuned_gemm.h): cuBLASLt's candidates for a shape, timed once, the fastest kept.
#include <ATen/core/grad_mode.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <dlfcn.h>
#include <ATen/cuda/CUDAGraphsUtils.cuh>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "model/tuned_gemm.h"

namespace rlt {

namespace {

// cuBLASLt's entry points as the process has them: the copy libtorch_cuda loaded, found by name, so that no
// second cuBLASLt (the toolkit's, say) comes in beside the cuBLAS torch uses. Empty where one is missing.
struct Lt {
  Lt() {
    auto find = [&](auto& f, const char* name) {
      f = reinterpret_cast<std::remove_reference_t<decltype(f)>>(dlsym(RTLD_DEFAULT, name));
      ok = ok && f != nullptr;
    };
    find(desc_create, "cublasLtMatmulDescCreate");
    find(desc_destroy, "cublasLtMatmulDescDestroy");
    find(desc_set, "cublasLtMatmulDescSetAttribute");
    find(layout_create, "cublasLtMatrixLayoutCreate");
    find(layout_destroy, "cublasLtMatrixLayoutDestroy");
    find(pref_create, "cublasLtMatmulPreferenceCreate");
    find(pref_destroy, "cublasLtMatmulPreferenceDestroy");
    find(pref_set, "cublasLtMatmulPreferenceSetAttribute");
    find(heuristic, "cublasLtMatmulAlgoGetHeuristic");
    find(matmul, "cublasLtMatmul");
  }
  bool ok = true;
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
};

const Lt& lt() {
  static const Lt l;
  return l;
}

void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error(std::string("tuned_linear: ") + what + " failed (cuBLAS status " +
                             std::to_string(static_cast<int>(s)) + ")");
  }
}

// Up to this many of cuBLASLt's candidates are timed, each with at most this much workspace.
constexpr int kCandidates = 16;
constexpr size_t kMaxWorkspace = size_t(32) << 20;

// The descriptors of y (M, N) = x (M, K) w (N, K)^T (+ b), in cuBLASLt's column-major terms: y^T (N, M) =
// w^T' (N, K) x^T (K, M), w read as the (K, N) column-major matrix that its rows are, transposed.
struct Problem {
  Problem(int64_t M, int64_t N, int64_t K, const void* bias) {
    try {
      describe(M, N, K, bias);
    } catch (...) {
      release();
      throw;
    }
  }
  ~Problem() { release(); }
  Problem(const Problem&) = delete;
  Problem& operator=(const Problem&) = delete;

  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;

 private:
  void describe(int64_t M, int64_t N, int64_t K, const void* bias) {
    check(lt().desc_create(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
    const cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
    check(lt().desc_set(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)), "TRANSA");
    check(lt().desc_set(desc, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof(n)), "TRANSB");
    if (bias) {
      const cublasLtEpilogue_t e = CUBLASLT_EPILOGUE_BIAS;
      const cudaDataType_t bt = CUDA_R_16BF;
      check(lt().desc_set(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof(e)), "EPILOGUE");
      check(lt().desc_set(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)), "BIAS_POINTER");
      check(lt().desc_set(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)), "BIAS_DATA_TYPE");
    }
    check(lt().layout_create(&a, CUDA_R_16BF, K, N, K), "layout of w");
    check(lt().layout_create(&b, CUDA_R_16BF, K, M, K), "layout of x");
    check(lt().layout_create(&c, CUDA_R_16BF, N, M, N), "layout of y");
  }
  void release() {
    if (c) lt().layout_destroy(c);
    if (b) lt().layout_destroy(b);
    if (a) lt().layout_destroy(a);
    if (desc) lt().desc_destroy(desc);
  }
};

struct Choice {
  bool lt = false;  // false: ATen's at::linear was the fastest
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
};

// device, M, N, K, bias, alignment, ATen's call left out (the test seam)
using Key = std::tuple<int, int64_t, int64_t, int64_t, bool, uint32_t, bool>;

// The largest power of two up to 256 that divides every address: what the chosen algorithm may assume.
uint32_t alignment(std::initializer_list<const void*> pointers) {
  uint32_t a = 256;
  for (const void* q : pointers) {
    const auto v = reinterpret_cast<uintptr_t>(q);
    while (a > 1 && v % a != 0) a /= 2;
  }
  return a;
}

std::mutex choices_mutex;
std::map<Key, Choice> choices;
TunedGemmCounts counts;

void run_lt(const Problem& p, const cublasLtMatmulAlgo_t& algo, size_t workspace, const at::Tensor& x,
            const at::Tensor& w, at::Tensor& y) {
  const float one = 1.0f, zero = 0.0f;
  at::Tensor ws;
  if (workspace > 0) ws = at::empty({static_cast<int64_t>(workspace)}, x.options().dtype(at::kByte));
  check(lt().matmul(at::cuda::getCurrentCUDABlasLtHandle(), p.desc, &one, w.data_ptr(), p.a, x.data_ptr(), p.b, &zero,
                    y.data_ptr(), p.c, y.data_ptr(), p.c, &algo, ws.defined() ? ws.data_ptr() : nullptr, workspace,
                    at::cuda::getCurrentCUDAStream()),
        "cublasLtMatmul");
}

at::Tensor aten_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  return b.defined() ? at::linear(x, w, b) : at::linear(x, w);
}

// Microseconds a call of f takes, the L2 cache cleared before each (a decode step reads its weights from
// memory): the median of 7 after 2 unmeasured calls.
template <typename F>
double time_us(F&& f, at::Tensor& flush) {
  std::vector<float> us;
  at::cuda::CUDAEvent t0(cudaEventDefault), t1(cudaEventDefault);  // timing events
  for (int r = 0; r < 9; ++r) {
    flush.zero_();
    t0.record();
    f();
    t1.record();
    t1.synchronize();
    if (r >= 2) us.push_back(t0.elapsed_time(t1) * 1000.0f);
  }
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

// Test seam (tuned_gemms_without_aten): ATen's call is no candidate, so a cuBLASLt algorithm is chosen.
std::atomic<bool> without_aten{false};

// cuBLASLt's candidates for p, as its heuristic ranks them; none where it has none.
std::vector<cublasLtMatmulHeuristicResult_t> candidates(const Problem& p, uint32_t align) {
  struct Preference {
    Preference() { check(lt().pref_create(&pref), "cublasLtMatmulPreferenceCreate"); }
    ~Preference() { lt().pref_destroy(pref); }
    cublasLtMatmulPreference_t pref = nullptr;
  } pr;
  const uint64_t most = kMaxWorkspace;
  check(lt().pref_set(pr.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &most, sizeof(most)), "MAX_WORKSPACE_BYTES");
  for (const auto attribute : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                               CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    check(lt().pref_set(pr.pref, attribute, &align, sizeof(align)), "MIN_ALIGNMENT");
  std::vector<cublasLtMatmulHeuristicResult_t> found(kCandidates);
  int n = 0;
  if (lt().heuristic(at::cuda::getCurrentCUDABlasLtHandle(), p.desc, p.a, p.b, p.c, p.c, pr.pref, kCandidates,
                     found.data(), &n) != CUBLAS_STATUS_SUCCESS)
    n = 0;
  found.resize(n);
  return found;
}

// The fastest of ATen's call and cuBLASLt's candidates whose products agree with ATen's (within a few bf16
// roundings of the largest). A candidate that fails, or a tuning that cannot run (no memory for its
// buffers), leaves ATen's call.
Choice tune(const Problem& p, const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, int64_t N,
            uint32_t align) {
  Choice best;
  try {
    const std::vector<cublasLtMatmulHeuristicResult_t> found = candidates(p, align);
    const int64_t l2 = at::cuda::getCurrentDeviceProperties()->l2CacheSize;
    at::Tensor flush = at::empty({2 * l2}, x.options().dtype(at::kByte));
    at::Tensor y = at::empty({x.size(0), N}, x.options());
    const at::Tensor want = aten_linear(x, w, b).to(at::kFloat);
    const double allowed = std::ldexp(want.abs().max().item<double>(), -6);
    double fastest =
        without_aten ? std::numeric_limits<double>::infinity() : time_us([&] { aten_linear(x, w, b); }, flush);
    for (const cublasLtMatmulHeuristicResult_t& f : found) {
      if (f.state != CUBLAS_STATUS_SUCCESS) continue;
      try {
        run_lt(p, f.algo, f.workspaceSize, x, w, y);
        if ((y.to(at::kFloat) - want).abs().max().item<double>() > allowed) continue;
        const double us = time_us([&] { run_lt(p, f.algo, f.workspaceSize, x, w, y); }, flush);
        if (us < fastest) fastest = us, best = {true, f.algo, f.workspaceSize};
      } catch (const std::exception&) {
        (void)cudaGetLastError();  // this candidate is out; the others are tried
      }
    }
  } catch (const std::exception&) {
    (void)cudaGetLastError();
    return Choice{};
  }
  return best;
}

}  // namespace

at::Tensor tuned_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  const bool grad =
      at::GradMode::is_enabled() && (x.requires_grad() || w.requires_grad() || (b.defined() && b.requires_grad()));
  const bool applies =
      lt().ok && !grad && x.is_cuda() && x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16 &&
      w.dim() == 2 && w.is_contiguous() && x.size(-1) == w.size(1) && x.numel() > 0 &&
      (!b.defined() ||
       (b.scalar_type() == at::kBFloat16 && b.is_contiguous() && b.dim() == 1 && b.size(0) == w.size(0)));
  if (!applies) return aten_linear(x, w, b);
  const int64_t K = w.size(1), N = w.size(0);
  const at::Tensor x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  const c10::cuda::CUDAGuard guard(x.device());
  // y comes from the caching allocator, whose blocks start at 512-byte boundaries.
  const uint32_t align = alignment({x2.data_ptr(), w.data_ptr(), b.defined() ? b.data_ptr() : nullptr});
  const Key key{x.get_device(), M, N, K, b.defined(), align, without_aten.load()};
  Choice choice;
  bool known = false;
  {
    std::lock_guard<std::mutex> lock(choices_mutex);
    const auto it = choices.find(key);
    if (it != choices.end()) choice = it->second, known = true;
  }
  if (known && !choice.lt) return aten_linear(x, w, b);
  const Problem p(M, N, K, b.defined() ? b.data_ptr() : nullptr);
  if (!known) {
    if (at::cuda::currentStreamCaptureStatusMayInitCtx() != at::cuda::CaptureStatus::None)
      return aten_linear(x, w, b);  // nothing can be timed inside a capture
    choice = tune(p, x2, w, b, N, align);
    std::lock_guard<std::mutex> lock(choices_mutex);
    if (choices.emplace(key, choice).second) ++counts.shapes, counts.lt_chosen += choice.lt ? 1 : 0;
  }
  if (!choice.lt) return aten_linear(x, w, b);
  at::Tensor y = at::empty({M, N}, x.options());
  run_lt(p, choice.algo, choice.workspace, x2, w, y);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return y.view(shape);
}

void tuned_gemms_without_aten(bool on) { without_aten = on; }

TunedGemmCounts tuned_gemm_counts() {
  std::lock_guard<std::mutex> lock(choices_mutex);
  return counts;
}

}  // namespace rlt
