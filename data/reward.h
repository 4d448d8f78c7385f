// Rewards for boxed-answer tasks, chosen by name in YAML (`reward.kind`): the last \boxed{...} of the
// model's text is extracted, normalised, and compared with the reference as a string or as an exact
// rational number; the tool-shaping variant follows the published ReTool recipe (verl,
// recipe/retool/retool.py) and softens the penalty of wrong answers that used the interpreter.
// Leaves out: symbolic equivalence (x+1 vs 1+x, sqrt forms: that needs a CAS such as sympy), units,
// percentages, degrees, intervals and sets, scientific notation, mixed numbers (1\frac{1}{2}), and
// \fbox. Such answers still match when their normalised strings are equal.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/fields.h"

namespace rlt {

// The content of the LAST \boxed{...} in `text`, braces balanced (so \boxed{\frac{1}{2}} gives
// \frac{1}{2}; escaped \{ and \} do not count). Boxes are found left to right and a box's content is
// skipped whole, so a box nested in a box is part of the outer answer. Returns nullopt when there is no
// box, or when the last one is never closed (a truncated final answer is no answer, even if an earlier
// box closed). "\boxed 5" (no braces) is not an answer: without braces its end is ambiguous
// ("\boxed 5 apples"), and the chat template asks for braces. Spaces between \boxed and { are allowed.
std::optional<std::string> extract_last_boxed(const std::string& text);

// A canonical string for comparing answers. Removes whitespace, $, \left / \right, \displaystyle, LaTeX
// spacing (\, \; \: \! \quad ~), \text{..} / \textbf{..} / \mathrm{..} / \mbox{..} wrappers (content
// kept), one trailing '.', a leading '+'; maps \dfrac / \tfrac to \frac and the shorthand \frac12 to
// \frac{1}{2}, the Unicode minus to '-'; drops thousands separators in a plain number ("1,234",
// "1{,}234", "1\,234", "1 234" -> "1234"); and writes a plain decimal canonically: no leading zeros
// ("007" -> "7", ".5" -> "0.5"), no trailing zeros after the point ("12.50" -> "12.5", "3.0" -> "3"),
// "-0" -> "0".
std::string normalize_answer(const std::string& s);

// True when the normalised answers are equal strings, or are equal as exact rationals. Numbers are
// integers, decimals, a/b and \frac{a}{b} (integer a, b; a sign in front or on a or b), compared in
// lowest terms with 128-bit integers, never through floating point: 0.5 = 1/2 = \frac{1}{2} = \dfrac12,
// but 0.33 != 1/3. A number too large for 128 bits falls back to string equality. An empty answer
// matches nothing.
bool answers_match(const std::string& predicted, const std::string& reference);

enum class RewardKind {
  kBoxed,             // +correct when the last box matches the reference, else wrong (no box included)
  kBoxedToolShaping,  // as kBoxed, but a wrong answer earns back 0.1 per tool call, up to 0.4 (ReTool)
  kPython,            // reward.script's reward(prompt, response, answer), in the sandbox (rollout/python_reward.h)
  kModel,             // reward.model_path's score of the conversation (rollout/reward_model.h)
};
inline const EnumNames<RewardKind>& enum_names(RewardKind) {
  static const EnumNames<RewardKind> names{{"boxed", RewardKind::kBoxed},
                                           {"boxed_tool_shaping", RewardKind::kBoxedToolShaping},
                                           {"python", RewardKind::kPython},
                                           {"model", RewardKind::kModel}};
  return names;
}

// One term of reward.combine: a reward kind (with the reward section's settings for it) and its weight.
struct RewardTerm {
  RewardKind kind = RewardKind::kBoxed;
  double weight = 1.0;

  template <class V>
  void visit(V&& v) {
    v("kind", kind, "boxed | boxed_tool_shaping | python | model");
    v("weight", weight, "the term's weight in the sum", FieldRange{-1e6, 1e6});
  }
  void check(const FieldFail& fail) const {
    if (weight == 0) fail("weight", "a term of weight 0 adds nothing: leave it out");
  }
};

struct RewardOptions {
  RewardKind kind = RewardKind::kBoxedToolShaping;
  double correct = 1.0;
  double wrong = -1.0;
  std::string script;      // made absolute when the config is read
  std::string model_path;  // likewise
  int64_t model_batch_tokens = 16384;
  std::vector<RewardTerm> combine;
  // DAPO's overlong shaping (Yu et al. 2025): overlong_penalty() below gives the ramp, with
  // L = overlong_buffer and P = overlong_penalty, and overlong_budget() the budget B.
  int64_t overlong_buffer = 0;
  double overlong_penalty = 1.0;

