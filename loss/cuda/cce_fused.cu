// The fused Hopper CCE kernels: logits tiles z = h W^T computed on the tensor cores (wgmma; operands brought
// in by TMA; a producer warp and two consumer warp groups; CUTLASS's SM90 mainloop) and consumed while
// they are still in registers, by one of two epilogues:
//   forward:  fold the tile into each row's online softmax state (max m, s = sum e^{x-m},
//             t = sum e^{x-m}(x-m), x = softcap(z) / temp); nothing of [N, V] reaches memory;
//   backward: form the tile's logits gradient dz (loss/cce.cpp's formula) and write it in the operand
//             dtype for the dE and dW GEMMs, flagging each 64-row x 256-entry part that holds an entry with
//             p >= eps or a target.
// The dE and dW GEMMs (further down) are ours too: persistent, over the flagged parts of dz only, so gradient
// filtering skips work per tile without a host read.
//
// Work split. Forward: a thread block owns 128 rows (64 under ping-pong, below) and a contiguous run of 256-entry
// vocabulary tiles (a "split"); it writes one (m, s, t) per row and split, and cce_fused_finish_kernel merges the
// splits, adds the target logit (a dot product per row) and writes log-prob, lse and entropy. Backward: the same split
// of a vocabulary block's tiles; each tile's gradient is written as it is formed. With 128 x 256 tiles a consumer
// thread holds 2 rows x 64 entries of a tile; the 4 threads of a quad share a row. Two thread blocks of neighbouring
// row tiles form a cluster and walk the same vocabulary tiles, so each W tile is loaded from L2 once for both (TMA
// multicast).
#include "loss/cuda/cce_fused.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <numeric>

#include "loss/cuda/online_softmax.cuh"

#ifdef RLT_HAVE_CUTLASS
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/pipeline/pipeline.hpp>
#endif

namespace rlt::cuda {

#ifdef RLT_HAVE_CUTLASS

namespace {

using namespace cute;

constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;

// Two ways for the two consumer warp groups to share the tensor cores (loss.cce_pingpong picks one):
// - cooperative (the default): both work on one 128 x 256 tile (64 rows each) and both run its epilogue
//   after its MMAs, so the tensor cores idle during every epilogue. 4 stages of 48 KiB; 2-block clusters
//   share W tiles.
// - ping-pong: each warp group owns a whole 64 x 256 tile of a 64-row thread block and the two take
//   alternate vocabulary tiles, so one's epilogue runs under the other's MMAs (the producer loads the
//   tiles in order; named barriers keep the MMAs alternating). 5 stages of 40 KiB; 4-block clusters share
//   each W tile, so the L2 traffic per MMA stays that of the cooperative tiles. Measured slower on the
//   H100 in every row but one (docs/benchmarks.md; not profiled: likely the shared-memory reads of W,
//   twice per row as many as a 128-row tile's), so it is an ablation.
// Either way a consumer thread holds 2 rows x 64 entries of its tile, so the epilogues are the same.
template <class Element, bool kPingpong>
struct Config {
  using TileShape = std::conditional_t<kPingpong, Shape<_64, _256, _64>, Shape<_128, _256, _64>>;
  using ClusterShape = std::conditional_t<kPingpong, Shape<_4, _1, _1>, Shape<_2, _1, _1>>;
  using Schedule = std::conditional_t<kPingpong, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                      cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, 8, Element,
      cutlass::layout::ColumnMajor, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<0>, Schedule>::CollectiveOp;
  using TiledMma = typename Mainloop::TiledMma;
  using Pipeline = typename Mainloop::MainloopPipeline;
  struct SharedStorage {
    typename Mainloop::TensorStorage tensors;
    alignas(16) typename Mainloop::PipelineStorage pipeline;
  };
  static constexpr int kThreads = 384;  // a producer warp group and two consumer warp groups
  static constexpr int kBlockM = kPingpong ? 64 : 128, kBlockN = 256;
  static constexpr int kCluster = kPingpong ? 4 : 2;
  static constexpr int kMmaThreads = kPingpong ? 128 : 256;  // the threads of one tile's MMA
  static constexpr int kStates = kPingpong ? 2 : 1;          // forward states a thread block writes per row
  static_assert(sizeof(SharedStorage) <= 227 * 1024, "shared memory");
};

// 2^x on the SFU (ex2.approx.ftz: relative error ~2^-22, subnormal results flushed to 0).
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// tanh u = 1 - 2 / (e^{2u} + 1): two SFU operations; absolute error ~1e-7 (the softcap multiplies it by cap).
__device__ __forceinline__ float fast_tanh(float u) { return 1.f - 2.f / (1.f + __expf(2.f * u)); }

// out[0] = a and, when `both`, out[1] = b, in the operand dtype; one 4-byte store when both are written and
// `word` says out is 4-byte aligned (an even row stride and base).
template <class Element>
__device__ __forceinline__ void store_pair(Element* out, float a, float b, bool both, bool word) {
  if (both && word) {
    const Element pair[2] = {Element(a), Element(b)};
    uint32_t bits;
    memcpy(&bits, pair, sizeof(bits));
    *reinterpret_cast<uint32_t*>(out) = bits;
  } else {
    out[0] = Element(a);
    if (both) out[1] = Element(b);
  }
}

// An accumulator fragment ((2, 2, N/8), MMA_M, MMA_N) seen as (rows, columns): the wgmma C layout puts a
// thread's values of rows r and r + 8 in mode (0, 1) and its columns in modes (0, 0) and (0, 2), so columns
// 2j and 2j + 1 of the view are neighbours in the tile.
template <class Layout>
CUTE_HOST_DEVICE auto rows_cols(Layout l) {
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}

// Forward epilogue: the online softmax state per row, in base-2 units y = x log2(e) (m2 = max y,
// s = sum 2^{y - m2}, t2 = sum 2^{y - m2} (y - m2)), so a logit costs one FFMA, one MUFU ex2 and two adds.
// Its code is kept small on purpose: with a branch per element (cap, temperature, mask) fully unrolled it
// missed the instruction cache and ran at a quarter of the mainloop's speed (ncu: "no instruction" stalls).
struct ForwardEpilogue {
  struct Args {
    float cap, temp;
    bool entropy;
    float* part;  // (3, states, n): m, s, t per row and state (a split, or a warp group of one under ping-pong)
  };
  static constexpr int kRows = 2;
  const Args& a;
  float k2;  // y per logit unit
  float m2[kRows], s2[kRows], t2[kRows];

