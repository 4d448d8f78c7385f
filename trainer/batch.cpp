// Packing and response log-probs; see batch.h.
#include "trainer/batch.h"

#include <algorithm>
#include <vector>

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
  const int64_t S = b.S, L = b.L, R = b.R;
  at::Tensor ids = at::zeros({S, L}, at::kLong), mask = at::zeros({S, R}, at::kFloat);
  at::Tensor lp = at::zeros({S, R}, at::kFloat);
  auto ids_a = ids.accessor<int64_t, 2>();
  auto mask_a = mask.accessor<float, 2>(), lp_a = lp.accessor<float, 2>();
  std::vector<int64_t> rows, slots, sampled_rows, sampled_slots;  // the one row index, and its loss-mask subset
  for (int64_t s = 0; s < S; ++s) {
    const Trajectory& t = trajs[begin + s];
    const auto all = t.ids();
    for (size_t i = 0; i < all.size(); ++i) ids_a[s][i] = all[i];
    const int64_t P = t.window_begin(), n = static_cast<int64_t>(t.response_ids.size());
    TORCH_CHECK(P >= 1, "pack: a trajectory has an empty prompt");
    for (int64_t j = 0; j < n; ++j) {
      rows.push_back(s * L + P - 1 + j);
      slots.push_back(s * R + j);
      mask_a[s][j] = t.loss_mask[j];
      lp_a[s][j] = t.logprobs[j];
      if (t.loss_mask[j]) {
        sampled_rows.push_back(rows.back());
        sampled_slots.push_back(slots.back());
      }
    }
  }
  // Row t scores ids[t + 1]; the last column scores padding and is never listed.
  at::Tensor targets = at::zeros({S, L}, at::kLong);
  if (L > 1) targets.narrow(1, 0, L - 1).copy_(ids.narrow(1, 1, L - 1));
  auto index = [&](const std::vector<int64_t>& v) { return at::tensor(v, at::kLong).to(device); };
  b.ids = ids.to(device);
  b.positions = at::arange(L, at::kLong).view({1, L}).expand({S, L}).contiguous().to(device);
  b.targets = targets.view({S * L}).to(device);
  b.response = {index(rows), index(slots)};
  b.sampled = {index(sampled_rows), index(sampled_slots)};
  b.loss_mask = mask.to(device);
  b.logprobs_rollout = lp.to(device);
  return b;
}

at::Tensor to_response_layout(const at::Tensor& values, const ResponseRows& rows, const PackedBatch& batch) {
  return at::zeros({batch.S * batch.R}, values.options()).index_copy(0, rows.slots, values).view({batch.S, batch.R});
}

ResponseLogprobs response_logprobs(const Transformer& model, const PackedBatch& batch, const LossOptions& options) {
  ResponseLogprobs out;
  out.hidden = model.forward(batch.ids, batch.positions, at::Tensor());  // (S, L, D)
  // loss.loss_mask_only: list the sampled tokens' rows only (tool output is never scored).
  const ResponseRows& listed = options.loss_mask_only ? batch.sampled : batch.response;
  LogprobInputs in;
  in.hidden = out.hidden.reshape({batch.S * batch.L, out.hidden.size(2)});  // (T, D)
  in.lm_head = model.lm_head();
  in.targets = batch.targets;
  in.rows = listed.rows;
  in.logit_softcap = model.config().final_softcap;
  LogprobOutput lo = token_logprobs(in, options);  // (N) in the index's order
  out.logprobs = to_response_layout(lo.logprobs, listed, batch);
  if (lo.entropy.defined()) out.entropy = to_response_layout(lo.entropy, listed, batch);
  return out;
}

}  // namespace rlt
