// JSONL loading and shuffled epochs; see dataset.h.
#include "data/dataset.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <utility>

#include "data/random.h"

namespace rlt {

namespace {

using json = nlohmann::json;

// A member we care about (the prompt or the answer), as the parser met it.
struct Member {
  enum Kind { kMissing, kString, kNumber, kMessages, kOther } kind = kMissing;
  std::string text;       // the string, or the number exactly as written in the file
  const char* type = "";  // for messages: "a boolean", "an array", ...
  int count = 0;          // how often its path appears in the object
};

// One chat message of a prompt given as a list, and the first problem met in it.
struct MessageFields {
  Member role, content;
  const char* element_type = nullptr;  // set when the list element is not an object
};

// "reward_model.ground_truth" -> {"reward_model", "ground_truth"}.
std::vector<std::string> split_path(const std::string& key) {
  std::vector<std::string> out;
  size_t b = 0;
  for (size_t e; (e = key.find('.', b)) != std::string::npos; b = e + 1) out.push_back(key.substr(b, e - b));
  out.push_back(key.substr(b));
  return out;
}

// A SAX pass over one line instead of a DOM: it validates the whole line like json::parse, but also sees
// each number's source text, so an answer written as 12.50 or 123456789012345678901234 (past 64 bits)
// reaches the reward exactly as written instead of through a double. It follows the path of every value
// (object keys and array indices) and keeps the two wanted members, at their dotted paths, and the
// role/content of each message when the prompt is a list; everything else is walked and dropped.
class LineReader : public nlohmann::json_sax<json> {
 public:
  LineReader(const std::string& prompt_key, const std::string& answer_key)
      : prompt_path_(split_path(prompt_key)), answer_path_(split_path(answer_key)) {}

  const char* root_type = nullptr;  // type of the line's value; "an object" is the only good one
  Member prompt, answer;
  std::vector<MessageFields> messages;  // when the prompt is a list
  std::string error;                    // the parser's message when the line is not valid JSON

