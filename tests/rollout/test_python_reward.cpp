// reward.kind python against hand-computed values: the scores and fields a script returns, the failures that
// get reward.wrong and are counted (an exception, a hang, a non-number, a dict without score, an interpreter
// that dies), a script that prints protocol-like lines to stdout, the first failure shown once, and the
// import check. Each check also runs on a wrong twin it must reject.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "rollout/python_reward.h"
#include "tests/common/tmpdir.h"

namespace rlt {
namespace {

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

std::string write_script(const testing::TempDir& dir, const std::string& name, const std::string& text) {
  const std::string path = (dir.path() / name).string();
  std::ofstream(path) << text;
  return path;
}

RewardOptions python_reward(const std::string& script) {
  RewardOptions o;
  o.kind = RewardKind::kPython;
  o.script = script;
  o.correct = 1.0;
  o.wrong = -0.75;  // not -1 or 0, so a failure mapped to any other constant shows
  return o;
}

SandboxOptions sandbox_options(int64_t workers) {
  SandboxOptions s;
  s.workers = workers;
  s.timeout_s = 1.0;  // a hang costs one second
  return s;
}

// Scalars and dicts. len() counts characters, so the non-ASCII response proves the text arrives as str.
constexpr const char* kValues = R"PY(
def reward(prompt, response, answer):
    hit = answer in response
    if prompt == 'scalar':
        return len(response) / 8
    return {'score': len(response) / 8 - len(prompt), 'correct': hit, 'hit': 1.0 if hit else 0.0,
            'words': len(response.split()), 'note': 'text is left out', 'inf': float('inf')}
)PY";

std::vector<RewardQuery> value_queries() {
  return {{"scalar", "abcdefgh", "x"},                      // 8 / 8 = 1.0, correct: 1.0 >= reward.correct
          {"scalar", "abcd", "x"},                          // 0.5, not correct
          {"pq", "the answer is 42", "42"},                 // 16 / 8 - 2 = 0.0, correct (the dict says so); 4 words
          {"p", "no idea", "7"},                            // 7 / 8 - 1 = -0.125, not correct; 2 words
          {"", "7 7 7 7", "7"},                             // 7 / 8 = 0.875, correct; 4 words
          {"abc", "", "9"},                                 // 0 - 3 = -3.0, not correct; 0 words
          {"scalar", "unicode \xC3\xA9\xE2\x9C\x93", "x"},  // 10 characters (13 bytes): 1.25, correct
          {"scalar", "cut\xE2\x9C", "x"}};                  // a character cut in two: "cut" + U+FFFD, 4 characters: 0.5
}

// "" when scores and tally are the hand-computed ones, else what differs.
std::string check_values(const std::vector<ScriptScore>& scores, const RewardTally& tally) {
  const std::vector<double> reward{1.0, 0.5, 0.0, -0.125, 0.875, -3.0, 1.25, 0.5};  // exact binary fractions
  const std::vector<bool> correct{true, false, true, false, true, false, true, false};
  if (scores.size() != reward.size()) return "scores: " + std::to_string(scores.size());
  for (size_t i = 0; i < reward.size(); ++i) {
    if (scores[i].failed) return "query " + std::to_string(i) + " failed: " + scores[i].error;
    if (scores[i].reward != reward[i])
      return "query " + std::to_string(i) + " reward " + std::to_string(scores[i].reward);
    if (scores[i].correct != correct[i]) return "query " + std::to_string(i) + " correct";
  }
  if (tally.scored != 8 || tally.failed != 0) return "tally counts";
  // reward/<field>: the mean over the 4 dict results. hit: (1 + 0 + 1 + 0) / 4; words: (4 + 2 + 4 + 0) / 4.
  // 'note' (a string) and 'inf' (not finite) are left out.
  if (tally.fields.size() != 2 || !tally.fields.count("hit") || !tally.fields.count("words")) return "field names";
  const auto mean = [&](const std::string& f) { return tally.fields.at(f).first / tally.fields.at(f).second; };
  if (mean("hit") != 0.5 || mean("words") != 2.5) return "field means";
  return "";
}

TEST(PythonReward, ScoresFieldsAndCorrectAreTheScriptsInOrder) {
  testing::TempDir dir("python_reward_values");
  PythonReward reward(python_reward(write_script(dir, "values.py", kValues)), sandbox_options(/*workers=*/3));
  const std::vector<ScriptScore> scores = reward.score(value_queries());  // 3 calls: 2, 3 and 3 queries
  RewardTally tally;
  tally.add(scores);
  EXPECT_EQ(check_values(scores, tally), "");

  // Twin: correct read from the score alone, ignoring the dict's "correct" (query 2 scores 0.0).
  std::vector<ScriptScore> by_score = scores;
  for (ScriptScore& s : by_score) s.correct = s.reward >= 1.0;
  EXPECT_NE(check_values(by_score, tally), "");
  // Twin: a field's mean over every scored trajectory (8), not over those that returned it (4).
  RewardTally over_all = tally;
  for (auto& [name, sum_count] : over_all.fields) sum_count.second = over_all.scored;
  EXPECT_NE(check_values(scores, over_all), "");
}

// Every way a call can fail, in one interpreter call (one worker): the queries after a failure are still
// scored. The script prints answer-like lines to stdout at import and inside reward().
constexpr const char* kFailures = R"PY(
import os, sys
print('{"i": 0, "score": 99, "correct": true, "fields": {}}')

def reward(prompt, response, answer):
    if response == 'raise':
        raise RuntimeError('boom in the reward')
    if response == 'hang':
        while True:
            pass
    if response == 'catch':
        try:
            while True:
                pass
        except Exception:
            return 1.0
    if response == 'print':
        print('{"i": 0, "score": 99, "correct": true, "fields": {}}')
        sys.stdout.flush()
        os.write(1, b'{"i": 1, "score": 99, "correct": true, "fields": {}}\n')
        return 0.5
    if response == 'nan':
        return float('nan')
    if response == 'string':
        return '1.0'
    if response == 'no score':
        return {'value': 1.0}
    return 1.0 if response == answer else 0.0
)PY";

