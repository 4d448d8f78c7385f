// The entry point: build the keep-index, run the chosen path on the kept rows only, scatter back.
// Scattering uses index_copy into zeros, whose backward is an index_select of the upstream gradient,
// so rows outside the keep-index get exactly zero gradient (seed 001: they have no path to the loss).
#include "loss/logprob.h"

#include <algorithm>
#include <vector>

#include <torch/csrc/autograd/custom_function.h>

#include "loss/cce.h"
#include "loss/selective.h"

namespace rlt {

namespace {

// The selective path's ATen chunks, when chunk_size is 0: rows such that one chunk's [rows, V] fp32
// working set (log-sum-exp and entropy temporaries) stays near 1M elements (4 MiB). A fixed 1024 rows
// was a whole batch's logits at seed 000's shapes on the CPU (bench_loss --case seed000: +100%).
constexpr int64_t kSelectiveChunkElems = int64_t{1} << 20;
// The hidden-state path's LM-head matmul, when chunk_size is 0: as many rows per GEMM as cce uses
// (cce_blocks), so a GPU keeps large GEMMs; naive keeps its documented "all rows at once".
constexpr int64_t kHiddenAutoRows = 4096;

SelectiveArgs selective_args(const LossOptions& opt, int64_t V) {
  SelectiveArgs a;
  a.temperature = opt.temperature;
  a.chunk_size =
      opt.chunk_size > 0 ? opt.chunk_size : std::max<int64_t>(1, kSelectiveChunkElems / std::max<int64_t>(V, 1));
  a.entropy = opt.entropy;
  a.inplace_backward = opt.inplace_backward;
  return a;
}

// (T') -> (T): values at `keep`, zeros elsewhere. Differentiable.
at::Tensor scatter_rows(const at::Tensor& values, const at::Tensor& keep, int64_t T) {
  if (!values.defined() || !keep.defined()) return values;
  return at::zeros({T}, values.options()).index_copy(0, keep, values);
}

// naive_logprobs over chunks of `chunk` rows (0 = one chunk), concatenated (seeds 003/004). Under
// autograd each chunk's log-softmax is still saved; chunking bounds the no-grad working set.
std::pair<at::Tensor, at::Tensor> naive_chunked(const at::Tensor& logits, const at::Tensor& targets,
                                                const LossOptions& opt) {
  const bool with_entropy = opt.entropy != EntropyMode::kNone;
  const int64_t N = logits.size(0);
  const int64_t chunk = opt.chunk_size > 0 ? opt.chunk_size : std::max<int64_t>(N, 1);
  std::vector<at::Tensor> lps, ents;
  for (int64_t s = 0; s < N; s += chunk) {
    const int64_t n = std::min(chunk, N - s);
    auto r = naive_logprobs(logits.narrow(0, s, n), targets.narrow(0, s, n), opt.temperature, with_entropy);
    lps.push_back(r.first);
    if (with_entropy) ents.push_back(opt.entropy == EntropyMode::kValue ? r.second.detach() : r.second);
  }
  if (N == 0) return naive_logprobs(logits, targets, opt.temperature, with_entropy);
  return {at::cat(lps), with_entropy ? at::cat(ents) : at::Tensor()};
}

// logits = hidden @ W^T with bf16/fp16 operands and an fp32 result (mm's out_dtype form, which has no
// autograd formula). Backward: dH = dZ W, dW = dZ^T H with dZ rounded to the operand dtype, as any
// bf16 GEMM backward does (cuBLAS accumulates in fp32).
class Fp32LogitsFn : public torch::autograd::Function<Fp32LogitsFn> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden,
                                                const at::Tensor& weight) {
    ctx->save_for_backward({hidden, weight});
    return {at::mm(hidden, weight.t(), at::kFloat)};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& h = saved[0];
    const at::Tensor& w = saved[1];
    at::Tensor dz = grads[0].to(h.scalar_type());  // (N, V)
    return {at::mm(dz, w), at::mm(dz.t(), h)};
  }
};

}  // namespace

std::pair<at::Tensor, at::Tensor> naive_logprobs(const at::Tensor& logits, const at::Tensor& targets,
                                                 double temperature, bool with_entropy) {
  TORCH_CHECK(logits.dim() == 2, "logits must be (N, V), got ", logits.sizes());
  at::Tensor x = logits.to(accumulation_dtype(logits.scalar_type()));  // (N, V)
  if (temperature != 1.0) x = x / temperature;
  at::Tensor logp_all = at::log_softmax(x, 1);                            // (N, V)
  at::Tensor logp = logp_all.gather(1, targets.unsqueeze(1)).squeeze(1);  // (N)
  at::Tensor entropy;
  if (with_entropy) entropy = -(logp_all.exp() * logp_all).sum(1);  // (N)
  return {logp, entropy};
}

at::Tensor fp32_logits(const at::Tensor& hidden, const at::Tensor& lm_head) {
  TORCH_CHECK(hidden.dim() == 2 && lm_head.dim() == 2 && hidden.size(1) == lm_head.size(1),
              "hidden (N, D) and lm_head (V, D) must agree on D: ", hidden.sizes(), " vs ", lm_head.sizes());
  TORCH_CHECK(hidden.scalar_type() == lm_head.scalar_type(), "hidden and lm_head dtypes differ");
  const auto acc = accumulation_dtype(hidden.scalar_type());
  if (hidden.scalar_type() == acc) return at::mm(hidden, lm_head.t());
  if (hidden.is_cuda()) return Fp32LogitsFn::apply(hidden, lm_head)[0];  // fp32-output GEMM, bf16 operands
  return at::mm(hidden.to(acc), lm_head.to(acc).t());
}

