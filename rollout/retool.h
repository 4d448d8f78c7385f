// The ReTool multi-turn loop: the policy writes text and tool calls; a turn ends at a call's close tag
// (</code>, the close of a ```python block, or </tool_call>: rollout/tools.h), at a closed \boxed{...}, or
// at EOS. Code runs in the sandbox and its output is appended in the protocol's reply framing (an
// <interpreter> block, or the chat template's tool turn) as tokens with loss_mask = 0 and no log-probs;
// a malformed call is answered in the same framing with what is wrong, and the run goes on. Generation
// goes on until an answer, EOS, the turn limit, the tool-call limit, or the context budget (then
// truncated and marked so).
//
// Token in, token out: a trajectory holds the exact sampled ids with their sampling log-probs, and tool
// output is tokenised on its own and appended; the model's text is never re-tokenised, so the trainer
// scores exactly the tokens that were sampled.
//
// Tool calls run concurrently on a pool and never stall the batch: a sequence waiting for its tool is
// just not fed, and the others keep decoding (rollout/engine.h). A reply enters the cache in one
// multi-token forward (TokenPolicy::extend), not one decode step per token. Under rollout.max_batch, the
// rows that finished trajectories release are refilled from the remaining prompts, an eighth of the rows
// at a time (TokenPolicy::admit): continuous batching, with the trajectories of one batch.
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "common/fields.h"
#include "data/reward.h"
#include "rollout/draft.h"
#include "rollout/engine.h"
#include "rollout/sampler.h"
#include "rollout/sandbox.h"
#include "rollout/tools.h"