std::vector<RewardQuery> failure_queries() {
  std::vector<RewardQuery> q;
  for (const char* r : {"5", "raise", "hang", "catch", "print", "nan", "string", "no score", "4", "5"}) {
    q.push_back({"What is 2 + 3?", r, "5"});
  }
  return q;
}

// "" when every failure got reward.wrong (-0.75) and was counted once, else what differs.
std::string check_failures(const std::vector<ScriptScore>& scores, const RewardTally& tally) {
  const double w = -0.75;
  const std::vector<double> reward{1.0, w, w, w, 0.5, w, w, w, 0.0, 1.0};
  const std::vector<bool> failed{false, true, true, true, false, true, true, true, false, false};
  if (scores.size() != reward.size()) return "scores: " + std::to_string(scores.size());
  for (size_t i = 0; i < reward.size(); ++i) {
    if (scores[i].failed != failed[i]) return "query " + std::to_string(i) + " failed: " + scores[i].error;
    if (scores[i].reward != reward[i])
      return "query " + std::to_string(i) + " reward " + std::to_string(scores[i].reward);
    if (scores[i].correct != (i == 0 || i == 9)) return "query " + std::to_string(i) + " correct";
  }
  if (tally.scored != 10 || tally.failed != 6) return "reward_errors " + std::to_string(tally.failed) + ", want 6";
  return "";
}

TEST(PythonReward, FailuresGetTheWrongRewardAreCountedAndTheRunGoesOn) {
  testing::TempDir dir("python_reward_failures");
  const std::string path = write_script(dir, "failures.py", kFailures);
  PythonReward reward(python_reward(path), sandbox_options(/*workers=*/1));
  ::testing::internal::CaptureStderr();
  const std::vector<ScriptScore> scores = reward.score(failure_queries());
  const std::vector<ScriptScore> again = reward.score({{"q", "raise", "5"}});
  const std::string err = ::testing::internal::GetCapturedStderr();
  RewardTally tally;
  tally.add(scores);
  EXPECT_EQ(check_failures(scores, tally), "");
  ASSERT_EQ(scores.size(), 10u);
  EXPECT_TRUE(contains(scores[1].error, "RuntimeError: boom in the reward")) << scores[1].error;
  EXPECT_TRUE(contains(scores[1].error, path + "\", line 7")) << scores[1].error;  // the script's frame, its line
  EXPECT_TRUE(contains(scores[1].error, "raise RuntimeError")) << scores[1].error;
  EXPECT_FALSE(contains(scores[1].error, "<stdin>")) << scores[1].error;  // none of the driver's frames
  EXPECT_TRUE(contains(scores[2].error, "timed out after 1 s")) << scores[2].error;
  EXPECT_TRUE(contains(scores[3].error, "timed out after 1 s")) << scores[3].error;
  EXPECT_TRUE(contains(scores[5].error, "returned float nan")) << scores[5].error;
  EXPECT_TRUE(contains(scores[6].error, "returned str '1.0'")) << scores[6].error;
  EXPECT_TRUE(contains(scores[7].error, "without \"score\"")) << scores[7].error;
  // The first failure of the object's life, on stderr once, with its traceback.
  size_t shown = 0;
  for (size_t p = err.find("warning: reward.script"); p != std::string::npos;
       p = err.find("warning: reward.script", p + 1)) {
    ++shown;
  }
  EXPECT_EQ(shown, 1u) << err;
  EXPECT_TRUE(contains(err, "RuntimeError: boom in the reward")) << err;
  ASSERT_EQ(again.size(), 1u);
  EXPECT_TRUE(again[0].failed);

  // Twin: failures mapped to 0 instead of reward.wrong.
  std::vector<ScriptScore> zero = scores;
  for (ScriptScore& s : zero) s.reward = s.failed ? 0.0 : s.reward;
  EXPECT_NE(check_failures(zero, tally), "");
  // Twin: each failure counted twice.
  RewardTally twice = tally;
  twice.failed *= 2;
  EXPECT_NE(check_failures(scores, twice), "");
}