  bool null() override { return value(Member::kOther, "", "null"); }
  bool boolean(bool) override { return value(Member::kOther, "", "a boolean"); }
  bool number_integer(number_integer_t v) override { return value(Member::kNumber, std::to_string(v), "a number"); }
  bool number_unsigned(number_unsigned_t v) override { return value(Member::kNumber, std::to_string(v), "a number"); }
  bool number_float(number_float_t, const string_t& s) override { return value(Member::kNumber, s, "a number"); }
  bool string(string_t& s) override { return value(Member::kString, s, "a string"); }
  bool binary(binary_t&) override { return value(Member::kOther, "", "binary data"); }
  bool start_object(std::size_t) override { return open(false, "an object"); }
  bool end_object() override { return close(); }
  bool start_array(std::size_t) override { return open(true, "an array"); }
  bool end_array() override { return close(); }
  bool key(string_t& k) override {
    stack_.back().key = k;
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
  struct Frame {
    bool array = false;
    int64_t index = -1;  // arrays: the element being read
    std::string key;     // objects: the member being read
  };

  // Advances the enclosing array's index and tells whether the value about to come sits at `path`
  // (object keys only; a path never crosses an array).
  void enter_value() {
    if (!stack_.empty() && stack_.back().array) ++stack_.back().index;
  }
  bool at(const std::vector<std::string>& path) const {
    if (stack_.size() != path.size() || stack_.empty() || !in_object_) return false;
    for (size_t i = 0; i < path.size(); ++i) {
      if (stack_[i].array || stack_[i].key != path[i]) return false;
    }
    return true;
  }
  // The message index when the value about to come is element [i] of the prompt list (depth +1) or a
  // member of it (depth +2; `field` is its key), else -1.
  int64_t message_index(size_t extra) const {
    const size_t n = prompt_path_.size();
    if (prompt.kind != Member::kMessages || stack_.size() != n + extra) return -1;
    for (size_t i = 0; i < n; ++i) {
      if (stack_[i].array || stack_[i].key != prompt_path_[i]) return -1;
    }
    return stack_[n].array ? stack_[n].index : -1;
  }
  void record(Member& m, Member::Kind kind, const std::string& text, const char* type) {
    m.kind = kind;
    m.text = text;
    m.type = type;
    m.count += 1;
  }
  bool value(Member::Kind kind, const std::string& text, const char* type) {
    if (stack_.empty()) root_type = type;
    enter_value();
    if (at(prompt_path_)) record(prompt, kind, text, type);
    if (at(answer_path_)) record(answer, kind, text, type);
    if (const int64_t i = message_index(1); i >= 0) {  // a list element that is not an object
      if (static_cast<int64_t>(messages.size()) <= i) messages.resize(i + 1);
      messages[i].element_type = type;
    }
    if (const int64_t i = message_index(2); i >= 0) {
      if (static_cast<int64_t>(messages.size()) <= i) messages.resize(i + 1);
      const std::string& field = stack_.back().key;
      if (field == "role") record(messages[i].role, kind, text, type);
      if (field == "content") record(messages[i].content, kind, text, type);
    }
    return true;
  }
  bool open(bool array, const char* type) {
    if (stack_.empty()) {
      root_type = type;
      in_object_ = !array;
    } else {
      enter_value();
      const bool prompt_list = array && at(prompt_path_);
      if (at(prompt_path_)) record(prompt, prompt_list ? Member::kMessages : Member::kOther, "", type);
      if (at(answer_path_)) record(answer, Member::kOther, "", type);  // a container is the wrong type
      if (const int64_t i = message_index(1); i >= 0) {
        if (static_cast<int64_t>(messages.size()) <= i) messages.resize(i + 1);
        if (array) messages[i].element_type = type;
      }
      if (const int64_t i = message_index(2); i >= 0) {
        const std::string& field = stack_.back().key;
        if (field == "role") record(messages[i].role, Member::kOther, "", type);
        if (field == "content") record(messages[i].content, Member::kOther, "", type);
      }
    }
    stack_.push_back(Frame{array, -1, ""});
    return true;
  }
  bool close() {
    stack_.pop_back();
    return true;
  }

  std::vector<std::string> prompt_path_, answer_path_;
  std::vector<Frame> stack_;
  bool in_object_ = false;
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
    if (!is_answer && m->kind == Member::kMessages) continue;
    if (m->kind != Member::kString && !(is_answer && m->kind == Member::kNumber)) {
      why = "key '" + *key + "' is " + m->type + ", expected a string" +
            (is_answer ? " or a number" : " or a list of chat messages");
      return false;
    }
    // An empty answer could never be matched (the reward treats no answer as wrong), so it is a data bug.
    if (is_blank(m->text)) {
      why = std::string("empty ") + (is_answer ? "answer" : "prompt") + " (key '" + *key + "')";
      return false;
    }
  }
  if (reader.prompt.kind == Member::kMessages) {
    if (reader.messages.empty()) {
      why = "key '" + o.prompt_key + "' is an empty list of messages";
      return false;
    }
    for (size_t i = 0; i < reader.messages.size(); ++i) {
      const MessageFields& f = reader.messages[i];
      const std::string at = o.prompt_key + "[" + std::to_string(i) + "]";
      if (f.element_type != nullptr) {
        why = at + " is " + f.element_type + ", expected a message object {\"role\", \"content\"}";
        return false;
      }
      for (const auto& [name, m] : {std::pair<const char*, const Member*>{"role", &f.role}, {"content", &f.content}}) {
        if (m->kind == Member::kMissing) {
          why = at + "." + name + ": missing";
          return false;
        }
        if (m->kind != Member::kString) {
          why = at + "." + name + ": is " + m->type + ", expected a string";
          return false;
        }
      }
      const std::string& role = f.role.text;
      if (role != "system" && role != "user" && role != "assistant" && role != "tool") {
        why = at + ".role: '" + role + "' is not one of system, user, assistant, tool";
        return false;
      }
      out.messages.push_back({role, f.content.text});
      if (role == "user") out.prompt = f.content.text;  // the last user turn: the question
    }
    if (out.prompt.empty() || is_blank(out.prompt)) {
      why = "key '" + o.prompt_key + "' has no non-empty user message";
      return false;
    }
    out.answer = std::move(reader.answer.text);
    return true;
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
    ex.data_source = std::filesystem::path(path).stem().string();
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
