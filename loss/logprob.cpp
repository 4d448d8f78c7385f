// The entry point: check the row index, run the chosen path on the listed rows (response_only) or on
// every row (then pick the listed ones), return them in the caller's order. Rows not listed have no
// path to the outputs, so they get exactly zero gradient (seed 001).
#include "loss/logprob.h"

#include <algorithm>
#include <vector>

#include <torch/csrc/autograd/custom_function.h>

#include "loss/cce.h"
#include "loss/selective.h"

namespace rlt {

namespace {

// The hidden-state path's LM-head matmul, when chunk_size is 0: as many rows per GEMM as cce uses
// (cce_blocks), so a GPU keeps large GEMMs; naive keeps its documented "all rows at once".
constexpr int64_t kHiddenAutoRows = 4096;

// The row index must name distinct rows of the batch: a repeated row would make the in-place
// selective backward write one row's gradient twice instead of summing it. One host read.
void check_rows(const at::Tensor& rows, int64_t T, const at::Device& device) {
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong, "rows must be a (T') int64 index, got ", rows.sizes(),
              " ", rows.scalar_type());
  TORCH_CHECK(rows.device() == device, "rows are on ", rows.device(), ", the inputs on ", device);
  if (rows.numel() == 0) return;
  const at::Tensor sorted = std::get<0>(rows.sort());
  const at::Tensor distinct = (sorted.narrow(0, 1, sorted.size(0) - 1) > sorted.narrow(0, 0, sorted.size(0) - 1)).all();
  const at::Tensor facts = at::stack({sorted[0], sorted[-1], distinct.to(at::kLong)}).cpu();  // (3)
  const auto f = facts.accessor<int64_t, 1>();
  TORCH_CHECK(f[0] >= 0 && f[1] < T, "rows must lie in [0, T) with T = ", T, ", got [", f[0], ", ", f[1], "]");
  TORCH_CHECK(f[2] == 1, "rows must be distinct (a row listed twice)");
}

// naive_logprobs over chunks of `chunk` rows (0 = one chunk), concatenated (seeds 003/004). Under
// autograd each chunk's log-softmax is still saved; chunking bounds the no-grad working set.
std::pair<at::Tensor, at::Tensor> naive_chunked(const at::Tensor& logits, const at::Tensor& targets,
                                                const LossOptions& opt) {
  const bool with_entropy = opt.entropy != EntropyMode::kNone;
  const int64_t N = logits.size(0);  // T' rows
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
    at::Tensor dz = grads[0].to(h.scalar_type());  // (T', V)
    return {at::mm(dz, w), at::mm(dz.t(), h)};
  }
};

}  // namespace

std::pair<at::Tensor, at::Tensor> naive_logprobs(const at::Tensor& logits, const at::Tensor& targets,
                                                 double temperature, bool with_entropy) {
  TORCH_CHECK(logits.dim() == 2, "logits must be (N, V), got ", logits.sizes());
  at::Tensor x = logits.to(accumulation_dtype(logits.scalar_type()));  // (T', V)
  if (temperature != 1.0) x = x / temperature;
  at::Tensor logp_all = at::log_softmax(x, 1);                            // (T', V)
  at::Tensor logp = logp_all.gather(1, targets.unsqueeze(1)).squeeze(1);  // (T')
  at::Tensor entropy;
  if (with_entropy) entropy = -(logp_all.exp() * logp_all).sum(1);  // (T')
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

// Log-probs (and entropy) of every row of hidden (T', D) through the LM head, naive or selective: fp32
// logits of chunk_size rows at a time, so the LM-head matmul's [rows, V] working set is bounded for
// every impl (under autograd each chunk's logits, or its log-softmax for naive, are still saved for the
// backward: that is what these paths trade against cce's recomputation).
static std::pair<at::Tensor, at::Tensor> hidden_logprobs(const at::Tensor& hidden, const at::Tensor& lm_head,
                                                         const at::Tensor& targets, double softcap,
                                                         const LossOptions& opt) {
  const int64_t N = hidden.size(0);  // T' rows
  const int64_t rows = opt.chunk_size > 0                ? opt.chunk_size
                       : opt.impl == LogprobImpl::kNaive ? std::max<int64_t>(N, 1)
                                                         : kHiddenAutoRows;
  // bf16/fp16 weights over several chunks: upcast the LM head once, so autograd sums the chunks' dW
  // in fp32 and rounds it once (per-chunk bf16 dW summed in bf16 loses 2^-9 per chunk).
  const auto acc = accumulation_dtype(hidden.scalar_type());
  const bool upcast = hidden.scalar_type() != acc && N > rows;
  const at::Tensor w = upcast ? lm_head.to(acc) : lm_head;  // (V, D)
  std::vector<at::Tensor> lps, ents;
  for (int64_t s = 0; s < std::max<int64_t>(N, 1); s += rows) {
    const int64_t n = std::min(rows, N - s);
    const at::Tensor h = hidden.narrow(0, s, n);                                      // (n, D)
    at::Tensor logits = upcast ? at::mm(h.to(acc), w.t()) : fp32_logits(h, lm_head);  // (n, V) fp32
    if (softcap > 0) logits = at::tanh(logits / softcap) * softcap;
    const at::Tensor tgt = targets.narrow(0, s, n);
    // selective: the logits are this module's own, so inplace_backward may give their buffer to the
    // gradient; it is honoured as configured (the option's doc says when it saves memory).
    auto r = opt.impl == LogprobImpl::kNaive ? naive_chunked(logits, tgt, opt)
                                             : selective_logprobs(logits, at::Tensor(), tgt, opt);
    lps.push_back(r.first);
    if (r.second.defined()) ents.push_back(r.second);
    if (N == 0) break;
  }
  return {at::cat(lps), ents.empty() ? at::Tensor() : at::cat(ents)};
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

  if (in.rows.defined()) check_rows(in.rows, T, source.device());

  // loss.response_only: the listed rows are gathered before any path runs (no [T', V] copy for
  // selective on logits: it reads them in place); otherwise every row is computed and the listed ones
  // are picked from the results.
  const at::Tensor& rows = in.rows;  // (T') or undefined = all T
  const bool listed_only = rows.defined() && opt.response_only;
  const at::Tensor targets = listed_only ? in.targets.index_select(0, rows) : in.targets;  // (T') or (T)
  std::pair<at::Tensor, at::Tensor> lp;  // log-probs, entropy: (T') or (T)
  if (from_hidden) {
    const at::Tensor hidden = listed_only ? in.hidden.index_select(0, rows) : in.hidden;  // (T', D) or (T, D)
    lp = opt.impl == LogprobImpl::kCce ? cce_logprobs(hidden, in.lm_head, targets, opt, in.logit_softcap)
                                       : hidden_logprobs(hidden, in.lm_head, targets, in.logit_softcap, opt);
  } else if (opt.impl == LogprobImpl::kNaive) {
    // The reference gathers the kept rows into a [T', V] copy, as the seed's PR does.
    lp = naive_chunked(listed_only ? in.logits.index_select(0, rows) : in.logits, targets, opt);
  } else {
    lp = selective_logprobs(in.logits, listed_only ? rows : at::Tensor(), targets, opt);
  }
  LogprobOutput out;
  const bool pick = rows.defined() && !listed_only;
  out.logprobs = pick ? lp.first.index_select(0, rows) : lp.first;
  if (lp.second.defined()) out.entropy = pick ? lp.second.index_select(0, rows) : lp.second;
  return out;
}

}  // namespace rlt
