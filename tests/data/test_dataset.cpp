// JSONL datasets (every malformed kind names file:line), the shuffled-epoch sampler, and the synthetic
// multiplication task with its tool-use trace, checked against an independent digit-by-digit product.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "data/reward.h"
#include "data/synthetic.h"
#include "tests/common/fixtures.h"
#include "tests/common/tmpdir.h"

namespace rlt {
namespace {

using testing::TempDir;

std::string write_file(const TempDir& dir, const std::string& name, const std::string& content) {
  const std::string path = (dir.path() / name).string();
  std::ofstream out(path, std::ios::binary);
  out << content;
  return path;
}

DatasetOptions options_for(const std::string& path) {
  DatasetOptions o;
  o.path = path;
  return o;
}

// The DataError message of load_jsonl, or "" when it loads.
std::string load_error(const DatasetOptions& o) {
  try {
    load_jsonl(o);
  } catch (const DataError& e) {
    return e.what();
  }
  return "";
}

TEST(Dataset, LoadsGoodFile) {
  TempDir dir("dataset_good");
  // Line 1 starts with a BOM; line 3 is blank; line 4 ends in \r\n; numbers as answers keep their text.
  const std::string path =
      write_file(dir, "good.jsonl",
                 "\xEF\xBB\xBF{\"prompt\": \"What is 2+2?\", \"answer\": \"4\"}\n"
                 "{\"answer\": 12.50, \"prompt\": \"Price?\", \"extra\": [1, {\"a\": null}]}\n"
                 "   \n"
                 "{\"prompt\": \"Big?\", \"answer\": 123456789012345678901234}\r\n"
                 "{\"prompt\": \"Neg?\", \"answer\": -7}\n"
                 "{\"prompt\": \"Caf\\u00e9 \\\"quoted\\\"\", \"answer\": \"1/2\"}");  // no final \n
  const Dataset d = load_jsonl(options_for(path));
  ASSERT_EQ(d.examples.size(), 5u);
  EXPECT_EQ(d.skipped, 0);
  EXPECT_EQ(d.examples[0].prompt, "What is 2+2?");
  EXPECT_EQ(d.examples[0].answer, "4");
  EXPECT_EQ(d.examples[0].source, path + ":1");
  EXPECT_EQ(d.examples[1].prompt, "Price?");
  EXPECT_EQ(d.examples[1].answer, "12.50");  // as written, not via a double ("12.5")
  EXPECT_EQ(d.examples[1].source, path + ":2");
  EXPECT_EQ(d.examples[2].answer, "123456789012345678901234");  // past 64 bits, still exact
  EXPECT_EQ(d.examples[2].source, path + ":4");                 // the blank line 3 still counts
  EXPECT_EQ(d.examples[3].answer, "-7");
  EXPECT_EQ(d.examples[4].prompt, "Caf\xC3\xA9 \"quoted\"");
  EXPECT_EQ(d.examples[4].source, path + ":6");
  for (const PromptExample& ex : d.examples) EXPECT_EQ(ex.data_source, "good") << "its set: the file's name";
}

struct BadLine {
  const char* name;
  std::string line;
  const char* why;  // a fragment the message must contain
};

// Each malformed kind, placed on line 4 (after two good lines and a blank one), is an error naming
// exactly file:4 and the reason.
TEST(Dataset, EachMalformedKindNamesFileAndLine) {
  const std::vector<BadLine> table = {
      {"invalid_json", "{\"prompt\": \"a\", \"answer\": }", "invalid JSON"},
      {"truncated", "{\"prompt\": \"a\", \"answer\": \"1\"", "invalid JSON"},
      {"trailing_garbage", "{\"prompt\": \"a\", \"answer\": \"1\"} x", "invalid JSON"},
      {"single_quotes", "{'prompt': 'a', 'answer': '1'}", "invalid JSON"},
      {"bad_utf8", "{\"prompt\": \"a\xFF\", \"answer\": \"1\"}", "invalid JSON"},
      {"array", "[\"a\", \"1\"]", "expected a JSON object, got an array"},
      {"string", "\"a\"", "expected a JSON object, got a string"},
      {"number", "42", "expected a JSON object, got a number"},
      {"missing_prompt", "{\"question\": \"a\", \"answer\": \"1\"}", "missing key 'prompt'"},
      {"missing_answer", "{\"prompt\": \"a\"}", "missing key 'answer'"},
      {"prompt_number", "{\"prompt\": 5, \"answer\": \"1\"}", "key 'prompt' is a number, expected a string"},
      {"answer_bool", "{\"prompt\": \"a\", \"answer\": true}", "key 'answer' is a boolean"},
      {"answer_null", "{\"prompt\": \"a\", \"answer\": null}", "key 'answer' is null"},
      {"answer_object", "{\"prompt\": \"a\", \"answer\": {\"v\": 1}}", "key 'answer' is an object"},
      {"answer_array", "{\"prompt\": \"a\", \"answer\": [1]}", "key 'answer' is an array"},
      {"empty_prompt", "{\"prompt\": \"\", \"answer\": \"1\"}", "empty prompt"},
      {"blank_prompt", "{\"prompt\": \" \\n \", \"answer\": \"1\"}", "empty prompt"},
      {"empty_answer", "{\"prompt\": \"a\", \"answer\": \"\"}", "empty answer"},
      {"duplicate_key", "{\"prompt\": \"a\", \"answer\": \"1\", \"answer\": \"2\"}", "appears 2 times"},
      {"bom_after_line_1", "\xEF\xBB\xBF{\"prompt\": \"a\", \"answer\": \"1\"}", "byte-order mark"},
  };
  TempDir dir("dataset_bad");
  for (const BadLine& row : table) {
    const std::string path = write_file(dir, std::string(row.name) + ".jsonl",
                                        "{\"prompt\": \"p1\", \"answer\": \"1\"}\n"
                                        "{\"prompt\": \"p2\", \"answer\": \"2\"}\n"
                                        "\n" +
                                            row.line + "\n{\"prompt\": \"p5\", \"answer\": \"5\"}\n");
    const std::string err = load_error(options_for(path));
    EXPECT_NE(err.find(path + ":4: "), std::string::npos) << row.name << ": " << err;
    EXPECT_NE(err.find(row.why), std::string::npos) << row.name << ": " << err;
    // Known-bad check of the assertion itself: the message names line 4, not a neighbour.
    EXPECT_EQ(err.find(path + ":5:"), std::string::npos) << row.name << ": " << err;
  }
  // The parser's column survives, the "line 1" of the parser's own view of one line does not.
  const std::string path = write_file(dir, "column.jsonl", "{\"prompt\": \"a\", \"answer\": }\n");
  const std::string err = load_error(options_for(path));
  EXPECT_NE(err.find("column"), std::string::npos) << err;
  EXPECT_EQ(err.find("line 1,"), std::string::npos) << err;
}

TEST(Dataset, SkipMalformedCountsAndReports) {
  TempDir dir("dataset_skip");
  const std::string path = write_file(dir, "mixed.jsonl",
                                      "{\"prompt\": \"p1\", \"answer\": \"1\"}\n"
                                      "not json\n"
                                      "{\"prompt\": \"p3\"}\n"
                                      "{\"prompt\": \"p4\", \"answer\": \"4\"}\n"
                                      "[]\n");
  DatasetOptions o = options_for(path);
  EXPECT_NE(load_error(o).find(path + ":2: invalid JSON"), std::string::npos);  // without skipping: line 2
  o.skip_malformed = true;
  const Dataset d = load_jsonl(o);
  ASSERT_EQ(d.examples.size(), 2u);
  EXPECT_EQ(d.examples[0].prompt, "p1");
  EXPECT_EQ(d.examples[1].prompt, "p4");
  EXPECT_EQ(d.examples[1].source, path + ":4");
  EXPECT_EQ(d.skipped, 3);
  ASSERT_EQ(d.skip_reasons.size(), 3u);
  EXPECT_EQ(d.skip_reasons[0].rfind(path + ":2: invalid JSON", 0), 0u) << d.skip_reasons[0];
  EXPECT_EQ(d.skip_reasons[1], path + ":3: missing key 'answer'");
  EXPECT_EQ(d.skip_reasons[2], path + ":5: expected a JSON object, got an array");
}

TEST(Dataset, SkipReasonsAreCappedButAllCounted) {
  TempDir dir("dataset_skip_cap");
  std::string text = "{\"prompt\": \"p\", \"answer\": \"1\"}\n";
  for (int i = 0; i < 25; ++i) text += "{}\n";
  DatasetOptions o = options_for(write_file(dir, "many.jsonl", text));
  o.skip_malformed = true;
  const Dataset d = load_jsonl(o);
  EXPECT_EQ(d.examples.size(), 1u);
  EXPECT_EQ(d.skipped, 25);
  EXPECT_EQ(static_cast<int64_t>(d.skip_reasons.size()), Dataset::kMaxSkipReasons);
}

TEST(Dataset, FileLevelErrors) {
  TempDir dir("dataset_files");
  const std::string missing = (dir.path() / "nope.jsonl").string();
  std::string err = load_error(options_for(missing));
  EXPECT_NE(err.find(missing + ": cannot open"), std::string::npos) << err;

  err = load_error(options_for(dir.path().string()));
  EXPECT_NE(err.find("is a directory"), std::string::npos) << err;

  const std::string empty = write_file(dir, "empty.jsonl", "");
  err = load_error(options_for(empty));
  EXPECT_NE(err.find(empty + ": no examples"), std::string::npos) << err;

  const std::string blank = write_file(dir, "blank.jsonl", "\n  \n\r\n");
  err = load_error(options_for(blank));
  EXPECT_NE(err.find(blank + ": no examples"), std::string::npos) << err;

  // Everything skipped: still an error, naming the first reason.
  DatasetOptions all_bad = options_for(write_file(dir, "all_bad.jsonl", "x\n{}\n"));
  all_bad.skip_malformed = true;
  err = load_error(all_bad);
  EXPECT_NE(err.find("all 2 non-blank lines are malformed"), std::string::npos) << err;
  EXPECT_NE(err.find(all_bad.path + ":1: invalid JSON"), std::string::npos) << err;

  err = load_error(DatasetOptions{});
  EXPECT_NE(err.find("no file given"), std::string::npos) << err;
}

TEST(Dataset, CustomKeys) {
  TempDir dir("dataset_keys");
  const std::string path = write_file(dir, "keys.jsonl",
                                      "{\"question\": \"q1\", \"solution\": 3, \"prompt\": \"ignored\"}\n"
                                      "{\"question\": \"q2\", \"solution\": \"x\"}\n");
  DatasetOptions o = options_for(path);
  o.prompt_key = "question";
  o.answer_key = "solution";
  const Dataset d = load_jsonl(o);
  ASSERT_EQ(d.examples.size(), 2u);
  EXPECT_EQ(d.examples[0].prompt, "q1");
  EXPECT_EQ(d.examples[0].answer, "3");
  EXPECT_EQ(d.examples[1].prompt, "q2");
  // With the default keys, line 1 has no answer: the error names the key that was looked for.
  EXPECT_NE(load_error(options_for(path)).find(path + ":1: missing key 'answer'"), std::string::npos);
}

TEST(Dataset, MaxExamplesStopsReading) {
  TempDir dir("dataset_max");
  std::string text;
  for (int i = 1; i <= 5; ++i) text += "{\"prompt\": \"p" + std::to_string(i) + "\", \"answer\": \"1\"}\n";
  text += "broken\n";  // past the cut: never read
  DatasetOptions o = options_for(write_file(dir, "five.jsonl", text));
  o.max_examples = 2;
  const Dataset d = load_jsonl(o);
  ASSERT_EQ(d.examples.size(), 2u);
  EXPECT_EQ(d.examples[1].prompt, "p2");
  o.max_examples = 0;  // all: now the broken line 6 is reached
  EXPECT_NE(load_error(o).find(o.path + ":6:"), std::string::npos);
}

TEST(Dataset, OptionsCheck) {
  std::vector<std::string> failed;
  const FieldFail fail = [&](const std::string& key, const std::string&) { failed.push_back(key); };
  DatasetOptions o;
  o.check(fail);
  EXPECT_TRUE(failed.empty());
  o.answer_key = "prompt";
  o.check(fail);
  EXPECT_EQ(failed, std::vector<std::string>{"answer_key"});
  failed.clear();
  o.answer_key = "answer";
  o.prompt_key = "";
  o.check(fail);
  EXPECT_EQ(failed, std::vector<std::string>{"prompt_key"});
}

std::vector<PromptExample> numbered(int n) {
  std::vector<PromptExample> v;
  for (int i = 0; i < n; ++i) v.push_back({"q" + std::to_string(i), std::to_string(i), "test:#" + std::to_string(i)});
  return v;
}

std::vector<std::string> prompts_of(const std::vector<PromptExample>& batch) {
  std::vector<std::string> p;
  for (const auto& e : batch) p.push_back(e.prompt);
  return p;
}

TEST(PromptSampler, EachEpochCoversEveryExampleOnce) {
  const int n = 13;  // odd, so batches of 4 straddle epoch boundaries
  PromptSampler s(numbered(n), /*seed=*/7);
  std::vector<std::string> all;
  for (int b = 0; b < 10; ++b) {  // 40 draws = 3 full epochs + 1
    const auto batch = prompts_of(s.next(4));
    ASSERT_EQ(batch.size(), 4u);
    all.insert(all.end(), batch.begin(), batch.end());
  }
  EXPECT_EQ(s.epoch(), 3);
  EXPECT_EQ(s.consumed(), 40);
  std::vector<std::string> every = prompts_of(numbered(n));
  std::sort(every.begin(), every.end());
  std::vector<std::vector<std::string>> epochs;
  for (int e = 0; e < 3; ++e) {
    std::vector<std::string> ep(all.begin() + e * n, all.begin() + (e + 1) * n);
    epochs.push_back(ep);
    std::sort(ep.begin(), ep.end());
    EXPECT_EQ(ep, every) << "epoch " << e << " is not a permutation of the examples";
  }
  // Reshuffled each pass, and actually shuffled (13! orders: equal by chance is ~1e-10).
  EXPECT_NE(epochs[0], epochs[1]);
  EXPECT_NE(epochs[1], epochs[2]);
  EXPECT_NE(epochs[0], prompts_of(numbered(n)));
}

TEST(PromptSampler, DeterministicUnderSeedAndDiffersAcrossSeeds) {
  PromptSampler a(numbered(50), 123), b(numbered(50), 123), c(numbered(50), 124);
  const auto first_a = prompts_of(a.next(120)), first_b = prompts_of(b.next(120)), first_c = prompts_of(c.next(120));
  EXPECT_EQ(first_a, first_b);
  EXPECT_NE(first_a, first_c);
  // Seed s epoch 1 is not seed s + 1 epoch 0 (the epoch is not simply added to the seed).
  PromptSampler d(numbered(50), 124);
  const std::vector<std::string> epoch1_of_123(first_a.begin() + 50, first_a.begin() + 100);
  EXPECT_NE(epoch1_of_123, prompts_of(d.next(50)));
}

TEST(PromptSampler, SeekReproducesAResumedRun) {
  PromptSampler full(numbered(9), 5);
  full.next(20);
  const auto expected = prompts_of(full.next(11));
  PromptSampler resumed(numbered(9), 5);
  resumed.seek(20);
  EXPECT_EQ(resumed.epoch(), 2);
  EXPECT_EQ(prompts_of(resumed.next(11)), expected);
  EXPECT_EQ(resumed.consumed(), 31);
}

TEST(PromptSampler, EdgeCases) {
  EXPECT_THROW(PromptSampler({}, 0), DataError);
  PromptSampler s(numbered(3), 0);
  EXPECT_TRUE(s.next(0).empty());
  EXPECT_THROW(s.next(-1), std::invalid_argument);
  const auto big = prompts_of(s.next(7));  // more than one pass in one batch
  EXPECT_EQ(big.size(), 7u);
  EXPECT_EQ(s.epoch(), 2);
  // Two full passes (6) and one example of the third: every example 2 or 3 times.
  for (const char* q : {"q0", "q1", "q2"}) {
    const auto k = std::count(big.begin(), big.end(), q);
    EXPECT_TRUE(k == 2 || k == 3) << q << " drawn " << k << " times";
  }
}

// Digit strings of a text, in order.
std::vector<std::string> integers_in(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s + " ") {
    if (c >= '0' && c <= '9') {
      cur += c;
    } else if (!cur.empty()) {
      out.push_back(cur);
      cur.clear();
    }
  }
  return out;
}

// Schoolbook multiplication on decimal strings: independent of the 128-bit arithmetic under test.
std::string multiply_decimal(const std::string& a, const std::string& b) {
  std::vector<int> acc(a.size() + b.size(), 0);  // little-endian digits
  for (size_t i = 0; i < a.size(); ++i) {
    for (size_t j = 0; j < b.size(); ++j) acc[i + j] += (a[a.size() - 1 - i] - '0') * (b[b.size() - 1 - j] - '0');
  }
  for (size_t k = 0; k + 1 < acc.size(); ++k) {
    acc[k + 1] += acc[k] / 10;
    acc[k] %= 10;
  }
  std::string out;
  for (size_t k = acc.size(); k-- > 0;) out += static_cast<char>('0' + acc[k]);
  out.erase(0, std::min(out.find_first_not_of('0'), out.size() - 1));
  return out;
}

TEST(Synthetic, IndependentMultiplicationAgrees) {
  // The checker itself, on hand-derived values (and a known-bad one).
  EXPECT_EQ(multiply_decimal("347", "829"), "287663");  // 347*829 = 347*800 + 347*29 = 277600 + 10063
  EXPECT_EQ(multiply_decimal("999999999999999999", "999999999999999999"), "999999999999999998000000000000000001");
  EXPECT_NE(multiply_decimal("12", "12"), "145");
}

TEST(Synthetic, AnswersAreTrueProductsWithRightDigitCounts) {
  for (const auto& [da, db] : std::vector<std::pair<int64_t, int64_t>>{{3, 3}, {1, 1}, {5, 2}, {18, 18}, {7, 11}}) {
    SyntheticOptions o;
    o.digits_a = da;
    o.digits_b = db;
    o.count = 300;
    o.seed = 42;
    const auto tasks = make_multiplication_tasks(o);
    ASSERT_EQ(tasks.size(), 300u);
    std::set<std::string> phrasings;
    for (size_t i = 0; i < tasks.size(); ++i) {
      const auto nums = integers_in(tasks[i].prompt);
      ASSERT_EQ(nums.size(), 2u) << tasks[i].prompt;
      EXPECT_EQ(static_cast<int64_t>(nums[0].size()), da) << tasks[i].prompt;
      EXPECT_EQ(static_cast<int64_t>(nums[1].size()), db) << tasks[i].prompt;
      EXPECT_NE(nums[0][0], '0');
      EXPECT_NE(nums[1][0], '0');
      EXPECT_EQ(tasks[i].answer, multiply_decimal(nums[0], nums[1])) << tasks[i].prompt;
      EXPECT_EQ(tasks[i].source, "synthetic:#" + std::to_string(i));
      std::string shape = tasks[i].prompt;
      for (const auto& n : nums) shape.replace(shape.find(n), n.size(), "N");
      phrasings.insert(shape);
    }
    EXPECT_GE(phrasings.size(), 3u) << "a few phrasings, not one sentence";
  }
}

TEST(Synthetic, DeterministicInSeed) {
  SyntheticOptions o;
  o.count = 50;
  const auto a = make_multiplication_tasks(o), b = make_multiplication_tasks(o);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].prompt, b[i].prompt);
    EXPECT_EQ(a[i].answer, b[i].answer);
  }
  o.seed = 1;
  const auto c = make_multiplication_tasks(o);
  int same = 0;
  for (size_t i = 0; i < a.size(); ++i) same += a[i].prompt == c[i].prompt;
  EXPECT_LT(same, 3);
  // A smaller count is a prefix of a larger one under the same seed.
  o.seed = 0;
  o.count = 10;
  const auto prefix = make_multiplication_tasks(o);
  for (size_t i = 0; i < prefix.size(); ++i) EXPECT_EQ(prefix[i].prompt, a[i].prompt);
}

