// Prompt datasets: JSONL files with one object per line holding a prompt (a string, or a list of chat
// messages) and an answer, at top-level or dotted keys, loaded whole into
// memory, and a sampler that walks them in deterministic shuffled epochs. A bad line is an error naming
// file:line and what is wrong, or (skip_malformed) is skipped and counted, so a typo in line 40,117 of a
// dataset is found before a run starts, not hours into it.
// Parquet files go through scripts/to_jsonl.py first. Leaves out: streaming files larger than memory,
// JSON arrays, keys that contain a dot, array indices in key paths.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/fields.h"

namespace rlt {

// One turn of a prompt given as a conversation.
struct ChatMessage {
  std::string role;  // system | user | assistant | tool
  std::string content;
};

struct PromptExample {
  std::string prompt;  // the question, before any chat template (a conversation's last user turn)
  std::string answer;  // reference answer (compared by the reward, data/reward.h)
  std::string source;  // where it came from: "file:line", or "synthetic:#i"
  // The set it belongs to, for per-set evaluation metrics: its file's name without the extension
  // ("aime-2024"); "" for synthetic prompts.
  std::string data_source;
  // The conversation, when the dataset gives the prompt as a list of messages (DAPO-Math-17k as slime
  // ships it); empty for a string prompt. A model's own chat template renders it whole.
  std::vector<ChatMessage> messages;
};

// Any problem with data files (datasets, tokenizer models): the message names the file, and the line
// where there is one.
class DataError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One more evaluation file (data.eval_sets): its path, and the keys that read it when they differ.
struct EvalSetOptions {
  std::string path;
  std::string prompt_key;
  std::string answer_key;
  int64_t max_examples = 0;

  template <class V>
  void visit(V&& v) {
    v("path", path, "the JSONL file");
    v("prompt_key", prompt_key, "its question key; empty = data.prompt_key");
    v("answer_key", answer_key, "its answer key; empty = data.answer_key");
    v("max_examples", max_examples, "its first N rows; 0 = all", FieldRange{0, 9.0e18});
  }
  void check(const FieldFail& fail) const {
    if (path.empty()) fail("path", "an evaluation set needs a path");
  }
};

struct DatasetOptions {
  std::string path;
  std::string prompt_key = "prompt";
  std::string answer_key = "answer";
  bool skip_malformed = false;
  int64_t max_examples = 0;
  std::string eval_path;
  std::string eval_prompt_key;
  std::string eval_answer_key;
  std::vector<EvalSetOptions> eval_sets;