  __device__ ForwardEpilogue(const Args& args) : a(args), k2(kLog2e / args.temp) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) m2[r] = -INFINITY, s2[r] = 0.f, t2[r] = 0.f;
  }

  // acc: the tile's fragment; coords: its (row, column) in the tile; valid: columns inside the vocabulary.
  template <class Acc, class Coords>
  __device__ void tile(Acc& acc, const Coords& coords, int valid, int) {
    if (a.cap > 0.f) {  // the final-logit softcap (gemma-2): cap tanh(z / cap)
      const float inv = 1.f / a.cap;
#pragma unroll
      for (int i = 0; i < size(acc); ++i) acc(i) = a.cap * fast_tanh(acc(i) * inv);
    }
    if (valid < 256) {
#pragma unroll
      for (int i = 0; i < size(acc); ++i) {
        if (get<1>(coords(i)) >= valid) acc(i) = -INFINITY;
      }
    }
    Tensor x = make_tensor(acc.data(), rows_cols(acc.layout()));
    static_assert(decltype(size<0>(x))::value == kRows, "2 rows per thread");
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int c = 0; c < size<1>(x); ++c) mx = fmaxf(mx, x(r, c));
      const float m = fmaxf(m2[r], mx * k2);
      // Rebase to the new max (by 2^{m_old - m}); a state still at -inf has nothing to rebase.
      const bool empty = m2[r] == -INFINITY;
      const float rs = empty ? 0.f : ex2(m2[r] - m);
      float s = s2[r] * rs, t = empty ? 0.f : rs * (t2[r] - s2[r] * (m - m2[r]));
#pragma unroll
      for (int c = 0; c < size<1>(x); ++c) {
        // Clamped at -127: a masked column (-inf, or NaN when all of this thread's columns are masked) adds
        // 2^-127, flushed to 0, instead of NaN to t.
        const float d = fmaxf(fmaf(x(r, c), k2, -m), -127.f);
        const float e = ex2(d);
        s += e;
        t = fmaf(e, d, t);
      }
      m2[r] = m, s2[r] = s, t2[r] = t;
    }
  }

  // The 4 threads of a quad hold the same rows: merge them, then one writes the split's state.
  template <class Coords>
  __device__ void finish(const Coords& coords, int row0, int n, int split, int splits) {
    Tensor xc = make_tensor(coords.data(), rows_cols(coords.layout()));
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      Online st{m2[r] * kLn2, s2[r], a.entropy ? t2[r] * kLn2 : 0.f};
      for (int off = 1; off < 4; off <<= 1) {
        const Online o{__shfl_xor_sync(0xffffffff, st.m, off), __shfl_xor_sync(0xffffffff, st.s, off),
                       __shfl_xor_sync(0xffffffff, st.t, off)};
        st = merge(st, o);
      }
      const int row = row0 + get<0>(xc(r, 0));
      if (lane % 4 == 0 && row < n) {
        const int64_t plane = int64_t{splits} * n, at = int64_t{split} * n + row;
        a.part[at] = st.m;
        a.part[plane + at] = st.s;
        a.part[2 * plane + at] = st.t;
      }
    }
  }
};

// Backward epilogue: dz = (-p (glp + gH (log p + H)) + glp [v = y]) / temp, times 1 - tanh^2(z / cap) under a
// softcap, p = e^{x - lse}; written to g (n, ld) in the operand dtype. The same formula as
// cce_backward_kernel (cce_kernels.cu), which the GPU tests hold this to.
// As in the forward, the per-entry loop is kept small and branch-free: the softcap and the mask of columns
// past the vocabulary are separate passes taken only when needed, and the loop is specialised on whether
// an entropy gradient and a softcap are present (one version runs per launch, so the instruction cache
// holds only it). Filtering keeps each row's largest p and decides once per tile.
template <class Element>
struct BackwardEpilogue {
  struct Args {
    float cap, temp, eps;
    const float *lse, *H, *glp, *gH;  // (n); H and gH null without an entropy gradient
    const int64_t* targets;           // (n), relative to v0
    int64_t v0;                       // the block's first vocabulary entry
    Element* g;                       // (n, ld)
    int64_t ld;
    // Tile filtering (null: none): flags (rows / 64, ldf) int32; a warp group's 64 rows x 256 entries of a tile
    // get `stamp` when one of its rows has an entry with p >= eps or its target there.
    int* flags;
    int ldf, stamp;
  };
  static constexpr int kRows = 2;
  const Args& a;
  // Per row: log2-domain lse, -glp / temp, -gH / temp, H (the entropy gradient's terms; 0 without it).
  float l2[kRows], na[kRows], nb[kRows], h[kRows];
  int64_t y[kRows];
  int row[kRows];
  int flag_row;  // this warp's 64-row group (a warp's 16 rows lie in one)