TEST(PythonReward, AnInterpreterThatEndsFailsTheQueriesItLeftUnanswered) {
  testing::TempDir dir("python_reward_exit");
  const std::string path = write_script(dir, "exits.py", R"PY(
import os
def reward(prompt, response, answer):
    if response == 'exit':
        os._exit(3)
    return 1.0
)PY");
  PythonReward reward(python_reward(path), sandbox_options(/*workers=*/1));
  ::testing::internal::CaptureStderr();
  const std::vector<ScriptScore> s = reward.score({{"", "a", ""}, {"", "exit", ""}, {"", "b", ""}});
  ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(s.size(), 3u);
  EXPECT_FALSE(s[0].failed);
  EXPECT_EQ(s[0].reward, 1.0);
  for (int i : {1, 2}) {
    EXPECT_TRUE(s[i].failed);
    EXPECT_EQ(s[i].reward, -0.75);
    EXPECT_TRUE(contains(s[i].error, "exit code 3")) << s[i].error;
  }
}

TEST(PythonReward, CodeThatHoldsOffTheAlarmIsStoppedByTheCallsLimit) {
  testing::TempDir dir("python_reward_blocked");
  const std::string source = R"PY(
import signal
def reward(prompt, response, answer):
    if response == 'block':
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        while True:
            pass
    return 1.0
)PY";
  const std::string path = write_script(dir, "blocks.py", source);
  // One call through the pieces PythonReward::score uses, with a call limit of 1 s x (0 + 2).
  const SandboxResult r =
      run_python(reward_call_code(path, source, /*timeout_s=*/1.0, {{"", "a", ""}, {"", "block", ""}, {"", "b", ""}}),
                 reward_sandbox_options(sandbox_options(1), /*max_queries=*/0));
  EXPECT_TRUE(r.timed_out);
  const std::vector<ScriptScore> s = parse_reward_call(r, 3, python_reward(path));
  ASSERT_EQ(s.size(), 3u);
  EXPECT_FALSE(s[0].failed);
  EXPECT_EQ(s[0].reward, 1.0);
  for (int i : {1, 2}) {
    EXPECT_TRUE(s[i].failed);
    EXPECT_EQ(s[i].reward, -0.75);
    EXPECT_TRUE(contains(s[i].error, "killed at its own time limit")) << s[i].error;
  }
}

TEST(PythonReward, TheImportCheckNamesThePathAndWhatIsWrong) {
  testing::TempDir dir("python_reward_check");
  const SandboxOptions sandbox = sandbox_options(1);
  const auto error_of = [&](const std::string& path) -> std::string {
    try {
      check_reward_script(path, sandbox);
    } catch (const RewardScriptError& e) {
      return e.what();
    }
    return "";
  };
  const std::string missing = (dir.path() / "missing.py").string();
  EXPECT_TRUE(contains(error_of(missing), missing + ": cannot read")) << error_of(missing);
  const std::string none = write_script(dir, "none.py", "def rewards(p, r, a):\n    return 1.0\n");
  EXPECT_TRUE(contains(error_of(none), none + " defines no function reward")) << error_of(none);
  const std::string broken = write_script(dir, "broken.py", "import no_such_module_here\n");
  const std::string b = error_of(broken);
  EXPECT_TRUE(contains(b, "importing " + broken + " failed") && contains(b, "ModuleNotFoundError")) << b;
  const std::string slow = write_script(dir, "slow.py", "while True:\n    pass\n");
  EXPECT_TRUE(contains(error_of(slow), "timed out after 1 s")) << error_of(slow);
  const std::string good = write_script(dir, "good.py", kValues);
  EXPECT_EQ(error_of(good), "");
  EXPECT_THROW(PythonReward(python_reward(missing), sandbox), RewardScriptError);
}