namespace rlt {

class Tokenizer;

enum class FinishReason {
  kAnswer,     // a closed \boxed{...}
  kEos,        // the end-of-sequence token
  kStop,       // a configured stop string
  kMaxTurns,   // the turn limit (a code or feedback turn past it)
  kToolLimit,  // a tool call past rollout.max_tool_calls
  kLength,     // sampling.max_new_tokens in one turn (truncated)
  kContext,    // rollout.max_context tokens (truncated)
};
inline const EnumNames<FinishReason>& enum_names(FinishReason) {
  static const EnumNames<FinishReason> names{{"answer", FinishReason::kAnswer},
                                             {"eos", FinishReason::kEos},
                                             {"stop", FinishReason::kStop},
                                             {"max_turns", FinishReason::kMaxTurns},
                                             {"tool_limit", FinishReason::kToolLimit},
                                             {"length", FinishReason::kLength},
                                             {"context", FinishReason::kContext}};
  return names;
}

// rollout.speculative: none, or drafts from text already seen (rollout/draft.h), each verified in one forward.
enum class Speculative { kNone, kSuffix };
inline const EnumNames<Speculative>& enum_names(Speculative) {
  static const EnumNames<Speculative> names{{"none", Speculative::kNone}, {"suffix", Speculative::kSuffix}};
  return names;
}

// Wrong speculative rollouts the tests must reject: each drafted token taken as sampled (kWholeDraft); the
// token drawn one position on taken at each position (kOffByOne); every position's noise that of the run's
// first (kStepNoise: noise indexed by the verifying forward, not the token); the rejected tokens left in
// the cache (kVisibleRejects); a rejected draft token taken anyway at every other rejection (kBiasToDraft).
enum class SpeculationFault { kNone, kWholeDraft, kOffByOne, kStepNoise, kVisibleRejects, kBiasToDraft };

struct RolloutOptions {
  bool tools = true;
  int64_t max_turns = 16;
  int64_t max_tool_calls = 16;
  int64_t max_context = 9216;
  int64_t max_tool_output_tokens = 256;
  // The trainer builds the run's ToolProtocol from tool_format, tool_name and the chat template.
  ToolFormat tool_format = ToolFormat::kCode;
  std::string tool_name = "code_interpreter";
  std::string stop;
  // Token ids that end a trajectory (FinishReason::kEos). Not a config key: the trainer sets them from the
  // checkpoint's generation_config.json and the tokenizer's EOS. Empty: the tokenizer's EOS alone.
  std::vector<int64_t> stop_ids;
  // A malformed <tool_call> is answered with what is wrong in it instead.
  std::string feedback = "Format error: put Python code between <code> and </code>, or end with Answer: \\boxed{...}.";
  // 0 holds all prompts x samples_per_prompt. Continuous batching: the rollout starts with as many whole
  // prompts as fit (at least one), and once finished trajectories have released an eighth of the rows (at
  // least samples_per_prompt; or what the last prompts need, or any when nothing else is left to decode),
  // admits the next prompts into them in one prefill, while the others run on (TokenPolicy::admit). A
  // prompt's samples always start together, on one shared prefill. The trajectories are those of
  // max_batch = 0: sampling noise depends on the sequence, not its batch.
  int64_t max_batch = 0;
  // The decode engine's switches (rollout.cuda_graphs, fused_kernels, packed_weights, cache_attention,
  // feed_graphs, keep_cache), as the engine takes them. Evaluation rollouts make their engine each time,
  // whatever keep_cache says.
  EngineSwitches engine;
  // The forward is TokenPolicy::extend; the trajectories are the same either way, up to rounding.
  bool multi_token_feed = true;
  // The replies are fed once an eighth of the live sequences have one, or the oldest has waited this long,
  // or no row is left to decode. A feed is an eager forward (about four decode steps' time): in
  // bench_rollout on an H100 (two runs), 4 against 0 gives 40 feeds against 74-82 and 0.25 s less feed
  // time, for 38-46 more decode steps; the rollouts are 1% and 10% shorter. The trajectories are the same
  // up to rounding.
  int64_t feed_wait = 4;
  // The pass is then one forward, not a decode step and a feed (runs of one token in TokenPolicy::extend).
  // With feed_graphs on a GPU (bf16/fp16, no q/k norm or sliding window) that forward is DecodeEngine's
  // merged pass: the step and the feed share their weight reads (docs/benchmarks.md, "A feed, a merged
  // pass, a squeeze"). Elsewhere it pads every row to the feed's length, which costs about what it saves in
  // decode steps (docs/benchmarks.md, design notes): off by default, as feed_graphs is.
  bool merge_feeds = false;
  // false frees the gathered weights before the update, and the rollout gathers a layer at a time.
  bool keep_weights = false;
  // The unfinished groups continue under the weights published by then (RolloutCarry). The extra groups
  // let the longest trajectories wait for the next step instead of holding this one; with several ranks
  // their count is rounded up to a multiple of the ranks.
  bool partial = false;
  int64_t partial_extra_prompts = 0;
  int64_t max_staleness = 2;
  double progress_s = 10;
  // Speculative rollouts (docs/rollout.md, "Speculative rollouts"). A pass whose decode rows are at most
  // speculative_max_rows feeds each row's last token and its draft (up to draft_tokens, fewer after
  // rejections: a row's next draft is one longer than its last accepted part, or one more after a whole
  // draft was taken) in one forward (TokenPolicy::extend_each_draw), draws each position's token as plain
  // decoding would (its own counter's noise), and keeps the draft up to the first token drawn otherwise,
  // that token included; the rest is taken back (TokenPolicy::retract). The samples are plain decoding's
  // wherever the two forwards give the same logits.
  Speculative speculative = Speculative::kNone;
  int64_t draft_tokens = 4;
  int64_t speculative_max_rows = 32;
  int64_t draft_history_tokens = 4000000;
  // Not config keys. The responses of earlier rollouts, by prompt (the trainer keeps one for the run; null:
  // only this rollout's texts), and a wrong verification for the tests.
  std::shared_ptr<DraftHistory> draft_history;
  SpeculationFault speculation_fault = SpeculationFault::kNone;

