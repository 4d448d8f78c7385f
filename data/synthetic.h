// The built-in demo's task: multiplication of multi-digit numbers, which a small model cannot do in its
// head but can by writing one line of Python, so tool use visibly pays off within a short run. Also the
// worked solution a supervised warm-up before RL teaches.
// Leaves out: other task families (the JSONL loader, data/dataset.h, is the way to bring real problems),
// and traces for prompts that are not a two-operand multiplication.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/fields.h"
#include "data/dataset.h"

namespace rlt {

struct SyntheticOptions {
  // At most 18 digits: the operands are 64-bit integers, and their products, computed in 128-bit
  // integers, stay exact up to 18 x 18 digits.
  int64_t digits_a = 3;
  int64_t digits_b = 3;
  // Operand pairs are independent draws, so with tiny digit counts problems repeat.
  int64_t count = 2000;
  // Our own splitmix64 stream: equal seeds give equal problems on every platform.
  int64_t seed = 0;

  template <class V>
  void visit(V&& v) {
    v("digits_a", digits_a, "digits of the first operand (leading digit nonzero)", FieldRange{1, 18});
    v("digits_b", digits_b, "digits of the second operand (leading digit nonzero)", FieldRange{1, 18});
    v("count", count, "problems generated", FieldRange{1, 1e9});
    v("seed", seed, "problem generator seed", FieldRange{0, 9.0e18});
  }
  // Ranges only (operands are 64-bit integers: at most 18 digits), checked by validate().
  void check(const FieldFail& fail) const {}
};

// `count` problems such as "What is 347 * 829?" in a few phrasings, each with its exact product as the
// answer ("287663") and source "synthetic:#i". Deterministic in the options. Throws std::invalid_argument
// when the options fail validate().
std::vector<PromptExample> make_multiplication_tasks(const SyntheticOptions& options);

// The worked solution of a multiplication prompt: the one line of Python that solves it, what it prints,
// and the final answer as the model writes it. rollout/tools.h lays it out as a tool-use trace in the
// run's call format. The operands are the two integers in the prompt. Throws DataError naming ex.source
// when the prompt does not hold exactly two integers of at most 18 digits, or when their product is not
// ex.answer (a warm-up that teaches a wrong answer is worse than none).
struct WorkedSolution {
  std::string code;    // "print(347 * 829)"
  std::string output;  // "287663"
  std::string answer;  // "Answer: \\boxed{287663}"
};
WorkedSolution worked_solution(const PromptExample& ex);

}  // namespace rlt
