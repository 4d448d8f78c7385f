// Boxed-answer extraction, normalisation, exact matching and the reward functions; see reward.h.
#include "data/reward.h"

#include <algorithm>
#include <cctype>
#include <stdexcept>

namespace rlt {

namespace {

bool is_letter(char c) { return std::isalpha(static_cast<unsigned char>(c)) != 0; }
bool is_digit(char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; }

// The index just past the '}' matching the '{' at `open`, or npos when it never closes. A backslash
// escapes the next character, so \{ and \} (literal braces) and \\ (a line break) do not count.
size_t match_brace(const std::string& s, size_t open) {
  int depth = 0;
  for (size_t i = open; i < s.size(); ++i) {
    if (s[i] == '\\') {
      ++i;
    } else if (s[i] == '{') {
      ++depth;
    } else if (s[i] == '}' && --depth == 0) {
      return i + 1;
    }
  }
  return std::string::npos;
}

// Where the LaTeX command `cmd` (e.g. "\\left") starts at or after `from`, as a whole command: the next
// character is not a letter, so "\\left" does not match inside "\\leftarrow".
size_t find_command(const std::string& s, const std::string& cmd, size_t from = 0) {
  for (size_t p = s.find(cmd, from); p != std::string::npos; p = s.find(cmd, p + 1)) {
    const size_t end = p + cmd.size();
    if (end >= s.size() || !is_letter(s[end]) || !is_letter(cmd.back())) return p;
  }
  return std::string::npos;
}

void erase_all(std::string& s, const std::string& what) {
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p)) s.erase(p, what.size());
}

void erase_command(std::string& s, const std::string& cmd) {
  for (size_t p = find_command(s, cmd); p != std::string::npos; p = find_command(s, cmd, p)) s.erase(p, cmd.size());
}

void replace_command(std::string& s, const std::string& cmd, const std::string& by) {
  for (size_t p = find_command(s, cmd); p != std::string::npos; p = find_command(s, cmd, p + by.size())) {
    s.replace(p, cmd.size(), by);
  }
}

// \text{abc} -> abc (braces balanced); an unclosed wrapper is left as it is.
void unwrap_command(std::string& s, const std::string& cmd) {
  for (size_t p = find_command(s, cmd); p != std::string::npos; p = find_command(s, cmd, p)) {
    const size_t open = p + cmd.size();
    const size_t end = open < s.size() && s[open] == '{' ? match_brace(s, open) : std::string::npos;
    if (end == std::string::npos) {
      p += cmd.size();
      continue;
    }
    s = s.substr(0, p) + s.substr(open + 1, end - open - 2) + s.substr(end);
  }
}

// One argument of a LaTeX command starting at `i`: a {group} (its content), a control word (\pi), or a
// single character (the 1 of \frac12). Advances i; false when nothing is there.
bool read_argument(const std::string& s, size_t& i, std::string& arg) {
  if (i >= s.size()) return false;
  if (s[i] == '{') {
    const size_t end = match_brace(s, i);
    if (end == std::string::npos) return false;
    arg = s.substr(i + 1, end - i - 2);
    i = end;
    return true;
  }
  if (s[i] == '}') return false;
  size_t j = i + 1;
  if (s[i] == '\\') {
    while (j < s.size() && is_letter(s[j])) ++j;
    if (j == i + 1 && j < s.size()) ++j;  // a control symbol such as \,
  }
  arg = s.substr(i, j - i);
  i = j;
  return true;
}

// \frac12, \frac1{2}, \frac{1}2 -> \frac{1}{2}, so the written forms of one fraction compare equal.
void brace_frac_arguments(std::string& s) {
  const std::string cmd = "\\frac";
  for (size_t p = find_command(s, cmd); p != std::string::npos; p = find_command(s, cmd, p + cmd.size())) {
    size_t i = p + cmd.size();
    std::string num, den;
    if (!read_argument(s, i, num) || !read_argument(s, i, den)) continue;
    s = s.substr(0, p) + "\\frac{" + num + "}{" + den + "}" + s.substr(i);
  }
}

bool all_digits(const std::string& s, size_t begin, size_t end) {
  if (begin >= end) return false;
  for (size_t i = begin; i < end; ++i) {
    if (!is_digit(s[i])) return false;
  }
  return true;
}

// "1,234,567" or "-1,234.5": groups of exactly three digits after the first comma, so "1,23" or a
// list "1,2" is left alone.
bool has_thousands_commas(const std::string& s) {
  const size_t begin = !s.empty() && s[0] == '-' ? 1 : 0;
  const size_t point = std::min(s.find('.'), s.size());
  if (point < s.size() && !all_digits(s, point + 1, s.size())) return false;
  const size_t first = s.find(',', begin);
  if (first == std::string::npos || first >= point) return false;
  if (first - begin < 1 || first - begin > 3 || !all_digits(s, begin, first)) return false;
  for (size_t g = first; g < point; g += 4) {
    if (s[g] != ',' || g + 4 > point || !all_digits(s, g + 1, g + 4)) return false;
  }
  return true;
}