  template <class V>
  void visit(V&& v) {
    v("tools", tools, "run code turns in the sandbox; false: plain generation (code is just text)");
    v("tool_format", tool_format,
      "how the policy calls the tool: code (<code>, ```python) | tool_call (<tool_call>{json})");
    v("tool_name", tool_name, "the tool's name in tool_call format and in the schema the chat template lists");
    v("max_turns", max_turns, "assistant turns per trajectory, the first included", FieldRange{1, 1e6});
    v("max_tool_calls", max_tool_calls,
      "code executions per trajectory; a call past it ends the trajectory (tool_limit)", FieldRange{0, 1e6});
    v("max_context", max_context,
      "prompt + response tokens per sequence; reaching it truncates the trajectory (context)", FieldRange{2, 1e9});
    v("max_tool_output_tokens", max_tool_output_tokens, "tokens of one tool output kept; the rest is cut and marked",
      FieldRange{1, 1e9});
    v("stop", stop, "extra stop string that ends a trajectory; empty = none");
    v("feedback", feedback,
      "reply, as a tool turn, to an unparseable turn: empty or unopened code block, or fake interpreter output");
    v("max_batch", max_batch, "sequences held at once, finished ones refilled from the next prompts; 0 = all",
      FieldRange{0, 1e9});
    engine.visit(v);
    v("multi_token_feed", multi_token_feed,
      "a tool's reply (or feedback) enters in one forward (false: one token per step)");
    v("feed_wait", feed_wait,
      "multi_token_feed: decode steps a ready tool reply may wait to share its forward with others; 0 = none",
      FieldRange{0, 1e6});
    v("merge_feeds", merge_feeds,
      "multi_token_feed: a pass that feeds tool replies takes its one-token rows in the same forward");
    v("keep_weights", keep_weights,
      "train.shard parameters: keep the gathered bf16 weights through the update (2 bytes a parameter more)");
    v("partial", partial,
      "train.async one_step: a rollout ends once a step's groups are complete; the others continue in the next");
    v("partial_extra_prompts", partial_extra_prompts,
      "rollout.partial: groups in play beyond a step's, at most train.prompts_per_step; 0 = a quarter of it",
      FieldRange{0, 1e6});
    v("max_staleness", max_staleness,
      "rollout.partial: the most weights versions one trajectory's tokens span (newest - oldest + 1)",
      FieldRange{2, 1e6});
    v("progress_s", progress_s,
      "seconds before, and between, a long rollout's live stderr lines (done, tokens/s, tool calls); 0 = none",
      FieldRange{0, 1e9});
    v("speculative", speculative,
      "none | suffix: drafts from the group's and earlier rollouts' text, verified in one forward (same samples)");
    v("draft_tokens", draft_tokens,
      "rollout.speculative: the longest draft a row feeds (with its last token, a run of at most 8)", FieldRange{1, 7});
    v("speculative_max_rows", speculative_max_rows,
      "rollout.speculative: a pass with more rows to decode than this is a plain decode step", FieldRange{1, 1e9});
    v("draft_history_tokens", draft_history_tokens,
      "rollout.speculative: response tokens of earlier rollouts kept as drafts' sources, by prompt",
      FieldRange{0, 1e12});
  }
  void check(const FieldFail& fail) const {
    if (tool_name.empty()) fail("tool_name", "must not be empty");
  }
};

struct Trajectory {
  int64_t prompt_index = 0;           // which prompt of the batch
  int64_t sample_index = 0;           // which of its samples_per_prompt completions
  std::vector<int64_t> prompt_ids;    // (Lp)
  std::vector<int64_t> response_ids;  // (R) sampled tokens and tool/feedback tokens, in order
  std::vector<uint8_t> loss_mask;     // (R) 1 = sampled by the policy, 0 = tool output or feedback
  std::vector<float> logprobs;        // (R) sampling log-probs; 0 where loss_mask = 0
  FinishReason finish = FinishReason::kEos;
  bool truncated = false;  // ended by a length or context limit
  int64_t turns = 1, tool_calls = 0, feedback_turns = 0, tool_timeouts = 0;
  std::string response_text;  // the model-written text only (rewards read this)
  double reward = 0;
  bool correct = false;
  double overlong_penalty = 0;  // of reward, the overlong shaping added to it (reward.overlong_buffer)
  // The version of the weights that began it: the RL steps they had taken (train.async: one behind the
  // update that trains on it; in turn, the update's own).
  int64_t weights_version = 0;
  // (R) the version of the weights in use when each response token was sampled or appended: all
  // weights_version, unless rollout.partial continued it under newer weights.
  std::vector<int64_t> versions;