  template <class Coords>
  __device__ BackwardEpilogue(const Args& args, const Coords& coords, int row0, int n) : a(args) {
    Tensor xc = make_tensor(coords.data(), rows_cols(coords.layout()));
    const float inv_temp = 1.f / a.temp;
    flag_row = (row0 + get<0>(xc(0, 0))) / 64;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      row[r] = row0 + get<0>(xc(r, 0));
      const int q = min(row[r], n - 1);  // rows past n compute on zeros and are not written
      l2[r] = a.lse[q] * kLog2e;
      na[r] = -a.glp[q] * inv_temp;
      nb[r] = a.gH ? -a.gH[q] * inv_temp : 0.f;
      h[r] = a.gH ? a.H[q] : 0.f;
      y[r] = a.targets[q] - a.v0;
      if (row[r] >= n) row[r] = -1;
    }
  }

  // x: the tile as (rows, columns), capped and masked; writes dz over it and returns each row's largest p.
  template <bool kEntropy, bool kCap, class X, class XC>
  __device__ void gradient(X& x, const XC& xc, int col0, float (&pmax)[kRows]) {
    const float k2 = kLog2e / a.temp, inv_cap = kCap ? 1.f / a.cap : 0.f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      // The target's column in this tile, or -1: the entry that gets + glp / temp.
      const int64_t t = y[r] - col0;
      const int ty = t >= 0 && t < 256 ? static_cast<int>(t) : -1;
      float pm = 0.f;
#pragma unroll
      for (int c = 0; c < size<1>(x); ++c) {
        const float z = x(r, c);
        const float lp2 = fmaf(z, k2, -l2[r]);  // log2 p
        const float p = ex2(lp2);
        pm = fmaxf(pm, p);
        float g = kEntropy ? p * fmaf(nb[r], fmaf(lp2, kLn2, h[r]), na[r]) : p * na[r];
        if (get<1>(xc(r, c)) == ty) g -= na[r];
        if (kCap) {
          const float u = z * inv_cap;  // tanh(z_raw / cap)
          g *= fmaf(-u, u, 1.f);
        }
        x(r, c) = g;
      }
      pmax[r] = pm;
    }
  }

  template <class Acc, class Coords>
  __device__ void tile(Acc& acc, const Coords& coords, int valid, int col0) {
    if (a.cap > 0.f) {  // z <- cap tanh(z / cap); the chain factor is recomputed from it
      const float inv = 1.f / a.cap;
#pragma unroll
      for (int i = 0; i < size(acc); ++i) acc(i) = a.cap * fast_tanh(acc(i) * inv);
    }
    if (valid < 256) {  // columns past the block (TMA's zero fill): p = 0, never stored
#pragma unroll
      for (int i = 0; i < size(acc); ++i) {
        if (get<1>(coords(i)) >= valid) acc(i) = -INFINITY;
      }
    }
    Tensor x = make_tensor(acc.data(), rows_cols(acc.layout()));
    Tensor xc = make_tensor(coords.data(), rows_cols(coords.layout()));
    float pmax[kRows];
    if (a.gH) {
      if (a.cap > 0.f) {
        gradient<true, true>(x, xc, col0, pmax);
      } else {
        gradient<true, false>(x, xc, col0, pmax);
      }
    } else {
      if (a.cap > 0.f) {
        gradient<false, true>(x, xc, col0, pmax);
      } else {
        gradient<false, false>(x, xc, col0, pmax);
      }
    }
    if (a.flags) {
      bool active = false;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int64_t t = y[r] - col0;  // the target's column in this tile
        active |= row[r] >= 0 && (pmax[r] >= a.eps || (t >= 0 && t < min(valid, 256)));
      }
      if (__any_sync(0xffffffff, active) && threadIdx.x % 32 == 0) a.flags[flag_row * a.ldf + col0 / 256] = a.stamp;
    }
    // Store pairs of neighbouring columns as one 4-byte word where the row stride allows it.
    const bool pairs = a.ld % 2 == 0;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (row[r] < 0) continue;
      Element* out = a.g + row[r] * a.ld + col0;
#pragma unroll
      for (int c = 0; c < size<1>(x); c += 2) {
        const int col = get<1>(xc(r, c));
        if (col < valid) store_pair(out + col, x(r, c), x(r, c + 1), col + 1 < valid, pairs);
      }
    }
  }

  template <class Coords>
  __device__ void finish(const Coords&, int, int, int, int) {}
};

// Ping-pong order: a warp group starts a tile's MMAs only once the other has issued every MMA of the tile
// before (warp group c arrives on named barrier 1 + c; 256 threads: the 128 that arrive and the 128 that
// wait). Besides keeping one's epilogue under the other's MMAs, the order is needed for correctness: a tile
// spans more k-blocks than the ring has stages, and a warp group that waited on a stage's phase parity
// early could take a fill one lap of the ring too soon.
__device__ __forceinline__ void named_arrive(int id) { asm volatile("bar.arrive %0, 256;" ::"r"(id) : "memory"); }
__device__ __forceinline__ void named_sync(int id) { asm volatile("bar.sync %0, 256;" ::"r"(id) : "memory"); }

// The TMA pipeline of a kernel whose warp 0 loads (the producer) and whose warp groups 1 and 2 multiply (the
// consumers; `consumers` of their threads release each stage). Initialises the barriers (the caller synchronises the
// block or cluster before any load) and prefetches the TMA descriptors.
template <class Mainloop, class ClusterShape, class Storage>
__device__ typename Mainloop::MainloopPipeline start_pipeline(Storage& storage, const typename Mainloop::Params& params,
                                                              int consumers) {
  using Pipeline = typename Mainloop::MainloopPipeline;
  const int warp_group = threadIdx.x / 128, warp_in_group = (threadIdx.x / 32) % 4;
  if (threadIdx.x == 0) Mainloop::prefetch_tma_descriptors(params);
  typename Pipeline::Params pp;
  if (warp_group == 0 && warp_in_group == 0) pp.role = Pipeline::ThreadCategory::Producer;
  if (warp_group > 0) pp.role = Pipeline::ThreadCategory::Consumer;
  pp.is_leader = threadIdx.x % 128 == 0;
  pp.num_consumers = consumers;
  pp.transaction_bytes = params.tma_transaction_bytes;
  return Pipeline(storage, pp, ClusterShape{});
}

template <class Element, class Epilogue, bool kPingpong>
struct Params {
  typename Config<Element, kPingpong>::Mainloop::Params mainloop;
  int n, V, D;  // rows, vocabulary (of this call), hidden size (a multiple of 8)
  int n_tiles;  // vocabulary tiles
  int splits;   // vocabulary splits (gridDim.y)
  typename Epilogue::Args epi;
};

