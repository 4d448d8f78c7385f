// Cut Cross-Entropy with LibTorch ops (seed 002, Algorithms 2 and 3), extended with entropy, temperature
// and any per-token upstream gradient.
//
// Notation per block (rows n, vocabulary block m): z = h_n W_m^T / temp (fp32), lse_n from the forward,
// logp = z - lse, p = e^{logp}. For upstream gradients glp (of logp_y) and gH (of H):
//   dz = -p * (glp + gH (logp + H))           (softmax part, over every vocabulary entry)
//      + glp * [v = y]                        (target part)
//   dE_n += (dz / temp) W_m,   dW_m += (dz / temp)^T h_n
// With a final-logit softcap (gemma2) z is first replaced by cap tanh(z / cap), and dz is multiplied by
// 1 - tanh^2(z / cap) before the GEMMs.
// The target part is added to dz in fp32 before dz is rounded to the GEMM dtype: -glp p_y + glp nearly
// cancels when p_y ~ 1, and rounding the two halves separately would keep bf16 error of size |glp|.
// Gradient filtering: when max(p) < eps over a block, its softmax part is skipped (seed 002, sec. 4.3);
// the target part of a skipped block is then added on its own (the "indexed matmul", Algorithm 1).
// Loop order in the backward is vocabulary-outer so each dW block is accumulated in fp32 and written
// once; dE is accumulated in an fp32 (T', D) buffer. Both are the gradients the call must return (bf16
// inputs: plus that fp32 dE accumulator), which is the memory lower bound of the backward.
#include "loss/cce.h"

#include <cmath>
#include <limits>
#include <tuple>

#include "loss/autograd_state.h"
#ifdef RLT_HAVE_CUDA
#include "loss/cuda/cce_fused.h"
#endif
#include "loss/logprob.h"

namespace rlt {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// a (n, k) @ b (k, m) with an fp32 (fp64) result; bf16 operands keep bf16 GEMM speed on CUDA.
at::Tensor mm_acc(const at::Tensor& a, const at::Tensor& b) {
  const auto acc = accumulation_dtype(a.scalar_type());
  if (a.scalar_type() == acc && b.scalar_type() == acc) return at::mm(a, b);
  if (a.is_cuda()) {
    at::Tensor bb = b.scalar_type() == a.scalar_type() ? b : b.to(a.scalar_type());
    return at::mm(a, bb, acc);
  }
  return at::mm(a.to(acc), b.to(acc));
}

// acc += a (n, k) @ b (k, m) without a temporary product: in-place addmm, with fp32 accumulation of
// bf16 operands on CUDA (addmm's out_dtype); on CPU half operands are upcast first.
void accumulate_mm(at::Tensor& acc, const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() == acc.scalar_type() && b.scalar_type() == acc.scalar_type()) {
    acc.addmm_(a, b);
  } else if (a.is_cuda()) {
    at::Tensor bb = b.scalar_type() == a.scalar_type() ? b : b.to(a.scalar_type());
    at::addmm_out(acc, acc, a, bb, acc.scalar_type());
  } else {
    acc.addmm_(a.to(acc.scalar_type()), b.to(acc.scalar_type()));
  }
}

// One call's settings: the user's options, with what they leave to the call resolved.
struct State {
  LossOptions options;
  int64_t rb = 0, vb = 0;  // row and vocabulary block sizes (chunk_size, vocab_chunk_size or automatic)
  double cap = 0.0;        // the model's final-logit softcap; 0 = none
  bool kernel = false;     // the fused CUDA block epilogues
  bool fused = false;      // the fused Hopper kernels (loss/cuda/cce_fused.cu): GEMM tiles consumed in registers
  // The gradient-filtering threshold in force; 0 = no filtering.
  double eps() const { return options.grad_filter ? options.grad_filter_eps : 0.0; }
};