  template <class V>
  void visit(V&& v) {
    v("path", path, "JSONL file, one {prompt, answer} object per line; blank lines are ignored");
    v("prompt_key", prompt_key,
      "key of the question (a string, or chat messages [{role, content}]); dotted paths reach nested objects");
    v("answer_key", answer_key,
      "key of the reference answer (a number is kept as written); dotted, e.g. reward_model.ground_truth");
    v("skip_malformed", skip_malformed,
      "skip and count bad lines instead of stopping at the first (an error naming file:line)");
    v("max_examples", max_examples, "keep the first N examples in file order, reading no further; 0 = all",
      FieldRange{0, 9.0e18});
    v("eval_path", eval_path, "evaluation JSONL (e.g. AIME 2024); empty = hold out train.eval_prompts");
    v("eval_prompt_key", eval_prompt_key, "question key of eval_path; empty = prompt_key");
    v("eval_answer_key", eval_answer_key, "answer key of eval_path; empty = answer_key");
    v("eval_sets", eval_sets,
      "more evaluation files, e.g. [{path: data/aime-2024.jsonl}, {path: my.jsonl, answer_key: solution}]; each "
      "file is logged on its own as eval_avg@k/<name>, eval_pass@j/<name>, <name> its file name without extension");
  }
  void check(const FieldFail& fail) const {
    if (prompt_key.empty()) fail("prompt_key", "must not be empty");
    if (answer_key.empty()) fail("answer_key", "must not be empty");
    if (!prompt_key.empty() && prompt_key == answer_key) {
      fail("answer_key", "must differ from prompt_key ('" + prompt_key + "'): the answer would be the question");
    }
    if (!eval_path.empty() && eval_options().prompt_key == eval_options().answer_key) {
      fail("eval_answer_key", "must differ from the evaluation's prompt key: the answer would be the question");
    }
    for (size_t i = 0; i < eval_sets.size(); ++i) {
      if (eval_set_options(i).prompt_key == eval_set_options(i).answer_key) {
        fail("eval_sets", "item " + std::to_string(i) + ": its answer key must differ from its prompt key");
      }
    }
  }
  // The options that read eval_sets[i]: this file's settings with that set's path, keys and row cap.
  DatasetOptions eval_set_options(size_t i) const {
    DatasetOptions o = eval_options();
    const EvalSetOptions& e = eval_sets.at(i);
    o.path = e.path;
    o.prompt_key = e.prompt_key.empty() ? prompt_key : e.prompt_key;
    o.answer_key = e.answer_key.empty() ? answer_key : e.answer_key;
    o.max_examples = e.max_examples;
    return o;
  }
  // The options that read eval_path: this file's settings with the evaluation's path and keys.
  DatasetOptions eval_options() const {
    DatasetOptions o = *this;
    o.path = eval_path;
    if (!eval_prompt_key.empty()) o.prompt_key = eval_prompt_key;
    if (!eval_answer_key.empty()) o.answer_key = eval_answer_key;
    o.max_examples = 0;
    o.eval_path.clear();
    o.eval_sets.clear();
    return o;
  }
};

struct Dataset {
  std::vector<PromptExample> examples;
  int64_t skipped = 0;                    // malformed lines skipped (skip_malformed only)
  std::vector<std::string> skip_reasons;  // the first kMaxSkipReasons of them, each "file:line: why"
  static constexpr int64_t kMaxSkipReasons = 10;
};

// Reads options.path. Throws DataError:
//   "FILE: cannot open ..." / "FILE: is a directory" / "FILE: read error" for the file itself;
//   "FILE:LINE: why" for a bad line: invalid JSON (with the column), not an object, a missing key, a key
//   that is not a string (numbers are accepted as answers and kept as written: 12.50 stays "12.50"),
//   an empty prompt or answer, a byte-order mark after line 1;
//   "FILE: no examples ..." when nothing usable remains (empty file, or every line skipped).
// A UTF-8 byte-order mark at the start of line 1 and a '\r' before each '\n' (Windows files) are accepted.
Dataset load_jsonl(const DatasetOptions& options);

// Deterministic shuffled epochs over a dataset: each pass visits every example exactly once, in an order
// that depends only on (seed, epoch), so a run is reproducible and a resumed one can seek() to where it
// stopped. The shuffle is our own Fisher-Yates over a splitmix64 stream, not std::shuffle, whose output
// differs between standard libraries.
class PromptSampler {
 public:
  // Throws DataError when examples is empty.
  PromptSampler(std::vector<PromptExample> examples, uint64_t seed);

  // The next n examples (n >= 0). A batch that runs past the end of a pass continues into the next
  // pass, so it may hold one example twice when n > size() or across the boundary.
  std::vector<PromptExample> next(int64_t n);

  // Passes completed so far = the pass the next example comes from (0-based).
  int64_t epoch() const { return epoch_; }
  // Examples drawn so far over all passes (what a checkpoint saves).
  int64_t consumed() const { return epoch_ * size() + position_; }
  // Continue as if `consumed` examples had been drawn: a resumed run sees the same batches.
  void seek(int64_t consumed);
  int64_t size() const { return static_cast<int64_t>(examples_.size()); }
  // The current pass's order: order()[i] is the index (into the constructor's examples) of the pass's
  // i-th example.
  const std::vector<int64_t>& order() const { return order_; }

 private:
  void shuffle_for_epoch();

  std::vector<PromptExample> examples_;
  uint64_t seed_;
  int64_t epoch_ = 0;
  int64_t position_ = 0;        // next index into order_
  std::vector<int64_t> order_;  // (size()) permutation of the current pass
};

}  // namespace rlt
