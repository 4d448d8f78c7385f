// The ReTool loop with a scripted stand-in policy (turn ends, windows, loss masks, truncation, feedback,
// token counts, tool concurrency, refills), and rollouts of a tiny model steered into tool calls: real
// sandboxed calls, replies fed in one forward or merged with decode steps, refills. DecodeEngine's own
// tests: test_engine.cpp. Partial rollouts (RolloutCarry): a cut rollout continued under the same
// weights is the uncut one, and one continued under newer weights carries each token's version and the
// log-prob of the weights that sampled it.
#include "rollout/retool.h"

#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <mutex>

#include "data/tokenizer.h"
#include "tests/common/fake_tool.h"
#include "tests/common/steered_policy.h"
#include "tests/common/tiny_model.h"
#include "tests/common/tiny_tokenizer.h"
#include "tests/common/tmpdir.h"

namespace rlt {
namespace {

using Clock = std::chrono::steady_clock;
using testing::FakeTool;
using testing::SteeredPolicy;
using testing::SteerOptions;
using testing::tiny_model;

// Writes a fixed script per sequence: its logits put +100 on the script's next token (Gumbel noise is
// below 18, so the draw is certain). Every token fed is recorded, so a test can check that the model saw
// exactly the trajectory's tokens. Tokens between an <interpreter> and its </interpreter> + "\n" are the
// loop's (tool output, feedback): they do not advance the script. Any other token that differs from the
// proposal is an error.
class ScriptedPolicy : public TokenPolicy {
 public:
  ScriptedPolicy(int64_t vocab, std::vector<std::vector<int64_t>> scripts, int64_t eos, int64_t open, int64_t close,
                 int64_t newline)
      : V_(vocab), scripts_(std::move(scripts)), eos_(eos), open_(open), close_(close), newline_(newline) {}

  // Each start() is a new batch: its rows 0..N-1 are sequences base_..base_+N-1 of the scripts, and each
  // admit() continues them, so a rollout reads the scripts in the same order however it batches them.
  at::Tensor start(const std::vector<std::vector<int64_t>>& prompts, int64_t repeats) override {
    base_ = static_cast<int64_t>(fed_.size());
    return add(prompts, repeats);
  }
  at::Tensor admit(const std::vector<std::vector<int64_t>>& prompts, int64_t repeats) override {
    admits_.push_back(static_cast<int64_t>(prompts.size()));
    return add(prompts, repeats);
  }

  at::Tensor step(const std::vector<int64_t>& rows, const std::vector<int64_t>& tokens) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!in_extend_) ++decode_steps_;
    for (size_t j = 0; j < rows.size(); ++j) {
      const int64_t n = base_ + rows[j], t = tokens[j];
      if (!in_extend_) last_step_[n] = decode_steps_;
      EXPECT_FALSE(gone_[n]) << "sequence " << n << " fed after its release";
      fed_[n].push_back(t);
      feed_times_[n].push_back(Clock::now());
      if (mode_[n] == kScript && t == proposal(n)) {
        ++pos_[n];
      } else if (mode_[n] == kScript && t == open_) {
        mode_[n] = kTool;
      } else if (mode_[n] == kTool) {
        if (t == close_) mode_[n] = kAfterClose;
      } else if (mode_[n] == kAfterClose && t == newline_) {
        mode_[n] = kScript;
      } else {
        ADD_FAILURE() << "sequence " << n << " was fed " << t << ", neither its script nor a tool turn";
      }
    }
    return proposals(rows);
  }
  // Fed one token per step (TokenPolicy's form), after noting the feed: its runs, how many other live
  // sequences were decoding then (their last token fed was not a call's close tag, code_close), the live
  // sequences, and the most decode steps run since one of its rows was last fed by one.
  at::Tensor extend(const std::vector<int64_t>& rows, const std::vector<std::vector<int64_t>>& runs) override {
    std::vector<bool> in_feed(fed_.size(), false);
    Feed f;
    f.runs = static_cast<int64_t>(runs.size());
    f.live = live_;
    for (int64_t r : rows) {
      in_feed[base_ + r] = true;
      f.steps_waited = std::max(f.steps_waited, decode_steps_ - last_step_[base_ + r]);
    }
    for (size_t n = base_; n < fed_.size(); ++n) {
      f.others_decoding += !gone_[n] && !in_feed[n] && mode_[n] == kScript && fed_[n].back() != code_close;
    }
    feeds_.push_back(f);
    in_extend_ = true;
    at::Tensor out = TokenPolicy::extend(rows, runs);
    in_extend_ = false;
    return out;
  }
  void release(const std::vector<int64_t>& rows) override {
    for (int64_t n : rows) {
      released_.push_back(base_ + n);
      live_ -= !gone_[base_ + n];
      gone_[base_ + n] = true;
    }
  }
  int64_t vocab_size() const override { return V_; }

  std::vector<std::vector<int64_t>> fed_;
  std::vector<std::vector<Clock::time_point>> feed_times_;
  std::vector<int64_t> released_;
  std::vector<int64_t> admits_;  // prompts per admit() call
  struct Feed {
    int64_t runs = 0, others_decoding = 0, live = 0, steps_waited = 0;
  };
  std::vector<Feed> feeds_;  // per extend() call
  int64_t code_close = -1;   // the token that ends a code call (for feeds_)
  int64_t max_live_ = 0;     // sequences started and not released, at most

 private:
  enum Mode { kScript, kTool, kAfterClose };
  at::Tensor add(const std::vector<std::vector<int64_t>>& prompts, int64_t repeats) {
    const int64_t N = static_cast<int64_t>(prompts.size()) * repeats, first = static_cast<int64_t>(fed_.size());
    EXPECT_LE(first + N, static_cast<int64_t>(scripts_.size())) << "one script per sequence";
    std::vector<int64_t> rows(N);
    for (int64_t n = 0; n < N; ++n) {
      fed_.push_back(prompts[n / repeats]);
      feed_times_.emplace_back();
      pos_.push_back(0);
      mode_.push_back(kScript);
      gone_.push_back(false);
      last_step_.push_back(decode_steps_);
      rows[n] = first - base_ + n;
    }
    live_ += N;
    max_live_ = std::max(max_live_, live_);
    return proposals(rows);
  }
  int64_t proposal(int64_t n) const { return pos_[n] < int64_t(scripts_[n].size()) ? scripts_[n][pos_[n]] : eos_; }
  at::Tensor proposals(const std::vector<int64_t>& rows) const {  // rows: local to the batch
    at::Tensor logits = at::zeros({int64_t(rows.size()), V_});
    for (size_t j = 0; j < rows.size(); ++j) logits[j][proposal(base_ + rows[j])] = 100.0;
    return logits;
  }
  int64_t V_;
  std::vector<std::vector<int64_t>> scripts_;
  int64_t eos_, open_, close_, newline_;
  std::vector<int64_t> pos_;
  std::vector<Mode> mode_;
  std::vector<bool> gone_;  // released
  int64_t live_ = 0;
  int64_t base_ = 0;                // first sequence of the current batch
  int64_t decode_steps_ = 0;        // step() calls not made by extend()
  std::vector<int64_t> last_step_;  // per sequence: decode_steps_ after the last decode step that fed it
  bool in_extend_ = false;
  std::mutex mu_;
};

class ReToolTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir("retool");
    TokenizerTrainOptions o;
    o.vocab_size = 400;
    o.user_symbols = testing::kToolTags;
    const std::string path = (dir_->path() / "tok.model").string();
    Tokenizer::train(testing::tool_corpus(), path, o);
    tok_ = new Tokenizer(Tokenizer::load(path));
  }
  static void TearDownTestSuite() {
    delete tok_;
    delete dir_;
  }

  std::vector<int64_t> enc(const std::string& s) const { return tok_->encode(s); }
  // Two steered first turns that call the fake tool: a call at once, and a sentence before the call, so
  // replies arrive while other rows decode (kTwoCallOutputs answers both).
  std::vector<std::vector<int64_t>> two_call_scripts() const {
    return {enc("<code>\nprint(1)\n</code>"),
            enc("Let me see, I will write a few words first and then some more.<code>\nprint(347 * 829)\n</code>")};
  }
  inline static const std::map<std::string, std::string> kTwoCallOutputs = {{"\nprint(347 * 829)\n", "287663\n"},
                                                                            {"\nprint(1)\n", "1\n"}};
  // n prompts "Q: 100 ?", "Q: 107 ?", ...
  std::vector<std::vector<int64_t>> numbered_prompts(int64_t n) const {
    std::vector<std::vector<int64_t>> out;
    for (int64_t i = 0; i < n; ++i) out.push_back(enc("Q: " + std::to_string(100 + 7 * i) + " ?"));
    return out;
  }
  std::unique_ptr<ScriptedPolicy> policy(const std::vector<std::string>& scripts) const {
    std::vector<std::vector<int64_t>> ids;
    for (const auto& s : scripts) ids.push_back(enc(s));
    const auto nl = enc("\n");
    EXPECT_EQ(nl.size(), 1u);
    return std::make_unique<ScriptedPolicy>(tok_->vocab_size(), ids, tok_->eos_id(), tok_->piece_id("<interpreter>"),
                                            tok_->piece_id("</interpreter>"), nl[0]);
  }
  static SamplingOptions sampling(int64_t G) {
    SamplingOptions s;
    s.samples_per_prompt = G;
    s.max_new_tokens = 200;
    return s;
  }
  // The text of the response tokens whose loss mask is `mask`, in order.
  std::string masked_text(const Trajectory& t, uint8_t mask) const {
    std::string out;
    for (size_t i = 0; i < t.response_ids.size(); ++i) {
      if (t.loss_mask[i] == mask) out += tok_->piece_text(t.response_ids[i]);
    }
    return out;
  }
  // Invariants of every trajectory: aligned fields, log-probs only where sampled, the model was fed
  // exactly the trajectory's tokens (all but a final sampled token nobody needed to feed).
  void check_consistent(const Trajectory& t, const ScriptedPolicy& p, int64_t n) const {
    ASSERT_EQ(t.loss_mask.size(), t.response_ids.size());
    ASSERT_EQ(t.logprobs.size(), t.response_ids.size());
    for (size_t i = 0; i < t.response_ids.size(); ++i) {
      if (t.loss_mask[i]) {
        EXPECT_GT(t.logprobs[i], -1e-3) << "a scripted token is certain";
      } else {
        EXPECT_EQ(t.logprobs[i], 0.0f) << "no log-prob for tokens the policy did not sample";
      }
    }
    EXPECT_EQ(t.window_begin(), int64_t(t.prompt_ids.size()));
    EXPECT_EQ(t.window_end(), int64_t(t.prompt_ids.size() + t.response_ids.size()));
    const auto ids = t.ids();
    const auto& fed = p.fed_[n];
    ASSERT_LE(fed.size(), ids.size());
    EXPECT_TRUE(std::equal(fed.begin(), fed.end(), ids.begin())) << "the model saw other tokens than the trajectory";
    // Left unfed: at most the final sampled token, then only tool output cut by the context budget (a
    // finished sequence is not fed what follows it).
    int64_t unfed_sampled = 0;
    for (size_t i = fed.size(); i < ids.size(); ++i) {
      const size_t r = i - t.prompt_ids.size();
      if (t.loss_mask[r]) {
        ++unfed_sampled;
        EXPECT_EQ(i, fed.size()) << "a sampled token after unfed tool output";
      }
    }
    EXPECT_LE(unfed_sampled, 1) << "only the final sampled token may be left unfed";
    if (t.finish != FinishReason::kContext) {
      EXPECT_GE(fed.size() + 1, ids.size()) << "only a context cut leaves tool output unfed";
    }
    EXPECT_EQ(t.response_text, masked_text(t, 1)) << "response_text is the model-written text";
  }

  static testing::TempDir* dir_;
  static Tokenizer* tok_;
};
testing::TempDir* ReToolTest::dir_ = nullptr;
Tokenizer* ReToolTest::tok_ = nullptr;

