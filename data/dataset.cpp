// JSONL loading and shuffled epochs; see dataset.h.
#include "data/dataset.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <utility>

#include "data/random.h"

namespace rlt {

namespace {

using json = nlohmann::json;

// One top-level member we care about (the prompt or the answer key), as the parser met it.
struct Member {
  enum Kind { kMissing, kString, kNumber, kOther } kind = kMissing;
  std::string text;       // the string, or the number exactly as written in the file
  const char* type = "";  // for messages: "a boolean", "an array", ...
  int count = 0;          // how often the key appears in the object
};

// A SAX pass over one line instead of a DOM: it validates the whole line like json::parse, but also sees
// each number's source text, so an answer written as 12.50 or 123456789012345678901234 (past 64 bits)
// reaches the reward exactly as written instead of through a double. Only the two wanted top-level
// members are kept; everything else is walked and dropped.
class LineReader : public nlohmann::json_sax<json> {
 public:
  LineReader(const std::string& prompt_key, const std::string& answer_key)
      : prompt_key_(prompt_key), answer_key_(answer_key) {}

  const char* root_type = nullptr;  // type of the line's value; "an object" is the only good one
  Member prompt, answer;
  std::string error;  // the parser's message when the line is not valid JSON

  bool null() override { return value(Member::kOther, "", "null"); }
  bool boolean(bool) override { return value(Member::kOther, "", "a boolean"); }
  bool number_integer(number_integer_t v) override { return value(Member::kNumber, std::to_string(v), "a number"); }
  bool number_unsigned(number_unsigned_t v) override { return value(Member::kNumber, std::to_string(v), "a number"); }
  bool number_float(number_float_t, const string_t& s) override { return value(Member::kNumber, s, "a number"); }
  bool string(string_t& s) override { return value(Member::kString, s, "a string"); }
  bool binary(binary_t&) override { return value(Member::kOther, "", "binary data"); }
  bool start_object(std::size_t) override { return open("an object"); }
  bool end_object() override { return close(); }
  bool start_array(std::size_t) override { return open("an array"); }
  bool end_array() override { return close(); }
  bool key(string_t& k) override {
    if (depth_ == 1) key_ = k;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& ex) override {
    // "[json.exception.parse_error.101] parse error at line 1, column 7: ..." -> "parse error at column 7: ...";
    // the line number is the file's, given by the caller.
    error = ex.what();
    const size_t bracket = error.find("] ");
    if (error.rfind("[json.exception.", 0) == 0 && bracket != std::string::npos) error.erase(0, bracket + 2);
    const size_t at_line = error.find("at line 1, ");
    if (at_line != std::string::npos) error.erase(at_line + 3, 8);
    return false;
  }

 private:
  bool value(Member::Kind kind, const std::string& text, const char* type) {
    if (depth_ == 0) root_type = type;
    if (depth_ != 1 || !in_object_) return true;
    Member* m = key_ == prompt_key_ ? &prompt : key_ == answer_key_ ? &answer : nullptr;
    if (m != nullptr) {
      m->kind = kind;
      m->text = text;
      m->type = type;
      m->count += 1;
    }
    return true;
  }
  bool open(const char* type) {
    if (depth_ == 0) in_object_ = std::strcmp(type, "an object") == 0;
    value(Member::kOther, "", type);  // a nested container as a member's value is the wrong type
    ++depth_;
    return true;
  }
  bool close() {
    --depth_;
    return true;
  }