class CceFn : public torch::autograd::Function<CceFn> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                               const at::Tensor& targets, const State& state) {
    const int64_t N = hidden.size(0), V = weight.size(0);  // N = T' rows
    const int64_t rb = state.rb, vb = state.vb;
    const double temp = state.options.temperature, cap = state.cap;
    const bool kernel = state.kernel;
    const EntropyMode entropy = state.options.entropy;
    const auto acc = accumulation_dtype(hidden.scalar_type());
    const auto opts = hidden.options().dtype(acc);
    at::Tensor logp = at::empty({N}, opts), lse = at::empty({N}, opts);                          // (T')
    at::Tensor H = entropy != EntropyMode::kNone ? at::empty({N}, opts) : at::empty({0}, opts);  // (T')
    // Rows [r0, r0 + n) given their online softmax state m, s, t: lse, the target's log-prob, the entropy.
    auto finish_rows = [&](int64_t r0, int64_t n, const at::Tensor& m, const at::Tensor& s, const at::Tensor& t) {
      const at::Tensor h = hidden.narrow(0, r0, n);
      at::Tensor l = m + s.log();  // (n)
      lse.narrow(0, r0, n).copy_(l);
      // The target logit as an indexed dot product (Algorithm 1): no [n, V] row needed; 1024 rows at a
      // time so its fp32 (rows, D) temporaries stay small.
      for (int64_t q0 = 0; q0 < n; q0 += 1024) {
        const int64_t q = std::min<int64_t>(1024, n - q0);
        at::Tensor tgt = targets.narrow(0, r0 + q0, q);
        at::Tensor zy = (h.narrow(0, q0, q).to(acc) * weight.index_select(0, tgt).to(acc)).sum(1);  // (q)
        if (cap > 0) zy.div_(cap).tanh_().mul_(cap);
        if (temp != 1.0) zy.div_(temp);
        logp.narrow(0, r0 + q0, q).copy_(zy - l.narrow(0, q0, q));
      }
      if (entropy != EntropyMode::kNone) H.narrow(0, r0, n).copy_(s.log() - t / s);  // lse - E_p[z]
    };
    if (state.fused) {
#ifdef RLT_HAVE_CUDA
      // Every row and the whole vocabulary in one kernel (the logits tiles stay in registers), then one
      // warp per row for the target logit, lse and entropy.
      cuda::cce_fused_forward(hidden, weight, targets, cap, temp, entropy != EntropyMode::kNone, logp, lse, H,
                              state.options.cce_pingpong);
#endif
    } else {
      for (int64_t r0 = 0; r0 < N; r0 += rb) {
        const int64_t n = std::min(rb, N - r0);
        at::Tensor h = hidden.narrow(0, r0, n);  // (n, D)
        at::Tensor m, s, t;                      // (n): running max, sum e^{z-m}, sum e^{z-m} (z-m)
        if (kernel) {
#ifdef RLT_HAVE_CUDA
          m = at::full({n}, -std::numeric_limits<double>::infinity(), opts);
          s = at::zeros({n}, opts);
          t = at::zeros({n}, opts);
          for (int64_t v0 = 0; v0 < V; v0 += vb) {
            const int64_t k = std::min(vb, V - v0);
            cuda::cce_block_forward(mm_acc(h, weight.narrow(0, v0, k).t()), cap, temp, entropy != EntropyMode::kNone, m,
                                    s, t);
          }
#endif
        } else {
          for (int64_t v0 = 0; v0 < V; v0 += vb) {
            const int64_t k = std::min(vb, V - v0);
            at::Tensor z = mm_acc(h, weight.narrow(0, v0, k).t());  // (n, k) fp32
            if (cap > 0) z.div_(cap).tanh_().mul_(cap);
            if (temp != 1.0) z.div_(temp);
            at::Tensor bmax = std::get<0>(z.max(1));
            at::Tensor m_new = v0 == 0 ? bmax : at::maximum(m, bmax);
            at::Tensor d = z.sub_(m_new.unsqueeze(1));  // (n, k) z - m_new, in z's buffer
            at::Tensor e = d.exp();                     // (n, k)
            if (v0 == 0) {
              s = e.sum(1);
              if (entropy != EntropyMode::kNone) t = e.mul_(d).sum(1);
            } else {
              // Rebase the running sums to the new max: r = e^{m - m_new},
              // sum e^{z-m_new}(z-m_new) = r (t - s (m_new - m)): non-positive terms, no cancellation.
              at::Tensor r = (m - m_new).exp_();
              if (entropy != EntropyMode::kNone) t = r * (t - s * (m_new - m));
              s = s * r + e.sum(1);
              if (entropy != EntropyMode::kNone) t.add_(e.mul_(d).sum(1));
            }
            m = m_new;
          }
        }
        finish_rows(r0, n, m, s, t);
      }
    }
    ctx->save_for_backward({hidden, weight, targets, lse, H});
    save_state(ctx, state);
    if (entropy != EntropyMode::kGrad) ctx->mark_non_differentiable({H});
    return {logp, H};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor hidden = saved[0], weight = saved[1], targets = saved[2], lse = saved[3], H = saved[4];
    const State& state = saved_state<State>(ctx);
    const double temp = state.options.temperature, eps = state.eps(), cap = state.cap;
    const int64_t rb = state.rb, vb = state.vb;
    const EntropyMode entropy = state.options.entropy;
    const bool kernel = state.kernel;
    variable_list out(4);
    at::Tensor glp = grads[0];
    at::Tensor gH = entropy == EntropyMode::kGrad ? grads[1] : at::Tensor();
    if (!glp.defined() && !gH.defined()) return out;
    if (!glp.defined()) glp = at::zeros_like(lse);
    glp = glp.to(lse.scalar_type()).contiguous();
    if (gH.defined()) gH = gH.to(lse.scalar_type()).contiguous();
    const int64_t N = hidden.size(0), V = weight.size(0), D = hidden.size(1);  // N = T' rows
    const auto acc = accumulation_dtype(hidden.scalar_type());
    const bool same = hidden.scalar_type() == acc;
    const double log_eps = eps > 0 ? std::log(eps) : -std::numeric_limits<double>::infinity();