template <class Element, class Epilogue, bool kPingpong>
__global__ void __launch_bounds__(384, 1)
    cce_fused_kernel(const __grid_constant__ Params<Element, Epilogue, kPingpong> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cfg = Config<Element, kPingpong>;
  using Mainloop = typename Cfg::Mainloop;
  using Pipeline = typename Cfg::Pipeline;
  extern __shared__ __align__(128) char smem[];
  auto& shared = *reinterpret_cast<typename Cfg::SharedStorage*>(smem);

  const int warp_group = threadIdx.x / 128, warp_in_group = (threadIdx.x / 32) % 4;
  Pipeline pipeline =
      start_pipeline<Mainloop, typename Cfg::ClusterShape>(shared.pipeline, p.mainloop, Cfg::kMmaThreads);
  // Every block of the cluster must see the barriers initialised before any multicast arrives.
  cute::cluster_arrive_relaxed();
  cute::cluster_wait();

  Mainloop mainloop;
  auto inputs = mainloop.load_init(make_shape(p.n, p.V, p.D, 1), p.mainloop);
  const int k_tiles = size<3>(get<0>(inputs));
  const int m_tile = blockIdx.x, split = blockIdx.y;
  const int t0 = static_cast<int>(int64_t{split} * p.n_tiles / p.splits);
  const int t1 = static_cast<int>(int64_t{split + 1} * p.n_tiles / p.splits);

  if (warp_group == 0) {  // the producer: one warp issues the TMA loads
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (warp_in_group == 0) {
      auto write = cutlass::make_producer_start_state<Pipeline>();
      for (int nt = t0; nt < t1; ++nt) {
        auto k_iter = make_coord_iterator(shape<3>(get<0>(inputs)));
        mainloop.load(p.mainloop, pipeline, write, inputs, make_coord(m_tile, nt, _, 0), k_iter, k_tiles,
                      threadIdx.x % 32, cute::block_rank_in_cluster(), shared.tensors);
        write.advance(k_tiles);
      }
      mainloop.load_tail(pipeline, write);
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<232>();
  typename Cfg::TiledMma mma;
  const int consumer = warp_group - 1;  // ping-pong: this warp group's turn (0 or 1)
  const int mma_thread = kPingpong ? threadIdx.x % 128 : threadIdx.x - 128;
  Tensor acc = partition_fragment_C(mma, take<0, 2>(typename Cfg::TileShape{}));  // (MMA, MMA_M, MMA_N) fp32
  Tensor coords = mma.get_slice(mma_thread).partition_C(make_identity_tensor(take<0, 2>(typename Cfg::TileShape{})));
  const int row0 = m_tile * Cfg::kBlockM;
  Epilogue epi = [&] {
    if constexpr (std::is_same_v<Epilogue, ForwardEpilogue>) {
      return Epilogue(p.epi);
    } else {
      return Epilogue(p.epi, coords, row0, p.n);
    }
  }();
  // Ping-pong: warp group c takes tiles t0 + c, t0 + c + 2, ... and skips the other's stages.
  const int first = kPingpong ? t0 + consumer : t0, step = kPingpong ? 2 : 1;
  typename Mainloop::PipelineState read;
  if (kPingpong) read.advance(consumer * k_tiles);
  for (int nt = first; nt < t1; nt += step) {
    if (kPingpong && nt > t0) named_sync(1 + (1 - consumer));  // the previous tile's MMAs are issued
    mainloop.mma(pipeline, read, acc, k_tiles, mma_thread, shared.tensors, p.mainloop);
    if (kPingpong && nt + 1 < t1) named_arrive(1 + consumer);  // the next tile's warp group may start
    mainloop.mma_tail(pipeline, read, k_tiles);
    read.advance(step * k_tiles);
    epi.tile(acc, coords, p.V - nt * Cfg::kBlockN, nt * Cfg::kBlockN);
  }
  // Forward: one state per row from each warp group that walked a tile run of its own.
  epi.finish(coords, row0, p.n, split * Cfg::kStates + (kPingpong ? consumer : 0), p.splits * Cfg::kStates);
#endif
}

// One warp per row: merges the splits' states, adds the target logit (an fp32 dot product of the row and
// W[y]) and writes log-prob, lse and entropy. A target outside [0, V) gives a NaN log-prob, which the
// trainer's finite-loss check reports, instead of a read out of bounds.
template <class Element>
__global__ void cce_fused_finish_kernel(const float* __restrict__ part, int n, int splits,
                                        const Element* __restrict__ h, const Element* __restrict__ w, int64_t V, int D,
                                        const int64_t* __restrict__ y, float cap, float temp, bool entropy, float* logp,
                                        float* lse, float* H) {
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= n) return;
  const int64_t plane = int64_t{splits} * n;
  Online st{-INFINITY, 0.f, 0.f};
  for (int k = lane; k < splits; k += 32) {
    const int64_t at = int64_t{k} * n + row;
    st = merge(st, Online{part[at], part[plane + at], part[2 * plane + at]});
  }
  for (int off = 16; off > 0; off >>= 1) {
    st = merge(st, Online{__shfl_xor_sync(0xffffffff, st.m, off), __shfl_xor_sync(0xffffffff, st.s, off),
                          __shfl_xor_sync(0xffffffff, st.t, off)});
  }
  const int64_t target = y[row];
  const bool in_range = target >= 0 && target < V;
  float dot = 0.f;
  if (in_range) {
    const uint4* hv = reinterpret_cast<const uint4*>(h + int64_t{row} * D);
    const uint4* wv = reinterpret_cast<const uint4*>(w + target * D);
    for (int i = lane; i < D / 8; i += 32) {  // 8 elements (16 bytes) per load
      const uint4 a = hv[i], b = wv[i];
      const Element* ae = reinterpret_cast<const Element*>(&a);
      const Element* be = reinterpret_cast<const Element*>(&b);
#pragma unroll
      for (int j = 0; j < 8; ++j) dot = fmaf(float(ae[j]), float(be[j]), dot);
    }
  }
  for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffff, dot, off);
  if (lane != 0) return;
  if (cap > 0.f) dot = cap * tanhf(dot / cap);
  const float l = st.m + logf(st.s);
  lse[row] = l;
  logp[row] = in_range ? scale(dot, temp) - l : NAN;
  if (entropy) H[row] = logf(st.s) - st.t / st.s;
}

// Vocabulary splits (forward and backward): enough thread blocks to fill whole waves of the GPU's SMs (row tiles x
// splits a multiple of the SM count where possible), each with at least 4 tiles per consumer (ping-pong: per
// warp group) so the pipeline's fill and the last epilogue are paid rarely.
template <bool kPingpong>
int vocab_splits(int m_tiles, int n_tiles) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int per_wave = sms / std::gcd(m_tiles, sms);
  return std::max(1, std::min(per_wave, n_tiles / (4 * Config<cutlass::bfloat16_t, kPingpong>::kStates)));
}

