#include "rollout/draft.h"

#include <algorithm>

#include "rollout/hash.h"

namespace rlt {

uint64_t hash_tokens(const int64_t* ids, int64_t n) {
  uint64_t h = 0x243f6a8885a308d3ULL ^ uint64_t(n);
  for (int64_t i = 0; i < n; ++i) h = fmix64(h ^ fmix64(uint64_t(ids[i]) + 0x9e3779b97f4a7c15ULL));
  return h;
}

void DraftHistory::remember(const std::vector<int64_t>& prompt, std::vector<Text> texts) {
  const uint64_t key = hash_tokens(prompt.data(), static_cast<int64_t>(prompt.size()));
  auto old = by_prompt_.find(key);
  if (old != by_prompt_.end()) {
    for (const Text& t : old->second) tokens_ -= static_cast<int64_t>(t.ids.size());
    by_prompt_.erase(old);
    order_.erase(std::find(order_.begin(), order_.end(), key));
  }
  int64_t n = 0;
  for (const Text& t : texts) n += static_cast<int64_t>(t.ids.size());
  if (n > max_tokens_) return;
  while (tokens_ + n > max_tokens_) {
    for (const Text& t : by_prompt_[order_.front()]) tokens_ -= static_cast<int64_t>(t.ids.size());
    by_prompt_.erase(order_.front());
    order_.pop_front();
  }
  tokens_ += n;
  by_prompt_[key] = std::move(texts);
  order_.push_back(key);
}

const std::vector<DraftHistory::Text>* DraftHistory::recall(const std::vector<int64_t>& prompt) const {
  auto it = by_prompt_.find(hash_tokens(prompt.data(), static_cast<int64_t>(prompt.size())));
  return it == by_prompt_.end() ? nullptr : &it->second;
}

uint64_t SuffixDrafter::key(int64_t group, int64_t a, int64_t b) {
  return fmix64(fmix64(uint64_t(a) * 0x9e3779b97f4a7c15ULL ^ uint64_t(b)) + uint64_t(group));
}

int64_t SuffixDrafter::add(int64_t group, const std::vector<int64_t>& ids, const std::vector<uint8_t>& sampled) {
  const int64_t t = static_cast<int64_t>(texts_.size());
  texts_.push_back({group, ids, sampled});
  for (int64_t at = 2; at < static_cast<int64_t>(ids.size()); ++at) pending_.emplace_back(t, at);
  return t;
}

void SuffixDrafter::append(int64_t text, int64_t id, bool sampled) {
  Text& t = texts_[text];
  t.ids.push_back(id);
  t.sampled.push_back(sampled);
  if (t.ids.size() >= 3) pending_.emplace_back(text, static_cast<int64_t>(t.ids.size()) - 1);
}

void SuffixDrafter::catch_up() {
  for (const auto& [t, at] : pending_) index(t, at);
  pending_.clear();
}

void SuffixDrafter::index(int64_t t, int64_t at) {
  const Text& x = texts_[t];
  Places& p = index_[key(x.group, x.ids[at - 2], x.ids[at - 1])];
  for (int i = std::min(p.count, kPlaces - 1); i > 0; --i) p.at[i] = p.at[i - 1];
  p.at[0] = {t, at};
  p.count = std::min(p.count + 1, kPlaces);
}

std::vector<int64_t> SuffixDrafter::draft(int64_t text, int64_t max_tokens) {
  catch_up();
  last_match_ = 0;
  std::vector<int64_t> out;
  const Text& x = texts_[text];
  const int64_t len = static_cast<int64_t>(x.ids.size());
  if (max_tokens <= 0 || len < 2) return out;
  auto it = index_.find(key(x.group, x.ids[len - 2], x.ids[len - 1]));
  if (it == index_.end()) return out;
  // Of the pair's places, the one whose match with the context's end runs furthest back.
  Place best;
  int64_t best_len = 0;
  for (int i = 0; i < it->second.count; ++i) {
    const Place p = it->second.at[i];
    const std::vector<int64_t>& src = texts_[p.text].ids;
    int64_t n = 0;
    while (n < options_.max_match && n < p.at && n < len && src[p.at - 1 - n] == x.ids[len - 1 - n]) ++n;
    if (n >= 2 && n > best_len) {  // n < 2: a hash collision
      best = p;
      best_len = n;
    }
  }
  if (best_len == 0) return out;
  const Text& src = texts_[best.text];
  const int64_t end = static_cast<int64_t>(src.ids.size());
  for (int64_t j = best.at; j < end && static_cast<int64_t>(out.size()) < max_tokens; ++j) {
    if (!src.sampled[j] && src.sampled[j - 1]) break;  // the model's text gives way to a reply
    out.push_back(src.ids[j]);
  }
  last_match_ = best_len;
  return out;
}

}  // namespace rlt