    at::Tensor dE = at::zeros({N, D}, hidden.options().dtype(acc));  // (T', D) fp32 accumulator
    at::Tensor dW = same ? at::zeros({V, D}, weight.options()) : at::empty({V, D}, weight.options());
    at::Tensor glp_t = glp / temp;  // (T') target-term coefficient
    // Filtering on the fused path is per tile and decided on the device: the dz kernel flags each 64 rows x 256
    // entries it must keep and cuda::cce_sparse_grads multiplies only those (no host read). The other CUDA path
    // decides per block, with one host read of any_above a block.
    const bool tile_filter = state.fused && eps > 0;
    at::Tensor any_above = kernel && !tile_filter ? at::zeros({1}, hidden.options().dtype(at::kInt)) : at::Tensor();
    at::Tensor flags =
        tile_filter ? at::zeros({(rb + 63) / 64, (vb + 255) / 256}, hidden.options().dtype(at::kInt)) : at::Tensor();
    int stamp = 0;  // a (row block, vocabulary block) pass's flag value
    // The target part of a filtered block on its own (Algorithm 1's indexed matmul): rows whose target
    // lies in the block get coef * W[y] in dE and coef * h in dW[y] (coef = 0 elsewhere). Under a
    // softcap the chain factor 1 - tanh^2(z_y / cap) of the target logit applies.
    auto add_target_term = [&](int64_t r0, int64_t n, const at::Tensor& h, const at::Tensor& w, const at::Tensor& col,
                               at::Tensor coef, at::Tensor& dW_blk) {
      at::Tensor wy = w.index_select(0, col.squeeze(1)).to(acc);  // (n, D)
      if (cap > 0) {
        at::Tensor ty = (h.to(acc) * wy).sum(1, /*keepdim=*/true).div_(cap).tanh_();  // (n, 1)
        coef = coef * (1 - ty * ty);
      }
      dE.narrow(0, r0, n).add_(wy.mul_(coef));
      dW_blk.index_add_(0, col.squeeze(1), h.to(acc).mul(coef));
    };
    for (int64_t v0 = 0; v0 < V; v0 += vb) {
      const int64_t k = std::min(vb, V - v0);
      at::Tensor w = weight.narrow(0, v0, k);  // (k, D)
      // One row block on the fused path: dW's block is one GEMM over every row, written straight into dW
      // (cuBLAS accumulates in fp32), with no fp32 accumulator for it.
      const bool direct = state.fused && !same && rb >= N;
      at::Tensor dW_blk = same     ? dW.narrow(0, v0, k)
                          : direct ? at::Tensor()
                                   : at::zeros({k, D}, hidden.options().dtype(acc));
      for (int64_t r0 = 0; r0 < N; r0 += rb) {
        const int64_t n = std::min(rb, N - r0);
        at::Tensor h = hidden.narrow(0, r0, n);  // (n, D)
        // Targets of these rows that fall in this vocabulary block: column (clamped) and coefficient
        // (glp / temp, or 0 for rows whose target is elsewhere). No host sync needed. The CUDA paths need
        // them only for a filtered block (six small kernels a block otherwise: ~1 ms at seed 002).
        auto target_cols = [&] {
          at::Tensor t = targets.narrow(0, r0, n) - v0;                       // (n)
          at::Tensor in_blk = (t >= 0) & (t < k);                             // (n)
          at::Tensor col = t.clamp(0, k - 1).unsqueeze(1);                    // (n, 1)
          at::Tensor coef = glp_t.narrow(0, r0, n).mul(in_blk).unsqueeze(1);  // (n, 1)
          return std::make_pair(col, coef);
        };
        if (kernel) {
#ifdef RLT_HAVE_CUDA
          at::Tensor g_op;    // (n, k): dz in the GEMM operand dtype
          if (state.fused) {  // recomputed in the GEMM's registers, written once in bf16
            // Rows padded to a multiple of 8 entries for the tile-filtered GEMMs (TMA loads g); unpadded for cuBLAS,
            // whose kernel choice (and last-bit rounding of a bf16 dW) the padding would change.
            g_op = at::empty({n, tile_filter ? (k + 7) / 8 * 8 : k}, hidden.options()).narrow(1, 0, k);
            cuda::cce_fused_backward(h, w, v0, cap, temp, lse.narrow(0, r0, n), H.numel() ? H.narrow(0, r0, n) : H,
                                     glp.narrow(0, r0, n), gH.defined() ? gH.narrow(0, r0, n) : gH,
                                     targets.narrow(0, r0, n), eps, g_op, flags, ++stamp, state.options.cce_pingpong);
            if (tile_filter) {
              at::Tensor dE_rows = dE.narrow(0, r0, n);
              at::Tensor dW_out = direct ? dW.narrow(0, v0, k) : dW_blk;
              cuda::cce_sparse_grads(g_op, h, w, flags, stamp, dE_rows, dW_out);
              continue;
            }
          } else {  // fused epilogue over an fp32 logits block (over z itself for fp32)
            any_above.zero_();
            at::Tensor z = mm_acc(h, w.t());  // (n, k) fp32
            g_op = same ? z : at::empty({n, k}, hidden.options());
            cuda::cce_block_backward(z, v0, cap, temp, lse.narrow(0, r0, n), H.numel() ? H.narrow(0, r0, n) : H,
                                     glp.narrow(0, r0, n), gH.defined() ? gH.narrow(0, r0, n) : gH,
                                     targets.narrow(0, r0, n), eps, g_op, any_above);
          }
          if (eps > 0 && any_above.item<int>() == 0) {
            if (direct) dW_blk = at::zeros({k, D}, hidden.options().dtype(acc));
            const auto [col, coef] = target_cols();
            add_target_term(r0, n, h, w, col, coef, dW_blk);
            continue;
          }
          at::Tensor dE_rows = dE.narrow(0, r0, n);
          accumulate_mm(dE_rows, g_op, w);
          if (direct) {
            at::Tensor out = dW.narrow(0, v0, k);
            at::mm_out(out, g_op.t(), h);
          } else {
            accumulate_mm(dW_blk, g_op.t(), h);
          }
#endif
          continue;
        }
        const auto [col, coef] = target_cols();
        at::Tensor logp_blk = mm_acc(h, w.t());  // (n, k): z
        at::Tensor dcap;                         // (n, k) softcap chain factor 1 - tanh^2(z / cap)
        if (cap > 0) {
          logp_blk.div_(cap).tanh_();
          dcap = 1 - logp_blk * logp_blk;
          logp_blk.mul_(cap);
        }
        if (temp != 1.0) logp_blk.div_(temp);
        logp_blk.sub_(lse.narrow(0, r0, n).unsqueeze(1));  // log p
        // Filtering: one host read per block decides whether its softmax part matters at all.
        if (eps > 0 && logp_blk.max().item<double>() < log_eps) {
          add_target_term(r0, n, h, w, col, coef, dW_blk);
          continue;
        }
        at::Tensor p = logp_blk.exp();  // (n, k)
        at::Tensor g;                   // (n, k): d loss / d z
        at::Tensor glp_c = glp.narrow(0, r0, n).unsqueeze(1);
        if (gH.defined()) {
          g = logp_blk.add_(H.narrow(0, r0, n).unsqueeze(1))
                  .mul_(gH.narrow(0, r0, n).unsqueeze(1))
                  .add_(glp_c)
                  .mul_(p)
                  .neg_();
        } else {
          g = p.mul_(glp_c).neg_();
        }
        if (temp != 1.0) g.div_(temp);
        g.scatter_add_(1, col, coef);                             // + glp/temp at the target column, in fp32
        if (cap > 0) g.mul_(dcap);                                // through the softcap: d/d z_raw
        p = at::Tensor();                                         // release before the two GEMMs
        at::Tensor g_op = same ? g : g.to(hidden.scalar_type());  // GEMM operand in the input dtype
        g = at::Tensor();
        at::Tensor dE_rows = dE.narrow(0, r0, n);
        accumulate_mm(dE_rows, g_op, w);     // (n, D) += (n, k) @ (k, D)
        accumulate_mm(dW_blk, g_op.t(), h);  // (k, D) += (k, n) @ (n, D)
      }
      if (!same && dW_blk.defined()) dW.narrow(0, v0, k).copy_(dW_blk);
    }
    out[0] = same ? dE : dE.to(hidden.scalar_type());
    out[1] = dW;
    return out;
  }
};

}  // namespace

