// Trajectories -> a training batch, and per-token log-probs of its responses through the loss module:
// the one function the old-policy, reference and update passes of GRPO and PPO all call.
//
// Two layouts, one row index. Padded: S sequences right-padded to L tokens (prompt + response),
// flattened to T = S * L rows; sequence s starts at row s * L. Right padding keeps every real token's
// causal context free of padding, so the forward needs no attention mask. Packed (train.pack_sequences):
// the S sequences laid end to end in one row of T = their summed lengths, sequence s at tokens
// [starts[s], starts[s + 1]), RoPE positions restarting at 0 in each, attention within each
// (Transformer::forward_packed); no padding reaches a GEMM. Either way row t scores ids[t + 1], so
// sequence s's response token j (at position P_s + j) is scored by row start_s + P_s - 1 + j. The
// policy loss reads (S, R) response-aligned tensors, R the longest response.
//
// Shared prompts (`share_prompts`, packed only): answers to one prompt next to each other in a micro-batch
// run the prompt once. The prompt but its last token goes first as a sequence of its own (positions 0 ..
// P - 2); each answer follows as a sequence that continues it (Transformer::forward_packed's prefix_of):
// the prompt's last token, then the response, at positions P - 1 onward. Each answer keeps its own first
// row, so row t still scores ids[t + 1]: the answer's response token j is scored by row start + j. The
// hidden states of every scored row equal the unshared layout's. The prompt's first P - 1 tokens count as
// the first answer's; each answer after it reuses them (`reused`), so the pack is P - 1 tokens shorter
// for each.
//
// The row index links the two: for each response token, in (sequence, position) order, the row that
// scores it and its slot s * R + j in the (S, R) layout. The loss module computes exactly those rows and
// returns them in that order (loss/logprob.h); one index_copy places them in the (S, R) layout.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "loss/logprob.h"
#include "model/transformer.h"
#include "rollout/retool.h"

namespace rlt {

// Response tokens of a batch, in (sequence, position) order.
struct ResponseRows {
  at::Tensor rows;   // (N) int64: the flattened row that scores the token (padded: s * L + P_s - 1 + j)
  at::Tensor slots;  // (N) int64: its slot s * R + j in the (S, R) response layout
};

struct PackedBatch {
  at::Tensor ids;                  // (S, L) int64, right-padded; packed: (1, T)
  at::Tensor positions;            // (S, L) int64; packed: (1, T), each sequence's own (a shared answer's from P - 1)
  std::vector<int64_t> starts;     // packed: token offsets of the packed sequences (S, and a shared prompt's
                                   // prefix sequence a run), from 0 to T; padded: empty
  at::Tensor targets;              // (T) int64: ids shifted left by one (a row past its sequence is never listed)
  ResponseRows response;           // every response token (sampled or tool output)
  ResponseRows sampled;            // the response tokens with loss_mask = 1 (loss.loss_mask_only), a subset
  at::Tensor loss_mask;            // (S, R) float: 1 = a sampled token that counts in the loss
  at::Tensor logprobs_rollout;     // (S, R) float: the rollout's sampling log-probs (0 on tool tokens and padding)
  std::vector<int64_t> prefix_of;  // shared prompts: per packed sequence (starts), the one it continues or -1
  std::vector<int64_t> reused;     // (S): tokens of each trajectory that another's forward ran (its prompt's)
  int64_t S = 0, L = 0, R = 0;     // packed: L = T, the tokens of the one row
  bool packed() const { return !starts.empty(); }
};

// The prompt tokens trajectory b can take from a over a shared prompt: P - 1 where the two prompts are
// equal and P >= 2, else 0.
int64_t shared_prompt_tokens(const Trajectory& a, const Trajectory& b);

// Lays trajectories [begin, end) of `trajs` out, end to end (`packed`) or right-padded; tensors on `device`.
// `share_prompts` (packed only): neighbours with one prompt run it once (above).
PackedBatch pack(const std::vector<Trajectory>& trajs, int64_t begin, int64_t end, at::Device device,
                 bool packed = false, bool share_prompts = false);

struct ResponseLogprobs {
  at::Tensor logprobs;  // (S, R) float32, differentiable when grad mode is on; 0 on slots not computed
  at::Tensor entropy;   // (S, R) float32 when options.entropy != none
  at::Tensor hidden;    // (S, L, D) the decoder's output, packed (1, T, D) (PPO's value head reads it by row)
};

// One forward of `model` over the batch: hidden states (S, L, D), packed (1, T, D).
at::Tensor batch_hidden(const Transformer& model, const PackedBatch& batch);

// One forward of `model` over the batch and the loss module on its response rows: every response
// token's, or with options.loss_mask_only the sampled tokens' only (the others read 0).
ResponseLogprobs response_logprobs(const Transformer& model, const PackedBatch& batch, const LossOptions& options);

// values (N), one per entry of `rows`, placed in the (S, R) response layout of `batch`; 0 elsewhere.
// Differentiable (index_copy's backward gathers the slots).
at::Tensor to_response_layout(const at::Tensor& values, const ResponseRows& rows, const PackedBatch& batch);

}  // namespace rlt