  // The response window in ids(): [begin, end).
  int64_t window_begin() const { return static_cast<int64_t>(prompt_ids.size()); }
  int64_t window_end() const { return window_begin() + static_cast<int64_t>(response_ids.size()); }
  std::vector<int64_t> ids() const;  // prompt_ids + response_ids
  int64_t sampled_tokens() const;    // sum(loss_mask)
};

// Runs one piece of code; returns a future so calls overlap (SandboxPool::submit fits).
using ToolRunner = std::function<std::future<SandboxResult>(const std::string& code)>;

// The tool's output as the reply shows it: stdout, then stderr when the code failed, and a note for a
// timeout or truncation.
std::string format_tool_output(const SandboxResult& r);

// How the loop reads a turn after each sampled token (exposed for tests): how the turn's text ends it, as
// "" (it goes on), "code", "bad_code", "bad_call", "answer" or "fake_output".
std::string turn_end(const std::string& text, const ToolProtocol& protocol);

// Whether a sampled token's text can end a turn that had not ended before it. A turn ends only at the last
// character of a tag (the call's close, the interpreter's open or close), at a fence's backtick or at an
// answer's closing brace: a piece holding none of them leaves turn_end() at "" (whitespace after a fence
// too: the fence test reads up to the last non-blank character). The loop reads the turn only when this
// says so; the full reading scans the turn's whole text, once per token of every row.
class TurnEndFilter {
 public:
  explicit TurnEndFilter(const ToolProtocol& protocol);
  explicit TurnEndFilter(std::string triggers) : triggers_(std::move(triggers)) {}
  bool may_end(const std::string& piece) const { return piece.find_first_of(triggers_) != std::string::npos; }
  const std::string& triggers() const { return triggers_; }