TEST_F(ReToolTest, AnswerEndsTheTrajectory) {
  auto p = policy({"Let me think.\nAnswer: \\boxed{42} and then more text"});
  RolloutOptions o;
  FakeTool tool;
  auto trajs = rollout(*p, *tok_, {enc("Q: 6*7?")}, sampling(1), o, tool.runner());
  ASSERT_EQ(trajs.size(), 1u);
  const Trajectory& t = trajs[0];
  check_consistent(t, *p, 0);
  EXPECT_EQ(t.finish, FinishReason::kAnswer);
  EXPECT_FALSE(t.truncated);
  EXPECT_EQ(t.response_text, "Let me think.\nAnswer: \\boxed{42}");
  EXPECT_EQ(t.sampled_tokens(), int64_t(t.response_ids.size()));
  EXPECT_EQ(t.turns, 1);
  EXPECT_EQ(t.tool_calls, 0);
  EXPECT_TRUE(tool.calls.empty());
  EXPECT_EQ(p->released_, std::vector<int64_t>{0});
}

// A long rollout says where it is on one live line (rollout.progress_s); a short one, or 0, says nothing.
TEST_F(ReToolTest, LongRolloutsPrintALiveProgressLine) {
  FakeTool tool;
  tool.outputs["\nprint(6*7)\n"] = "42\n";
  auto run = [&](double progress_s) {
    auto p = policy({"<code>\nprint(6*7)\n</code>Answer: \\boxed{42}"});
    RolloutOptions o;
    o.progress_s = progress_s;
    ::testing::internal::CaptureStderr();
    rollout(*p, *tok_, {enc("Q")}, sampling(1), o, tool.runner());
    return ::testing::internal::GetCapturedStderr();
  };
  const std::string line = run(1e-9);  // "long" from the first iteration on
  EXPECT_NE(line.find("\rrollout "), std::string::npos) << line;
  EXPECT_NE(line.find("/1 trajectories done"), std::string::npos) << line;
  EXPECT_NE(line.find("tool calls in flight"), std::string::npos) << line;
  EXPECT_EQ(line.back(), '\n') << "the line is ended when the rollout is";
  EXPECT_EQ(run(0), "");
  EXPECT_EQ(run(3600), "") << "a rollout shorter than progress_s prints nothing";
}

// A checkpoint's generation_config.json may name stop ids other than the tokenizer's EOS (Qwen instruct:
// <|im_end|> and <|endoftext|>): each one ends the trajectory, and the tokenizer's EOS alone does not when
// the list is given without it.
TEST_F(ReToolTest, EveryStopIdEndsTheTrajectory) {
  const std::vector<int64_t> stop = enc("!");
  ASSERT_EQ(stop.size(), 1u);
  auto p = policy({"Thinking hard! then more text"});
  RolloutOptions o;
  o.tools = false;
  o.stop_ids = {stop[0]};
  FakeTool tool;
  auto trajs = rollout(*p, *tok_, {enc("Q?")}, sampling(1), o, tool.runner());
  check_consistent(trajs[0], *p, 0);
  EXPECT_EQ(trajs[0].finish, FinishReason::kEos);
  EXPECT_EQ(trajs[0].response_text, "Thinking hard!");
  // Without the id in the list, the same script runs on past it.
  auto q = policy({"Thinking hard! then more text"});
  RolloutOptions plain;
  plain.tools = false;
  auto more = rollout(*q, *tok_, {enc("Q?")}, sampling(1), plain, tool.runner());
  EXPECT_NE(more[0].response_text.find("then more text"), std::string::npos);
}

TEST_F(ReToolTest, ToolCallAppendsMaskedInterpreterTurn) {
  auto p = policy({"I compute.<code>\nprint(6*7)\n</code>Answer: \\boxed{42}"});
  FakeTool tool;
  tool.outputs["\nprint(6*7)\n"] = "42\n";
  RolloutStats stats;
  auto trajs = rollout(*p, *tok_, {enc("Q: 6*7?")}, sampling(1), RolloutOptions{}, tool.runner(), {}, {}, &stats);
  const Trajectory& t = trajs[0];
  check_consistent(t, *p, 0);
  ASSERT_EQ(tool.calls, std::vector<std::string>{"\nprint(6*7)\n"});
  // Every response token but the last (the answer ends the trajectory) is fed: the interpreter block (the
  // forced part) in one multi-token forward, with the call's close tag when the tool answered before that
  // was fed, and every other token in a one-token step.
  const int64_t R = static_cast<int64_t>(t.response_ids.size()), F = R - t.sampled_tokens();
  EXPECT_EQ(stats.forced_tokens, F);
  EXPECT_EQ(stats.feed_steps, 1);
  EXPECT_GE(stats.feed_tokens, F);
  EXPECT_LE(stats.feed_tokens, F + 1);
  EXPECT_EQ(stats.fed_rows + stats.feed_tokens, R - 1);
  EXPECT_EQ(stats.decode_steps, stats.fed_rows) << "one sequence: one row per decode step";
  EXPECT_LE(stats.prefill_s + stats.decode_s + stats.feed_s + stats.sample_s + stats.tool_wait_s, stats.total_s);
  EXPECT_GT(stats.turn_s, 0.0);
  EXPECT_LE(stats.turn_s, stats.sample_s) << "the turn parsing is part of the sampling time";
  EXPECT_EQ(t.finish, FinishReason::kAnswer);
  EXPECT_EQ(t.tool_calls, 1);
  EXPECT_EQ(t.turns, 2);
  EXPECT_EQ(masked_text(t, 0), "<interpreter>\n42\n</interpreter>\n");
  EXPECT_EQ(t.response_text, "I compute.<code>\nprint(6*7)\n</code>Answer: \\boxed{42}");
  // The window: sampled code, then the interpreter block (mask 0), then the sampled answer.
  const auto code = enc("I compute.<code>\nprint(6*7)\n</code>");
  const auto out = enc("<interpreter>\n");
  ASSERT_GT(t.response_ids.size(), code.size() + out.size());
  for (size_t i = 0; i < code.size(); ++i) EXPECT_EQ(t.loss_mask[i], 1) << i;
  EXPECT_EQ(t.response_ids[code.size()], out[0]);
  EXPECT_EQ(t.loss_mask[code.size()], 0);
  EXPECT_EQ(t.loss_mask.back(), 1);
  EXPECT_EQ(t.sampled_tokens(), int64_t(enc(t.response_text).size()));
}

TEST_F(ReToolTest, FencedPythonBlockIsACodeTurn) {
  auto p = policy({"```python\nprint(6*7)\n```\nAnswer: \\boxed{42}"});
  FakeTool tool;
  tool.outputs["print(6*7)\n"] = "42\n";
  auto trajs = rollout(*p, *tok_, {enc("Q")}, sampling(1), RolloutOptions{}, tool.runner());
  check_consistent(trajs[0], *p, 0);
  EXPECT_EQ(tool.calls, std::vector<std::string>{"print(6*7)\n"});
  EXPECT_EQ(trajs[0].finish, FinishReason::kAnswer);
  EXPECT_EQ(masked_text(trajs[0], 0), "<interpreter>\n42\n</interpreter>\n");
}

TEST_F(ReToolTest, UnparseableTurnsGetFeedback) {
  // An empty code block, then text posing as interpreter output, then an answer.
  auto p = policy({"<code>\n  \n</code>Hmm.<interpreter>Answer: \\boxed{1}"});
  FakeTool tool;
  RolloutOptions o;
  auto trajs = rollout(*p, *tok_, {enc("Q")}, sampling(1), o, tool.runner());
  const Trajectory& t = trajs[0];
  check_consistent(t, *p, 0);
  EXPECT_TRUE(tool.calls.empty()) << "nothing to run";
  EXPECT_EQ(t.feedback_turns, 2);
  EXPECT_EQ(t.turns, 3);
  EXPECT_EQ(t.tool_calls, 0);
  const std::string fb = "<interpreter>\n" + o.feedback + "\n</interpreter>\n";
  EXPECT_EQ(masked_text(t, 0), fb + fb);
  EXPECT_EQ(t.finish, FinishReason::kAnswer);
}

TEST_F(ReToolTest, BoxedInsideCodeIsNotAnAnswer) {
  auto p = policy({"<code>\nprint('\\boxed{7}')\n</code>Answer: \\boxed{7}"});
  FakeTool tool;
  tool.outputs["\nprint('\\boxed{7}')\n"] = "\\boxed{7}\n";
  auto trajs = rollout(*p, *tok_, {enc("Q")}, sampling(1), RolloutOptions{}, tool.runner());
  check_consistent(trajs[0], *p, 0);
  EXPECT_EQ(tool.calls.size(), 1u);
  EXPECT_EQ(trajs[0].turns, 2);
  EXPECT_EQ(trajs[0].finish, FinishReason::kAnswer);
}

// The loop reads a turn again only when the sampled piece can end it (TurnEndFilter). Over a corpus of turns
// (calls closed, empty or malformed in both formats, fences with and without a language and with whitespace
// after them, answers in and out of code, nested and unclosed braces, the model writing the interpreter's
// part, text that never ends), each cut into pieces of 1 to 4 characters in several ways, the filtered reading
// ends every turn at the same piece and in the same way as reading after every piece. Filters missing the
// backtick, the closing brace or a tag's last character end some turn later (or never), and fail.
TEST(TurnEndFilter, EndsEveryTurnWhereReadingAfterEveryPieceDoes) {
  const std::vector<std::string> turns = {
      "Let me compute.\n<code>\nprint(6*7)\n</code>",
      "<code>\n\n</code>",
      "</code>",
      "text <code>print('\\boxed{7}')\n</code> more",
      "```python\nprint(1)\n```",
      "```python\nprint(1)\n```   \n",
      "```\nprint(1)\n```",
      "```js\nx\n``` and then ```python\ny = 2\n```",
      "So the answer is \\boxed{42}.",
      "\\boxed{\\frac{1}{2}} done",
      "\\boxed 5 and \\boxed{",
      "<code>x = '\\boxed{3}'",
      "I will now write <interpreter>",
      "result</interpreter>",
      "<tool_call>{\"name\": \"code_interpreter\", \"arguments\": {\"code\": \"print(2)\"}}</tool_call>",
      "<tool_call>{not json}</tool_call>",
      "plain words that never end a turn, with (parens) and [brackets] and > signs",
  };
  ToolProtocol code_format, call_format;
  call_format.format = ToolFormat::kToolCall;
  // For each (turn, cut): the piece at which the reading first ends the turn, and how ("" and -1: never).
  auto read = [&](const ToolProtocol& p, const std::function<bool(const std::string&)>& may_end) {
    std::vector<std::pair<int64_t, std::string>> ends;
    for (const std::string& turn : turns) {
      for (int64_t cut = 0; cut < 4; ++cut) {
        std::string text;
        std::pair<int64_t, std::string> end{-1, ""};
        for (size_t at = 0, i = 0; at < turn.size(); ++i) {
          const size_t len = std::min<size_t>(turn.size() - at, 1 + (i * 7 + cut * 3 + at) % 4);
          const std::string piece = turn.substr(at, len);
          text += piece;
          at += len;
          const std::string how = may_end(piece) ? turn_end(text, p) : "";
          if (!how.empty()) {
            end = {static_cast<int64_t>(i), how};
            break;
          }
        }
        ends.push_back(end);
      }
    }
    return ends;
  };
  for (const ToolProtocol* p : {&code_format, &call_format}) {
    const auto every = read(*p, [](const std::string&) { return true; });
    const TurnEndFilter filter(*p);
    EXPECT_EQ(read(*p, [&](const std::string& s) { return filter.may_end(s); }), every);
    int64_t ended = 0;
    for (const auto& e : every) ended += e.first >= 0;
    EXPECT_GE(ended, 40) << "most turns of the corpus end";
    // Known-bad filters: each trigger left out in turn.
    for (const char c : filter.triggers()) {
      std::string fewer = filter.triggers();
      fewer.erase(fewer.find(c), 1);
      const TurnEndFilter wrong(fewer);
      EXPECT_NE(read(*p, [&](const std::string& s) { return wrong.may_end(s); }), every)
          << "a filter without '" << c << "' must miss a turn's end";
    }
  }
}

