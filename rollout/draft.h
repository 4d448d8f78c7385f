// Drafts for exact speculative rollouts (rollout.speculative: suffix): the tokens a sequence is likely to
// sample next, read off text already seen. No draft model: nothing here has weights that a policy update
// would make stale. The verifying forward and the acceptance rule are the loop's (retool.cpp); a draft only
// decides how many tokens a forward may yield, never which ones (docs/rollout.md, "Speculative rollouts").
//
// A group's texts (its prompt's samples, and the responses of the same prompt in earlier rollouts) share
// one index: each pair of tokens maps to the last few places it was followed by a token. A sequence's
// draft continues, of those places of its last two tokens, the one whose match runs furthest back (up to
// max_match tokens; the latest of equals), in its own text or another of its group, up to the draft's
// length. A continuation stops where the model's text gave way to a tool's reply (a sampled token followed
// by a forced one): the reply is the tool's, never the model's to sample. One index entry a token: the
// index of 64 texts of 768 tokens costs the development machine's host about 10 ms. Text is indexed when a
// draft is next asked for, in the order it arrived (the same index as one kept up to date token by token), so
// a rollout that never drafts (more rows than rollout.speculative_max_rows throughout) never builds it.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

namespace rlt {

// The responses of earlier rollouts, by prompt (its tokens' hash), bounded in tokens: the oldest prompts'
// go first. A cache of drafts only: trajectories do not depend on it (a verified draft yields the tokens
// plain decoding samples), so a resumed run starts it empty.
class DraftHistory {
 public:
  explicit DraftHistory(int64_t max_tokens) : max_tokens_(max_tokens) {}
  struct Text {
    std::vector<int64_t> ids;      // the response
    std::vector<uint8_t> sampled;  // (ids) 1 = sampled by the policy, 0 = tool reply or feedback
  };
  // The texts of a prompt's latest rollout (replacing any earlier ones of it).
  void remember(const std::vector<int64_t>& prompt, std::vector<Text> texts);
  const std::vector<Text>* recall(const std::vector<int64_t>& prompt) const;
  int64_t tokens() const { return tokens_; }
  int64_t prompts() const { return static_cast<int64_t>(by_prompt_.size()); }

 private:
  int64_t max_tokens_;
  int64_t tokens_ = 0;
  std::unordered_map<uint64_t, std::vector<Text>> by_prompt_;
  std::deque<uint64_t> order_;  // prompts, oldest first
};

uint64_t hash_tokens(const int64_t* ids, int64_t n);

struct DraftOptions {
  int64_t max_match = 8;  // a match's length is counted up to this many tokens
};

class SuffixDrafter {
 public:
  explicit SuffixDrafter(DraftOptions options = {}) : options_(options) {}
  // A new text of `group` (a sequence; or an earlier rollout's response, which never grows), its tokens so far.
  // Returns its id.
  int64_t add(int64_t group, const std::vector<int64_t>& ids, const std::vector<uint8_t>& sampled);
  // Text `text` gets one more token.
  void append(int64_t text, int64_t id, bool sampled);
  // Up to max_tokens tokens that may follow text `text`; empty when its last two tokens never occurred
  // before (followed by a token). Indexes the text added since the last draft first.
  std::vector<int64_t> draft(int64_t text, int64_t max_tokens);
  // Tokens added or appended and not yet indexed (each is once a draft is asked for).
  int64_t unindexed() const { return static_cast<int64_t>(pending_.size()); }
  // The length of the match the latest draft() continued (0: none; at most max_match).
  int64_t last_match() const { return last_match_; }

 private:
  struct Place {
    int64_t text = -1;
    int64_t at = 0;  // the index of the token that followed the pair
  };
  static constexpr int kPlaces = 4;  // places kept per pair, the latest first
  struct Places {
    std::array<Place, kPlaces> at;
    int count = 0;
  };
  struct Text {
    int64_t group = 0;
    std::vector<int64_t> ids;
    std::vector<uint8_t> sampled;
  };
  // Indexes the pair just before token `at` of text t (that token follows it).
  void index(int64_t t, int64_t at);
  // Indexes pending_, in order.
  void catch_up();
  static uint64_t key(int64_t group, int64_t a, int64_t b);

  DraftOptions options_;
  std::vector<Text> texts_;
  std::unordered_map<uint64_t, Places> index_;        // (group, pair) -> the last places it was followed
  std::vector<std::pair<int64_t, int64_t>> pending_;  // (text, at) to index, in the order they arrived
  int64_t last_match_ = 0;
};

}  // namespace rlt
