// Rewards: last-\boxed{} extraction, normalisation, exact matching (each known-good row beside a
// known-bad one, so a matcher that accepts everything fails), and the reward values of both kinds.
#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "data/reward.h"

namespace rlt {
namespace {

struct ExtractRow {
  const char* text;
  std::optional<std::string> expected;
};

TEST(Reward, ExtractLastBoxed) {
  const std::vector<ExtractRow> table = {
      {"The answer is \\boxed{42}.", "42"},
      {"Answer: \\boxed{287663}", "287663"},
      {"\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"},              // nested braces balanced
      {"first \\boxed{1}, then \\boxed{2}", "2"},             // two boxes: the last
      {"Let {x} = {y}; so \\boxed{x^{2}} and {z}", "x^{2}"},  // other braces around
      {"\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"},                  // escaped braces do not count
      {"\\boxed{\\boxed{3}}", "\\boxed{3}"},                  // a box in a box is the outer answer
      {"\\boxed {7}", "7"},                                   // space before the brace
      {"\\boxed{}", ""},                                      // present but empty
      {"\\boxed{12", std::nullopt},                           // unclosed
      {"\\boxed{3} but actually \\boxed{4", std::nullopt},    // the last one unclosed: truncated
      {"no answer here {1}", std::nullopt},                   // none
      {"\\boxed 5", std::nullopt},                            // no braces: not accepted
      {"\\boxedx{5}", std::nullopt},                          // another command
      {"\\boxed 5 and \\boxed{6}", "6"},
      {"", std::nullopt},
  };
  for (const ExtractRow& row : table) {
    EXPECT_EQ(extract_last_boxed(row.text), row.expected) << "text: " << row.text;
  }
}

TEST(Reward, NormalizeAnswer) {
  const std::vector<std::pair<const char*, const char*>> table = {
      {"1,234", "1234"},
      {"1{,}234", "1234"},
      {"1\\,234", "1234"},
      {"1 234", "1234"},
      {"1,234,567.50", "1234567.5"},
      {"-1,234", "-1234"},
      {"1,23", "1,23"},  // not groups of three: not a separator
      {"1,2", "1,2"},    // a list stays a list
      {"$42$", "42"},
      {"$$42$$", "42"},
      {"\\text{42}", "42"},
      {"\\text {42}", "42"},
      {"1\\ 234", "1234"},
      {"\\quad 5", "5"},
      {"\\textbf{7}", "7"},
      {"\\mathrm{ 8 }", "8"},
      {"\\left(1, 2\\right)", "(1,2)"},
      {"x\\rightarrow y", "x\\rightarrowy"},  // \right is removed only as a whole command
      {"42.", "42"},
      {"+5", "5"},
      {"007", "7"},
      {"12.50", "12.5"},
      {"3.0", "3"},
      {".5", "0.5"},
      {"-0.0", "0"},
      {"- 3", "-3"},
      {"\xE2\x88\x92"
       "5",
       "-5"},  // Unicode minus
      {"\\dfrac12", "\\frac{1}{2}"},
      {"\\tfrac{1}{2}", "\\frac{1}{2}"},
      {"\\frac 1 2", "\\frac{1}{2}"},
      {"\\frac\\pi2", "\\frac{\\pi}{2}"},
      {"\\displaystyle\\frac{3}{4}", "\\frac{3}{4}"},
      {"  x + 1 ", "x+1"},
      {"", ""},
  };
  for (const auto& [in, out] : table) EXPECT_EQ(normalize_answer(in), out) << "input: " << in;
}

struct MatchRow {
  const char* predicted;
  const char* reference;
  bool match;
};

TEST(Reward, AnswersMatch) {
  // Pairs: a known-good row, then a known-bad one of the same form.
  const std::vector<MatchRow> table = {
      {"1,234", "1234", true},
      {"1,234", "1235", false},
      {"0.5", "1/2", true},
      {"0.5", "1/3", false},
      {"1/2", "\\frac{1}{2}", true},
      {"\\frac{1}{2}", "\\frac{1}{3}", false},
      {"\\dfrac12", "0.5", true},  // decided: the \frac12 shorthand is accepted
      {"\\dfrac13", "0.5", false},
      {"\\frac{2}{4}", "1/2", true},  // compared in lowest terms
      {"\\frac{2}{4}", "2/3", false},
      {"-3", "- 3", true},
      {"-3", "3", false},
      {"12.50", "12.5", true},
      {"12.50", "12.05", false},
      {"$42$", "42", true},
      {"$42$", "24", false},
      {"\\text{42}", "42", true},
      {"\\text{42}", "4.2", false},
      {"007", "7", true},
      {"007", "70", false},
      {"12", "12", true},
      {"12", "13", false},
      {"2/6", "1/3", true},
      {"0.33", "1/3", false},  // exact: no float tolerance
      {"0.333333333333333333333333333333", "1/3", false},
      {"-\\frac{1}{2}", "-0.5", true},
      {"-\\frac{1}{2}", "0.5", false},
      {"\\frac{-1}{2}", "-1/2", true},
      {"\\frac{-1}{2}", "1/2", false},
      {"5", "5.000", true},
      {"5", "5.001", false},
      {"-0", "0", true},
      {"-1", "0", false},
      // Past 128 bits: string equality only.
      {"123456789012345678901234567890123456789012", "123456789012345678901234567890123456789012", true},
      {"123456789012345678901234567890123456789012", "123456789012345678901234567890123456789013", false},
      {"1/0", "1/0", true},  // not a number, but the same string
      {"1/0", "2/0", false},
      {"x+1", "x + 1", true},
      {"x+1", "1+x", false},   // symbolic equivalence is left out
      {"1e3", "1000", false},  // scientific notation is left out
      {"", "", false},         // an empty answer matches nothing
      {"", "0", false},
  };
  for (const MatchRow& row : table) {
    EXPECT_EQ(answers_match(row.predicted, row.reference), row.match)
        << "'" << row.predicted << "' vs '" << row.reference << "'";
    EXPECT_EQ(answers_match(row.reference, row.predicted), row.match)
        << "symmetric: '" << row.reference << "' vs '" << row.predicted << "'";
  }
}

// Rewards are sums of a few decimal constants in double; 1e-12 is far below the 0.1 step between
// neighbouring values, so a wrong step still fails.
constexpr double kRewardTol = 1e-12;

TEST(Reward, ToolShapingValues) {
  // ReTool recipe (verl recipe/retool/retool.py): wrong -> min(-0.6, -1 + (num_turns - 2) / 2 * 0.1).
  // verl's num_turns = 1 (prompt) + assistant turns + tool responses = 1 + (k + 1) + k = 2k + 2 for k
  // tool calls ending in an answer, so the credit is k * 0.1:
  //   k = 0: min(-0.6, -1.0) = -1.0      k = 1: -0.9      k = 2: -0.8      k = 3: -0.7
  //   k = 4: min(-0.6, -0.6) = -0.6      k = 6: min(-0.6, -0.4) = -0.6    k = 10: -0.6
  const RewardOptions o;  // boxed_tool_shaping, +1 / -1
  const std::vector<std::pair<int64_t, double>> wrong = {{0, -1.0}, {1, -0.9}, {2, -0.8},  {3, -0.7},
                                                         {4, -0.6}, {6, -0.6}, {10, -0.6}, {100, -0.6}};
  for (const auto& [calls, expected] : wrong) {
    const RewardResult r = compute_reward("so \\boxed{13}", "12", calls, o);
    EXPECT_NEAR(r.reward, expected, kRewardTol) << calls << " tool calls";
    EXPECT_FALSE(r.correct);
    EXPECT_TRUE(r.has_answer);
    EXPECT_EQ(r.extracted, "13");
  }
  // No answer at all is shaped like a wrong one.
  const RewardResult none = compute_reward("I give up", "12", 3, o);
  EXPECT_NEAR(none.reward, -0.7, kRewardTol);
  EXPECT_FALSE(none.has_answer);
  // A correct answer earns +1 whatever the tool use.
  for (int64_t calls : {0, 2, 10}) {
    const RewardResult r = compute_reward("Answer: \\boxed{12}", "12", calls, o);
    EXPECT_NEAR(r.reward, 1.0, kRewardTol);
    EXPECT_TRUE(r.correct);
  }
  // Known-bad: the tolerance separates neighbouring steps.
  EXPECT_GT(std::abs(compute_reward("\\boxed{1}", "2", 2, o).reward - (-0.7)), kRewardTol);
}

TEST(Reward, PlainBoxed) {
  RewardOptions o;
  o.kind = RewardKind::kBoxed;
  EXPECT_EQ(compute_reward("\\boxed{\\frac{1}{2}}", "0.5", 0, o).reward, 1.0);
  EXPECT_EQ(compute_reward("\\boxed{0.4}", "0.5", 5, o).reward, -1.0);  // no tool credit
  EXPECT_EQ(compute_reward("0.5", "0.5", 0, o).reward, -1.0);           // unboxed is no answer
  const RewardResult empty = compute_reward("\\boxed{ }", "0", 0, o);
  EXPECT_FALSE(empty.has_answer);
  EXPECT_EQ(empty.reward, -1.0);
  // Only the last box counts: a right answer revised into a wrong one is wrong.
  EXPECT_EQ(compute_reward("\\boxed{7} no wait \\boxed{8}", "7", 0, o).reward, -1.0);
  o.correct = 2.0;
  o.wrong = -0.5;
  EXPECT_EQ(compute_reward("\\boxed{7}", "7", 0, o).reward, 2.0);
  EXPECT_EQ(compute_reward("\\boxed{6}", "7", 0, o).reward, -0.5);
  EXPECT_THROW(compute_reward("\\boxed{6}", "7", -1, o), std::invalid_argument);
}

TEST(Reward, OptionsAndNames) {
  EXPECT_STREQ(enum_to_string(RewardKind::kBoxed), "boxed");
  EXPECT_STREQ(enum_to_string(RewardKind::kBoxedToolShaping), "boxed_tool_shaping");
  std::vector<std::string> failed;
  const FieldFail fail = [&](const std::string& key, const std::string&) { failed.push_back(key); };
  RewardOptions o;
  o.check(fail);
  EXPECT_TRUE(failed.empty());
  o.correct = -2.0;  // below wrong
  o.check(fail);
  EXPECT_EQ(failed, (std::vector<std::string>{"correct", "wrong"}));
  failed.clear();
  o.correct = 1.0;
  o.wrong = 0.7;  // shaped wrong could reach 1.1 > correct
  o.check(fail);
  EXPECT_EQ(failed, std::vector<std::string>{"wrong"});
  failed.clear();
  o.kind = RewardKind::kBoxed;  // no shaping: 0.7 < 1 is fine
  o.check(fail);
  EXPECT_TRUE(failed.empty());
}

}  // namespace
}  // namespace rlt