TEST_F(ReToolTest, LimitsEndTrajectories) {
  const std::string call = "<code>\nprint(1)\n</code>";
  FakeTool tool;
  tool.outputs["\nprint(1)\n"] = "1\n";
  {  // the turn limit: the third code turn would start a fourth turn
    SCOPED_TRACE("turn limit");
    auto p = policy({call + call + call + call + "Answer: \\boxed{1}"});
    RolloutOptions o;
    o.max_turns = 3;
    auto t = rollout(*p, *tok_, {enc("Q")}, sampling(1), o, tool.runner())[0];
    check_consistent(t, *p, 0);
    EXPECT_EQ(t.finish, FinishReason::kMaxTurns);
    EXPECT_EQ(t.tool_calls, 2);
    EXPECT_EQ(t.turns, 3);
    EXPECT_FALSE(t.truncated);
  }
  {  // the tool-call limit
    SCOPED_TRACE("tool-call limit");
    auto p = policy({call + call + "Answer: \\boxed{1}"});
    RolloutOptions o;
    o.max_tool_calls = 1;
    auto t = rollout(*p, *tok_, {enc("Q")}, sampling(1), o, tool.runner())[0];
    check_consistent(t, *p, 0);
    EXPECT_EQ(t.finish, FinishReason::kToolLimit);
    EXPECT_EQ(t.tool_calls, 1);
  }
  {  // tokens per turn: truncated after exactly max_new_tokens samples
    SCOPED_TRACE("tokens per turn");
    auto p = policy({"one two three four five six seven eight nine ten"});
    SamplingOptions s = sampling(1);
    s.max_new_tokens = 5;
    auto t = rollout(*p, *tok_, {enc("Q")}, s, RolloutOptions{}, tool.runner())[0];
    check_consistent(t, *p, 0);
    EXPECT_EQ(t.finish, FinishReason::kLength);
    EXPECT_TRUE(t.truncated);
    EXPECT_EQ(t.response_ids.size(), 5u);
  }
  {  // the context budget, reached inside the tool output: cut there, exactly at the budget
    SCOPED_TRACE("context budget");
    auto p = policy({call + "Answer: \\boxed{1}"});
    tool.outputs["\nprint(1)\n"] = "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20\n";
    RolloutOptions o;
    const auto prompt = enc("Q");
    o.max_context = int64_t(prompt.size() + enc(call).size()) + 6;
    auto t = rollout(*p, *tok_, {prompt}, sampling(1), o, tool.runner())[0];
    check_consistent(t, *p, 0);
    EXPECT_EQ(t.finish, FinishReason::kContext);
    EXPECT_TRUE(t.truncated);
    EXPECT_EQ(int64_t(t.ids().size()), o.max_context);
    EXPECT_EQ(t.sampled_tokens(), int64_t(enc(call).size()));
  }
  {  // end of sequence, and a stop string
    auto p = policy({"short", "go STOP here"});
    RolloutOptions o;
    o.stop = "STOP";
    auto ts = rollout(*p, *tok_, {enc("Q")}, sampling(2), o, tool.runner());
    check_consistent(ts[0], *p, 0);
    check_consistent(ts[1], *p, 1);
    EXPECT_EQ(ts[0].finish, FinishReason::kEos);
    EXPECT_EQ(ts[0].response_ids.back(), tok_->eos_id());
    EXPECT_EQ(ts[1].finish, FinishReason::kStop);
    EXPECT_EQ(ts[1].response_text, "go STOP");
  }
}

TEST_F(ReToolTest, ToolOutputIsCappedInTokens) {
  auto p = policy({"<code>\nprint(1)\n</code>Answer: \\boxed{1}"});
  FakeTool tool;
  std::string big;
  for (int i = 0; i < 100; ++i) big += std::to_string(i) + " ";
  tool.outputs["\nprint(1)\n"] = big;
  RolloutOptions o;
  o.max_tool_output_tokens = 10;
  auto t = rollout(*p, *tok_, {enc("Q")}, sampling(1), o, tool.runner())[0];
  check_consistent(t, *p, 0);
  const std::vector<int64_t> big_ids = enc(big);
  const std::string expected_body = tok_->decode(std::vector<int64_t>(big_ids.begin(), big_ids.begin() + 10));
  EXPECT_EQ(masked_text(t, 0), "<interpreter>\n" + expected_body + "\n[output truncated]\n</interpreter>\n");
}

TEST_F(ReToolTest, SlowToolsDoNotStallOtherSequences) {
  // Sequence 0 calls a 400 ms tool; sequences 1..3 write text meanwhile and must finish first.
  std::string text;
  for (int i = 0; i < 20; ++i) text += "word" + std::to_string(i) + " ";  // within max_new_tokens = 200
  auto p = policy({"<code>\nslow()\n</code>Answer: \\boxed{1}", text + "Answer: \\boxed{2}",
                   text + "Answer: \\boxed{3}", text + "Answer: \\boxed{4}"});
  FakeTool tool;
  tool.outputs["\nslow()\n"] = "done\n";
  tool.delay_ms["\nslow()\n"] = 400;
  RolloutStats stats;
  auto ts = rollout(*p, *tok_, {enc("Q")}, sampling(4), RolloutOptions{}, tool.runner(), {}, {}, &stats);
  for (int n = 0; n < 4; ++n) check_consistent(ts[n], *p, n);
  // The call's latency as the loop saw it (at least the tool's 400 ms), of it the tool's own clock, and the
  // decode steps sequence 0 sat out meanwhile (the others had 20 words each to write).
  EXPECT_DOUBLE_EQ(stats.tool_run_s, 0.4);
  EXPECT_GE(stats.tool_latency_s, 0.4);
  EXPECT_LE(stats.tool_latency_s, stats.total_s);
  EXPECT_GE(stats.tool_wait_row_steps, 10);
  EXPECT_LE(stats.tool_wait_row_steps, stats.decode_steps + stats.feed_steps) << "one sequence waited, once a pass";
  EXPECT_EQ(stats.feed_wait_row_steps, 0) << "nothing else decodes once the reply is back: it is fed at once";
  ASSERT_EQ(tool.returned.size(), 1u);
  for (int n = 1; n < 4; ++n) {
    EXPECT_EQ(ts[n].finish, FinishReason::kAnswer);
    EXPECT_LT(p->feed_times_[n].back(), tool.returned[0]) << "sequence " << n << " waited for another's tool";
  }
  EXPECT_EQ(ts[0].finish, FinishReason::kAnswer);
}

TEST_F(ReToolTest, ToolCallsOverlap) {
  // Four sequences each call a 300 ms tool: together well under 4 x 300 ms.
  std::vector<std::string> scripts;
  FakeTool tool;
  for (int n = 0; n < 4; ++n) {
    const std::string code = "\nwait(" + std::to_string(n) + ")\n";
    scripts.push_back("<code>" + code + "</code>Answer: \\boxed{" + std::to_string(n) + "}");
    tool.outputs[code] = "ok\n";
    tool.delay_ms[code] = 300;
  }
  auto p = policy(scripts);
  const auto t0 = Clock::now();
  auto ts = rollout(*p, *tok_, {enc("Q")}, sampling(4), RolloutOptions{}, tool.runner());
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  for (int n = 0; n < 4; ++n) {
    check_consistent(ts[n], *p, n);
    EXPECT_EQ(ts[n].tool_calls, 1);
  }
  EXPECT_LT(ms, 900.0) << "tool calls ran one after another";
}

TEST_F(ReToolTest, RefillGivesTheTrajectoriesOfOneBatch) {
  // Five prompts x G = 2 decoded together, or with rollout.max_batch = 4: prompts 0 and 1 start, and finish
  // in the same pass (equal scripts), which frees four rows: prompts 2 and 3 are admitted in one call.
  // Prompt 2 finishes first (prompt 3 calls a slow tool), and prompt 4 takes its two rows while prompt 3's
  // tool runs, before its reply is fed. The trajectories are the same, in the same order, and never more
  // than four sequences are held.
  std::vector<std::string> scripts(4, "x\\boxed{1}");  // prompts 0 and 1
  scripts.push_back("y\\boxed{2}");                    // prompt 2
  scripts.push_back("y\\boxed{2}");
  scripts.push_back("c<code>\nslow()\n</code>\\boxed{3}");  // prompt 3: a slow tool call
  scripts.push_back("long text here then \\boxed{3}");
  scripts.push_back("d<code>\nprint(1)\n</code>\\boxed{4}");  // prompt 4: a fast one
  scripts.push_back("w\\boxed{4}");
  FakeTool tool;
  tool.outputs["\nprint(1)\n"] = "1\n";
  tool.outputs["\nslow()\n"] = "2\n";
  tool.delay_ms["\nslow()\n"] = 100;
  std::vector<std::vector<int64_t>> prompts;
  for (int i = 0; i < 5; ++i) prompts.push_back(enc("Q" + std::to_string(i)));
  auto run = [&](int64_t max_batch, std::unique_ptr<ScriptedPolicy>& p, RolloutStats& stats) {
    p = policy(scripts);
    RolloutOptions o;
    o.max_batch = max_batch;
    return rollout(*p, *tok_, prompts, sampling(2), o, tool.runner(), {}, {}, &stats);
  };
  std::unique_ptr<ScriptedPolicy> p_all, p_refill;
  RolloutStats all_stats, refill_stats;
  const auto all = run(0, p_all, all_stats), refill = run(4, p_refill, refill_stats);
  ASSERT_EQ(all.size(), 10u);
  ASSERT_EQ(refill.size(), 10u);
  for (size_t i = 0; i < 10; ++i) {
    check_consistent(refill[i], *p_refill, int64_t(i));
    EXPECT_EQ(refill[i].prompt_index, int64_t(i / 2));
    EXPECT_EQ(refill[i].sample_index, int64_t(i % 2));
    EXPECT_EQ(all[i].response_ids, refill[i].response_ids) << i;
    EXPECT_EQ(all[i].loss_mask, refill[i].loss_mask) << i;
    EXPECT_EQ(all[i].finish, refill[i].finish) << i;
    EXPECT_EQ(refill[i].finish, FinishReason::kAnswer) << i;
  }
  EXPECT_EQ(refill[6].tool_calls, 1);
  EXPECT_EQ(refill[8].tool_calls, 1);
  // Prompt 4 was fed its first token before prompt 3's slow reply (feed_times_ counts response tokens).
  const auto& r6 = refill[6].response_ids;
  const size_t reply = std::find(r6.begin(), r6.end(), tok_->piece_id("<interpreter>")) - r6.begin();
  ASSERT_LT(reply, p_refill->feed_times_[6].size());
  ASSERT_FALSE(p_refill->feed_times_[8].empty());
  EXPECT_LT(p_refill->feed_times_[8][0], p_refill->feed_times_[6][reply]);
  EXPECT_EQ(p_refill->admits_, (std::vector<int64_t>{2, 1})) << "prompts 2 and 3 in one call, then prompt 4";
  EXPECT_EQ(refill_stats.refills, 3);
  EXPECT_EQ(p_refill->max_live_, 4);
  EXPECT_TRUE(p_all->admits_.empty());
  EXPECT_EQ(all_stats.refills, 0);
  EXPECT_EQ(p_all->max_live_, 10);
  EXPECT_EQ(refill_stats.forced_tokens, all_stats.forced_tokens);
  // max_batch below G: still one whole prompt at a time, each admitted alone.
  std::unique_ptr<ScriptedPolicy> p_one;
  RolloutStats one_stats;
  const auto one = run(1, p_one, one_stats);
  for (size_t i = 0; i < 10; ++i) EXPECT_EQ(all[i].response_ids, one[i].response_ids) << i;
  EXPECT_EQ(p_one->admits_, (std::vector<int64_t>{1, 1, 1, 1}));
  EXPECT_EQ(p_one->max_live_, 2);
  EXPECT_EQ(one_stats.refills, 4);
}