 private:
  std::string triggers_;  // the characters that can end a turn
};

// Where a rollout's wall time went. Decode steps are synchronised with the device so that their time is the
// model's, not the sampler's.
struct RolloutStats {
  int64_t decode_steps = 0;  // one-token policy steps (a step feeds every sequence with one pending token)
  int64_t fed_rows = 0;      // sequences fed, summed over the decode steps
  // Multi-token forwards (TokenPolicy::extend): tool replies or feedback, whole. With rollout.merge_feeds
  // such a forward also takes its pass's one-token rows: they count here (feed_tokens, feed_s), not in
  // decode_steps or fed_rows.
  int64_t feed_steps = 0;
  int64_t feed_tokens = 0;    // tokens fed by those (a reply, and the sampled token before it if still unfed)
  int64_t forced_tokens = 0;  // tool output and feedback tokens (fed in the multi-token forwards)
  int64_t refills = 0;        // prompts admitted into released rows after the start (rollout.max_batch)
  double prefill_s = 0;       // the prompts' prefill, the first prompts' and the admitted ones'
  double decode_s = 0;        // the decode steps: forward, and the draw of the fed rows' tokens (step_draw)
  double feed_s = 0;          // the multi-token forwards
  double sample_s = 0;        // sampling after feeds and admits, and taking the tokens steps drew
  double turn_s = 0;          // of sample_s: the host reading the sampled tokens (turn ends, tool calls sent)
  double tool_wait_s = 0;     // blocked on tool calls with nothing else to decode
  // A tool call's latency as the loop sees it, summed over the calls: from its submission to the pass that
  // collected its result (the loop looks once a pass, so up to a decode step more than the sandbox took).
  double tool_latency_s = 0;
  double tool_run_s = 0;  // of it, the sandbox's own clock (SandboxResult::wall_ms: the script's run, supervised)
  // Sequences that sat out a pass of the loop (its decode step, its feed, or both, or one merged forward),
  // summed over the passes: waiting on a tool call, or holding a reply back for a shared feed
  // (rollout.feed_wait). The longest trajectory's sat-out passes lengthen the rollout.
  int64_t tool_wait_row_steps = 0;
  int64_t feed_wait_row_steps = 0;
  double total_s = 0;  // the whole rollout; the rest is host bookkeeping (turn parsing, batching)
  // rollout.partial (RolloutCarry): trajectories continued from the carry (one prefill each), and unfinished
  // ones left in it.
  int64_t resumed = 0;
  int64_t cut = 0;
  // rollout.speculative: the verifying forwards (TokenPolicy::extend_each_draw) and the rows they fed, summed
  // (their time is in decode_s); the draft tokens fed, and of them those sampled as drafted; the tokens the
  // rows that sampled in them sampled (one a row and forward, plus the accepted ones).
  int64_t verify_passes = 0;
  int64_t verify_rows = 0;
  int64_t drafted_tokens = 0;
  int64_t accepted_tokens = 0;
  int64_t verify_sampled = 0;
  int64_t verify_sampling_rows = 0;  // of verify_rows, those that sampled (not waiting on the tool they called)
  // The tail: decode passes (steps or verifying forwards) of at most 16 rows, their time (in decode_s) and
  // the tokens their rows sampled.
  int64_t tail_passes = 0;
  int64_t tail_sampled = 0;
  double tail_s = 0;
};

// rollout.partial: a group whose trajectories were not all finished when its rollout ended. What the loop
// needs to continue them is in the trajectories themselves: a cut trajectory re-enters a cache with all its
// tokens (the last sampled one and a tool's reply included) and samples next, and its current turn's text
// is its sampled tokens after the last appended one.
struct CarriedGroup {
  int64_t key = 0;                  // the prompt's noise stream: sample g draws from stream key * G + g
  std::vector<int64_t> prompt_ids;  // (Lp)
  std::vector<Trajectory> trajs;    // (G) in sample order, finished or cut
  std::vector<uint8_t> started;     // (G) 0: the group's prompt was never admitted (no token yet)
  std::vector<uint8_t> done;        // (G)
};

// A rollout that ends once `groups` groups are complete (rollout.partial), leaving the others for the next:
//   in:  carry, groups to continue before the new prompts (their trajectories re-enter a cache in one
//        prefill each, under the weights in use now);
//   out: carry, the groups this rollout did not return, oldest first; keys, each returned group's key.
// The rollout returns the first `groups` complete groups in order (the carried ones, then the new prompts),
// once that many are complete and no unfinished trajectory must finish here: one whose tokens would span
// more than rollout.max_staleness versions if the next rollout (at version + 1 at most) continued it.
// groups = 0: every group, as a rollout without a carry.
struct RolloutCarry {
  int64_t groups = 0;
  int64_t version = 0;  // the weights' version: each new token's (Trajectory::versions)
  std::vector<CarriedGroup> carry;
  std::vector<int64_t> keys;
};

// One rollout: samples_per_prompt trajectories per prompt, in prompt-major order
// (prompt_index * G + sample_index). Sequence n's sampling noise stream is streams[prompt] * G + g, so a
// prompt's completions do not depend on its batch (streams empty = the prompt's index). With a carry: its
// groups first, then the prompts', the first carry->groups complete ones (see RolloutCarry).
std::vector<Trajectory> rollout(TokenPolicy& policy, const Tokenizer& tokenizer,
                                const std::vector<std::vector<int64_t>>& prompts, const SamplingOptions& sampling,
                                const RolloutOptions& options, const ToolRunner& tools,
                                const std::vector<int64_t>& streams = {}, const ToolProtocol& protocol = {},
                                RolloutStats* stats = nullptr, RolloutCarry* carry = nullptr);

// Fills reward and correct from each trajectory's response_text and tool_calls; answers[i] is prompt i's.
void assign_rewards(std::vector<Trajectory>& trajectories, const std::vector<std::string>& answers,
                    const RewardOptions& options);

}  // namespace rlt