// A plain decimal ("-007.50", ".5") written canonically ("-7.5", "0.5"); anything else unchanged.
std::string canonical_decimal(const std::string& s) {
  const bool negative = !s.empty() && s[0] == '-';
  const size_t begin = negative ? 1 : 0;
  const size_t point = std::min(s.find('.'), s.size());
  const bool int_ok = point == begin || all_digits(s, begin, point);
  const bool frac_ok = point == s.size() || point + 1 == s.size() || all_digits(s, point + 1, s.size());
  if (!int_ok || !frac_ok || (point == begin && point + 1 >= s.size())) return s;  // no digit at all
  std::string int_part = s.substr(begin, point - begin);
  std::string frac_part = point < s.size() ? s.substr(point + 1) : "";
  int_part.erase(0, std::min(int_part.find_first_not_of('0'), int_part.size()));
  if (int_part.empty()) int_part = "0";
  frac_part.erase(std::min(frac_part.find_last_not_of('0') + 1, frac_part.size()));
  std::string out = int_part + (frac_part.empty() ? "" : "." + frac_part);
  return negative && out != "0" ? "-" + out : out;
}

// An exact rational num/den in lowest terms, den > 0. 128-bit: decimals of up to 38 digits are exact.
struct Rational {
  __int128 num = 0;
  __int128 den = 1;
};

__int128 gcd128(__int128 a, __int128 b) {
  if (a < 0) a = -a;
  if (b < 0) b = -b;
  while (b != 0) {
    const __int128 t = a % b;
    a = b;
    b = t;
  }
  return a;
}

// Digits [begin, end) as a non-negative integer; false on overflow or a non-digit.
bool parse_digits(const std::string& s, size_t begin, size_t end, __int128& out) {
  if (!all_digits(s, begin, end)) return false;
  out = 0;
  for (size_t i = begin; i < end; ++i) {
    if (__builtin_mul_overflow(out, 10, &out) || __builtin_add_overflow(out, s[i] - '0', &out)) return false;
  }
  return true;
}

bool parse_signed_integer(const std::string& s, __int128& out) {
  const bool negative = !s.empty() && s[0] == '-';
  if (!parse_digits(s, negative ? 1 : 0, s.size(), out)) return false;
  if (negative) out = -out;
  return true;
}

bool make_rational(__int128 num, __int128 den, Rational& out) {
  if (den == 0) return false;
  if (den < 0) {
    num = -num;
    den = -den;
  }
  const __int128 g = gcd128(num, den);
  out.num = num / g;
  out.den = den / g;
  return true;
}

// A normalised answer as an exact number: integer, decimal, a/b, \frac{a}{b}, with an optional '-' in
// front. Anything else (or anything past 128 bits) is not a number here.
bool parse_rational(const std::string& s, Rational& out) {
  const bool negative = !s.empty() && s[0] == '-';
  const std::string body = s.substr(negative ? 1 : 0);
  __int128 num = 0, den = 1;
  if (body.rfind("\\frac{", 0) == 0) {
    const size_t num_end = match_brace(body, 5);
    if (num_end == std::string::npos || num_end >= body.size() || body[num_end] != '{') return false;
    const size_t den_end = match_brace(body, num_end);
    if (den_end != body.size()) return false;
    if (!parse_signed_integer(body.substr(6, num_end - 7), num)) return false;
    if (!parse_signed_integer(body.substr(num_end + 1, den_end - num_end - 2), den)) return false;
  } else if (const size_t slash = body.find('/'); slash != std::string::npos) {
    if (!parse_signed_integer(body.substr(0, slash), num)) return false;
    if (!parse_signed_integer(body.substr(slash + 1), den)) return false;
  } else {
    // canonical_decimal already ran: "D" or "D.F" with D, F digits.
    const size_t point = std::min(body.find('.'), body.size());
    __int128 int_part = 0, frac_part = 0;
    if (!parse_digits(body, 0, point, int_part)) return false;
    if (point < body.size()) {
      if (!parse_digits(body, point + 1, body.size(), frac_part)) return false;
      for (size_t i = point + 1; i < body.size(); ++i) {
        if (__builtin_mul_overflow(den, 10, &den)) return false;
      }
    }
    if (__builtin_mul_overflow(int_part, den, &num) || __builtin_add_overflow(num, frac_part, &num)) return false;
  }
  if (negative) num = -num;
  return make_rational(num, den, out);
}

}  // namespace