// With many rows, refills wait until an eighth of them can start together (one prefill each), except for
// the last prompts; the trajectories are still those of one batch. Rejects one admit per freed row.
TEST_F(ReToolTest, RefillStartsPromptsInGroupsOfAnEighthOfTheRows) {
  std::vector<std::string> scripts;
  std::vector<std::vector<int64_t>> prompts;
  for (int i = 0; i < 24; ++i) {
    scripts.push_back(std::string(1 + i, 'a') + "\\boxed{1}");  // one finishes per pass
    prompts.push_back(enc("Q" + std::to_string(i)));
  }
  auto run = [&](int64_t max_batch, std::unique_ptr<ScriptedPolicy>& p, RolloutStats& stats) {
    p = policy(scripts);
    RolloutOptions o;
    o.max_batch = max_batch;
    return rollout(*p, *tok_, prompts, sampling(1), o, FakeTool().runner(), {}, {}, &stats);
  };
  std::unique_ptr<ScriptedPolicy> p_all, p_refill;
  RolloutStats all_stats, refill_stats;
  const auto all = run(0, p_all, all_stats), refill = run(16, p_refill, refill_stats);
  ASSERT_EQ(refill.size(), 24u);
  for (size_t i = 0; i < 24; ++i) EXPECT_EQ(all[i].response_ids, refill[i].response_ids) << i;
  EXPECT_EQ(refill_stats.refills, 8);
  ASSERT_FALSE(p_refill->admits_.empty());
  int64_t left = 8;  // prompts not yet admitted after the first 16
  for (int64_t a : p_refill->admits_) {
    EXPECT_GE(a, std::min<int64_t>(2, left)) << "an admit of " << a << " prompts with " << left << " left";
    left -= a;
  }
  EXPECT_EQ(left, 0);
  EXPECT_LT(p_refill->admits_.size(), 8u) << "one admit per freed row";
  EXPECT_LE(p_refill->max_live_, 16);
}

// A refill waits for an eighth of the rows only while other rows decode: with every other row waiting on
// a slow tool, a single freed row takes the next prompt at once (rejects a gate that ignores idleness).
TEST_F(ReToolTest, RefillDoesNotWaitWhenNothingElseDecodes) {
  std::vector<std::string> scripts(15, "<code>\nslow()\n</code>\\boxed{1}");  // prompts 0-14: a slow call
  scripts.push_back("some words here and then some more words \\boxed{2}");   // prompt 15: done after the calls
  for (int i = 16; i < 24; ++i) scripts.push_back("\\boxed{3}");
  std::vector<std::vector<int64_t>> prompts;
  for (int i = 0; i < 24; ++i) prompts.push_back(enc("Q" + std::to_string(i)));
  FakeTool tool;
  tool.outputs["\nslow()\n"] = "1\n";
  tool.delay_ms["\nslow()\n"] = 800;  // far beyond the passes before prompt 16 starts, even on a loaded machine
  auto p = policy(scripts);
  RolloutOptions o;
  o.max_batch = 16;
  RolloutStats stats;
  const auto trajs = rollout(*p, *tok_, prompts, sampling(1), o, tool.runner(), {}, {}, &stats);
  ASSERT_EQ(trajs.size(), 24u);
  for (size_t i = 0; i < 24; ++i) {
    check_consistent(trajs[i], *p, int64_t(i));
    EXPECT_EQ(trajs[i].finish, FinishReason::kAnswer) << i;
  }
  ASSERT_EQ(tool.returned.size(), 15u);
  const auto first_reply = *std::min_element(tool.returned.begin(), tool.returned.end());
  ASSERT_FALSE(p->feed_times_[16].empty());
  EXPECT_LT(p->feed_times_[16].front(), first_reply) << "prompt 16 waited for the tools although nothing decoded";
  ASSERT_FALSE(p->admits_.empty());
  EXPECT_EQ(p->admits_.front(), 1) << "one freed row, admitted alone";
  EXPECT_EQ(stats.refills, 8);
}

// rollout.feed_wait: with other rows decoding, a ready tool reply waits until an eighth of the live rows
// have one (here 2 of 16), or it has waited feed_wait decode steps. Replies are ready when the call returns
// (FakeTool::ready_runner) and the calls come a few steps apart, so the schedule is fixed. Checked for feed_wait 1000
// (no reply fed alone beside decoding rows while more than 8 live) and 2 (no reply waits more than 2 steps
// after the step that could have fed it, and some are fed alone by that bound); feed_wait 0 breaks the
// first rule, so the check can fail. The trajectories are the same for all three.
TEST_F(ReToolTest, ToolRepliesWaitToShareAFeed) {
  std::vector<std::string> scripts;
  FakeTool tool;
  for (int i = 0; i < 16; ++i) {
    std::string lead;
    for (int k = 0; k < 3 * i; ++k) lead += " w";  // the calls come a few steps apart
    const std::string code = "\nprint(" + std::to_string(i) + ")\n";
    scripts.push_back(lead + "<code>" + code + "</code> then more words and more words\\boxed{" + std::to_string(i) +
                      "}");
    tool.outputs[code] = std::to_string(i) + "\n";
  }
  std::map<int64_t, RolloutStats> stats_of;  // by feed_wait
  auto run = [&](int64_t wait, std::unique_ptr<ScriptedPolicy>& p) {
    p = policy(scripts);
    p->code_close = tok_->piece_id("</code>");
    RolloutOptions o;
    o.feed_wait = wait;
    o.merge_feeds = false;  // replies apart from the decode step, so that a feed's runs are replies only
    RolloutStats& stats = stats_of[wait];
    auto out = rollout(*p, *tok_, {enc("Q")}, sampling(16), o, tool.ready_runner(), {}, {}, &stats);
    EXPECT_EQ(stats.feed_steps, static_cast<int64_t>(p->feeds_.size()));
    int64_t replies = 0;
    for (const auto& f : p->feeds_) replies += f.runs;
    EXPECT_EQ(replies, 16) << "one reply per sequence";
    return out;
  };
  // Feeds of fewer replies than an eighth of the live rows while others decoded.
  auto early = [](const ScriptedPolicy& p) {
    int64_t n = 0;
    for (const auto& f : p.feeds_) n += 8 * f.runs < f.live && f.others_decoding > 0;
    return n;
  };
  std::unique_ptr<ScriptedPolicy> p_now, p_wait, p_two;
  const auto now = run(0, p_now), waited = run(1000, p_wait), two = run(2, p_two);
  ASSERT_EQ(waited.size(), 16u);
  for (size_t i = 0; i < 16; ++i) {
    check_consistent(waited[i], *p_wait, int64_t(i));
    EXPECT_EQ(waited[i].tool_calls, 1) << i;
    EXPECT_EQ(waited[i].finish, FinishReason::kAnswer) << i;
    EXPECT_EQ(now[i].response_ids, waited[i].response_ids) << i;
    EXPECT_EQ(now[i].loss_mask, waited[i].loss_mask) << i;
    EXPECT_EQ(two[i].response_ids, waited[i].response_ids) << i;
  }
  EXPECT_EQ(early(*p_wait), 0) << "a reply fed before an eighth of the live rows had one";
  EXPECT_GT(early(*p_now), 0) << "feed_wait 0 feeds each reply as it comes";
  EXPECT_LT(p_wait->feeds_.size(), p_now->feeds_.size());
  // feed_wait 2: the step of the pass that made the call, then at most 2 more.
  int64_t longest = 0;
  for (const auto& f : p_two->feeds_) longest = std::max(longest, f.steps_waited);
  EXPECT_EQ(longest, 3);
  EXPECT_GT(early(*p_two), 0) << "the calls come 3 steps apart: replies go alone after 2";
  for (const auto& f : p_now->feeds_) EXPECT_LE(f.steps_waited, 1);
  // The decode steps that sequences sat out holding a reply back: none when each is fed as it comes, at
  // most 2 a reply at feed_wait 2, and more than that when replies wait for an eighth of the rows.
  EXPECT_EQ(stats_of[0].feed_wait_row_steps, 0);
  EXPECT_GT(stats_of[2].feed_wait_row_steps, 0);
  EXPECT_LE(stats_of[2].feed_wait_row_steps, 2 * 16);
  EXPECT_GT(stats_of[1000].feed_wait_row_steps, stats_of[2].feed_wait_row_steps);
  for (const auto& [wait, st] : stats_of) EXPECT_EQ(st.tool_wait_row_steps, 0) << "replies are ready at once";
}

TEST_F(ReToolTest, RewardsFromModelTextOnly) {
  // The interpreter prints the right answer in a box, the model answers wrongly: reward from the model's text.
  auto p = policy({"<code>\nx()\n</code>Answer: \\boxed{5}", "Answer: \\boxed{42}"});
  FakeTool tool;
  tool.outputs["\nx()\n"] = "\\boxed{42}\n";
  auto ts = rollout(*p, *tok_, {enc("Q")}, sampling(2), RolloutOptions{}, tool.runner());
  RewardOptions r;
  r.kind = RewardKind::kBoxed;
  assign_rewards(ts, {"42"}, r);
  EXPECT_FALSE(ts[0].correct);
  EXPECT_EQ(ts[0].reward, -1.0);
  EXPECT_TRUE(ts[1].correct);
  EXPECT_EQ(ts[1].reward, 1.0);
}

// ---- Rollouts of a tiny model ----

// Two trajectories' largest log-prob difference; 1e30 when their tokens differ.
double logprob_gap(const Trajectory& x, const Trajectory& y) {
  if (x.response_ids != y.response_ids) return 1e30;
  double d = 0;
  for (size_t k = 0; k < x.logprobs.size(); ++k) d = std::max(d, double(std::abs(x.logprobs[k] - y.logprobs[k])));
  return d;
}

// A tiny model's rollout policy steered to `prefixes`: prompt i (in the order started) is forced to write
// prefixes[i % prefixes.size()] first (a random model cannot write code, so its first turn opens with a
// code block; what it samples after is its own). multi_token: a tool's reply enters in one forward, else
// one token per step.
SteerOptions steer_to(std::vector<std::vector<int64_t>> prefixes, bool multi_token) {
  SteerOptions s;
  s.scripts = std::move(prefixes);
  s.multi_token = multi_token;
  return s;
}

TEST_F(ReToolTest, TinyModelMultiTurnRolloutWithTheRealSandbox) {
  // Real sandboxed calls inside a model rollout (steered: its first turn is one code block), reproducible
  // under a seed, and loss masks that match the tool turns.
  const Transformer m = tiny_model("llama", 5);
  SandboxOptions so;
  so.timeout_s = 5;
  SandboxPool pool(so);
  ToolRunner tools = [&pool](const std::string& code) { return pool.submit(code); };
  const auto prefix = enc("<code>\nprint(347 * 829)\n</code>");
  auto run = [&](int64_t seed) {
    SteeredPolicy policy(m, steer_to({prefix}, /*multi_token=*/true));
    SamplingOptions s = sampling(3);
    s.seed = seed;
    s.max_new_tokens = 24;
    RolloutOptions o;
    o.max_context = 120;
    return rollout(policy, *tok_, {enc("Q: 347 * 829?"), enc("Q: again")}, s, o, tools);
  };
  const auto a = run(1), b = run(1), c = run(2);
  ASSERT_EQ(a.size(), 6u);
  bool differs = false;
  for (size_t i = 0; i < a.size(); ++i) {
    const Trajectory& t = a[i];
    EXPECT_EQ(t.response_ids, b[i].response_ids) << "same seed, same trajectory";
    EXPECT_EQ(t.loss_mask, b[i].loss_mask);
    differs |= t.response_ids != c[i].response_ids;
    ASSERT_GE(t.tool_calls, 1);
    // The first tool turn is the real interpreter's output, masked out of the loss.
    const std::string tool_text = masked_text(t, 0);
    EXPECT_EQ(tool_text.rfind("<interpreter>\n287663\n</interpreter>\n", 0), 0u) << tool_text;
    EXPECT_LE(int64_t(t.ids().size()), 120);
    for (size_t k = 0; k < t.response_ids.size(); ++k) {
      if (t.loss_mask[k]) {
        EXPECT_LE(t.logprobs[k], 0.0f);
      } else {
        EXPECT_EQ(t.logprobs[k], 0.0f);
      }
    }
  }
  EXPECT_TRUE(differs) << "another seed, other samples";
}