  const std::string& prompt_key_;
  const std::string& answer_key_;
  int depth_ = 0;
  bool in_object_ = false;
  std::string key_;
};

bool is_blank(const std::string& s) { return s.find_first_not_of(" \t\r\n\f\v") == std::string::npos; }

const char kBom[] = "\xEF\xBB\xBF";

// The example on one line, or the reason it is not one.
bool parse_line(const std::string& line, const DatasetOptions& o, PromptExample& out, std::string& why) {
  LineReader reader(o.prompt_key, o.answer_key);
  if (!json::sax_parse(line, &reader)) {
    why = "invalid JSON: " + reader.error;
    return false;
  }
  if (std::strcmp(reader.root_type, "an object") != 0) {
    why = std::string("expected a JSON object, got ") + reader.root_type;
    return false;
  }
  const std::pair<const std::string*, Member*> members[] = {{&o.prompt_key, &reader.prompt},
                                                            {&o.answer_key, &reader.answer}};
  for (const auto& [key, m] : members) {
    const bool is_answer = m == &reader.answer;
    if (m->kind == Member::kMissing) {
      why = "missing key '" + *key + "'";
      return false;
    }
    // JSON leaves duplicate keys undefined (parsers keep the first or the last); refuse to guess.
    if (m->count > 1) {
      why = "key '" + *key + "' appears " + std::to_string(m->count) + " times";
      return false;
    }
    if (m->kind != Member::kString && !(is_answer && m->kind == Member::kNumber)) {
      why = "key '" + *key + "' is " + m->type + ", expected a string" + (is_answer ? " or a number" : "");
      return false;
    }
    // An empty answer could never be matched (the reward treats no answer as wrong), so it is a data bug.
    if (is_blank(m->text)) {
      why = std::string("empty ") + (is_answer ? "answer" : "prompt") + " (key '" + *key + "')";
      return false;
    }
  }
  out.prompt = std::move(reader.prompt.text);
  out.answer = std::move(reader.answer.text);
  return true;
}

}  // namespace

Dataset load_jsonl(const DatasetOptions& options) {
  const std::string& path = options.path;
  if (path.empty()) throw DataError("dataset: no file given (the dataset path is empty)");
  // stat first: an ifstream opens a directory without complaint and then reads nothing, which would
  // surface as a confusing "no examples".
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    throw DataError(path + ": cannot open the dataset: " + std::strerror(errno));
  }
  if (S_ISDIR(st.st_mode)) throw DataError(path + ": is a directory, expected a JSONL file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(path + ": cannot open the dataset: " + std::strerror(errno));

  Dataset data;
  std::string line;
  int64_t line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    bool bom = line.compare(0, 3, kBom) == 0;
    if (bom && line_no == 1) {
      line.erase(0, 3);  // editors on Windows write one; it is not data
      bom = false;
    }
    if (is_blank(line)) continue;

    const std::string where = path + ":" + std::to_string(line_no);
    PromptExample ex;
    std::string why;
    bool ok = false;
    if (bom) {
      // Past line 1 a byte-order mark means files were concatenated; nlohmann would silently accept it.
      why = "byte-order mark in the middle of the file (concatenated files?)";
    } else {
      ok = parse_line(line, options, ex, why);
    }
    if (!ok) {
      if (!options.skip_malformed) throw DataError(where + ": " + why);
      ++data.skipped;
      if (static_cast<int64_t>(data.skip_reasons.size()) < Dataset::kMaxSkipReasons) {
        data.skip_reasons.push_back(where + ": " + why);
      }
      continue;
    }
    ex.source = where;
    data.examples.push_back(std::move(ex));
    if (options.max_examples > 0 && static_cast<int64_t>(data.examples.size()) >= options.max_examples) break;
  }
  if (in.bad()) throw DataError(path + ": read error after line " + std::to_string(line_no));
  if (data.examples.empty()) {
    if (data.skipped > 0) {
      throw DataError(path + ": no examples: all " + std::to_string(data.skipped) +
                      " non-blank lines are malformed; the first: " + data.skip_reasons.front());
    }
    throw DataError(path + ": no examples (the file is empty or has only blank lines)");
  }
  return data;
}

PromptSampler::PromptSampler(std::vector<PromptExample> examples, uint64_t seed)
    : examples_(std::move(examples)), seed_(seed) {
  if (examples_.empty()) throw DataError("PromptSampler: no examples to sample from");
  shuffle_for_epoch();
}

void PromptSampler::shuffle_for_epoch() {
  // The pass's order depends on (seed, epoch) only, never on earlier passes, so seek() can jump to any
  // pass. Mixing the epoch in through a multiply (not seed + epoch) keeps seed s pass e + 1 different
  // from seed s + 1 pass e.
  uint64_t seed_state = seed_;
  uint64_t state = splitmix64(seed_state) ^ (static_cast<uint64_t>(epoch_) * 0xD1B54A32D192ED03ull);
  order_.resize(examples_.size());
  for (size_t i = 0; i < order_.size(); ++i) order_[i] = static_cast<int64_t>(i);
  // Fisher-Yates (Knuth, TAOCP vol. 2, Algorithm P): every permutation equally likely.
  for (size_t i = order_.size(); i > 1; --i) {
    const uint64_t j = uniform_below(state, i);
    std::swap(order_[i - 1], order_[j]);
  }
}

std::vector<PromptExample> PromptSampler::next(int64_t n) {
  if (n < 0) throw std::invalid_argument("PromptSampler::next: n = " + std::to_string(n) + ", expected >= 0");
  std::vector<PromptExample> batch;
  batch.reserve(static_cast<size_t>(n));
  for (int64_t k = 0; k < n; ++k) {
    batch.push_back(examples_[order_[position_]]);
    if (++position_ == size()) {
      position_ = 0;
      ++epoch_;
      shuffle_for_epoch();
    }
  }
  return batch;
}

void PromptSampler::seek(int64_t consumed) {
  if (consumed < 0) {
    throw std::invalid_argument("PromptSampler::seek: consumed = " + std::to_string(consumed) + ", expected >= 0");
  }
  epoch_ = consumed / size();
  position_ = consumed % size();
  shuffle_for_epoch();
}

}  // namespace rlt
