// Packing and response log-probs; see batch.h.
#include "trainer/batch.h"

#include <algorithm>

namespace rlt {

PackedBatch pack(const std::vector<Trajectory>& trajs, int64_t begin, int64_t end, at::Device device) {
  TORCH_CHECK(0 <= begin && begin < end && end <= static_cast<int64_t>(trajs.size()), "pack: bad range [", begin, ", ",
              end, ") of ", trajs.size());
  PackedBatch b;
  b.S = end - begin;
  for (int64_t s = begin; s < end; ++s) {
    b.L = std::max<int64_t>(b.L, trajs[s].window_end());
    b.R = std::max<int64_t>(b.R, static_cast<int64_t>(trajs[s].response_ids.size()));
  }
  b.R = std::max<int64_t>(b.R, 1);
  const int64_t S = b.S, L = b.L, R = b.R, T = S * L;
  at::Tensor ids = at::zeros({S, L}, at::kLong), windows = at::zeros({S, 2}, at::kLong);
  at::Tensor row_mask = at::zeros({T}, at::kFloat), gather = at::zeros({S, R}, at::kLong);
  at::Tensor mask = at::zeros({S, R}, at::kFloat), valid = at::zeros({S, R}, at::kFloat);
  at::Tensor lp = at::zeros({S, R}, at::kFloat);
  auto ids_a = ids.accessor<int64_t, 2>();
  auto gather_a = gather.accessor<int64_t, 2>();
  auto mask_a = mask.accessor<float, 2>(), valid_a = valid.accessor<float, 2>(), lp_a = lp.accessor<float, 2>();
  for (int64_t s = 0; s < S; ++s) {
    const Trajectory& t = trajs[begin + s];
    const auto all = t.ids();
    for (size_t i = 0; i < all.size(); ++i) ids_a[s][i] = all[i];
    const int64_t P = t.window_begin(), n = static_cast<int64_t>(t.response_ids.size());
    TORCH_CHECK(P >= 1, "pack: a trajectory has an empty prompt");
    windows[s][0] = s * L + P - 1;
    windows[s][1] = s * L + P - 1 + n;
    for (int64_t j = 0; j < n; ++j) {
      gather_a[s][j] = s * L + P - 1 + j;
      mask_a[s][j] = t.loss_mask[j];
      valid_a[s][j] = 1;
      lp_a[s][j] = t.logprobs[j];
      row_mask[s * L + P - 1 + j] = t.loss_mask[j];
    }
  }
  // Row t scores ids[t + 1]; the last column scores padding and lies outside every window.
  at::Tensor targets = at::zeros({S, L}, at::kLong);
  if (L > 1) targets.narrow(1, 0, L - 1).copy_(ids.narrow(1, 1, L - 1));
  b.ids = ids.to(device);
  b.positions = at::arange(L, at::kLong).view({1, L}).expand({S, L}).contiguous().to(device);
  b.targets = targets.view({T}).to(device);
  b.rows.response_windows = windows.to(device);
  b.rows.loss_mask = row_mask.to(device);
  b.gather = gather.to(device);
  b.loss_mask = mask.to(device);
  b.resp_valid = valid.to(device);
  b.logprobs_sampled = lp.to(device);
  return b;
}

ResponseLogprobs response_logprobs(const Transformer& model, const PackedBatch& batch, const LossOptions& options) {
  const int64_t S = batch.S, L = batch.L;
  ResponseLogprobs out;
  out.hidden = model.forward(batch.ids, batch.positions, at::Tensor());  // (S, L, D)
  LogprobInputs in;
  in.hidden = out.hidden.reshape({S * L, out.hidden.size(2)});  // (T, D)
  in.lm_head = model.lm_head();
  in.targets = batch.targets;
  in.rows = batch.rows;
  in.logit_softcap = model.config().final_softcap;
  LogprobOutput lo = token_logprobs(in, options);
  const at::Tensor idx = batch.gather.reshape({-1});
  out.logprobs = lo.logprobs.index_select(0, idx).view({S, batch.R}) * batch.resp_valid;  // (S, R)
  if (lo.entropy.defined()) out.entropy = lo.entropy.index_select(0, idx).view({S, batch.R}) * batch.resp_valid;
  return out;
}

}  // namespace rlt