std::pair<int64_t, int64_t> cce_blocks(int64_t N, int64_t V, int64_t D, int64_t row_block, int64_t vocab_block,
                                       bool fused) {
  // ~8M elements: a [rows, vocab] logits block and the fp32 (vocab, D) dW accumulator of a bf16 run
  // each stay within 32 MiB.
  constexpr int64_t kBlockElems = int64_t{1} << 23;
  // Blockwise: 4096 rows x 2048 entries at seed 002's shape: on the H200 this is faster than 8192 x 1024
  // (fewer passes over the fp32 dE accumulator) and, unlike 2048 x 4096, within the 1.1x memory target.
  // Fused: the kernels hold no fp32 logits block, only the bf16 logits gradient (rows x vocab) between the
  // dz kernel and the dE/dW GEMMs. Up to 8192 rows x 4096 entries (64 MiB): at seed 002's shape every row
  // in one block (dW's block written by one GEMM, no fp32 accumulator) and 63 passes over dE are 20 ms
  // faster than 4096 x 2048 on the H200. Wider blocks: docs/benchmarks.md, design notes.
  int64_t rb = row_block > 0 ? row_block : std::min<int64_t>(std::max<int64_t>(N, 1), fused ? 8192 : 4096);
  rb = std::max<int64_t>(1, std::min(rb, std::max<int64_t>(N, 1)));
  const int64_t vb_auto =
      fused ? 4096
            : std::max<int64_t>(128, std::min(kBlockElems / rb, kBlockElems / std::max<int64_t>(D, 1)) / 128 * 128);
  int64_t vb = vocab_block > 0 ? vocab_block : vb_auto;
  vb = std::max<int64_t>(1, std::min(vb, std::max<int64_t>(V, 1)));
  if (fused) {  // the tile-filtered GEMMs take blocks of up to 131072 rows and entries (2048 k-blocks a tile)
    rb = std::min<int64_t>(rb, 131072);
    vb = std::min<int64_t>(vb, 131072);
  }
  return {rb, vb};
}