  template <class V>
  void visit(V&& v) {
    v("kind", kind,
      "reward function: boxed | boxed_tool_shaping | python | model; left at its default when reward.combine names the "
      "terms");
    v("correct", correct,
      "reward of a correct answer (python: a score >= it counts as correct unless the script's dict says)",
      FieldRange{-1e6, 1e6});
    v("wrong", wrong,
      "reward of a wrong or missing answer (boxed_tool_shaping: before tool credit; python: and of a failed call)",
      FieldRange{-1e6, 1e6});
    v("script", script,
      "python: a .py file defining reward(prompt, response, answer) -> float or dict with score; relative to the "
      "config file's folder (--set: the working directory)");
    v("model_path", model_path,
      "model: a Hugging Face *ForSequenceClassification folder (one label) with its tokenizer and chat template; "
      "relative like script");
    v("model_batch_tokens", model_batch_tokens, "model: the most tokens one scoring forward packs", FieldRange{1, 1e9});
    v("combine", combine,
      "a weighted sum of kinds instead of reward.kind, e.g. [{kind: boxed, weight: 1.0}, {kind: model, weight: 0.5}]; "
      "each term is logged as reward_terms/<kind>");
    v("overlong_buffer", overlong_buffer,
      "DAPO overlong shaping: tokens before the response budget over which the penalty ramps up; 0 = off",
      FieldRange{0, 1e9});
    v("overlong_penalty", overlong_penalty, "DAPO overlong shaping: the penalty at and beyond the budget",
      FieldRange{0, 1e6});
  }
  // The terms the reward sums: reward.combine's, else reward.kind's with weight 1.
  std::vector<RewardTerm> terms() const { return combine.empty() ? std::vector<RewardTerm>{{kind, 1.0}} : combine; }
  bool uses(RewardKind k) const {
    for (const RewardTerm& t : terms()) {
      if (t.kind == k) return true;
    }
    return false;
  }
  // The reward is one rule term of weight 1 (the built-in matchers or the script, as before reward.combine).
  bool single_rule() const {
    return terms().size() == 1 && terms()[0].weight == 1.0 && terms()[0].kind != RewardKind::kModel;
  }

  void check(const FieldFail& fail) const {
    if (uses(RewardKind::kPython) && script.empty()) fail("script", "reward.kind python needs a script");
    if (uses(RewardKind::kModel) && model_path.empty()) fail("model_path", "reward.kind model needs a model_path");
    for (size_t i = 0; i < combine.size(); ++i) {
      for (size_t j = 0; j < i; ++j) {
        if (combine[j].kind == combine[i].kind) {
          fail("combine", std::string("the kind ") + enum_to_string(combine[i].kind) + " is named twice");
        }
      }
    }
    if (uses(RewardKind::kBoxed) && uses(RewardKind::kBoxedToolShaping)) {
      fail("combine", "boxed and boxed_tool_shaping are the same matcher: name one");
    }
    if (!(correct > wrong))
      fail("correct", "must be greater than reward.wrong, or learning would avoid correct answers");
    // The shaped penalty tops out at wrong + 0.4; it must stay below a correct answer's reward.
    if (uses(RewardKind::kBoxedToolShaping) && !(wrong + kToolCreditCap < correct)) {
      fail("wrong", "with boxed_tool_shaping, wrong + 0.4 (the most tool credit) must stay below reward.correct");
    }
  }

  // boxed_tool_shaping, in the recipe's numbers: credit per tool call, and the most credit in all.
  static constexpr double kToolCreditPerCall = 0.1;
  static constexpr double kToolCreditCap = 0.4;
};

struct RewardResult {
  double reward = 0;
  bool correct = false;
  bool has_answer = false;  // a closed \boxed{...} with non-empty content was found
  std::string extracted;    // that box's content as written (empty when none)
};

// DAPO's soft overlong punishment, added to the reward: 0 for n <= B - L, -P (n - (B - L)) / L for
// B - L < n <= B, -P beyond B (L = options.overlong_buffer, P = options.overlong_penalty; 0 when L = 0).
// n is the trajectory's sampled tokens (tool output and feedback left out: the policy did not write
// them); B its response budget (overlong_budget). A budget shorter than L ramps from n = 0.
double overlong_penalty(int64_t sampled_tokens, int64_t budget, const RewardOptions& options);

// The response budget of a trajectory whose prompt has prompt_tokens tokens: what the rollout lets it
// sample, min(max_context - prompt_tokens, max_turns * max_new_tokens) (rollout.max_context,
// rollout.max_turns, sampling.max_new_tokens; one turn when rollout.tools is off). For a single turn it is
// sampling.max_new_tokens unless the context is shorter; for multi-turn tool trajectories the context
// usually binds, and since the tool output inside it is not counted in n, a trajectory stopped by the
// context falls short of B by its tool output.
int64_t overlong_budget(int64_t prompt_tokens, int64_t max_context, int64_t max_turns, int64_t max_new_tokens);

// response_text: the model-written text only (the caller leaves tool output out, so a box printed by
// the interpreter earns nothing). tool_calls: code executions in the trajectory (>= 0).
//   boxed:              correct -> correct, else wrong.
//   boxed_tool_shaping: correct -> correct, else min(wrong + 0.4, wrong + 0.1 * tool_calls); with the
//                       defaults min(-0.6, -1 + 0.1 * tool_calls). The recipe writes the credit as
//                       (num_turns - 2) / 2 * 0.1, where verl's num_turns counts the prompt, every
//                       assistant turn and every tool response: 1 + (k + 1) + k = 2k + 2 for k tool calls
//                       ending in an answer, so (num_turns - 2) / 2 = k.
// Throws std::invalid_argument when tool_calls < 0, and for reward.kind python (the script scores those).
RewardResult compute_reward(const std::string& response_text, const std::string& reference, int64_t tool_calls,
                            const RewardOptions& options);

}  // namespace rlt