TEST_F(ReToolTest, ToolRepliesFedInOneForwardGiveTheOneTokenTrajectories) {
  // The same rollout twice: tool replies fed one token per decode step, and in one multi-token forward.
  // float64, so the two differ only by rounding: the same tokens, log-probs within 1e-6 (they are stored
  // as float). A feed that loses each run's first token (the call's close tag) must fail the same check.
  const Transformer m = tiny_model("llama", 7);
  FakeTool tool;
  tool.outputs["\nprint(347 * 829)\n"] = "287663\n";
  const auto prefix = enc("<code>\nprint(347 * 829)\n</code>");
  auto run = [&](bool multi, bool drop_first, RolloutStats* stats) {
    SteerOptions so = steer_to({prefix}, multi);
    so.drop_first = drop_first;
    SteeredPolicy policy(m, so);
    SamplingOptions s = sampling(3);
    s.seed = 4;
    s.max_new_tokens = 24;
    RolloutOptions o;
    o.max_context = 120;
    auto out = rollout(policy, *tok_, {enc("Q: 347 * 829?"), enc("Q: again")}, s, o, tool.runner(), {}, {}, stats);
    if (multi) {
      EXPECT_GT(policy.extends(), 0);
    }
    return out;
  };
  RolloutStats one_stats, multi_stats;
  const auto one = run(false, false, &one_stats), multi = run(true, false, &multi_stats),
             bad = run(true, true, nullptr);
  ASSERT_EQ(one.size(), 6u);
  ASSERT_EQ(multi.size(), 6u);
  double worst_bad = 0;
  for (size_t i = 0; i < one.size(); ++i) {
    ASSERT_GE(one[i].tool_calls, 1);
    EXPECT_EQ(one[i].loss_mask, multi[i].loss_mask);
    EXPECT_LT(logprob_gap(one[i], multi[i]), 1e-6) << "trajectory " << i;
    worst_bad = std::max(worst_bad, logprob_gap(one[i], bad[i]));
  }
  EXPECT_GT(worst_bad, 1e-3) << "a feed that drops a token must change the trajectories";
  // Every forced token went in a multi-token forward, and the decode steps fell by as many tokens.
  EXPECT_GT(multi_stats.forced_tokens, 0);
  EXPECT_EQ(multi_stats.forced_tokens, one_stats.forced_tokens);
  EXPECT_GE(multi_stats.feed_tokens, multi_stats.forced_tokens);
}

TEST_F(ReToolTest, MergedFeedsGiveTheTrajectoriesOfSeparateSteps) {
  // rollout.merge_feeds: a pass that feeds a tool's reply takes the rows decoding beside it in the same
  // forward, as runs of one token. Prompts steered to an immediate call alternate with prompts that write
  // a sentence first, so replies arrive while those rows decode. float64: the same tokens and log-probs
  // within 1e-6 as a step and a feed apart. A merge that feeds those rows another token must fail it.
  // Replies are ready when the call returns (FakeTool::ready_runner): the schedule does not depend on threads.
  const Transformer m = tiny_model("llama", 11);
  FakeTool fake;
  fake.outputs = kTwoCallOutputs;
  const ToolRunner tool = fake.ready_runner();
  const std::vector<std::vector<int64_t>> prefixes = two_call_scripts();
  const std::vector<std::vector<int64_t>> prompts = numbered_prompts(4);
  auto run = [&](bool merge, bool corrupt, RolloutStats& stats, int64_t& mixed) {
    SteerOptions so = steer_to(prefixes, /*multi_token=*/true);
    so.corrupt_single = corrupt;
    SteeredPolicy policy(m, so);
    SamplingOptions s = sampling(2);
    s.seed = 5;
    s.max_new_tokens = 100;
    RolloutOptions o;
    o.max_context = 240;
    o.merge_feeds = merge;
    auto out = rollout(policy, *tok_, prompts, s, o, tool, {}, {}, &stats);
    mixed = policy.mixed_extends();
    return out;
  };
  RolloutStats apart_stats, merged_stats, bad_stats;
  int64_t apart_mixed = 0, merged_mixed = 0, bad_mixed = 0;
  const auto apart = run(false, false, apart_stats, apart_mixed);
  const auto merged = run(true, false, merged_stats, merged_mixed);
  const auto bad = run(true, true, bad_stats, bad_mixed);
  EXPECT_EQ(apart_mixed, 0);
  ASSERT_GT(merged_mixed, 0) << "no reply arrived while other rows decoded";
  EXPECT_GT(bad_mixed, 0);
  ASSERT_EQ(merged.size(), 8u);
  double worst_bad = 0;
  for (size_t i = 0; i < merged.size(); ++i) {
    ASSERT_GE(apart[i].tool_calls, 1) << i;
    EXPECT_EQ(apart[i].loss_mask, merged[i].loss_mask) << i;
    EXPECT_EQ(apart[i].turns, merged[i].turns) << i;
    EXPECT_LT(logprob_gap(apart[i], merged[i]), 1e-6) << "trajectory " << i;
    worst_bad = std::max(worst_bad, logprob_gap(apart[i], bad[i]));
  }
  EXPECT_GT(worst_bad, 1e-3) << "a merge that feeds the decoding rows another token must change the trajectories";
  // As many tokens fed, some of the one-token rows' in the feeds (how many passes each run took depends on
  // when the tools returned).
  EXPECT_EQ(merged_stats.fed_rows + merged_stats.feed_tokens, apart_stats.fed_rows + apart_stats.feed_tokens);
  EXPECT_LT(merged_stats.fed_rows, apart_stats.fed_rows);
}

TEST_F(ReToolTest, RefillOfATinyModelGivesTheTrajectoriesOfOneBatch) {
  // Six prompts x G = 2 on a float64 model, steered in turn to a slow tool call, an immediate answer, and a
  // fast tool call: with rollout.max_batch = 4 (and 5, and 1, below G) the answering prompts' rows are
  // refilled while other rows wait on their tools or take their replies. Same trajectories as one batch:
  // tokens, loss masks, finish reasons, turns and tool calls; log-probs within float32 storage (the
  // logits differ by rounding only, ~1e-13). The cache never holds more rows than max_batch.
  const Transformer m = tiny_model("llama", 9);
  FakeTool tool;
  tool.outputs["\nprint(347 * 829)\n"] = "287663\n";
  tool.delay_ms["\nprint(347 * 829)\n"] = 60;
  tool.outputs["\nprint(1)\n"] = "1\n";
  const std::vector<std::vector<int64_t>> prefixes = {
      enc("<code>\nprint(347 * 829)\n</code>"), enc("Answer: \\boxed{7}"), enc("Let me see.<code>\nprint(1)\n</code>")};
  std::vector<std::vector<int64_t>> prompts;
  for (int i = 0; i < 6; ++i) prompts.push_back(enc("Q: " + std::to_string(100 + 7 * i) + " ?"));
  struct Run {
    std::vector<Trajectory> trajs;
    RolloutStats stats;
    int64_t max_rows = 0;
    bool fed_around_an_admit = false;
  };
  auto run = [&](int64_t max_batch) {
    SteeredPolicy policy(m, steer_to(prefixes, /*multi_token=*/true));
    SamplingOptions s = sampling(2);
    s.seed = 3;
    s.max_new_tokens = 40;
    RolloutOptions o;
    o.max_context = 120;
    o.max_batch = max_batch;
    Run r;
    r.trajs = rollout(policy, *tok_, prompts, s, o, tool.runner(), {}, {}, &r.stats);
    r.max_rows = policy.max_cache_rows();
    r.fed_around_an_admit = policy.fed_around_an_admit();
    return r;
  };
  const Run all = run(0);
  ASSERT_EQ(all.trajs.size(), 12u);
  EXPECT_EQ(all.stats.refills, 0);
  EXPECT_EQ(all.max_rows, 12);
  int64_t calls = 0;
  for (const auto& t : all.trajs) calls += t.tool_calls;
  EXPECT_GE(calls, 8) << "prompts 0, 2, 3, 5 call a tool";
  for (int64_t max_batch : {4, 5, 1}) {
    SCOPED_TRACE("max_batch " + std::to_string(max_batch));
    const Run r = run(max_batch);
    ASSERT_EQ(r.trajs.size(), 12u);
    for (size_t i = 0; i < 12; ++i) {
      const Trajectory &a = all.trajs[i], &b = r.trajs[i];
      EXPECT_EQ(b.prompt_index, int64_t(i / 2));
      EXPECT_EQ(b.sample_index, int64_t(i % 2));
      EXPECT_EQ(a.response_ids, b.response_ids) << i;
      EXPECT_EQ(a.loss_mask, b.loss_mask) << i;
      EXPECT_EQ(a.finish, b.finish) << i;
      EXPECT_EQ(a.turns, b.turns) << i;
      EXPECT_EQ(a.tool_calls, b.tool_calls) << i;
      ASSERT_EQ(a.logprobs.size(), b.logprobs.size());
      for (size_t k = 0; k < a.logprobs.size(); ++k) {
        EXPECT_NEAR(a.logprobs[k], b.logprobs[k], 1e-6) << i << " token " << k;
      }
    }
    // Whole prompts start first (max_batch / G of them, at least one); every other one is a refill.
    EXPECT_EQ(r.stats.refills, 6 - std::max<int64_t>(1, max_batch / 2));
    EXPECT_LE(r.max_rows, std::max<int64_t>(max_batch, 2)) << "released rows are reused, not added";
    EXPECT_EQ(r.stats.forced_tokens, all.stats.forced_tokens);
    if (max_batch == 4) {
      EXPECT_TRUE(r.fed_around_an_admit) << "a tool's reply fed to an older row after a refill";
    }
  }
}

// ---- Partial rollouts (rollout.partial) ----

// A tiny float64 model's rollout without tools, whose lengths vary: 40 of the 400 ids end a trajectory.
class PartialRolloutTest : public ReToolTest {
 protected:
  SamplingOptions partial_sampling() const {
    SamplingOptions s = sampling(2);
    s.seed = 6;
    s.max_new_tokens = 24;
    return s;
  }
  RolloutOptions partial_options() const {
    RolloutOptions o;
    o.tools = false;
    o.max_context = 120;
    o.progress_s = 0;
    for (int64_t id = 100; id < 140; ++id) o.stop_ids.push_back(id);
    return o;
  }
  std::vector<std::vector<int64_t>> prompts(int64_t first, int64_t n) const {
    std::vector<std::vector<int64_t>> out;
    for (int64_t i = first; i < first + n; ++i) out.push_back(enc("Q: " + std::to_string(100 + 7 * i) + " ?"));
    return out;
  }
  static std::vector<int64_t> streams(int64_t first, int64_t n) {
    std::vector<int64_t> out(n);
    for (int64_t i = 0; i < n; ++i) out[i] = first + i;
    return out;
  }
  // With `drafts`, a speculative rollout drafting from it (rollout.speculative: suffix).
  std::vector<Trajectory> go(const Transformer& m, RolloutCarry* carry, int64_t first, int64_t n,
                             RolloutStats* stats = nullptr, int64_t max_staleness = 2,
                             std::shared_ptr<DraftHistory> drafts = nullptr) const {
    DecodeEngine policy(m);
    RolloutOptions o = partial_options();
    o.max_staleness = max_staleness;
    if (drafts) {
      o.speculative = Speculative::kSuffix;
      o.draft_history = std::move(drafts);
    }
    return rollout(policy, *tok_, prompts(first, n), partial_sampling(), o, {}, streams(first, n), {}, stats, carry);
  }
  // Sampled token k's log-prob under m, from a full forward over the tokens before it (float64).
  static double reference_logprob(const Transformer& m, const Trajectory& t, size_t k) {
    at::NoGradGuard no_grad;
    std::vector<int64_t> ids = t.prompt_ids;
    ids.insert(ids.end(), t.response_ids.begin(), t.response_ids.begin() + static_cast<int64_t>(k));
    const int64_t L = static_cast<int64_t>(ids.size());
    at::Tensor h =
        m.forward(at::tensor(ids, at::kLong).view({1, L}), at::arange(L, at::kLong).view({1, L}), at::Tensor());
    return at::log_softmax(m.logits(h.select(1, L - 1))[0], -1)[t.response_ids[k]].item<double>();
  }
};