LogprobOutput token_logprobs(const LogprobInputs& in, const LossOptions& opt) {
  const bool from_hidden = in.hidden.defined();
  TORCH_CHECK(from_hidden != in.logits.defined(), "give either logits or hidden + lm_head, not both");
  TORCH_CHECK(!from_hidden || in.lm_head.defined(), "hidden states need the lm_head weight");
  TORCH_CHECK(opt.impl != LogprobImpl::kCce || from_hidden, "impl cce needs hidden states and lm_head");
  TORCH_CHECK(in.logit_softcap >= 0, "logit_softcap must be >= 0");
  TORCH_CHECK(from_hidden || in.logit_softcap == 0,
              "logit_softcap applies to hidden-state inputs; logits given directly must already be capped");
  const at::Tensor& source = from_hidden ? in.hidden : in.logits;  // (T, D) or (T, V)
  TORCH_CHECK(source.dim() == 2, "expected a 2-D (T, *) input, got ", source.sizes());
  TORCH_CHECK(at::isFloatingType(source.scalar_type()), "inputs must be floating point");
  const int64_t T = source.size(0);
  TORCH_CHECK(in.targets.dim() == 1 && in.targets.size(0) == T, "targets must be (T) with T = ", T);
  TORCH_CHECK(in.targets.scalar_type() == at::kLong, "targets must be int64");
  TORCH_CHECK(in.targets.device() == source.device(), "targets and inputs on different devices");

  LogprobOutput out;
  out.keep_index = build_keep_index(T, in.rows, opt.response_only, opt.loss_mask_only);  // (T') or all
  const at::Tensor& keep = out.keep_index;
  at::Tensor targets = keep.defined() ? in.targets.index_select(0, keep) : in.targets;  // (T')

  std::pair<at::Tensor, at::Tensor> lp;  // (T') log-probs, entropy
  if (from_hidden) {
    at::Tensor hidden = keep.defined() ? in.hidden.index_select(0, keep) : in.hidden;  // (T', D)
    if (opt.impl == LogprobImpl::kCce) {
      CceArgs a;
      a.temperature = opt.temperature;
      a.row_block = opt.chunk_size;
      a.vocab_block = opt.vocab_chunk_size;
      a.entropy = opt.entropy;
      a.grad_filter_eps = opt.grad_filter ? opt.grad_filter_eps : 0.0;
      a.softcap = in.logit_softcap;
      lp = cce_logprobs(hidden, in.lm_head, targets, a);
    } else {
      // fp32 logits of chunk_size kept rows at a time: the LM-head matmul's [rows, V] working set is
      // bounded for every impl (under autograd each chunk's logits, or its log-softmax for naive, are
      // still saved for the backward: that is what these paths trade against cce's recomputation).
      const int64_t N = hidden.size(0), V = in.lm_head.size(0);
      const int64_t rows = opt.chunk_size > 0                ? opt.chunk_size
                           : opt.impl == LogprobImpl::kNaive ? std::max<int64_t>(N, 1)
                                                             : kHiddenAutoRows;
      // bf16/fp16 weights over several chunks: upcast the LM head once, so autograd sums the chunks' dW
      // in fp32 and rounds it once (per-chunk bf16 dW summed in bf16 loses 2^-9 per chunk).
      const auto acc = accumulation_dtype(hidden.scalar_type());
      const bool upcast = hidden.scalar_type() != acc && N > rows;
      const at::Tensor w = upcast ? in.lm_head.to(acc) : in.lm_head;  // (V, D)
      std::vector<at::Tensor> lps, ents;
      for (int64_t s = 0; s < std::max<int64_t>(N, 1); s += rows) {
        const int64_t n = std::min(rows, N - s);
        const at::Tensor h = hidden.narrow(0, s, n);                                         // (n, D)
        at::Tensor logits = upcast ? at::mm(h.to(acc), w.t()) : fp32_logits(h, in.lm_head);  // (n, V) fp32
        if (in.logit_softcap > 0) logits = at::tanh(logits / in.logit_softcap) * in.logit_softcap;
        const at::Tensor tgt = targets.narrow(0, s, n);
        // selective: the logits are this module's own, so inplace_backward may give their buffer to the
        // gradient; it is honoured as configured (the option's doc says when it saves memory).
        auto r = opt.impl == LogprobImpl::kNaive
                     ? naive_chunked(logits, tgt, opt)
                     : selective_logprobs(logits, at::Tensor(), tgt, selective_args(opt, V));
        lps.push_back(r.first);
        if (r.second.defined()) ents.push_back(r.second);
        if (N == 0) break;
      }
      lp = {at::cat(lps), ents.empty() ? at::Tensor() : at::cat(ents)};
    }
  } else if (opt.impl == LogprobImpl::kNaive) {
    // The reference gathers the kept rows into a [T', V] copy, as the seed's PR does.
    at::Tensor logits = keep.defined() ? in.logits.index_select(0, keep) : in.logits;
    lp = naive_chunked(logits, targets, opt);
  } else {
    // Reads the kept rows where they are: no [T', V] copy.
    lp = selective_logprobs(in.logits, keep, targets, selective_args(opt, in.logits.size(1)));
  }
  out.logprobs = scatter_rows(lp.first, keep, T);
  out.entropy = scatter_rows(lp.second, keep, T);
  return out;
}

}  // namespace rlt