// TMA wants 16-byte aligned rows and base pointers: D a multiple of 8 (bf16/fp16). Other operands are copied
// into zero-padded ones (the padding adds nothing to a dot product).
at::Tensor tma_ready(const at::Tensor& a) {
  const int64_t D = a.size(1), Dp = (D + 7) / 8 * 8;
  const bool aligned = reinterpret_cast<uintptr_t>(a.data_ptr()) % 16 == 0;
  if (Dp == D && aligned && a.stride(1) == 1 && a.stride(0) == D) return a;
  at::Tensor out = at::zeros({a.size(0), Dp}, a.options());
  out.narrow(1, 0, D).copy_(a);
  return out;
}

// Row tiles, rounded up to whole clusters (a block past the last row computes on TMA's zero fill and writes
// nothing), and vocabulary tiles of an (n, V) problem.
template <bool kPingpong>
std::pair<int, int> tiles(int64_t n, int64_t V) {
  using Cfg = Config<cutlass::bfloat16_t, kPingpong>;
  constexpr int kRowsPerCluster = Cfg::kCluster * Cfg::kBlockM;
  const int m_tiles = static_cast<int>((n + kRowsPerCluster - 1) / kRowsPerCluster) * Cfg::kCluster;
  return {m_tiles, static_cast<int>((V + 255) / 256)};
}

// Launches the fused kernel over h (n, D) x w (V, D) with `splits` vocabulary splits.
template <class Element, class Epilogue, bool kPingpong>
void launch(const at::Tensor& h, const at::Tensor& w, int splits, const typename Epilogue::Args& epi) {
  using Cfg = Config<Element, kPingpong>;
  using Mainloop = typename Cfg::Mainloop;
  const int n = static_cast<int>(h.size(0)), V = static_cast<int>(w.size(0)), D = static_cast<int>(h.size(1));
  const auto [m_tiles, n_tiles] = tiles<kPingpong>(n, V);
  typename Mainloop::Arguments args{
      reinterpret_cast<const Element*>(h.data_ptr()), make_stride(int64_t{D}, _1{}, int64_t{0}),
      reinterpret_cast<const Element*>(w.data_ptr()), make_stride(int64_t{D}, _1{}, int64_t{0})};
  Params<Element, Epilogue, kPingpong> p{
      Mainloop::to_underlying_arguments(make_shape(n, V, D, 1), args, nullptr), n, V, D, n_tiles, splits, epi};
  const int smem = sizeof(typename Cfg::SharedStorage);
  auto kernel = cce_fused_kernel<Element, Epilogue, kPingpong>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(m_tiles, splits);
  config.blockDim = dim3(Cfg::kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = at::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute cluster[1];
  cluster[0].id = cudaLaunchAttributeClusterDimension;
  cluster[0].val.clusterDim.x = Cfg::kCluster;
  cluster[0].val.clusterDim.y = 1;
  cluster[0].val.clusterDim.z = 1;
  config.attrs = cluster;
  config.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p));
}

// The backward's dE and dW GEMMs over the tiles of a block's logits gradient g (n, k) that tile filtering kept:
//   dE (n, D) += g w        (M = rows, K = vocabulary entries; A = g, K-major)
//   dW (k, D)  = g^T h      (M = vocabulary entries, K = rows; A = g^T, M-major), or += into an fp32 block
// B (w or h) is N-major: hidden is the contiguous dimension. A k-block of A is loaded and multiplied only when a
// flag of the g tiles it covers carries the block's stamp (the backward epilogue sets them): its other entries
// have p < eps and no target, the gradient filter's dropped part. An output tile with no kept k-block is left
// alone (dE) or written as zeros (dW). No host synchronisation: the decision is read on the device.
// 128 x 192 output tiles (D = 2304 is 12 of them; 2 x 9 x 256 would leave a third of a wave idle), no
// clusters (the thread blocks' k-blocks differ, so TMA multicast does not apply).
constexpr int kMaxKeptWords = 64;  // k-blocks of 64 per tile: up to 131072 rows (dW) or entries (dE) per block

template <class Element, bool kDW>
struct SparseConfig {
  using TileShape = Shape<_128, _192, _64>;
  using ClusterShape = Shape<_1, _1, _1>;
  using LayoutA = std::conditional_t<kDW, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, 8, Element, cutlass::layout::RowMajor, 8,
      float, TileShape, ClusterShape, cutlass::gemm::collective::StageCountAutoCarveout<0>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using TiledMma = typename Mainloop::TiledMma;
  using Pipeline = typename Mainloop::MainloopPipeline;
  struct SharedStorage {
    typename Mainloop::TensorStorage tensors;
    alignas(16) typename Mainloop::PipelineStorage pipeline;
    uint32_t kept[kMaxKeptWords];  // the producer's current tile: its kept k-blocks as bits
  };
  static constexpr int kBlockM = 128, kBlockN = 192, kBlockK = 64;
  static_assert(sizeof(SharedStorage) <= 227 * 1024, "shared memory");
};

// Which k-blocks of an output tile are kept. flags (rows / 64, ldf): one per 64 rows x 256 entries of g.
struct KeptBlocks {
  const int* flags;
  int ldf, flag_rows, stamp, k_blocks;
  bool dW;
  // dE: k-block k spans entries 64k.. of rows 128 m.. (flag rows 2m, 2m + 1, column k / 4); dW: it spans rows
  // 64k.. (flag row k) of entries 128 m.. (flag column m / 2).
  __device__ bool kept(int m_tile, int k) const {
    if (k >= k_blocks) return false;
    if (dW) return __ldg(flags + k * ldf + m_tile / 2) == stamp;
    const int r = 2 * m_tile, c = k / 4;
    return __ldg(flags + r * ldf + c) == stamp || (r + 1 < flag_rows && __ldg(flags + (r + 1) * ldf + c) == stamp);
  }
  // A whole warp: the kept k-blocks of a tile as bits (word w: k-blocks 32w..32w + 31), 32 flags read at once.
  // Writes the words to `mask` when given; returns how many are kept.
  __device__ int scan(int m_tile, uint32_t* mask) const {
    const int lane = threadIdx.x % 32;
    int count = 0;
    for (int w = 0; w * 32 < k_blocks; ++w) {
      const uint32_t bits = __ballot_sync(0xffffffff, kept(m_tile, w * 32 + lane));
      if (mask && lane == 0) mask[w] = bits;
      count += __popc(bits);
    }
    __syncwarp();
    return count;
  }
};