TEST_F(PartialRolloutTest, ACutRolloutContinuedUnderTheSameWeightsIsTheUncutRollout) {
  // Six prompts x 2 on one model: a rollout returning the first 2 complete groups, then one continuing the
  // other 4 (re-prefilled from their tokens), give every trajectory of one uncut rollout: tokens, masks,
  // finish reasons, log-probs within float32 storage. A carry whose cut trajectories re-enter the cache with
  // another first token must change what they sample after it.
  const Transformer m = tiny_model("llama", 21);
  const std::vector<Trajectory> uncut = go(m, nullptr, 0, 6);
  ASSERT_EQ(uncut.size(), 12u);
  auto continued = [&](bool corrupt) {
    RolloutCarry c;
    c.groups = 2;
    RolloutStats first, second;
    std::vector<Trajectory> a = go(m, &c, 0, 6, &first);
    EXPECT_EQ(a.size(), 4u);
    EXPECT_EQ(c.carry.size(), 4u);
    EXPECT_GT(first.cut, 0) << "no trajectory was unfinished at the cut";
    int64_t unfinished = 0;  // RolloutStats::cut: the begun, unfinished trajectories left in the carry
    for (const CarriedGroup& g : c.carry) {
      for (size_t i = 0; i < g.trajs.size(); ++i) unfinished += g.started[i] && !g.done[i];
    }
    EXPECT_EQ(first.cut, unfinished);
    std::map<int64_t, std::vector<Trajectory>> by_key;
    for (size_t q = 0; q < c.keys.size(); ++q) {
      by_key[c.keys[q]] = {a[2 * q], a[2 * q + 1]};
      EXPECT_EQ(a[2 * q].prompt_index, static_cast<int64_t>(q));
    }
    for (size_t q = 1; q < c.keys.size(); ++q) EXPECT_LT(c.keys[q - 1], c.keys[q]) << "complete groups in order";
    if (corrupt) {  // each cut trajectory re-enters its cache with another first response token
      for (CarriedGroup& g : c.carry) {
        for (size_t i = 0; i < g.trajs.size(); ++i) {
          Trajectory& t = g.trajs[i];
          if (g.started[i] && !g.done[i] && !t.response_ids.empty()) t.response_ids[0] = (t.response_ids[0] + 1) % 100;
        }
      }
    }
    c.groups = 4;
    std::vector<Trajectory> b = go(m, &c, 6, 0, &second);
    EXPECT_EQ(second.resumed, first.cut);
    EXPECT_EQ(second.cut, 0);
    EXPECT_TRUE(c.carry.empty());
    for (size_t q = 0; q < c.keys.size(); ++q) by_key[c.keys[q]] = {b[2 * q], b[2 * q + 1]};
    return by_key;
  };
  const auto good = continued(false), bad = continued(true);
  ASSERT_EQ(good.size(), 6u);
  ASSERT_EQ(bad.size(), 6u);
  double worst_bad = 0;
  bool bad_tokens = false;
  for (int64_t key = 0; key < 6; ++key) {
    for (int64_t g = 0; g < 2; ++g) {
      const Trajectory &u = uncut[2 * key + g], &t = good.at(key)[g], &w = bad.at(key)[g];
      EXPECT_EQ(t.sample_index, g);
      EXPECT_EQ(t.response_ids, u.response_ids) << key << "/" << g;
      EXPECT_EQ(t.loss_mask, u.loss_mask);
      EXPECT_EQ(t.finish, u.finish);
      EXPECT_EQ(t.response_text, u.response_text);
      EXPECT_EQ(t.versions, std::vector<int64_t>(t.response_ids.size(), 0));
      ASSERT_EQ(t.logprobs.size(), u.logprobs.size());
      for (size_t k = 0; k < t.logprobs.size(); ++k) EXPECT_NEAR(t.logprobs[k], u.logprobs[k], 1e-6) << key;
      // What the corrupted carry sampled after its first token.
      const std::vector<int64_t> w_after(w.response_ids.begin() + (w.response_ids.empty() ? 0 : 1),
                                         w.response_ids.end());
      const std::vector<int64_t> u_after(u.response_ids.begin() + (u.response_ids.empty() ? 0 : 1),
                                         u.response_ids.end());
      bad_tokens |= w_after != u_after;
      for (size_t k = 1; w_after == u_after && k < w.logprobs.size(); ++k) {
        worst_bad = std::max(worst_bad, double(std::abs(w.logprobs[k] - u.logprobs[k])));
      }
    }
  }
  EXPECT_TRUE(bad_tokens || worst_bad > 1e-3) << "a carry whose context is wrong must change the continued tokens";
}

TEST_F(PartialRolloutTest, ASpeculativeCutRolloutContinuedIsThePlainUncutRollout) {
  // rollout.partial with speculation: six prompts x 2, a speculative rollout returning the first 2 complete
  // groups, then one continuing the other 4 (their carried text indexed whole, drafts also from the first
  // rollout's responses), give plain decoding's uncut trajectories (float64: tokens, finish reasons,
  // log-probs within float32 storage).
  const Transformer m = tiny_model("llama", 21);
  const std::vector<Trajectory> uncut = go(m, nullptr, 0, 6);
  auto drafts = std::make_shared<DraftHistory>(100000);
  go(m, nullptr, 0, 6, nullptr, 2, drafts);  // the prompts' earlier rollout
  RolloutCarry c;
  c.groups = 2;
  RolloutStats first, second;
  const std::vector<Trajectory> a = go(m, &c, 0, 6, &first, 2, drafts);
  ASSERT_GT(first.cut, 0);
  std::map<int64_t, std::vector<Trajectory>> by_key;
  for (size_t q = 0; q < c.keys.size(); ++q) by_key[c.keys[q]] = {a[2 * q], a[2 * q + 1]};
  c.groups = 4;
  const std::vector<Trajectory> b = go(m, &c, 6, 0, &second, 2, drafts);
  for (size_t q = 0; q < c.keys.size(); ++q) by_key[c.keys[q]] = {b[2 * q], b[2 * q + 1]};
  ASSERT_EQ(by_key.size(), 6u);
  for (int64_t key = 0; key < 6; ++key) {
    for (int64_t g = 0; g < 2; ++g) {
      const Trajectory &u = uncut[2 * key + g], &t = by_key.at(key)[g];
      EXPECT_LT(logprob_gap(u, t), 1e-6) << "prompt " << key << " sample " << g;
      EXPECT_EQ(u.finish, t.finish);
    }
  }
  EXPECT_GT(first.accepted_tokens + second.accepted_tokens, 0) << "no draft was taken";
  EXPECT_GT(second.verify_passes, 0) << "the continued rollout never speculated";
}

TEST_F(PartialRolloutTest, ContinuedTrajectoriesCarryTheLogprobsOfTheWeightsThatSampledEachToken) {
  // Rollout A (version 0, model m0) returns 3 of 6 groups; rollout B (version 1, m1) continues the other 3
  // and returns 1 group. Every sampled token's log-prob is, within float32 storage, that of the full float64
  // forward of the weights its version names; the trajectories that span both versions fail the same check
  // against their first version's weights alone. max_staleness 2: B finishes every trajectory begun at
  // version 0 (continuing it at version 2 would span 3), so B's carry holds only version-1 trajectories,
  // while with max_staleness 3 it carries a version-0 one.
  const Transformer m0 = tiny_model("llama", 21), m1 = tiny_model("llama", 22);
  RolloutCarry c;
  c.groups = 3;
  c.version = 0;
  RolloutStats stats;
  const std::vector<Trajectory> a = go(m0, &c, 0, 6, &stats);
  ASSERT_EQ(a.size(), 6u);
  ASSERT_GT(stats.cut, 0);
  const std::vector<CarriedGroup> after_a = c.carry;
  c.groups = 1;
  c.version = 1;
  const std::vector<Trajectory> b = go(m1, &c, 6, 3);
  ASSERT_EQ(b.size(), 2u);
  for (const CarriedGroup& g : c.carry) {
    for (size_t i = 0; i < g.trajs.size(); ++i) {
      if (g.started[i] && !g.done[i]) EXPECT_EQ(g.trajs[i].weights_version, 1) << "a version-0 trajectory was cut";
    }
  }
  // Every trajectory finished so far: A's, B's returned and B's carried finished ones.
  std::vector<Trajectory> finished(a.begin(), a.end());
  finished.insert(finished.end(), b.begin(), b.end());
  for (const CarriedGroup& g : c.carry) {
    for (size_t i = 0; i < g.trajs.size(); ++i) {
      if (g.done[i]) finished.push_back(g.trajs[i]);
    }
  }
  int64_t spanning = 0;
  double worst_first_version = 0;
  for (const Trajectory& t : finished) {
    ASSERT_EQ(t.versions.size(), t.response_ids.size());
    const int64_t lo = *std::min_element(t.versions.begin(), t.versions.end());
    const int64_t hi = *std::max_element(t.versions.begin(), t.versions.end());
    EXPECT_EQ(lo, t.weights_version);
    EXPECT_LE(hi - lo + 1, 2) << "a trajectory spans more than max_staleness versions";
    spanning += hi > lo;
    for (size_t k = 0; k < t.response_ids.size(); ++k) {
      if (!t.loss_mask[k]) continue;
      const double want = reference_logprob(t.versions[k] == 0 ? m0 : m1, t, k);
      EXPECT_NEAR(t.logprobs[k], want, 1e-5) << "token " << k << " of version " << t.versions[k];
      if (hi > lo) {
        worst_first_version = std::max(
            worst_first_version, std::abs(t.logprobs[k] - reference_logprob(t.weights_version == 0 ? m0 : m1, t, k)));
      }
    }
  }
  EXPECT_GT(spanning, 0) << "no trajectory was continued under the newer weights";
  EXPECT_GT(worst_first_version, 1e-2) << "the check must reject the first version's weights for every token";

  // max_staleness 3: B may cut a trajectory begun at version 0.
  RolloutCarry loose;
  loose.carry = after_a;
  loose.groups = 1;
  loose.version = 1;
  go(m1, &loose, 6, 3, nullptr, /*max_staleness=*/3);
  bool old_cut = false;
  for (const CarriedGroup& g : loose.carry) {
    for (size_t i = 0; i < g.trajs.size(); ++i)
      old_cut |= g.started[i] && !g.done[i] && g.trajs[i].weights_version == 0;
  }
  EXPECT_TRUE(old_cut) << "with max_staleness 3 a version-0 trajectory is left for version 2";
}

// ---- Speculative rollouts (rollout.speculative) ----

TEST(SuffixDrafter, DraftsContinueTheLongestEarlierMatchOfTheGroup) {
  SuffixDrafter d;
  const std::vector<uint8_t> all(8, 1);
  d.add(0, {5, 1, 2, 3, 10, 11}, std::vector<uint8_t>(6, 1));
  d.add(0, {6, 2, 3, 20, 21}, std::vector<uint8_t>(5, 1));
  d.add(1, {2, 3, 99, 98}, std::vector<uint8_t>(4, 1));  // another group: never a source for group 0
  const int64_t q = d.add(0, {1, 2, 3}, std::vector<uint8_t>(3, 0));
  EXPECT_EQ(d.draft(q, 4), (std::vector<int64_t>{10, 11})) << "the 3-gram's continuation, not the later 2-gram's";
  EXPECT_EQ(d.last_match(), 3);
  const int64_t r = d.add(0, {9, 2, 3}, std::vector<uint8_t>(3, 1));
  EXPECT_EQ(d.draft(r, 4), (std::vector<int64_t>{20, 21})) << "the latest occurrence of the 2-gram";
  EXPECT_EQ(d.draft(r, 1), (std::vector<int64_t>{20}));
  d.append(r, 7, true);  // "3 7" occurred nowhere before
  EXPECT_TRUE(d.draft(r, 4).empty());
  EXPECT_EQ(d.last_match(), 0);
  // Its own text: a repeat continues into itself.
  const int64_t own = d.add(2, {4, 5, 6, 4, 5}, std::vector<uint8_t>(5, 1));
  EXPECT_EQ(d.draft(own, 8), (std::vector<int64_t>{6, 4, 5}));
  // A continuation stops where the model's text gives way to a reply, never at a reply's own end.
  d.add(3, {1, 2, 3, 4, 5, 6, 7}, {1, 1, 1, 0, 0, 1, 1});
  const int64_t a = d.add(3, {8, 2, 3}, {1, 1, 1});
  EXPECT_TRUE(d.draft(a, 4).empty()) << "3 was followed by a reply's first token";
  const int64_t b = d.add(3, {8, 1, 2}, {1, 1, 1});
  EXPECT_EQ(d.draft(b, 4), (std::vector<int64_t>{3}));
  const int64_t c = d.add(3, {8, 3, 4}, {1, 1, 1});
  EXPECT_EQ(d.draft(c, 4), (std::vector<int64_t>{5, 6, 7})) << "from inside a reply into the next turn";
}

