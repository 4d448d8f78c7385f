// The ReTool loop; see retool.h. One pass of the main loop: sample for the sequences whose logits are
// ready, pick up finished tool calls, feed every sequence that has tokens to feed (a decode step for the
// ones with one token, one multi-token forward for those with a tool's reply), and repeat. A sequence's
// state is a queue of tokens not yet in the model's cache ("pending"): its own last sample, or tool output
// to append. A sequence samples when that queue runs dry.
//
// Continuous batching (rollout.max_batch): the loop starts with as many whole prompts as fit in max_batch
// rows, and once finished trajectories have released an eighth of the rows (at least a prompt's G; or the
// rows the last prompts need, or any when nothing else is left to decode), admits the next prompts into
// them (TokenPolicy::admit), while the others go on decoding or wait on their tools. Prompts are admitted in
// order, G rows each; the policy numbers its sequences in the order they start (pid_).
//
// A carry (rollout.partial, RolloutCarry): the carried groups' sequences come first. Their unfinished ones
// start the policy, each prefilled with all its tokens, and the new prompts are admitted after them. Once
// enough groups are complete (and none must finish here), the loop stops at the top of a pass, where every
// row has sampled; a row waiting on its tool gets the reply first.
#include "rollout/retool.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <iostream>
#include <thread>

#include "common/memory.h"
#include "common/timing.h"
#include "data/tokenizer.h"