// The producer's k iterator over a tile's kept k-blocks (bits in shared memory), in order; the mainloop reads *it
// and advances it once a load.
struct KeptIterator {
  const uint32_t* mask;
  int k, k_blocks;
  __device__ int operator*() const { return k; }
  __device__ KeptIterator& operator++() {
    k = next(mask, k + 1, k_blocks);
    return *this;
  }
  __device__ static int next(const uint32_t* mask, int k, int k_blocks) {
    while (k < k_blocks) {
      const uint32_t rest = mask[k / 32] >> (k % 32);
      if (rest) return k + __ffs(rest) - 1;
      k = (k / 32 + 1) * 32;
    }
    return k_blocks;
  }
};

template <class Element, bool kDW>
struct SparseParams {
  typename SparseConfig<Element, kDW>::Mainloop::Params mainloop;
  int M, N, K;
  int m_tiles, tiles;
  KeptBlocks kb;
  float* add;      // fp32 output to accumulate into, or
  Element* store;  // an output in the operand dtype to overwrite
  int64_t ldo;
  bool pairs;  // the output's rows and base allow two-element stores
};

// Persistent: each thread block walks output tiles blockIdx.x, + gridDim.x, ... with one pipeline, so the
// producer loads a tile's first k-blocks while the consumers write the last one's (a tile keeps only a few
// k-blocks when the filter skips most: per-tile fill and epilogue would dominate otherwise).
template <class Element, bool kDW>
__global__ void __launch_bounds__(384, 1) cce_sparse_gemm_kernel(const __grid_constant__ SparseParams<Element, kDW> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cfg = SparseConfig<Element, kDW>;
  using Mainloop = typename Cfg::Mainloop;
  using Pipeline = typename Cfg::Pipeline;
  static_assert(Cfg::kBlockM == 128 && Cfg::kBlockK == 64, "KeptBlocks maps these tiles onto 64 x 256 flags");
  extern __shared__ __align__(128) char smem[];
  auto& shared = *reinterpret_cast<typename Cfg::SharedStorage*>(smem);

  const int warp_group = threadIdx.x / 128, warp_in_group = (threadIdx.x / 32) % 4;
  Pipeline pipeline = start_pipeline<Mainloop, typename Cfg::ClusterShape>(shared.pipeline, p.mainloop, 256);
  __syncthreads();  // the barriers initialised before any load arrives

  Mainloop mainloop;
  auto inputs = mainloop.load_init(make_shape(p.M, p.N, p.K, 1), p.mainloop);

  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (warp_in_group == 0) {
      auto write = cutlass::make_producer_start_state<Pipeline>();
      for (int t = blockIdx.x; t < p.tiles; t += gridDim.x) {
        const int m_tile = t % p.m_tiles, n_tile = t / p.m_tiles;
        const int kept = p.kb.scan(m_tile, shared.kept);
        if (kept == 0) continue;
        mainloop.load(p.mainloop, pipeline, write, inputs, make_coord(m_tile, n_tile, _, 0),
                      KeptIterator{shared.kept, KeptIterator::next(shared.kept, 0, p.kb.k_blocks), p.kb.k_blocks}, kept,
                      threadIdx.x % 32, 0, shared.tensors);
        write.advance(kept);
        __syncwarp();  // the elected lane is done with this tile's bits
      }
      mainloop.load_tail(pipeline, write);
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<232>();
  typename Cfg::TiledMma mma;
  const int mma_thread = threadIdx.x - 128;
  Tensor acc = partition_fragment_C(mma, take<0, 2>(typename Cfg::TileShape{}));
  Tensor coords = mma.get_slice(mma_thread).partition_C(make_identity_tensor(take<0, 2>(typename Cfg::TileShape{})));
  Tensor x = make_tensor(acc.data(), rows_cols(acc.layout()));
  Tensor xc = make_tensor(coords.data(), rows_cols(coords.layout()));
  constexpr int kCols = decltype(size<1>(x))::value;
  static_assert(kCols % 16 == 0, "the read-modify-write takes 8 column pairs at a time");
  typename Mainloop::PipelineState read;
  for (int t = blockIdx.x; t < p.tiles; t += gridDim.x) {
    const int m_tile = t % p.m_tiles, n_tile = t / p.m_tiles;
    const int kept = p.kb.scan(m_tile, nullptr);
    if (kept == 0) {
      if (p.add) continue;  // nothing to add
      clear(acc);
    } else {
      mainloop.mma(pipeline, read, acc, kept, mma_thread, shared.tensors, p.mainloop);
      mainloop.mma_tail(pipeline, read, kept);
      read.advance(kept);
    }
    const int col0 = n_tile * Cfg::kBlockN;
    const bool full = p.pairs && col0 + Cfg::kBlockN <= p.N;  // every column inside, two-element accesses
#pragma unroll
    for (int r = 0; r < size<0>(x); ++r) {
      const int row = m_tile * Cfg::kBlockM + get<0>(xc(r, 0));
      if (row >= p.M) continue;
      if (p.add && full) {
        // Read-modify-write in chunks of 8 pairs: the loads of a chunk are issued together (one after another,
        // each load would wait out its own latency behind the previous store).
        float* out = p.add + row * p.ldo + col0;
#pragma unroll
        for (int c0 = 0; c0 < kCols; c0 += 16) {
          float2 old[8];
#pragma unroll
          for (int j = 0; j < 8; ++j) old[j] = *reinterpret_cast<const float2*>(out + get<1>(xc(r, c0 + 2 * j)));
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            old[j].x += x(r, c0 + 2 * j), old[j].y += x(r, c0 + 2 * j + 1);
            *reinterpret_cast<float2*>(out + get<1>(xc(r, c0 + 2 * j))) = old[j];
          }
        }
        continue;
      }
#pragma unroll
      for (int c = 0; c < kCols; c += 2) {  // columns c and c + 1 are neighbours
        const int col = col0 + get<1>(xc(r, c));
        if (col >= p.N) continue;
        const bool both = col + 1 < p.N;
        if (p.add) {
          float* out = p.add + row * p.ldo + col;
          out[0] += x(r, c);
          if (both) out[1] += x(r, c + 1);
        } else {
          store_pair(p.store + row * p.ldo + col, x(r, c), x(r, c + 1), both, p.pairs);
        }
      }
    }
  }
#endif
}