TEST(Synthetic, RejectsBadOptions) {
  SyntheticOptions o;
  o.digits_a = 19;  // past 64-bit operands
  EXPECT_THROW(make_multiplication_tasks(o), std::invalid_argument);
  o.digits_a = 0;
  EXPECT_THROW(make_multiplication_tasks(o), std::invalid_argument);
  o.digits_a = 3;
  o.count = 0;
  EXPECT_THROW(make_multiplication_tasks(o), std::invalid_argument);
}

TEST(Synthetic, WorkedSolution) {
  SyntheticOptions o;
  o.count = 20;
  o.digits_a = 4;
  o.digits_b = 5;
  for (const PromptExample& ex : make_multiplication_tasks(o)) {
    const WorkedSolution w = worked_solution(ex);
    const auto nums = integers_in(ex.prompt);
    EXPECT_EQ(w.code, "print(" + nums[0] + " * " + nums[1] + ")");
    EXPECT_EQ(w.output, ex.answer);
    // The reward reads the model's text and finds the answer in it.
    EXPECT_EQ(extract_last_boxed(w.answer), ex.answer);
    EXPECT_TRUE(compute_reward(w.answer, ex.answer, 1, RewardOptions{}).correct);
  }
}

TEST(Synthetic, WorkedSolutionRejectsWhatItCannotSolve) {
  auto message = [](const PromptExample& ex) {
    try {
      worked_solution(ex);
    } catch (const DataError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  std::string err = message({"What is 12 * 34?", "409", "f.jsonl:7"});  // wrong reference answer
  EXPECT_NE(err.find("f.jsonl:7"), std::string::npos) << err;
  EXPECT_NE(err.find("408"), std::string::npos) << err;
  err = message({"What is twelve squared?", "144", "f.jsonl:8"});
  EXPECT_NE(err.find("f.jsonl:8"), std::string::npos) << err;
  EXPECT_NE(err.find("found 0"), std::string::npos) << err;
  EXPECT_NE(message({"What is 1 * 2 * 3?", "6", "x"}).find("found 3"), std::string::npos);
}

}  // namespace
}  // namespace rlt