namespace rlt {

std::vector<int64_t> Trajectory::ids() const {
  std::vector<int64_t> out = prompt_ids;
  out.insert(out.end(), response_ids.begin(), response_ids.end());
  return out;
}

int64_t Trajectory::sampled_tokens() const {
  int64_t n = 0;
  for (uint8_t m : loss_mask) n += m;
  return n;
}

std::string format_tool_output(const SandboxResult& r) {
  std::string out = r.stdout_text;
  if (r.exit_code != 0 && !r.stderr_text.empty()) {
    if (!out.empty() && out.back() != '\n') out += '\n';
    out += r.stderr_text;
  }
  if (r.truncated) out += "\n[output truncated]";
  if (r.timed_out) out += "\n[timed out]";
  while (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return !suffix.empty() && s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool is_blank(const std::string& s) { return s.find_first_not_of(" \t\r\n") == std::string::npos; }

// How a turn's text stands after its latest token.
struct TurnEnd {
  enum Kind { kNone, kCode, kBadCode, kBadCall, kAnswer, kFakeOutput } kind = kNone;
  std::string code;   // kCode
  std::string error;  // kBadCall: what is wrong with the <tool_call>, said to the model
};

// A fenced block "```python\n...\n```" that the latest token closed; code set when so.
bool closes_fence(const std::string& text, std::string& code) {
  size_t end = text.find_last_not_of(" \t\r\n");
  if (end == std::string::npos || end < 2 || text.compare(end - 2, 3, "```") != 0) return false;
  const size_t close = end - 2;
  if (close == 0) return false;
  const size_t open = text.rfind("```", close - 1);
  if (open == std::string::npos) return false;
  // The fences before `close` must pair up, `open` being the opening of the last pair.
  size_t count = 0;
  for (size_t p = text.find("```"); p != std::string::npos && p < close; p = text.find("```", p + 3)) ++count;
  if (count % 2 == 0) return false;
  size_t line_end = text.find('\n', open);
  if (line_end == std::string::npos || line_end > close) return false;
  const std::string lang = text.substr(open + 3, line_end - open - 3);
  if (lang != "python" && lang != "py" && lang != "python3") return false;
  code = text.substr(line_end + 1, close - line_end - 1);
  return true;
}

// The call format's open and close tags.
std::pair<const std::string&, const std::string&> call_tags(const ToolProtocol& p) {
  if (p.format == ToolFormat::kCode) return {p.code_open, p.code_close};
  return {p.call_open, p.call_close};
}

// Inside an open call (<code> or <tool_call>) or an open ```python fence (where "\boxed{" is code, not
// an answer).
bool inside_code(const std::string& text, const ToolProtocol& p) {
  const auto [open_tag, close_tag] = call_tags(p);
  const size_t open = text.rfind(open_tag);
  if (open != std::string::npos) {
    const size_t close = text.rfind(close_tag);
    if (close == std::string::npos || close < open) return true;
  }
  size_t count = 0;
  for (size_t p = text.find("```"); p != std::string::npos; p = text.find("```", p + 3)) ++count;
  return count % 2 == 1;
}

TurnEnd classify_turn(const std::string& text, const ToolProtocol& p) {
  TurnEnd t;
  const auto [open_tag, close_tag] = call_tags(p);
  if (ends_with(text, close_tag)) {
    const size_t close = text.size() - close_tag.size();
    const size_t open = text.rfind(open_tag, close);
    if (open == std::string::npos) {
      t.kind = TurnEnd::kBadCode;
      return t;
    }
    const std::string body = text.substr(open + open_tag.size(), close - open - open_tag.size());
    if (p.format == ToolFormat::kToolCall) {
      ParsedToolCall call = parse_tool_call(body, p.tool_name);
      t.kind = call.ok ? TurnEnd::kCode : TurnEnd::kBadCall;
      t.code = std::move(call.code);
      t.error = std::move(call.error);
      return t;
    }
    t.code = body;
    t.kind = is_blank(t.code) ? TurnEnd::kBadCode : TurnEnd::kCode;
    return t;
  }
  std::string code;
  if (closes_fence(text, code)) {
    t.kind = is_blank(code) ? TurnEnd::kBadCode : TurnEnd::kCode;
    t.code = code;
    return t;
  }
  if (inside_code(text, p)) return t;
  if (ends_with(text, p.output_open) || ends_with(text, p.output_close)) {
    t.kind = TurnEnd::kFakeOutput;  // the model writing the interpreter's part
    return t;
  }
  // An answer ends the turn once its braces close; "\boxed{" alone is still being written.
  if (text.find("\\boxed") != std::string::npos && extract_last_boxed(text).has_value()) t.kind = TurnEnd::kAnswer;
  return t;
}

using Clock = std::chrono::steady_clock;

// Seconds since t; t moves to now.
double lap(Clock::time_point& t) {
  const auto now = Clock::now();
  const double s = std::chrono::duration<double>(now - t).count();
  t = now;
  return s;
}

// RolloutStats' tail: a decode pass (a step or a verifying forward) of at most 16 rows, its seconds and the
// tokens its rows sampled.
void count_tail(RolloutStats& stats, size_t rows, double seconds, int64_t sampled) {
  if (rows > 16) return;
  stats.tail_passes += 1;
  stats.tail_s += seconds;
  stats.tail_sampled += sampled;
}

enum class SeqState { kQueued, kGenerating, kWaiting, kDone };  // kQueued: its prompt not yet admitted

struct Seq {
  Trajectory traj;
  std::deque<int64_t> pending;  // tokens to feed the model, in order
  SeqState state = SeqState::kQueued;
  int64_t turn_tokens = 0;  // sampled in the current turn
  std::string turn_text;    // model text of the current turn
  std::future<SandboxResult> tool;
  int64_t stream = 0;
  int64_t run_since = -1;  // decode passes done when its pending run (several tokens) was first held back
  std::chrono::steady_clock::time_point tool_sent;  // when its tool call was submitted
  int64_t text = -1;                                // its text in the drafter (rollout.speculative)
  int64_t draft_len = 0;                            // the longest draft it feeds next
};

class Loop {
 public:
  Loop(TokenPolicy& policy, const Tokenizer& tok, const SamplingOptions& sampling, const RolloutOptions& options,
       const ToolRunner& tools, const ToolProtocol& protocol)
      : policy_(policy),
        tok_(tok),
        sampling_(sampling),
        options_(options),
        tools_(tools),
        protocol_(protocol),
        reply_open_(tok.encode(protocol.reply_open)),
        reply_close_(tok.encode(protocol.reply_close)),
        turn_filter_(protocol) {}

  // max_rows: sequences held at once (rollout.max_batch; 0 = every prompt at once); at least one prompt's G.
  std::vector<Trajectory> run(const std::vector<std::vector<int64_t>>& prompts, const std::vector<int64_t>& streams,
                              int64_t max_rows, RolloutStats& stats, RolloutCarry* carry) {
    const int64_t G = sampling_.samples_per_prompt;
    carry_ = carry;
    version_ = carry ? carry->version : 0;
    // The groups: the carried ones begun (their sequences first), then the prompts to admit: the carried
    // ones never begun, then the new ones.
    std::vector<CarriedGroup> begun;
    if (carry) {
      carry->keys.clear();
      for (CarriedGroup& c : carry->carry) {
        TORCH_CHECK(static_cast<int64_t>(c.trajs.size()) == G && static_cast<int64_t>(c.started.size()) == G &&
                        static_cast<int64_t>(c.done.size()) == G,
                    "rollout: a carried group of ", c.trajs.size(), " trajectories, sampling.samples_per_prompt ", G);
        if (std::find(c.started.begin(), c.started.end(), 1) != c.started.end()) {
          begun.push_back(std::move(c));
        } else {
          prompts_.push_back(c.prompt_ids);
          keys_.push_back(c.key);
        }
      }
      carry->carry.clear();
    }
    for (size_t p = 0; p < prompts.size(); ++p) {
      prompts_.push_back(prompts[p]);
      keys_.push_back(streams[p]);
    }
    const int64_t B = static_cast<int64_t>(begun.size()), P = static_cast<int64_t>(prompts_.size());
    base_ = B * G;
    seqs_ = std::vector<Seq>(base_ + P * G);
    released_.assign(seqs_.size(), false);
    pid_.assign(seqs_.size(), -1);
    std::vector<int64_t> live;  // the carried sequences to continue
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t g = 0; g < G; ++g) {
        Seq& s = seqs_[b * G + g];
        s.traj = std::move(begun[b].trajs[g]);
        s.traj.prompt_ids = begun[b].prompt_ids;
        s.stream = begun[b].key * G + g;
        restore(s);
        if (begun[b].done[g]) {
          s.state = SeqState::kDone;
          released_[b * G + g] = true;  // never in this rollout's cache
        } else {
          s.state = SeqState::kGenerating;
          live.push_back(b * G + g);
        }
      }
      group_keys_.push_back(begun[b].key);
    }
    for (int64_t p = 0; p < P; ++p) {
      for (int64_t g = 0; g < G; ++g) {
        Seq& s = seqs_[base_ + p * G + g];
        s.traj.sample_index = g;
        s.traj.prompt_ids = prompts_[p];
        s.stream = keys_[p] * G + g;
      }
      group_keys_.push_back(keys_[p]);
    }
    if (options_.speculative == Speculative::kSuffix) start_drafts();
    const int64_t L = static_cast<int64_t>(live.size());
    rows_ = max_rows > 0 ? std::max(max_rows, G) : L + P * G;
    // Admits to come: the policy keeps rows through a reallocation for them (whole prompts' worth).
    policy_.reserve_rows(rows_ < L + P * G ? rows_ / G * G : 0);
    auto t = Clock::now();
    start_ = t;
    next_progress_ = options_.progress_s;
    std::vector<int64_t> to_sample;
    at::Tensor logits;  // (to_sample, V)
    // The rows whose next token the decode step drew itself (TokenPolicy::step_draw), and the draws: they
    // take their tokens before to_sample's, in the order sampling would have taken them.
    std::vector<int64_t> drawn_rows;
    SampleOutput drawn;
    if (L > 0) logits = resume(live, to_sample, stats, t);
    {
      std::vector<int64_t> admitted;
      at::Tensor a = admit(admitted, stats, t, /*first=*/L == 0, /*idle=*/true, /*initial=*/true);
      if (!admitted.empty()) {
        logits = to_sample.empty() ? a : at::cat({logits, a});
        to_sample.insert(to_sample.end(), admitted.begin(), admitted.end());
      }
    }
    bool cut = false;
    for (;;) {
      report_progress();
      if (!drawn_rows.empty() || !to_sample.empty()) {
        if (!drawn_rows.empty()) take_samples(drawn_rows, drawn, stats);
        drawn_rows.clear();
        if (!to_sample.empty()) sample(to_sample, logits, stats);
        stats.sample_s += lap(t);
      }
      collect_tools(/*block=*/false);
      if (enough_groups()) {  // every row has sampled: the unfinished ones stop here
        cut = true;
        break;
      }
      // A sequence with one token to feed (its last sample) joins the decode step; one with several (its
      // last sample, then a tool's reply or feedback) is fed all of them at once, in one forward over the
      // rows that have such runs.
      std::vector<int64_t> rows, tokens, run_rows;
      std::vector<std::vector<int64_t>> runs;
      for (size_t n = 0; n < seqs_.size(); ++n) {
        std::deque<int64_t>& q = seqs_[n].pending;
        if (q.size() != 1) continue;
        rows.push_back(static_cast<int64_t>(n));
        tokens.push_back(q.front());
        q.clear();
      }
      if (feed_now(rows.empty(), stats.decode_steps + stats.verify_passes)) {
        for (size_t n = 0; n < seqs_.size(); ++n) {
          Seq& s = seqs_[n];
          if (s.pending.size() < 2) continue;
          run_rows.push_back(static_cast<int64_t>(n));
          runs.emplace_back(s.pending.begin(), s.pending.end());
          s.pending.clear();
          s.run_since = -1;
        }
      }
      release_finished();
      to_sample.clear();
      // Rows released take the next prompts once enough are free; their first tokens are sampled in the
      // next pass, with the logits of the rows fed below.
      std::vector<int64_t> admitted;
      at::Tensor admitted_logits =
          admit(admitted, stats, t, /*first=*/false, /*idle=*/rows.empty() && run_rows.empty());  // (admitted, V)
      if (rows.empty() && run_rows.empty()) {
        if (!admitted.empty()) {
          to_sample = std::move(admitted);
          logits = admitted_logits;
          continue;
        }
        if (!any_waiting()) break;
        lap(t);
        collect_tools(/*block=*/true);  // nothing to decode: wait for a tool call to return
        stats.tool_wait_s += lap(t);
        continue;
      }
      lap(t);
      // The sequences this pass leaves out: waiting on a tool (not the one whose call's last token this pass
      // feeds), or holding a reply back (rollout.feed_wait; a fed one's pending was cleared above).
      std::vector<uint8_t> fed_now(seqs_.size(), 0);
      for (int64_t n : rows) fed_now[n] = 1;
      for (int64_t n : run_rows) fed_now[n] = 1;
      for (size_t n = 0; n < seqs_.size(); ++n) {
        stats.tool_wait_row_steps += seqs_[n].state == SeqState::kWaiting && !fed_now[n];
        stats.feed_wait_row_steps += seqs_[n].pending.size() >= 2;
      }
      // Drafts (rollout.speculative): a pass with few rows to decode verifies them in one forward.
      std::vector<std::vector<int64_t>> drafts;
      if (drafter_ && !rows.empty() && static_cast<int64_t>(rows.size()) <= options_.speculative_max_rows) {
        drafts = make_drafts(rows);
      }
      if (options_.merge_feeds && options_.multi_token_feed && !rows.empty() && !run_rows.empty() && drafts.empty()) {
        // One forward for the pass: the one-token rows join the feed as runs of one token.
        for (size_t j = 0; j < rows.size(); ++j) {
          run_rows.insert(run_rows.begin() + j, rows[j]);
          runs.insert(runs.begin() + j, std::vector<int64_t>{tokens[j]});
        }
        rows.clear();
      }
      // A row samples next unless its step fed the last token of a tool call (it waits for the reply).
      auto samples_next = [&](int64_t n) {
        return seqs_[n].pending.empty() && seqs_[n].state == SeqState::kGenerating;
      };
      if (!drafts.empty()) {
        verify(rows, tokens, drafts, stats, t);
      } else if (!rows.empty()) {
        // The step draws every fed row's next token (on a GPU inside the step's graph); the rows that wait
        // drop theirs.
        // The next pass is likely this one again (too many rows to draft; no feed, admit or held reply in
        // sight): the engine may start its step before this one's draws are read (rollout.step_ahead).
        const bool plain_next =
            (!drafter_ || static_cast<int64_t>(rows.size()) > options_.speculative_max_rows) && run_rows.empty() &&
            admitted.empty() &&
            std::none_of(seqs_.begin(), seqs_.end(), [](const Seq& s) { return s.pending.size() >= 2; });
        const SampleOutput d = policy_.step_draw(pids(rows), tokens, sampling_, row_keys(rows), tok_.vocab_size(),
                                                 plain_next ? row_keys(rows, 1) : at::Tensor());
        const double step_s = lap(t);
        stats.decode_s += step_s;
        stats.decode_steps += 1;
        stats.fed_rows += static_cast<int64_t>(rows.size());
        std::vector<int64_t> keep;
        for (size_t j = 0; j < rows.size(); ++j) {
          if (!samples_next(rows[j])) continue;
          drawn_rows.push_back(rows[j]);
          keep.push_back(static_cast<int64_t>(j));
        }
        count_tail(stats, rows.size(), step_s, static_cast<int64_t>(keep.size()));
        const at::Tensor k = at::tensor(keep, at::kLong);
        drawn = {d.ids.index_select(0, k), d.logprobs.index_select(0, k)};
      }
      if (!run_rows.empty()) {
        // (run_rows, V); rollout.multi_token_feed off: TokenPolicy's one-token-per-step feed.
        logits = options_.multi_token_feed ? policy_.extend(pids(run_rows), runs)
                                           : policy_.TokenPolicy::extend(pids(run_rows), runs);
        stream_synchronize(logits.device());
        stats.feed_s += lap(t);
        stats.feed_steps += 1;
        for (const auto& r : runs) stats.feed_tokens += static_cast<int64_t>(r.size());
        std::vector<int64_t> pick;
        for (size_t j = 0; j < run_rows.size(); ++j) {
          if (!samples_next(run_rows[j])) continue;
          to_sample.push_back(run_rows[j]);
          pick.push_back(static_cast<int64_t>(j));
        }
        // Through pinned memory: a copy from pageable memory would first wait for the pass's forwards.
        if (!pick.empty()) logits = logits.index_select(0, to_device_async(pick, logits.device()));
      }
      if (!admitted.empty()) {
        logits = to_sample.empty() ? admitted_logits : at::cat({logits, admitted_logits});
        to_sample.insert(to_sample.end(), admitted.begin(), admitted.end());
      }
    }
    TORCH_CHECK(cut || next_prompt_ == P, "rollout: the loop ended with prompts never admitted");
    if (printed_) std::cerr << "\n";
    if (cut) {
      for (auto& s : seqs_) {
        if (s.state != SeqState::kWaiting) continue;
        take_tool_reply(s);  // the carried row holds its reply, not a call in flight
      }
    }
    stats.forced_tokens += forced_tokens_;
    stats.tool_latency_s += tool_latency_s_;
    stats.tool_run_s += tool_run_s_;
    return results(G, stats);
  }

 private:
  // Starts the next prompts: as many whole prompts as fit in the rows not held by running sequences (at
  // least one, at the first call), in one prefill. While others run (and idle is false: something else
  // is left to decode), only once an eighth of the rows can start together, or the last prompts. Appends their
  // sequences to `started` and returns their first-token logits (started, V), or an undefined tensor when none fit or
  // none are left.
  at::Tensor admit(std::vector<int64_t>& started, RolloutStats& stats, Clock::time_point& t, bool first,
                   bool idle = false, bool initial = false) {
    const int64_t G = sampling_.samples_per_prompt, P = static_cast<int64_t>(prompts_.size());
    if (next_prompt_ == P) return at::Tensor();
    int64_t held = 0;  // rows of sequences started and not released
    for (size_t n = 0; n < seqs_.size(); ++n) held += pid_[n] >= 0 && !released_[n];
    const int64_t count = std::min(P - next_prompt_, (rows_ - held) / G);
    if (count <= 0) return at::Tensor();
    // While others decode, wait until an eighth of the rows (or the last prompts) can start together: each
    // admit is an eager prefill and a device sync. With one prompt per admit, continuous batching runs at
    // 0.89x of two waves (H200); batched, at 1.05-1.11x (H100; bench_rollout --refill,
    // docs/benchmarks.md). With nothing else to decode, waiting would only leave the device idle.
    const int64_t batch = std::min(P - next_prompt_, std::max<int64_t>(1, rows_ / G / 8));
    if (held > 0 && !idle && count < batch) return at::Tensor();
    const int64_t begin = next_prompt_;
    next_prompt_ += count;
    if (next_prompt_ == P) policy_.reserve_rows(0);  // the last admit: released rows may go
    for (int64_t n = base_ + begin * G; n < base_ + next_prompt_ * G; ++n) {
      seqs_[n].state = SeqState::kGenerating;
      seqs_[n].traj.weights_version = version_;
      pid_[n] = next_pid_++;
      started.push_back(n);
    }
    const std::vector<std::vector<int64_t>> prompts(prompts_.begin() + begin, prompts_.begin() + next_prompt_);
    lap(t);
    at::Tensor logits = first ? policy_.start(prompts, G) : policy_.admit(prompts, G);  // (count G, V)
    stream_synchronize(logits.device());
    stats.prefill_s += lap(t);
    if (!initial) stats.refills += count;
    return logits;
  }

  // The carried unfinished sequences `live` start the policy, each prefilled with all its tokens under the
  // weights in use now (feeding the tokens it had not fed yet, then sampling, would give the same logits),
  // and sample next: they are appended to to_sample; returns their logits (live, V).
  at::Tensor resume(const std::vector<int64_t>& live, std::vector<int64_t>& to_sample, RolloutStats& stats,
                    Clock::time_point& t) {
    std::vector<std::vector<int64_t>> contexts;
    for (int64_t n : live) {
      contexts.push_back(seqs_[n].traj.ids());
      pid_[n] = next_pid_++;
      to_sample.push_back(n);
    }
    lap(t);
    at::Tensor logits = policy_.start(contexts, 1);  // (live, V)
    stream_synchronize(logits.device());
    stats.prefill_s += lap(t);
    stats.resumed += static_cast<int64_t>(live.size());
    return logits;
  }

  // A carried sequence's loop state from its trajectory: the current turn is its sampled tokens after the
  // last appended one (next_turn cleared it there).
  void restore(Seq& s) {
    const std::vector<int64_t>& r = s.traj.response_ids;
    TORCH_CHECK(
        r.size() == s.traj.loss_mask.size() && r.size() == s.traj.logprobs.size() && r.size() == s.traj.versions.size(),
        "rollout: a carried trajectory's fields disagree in length");
    s.traj.response_text.clear();
    s.turn_text.clear();
    s.turn_tokens = 0;
    for (size_t i = 0; i < r.size(); ++i) {
      if (s.traj.loss_mask[i]) {
        const std::string& piece = tok_.piece_text(r[i]);
        s.traj.response_text += piece;
        s.turn_text += piece;
        s.turn_tokens += 1;
      } else {
        s.turn_text.clear();
        s.turn_tokens = 0;
      }
    }
  }

  // The policy's sequence ids of loop sequences.
  std::vector<int64_t> pids(const std::vector<int64_t>& seqs) const {
    std::vector<int64_t> out;
    out.reserve(seqs.size());
    for (int64_t n : seqs) out.push_back(pid_[n]);
    return out;
  }

  bool group_done(int64_t q) const {
    const int64_t G = sampling_.samples_per_prompt;
    for (int64_t g = 0; g < G; ++g) {
      if (seqs_[group_seq(q, g)].state != SeqState::kDone) return false;
    }
    return true;
  }
  // Group q's sample g: the begun carried groups' sequences come first.
  int64_t group_seq(int64_t q, int64_t g) const { return q * sampling_.samples_per_prompt + g; }

  // A partial rollout's end (RolloutCarry): enough complete groups, and no unfinished trajectory that the
  // next rollout could not continue within max_staleness versions.
  bool enough_groups() const {
    if (!carry_ || carry_->groups <= 0) return false;
    int64_t complete = 0;
    for (size_t q = 0; q < group_keys_.size(); ++q) complete += group_done(static_cast<int64_t>(q));
    if (complete < carry_->groups) return false;
    for (const Seq& s : seqs_) {
      const bool unfinished = s.state == SeqState::kGenerating || s.state == SeqState::kWaiting;
      if (unfinished && (version_ + 1) - s.traj.weights_version + 1 > options_.max_staleness) return false;
    }
    return true;
  }

  // The returned trajectories (prompt_index: the group's place among them), and the carry the rest form.
  std::vector<Trajectory> results(int64_t G, RolloutStats& stats) {
    const int64_t groups = static_cast<int64_t>(group_keys_.size());
    const int64_t want = carry_ && carry_->groups > 0 ? carry_->groups : groups;
    std::vector<Trajectory> out;
    int64_t taken = 0;
    for (int64_t q = 0; q < groups; ++q) {
      if (taken < want && group_done(q)) {
        remember(q);
        for (int64_t g = 0; g < G; ++g) {
          Trajectory& tr = seqs_[group_seq(q, g)].traj;
          tr.prompt_index = taken;
          out.push_back(std::move(tr));
        }
        if (carry_) carry_->keys.push_back(group_keys_[q]);
        ++taken;
        continue;
      }
      TORCH_CHECK(carry_, "rollout: a group was left unfinished");
      CarriedGroup c;
      c.key = group_keys_[q];
      for (int64_t g = 0; g < G; ++g) {
        Seq& s = seqs_[group_seq(q, g)];
        const bool started = s.state != SeqState::kQueued;
        c.prompt_ids = s.traj.prompt_ids;
        c.started.push_back(started);
        c.done.push_back(s.state == SeqState::kDone);
        stats.cut += started && s.state != SeqState::kDone;
        c.trajs.push_back(std::move(s.traj));
      }
      carry_->carry.push_back(std::move(c));
    }
    TORCH_CHECK(taken == want, "rollout: ", taken, " groups complete, ", want, " wanted");
    return out;
  }

  int64_t total_tokens(const Seq& s) const {
    return static_cast<int64_t>(s.traj.prompt_ids.size() + s.traj.response_ids.size());
  }

  void finish(Seq& s, FinishReason why, bool truncated = false) {
    s.state = SeqState::kDone;
    s.traj.finish = why;
    s.traj.truncated = truncated;
    s.pending.clear();
  }

  // Appends tokens the policy did not sample (tool output, feedback); they are fed before it samples again.
  // Returns false when the context budget cut them (the trajectory is then finished).
  bool append_forced(Seq& s, const std::vector<int64_t>& ids) {
    const int64_t room = options_.max_context - total_tokens(s);
    const int64_t n = std::min<int64_t>(room, static_cast<int64_t>(ids.size()));
    forced_tokens_ += n;
    for (int64_t i = 0; i < n; ++i) {
      s.traj.response_ids.push_back(ids[i]);
      s.traj.loss_mask.push_back(0);
      s.traj.logprobs.push_back(0.0f);
      s.traj.versions.push_back(version_);
      s.pending.push_back(ids[i]);
      if (drafter_) drafter_->append(s.text, ids[i], /*sampled=*/false);
    }
    if (n < static_cast<int64_t>(ids.size()) || total_tokens(s) >= options_.max_context) {
      finish(s, FinishReason::kContext, /*truncated=*/true);
      return false;
    }
    return true;
  }

  // The turn boundary after a tool or feedback message: the next sample starts a new assistant turn.
  void next_turn(Seq& s) {
    s.state = SeqState::kGenerating;
    s.turn_tokens = 0;
    s.turn_text.clear();
    s.traj.turns += 1;
  }

  // The reply turn: the framing's tokens (encoded once) around the body's, the body cut to
  // rollout.max_tool_output_tokens.
  std::vector<int64_t> reply_turn(const std::string& body) const {
    std::vector<int64_t> text = tok_.encode(body);
    const bool cut = static_cast<int64_t>(text.size()) > options_.max_tool_output_tokens;
    if (cut) text.resize(options_.max_tool_output_tokens);
    if (protocol_.render_reply) {
      // A template that transforms the content (tojson): the kept output's text through the template.
      return tok_.encode(protocol_.reply_text(tok_.decode(text) + (cut ? "\n[output truncated]" : "")));
    }
    std::vector<int64_t> ids = reply_open_;
    if (cut) {
      const auto mark = tok_.encode("\n[output truncated]");
      text.insert(text.end(), mark.begin(), mark.end());
    }
    ids.insert(ids.end(), text.begin(), text.end());
    ids.insert(ids.end(), reply_close_.begin(), reply_close_.end());
    return ids;
  }

  void give_feedback(Seq& s, const std::string& message) {
    if (s.traj.turns >= options_.max_turns) return finish(s, FinishReason::kMaxTurns);
    s.traj.feedback_turns += 1;
    if (append_forced(s, reply_turn(message))) next_turn(s);
  }

  // The noise keys of the rows' next tokens (sample_row_keys): each row's stream, and the token's index in
  // its response as the counter; `ahead` tokens later with ahead (the step after next's, should each row
  // sample its next token).
  at::Tensor row_keys(const std::vector<int64_t>& rows, int64_t ahead = 0) const {
    const int64_t n = static_cast<int64_t>(rows.size());
    // Filled through their pointers: an element write on a tensor is a dispatch of its own.
    at::Tensor streams = at::empty({n}, at::kLong), counters = at::empty({n}, at::kLong);
    int64_t* stream = streams.data_ptr<int64_t>();
    int64_t* counter = counters.data_ptr<int64_t>();
    for (int64_t j = 0; j < n; ++j) {
      const Seq& s = seqs_[rows[j]];
      stream[j] = s.stream;
      counter[j] = static_cast<int64_t>(s.traj.response_ids.size()) + ahead;
    }
    return sample_row_keys(sampling_.seed, streams, counters);
  }

  // Each row's token and its log-prob, in order (a step's draws, or a sampling's), into its trajectory.
  void take_samples(const std::vector<int64_t>& rows, const SampleOutput& out, RolloutStats& stats) {
    const int64_t* ids = out.ids.data_ptr<int64_t>();
    const float* lp = out.logprobs.data_ptr<float>();
    const auto t0 = Clock::now();
    for (size_t j = 0; j < rows.size(); ++j) on_sampled(seqs_[rows[j]], ids[j], lp[j]);
    stats.turn_s += seconds_since(t0);
  }

  void sample(const std::vector<int64_t>& rows, const at::Tensor& logits, RolloutStats& stats) {
    take_samples(rows, sample_keyed(logits, sampling_, row_keys(rows), tok_.vocab_size()), stats);
  }

  void on_sampled(Seq& s, int64_t id, float logprob) {
    s.traj.response_ids.push_back(id);
    s.traj.loss_mask.push_back(1);
    s.traj.logprobs.push_back(logprob);
    s.traj.versions.push_back(version_);
    if (drafter_) drafter_->append(s.text, id, /*sampled=*/true);
    s.turn_tokens += 1;
    const std::string& piece = tok_.piece_text(id);
    s.turn_text += piece;
    s.traj.response_text += piece;
    const bool stop_id = options_.stop_ids.empty() ? id == tok_.eos_id()
                                                   : std::find(options_.stop_ids.begin(), options_.stop_ids.end(),
                                                               id) != options_.stop_ids.end();
    if (stop_id) return finish(s, FinishReason::kEos);
    if (!options_.stop.empty() && ends_with(s.traj.response_text, options_.stop)) {
      return finish(s, FinishReason::kStop);
    }
    // The turn's text is read again only when the piece can end it (TurnEndFilter; without tools, only an
    // answer's closing brace can): the reading scans the whole turn.
    TurnEnd end;
    if (options_.tools) {
      if (turn_filter_.may_end(piece)) end = classify_turn(s.turn_text, protocol_);
    } else if (piece.find('}') != std::string::npos && s.turn_text.find("\\boxed") != std::string::npos &&
               extract_last_boxed(s.turn_text)) {
      end.kind = TurnEnd::kAnswer;
    }
    if (end.kind == TurnEnd::kAnswer) return finish(s, FinishReason::kAnswer);
    if (total_tokens(s) >= options_.max_context) return finish(s, FinishReason::kContext, true);
    if (end.kind == TurnEnd::kNone) {
      if (s.turn_tokens >= sampling_.max_new_tokens) return finish(s, FinishReason::kLength, true);
      s.pending.push_back(id);
      return;
    }
    // The turn ended with code, or is malformed: the last token goes to the cache before the tool turn.
    s.pending.push_back(id);
    if (end.kind == TurnEnd::kBadCode || end.kind == TurnEnd::kFakeOutput) return give_feedback(s, options_.feedback);
    if (end.kind == TurnEnd::kBadCall) return give_feedback(s, end.error);
    if (s.traj.tool_calls >= options_.max_tool_calls) return finish(s, FinishReason::kToolLimit);
    if (s.traj.turns >= options_.max_turns) return finish(s, FinishReason::kMaxTurns);
    s.traj.tool_calls += 1;
    s.state = SeqState::kWaiting;
    s.tool_sent = std::chrono::steady_clock::now();
    s.tool = tools_(end.code);
  }

  // rollout.speculative: every sequence's text so far (a carried one's whole), and each group's responses of
  // its prompt's latest earlier rollout, in the drafter; a group's texts share its index.
  void start_drafts() {
    drafter_ = std::make_unique<SuffixDrafter>();
    const int64_t G = sampling_.samples_per_prompt;
    for (size_t q = 0; q < group_keys_.size(); ++q) {
      const std::vector<int64_t>& prompt = seqs_[group_seq(static_cast<int64_t>(q), 0)].traj.prompt_ids;
      const auto* seen = options_.draft_history ? options_.draft_history->recall(prompt) : nullptr;
      if (seen) {
        for (const DraftHistory::Text& x : *seen) drafter_->add(static_cast<int64_t>(q), x.ids, x.sampled);
      }
      for (int64_t g = 0; g < G; ++g) {
        Seq& s = seqs_[group_seq(static_cast<int64_t>(q), g)];
        std::vector<uint8_t> sampled(s.traj.prompt_ids.size(), 0);
        sampled.insert(sampled.end(), s.traj.loss_mask.begin(), s.traj.loss_mask.end());
        s.text = drafter_->add(static_cast<int64_t>(q), s.traj.ids(), sampled);
        s.draft_len = options_.draft_tokens;
      }
    }
  }

  // Group q's responses, finished, as the next rollout's drafts of its prompt.
  void remember(int64_t q) {
    if (!drafter_ || !options_.draft_history) return;
    std::vector<DraftHistory::Text> texts;
    for (int64_t g = 0; g < sampling_.samples_per_prompt; ++g) {
      const Trajectory& tr = seqs_[group_seq(q, g)].traj;
      texts.push_back({tr.response_ids, tr.loss_mask});
    }
    options_.draft_history->remember(seqs_[group_seq(q, 0)].traj.prompt_ids, std::move(texts));
  }

  // Each row's draft (empty where it has none, or samples no more in this turn than its last token); none
  // at all when no row has one.
  std::vector<std::vector<int64_t>> make_drafts(const std::vector<int64_t>& rows) const {
    std::vector<std::vector<int64_t>> out(rows.size());
    bool any = false;
    for (size_t j = 0; j < rows.size(); ++j) {
      const Seq& s = seqs_[rows[j]];
      if (!s.pending.empty() || s.state != SeqState::kGenerating) continue;  // it waits on its call's reply
      // A verifying forward samples up to the draft's length + 1 tokens, all within this turn's and the
      // context's limits.
      const int64_t room = std::min(
          {s.draft_len, sampling_.max_new_tokens - s.turn_tokens - 1, options_.max_context - total_tokens(s) - 1});
      if (room <= 0) continue;
      out[j] = drafter_->draft(s.text, room);
      any |= !out[j].empty();
    }
    if (!any) out.clear();
    return out;
  }

  // One verifying forward: each row's last token and its draft (TokenPolicy::extend_each_draw); each position's
  // token drawn with the noise of its own index in the response, as plain decoding draws it; the draft kept
  // up to the first position whose draw differs from it, that draw included, and the rest taken back.
  void verify(const std::vector<int64_t>& rows, const std::vector<int64_t>& tokens,
              const std::vector<std::vector<int64_t>>& drafts, RolloutStats& stats, Clock::time_point& t) {
    stats.sample_s += lap(t);  // the drafts, host work
    const SpeculationFault fault = options_.speculation_fault;
    std::vector<std::vector<int64_t>> runs(rows.size());
    std::vector<int64_t> streams, counters;  // each position's noise
    for (size_t j = 0; j < rows.size(); ++j) {
      const Seq& s = seqs_[rows[j]];
      runs[j].push_back(tokens[j]);
      runs[j].insert(runs[j].end(), drafts[j].begin(), drafts[j].end());
      for (size_t i = 0; i < runs[j].size(); ++i) {
        streams.push_back(s.stream);
        counters.push_back(
            static_cast<int64_t>(s.traj.response_ids.size() + (fault == SpeculationFault::kStepNoise ? 0 : i)));
      }
    }
    const SampleOutput d = policy_.extend_each_draw(
        pids(rows), runs, sampling_,
        sample_row_keys(sampling_.seed, at::tensor(streams, at::kLong), at::tensor(counters, at::kLong)),
        tok_.vocab_size());  // (positions)
    const double forward_s = lap(t);
    stats.decode_s += forward_s;
    const int64_t sampled_before = stats.verify_sampled;
    stats.verify_passes += 1;
    stats.verify_rows += static_cast<int64_t>(rows.size());
    const int64_t* ids = d.ids.data_ptr<int64_t>();
    const float* lp = d.logprobs.data_ptr<float>();
    std::vector<int64_t> back(rows.size(), 0);  // tokens to take back
    int64_t off = 0;                            // row j's first position
    for (size_t j = 0; j < rows.size(); ++j) {
      Seq& s = seqs_[rows[j]];
      const std::vector<int64_t>& draft = drafts[j];
      const int64_t m = static_cast<int64_t>(draft.size());
      stats.drafted_tokens += m;
      if (s.pending.empty() && s.state == SeqState::kGenerating) {
        stats.verify_sampling_rows += 1;
        int64_t i = 0, accepted = 0;
        for (;; ++i) {
          const int64_t at = fault == SpeculationFault::kOffByOne ? off + std::min(i + 1, m) : off + i;
          int64_t id = ids[at];
          if (fault == SpeculationFault::kWholeDraft && i < m) id = draft[i];
          if (fault == SpeculationFault::kBiasToDraft && i < m && id != draft[i] && (++biased_ % 2 == 1)) id = draft[i];
          const bool as_drafted = i < m && id == draft[i];
          on_sampled(s, id, lp[at]);
          stats.verify_sampled += 1;
          accepted += as_drafted;
          if (!as_drafted || s.state != SeqState::kGenerating || s.pending.size() != 1) break;
          s.pending.clear();  // the drafted token is in the cache already
        }
        back[j] = m - i;  // the run's tokens after position i
        stats.accepted_tokens += accepted;
        if (m > 0) s.draft_len = accepted == m ? std::min(options_.draft_tokens, m + 1) : accepted + 1;
      }
      off += m + 1;
    }
    count_tail(stats, rows.size(), forward_s, stats.verify_sampled - sampled_before);
    const double host = lap(t);  // reading the tokens (turn ends, tool calls sent)
    stats.sample_s += host;
    stats.turn_s += host;
    if (fault != SpeculationFault::kVisibleRejects) policy_.retract(pids(rows), back);
    stats.decode_s += lap(t);
  }

  // The live line of a long rollout (rollout.progress_s): "\r"-rewritten in place, ended by run().
  void report_progress() {
    if (options_.progress_s <= 0) return;
    const double s = seconds_since(start_);
    if (s < next_progress_) return;
    next_progress_ = s + options_.progress_s;
    int64_t done = 0, waiting = 0, sampled = 0;
    for (const auto& q : seqs_) {
      done += q.state == SeqState::kDone;
      waiting += q.state == SeqState::kWaiting;
      sampled += q.traj.sampled_tokens();
    }
    std::cerr << "\rrollout " << static_cast<int64_t>(s) << " s: " << done << "/" << seqs_.size()
              << " trajectories done, " << static_cast<int64_t>(sampled / s) << " sampled tokens/s, " << waiting
              << " tool calls in flight   " << std::flush;
    printed_ = true;
  }

  // Whether the pending runs (tool replies, feedback: several tokens each) go in this pass's feed, or wait
  // so that more share its forward (rollout.feed_wait). Marks when each run was first held back.
  bool feed_now(bool nothing_to_decode, int64_t step) {
    int64_t ready = 0, live = 0, oldest = step;
    for (auto& s : seqs_) {
      live += s.state == SeqState::kGenerating || s.state == SeqState::kWaiting;
      if (s.pending.size() < 2) continue;
      ++ready;
      if (s.run_since < 0) s.run_since = step;
      oldest = std::min(oldest, s.run_since);
    }
    if (ready == 0) return false;
    if (!options_.multi_token_feed || options_.feed_wait == 0 || nothing_to_decode) return true;
    return 8 * ready >= live || step - oldest >= options_.feed_wait;  // an eighth of the live rows, rounded up
  }

  bool any_waiting() const {
    for (const auto& s : seqs_) {
      if (s.state == SeqState::kWaiting) return true;
    }
    return false;
  }

  // Appends the output of every finished tool call; with block, first waits until at least one is done.
  void collect_tools(bool block) {
    for (;;) {
      bool got = false;
      for (auto& s : seqs_) {
        if (s.state != SeqState::kWaiting) continue;
        if (s.tool.wait_for(std::chrono::seconds(0)) != std::future_status::ready) continue;
        take_tool_reply(s);
        got = true;
      }
      if (got || !block) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  // The result of s's tool call (waiting for it) appended as its reply turn.
  void take_tool_reply(Seq& s) {
    SandboxResult r = s.tool.get();
    tool_latency_s_ += seconds_since(s.tool_sent);
    tool_run_s_ += r.wall_ms / 1e3;
    s.traj.tool_timeouts += r.timed_out;
    if (append_forced(s, reply_turn(format_tool_output(r)))) next_turn(s);
  }

  void release_finished() {
    std::vector<int64_t> done;
    for (size_t n = 0; n < seqs_.size(); ++n) {
      if (seqs_[n].state == SeqState::kDone && !released_[n]) {
        released_[n] = true;
        done.push_back(static_cast<int64_t>(n));
      }
    }
    if (!done.empty()) policy_.release(pids(done));
  }

 private:
  TokenPolicy& policy_;
  const Tokenizer& tok_;
  const SamplingOptions& sampling_;
  const RolloutOptions& options_;
  const ToolRunner& tools_;
  const ToolProtocol& protocol_;
  const std::vector<int64_t> reply_open_, reply_close_;  // the reply framing's tokens
  const TurnEndFilter turn_filter_;                      // when a sampled piece can end a turn
  std::vector<std::vector<int64_t>> prompts_;            // to admit: a carry's never begun, then the step's
  std::vector<int64_t> keys_;                            // prompts_' noise streams
  int64_t base_ = 0;                                     // the sequences of carried groups begun come first
  std::vector<int64_t> group_keys_;                      // each group's key: the begun carried ones, then prompts_'
  RolloutCarry* carry_ = nullptr;
  int64_t version_ = 0;      // RolloutCarry::version: each new token's
  int64_t rows_ = 0;         // sequences held at once, at most
  int64_t next_prompt_ = 0;  // prompts_ [0, next_prompt_) were admitted
  std::vector<Seq> seqs_;
  std::vector<bool> released_;
  std::vector<int64_t> pid_;  // each sequence's id in the policy (-1: not started in this rollout)
  int64_t next_pid_ = 0;
  int64_t forced_tokens_ = 0;
  std::unique_ptr<SuffixDrafter> drafter_;  // rollout.speculative
  int64_t biased_ = 0;                      // SpeculationFault::kBiasToDraft's rejections
  double tool_latency_s_ = 0;               // RolloutStats::tool_latency_s
  double tool_run_s_ = 0;                   // RolloutStats::tool_run_s
  Clock::time_point start_;
  double next_progress_ = 0;  // seconds since start_ of the next live line
  bool printed_ = false;
};

}  // namespace

std::string turn_end(const std::string& text, const ToolProtocol& protocol) {
  switch (classify_turn(text, protocol).kind) {
    case TurnEnd::kNone:
      return "";
    case TurnEnd::kCode:
      return "code";
    case TurnEnd::kBadCode:
      return "bad_code";
    case TurnEnd::kBadCall:
      return "bad_call";
    case TurnEnd::kAnswer:
      return "answer";
    case TurnEnd::kFakeOutput:
      return "fake_output";
  }
  return "";
}

TurnEndFilter::TurnEndFilter(const ToolProtocol& p) : triggers_("`}") {
  for (const std::string* tag : {&p.code_close, &p.call_close, &p.output_open, &p.output_close}) {
    if (!tag->empty() && triggers_.find(tag->back()) == std::string::npos) triggers_ += tag->back();
  }
}

std::vector<Trajectory> rollout(TokenPolicy& policy, const Tokenizer& tokenizer,
                                const std::vector<std::vector<int64_t>>& prompts, const SamplingOptions& sampling,
                                const RolloutOptions& options, const ToolRunner& tools,
                                const std::vector<int64_t>& streams, const ToolProtocol& protocol, RolloutStats* stats,
                                RolloutCarry* carry) {
  const auto t0 = Clock::now();
  RolloutStats local;
  TORCH_CHECK(streams.empty() || streams.size() == prompts.size(), "rollout: one stream per prompt");
  TORCH_CHECK(!options.tools || tools, "rollout: rollout.tools is on but no tool runner was given");
  const int64_t P = static_cast<int64_t>(prompts.size());
  for (const auto& p : prompts) {
    TORCH_CHECK(static_cast<int64_t>(p.size()) < options.max_context, "rollout: a prompt of ", p.size(),
                " tokens leaves no room within rollout.max_context = ", options.max_context);
  }
  std::vector<int64_t> prompt_streams(P);
  for (int64_t p = 0; p < P; ++p) prompt_streams[p] = streams.empty() ? p : streams[p];
  Loop loop(policy, tokenizer, sampling, options, tools, protocol);
  // The loop reserves the policy's rows while prompts remain; a rollout that throws leaves none reserved.
  struct ClearReserve {
    TokenPolicy& policy;
    ~ClearReserve() { policy.reserve_rows(0); }
  } clear_reserve{policy};
  std::vector<Trajectory> out = loop.run(prompts, prompt_streams, options.max_batch, local, carry);
  if (stats) {
    local.total_s = seconds_since(t0);
    *stats = local;
  }
  return out;
}

void assign_rewards(std::vector<Trajectory>& trajectories, const std::vector<std::string>& answers,
                    const RewardOptions& options) {
  for (auto& t : trajectories) {
    TORCH_CHECK(t.prompt_index >= 0 && t.prompt_index < static_cast<int64_t>(answers.size()),
                "assign_rewards: no answer for prompt ", t.prompt_index);
    const RewardResult r = compute_reward(t.response_text, answers[t.prompt_index], t.tool_calls, options);
    t.reward = r.reward;
    t.correct = r.correct;
  }
}

}  // namespace rlt