// Text is indexed when a draft is next asked for, in the order it arrived: the drafts are those of an index
// kept up to date token by token, and a drafter never asked for one indexes nothing. Two texts of a group
// get their tokens in turn; B's pair (1, 2) is followed first (60), then A's (50), so A's is the latest
// place of equal match and Q's draft is 50. Twin: indexing text by text, which puts B's last (60).
TEST(SuffixDrafter, IndexesTextInTheOrderItArrivedWhenADraftIsAskedFor) {
  auto grow = [](SuffixDrafter& d, bool draft_each_token) {
    const int64_t a = d.add(0, {9}, {1}), b = d.add(0, {8}, {1});
    const std::vector<std::pair<int64_t, int64_t>> arrivals = {{a, 1}, {b, 1}, {a, 2}, {b, 2}, {b, 60}, {a, 50}};
    for (const auto& [text, id] : arrivals) {
      d.append(text, id, true);
      if (draft_each_token) d.draft(text, 4);
    }
    return d.add(0, {7, 1, 2}, {1, 1, 1});
  };
  SuffixDrafter deferred, eager;
  const int64_t q = grow(deferred, false);
  EXPECT_EQ(deferred.unindexed(), 2 + 2 + 1) << "A's two pairs followed by a token, B's two, Q's one";
  EXPECT_EQ(deferred.draft(q, 4), (std::vector<int64_t>{50}));
  EXPECT_EQ(deferred.unindexed(), 0);
  EXPECT_EQ(eager.draft(grow(eager, true), 4), (std::vector<int64_t>{50})) << "kept up to date token by token";
  SuffixDrafter text_by_text;
  text_by_text.add(0, {9, 1, 2, 50}, {1, 1, 1, 1});
  text_by_text.add(0, {8, 1, 2, 60}, {1, 1, 1, 1});
  EXPECT_EQ(text_by_text.draft(text_by_text.add(0, {7, 1, 2}, {1, 1, 1}), 4), (std::vector<int64_t>{60}))
      << "twin: text by text";
}

TEST(DraftHistory, KeepsTheLatestRolloutOfEachPromptWithinItsTokens) {
  DraftHistory h(25);
  auto text = [](int64_t n, int64_t v) {
    return DraftHistory::Text{std::vector<int64_t>(n, v), std::vector<uint8_t>(n, 1)};
  };
  h.remember({1}, {text(10, 1)});
  h.remember({2}, {text(5, 2), text(5, 2)});
  EXPECT_EQ(h.tokens(), 20);
  h.remember({1}, {text(4, 3)});  // replaces prompt 1's, which becomes the newest
  EXPECT_EQ(h.tokens(), 14);
  ASSERT_NE(h.recall({1}), nullptr);
  EXPECT_EQ(h.recall({1})->at(0).ids[0], 3);
  h.remember({3}, {text(12, 4)});  // 26 > 25: the oldest (prompt 2) goes
  EXPECT_EQ(h.recall({2}), nullptr);
  EXPECT_NE(h.recall({1}), nullptr);
  EXPECT_EQ(h.tokens(), 16);
  h.remember({4}, {text(30, 5)});  // larger than the whole history: not kept, nothing evicted
  EXPECT_EQ(h.recall({4}), nullptr);
  EXPECT_EQ(h.tokens(), 16);
}

// A speculative rollout of a tiny float64 model without tools, against plain decoding of the same prompts.
class SpeculativeRolloutTest : public ReToolTest {
 protected:
  // The rollouts' settings: 4 samples a prompt of at most 48 tokens, top-p 0.9 where sampled; tools off,
  // ids 100-103 stop a trajectory.
  static SamplingOptions plain_sampling(int64_t seed, double temperature) {
    SamplingOptions s = sampling(4);
    s.seed = seed;
    s.temperature = temperature;
    s.top_p = temperature > 0 ? 0.9 : 1.0;
    s.max_new_tokens = 48;
    return s;
  }
  static RolloutOptions plain_options() {
    RolloutOptions o;
    o.tools = false;
    o.max_context = 160;
    o.progress_s = 0;
    for (int64_t id = 100; id < 104; ++id) o.stop_ids.push_back(id);
    return o;
  }
  std::vector<Trajectory> go(const Transformer& m, double temperature, int64_t seed, bool speculate,
                             RolloutStats* stats, std::shared_ptr<DraftHistory> history = nullptr,
                             SpeculationFault fault = SpeculationFault::kNone) const {
    DecodeEngine policy(m);
    const SamplingOptions s = plain_sampling(seed, temperature);
    RolloutOptions o = plain_options();
    if (speculate) {
      o.speculative = Speculative::kSuffix;
      o.draft_tokens = 4;
      o.speculation_fault = fault;
      o.draft_history = std::move(history);
    }
    return rollout(policy, *tok_, numbered_prompts(4), s, o, {}, {}, {}, stats);
  }
};

// The largest log-prob difference over a set of trajectories (1e30 where tokens differ).
double worst_gap(const std::vector<Trajectory>& x, const std::vector<Trajectory>& y) {
  EXPECT_EQ(x.size(), y.size());
  double d = 0;
  for (size_t i = 0; i < std::min(x.size(), y.size()); ++i) d = std::max(d, logprob_gap(x[i], y[i]));
  return d;
}

TEST_F(SpeculativeRolloutTest, SamplesThePlainRolloutsTokens) {
  // float64: a verifying forward's logits equal a decode step's up to rounding, so a speculative rollout
  // samples every token plain decoding samples, at temperature 1 with top-p 0.9 and greedy, with log-probs
  // equal within float storage. A first rollout (seed 8) drafts from its groups' texts; a second (seed 9)
  // also from the first's responses of the same prompts, which it partly repeats: some drafts are taken
  // whole, others cut short.
  const Transformer m = tiny_model("llama", 31);
  for (const double temperature : {1.0, 0.0}) {
    SCOPED_TRACE("temperature " + std::to_string(temperature));
    RolloutStats plain_stats, first_stats, stats;
    auto history = std::make_shared<DraftHistory>(100000);
    EXPECT_LT(worst_gap(go(m, temperature, 8, false, nullptr), go(m, temperature, 8, true, &first_stats, history)),
              1e-6);
    EXPECT_EQ(history->prompts(), 4);
    const auto plain = go(m, temperature, 9, false, &plain_stats);
    const auto spec = go(m, temperature, 9, true, &stats, std::make_shared<DraftHistory>(*history));
    EXPECT_LT(worst_gap(plain, spec), 1e-6);
    for (size_t i = 0; i < plain.size(); ++i) EXPECT_EQ(plain[i].finish, spec[i].finish) << i;
    EXPECT_GT(stats.verify_passes, 0);
    EXPECT_GT(stats.accepted_tokens, 0) << "no draft was taken";
    // Greedy, the second rollout repeats the first, which it drafts from: every draft is taken.
    if (temperature > 0) {
      EXPECT_LT(stats.accepted_tokens, stats.drafted_tokens) << "no draft was cut short";
    }
    EXPECT_GT(stats.verify_sampled, stats.verify_sampling_rows)
        << "a verifying forward yields more than one token a row";
    // Every sampled token came from a decode step, a verifying forward or a prompt's first logits (16).
    int64_t sampled = 0;
    for (const Trajectory& t : plain) sampled += t.sampled_tokens();
    EXPECT_EQ(plain_stats.fed_rows + 16, sampled);
    EXPECT_EQ(stats.fed_rows + stats.verify_sampled + 16, sampled);
    std::cout << "temperature " << temperature << ": plain " << plain_stats.decode_steps << " steps; first "
              << first_stats.decode_steps << " + " << first_stats.verify_passes << " verifying, "
              << first_stats.accepted_tokens << " of " << first_stats.drafted_tokens << " drafted taken; second "
              << stats.decode_steps << " + " << stats.verify_passes << ", " << stats.accepted_tokens << " of "
              << stats.drafted_tokens << "\n";
    // Wrong verifications change the trajectories.
    if (temperature == 0) continue;
    for (const SpeculationFault f : {SpeculationFault::kWholeDraft, SpeculationFault::kOffByOne,
                                     SpeculationFault::kStepNoise, SpeculationFault::kVisibleRejects}) {
      EXPECT_GT(worst_gap(plain, go(m, temperature, 9, true, nullptr, std::make_shared<DraftHistory>(*history), f)),
                1e-3)
          << "fault " << int(f);
    }
  }
}

// The rollout's engine behind a policy that passes every call on; with `own_keys`, step_draw passes the
// step's own keys as the next step's (the wrong twin of a loop that does not move the counters on).
class PassedOn : public TokenPolicy {
 public:
  PassedOn(DecodeEngine& e, bool own_keys) : e_(e), own_keys_(own_keys) {}
  at::Tensor start(const std::vector<std::vector<int64_t>>& prompts, int64_t repeats) override {
    return e_.start(prompts, repeats);
  }
  at::Tensor step(const std::vector<int64_t>& rows, const std::vector<int64_t>& tokens) override {
    return e_.step(rows, tokens);
  }
  SampleOutput step_draw(const std::vector<int64_t>& rows, const std::vector<int64_t>& tokens,
                         const SamplingOptions& sampling, const at::Tensor& row_keys, int64_t vocab_limit,
                         const at::Tensor& next_keys) override {
    const at::Tensor keys = own_keys_ && next_keys.defined() ? row_keys : next_keys;
    return e_.step_draw(rows, tokens, sampling, row_keys, vocab_limit, keys);
  }
  at::Tensor extend(const std::vector<int64_t>& rows, const std::vector<std::vector<int64_t>>& runs) override {
    return e_.extend(rows, runs);
  }
  void release(const std::vector<int64_t>& rows) override { e_.release(rows); }
  int64_t vocab_size() const override { return e_.vocab_size(); }

 private:
  DecodeEngine& e_;
  bool own_keys_;
};

TEST_F(SpeculativeRolloutTest, StepsStartedAheadSampleThePlainRolloutsTokens) {
  // rollout.step_ahead: the loop passes each step the keys of the step after it, and the engine (float64 on
  // the CPU, at the graphs' fixed shape) starts that step before the draws are read. Rows stop at their
  // stop ids and leave the steps started with them. Every token and log-prob equals a rollout whose steps
  // start when asked; most steps were started ahead, and a policy that passes each step's own keys as the
  // next ones gets none taken.
  const Transformer m = tiny_model("llama", 31);
  auto go = [&](bool ahead, bool own_keys, RolloutStats& stats, int64_t& taken) {
    EngineOptions po;
    po.switches.cuda_graphs = true;
    po.fixed_shape_step = true;
    po.switches.step_ahead = ahead;
    DecodeEngine engine(m, po);
    const SamplingOptions s = plain_sampling(9, 1.0);
    PassedOn policy(engine, own_keys);
    auto out = rollout(policy, *tok_, numbered_prompts(4), s, plain_options(), {}, {}, {}, &stats);
    taken = engine.steps_ahead_taken();
    return out;
  };
  RolloutStats plain_stats, stats, twin_stats;
  int64_t plain_taken = 0, taken = 0, twin_taken = 0;
  const auto plain = go(false, false, plain_stats, plain_taken), ahead = go(true, false, stats, taken);
  EXPECT_EQ(worst_gap(plain, ahead), 0.0);
  int64_t stopped = 0;
  for (const Trajectory& t : ahead) stopped += t.finish == FinishReason::kEos;
  EXPECT_GT(stopped, 0) << "no row left the steps started with it";
  EXPECT_EQ(plain_taken, 0);
  EXPECT_EQ(stats.decode_steps, plain_stats.decode_steps);
  EXPECT_GT(2 * taken, stats.decode_steps) << taken << " of " << stats.decode_steps << " steps started ahead";
  std::cout << taken << " of " << stats.decode_steps << " decode steps started ahead; " << stopped
            << " rows stopped at a stop id\n";
  const auto twin = go(true, true, twin_stats, twin_taken);
  EXPECT_EQ(worst_gap(plain, twin), 0.0);
  EXPECT_EQ(twin_taken, 0) << "steps started with the keys of the step before must not be taken";
}