std::optional<std::string> extract_last_boxed(const std::string& text) {
  const std::string cmd = "\\boxed";
  std::optional<std::string> last;
  for (size_t p = find_command(text, cmd); p != std::string::npos; p = find_command(text, cmd, p)) {
    size_t open = p + cmd.size();
    while (open < text.size() && (text[open] == ' ' || text[open] == '\t' || text[open] == '\n')) ++open;
    if (open >= text.size() || text[open] != '{') {  // "\boxed 5": not an answer (see reward.h)
      p = open;
      continue;
    }
    const size_t end = match_brace(text, open);
    if (end == std::string::npos) return std::nullopt;  // the last box runs to the end: truncated
    last = text.substr(open + 1, end - open - 2);
    p = end;  // skip the content: a box inside this one is part of this answer
  }
  return last;
}

std::string normalize_answer(const std::string& input) {
  std::string s = input;
  replace_command(s, "\xE2\x88\x92", "-");  // U+2212 MINUS SIGN
  // Commands that end at a letter go before the spaces do, or "\quad x" would become "\quadx".
  for (const char* cmd : {"\\left", "\\right", "\\displaystyle", "\\quad", "\\qquad"}) erase_command(s, cmd);
  // LaTeX spacing goes before other whitespace, or "1\ 234" would leave "1\234".
  for (const char* spacing : {"\\,", "\\;", "\\:", "\\!", "\\ ", "~", "$"}) erase_all(s, spacing);
  s.erase(std::remove_if(s.begin(), s.end(), [](char c) { return std::isspace(static_cast<unsigned char>(c)); }),
          s.end());
  for (const char* wrapper : {"\\text", "\\textbf", "\\mathrm", "\\mbox"}) unwrap_command(s, wrapper);
  replace_command(s, "\\dfrac", "\\frac");
  replace_command(s, "\\tfrac", "\\frac");
  brace_frac_arguments(s);
  if (!s.empty() && s.back() == '.') s.pop_back();  // "The answer is 5."
  if (s.size() > 1 && s[0] == '+') s.erase(0, 1);
  // "1{,}234" is how LaTeX users keep a comma from adding space; with "1,234" it is a separator only
  // in groups of three, so a list "1,2" stays a list.
  std::string plain = s;
  for (size_t p = plain.find("{,}"); p != std::string::npos; p = plain.find("{,}", p)) plain.replace(p, 3, ",");
  if (has_thousands_commas(plain)) {
    plain.erase(std::remove(plain.begin(), plain.end(), ','), plain.end());
    s = plain;
  }
  return canonical_decimal(s);
}

bool answers_match(const std::string& predicted, const std::string& reference) {
  const std::string p = normalize_answer(predicted), r = normalize_answer(reference);
  if (p.empty() || r.empty()) return false;
  if (p == r) return true;
  Rational a, b;
  if (!parse_rational(p, a) || !parse_rational(r, b)) return false;
  return a.num == b.num && a.den == b.den;  // lowest terms with den > 0 are unique
}

double overlong_penalty(int64_t sampled_tokens, int64_t budget, const RewardOptions& options) {
  const int64_t L = options.overlong_buffer;
  if (L <= 0) return 0.0;
  const int64_t start = std::max<int64_t>(budget - L, 0);  // the last token that costs nothing
  if (sampled_tokens <= start) return 0.0;
  if (sampled_tokens > budget) return -options.overlong_penalty;
  return -options.overlong_penalty * static_cast<double>(sampled_tokens - start) / static_cast<double>(L);
}

int64_t overlong_budget(int64_t prompt_tokens, int64_t max_context, int64_t max_turns, int64_t max_new_tokens) {
  return std::max<int64_t>(std::min(max_context - prompt_tokens, max_turns * max_new_tokens), 0);
}

RewardResult compute_reward(const std::string& response_text, const std::string& reference, int64_t tool_calls,
                            const RewardOptions& options) {
  if (tool_calls < 0) {
    throw std::invalid_argument("compute_reward: tool_calls = " + std::to_string(tool_calls) + ", expected >= 0");
  }
  if (options.kind == RewardKind::kPython || options.kind == RewardKind::kModel) {
    throw std::invalid_argument(std::string("compute_reward: reward.kind ") + enum_to_string(options.kind) +
                                " is scored elsewhere (rollout/python_reward.h, rollout/reward_model.h)");
  }
  RewardResult r;
  const std::optional<std::string> box = extract_last_boxed(response_text);
  if (box) r.extracted = *box;
  r.has_answer = box.has_value() && !normalize_answer(*box).empty();
  r.correct = r.has_answer && answers_match(*box, reference);
  if (r.correct) {
    r.reward = options.correct;
  } else if (options.kind == RewardKind::kBoxed) {
    r.reward = options.wrong;
  } else {
    // ReTool recipe (verl recipe/retool/retool.py): min(-0.6, score + (num_turns - 2) / 2 * 0.1) with
    // score = -1 and (num_turns - 2) / 2 = tool calls (reward.h derives it). No box counts as wrong.
    const double credit = RewardOptions::kToolCreditPerCall * static_cast<double>(tool_calls);
    r.reward = std::min(options.wrong + RewardOptions::kToolCreditCap, options.wrong + credit);
  }
  return r;
}

}  // namespace rlt
