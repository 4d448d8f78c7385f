// Selective log-softmax as a custom autograd function (seed 000, extended).
//
// Forward, per kept row r with x = logits[row_r] / temp (fp32 accumulation):
//   lse_r = log sum_v e^{x_v},  logp_r = x_{y_r} - lse_r,  H_r = sum_v p_v (lse_r - x_v)   (p = e^{x - lse})
// Backward, for upstream gradients glp (of logp) and gH (of H):
//   d logp_r / d x_v = [v = y_r] - p_v
//   d H_r    / d x_v = -p_v (log p_v + H_r)            (derivation: H = lse - sum p x, dp_u/dx_v = p_u([u=v]-p_v))
//   d / d logits     = (1 / temp) d / d x
// so only lse (and H when its gradient flows) is saved: T' floats instead of a [T', V] log-softmax.
#include "loss/selective.h"

#include <algorithm>

#include "loss/autograd_state.h"
#include "loss/logprob.h"

namespace rlt {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Rows [s, s + n) of the kept set as an (n, V) tensor in the accumulation dtype, divided by temp.
// For fp32 logits with temp 1 over all rows this is a view of `logits` (never written through).
at::Tensor chunk_rows(const at::Tensor& logits, const at::Tensor& rows, int64_t s, int64_t n, double temp) {
  at::Tensor x = rows.defined() ? logits.index_select(0, rows.narrow(0, s, n)) : logits.narrow(0, s, n);
  x = x.to(accumulation_dtype(logits.scalar_type()));
  return temp == 1.0 ? x : x / temp;
}

// The ATen chunks' rows when chunk_size is 0: one chunk's [rows, V] fp32 working set (log-sum-exp and
// entropy temporaries) stays near 1M elements (4 MiB). A fixed 1024 rows is a whole batch's logits at
// seed 000's shapes on the CPU (bench_loss --case seed000: +100%).
constexpr int64_t kChunkElems = int64_t{1} << 20;

struct State {
  LossOptions options;
  int64_t chunk = 0;    // rows per ATen chunk, resolved
  bool kernel = false;  // the fused CUDA kernel
};

class SelectiveFn : public torch::autograd::Function<SelectiveFn> {
 public:
  // logits (T, V); rows (T') or an empty tensor for all rows; targets (T').
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& rows_or_empty,
                               const at::Tensor& targets, const State& state) {
    const at::Tensor rows = rows_or_empty.numel() > 0 ? rows_or_empty : at::Tensor();
    const int64_t N = targets.size(0);
    const EntropyMode entropy = state.options.entropy;
    const double temperature = state.options.temperature;
    const auto opts = logits.options().dtype(accumulation_dtype(logits.scalar_type()));
    at::Tensor logp = at::empty({N}, opts);                                                      // (T')
    at::Tensor lse = at::empty({N}, opts);                                                       // (T')
    at::Tensor H = entropy != EntropyMode::kNone ? at::empty({N}, opts) : at::empty({0}, opts);  // (T')
    if (state.kernel) {
#ifdef RLT_HAVE_CUDA
      cuda::selective_forward(logits, rows, targets, temperature, logp, lse,
                              entropy != EntropyMode::kNone ? &H : nullptr);
#endif
    } else {
      for (int64_t s = 0; s < N; s += state.chunk) {
        const int64_t n = std::min(state.chunk, N - s);
        at::Tensor x = chunk_rows(logits, rows, s, n, temperature);  // (n, V)
        at::Tensor l = at::logsumexp(x, {1});                        // (n)
        lse.narrow(0, s, n).copy_(l);
        logp.narrow(0, s, n).copy_(x.gather(1, targets.narrow(0, s, n).unsqueeze(1)).squeeze(1) - l);
        if (entropy != EntropyMode::kNone) {
          // H = sum_v p_v (lse - x_v): non-negative terms. (lse - sum p x cancels: both ~ max logit.)
          at::Tensor d = x - l.unsqueeze(1);  // (n, V) log p
          H.narrow(0, s, n).copy_(d.exp().mul_(d).sum(1).neg_());
        }
      }
    }
    ctx->save_for_backward({logits, rows_or_empty, targets, lse, H});
    save_state(ctx, state);
    if (entropy != EntropyMode::kGrad) ctx->mark_non_differentiable({H});
    return {logp, H};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    at::Tensor logits = saved[0], rows = saved[1].numel() > 0 ? saved[1] : at::Tensor();
    at::Tensor targets = saved[2], lse = saved[3], H = saved[4];
    const State& state = saved_state<State>(ctx);
    const double temp = state.options.temperature;
    const EntropyMode entropy = state.options.entropy;
    const int64_t N = targets.size(0);
    at::Tensor glp = grads[0];                                                // (T') or undefined
    at::Tensor gH = entropy == EntropyMode::kGrad ? grads[1] : at::Tensor();  // (T') or undefined
    variable_list out(4);
    if (!glp.defined() && !gH.defined()) return out;
    if (!glp.defined()) glp = at::zeros_like(lse);

    // The gradient buffer: the logits themselves (seed 003), or a fresh one. Rows outside the kept
    // set get 0: they have no path to the loss.
    at::Tensor grad;
    if (state.options.inplace_backward) {
      grad = logits.detach();
      if (rows.defined()) {
        at::Tensor dropped = at::ones({logits.size(0)}, logits.options().dtype(at::kBool));
        dropped.index_fill_(0, rows, false);
        grad.masked_fill_(dropped.unsqueeze(1), 0);
      }
    } else {
      grad = rows.defined() ? at::zeros_like(logits) : at::empty_like(logits);
    }
    if (state.kernel) {
#ifdef RLT_HAVE_CUDA
      cuda::selective_backward(logits, rows, targets, lse, H, glp, gH.defined() ? gH : at::Tensor(), temp, grad);
#endif
      out[0] = grad;
      return out;
    }
    for (int64_t s = 0; s < N; s += state.chunk) {
      const int64_t n = std::min(state.chunk, N - s);
      at::Tensor x = chunk_rows(logits, rows, s, n, temp);         // (n, V)
      at::Tensor logp_all = x - lse.narrow(0, s, n).unsqueeze(1);  // (n, V) fresh buffer
      at::Tensor p = logp_all.exp();                               // (n, V)
      at::Tensor glp_c = glp.narrow(0, s, n).unsqueeze(1);         // (n, 1)
      at::Tensor g;                                                // (n, V)
      if (gH.defined()) {
        // -gH (log p + H) - glp, times p: the entropy and log-prob terms in logp_all's buffer.
        g = logp_all.add_(H.narrow(0, s, n).unsqueeze(1)).mul_(-gH.narrow(0, s, n).unsqueeze(1)).sub_(glp_c).mul_(p);
      } else {
        g = p.mul_(-glp_c);
      }
      g.scatter_add_(1, targets.narrow(0, s, n).unsqueeze(1), glp_c);  // + glp at the target column
      if (temp != 1.0) g.div_(temp);
      if (rows.defined()) {
        grad.index_copy_(0, rows.narrow(0, s, n), g.to(grad.scalar_type()));
      } else {
        grad.narrow(0, s, n).copy_(g);
      }
    }
    out[0] = grad;
    return out;
  }
};

}  // namespace