namespace rlt {
namespace {

const std::string kHfData = std::string(RLT_FIXTURES_DIR) + "/data";

// DAPO-Math-17k as slime ships it: the prompt is a list of chat messages, the answer is under "label".
TEST(Dataset, DapoMathPromptsAreChatMessages) {
  RLT_SKIP_WITHOUT_FIXTURES();
  DatasetOptions o = options_for(kHfData + "/dapo_math_17k.head200.jsonl");
  o.answer_key = "label";
  const Dataset d = load_jsonl(o);
  ASSERT_EQ(d.examples.size(), 200u);
  const PromptExample& ex = d.examples[0];
  ASSERT_EQ(ex.messages.size(), 1u);
  EXPECT_EQ(ex.messages[0].role, "user");
  EXPECT_EQ(ex.prompt, ex.messages[0].content) << "the question is the last user turn";
  EXPECT_NE(ex.prompt.find("In triangle $ABC$"), std::string::npos);
  EXPECT_EQ(ex.answer, "34");  // rows 0-2: 34, 113, -3 (fixtures README)
  EXPECT_EQ(d.examples[1].answer, "113");
  EXPECT_EQ(d.examples[2].answer, "-3");
  // Row 175 (0-based): a "\nabla" became a JSON "\n" escape: a real newline, kept as published.
  EXPECT_NE(d.examples[175].prompt.find("\nabla"), std::string::npos);
}

// AIME 2024: `problem` / zero-padded string answers; the reward counts "25" for "025".
TEST(Dataset, Aime2024KeysAndZeroPaddedAnswers) {
  RLT_SKIP_WITHOUT_FIXTURES();
  DatasetOptions o = options_for(kHfData + "/aime2024.jsonl");
  o.prompt_key = "problem";
  const Dataset d = load_jsonl(o);
  ASSERT_EQ(d.examples.size(), 30u);
  EXPECT_TRUE(d.examples[0].messages.empty()) << "a string prompt";
  bool padded = false;
  for (const auto& ex : d.examples) {
    if (ex.answer.size() == 3 && ex.answer[0] == '0') {
      padded = true;
      EXPECT_TRUE(answers_match(ex.answer.substr(1), ex.answer)) << ex.answer;
      EXPECT_FALSE(answers_match(ex.answer.substr(1) + "0", ex.answer)) << ex.answer;
    }
  }
  EXPECT_TRUE(padded) << "the fixture has zero-padded answers such as 025";
}

// The evaluation file beside DAPO training data: its own path and keys; unset keys fall back to the
// training ones, and the same key for question and answer is refused.
TEST(Dataset, EvaluationFileWithItsOwnKeys) {
  RLT_SKIP_WITHOUT_FIXTURES();
  DatasetOptions o = options_for(kHfData + "/dapo_math_17k.head200.jsonl");
  o.answer_key = "label";
  o.max_examples = 8;
  o.eval_path = kHfData + "/aime2024.jsonl";
  o.eval_prompt_key = "problem";
  o.eval_answer_key = "answer";
  const Dataset eval = load_jsonl(o.eval_options());
  ASSERT_EQ(eval.examples.size(), 30u) << "max_examples caps the training file only";
  EXPECT_EQ(eval.examples[7].answer, "025");
  EXPECT_EQ(eval.examples[0].source.rfind(kHfData + "/aime2024.jsonl:1", 0), 0u) << eval.examples[0].source;
  EXPECT_EQ(load_jsonl(o).examples.size(), 8u);
  DatasetOptions fallback = o;
  fallback.eval_answer_key.clear();  // -> "label", which AIME rows lack: an error naming file and line
  try {
    load_jsonl(fallback.eval_options());
    ADD_FAILURE() << "AIME rows have no label";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("aime2024.jsonl:1"), std::string::npos) << e.what();
  }
  DatasetOptions same = o;
  same.eval_answer_key = "problem";
  std::string why;
  validate(same, [&](const std::string& key, const std::string& msg) { why += key + ": " + msg; });
  EXPECT_NE(why.find("eval_answer_key"), std::string::npos) << why;
}

TEST(Dataset, DottedKeysReachNestedObjects) {
  TempDir dir("dataset_nested");
  // verl's schema: the reference answer under reward_model.ground_truth, numbers kept as written.
  const std::string path = write_file(
      dir, "verl.jsonl",
      "{\"data_source\": \"math_dapo\", \"prompt\": [{\"content\": \"What is 2+3?\", \"role\": \"user\"}], "
      "\"reward_model\": {\"ground_truth\": \"5\", \"style\": \"rule\"}, \"extra_info\": {\"index\": \"a\"}}\n"
      "{\"prompt\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", \"content\": \"7*6?\"}], "
      "\"reward_model\": {\"ground_truth\": 42.0, \"style\": \"rule\"}}\n");
  DatasetOptions o = options_for(path);
  o.answer_key = "reward_model.ground_truth";
  const Dataset d = load_jsonl(o);
  ASSERT_EQ(d.examples.size(), 2u);
  EXPECT_EQ(d.examples[0].answer, "5");
  EXPECT_EQ(d.examples[1].answer, "42.0") << "as written in the file";
  ASSERT_EQ(d.examples[1].messages.size(), 2u);
  EXPECT_EQ(d.examples[1].messages[0].role, "system");
  EXPECT_EQ(d.examples[1].prompt, "7*6?");
  // The same key one level up is not the nested one: a reader that matched the last key alone would take
  // "style" objects' siblings; this one must say the path is missing.
  o.answer_key = "ground_truth";
  EXPECT_NE(load_error(o).find("missing key 'ground_truth'"), std::string::npos) << load_error(o);
}

TEST(Dataset, BadMessagesNameFileLineAndPath) {
  TempDir dir("dataset_bad_messages");
  const struct {
    const char* line;
    const char* fragment;
  } rows[] = {
      {R"({"prompt": [], "answer": "1"})", "empty list of messages"},
      {R"({"prompt": ["hi"], "answer": "1"})", "prompt[0] is a string, expected a message object"},
      {R"({"prompt": [{"role": "user"}], "answer": "1"})", "prompt[0].content: missing"},
      {R"({"prompt": [{"role": "user", "content": "q"}, {"role": 3, "content": "x"}], "answer": "1"})",
       "prompt[1].role: is a number"},
      {R"({"prompt": [{"role": "robot", "content": "q"}], "answer": "1"})", "prompt[0].role: 'robot' is not one of"},
      {R"({"prompt": [{"role": "system", "content": "s"}], "answer": "1"})", "no non-empty user message"},
      {R"({"prompt": "q", "reward_model": {"ground_truth": {"x": 1}}})", "is an object"},
  };
  for (const auto& row : rows) {
    const bool nested = std::string(row.line).find("reward_model") != std::string::npos;
    const std::string good =
        nested ? R"({"prompt": "ok", "reward_model": {"ground_truth": "2"}})" : R"({"prompt": "ok", "answer": "2"})";
    const std::string path = write_file(dir, "bad.jsonl", good + "\n" + row.line + "\n");
    DatasetOptions o = options_for(path);
    if (nested) o.answer_key = "reward_model.ground_truth";
    const std::string err = load_error(o);
    EXPECT_NE(err.find(path + ":2: "), std::string::npos) << err;
    EXPECT_NE(err.find(row.fragment), std::string::npos) << err;
  }
}

}  // namespace
}  // namespace rlt
