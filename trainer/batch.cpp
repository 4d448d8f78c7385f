// Packing and response log-probs; see batch.h.
#include "trainer/batch.h"

#include <algorithm>
#include <vector>

namespace rlt {

int64_t shared_prompt_tokens(const Trajectory& a, const Trajectory& b) {
  const int64_t P = static_cast<int64_t>(b.prompt_ids.size());
  return P >= 2 && a.prompt_ids == b.prompt_ids ? P - 1 : 0;
}

PackedBatch pack(const std::vector<Trajectory>& trajs, int64_t begin, int64_t end, at::Device device, bool packed,
                 bool share_prompts) {
  TORCH_CHECK(0 <= begin && begin < end && end <= static_cast<int64_t>(trajs.size()), "pack: bad range [", begin, ", ",
              end, ") of ", trajs.size());
  PackedBatch b;
  b.S = end - begin;
  const int64_t S = b.S;
  // Shared prompts: skip[s], the prompt tokens sequence s takes from its run's prefix sequence (0: none);
  // opens[s], whether a run's prefix sequence goes in before s (its tokens then count as s's).
  std::vector<int64_t> skip(S, 0);
  std::vector<uint8_t> opens(S, 0);
  b.reused.assign(S, 0);
  int64_t total = 0;  // the tokens of the one packed row
  for (int64_t s = 0; s < S; ++s) {
    const Trajectory& t = trajs[begin + s];
    b.L = std::max<int64_t>(b.L, t.window_end());
    b.R = std::max<int64_t>(b.R, static_cast<int64_t>(t.response_ids.size()));
    if (packed && share_prompts) {
      const int64_t with_prev = s > 0 ? shared_prompt_tokens(trajs[begin + s - 1], t) : 0;
      const int64_t with_next = s + 1 < S ? shared_prompt_tokens(t, trajs[begin + s + 1]) : 0;
      skip[s] = std::max(with_prev, with_next);
      opens[s] = with_prev == 0 && with_next > 0;
      b.reused[s] = with_prev;
    }
    total += t.window_end() - b.reused[s];
  }
  b.R = std::max<int64_t>(b.R, 1);
  const int64_t R = b.R;
  // The token grid (rows_n, cols): right-padded rows, or one row of every sequence end to end. Sequence s
  // starts at token `start` of it flattened: s L padded, the lengths before it summed packed.
  const int64_t rows_n = packed ? 1 : S, cols = packed ? total : b.L;
  at::Tensor ids = at::zeros({rows_n, cols}, at::kLong), pos = at::zeros({rows_n, cols}, at::kLong);
  at::Tensor mask = at::zeros({S, R}, at::kFloat), lp = at::zeros({S, R}, at::kFloat);
  int64_t* ids_p = ids.data_ptr<int64_t>();
  int64_t* pos_p = pos.data_ptr<int64_t>();
  auto mask_a = mask.accessor<float, 2>(), lp_a = lp.accessor<float, 2>();
  std::vector<int64_t> rows, slots, sampled_rows, sampled_slots;  // the one row index, and its loss-mask subset
  int64_t start = 0, prefix = -1;                                 // prefix: the open run's prefix sequence
  if (packed) b.starts.push_back(0);
  // Tokens [from, to) of `all` as the next packed sequence (at their own positions), continuing `of`.
  auto lay = [&](const std::vector<int64_t>& all, int64_t from, int64_t to, int64_t of) {
    for (int64_t i = from; i < to; ++i) {
      ids_p[start + i - from] = all[i];
      pos_p[start + i - from] = i;
    }
    start += to - from;
    b.starts.push_back(start);
    b.prefix_of.push_back(of);
  };
  for (int64_t s = 0; s < S; ++s) {
    const Trajectory& t = trajs[begin + s];
    const auto all = t.ids();
    const int64_t n = static_cast<int64_t>(all.size());
    if (opens[s]) {
      lay(all, 0, skip[s], -1);
      prefix = static_cast<int64_t>(b.starts.size()) - 2;
    }
    if (!packed) {
      start = s * b.L;
      for (int64_t i = 0; i < n; ++i) {
        ids_p[start + i] = all[i];
        pos_p[start + i] = i;
      }
      for (int64_t i = n; i < b.L; ++i) pos_p[start + i] = i;  // padding keeps counting (never scored)
    }
    const int64_t P = t.window_begin(), nr = static_cast<int64_t>(t.response_ids.size());
    TORCH_CHECK(P >= 1, "pack: a trajectory has an empty prompt");
    for (int64_t j = 0; j < nr; ++j) {
      rows.push_back(start + P - 1 - skip[s] + j);
      slots.push_back(s * R + j);
      mask_a[s][j] = t.loss_mask[j];
      lp_a[s][j] = t.logprobs[j];
      if (t.loss_mask[j]) {
        sampled_rows.push_back(rows.back());
        sampled_slots.push_back(slots.back());
      }
    }
    if (packed) lay(all, skip[s], n, skip[s] > 0 ? prefix : -1);
  }
  if (packed) b.L = total;
  if (std::all_of(b.prefix_of.begin(), b.prefix_of.end(), [](int64_t f) { return f < 0; })) b.prefix_of.clear();
  // Row t scores ids[t + 1]; the last token of each sequence scores what follows it and is never listed.
  const int64_t T = rows_n * cols;
  at::Tensor targets = at::zeros({T}, at::kLong);
  if (T > 1) targets.narrow(0, 0, T - 1).copy_(ids.view({T}).narrow(0, 1, T - 1));
  auto index = [&](const std::vector<int64_t>& v) { return at::tensor(v, at::kLong).to(device); };
  b.ids = ids.to(device);
  b.positions = pos.to(device);
  b.targets = targets.to(device);
  b.response = {index(rows), index(slots)};
  b.sampled = {index(sampled_rows), index(sampled_slots)};
  b.loss_mask = mask.to(device);
  b.logprobs_rollout = lp.to(device);
  return b;
}

at::Tensor to_response_layout(const at::Tensor& values, const ResponseRows& rows, const PackedBatch& batch) {
  return at::zeros({batch.S * batch.R}, values.options()).index_copy(0, rows.slots, values).view({batch.S, batch.R});
}

at::Tensor batch_hidden(const Transformer& model, const PackedBatch& batch) {
  return batch.packed() ? model.forward_packed(batch.ids, batch.positions, batch.starts, batch.prefix_of)  // (1, T, D)
                        : model.forward(batch.ids, batch.positions, at::Tensor());                         // (S, L, D)
}

ResponseLogprobs response_logprobs(const Transformer& model, const PackedBatch& batch, const LossOptions& options) {
  ResponseLogprobs out;
  out.hidden = batch_hidden(model, batch);
  // loss.loss_mask_only: list the sampled tokens' rows only (tool output is never scored).
  const ResponseRows& listed = options.loss_mask_only ? batch.sampled : batch.response;
  LogprobInputs in;
  in.hidden = out.hidden.reshape({-1, out.hidden.size(2)});  // (T, D)
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