// a: g (n, k) with a row stride that is a multiple of 8 (TMA); b: w (k, D) for dE or h (n, D) for dW, TMA-ready;
// out: (M, D) fp32 (accumulated) or in the operand dtype (overwritten).
template <class Element, bool kDW>
void sparse_gemm(const at::Tensor& g, const at::Tensor& b, int64_t D, const at::Tensor& flags, int stamp,
                 at::Tensor& out, int max_blocks) {
  using Cfg = SparseConfig<Element, kDW>;
  using Mainloop = typename Cfg::Mainloop;
  const int n = static_cast<int>(g.size(0)), k = static_cast<int>(g.size(1));
  const int64_t ld = g.stride(0);
  const int M = kDW ? k : n, K = kDW ? n : k, N = static_cast<int>(D);
  typename Mainloop::StrideA sa;
  if constexpr (kDW) {
    sa = make_stride(_1{}, ld, int64_t{0});
  } else {
    sa = make_stride(ld, _1{}, int64_t{0});
  }
  const typename Mainloop::StrideB sb = make_stride(_1{}, b.stride(0), int64_t{0});
  typename Mainloop::Arguments args{reinterpret_cast<const Element*>(g.data_ptr()), sa,
                                    reinterpret_cast<const Element*>(b.data_ptr()), sb};
  const bool add = out.scalar_type() == at::kFloat;
  const int64_t ldo = out.stride(0);
  const bool pairs = ldo % 2 == 0 && reinterpret_cast<uintptr_t>(out.data_ptr()) % (add ? 8 : 4) == 0;
  const int m_tiles = (M + Cfg::kBlockM - 1) / Cfg::kBlockM, tiles = m_tiles * ((N + Cfg::kBlockN - 1) / Cfg::kBlockN);
  const KeptBlocks kb{flags.data_ptr<int>(),
                      static_cast<int>(flags.size(1)),
                      static_cast<int>((n + 63) / 64),
                      stamp,
                      (K + Cfg::kBlockK - 1) / Cfg::kBlockK,
                      kDW};
  SparseParams<Element, kDW> p{Mainloop::to_underlying_arguments(make_shape(M, N, K, 1), args, nullptr),
                               M,
                               N,
                               K,
                               m_tiles,
                               tiles,
                               kb,
                               add ? out.data_ptr<float>() : nullptr,
                               add ? nullptr : reinterpret_cast<Element*>(out.data_ptr()),
                               ldo,
                               pairs};
  const int smem = sizeof(typename Cfg::SharedStorage);
  auto kernel = cce_sparse_gemm_kernel<Element, kDW>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const dim3 grid(std::min(tiles, max_blocks > 0 ? std::min(max_blocks, sms) : sms));
  kernel<<<grid, 384, smem, at::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class Element, bool kPingpong>
void forward(const at::Tensor& h, const at::Tensor& w, const at::Tensor& targets, double softcap, double temperature,
             bool entropy, at::Tensor& logp, at::Tensor& lse, at::Tensor& H) {
  const int n = static_cast<int>(h.size(0));
  const auto [m_tiles, n_tiles] = tiles<kPingpong>(n, w.size(0));
  const int splits = vocab_splits<kPingpong>(m_tiles, n_tiles);
  const int states = splits * Config<Element, kPingpong>::kStates;
  at::Tensor part = at::empty({3, states, n}, h.options().dtype(at::kFloat));
  launch<Element, ForwardEpilogue, kPingpong>(
      h, w, splits, {static_cast<float>(softcap), static_cast<float>(temperature), entropy, part.data_ptr<float>()});
  constexpr int kWarps = 8;
  cce_fused_finish_kernel<Element><<<(n + kWarps - 1) / kWarps, 32 * kWarps, 0, at::cuda::getCurrentCUDAStream()>>>(
      part.data_ptr<float>(), n, states, reinterpret_cast<const Element*>(h.data_ptr()),
      reinterpret_cast<const Element*>(w.data_ptr()), w.size(0), static_cast<int>(h.size(1)),
      targets.data_ptr<int64_t>(), static_cast<float>(softcap), static_cast<float>(temperature), entropy,
      logp.data_ptr<float>(), lse.data_ptr<float>(), H.numel() ? H.data_ptr<float>() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Calls f(Element{}, std::bool_constant<pingpong>{}) for the operands' dtype (bf16 or fp16) and the schedule.
template <class F>
void dispatch(const at::Tensor& hidden, bool pingpong, F&& f) {
  const bool bf16 = hidden.scalar_type() == at::kBFloat16;
  if (pingpong) {
    bf16 ? f(cutlass::bfloat16_t{}, std::true_type{}) : f(cutlass::half_t{}, std::true_type{});
  } else {
    bf16 ? f(cutlass::bfloat16_t{}, std::false_type{}) : f(cutlass::half_t{}, std::false_type{});
  }
}

}  // namespace

bool cce_fused_available(const at::Tensor& hidden) {
  if (!hidden.is_cuda()) return false;
  if (hidden.scalar_type() != at::kBFloat16 && hidden.scalar_type() != at::kHalf) return false;
  const auto* props = at::cuda::getDeviceProperties(hidden.get_device());
  return props->major == 9 && props->minor == 0;
}

void cce_fused_forward(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets, double softcap,
                       double temperature, bool entropy, at::Tensor& logp, at::Tensor& lse, at::Tensor& H,
                       bool pingpong) {
  TORCH_CHECK(cce_fused_available(hidden), "cce_fused_forward: needs bf16/fp16 operands on an sm_90 GPU");
  TORCH_CHECK(hidden.size(0) < (int64_t{1} << 31) && weight.size(0) < (int64_t{1} << 31),
              "cce_fused_forward: rows and vocabulary must fit in int32");
  TORCH_CHECK(targets.is_contiguous() && targets.scalar_type() == at::kLong, "cce_fused_forward: targets (n) int64");
  if (hidden.size(0) == 0) return;
  const at::Tensor h = tma_ready(hidden), w = tma_ready(weight);
  dispatch(hidden, pingpong, [&](auto tag, auto schedule) {
    forward<decltype(tag), decltype(schedule)::value>(h, w, targets, softcap, temperature, entropy, logp, lse, H);
  });
}

void cce_fused_backward(const at::Tensor& hidden, const at::Tensor& weight, int64_t v0, double softcap,
                        double temperature, const at::Tensor& lse, const at::Tensor& H, const at::Tensor& glp,
                        const at::Tensor& gH, const at::Tensor& targets, double eps, at::Tensor& g,
                        const at::Tensor& flags, int stamp, bool pingpong) {
  TORCH_CHECK(cce_fused_available(hidden), "cce_fused_backward: needs bf16/fp16 operands on an sm_90 GPU");
  TORCH_CHECK(g.stride(1) == 1 && g.stride(0) >= g.size(1) && g.scalar_type() == hidden.scalar_type() &&
                  g.size(0) == hidden.size(0) && g.size(1) == weight.size(0),
              "cce_fused_backward: g must be (n, k) with unit column stride in the operands' dtype");
  TORCH_CHECK(!flags.defined() ||
                  (flags.is_contiguous() && flags.scalar_type() == at::kInt &&
                   flags.size(0) >= (hidden.size(0) + 63) / 64 && flags.size(1) >= (weight.size(0) + 255) / 256),
              "cce_fused_backward: flags must be int32 (>= n / 64, >= k / 256)");
  if (hidden.size(0) == 0 || weight.size(0) == 0) return;
  const at::Tensor h = tma_ready(hidden), w = tma_ready(weight);
  dispatch(hidden, pingpong, [&](auto tag, auto schedule) {
    using Element = decltype(tag);
    constexpr bool kPingpong = decltype(schedule)::value;
    typename BackwardEpilogue<Element>::Args args{static_cast<float>(softcap),
                                                  static_cast<float>(temperature),
                                                  static_cast<float>(eps),
                                                  lse.data_ptr<float>(),
                                                  gH.defined() ? H.data_ptr<float>() : nullptr,
                                                  glp.data_ptr<float>(),
                                                  gH.defined() ? gH.data_ptr<float>() : nullptr,
                                                  targets.data_ptr<int64_t>(),
                                                  v0,
                                                  reinterpret_cast<Element*>(g.data_ptr()),
                                                  g.stride(0),
                                                  flags.defined() ? flags.data_ptr<int>() : nullptr,
                                                  flags.defined() ? static_cast<int>(flags.size(1)) : 0,
                                                  stamp};
    // Each thread block walks a run of the block's vocabulary tiles, as the forward's do, so the producer
    // loads the next tile while the consumers write this one's gradient (one tile per block leaves the
    // pipeline's fill and every epilogue exposed: 290 TFLOP/s on the H100).
    const auto [m_tiles, n_tiles] = tiles<kPingpong>(h.size(0), w.size(0));
    launch<Element, BackwardEpilogue<Element>, kPingpong>(h, w, vocab_splits<kPingpong>(m_tiles, n_tiles), args);
  });
}

void cce_sparse_grads(const at::Tensor& g, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& flags,
                      int stamp, at::Tensor& dE, at::Tensor& dW, int max_blocks) {
  TORCH_CHECK(cce_fused_available(hidden), "cce_sparse_grads: needs bf16/fp16 operands on an sm_90 GPU");
  const int64_t n = g.size(0), k = g.size(1), D = hidden.size(1);
  TORCH_CHECK(g.scalar_type() == hidden.scalar_type() && weight.scalar_type() == hidden.scalar_type(),
              "cce_sparse_grads: g, hidden and weight must share a dtype");
  TORCH_CHECK(g.stride(1) == 1 && g.stride(0) >= k && g.stride(0) % 8 == 0 &&
                  reinterpret_cast<uintptr_t>(g.data_ptr()) % 16 == 0,
              "cce_sparse_grads: g needs unit column stride, a row stride that is a multiple of 8 and a 16-byte base");
  TORCH_CHECK(hidden.size(0) == n && weight.size(0) == k && weight.size(1) == D,
              "cce_sparse_grads: g (n, k), hidden (n, D), weight (k, D)");
  TORCH_CHECK(flags.is_contiguous() && flags.scalar_type() == at::kInt && flags.size(0) >= (n + 63) / 64 &&
                  flags.size(1) >= (k + 255) / 256,
              "cce_sparse_grads: flags must be int32 (>= n / 64, >= k / 256)");
  TORCH_CHECK(dE.scalar_type() == at::kFloat && dE.size(0) == n && dE.size(1) == D && dE.stride(1) == 1,
              "cce_sparse_grads: dE must be (n, D) fp32 with unit column stride");
  TORCH_CHECK((dW.scalar_type() == at::kFloat || dW.scalar_type() == hidden.scalar_type()) && dW.size(0) == k &&
                  dW.size(1) == D && dW.stride(1) == 1,
              "cce_sparse_grads: dW must be (k, D), fp32 or the operands' dtype, with unit column stride");
  TORCH_CHECK(n <= 64 * 32 * kMaxKeptWords && k <= 64 * 32 * kMaxKeptWords, "cce_sparse_grads: at most ",
              64 * 32 * kMaxKeptWords, " rows and entries a block (loss.chunk_size, loss.vocab_chunk_size); got ", n,
              " x ", k);
  if (n == 0 || k == 0) return;
  const at::Tensor h = tma_ready(hidden), w = tma_ready(weight);
  dispatch(hidden, false, [&](auto tag, auto) {
    using Element = decltype(tag);
    sparse_gemm<Element, false>(g, w, D, flags, stamp, dE, max_blocks);
    sparse_gemm<Element, true>(g, h, D, flags, stamp, dW, max_blocks);
  });
}

#else  // no CUTLASS headers at build time: the blockwise path serves every call

bool cce_fused_available(const at::Tensor&) { return false; }

void cce_fused_forward(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, double, bool, at::Tensor&,
                       at::Tensor&, at::Tensor&, bool) {
  TORCH_CHECK(false, "cce_fused_forward: built without CUTLASS");
}

void cce_fused_backward(const at::Tensor&, const at::Tensor&, int64_t, double, double, const at::Tensor&,
                        const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double, at::Tensor&,
                        const at::Tensor&, int, bool) {
  TORCH_CHECK(false, "cce_fused_backward: built without CUTLASS");
}

void cce_sparse_grads(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int, at::Tensor&,
                      at::Tensor&, int) {
  TORCH_CHECK(false, "cce_sparse_grads: built without CUTLASS");
}

#endif

}  // namespace rlt::cuda