// examples/rewards/math_verify.py through each of its checkers: as shipped (math_verify where the
// interpreter has it, else sympy), with math_verify hidden (sympy), and with sympy hidden too (the texts).
// The "checker" field says which one ran; a checker the interpreter lacks is skipped, the texts never are.
const std::vector<RewardQuery>& example_queries() {
  static const std::vector<RewardQuery> q{
      {"", "so \\boxed{\\frac{1}{2}}", "0.5"},
      {"", "\\boxed{41}", "42"},
      {"", "\\boxed{1+x}", "x+1"},
      {"", "\\boxed{\\frac{\\sqrt{2}}{2}}", "\\sqrt{2}/2"},
      {"", "no box", "1"},
      {"", "The answer is \\boxed{ 10 }.", "10"},
      {"", "\\boxed{2^{10}}", "1024"},
      {"", "\\boxed{3", "3"},  // never closed: no answer
  };
  return q;
}

// "" when the scores are the checker's verdicts: +1 correct, -1 wrong or no box.
std::string check_example(const std::vector<ScriptScore>& s, const std::vector<bool>& correct) {
  if (s.size() != correct.size()) return "scores: " + std::to_string(s.size());
  for (size_t i = 0; i < correct.size(); ++i) {
    if (s[i].failed) return "query " + std::to_string(i) + " failed: " + s[i].error;
    if (s[i].correct != correct[i] || s[i].reward != (correct[i] ? 1.0 : -1.0)) {
      return "query " + std::to_string(i) + ": reward " + std::to_string(s[i].reward);
    }
  }
  return "";
}

TEST(PythonReward, TheMathVerifyExampleAgreesWithEachOfItsCheckers) {
  std::ifstream f(std::string(RLT_SOURCE_DIR) + "/examples/rewards/math_verify.py");
  std::stringstream example;
  example << f.rdbuf();
  ASSERT_FALSE(example.str().empty());
  testing::TempDir dir("python_reward_example");
  SandboxOptions sandbox = sandbox_options(/*workers=*/2);
  sandbox.timeout_s = 20;  // the first sympy simplify of a cold interpreter, on a loaded CI machine
  const auto run = [&](const std::string& name, const std::string& prelude, int64_t& checker) {
    RewardOptions o = python_reward(write_script(dir, name, prelude + example.str()));
    o.wrong = -1.0;
    const std::vector<ScriptScore> s = PythonReward(o, sandbox).score(example_queries());
    checker = s.empty() || !s[0].fields.count("checker") ? 0 : static_cast<int64_t>(s[0].fields.at("checker"));
    return s;
  };
  // Which answers each checker accepts: 0.5 = \frac{1}{2}, 1 + x = x + 1, \frac{\sqrt 2}{2} = \sqrt 2 / 2 and
  // 2^{10} = 1024 need algebra; the texts match only " 10 " against "10".
  const std::vector<bool> algebra{true, false, true, true, false, true, true, false};
  const std::vector<bool> texts{false, false, false, false, false, true, false, false};

  int64_t shipped_checker = 0, sympy_checker = 0, text_checker = 0;
  const std::vector<ScriptScore> shipped = run("shipped.py", "", shipped_checker);
  const std::vector<ScriptScore> sympy =
      run("no_math_verify.py", "import sys\nsys.modules['math_verify'] = None\n", sympy_checker);
  const std::vector<ScriptScore> text =
      run("texts_only.py", "import sys\nsys.modules['math_verify'] = sys.modules['sympy'] = None\n", text_checker);

  ASSERT_EQ(text_checker, 3);
  EXPECT_EQ(check_example(text, texts), "");
  EXPECT_NE(check_example(text, algebra), "");  // twin: the texts' verdicts are not algebra's
  if (sympy_checker == 2) {
    EXPECT_EQ(check_example(sympy, algebra), "");
    EXPECT_NE(check_example(sympy, texts), "");
  }
  if (shipped_checker == 1) {
    EXPECT_EQ(check_example(shipped, algebra), "");
  }
  if (shipped_checker != 1 || sympy_checker != 2) {
    GTEST_SKIP() << "the sandbox's interpreter lacks " << (sympy_checker != 2 ? "sympy" : "math_verify")
                 << ": that checker was not compared";
  }
}

}  // namespace
}  // namespace rlt
