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

#include <torch/csrc/autograd/custom_function.h>

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

bool use_kernel(const at::Tensor& logits, const SelectiveArgs& a) {
#ifdef RLT_HAVE_CUDA
  return a.use_cuda_kernel && logits.is_cuda() && logits.scalar_type() != at::kDouble;
#else
  return false;
#endif
}

class SelectiveFn : public torch::autograd::Function<SelectiveFn> {
 public:
  // logits (T, V); rows (T') or an empty tensor for all rows; targets (T').
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& rows_or_empty,
                               const at::Tensor& targets, double temperature, int64_t chunk_size, int64_t entropy_mode,
                               bool inplace, bool kernel) {
    const at::Tensor rows = rows_or_empty.numel() > 0 ? rows_or_empty : at::Tensor();
    const int64_t N = targets.size(0);
    const auto entropy = static_cast<EntropyMode>(entropy_mode);
    const auto opts = logits.options().dtype(accumulation_dtype(logits.scalar_type()));
    at::Tensor logp = at::empty({N}, opts);                                                      // (T')
    at::Tensor lse = at::empty({N}, opts);                                                       // (T')
    at::Tensor H = entropy != EntropyMode::kNone ? at::empty({N}, opts) : at::empty({0}, opts);  // (T')
    if (kernel) {
#ifdef RLT_HAVE_CUDA
      cuda::selective_forward(logits, rows, targets, temperature, logp, lse,
                              entropy != EntropyMode::kNone ? &H : nullptr);
#endif
    } else {
      const int64_t chunk = chunk_size > 0 ? chunk_size : std::max<int64_t>(N, 1);
      for (int64_t s = 0; s < N; s += chunk) {
        const int64_t n = std::min(chunk, N - s);
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
    ctx->saved_data["temperature"] = temperature;
    ctx->saved_data["chunk"] = chunk_size;
    ctx->saved_data["entropy"] = entropy_mode;
    ctx->saved_data["inplace"] = inplace;
    ctx->saved_data["kernel"] = kernel;
    if (entropy != EntropyMode::kGrad) ctx->mark_non_differentiable({H});
    return {logp, H};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    at::Tensor logits = saved[0], rows = saved[1].numel() > 0 ? saved[1] : at::Tensor();
    at::Tensor targets = saved[2], lse = saved[3], H = saved[4];
    const double temp = ctx->saved_data["temperature"].toDouble();
    const int64_t chunk_size = ctx->saved_data["chunk"].toInt();
    const auto entropy = static_cast<EntropyMode>(ctx->saved_data["entropy"].toInt());
    const bool inplace = ctx->saved_data["inplace"].toBool();
    const bool kernel = ctx->saved_data["kernel"].toBool();
    const int64_t N = targets.size(0);
    at::Tensor glp = grads[0];                                                // (T') or undefined
    at::Tensor gH = entropy == EntropyMode::kGrad ? grads[1] : at::Tensor();  // (T') or undefined
    variable_list out(8);
    if (!glp.defined() && !gH.defined()) return out;
    if (!glp.defined()) glp = at::zeros_like(lse);

    // The gradient buffer: the logits themselves (seed 003), or a fresh one. Rows outside the kept
    // set get 0: they have no path to the loss.
    at::Tensor grad;
    if (inplace) {
      grad = logits.detach();
      if (rows.defined()) {
        at::Tensor dropped = at::ones({logits.size(0)}, logits.options().dtype(at::kBool));
        dropped.index_fill_(0, rows, false);
        grad.masked_fill_(dropped.unsqueeze(1), 0);
      }
    } else {
      grad = rows.defined() ? at::zeros_like(logits) : at::empty_like(logits);
    }
    if (kernel) {
#ifdef RLT_HAVE_CUDA
      cuda::selective_backward(logits, rows, targets, lse, H, glp, gH.defined() ? gH : at::Tensor(), temp, grad);
#endif
      out[0] = grad;
      return out;
    }
    const int64_t chunk = chunk_size > 0 ? chunk_size : std::max<int64_t>(N, 1);
    for (int64_t s = 0; s < N; s += chunk) {
      const int64_t n = std::min(chunk, N - s);
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
                                                     const at::Tensor& targets, const SelectiveArgs& args) {
  TORCH_CHECK(logits.dim() == 2, "logits must be (T, V), got ", logits.sizes());
  TORCH_CHECK(at::isFloatingType(logits.scalar_type()), "logits must be floating point");
  TORCH_CHECK(targets.dim() == 1 && targets.scalar_type() == at::kLong, "targets must be (T') int64");
  TORCH_CHECK(rows.defined() ? rows.size(0) == targets.size(0) : logits.size(0) == targets.size(0),
              "targets must have one entry per kept row");
  TORCH_CHECK(args.temperature > 0, "temperature must be > 0");
  at::Tensor x = logits.is_contiguous() ? logits : logits.contiguous();
  at::Tensor r = rows.defined() ? rows : at::empty({0}, targets.options());
  auto outs = SelectiveFn::apply(x, r, targets, args.temperature, args.chunk_size, static_cast<int64_t>(args.entropy),
                                 args.inplace_backward, use_kernel(x, args));
  return {outs[0], args.entropy == EntropyMode::kNone ? at::Tensor() : outs[1]};
}

}  // namespace rlt
