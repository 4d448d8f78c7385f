// Multiplication problems and their worked tool-use traces; see synthetic.h.
#include "data/synthetic.h"

#include <cctype>
#include <stdexcept>

#include "data/random.h"

namespace rlt {

namespace {

uint64_t pow10(int64_t k) {
  uint64_t p = 1;
  for (int64_t i = 0; i < k; ++i) p *= 10;
  return p;
}

std::string to_decimal(unsigned __int128 v) {
  if (v == 0) return "0";
  std::string s;
  for (; v > 0; v /= 10) s.insert(s.begin(), static_cast<char>('0' + static_cast<int>(v % 10)));
  return s;
}

// Several phrasings so the policy learns the task, not one sentence; none contains other digits, which
// worked_solution relies on to find the operands.
std::string phrase(int which, const std::string& a, const std::string& b) {
  switch (which) {
    case 0:
      return "What is " + a + " * " + b + "?";
    case 1:
      return "Calculate " + a + " times " + b + ".";
    case 2:
      return "Multiply " + a + " by " + b + ".";
    default:
      return "What is the product of " + a + " and " + b + "?";
  }
}
constexpr int kPhrasings = 4;

}  // namespace

std::vector<PromptExample> make_multiplication_tasks(const SyntheticOptions& options) {
  std::string bad;
  SyntheticOptions copy = options;  // visit() is non-const by the fields.h convention
  validate(copy, [&](const std::string& key, const std::string& why) {
    if (bad.empty()) bad = "synthetic task options: " + key + ": " + why;
  });
  if (!bad.empty()) throw std::invalid_argument(bad);

  // One stream for the whole set, drawn in a fixed order (a, b, phrasing) per problem: the first k
  // problems of a larger count are the problems of count = k.
  uint64_t state = static_cast<uint64_t>(options.seed);
  const uint64_t lo_a = pow10(options.digits_a - 1), lo_b = pow10(options.digits_b - 1);
  const uint64_t span_a = pow10(options.digits_a) - lo_a, span_b = pow10(options.digits_b) - lo_b;
  std::vector<PromptExample> tasks;
  tasks.reserve(static_cast<size_t>(options.count));
  for (int64_t i = 0; i < options.count; ++i) {
    const uint64_t a = lo_a + uniform_below(state, span_a);
    const uint64_t b = lo_b + uniform_below(state, span_b);
    const int which = static_cast<int>(uniform_below(state, kPhrasings));
    PromptExample ex;
    ex.prompt = phrase(which, std::to_string(a), std::to_string(b));
    ex.answer = to_decimal(static_cast<unsigned __int128>(a) * b);  // < 10^36: exact in 128 bits
    ex.source = "synthetic:#" + std::to_string(i);
    tasks.push_back(std::move(ex));
  }
  return tasks;
}

WorkedSolution worked_solution(const PromptExample& ex) {
  std::vector<std::string> numbers;
  for (size_t i = 0; i < ex.prompt.size();) {
    if (!std::isdigit(static_cast<unsigned char>(ex.prompt[i]))) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < ex.prompt.size() && std::isdigit(static_cast<unsigned char>(ex.prompt[j]))) ++j;
    numbers.push_back(ex.prompt.substr(i, j - i));
    i = j;
  }
  if (numbers.size() != 2) {
    throw DataError(ex.source + ": worked_solution: expected a prompt with exactly two integers, found " +
                    std::to_string(numbers.size()) + " in '" + ex.prompt + "'");
  }
  for (const std::string& n : numbers) {
    if (n.size() > 18) {
      throw DataError(ex.source + ": worked_solution: operand " + n + " has more than 18 digits");
    }
  }
  const uint64_t a = std::stoull(numbers[0]), b = std::stoull(numbers[1]);
  const std::string product = to_decimal(static_cast<unsigned __int128>(a) * b);
  if (product != ex.answer) {
    throw DataError(ex.source + ": worked_solution: " + numbers[0] + " * " + numbers[1] + " = " + product +
                    ", but the example's answer is '" + ex.answer + "'");
  }
  // Operands are re-printed from their values, so a prompt's "007" becomes 7: Python 3 rejects integer
  // literals with leading zeros.
  const std::string code = "print(" + std::to_string(a) + " * " + std::to_string(b) + ")";
  return {code, product, "Answer: \\boxed{" + product + "}"};
}

}  // namespace rlt