std::pair<at::Tensor, at::Tensor> cce_logprobs(const at::Tensor& hidden, const at::Tensor& lm_head,
                                               const at::Tensor& targets, const LossOptions& options, double softcap,
                                               bool use_cuda_kernel) {
  TORCH_CHECK(hidden.dim() == 2 && lm_head.dim() == 2 && hidden.size(1) == lm_head.size(1),
              "cce: hidden (N, D) and lm_head (V, D) must agree on D: ", hidden.sizes(), " vs ", lm_head.sizes());
  TORCH_CHECK(hidden.scalar_type() == lm_head.scalar_type(), "cce: hidden and lm_head dtypes differ");
  TORCH_CHECK(at::isFloatingType(hidden.scalar_type()), "cce: inputs must be floating point");
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == hidden.size(0) && targets.scalar_type() == at::kLong,
              "cce: targets must be (N) int64");
  TORCH_CHECK(options.temperature > 0, "cce: temperature must be > 0");
  TORCH_CHECK(softcap >= 0, "cce: softcap must be >= 0");
  at::Tensor h = hidden.contiguous(), w = lm_head.contiguous();
  State state;
  state.options = options;
  state.cap = softcap;
#ifdef RLT_HAVE_CUDA
  state.kernel = use_cuda_kernel && h.is_cuda() && h.scalar_type() != at::kDouble;
  state.fused = state.kernel && options.cce_fused && cuda::cce_fused_available(h);
#else
  (void)use_cuda_kernel;
#endif
  std::tie(state.rb, state.vb) =
      cce_blocks(h.size(0), w.size(0), h.size(1), options.chunk_size, options.vocab_chunk_size, state.fused);
  auto outs = CceFn::apply(h, w, targets, state);
  return {outs[0], options.entropy == EntropyMode::kNone ? at::Tensor() : outs[1]};
}

}  // namespace rlt