TEST_F(SpeculativeRolloutTest, SamplesThePlainRolloutsTokensInFloat32) {
  // float32 on the CPU: a verifying forward's GEMMs have other shapes than a decode step's, so their logits
  // may differ in the last bits, and a draw can flip only where two candidates' Gumbel-perturbed scores
  // nearly tie. Every trajectory that differs from plain decoding's must differ first at such a near tie
  // (under 1e-3, from plain's own logits by a full forward): reported, and so explained.
  const Transformer m = tiny_model("llama", 31, at::kCPU, at::kFloat);
  auto history = std::make_shared<DraftHistory>(100000);
  go(m, 1.0, 8, true, nullptr, history);
  const auto plain = go(m, 1.0, 9, false, nullptr);
  RolloutStats stats;
  const auto spec = go(m, 1.0, 9, true, &stats, history);
  ASSERT_EQ(plain.size(), spec.size());
  EXPECT_GT(stats.accepted_tokens, 0);
  int64_t same = 0;
  for (size_t i = 0; i < plain.size(); ++i) {
    const Trajectory &p = plain[i], &q = spec[i];
    if (p.response_ids == q.response_ids) {
      ++same;
      continue;
    }
    size_t k = 0;
    while (k < p.response_ids.size() && k < q.response_ids.size() && p.response_ids[k] == q.response_ids[k]) ++k;
    ASSERT_LT(k, p.response_ids.size()) << "trajectory " << i << ": one is a prefix of the other";
    // Plain decoding's scores at token k: its logits (a full forward over the tokens before it), top-p, and
    // the noise of (seed 9, the sequence's stream, k).
    at::NoGradGuard no_grad;
    std::vector<int64_t> ids = p.prompt_ids;
    ids.insert(ids.end(), p.response_ids.begin(), p.response_ids.begin() + static_cast<int64_t>(k));
    const int64_t L = static_cast<int64_t>(ids.size());
    const at::Tensor h =
        m.forward(at::tensor(ids, at::kLong).view({1, L}), at::arange(L, at::kLong).view({1, L}), at::Tensor());
    const at::Tensor logits = m.logits(h.select(1, L - 1)).to(at::kFloat);  // (1, V)
    const at::Tensor u = counter_uniforms(9, at::tensor({p.prompt_index * 4 + p.sample_index}, at::kLong),
                                          at::tensor({static_cast<int64_t>(k)}, at::kLong), logits.size(1), at::kCPU);
    const at::Tensor scores = filter_top_k_top_p(logits, 0, 0.9) - at::log(-at::log(u));
    const at::Tensor top = std::get<0>(scores.topk(2, 1))[0];
    const double gap = (top[0] - top[1]).item<double>();
    std::cout << "trajectory " << i << " differs first at token " << k << ": plain's top two scores " << gap
              << " apart\n";
    EXPECT_LT(gap, 1e-3) << "trajectory " << i << " differs where plain decoding's draw is no near tie";
  }
  std::cout << same << " of " << plain.size() << " trajectories the same as plain decoding's in float32\n";
  EXPECT_GE(same, static_cast<int64_t>(plain.size()) - 2);
}

TEST_F(ReToolTest, SpeculativeRolloutsWithToolsSampleThePlainRolloutsTokens) {
  // Tool turns: rows steered to a code call (a sentence first, or the call at once), the fake tool's reply
  // fed as a run, then free text. A speculative rollout (drafts from the group: the siblings' calls and
  // replies) gives plain decoding's trajectories, loss masks and tool calls; its drafts never reach into a
  // reply, so no reply token is ever sampled. Leaving rejected tokens in the cache must change them.
  const Transformer m = tiny_model("llama", 11);
  FakeTool fake;
  fake.outputs = kTwoCallOutputs;
  const ToolRunner tool = fake.ready_runner();
  const std::vector<std::vector<int64_t>> prefixes = two_call_scripts();
  const std::vector<std::vector<int64_t>> prompts = numbered_prompts(4);
  auto run = [&](bool speculate, SpeculationFault fault, RolloutStats* stats) {
    SteeredPolicy policy(m, steer_to(prefixes, /*multi_token=*/true));
    SamplingOptions s = sampling(3);
    s.seed = 5;
    s.max_new_tokens = 100;
    RolloutOptions o;
    o.max_context = 240;
    o.progress_s = 0;
    if (speculate) {
      o.speculative = Speculative::kSuffix;
      o.draft_tokens = 7;
      o.speculation_fault = fault;
    }
    return rollout(policy, *tok_, prompts, s, o, tool, {}, {}, stats);
  };
  RolloutStats plain_stats, stats;
  const auto plain = run(false, SpeculationFault::kNone, &plain_stats);
  const auto spec = run(true, SpeculationFault::kNone, &stats);
  ASSERT_EQ(spec.size(), 12u);
  for (size_t i = 0; i < plain.size(); ++i) {
    ASSERT_GE(plain[i].tool_calls, 1) << i;
    EXPECT_EQ(plain[i].loss_mask, spec[i].loss_mask) << i;
    EXPECT_EQ(plain[i].tool_calls, spec[i].tool_calls) << i;
    EXPECT_EQ(plain[i].turns, spec[i].turns) << i;
    EXPECT_LT(logprob_gap(plain[i], spec[i]), 1e-6) << "trajectory " << i;
  }
  EXPECT_EQ(stats.forced_tokens, plain_stats.forced_tokens);
  EXPECT_GT(stats.accepted_tokens, 0);
  EXPECT_GT(stats.verify_sampled, stats.verify_sampling_rows);
  std::cout << "plain " << plain_stats.decode_steps << " steps; speculative " << stats.decode_steps << " + "
            << stats.verify_passes << " verifying, " << stats.accepted_tokens << " of " << stats.drafted_tokens
            << " drafted taken\n";
  EXPECT_GT(worst_gap(plain, run(true, SpeculationFault::kVisibleRejects, nullptr)), 1e-3);
}

// The two-sample chi-square statistic of counts a and b over the same categories, categories of fewer than
// 10 counts together pooled into one, and its z-score by the Wilson-Hilferty approximation (z > 3.1: the
// samples differ at p < 0.001).
double chi_square_z(const std::map<int64_t, int64_t>& a, const std::map<int64_t, int64_t>& b) {
  std::map<int64_t, std::pair<double, double>> cells;
  double na = 0, nb = 0;
  for (const auto& [k, n] : a) cells[k].first += n, na += n;
  for (const auto& [k, n] : b) cells[k].second += n, nb += n;
  std::vector<std::pair<double, double>> pooled(1, {0.0, 0.0});
  for (const auto& [k, c] : cells) {
    if (c.first + c.second >= 10) {
      pooled.push_back(c);
    } else {
      pooled[0].first += c.first;
      pooled[0].second += c.second;
    }
  }
  double chi2 = 0;
  int64_t cats = 0;
  for (const auto& [x, y] : pooled) {
    if (x + y == 0) continue;
    ++cats;
    const double ea = na * (x + y) / (na + nb), eb = nb * (x + y) / (na + nb);
    chi2 += (x - ea) * (x - ea) / ea + (y - eb) * (y - eb) / eb;
  }
  const double k = static_cast<double>(std::max<int64_t>(1, cats - 1));
  return (std::cbrt(chi2 / k) - (1 - 2 / (9 * k))) / std::sqrt(2 / (9 * k));
}

TEST_F(SpeculativeRolloutTest, SamplesFromTheModelsDistributionInBf16) {
  // bfloat16: a verifying forward's logits differ from a decode step's in their last bits, so a speculative
  // rollout may sample other tokens than plain decoding does; its samples must still follow the model's
  // distribution. 768 samples of one prompt, the token at each of a few positions, speculative (drafts from
  // an earlier rollout of the prompt) against plain decoding under other noise: a two-sample chi-square test
  // per position passes, as it does between two plain rollouts. A verification that takes a rejected
  // draft token at every other rejection (biased toward the draft) must fail it.
  Transformer m(model_config_from_json(testing::tiny_family_config("llama"), "tiny llama"), at::kBFloat16, at::kCPU,
                43);
  {
    at::NoGradGuard no_grad;
    for (auto& p : m.parameters())
      p.mul_(5.0);  // peaked enough for drafts to be taken, not so much that bf16 never flips a draw
  }
  const std::vector<std::vector<int64_t>> one = {enc("Q: 347 * 829 ?")};
  auto run = [&](int64_t seed, bool speculate, SpeculationFault fault, std::shared_ptr<DraftHistory> h,
                 RolloutStats* stats) {
    DecodeEngine policy(m);
    SamplingOptions s = sampling(768);
    s.seed = seed;
    s.max_new_tokens = 12;
    RolloutOptions o;
    o.tools = false;
    o.max_context = 64;
    o.progress_s = 0;
    o.stop_ids = {399};
    if (speculate) {
      o.speculative = Speculative::kSuffix;
      o.speculative_max_rows = 100000;
      o.speculation_fault = fault;
      o.draft_history = std::move(h);
    }
    return rollout(policy, *tok_, one, s, o, {}, {}, {}, stats);
  };
  auto counts = [](const std::vector<Trajectory>& t, size_t at) {
    std::map<int64_t, int64_t> c;
    for (const Trajectory& x : t) c[x.response_ids.size() > at ? x.response_ids[at] : -1] += 1;
    return c;
  };
  auto history = std::make_shared<DraftHistory>(1000000);
  run(1, true, SpeculationFault::kNone, history, nullptr);  // the earlier rollout drafts come from
  RolloutStats stats, biased_stats;
  const auto plain = run(3, false, SpeculationFault::kNone, nullptr, nullptr);
  const auto plain2 = run(2, false, SpeculationFault::kNone, nullptr, nullptr);
  const auto spec = run(2, true, SpeculationFault::kNone, std::make_shared<DraftHistory>(*history), &stats);
  const auto biased =
      run(2, true, SpeculationFault::kBiasToDraft, std::make_shared<DraftHistory>(*history), &biased_stats);
  int64_t differs = 0;
  for (size_t i = 0; i < spec.size(); ++i) differs += spec[i].response_ids != plain2[i].response_ids;
  std::cout << "accepted " << stats.accepted_tokens << " of " << stats.drafted_tokens << "; " << differs
            << " of 768 differ from plain decoding under the same noise\n";
  double worst_biased = 0;
  for (size_t at : {2, 5, 8, 11}) {
    const double z_plain = chi_square_z(counts(plain, at), counts(plain2, at));
    const double z_spec = chi_square_z(counts(plain, at), counts(spec, at));
    const double z_biased = chi_square_z(counts(plain, at), counts(biased, at));
    std::cout << "position " << at << ": z plain " << z_plain << ", speculative " << z_spec << ", biased " << z_biased
              << "\n";
    EXPECT_LT(z_plain, 3.1) << at;
    EXPECT_LT(z_spec, 3.1) << at;
    worst_biased = std::max(worst_biased, z_biased);
  }
  EXPECT_GT(worst_biased, 5.0) << "a verification biased toward the draft must fail the test";
  EXPECT_GT(stats.accepted_tokens, 0);
  EXPECT_LT(stats.accepted_tokens, stats.drafted_tokens);
  EXPECT_GT(differs, 0) << "bf16 rounding never changed a draw: the test shows nothing plain decoding's doesn't";
}

}  // namespace
}  // namespace rlt