std::pair<at::Tensor, at::Tensor> selective_logprobs(const at::Tensor& logits, const at::Tensor& rows,
                                                     const at::Tensor& targets, const LossOptions& options,
                                                     bool use_cuda_kernel) {
  TORCH_CHECK(logits.dim() == 2, "logits must be (T, V), got ", logits.sizes());
  TORCH_CHECK(at::isFloatingType(logits.scalar_type()), "logits must be floating point");
  TORCH_CHECK(targets.dim() == 1 && targets.scalar_type() == at::kLong, "targets must be (T') int64");
  TORCH_CHECK(rows.defined() ? rows.size(0) == targets.size(0) : logits.size(0) == targets.size(0),
              "targets must have one entry per kept row");
  TORCH_CHECK(options.temperature > 0, "temperature must be > 0");
  at::Tensor x = logits.is_contiguous() ? logits : logits.contiguous();
  at::Tensor r = rows.defined() ? rows : at::empty({0}, targets.options());
  State state;
  state.options = options;
  state.chunk =
      options.chunk_size > 0 ? options.chunk_size : std::max<int64_t>(1, kChunkElems / std::max<int64_t>(x.size(1), 1));
#ifdef RLT_HAVE_CUDA
  state.kernel = use_cuda_kernel && x.is_cuda() && x.scalar_type() != at::kDouble;
#else
  (void)use_cuda_kernel;
#endif
  auto outs = SelectiveFn::apply(x, r, targets, state);
  return {outs[0], options.entropy == EntropyMode::kNone ? at::Tensor() : outs[1]};
}

}  // namespace rlt
