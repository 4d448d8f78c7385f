// The trainer's one row layout (trainer/batch.h): pack() lists each response token's scoring row once,
// the loss module computes exactly those rows, and the (S, R) response layout the policy loss reads holds
// the log-prob of response token j of sequence s at (s, j). Reference: each trajectory alone through the
// model, a float64 log-softmax over the full vocabulary. Each check is paired with a wrongly packed
// batch (an off-by-one row, a dropped row, two sequences' slots swapped) that it must reject.
#include <gtest/gtest.h>

#include <ATen/core/grad_mode.h>

#include <string>
#include <tuple>
#include <vector>

#include "data/tokenizer.h"
#include "model/transformer.h"
#include "rollout/engine.h"
#include "rollout/retool.h"
#include "tests/common/check.h"
#include "tests/common/tiny_model.h"
#include "tests/common/tiny_tokenizer.h"
#include "tests/common/tmpdir.h"
#include "trainer/batch.h"
#include "trainer/metrics.h"

namespace rlt {
namespace {

// Prompts of 3, 5 and 2 tokens; responses of 4, 1 and 6 tokens, tool output (loss_mask 0) inside.
std::vector<Trajectory> trajectories() {
  std::vector<Trajectory> t(3);
  t[0].prompt_ids = {1, 7, 9};
  t[0].response_ids = {11, 12, 13, 14};
  t[0].loss_mask = {1, 0, 0, 1};
  t[1].prompt_ids = {1, 4, 4, 8, 2};
  t[1].response_ids = {30};
  t[1].loss_mask = {1};
  t[2].prompt_ids = {1, 5};
  t[2].response_ids = {21, 22, 23, 24, 25, 26};
  t[2].loss_mask = {1, 1, 0, 0, 1, 1};
  for (auto& x : t) x.logprobs.assign(x.response_ids.size(), 0.f);
  return t;
}

// (S, R) float64: log p(response token j of s) from s alone; 0 on padding slots.
at::Tensor reference(const Transformer& model, const std::vector<Trajectory>& trajs, int64_t R) {
  at::NoGradGuard no_grad;
  at::Tensor out = at::zeros({static_cast<int64_t>(trajs.size()), R}, at::kDouble);
  for (size_t s = 0; s < trajs.size(); ++s) {
    const auto ids = trajs[s].ids();
    const int64_t n = static_cast<int64_t>(ids.size()), P = trajs[s].window_begin();
    const at::Tensor x = at::tensor(ids, at::kLong).view({1, n});
    const at::Tensor h = model.forward(x, at::arange(n, at::kLong).view({1, n}), at::Tensor())[0];  // (n, D)
    const at::Tensor logp = at::log_softmax(at::mm(h.to(at::kDouble), model.lm_head().to(at::kDouble).t()), 1);
    for (int64_t j = 0; j + P < n; ++j) out[s][j] = logp[P - 1 + j][ids[P + j]];
  }
  return out;
}

at::Tensor logprobs(const Transformer& model, const PackedBatch& b, const LossOptions& o) {
  at::NoGradGuard no_grad;
  return response_logprobs(model, b, o).logprobs;
}

// Log-probs (S, R), the loss -sum(mask * logp) and the gradient of every parameter, for batch `b`.
std::tuple<at::Tensor, double, std::vector<at::Tensor>> logprobs_loss_grads(Transformer& model, const PackedBatch& b,
                                                                            const LossOptions& o) {
  for (auto& p : model.parameters()) p.mutable_grad().reset();
  const ResponseLogprobs r = response_logprobs(model, b, o);
  const at::Tensor loss = -(r.logprobs * b.loss_mask).sum();
  loss.backward();
  std::vector<at::Tensor> g;
  for (const auto& p : model.parameters()) g.push_back(p.grad().clone());
  return {r.logprobs.detach(), loss.item<double>(), g};
}

TEST(Batch, RowIndexLinksEachResponseTokenToItsScoringRow) {
  const Transformer model(testing::tiny_llama(50), at::kFloat, at::kCPU, /*seed=*/3);
  const auto trajs = trajectories();
  const PackedBatch b = pack(trajs, 0, 3, at::kCPU);
  ASSERT_EQ(b.R, 6);
  ASSERT_EQ(b.L, 8);
  // Sequence-major order, one entry per response token: rows s*L + P_s - 1 + j, slots s*R + j.
  EXPECT_TRUE(at::equal(b.response.rows, at::tensor({2, 3, 4, 5, 12, 17, 18, 19, 20, 21, 22}, at::kLong)));
  EXPECT_TRUE(at::equal(b.response.slots, at::tensor({0, 1, 2, 3, 6, 12, 13, 14, 15, 16, 17}, at::kLong)));
  EXPECT_TRUE(at::equal(b.sampled.rows, at::tensor({2, 5, 12, 17, 18, 21, 22}, at::kLong)));
  const at::Tensor want = reference(model, trajs, b.R);  // (S, R)

  // Wrongly packed batches the check must reject.
  PackedBatch off_row = b, dropped = b, swapped = b;
  off_row.response.rows = b.response.rows + 1;
  dropped.response.rows = b.response.rows.narrow(0, 0, 10);
  dropped.response.slots = b.response.slots.narrow(0, 0, 10);
  swapped.response.slots = b.response.slots.clone();
  swapped.response.slots[4] = 0;  // sequence 1's token lands on sequence 0's first slot ...
  swapped.response.slots[0] = 6;  // ... and the other way round
  for (auto impl : {LogprobImpl::kNaive, LogprobImpl::kSelective, LogprobImpl::kCce}) {
    for (bool response_only : {true, false}) {
      LossOptions o;
      o.impl = impl;
      o.response_only = response_only;
      const std::string what = std::string(enum_to_string(impl)) + (response_only ? " response_only" : " all rows");
      const at::Tensor got = logprobs(model, b, o);
      RLT_EXPECT_CLOSE_REJECTING(got, logprobs(model, off_row, o), "row t + 1", want, 1e-5, 0.0, what);
      EXPECT_TRUE(rlt::testing::rejects(logprobs(model, dropped, o), want, 1e-5, 0.0, what, "last token dropped"));
      EXPECT_TRUE(rlt::testing::rejects(logprobs(model, swapped, o), want, 1e-5, 0.0, what, "slots swapped"));
    }
  }
}

// The packed layout (train.pack_sequences): the same trajectories and a one-token sequence laid end to end.
// Its row index, RoPE positions restarting in each sequence, and log-probs, loss and parameter gradients
// equal to the padded layout's in fp32. Wrong twins: a boundary row off by one (sequence 1's rows as if it
// started a token later), and positions running on across sequences.
TEST(Batch, PackedSequencesGiveThePaddedLogprobsLossAndGradients) {
  Transformer model(testing::tiny_llama(50), at::kFloat, at::kCPU, /*seed=*/5);
  auto trajs = trajectories();
  trajs.push_back(Trajectory{});
  trajs.back().prompt_ids = {1};  // one token, nothing scored
  const PackedBatch padded = pack(trajs, 0, 4, at::kCPU), b = pack(trajs, 0, 4, at::kCPU, /*packed=*/true);
  ASSERT_TRUE(b.packed());
  EXPECT_EQ(b.starts, (std::vector<int64_t>{0, 7, 13, 21, 22}));
  EXPECT_EQ(b.ids.sizes(), (std::vector<int64_t>{1, 22}));
  EXPECT_EQ(b.L, 22);
  // Rows start_s + P_s - 1 + j; slots and the loss mask as in the padded layout.
  EXPECT_TRUE(at::equal(b.response.rows, at::tensor({2, 3, 4, 5, 11, 14, 15, 16, 17, 18, 19}, at::kLong)));
  EXPECT_TRUE(at::equal(b.response.slots, padded.response.slots));
  EXPECT_TRUE(at::equal(b.sampled.slots, padded.sampled.slots));
  EXPECT_TRUE(at::equal(b.loss_mask, padded.loss_mask));
  const at::Tensor restart =
      at::cat({at::arange(7), at::arange(6), at::arange(8), at::arange(1)}).to(at::kLong).view({1, 22});
  EXPECT_TRUE(at::equal(b.positions, restart));
  EXPECT_FALSE(at::equal(at::arange(22, at::kLong).view({1, 22}), restart)) << "positions running across";
  for (int64_t s = 0; s < 4; ++s) {
    const auto ids = trajs[s].ids();
    EXPECT_TRUE(at::equal(b.ids[0].narrow(0, b.starts[s], b.starts[s + 1] - b.starts[s]), at::tensor(ids, at::kLong)));
  }

  PackedBatch off_row = b;  // sequence 1's row one token on
  off_row.response.rows = b.response.rows.clone();
  off_row.response.rows[4] = b.response.rows[4].item<int64_t>() + 1;
  for (auto impl : {LogprobImpl::kSelective, LogprobImpl::kCce}) {
    LossOptions o;
    o.impl = impl;
    const std::string what = enum_to_string(impl);
    auto run = [&](const PackedBatch& x) { return logprobs_loss_grads(model, x, o); };  // in each layout
    const auto [want, want_loss, want_g] = run(padded);
    const auto [got, got_loss, got_g] = run(b);
    const auto [wrong, wrong_loss, wrong_g] = run(off_row);
    RLT_EXPECT_CLOSE_REJECTING(got, wrong, "a boundary row off by one", want, 1e-6, 0.0, what + " log-probs");
    EXPECT_NEAR(got_loss, want_loss, 1e-5) << what;
    EXPECT_GT(std::abs(wrong_loss - want_loss), 1e-3) << what << ": the off-by-one row moves the loss";
    int64_t moved = 0;  // gradients the off-by-one row moves past the bound
    for (size_t i = 0; i < got_g.size(); ++i) {
      RLT_EXPECT_CLOSE(got_g[i], want_g[i], 1e-6, 1e-5, what + " grad " + std::to_string(i));
      moved += !rlt::testing::close(wrong_g[i], want_g[i], 1e-6, 1e-5, "");
    }
    EXPECT_GT(moved, 0) << what << ": the gradient bound accepts a boundary row off by one";
  }
}

// Shared prompts (train.share_prompts): three answers to one 4-token prompt, an answer to another prompt,
// and two answers to a 1-token prompt (nothing to share: its last token is each answer's own first row).
// The three run the prompt's first 3 tokens once as a sequence of their own, and each continues it from the
// prompt's last token at position 3. Log-probs (every response row, and the sampled ones alone), the loss
// and every parameter's gradient equal the padded layout's in fp32. Wrong twins: the answers without their
// prompt (prefix_of all -1), and the answers' positions restarting at 0.
TEST(Batch, SharedPromptsGiveThePaddedLogprobsLossAndGradients) {
  Transformer model(testing::tiny_llama(50), at::kFloat, at::kCPU, /*seed=*/6);
  std::vector<Trajectory> trajs(6);
  const std::vector<std::vector<int64_t>> prompts = {{1, 7, 9, 3},    {1, 7, 9, 3}, {1, 7, 9, 3},
                                                     {1, 4, 4, 8, 2}, {1},          {1}};
  const std::vector<std::vector<int64_t>> responses = {{11, 12, 13}, {30}, {21, 22, 23, 24, 25}, {16, 17}, {5, 6}, {7}};
  const std::vector<std::vector<uint8_t>> masks = {{1, 0, 1}, {1}, {1, 1, 0, 0, 1}, {1, 1}, {0, 1}, {1}};
  for (size_t s = 0; s < trajs.size(); ++s) {
    trajs[s].prompt_ids = prompts[s];
    trajs[s].response_ids = responses[s];
    trajs[s].loss_mask = masks[s];
    trajs[s].logprobs.assign(responses[s].size(), 0.f);
  }
  EXPECT_EQ(shared_prompt_tokens(trajs[0], trajs[1]), 3);
  EXPECT_EQ(shared_prompt_tokens(trajs[2], trajs[3]), 0);
  EXPECT_EQ(shared_prompt_tokens(trajs[4], trajs[5]), 0) << "a one-token prompt has nothing to share";
  const PackedBatch padded = pack(trajs, 0, 6, at::kCPU);
  const PackedBatch plain = pack(trajs, 0, 6, at::kCPU, /*packed=*/true);
  const PackedBatch b = pack(trajs, 0, 6, at::kCPU, /*packed=*/true, /*share_prompts=*/true);
  EXPECT_TRUE(plain.prefix_of.empty());
  EXPECT_EQ(plain.starts, (std::vector<int64_t>{0, 7, 12, 21, 28, 31, 33}));
  // [1 7 9] [3 11 12 13] [3 30] [3 21 .. 25] [1 4 4 8 2 16 17] [1 5 6] [1 7]
  EXPECT_EQ(b.starts, (std::vector<int64_t>{0, 3, 7, 9, 15, 22, 25, 27}));
  EXPECT_EQ(b.prefix_of, (std::vector<int64_t>{-1, 0, 0, 0, -1, -1, -1}));
  EXPECT_EQ(b.L, 27);
  EXPECT_TRUE(at::equal(
      b.ids, at::tensor({1, 7, 9, 3, 11, 12, 13, 3, 30, 3, 21, 22, 23, 24, 25, 1, 4, 4, 8, 2, 16, 17, 1, 5, 6, 1, 7},
                        at::kLong)
                 .view({1, 27})));
  EXPECT_TRUE(
      at::equal(b.positions,
                at::tensor({0, 1, 2, 3, 4, 5, 6, 3, 4, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 0, 1}, at::kLong)
                    .view({1, 27})));
  // Each answer's first row is its own copy of the prompt's last token.
  EXPECT_TRUE(at::equal(b.response.rows, at::tensor({3, 4, 5, 7, 9, 10, 11, 12, 13, 19, 20, 22, 23, 25}, at::kLong)));
  EXPECT_TRUE(at::equal(b.response.slots, padded.response.slots));
  EXPECT_TRUE(at::equal(b.loss_mask, padded.loss_mask));

  PackedBatch unprompted = b, restarted = b;
  unprompted.prefix_of.assign(b.prefix_of.size(), -1);
  restarted.positions = b.positions.clone();
  for (int64_t s = 1; s <= 3; ++s) {
    restarted.positions[0]
        .narrow(0, b.starts[s], b.starts[s + 1] - b.starts[s])
        .copy_(at::arange(b.starts[s + 1] - b.starts[s], at::kLong));
  }
  for (bool mask_only : {false, true}) {
    LossOptions o;
    o.impl = LogprobImpl::kCce;
    o.loss_mask_only = mask_only;
    const std::string what = mask_only ? "sampled rows" : "response rows";
    auto run = [&](const PackedBatch& x) { return logprobs_loss_grads(model, x, o); };  // in each layout
    const auto [want, want_loss, want_g] = run(padded);
    const auto [got, got_loss, got_g] = run(b);
    RLT_EXPECT_CLOSE_REJECTING(got, std::get<0>(run(unprompted)), "the answers without their prompt", want, 1e-6, 0.0,
                               what);
    RLT_EXPECT_CLOSE_REJECTING(got, std::get<0>(run(restarted)), "positions restarting in each answer", want, 1e-6, 0.0,
                               what);
    EXPECT_NEAR(got_loss, want_loss, 1e-5) << what;
    for (size_t i = 0; i < got_g.size(); ++i) {
      RLT_EXPECT_CLOSE(got_g[i], want_g[i], 1e-6, 1e-5, what + " grad " + std::to_string(i));
    }
  }
  // The update's work (trainer/metrics.h): the first answer forwards the prompt and its own tokens; the
  // others their own, attending over the 3 they reuse; the tokens sum to the pack's.
  EXPECT_EQ(b.reused, (std::vector<int64_t>{0, 3, 3, 0, 0, 0}));
  LossOptions o;
  o.response_only = true;
  const std::vector<SequenceWork> work = update_work(o, trajs, {b});
  ASSERT_EQ(work.size(), 6u);
  EXPECT_EQ(work[0].tokens, 7);
  EXPECT_EQ(work[0].context, 0);
  EXPECT_EQ(work[1].tokens, 2);
  EXPECT_EQ(work[1].context, 3);
  EXPECT_EQ(work[1].scored, 1);
  EXPECT_EQ(work[2].tokens, 6);
  EXPECT_EQ(work[3].tokens, 7);
  EXPECT_EQ(work[3].context, 0);
  int64_t forwarded = 0;
  for (const SequenceWork& w : work) forwarded += w.tokens;
  EXPECT_EQ(forwarded, b.L) << "the prompt's 3 shared tokens are forwarded once";
}

TEST(Batch, LossMaskOnlyScoresTheSampledTokensAlone) {
  const Transformer model(testing::tiny_llama(50), at::kFloat, at::kCPU, /*seed=*/4);
  const auto trajs = trajectories();
  const PackedBatch b = pack(trajs, 0, 3, at::kCPU);
  for (auto impl : {LogprobImpl::kNaive, LogprobImpl::kSelective, LogprobImpl::kCce}) {
    LossOptions o;
    o.impl = impl;
    const at::Tensor all = logprobs(model, b, o);
    o.loss_mask_only = true;
    at::Tensor lp;
    at::Tensor hidden_grad;
    {
      // The gradient reaches only the sampled tokens' scoring rows.
      ResponseLogprobs r = response_logprobs(model, b, o);
      lp = r.logprobs.detach();
      at::Tensor h = r.hidden;
      h.retain_grad();
      r.logprobs.sum().backward();
      hidden_grad = h.grad().reshape({b.S * b.L, -1}).abs().sum(1);  // (T)
    }
    const std::string what = enum_to_string(impl);
    EXPECT_TRUE(at::equal(lp, all * b.loss_mask)) << what << ": sampled slots as before, tool slots 0";
    const at::Tensor scored = at::zeros({b.S * b.L}, at::kBool).index_fill_(0, b.sampled.rows, true);
    EXPECT_GT(hidden_grad.masked_select(scored).min().item<double>(), 0.0) << what;
    EXPECT_EQ(hidden_grad.masked_select(~scored).max().item<double>(), 0.0) << what << ": tool rows get no gradient";
  }
}

// The rollout's sampling log-probs and the trainer's recomputation of the same tokens on the same weights,
// both through the loss module: in fp32 they agree to 1e-6 on every path, and the
// logged logprob_mismatch_* are that difference. A recomputation without the sampling temperature must
// exceed it.
TEST(Batch, RolloutLogprobsMatchTheTrainersInFp32) {
  testing::TempDir dir("mismatch");
  TokenizerTrainOptions to;
  to.vocab_size = 320;
  to.user_symbols = testing::kToolTags;
  const std::string path = (dir.path() / "tok.model").string();
  Tokenizer::train(testing::tool_corpus(), path, to);
  const Tokenizer tok = Tokenizer::load(path);
  const Transformer model(testing::tiny_llama(tok.vocab_size()), at::kFloat, at::kCPU, /*seed=*/5);
  SamplingOptions s;
  s.temperature = 0.7;
  s.samples_per_prompt = 4;
  s.max_new_tokens = 12;
  RolloutOptions ro;
  ro.tools = false;
  std::vector<Trajectory> trajs;
  {
    at::NoGradGuard no_grad;
    DecodeEngine policy(model, EngineOptions{});
    trajs = rollout(policy, tok, {tok.encode("What is 12 * 34?"), tok.encode("def f(x):")}, s, ro, ToolRunner());
  }
  const PackedBatch b = pack(trajs, 0, static_cast<int64_t>(trajs.size()), at::kCPU);
  ASSERT_GT(b.loss_mask.sum().item<double>(), 40);
  for (auto impl : {LogprobImpl::kNaive, LogprobImpl::kSelective, LogprobImpl::kCce}) {
    LossOptions o;
    o.impl = impl;
    o.temperature = s.temperature;  // what make_run sets: the trainer scores the distribution sampled from
    const std::string what = enum_to_string(impl);
    LogprobMismatch mm;
    mm.add(logprobs(model, b, o), b.logprobs_rollout, b.loss_mask);
    const auto m = mm.read();
    EXPECT_LE(m.at("logprob_mismatch_max"), 1e-6) << what;
    // The logged values are their definition: max and mean of |trainer - rollout| over sampled tokens.
    const at::Tensor d = ((logprobs(model, b, o) - b.logprobs_rollout).abs() * b.loss_mask).to(at::kDouble);
    EXPECT_DOUBLE_EQ(m.at("logprob_mismatch_max"), d.max().item<double>()) << what;
    EXPECT_NEAR(m.at("logprob_mismatch_mean"), d.sum().item<double>() / b.loss_mask.sum().item<double>(), 1e-15);
    LossOptions no_temp = o;
    no_temp.temperature = 1.0;
    LogprobMismatch wrong;
    wrong.add(logprobs(model, b, no_temp), b.logprobs_rollout, b.loss_mask);
    EXPECT_GT(wrong.read().at("logprob_mismatch_max"), 1e-6) << what << ": a missing temperature must show";
  }
}

}  // namespace
}  // namespace rlt
