// A model-backed policy steered into tool calls, for rollouts of random models (they write no code): the
// ReTool loop's model tests (tests/rollout/test_retool.cpp) and bench_rollout (apps/, through the project's
// include path). Header-only, so nothing of it is linked into a library.
//
// Each sequence's turn samples `free_before` tokens freely, then a script's tokens are forced one by one
// (+1e4 on their logits), then the sequence waits for the tool's reply; the reply's last tokens
// (`reply_end`, the protocol's close of the interpreter block) start the next turn, free again. With an
// empty reply_end a sequence has one scripted turn and samples freely after it. What a sequence samples
// outside its script is the model's own.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <utility>
#include <vector>

#include "common/memory.h"
#include "common/timing.h"
#include "rollout/engine.h"

namespace rlt::testing {

struct SteerOptions {
  // Prompt i (in the order started) is steered to scripts[i % scripts.size()].
  std::vector<std::vector<int64_t>> scripts;
  int64_t free_before = 0;  // free samples before each turn's script
  // The first calls spread out: sequence n's first turn samples free_before + (37 n mod free_before) freely,
  // so the rows do not all call at once.
  bool spread = false;
  std::vector<int64_t> reply_end;  // the tokens that end a tool's reply; empty: one scripted turn
  // A tool's reply enters in one forward (DecodeEngine::extend); off: one token per step (TokenPolicy's
  // default extend).
  bool multi_token = true;
  // Broken multi-token feeds, for the checks that must reject them: each run of several tokens loses its
  // first; a one-token run's row is fed another token.
  bool drop_first = false;
  bool corrupt_single = false;
};

class SteeredPolicy : public TokenPolicy {
 public:
  SteeredPolicy(const Transformer& m, SteerOptions steer, EngineOptions po = {})
      : inner_(m, po), o_(std::move(steer)) {}
  DecodeEngine& inner() { return inner_; }

  // Ends trajectory n (counted from `first`, the index of this rollout's first prompt in the whole set) with
  // `eos` after budget(first + n) tokens: lengths that differ per trajectory but not between runs.
  void set_lengths(int64_t eos, std::function<int64_t(int64_t)> budget, int64_t first) {
    eos_ = eos;
    budget_ = std::move(budget);
    first_ = first;
  }

  double steer_seconds() const { return steer_s_; }  // host seconds in steer(), so far
  int64_t extends() const { return extends_; }       // multi-token feeds
  // Feeds that carried one-token rows beside longer runs (rollout.merge_feeds).
  int64_t mixed_extends() const { return mixed_extends_; }
  // The cache's rows, at most, after any call.
  int64_t max_cache_rows() const { return max_rows_; }
  // A multi-token feed (a tool's reply) went to a sequence started before the latest admit, after it.
  bool fed_around_an_admit() const { return fed_before_admitted_; }

  at::Tensor start(const std::vector<std::vector<int64_t>>& prompts, int64_t repeats) override {
    rows_.clear();
    prompts_ = 0;
    return steer(add(prompts, repeats), inner_.start(prompts, repeats));
  }
  at::Tensor admit(const std::vector<std::vector<int64_t>>& prompts, int64_t repeats) override {
    last_admitted_ = static_cast<int64_t>(rows_.size());
    std::vector<int64_t> added = add(prompts, repeats);
    return steer(added, inner_.admit(prompts, repeats));
  }
  at::Tensor step(const std::vector<int64_t>& rows, const std::vector<int64_t>& tokens) override {
    for (size_t j = 0; j < rows.size(); ++j) fed(rows_[rows[j]], tokens[j]);
    return steer(rows, inner_.step(rows, tokens));
  }
  at::Tensor extend(const std::vector<int64_t>& rows, const std::vector<std::vector<int64_t>>& runs) override {
    if (!o_.multi_token) return TokenPolicy::extend(rows, runs);
    bool single = false, longer = false;
    for (const auto& r : runs) {
      single |= r.size() == 1;
      longer |= r.size() > 1;
    }
    mixed_extends_ += single && longer;
    for (size_t j = 0; j < rows.size(); ++j) {
      for (int64_t t : runs[j]) fed(rows_[rows[j]], t);
      fed_before_admitted_ |= last_admitted_ >= 0 && rows[j] < last_admitted_;
    }
    ++extends_;
    if (!o_.drop_first && !o_.corrupt_single) return steer(rows, inner_.extend(rows, runs));
    std::vector<std::vector<int64_t>> broken = runs;
    for (auto& r : broken) {
      if (o_.drop_first && r.size() > 1) r.erase(r.begin());
      if (o_.corrupt_single && r.size() == 1) r[0] = (r[0] + 1) % inner_.vocab_size();
    }
    return steer(rows, inner_.extend(rows, broken));
  }
  // A verifying forward (rollout.speculative): each position steered by the row's state after the tokens
  // before it; retract() returns a row to its state before the tokens taken back.
  at::Tensor extend_each(const std::vector<int64_t>& rows, const std::vector<std::vector<int64_t>>& runs) override {
    at::Tensor logits = inner_.extend_each(rows, runs);  // (positions, V)
    before_.clear();
    std::vector<int64_t> at;
    int64_t position = 0;
    for (size_t j = 0; j < rows.size(); ++j) {
      Row& r = rows_[rows[j]];
      std::vector<Row>& states = before_[rows[j]];
      for (int64_t t : runs[j]) {
        states.push_back(r);
        fed(r, t);
        force(r, rows[j], position++, logits.size(1), at);
      }
    }
    return steer_at(at, logits);
  }
  void retract(const std::vector<int64_t>& rows, const std::vector<int64_t>& counts) override {
    inner_.retract(rows, counts);
    for (size_t j = 0; j < rows.size(); ++j) {
      if (counts[j] == 0) continue;
      const std::vector<Row>& states = before_.at(rows[j]);
      rows_[rows[j]] = states[states.size() - counts[j]];
    }
  }
  void release(const std::vector<int64_t>& rows) override { inner_.release(rows); }
  void reserve_rows(int64_t rows) override { inner_.reserve_rows(rows); }
  int64_t vocab_size() const override { return inner_.vocab_size(); }

 private:
  enum class State { kFree, kScript, kWaiting };
  struct Row {
    State state = State::kFree;
    int64_t count = 0;          // free samples of this turn, or script tokens fed
    int64_t fed = 0;            // tokens fed after the prompt
    std::vector<int64_t> tail;  // the last tokens fed, to see the reply's end
    int64_t free_before = 0;    // free samples before this turn's script
    int64_t script = 0;         // index into SteerOptions::scripts
  };

  // Rows for the prompts' sequences, in the order TokenPolicy numbers them; returns their indices.
  std::vector<int64_t> add(const std::vector<std::vector<int64_t>>& prompts, int64_t repeats) {
    const int64_t nscripts = static_cast<int64_t>(o_.scripts.size());
    std::vector<int64_t> added;
    for (size_t u = 0; u < prompts.size(); ++u, ++prompts_) {
      for (int64_t g = 0; g < repeats; ++g) {
        const int64_t n = static_cast<int64_t>(rows_.size());
        Row r;
        r.script = prompts_ % nscripts;
        r.free_before = o_.free_before + (o_.spread ? (37 * n) % o_.free_before : 0);
        if (r.free_before == 0) r.state = State::kScript;
        rows_.push_back(std::move(r));
        added.push_back(n);
      }
    }
    return added;
  }
  void fed(Row& r, int64_t t) {
    r.fed += 1;
    if (!o_.reply_end.empty()) {
      r.tail.push_back(t);
      if (r.tail.size() > o_.reply_end.size()) r.tail.erase(r.tail.begin());
      if (r.tail == o_.reply_end) {  // the next turn starts (also after feedback: random text can close a tag)
        r.state = o_.free_before == 0 ? State::kScript : State::kFree;
        r.count = 0;
        r.free_before = o_.free_before;
        return;
      }
    }
    if (r.state == State::kWaiting) return;
    r.count += 1;
    if (r.state == State::kScript && r.count == static_cast<int64_t>(o_.scripts[r.script].size())) {
      r.state = State::kWaiting;
    } else if (r.state == State::kFree && r.count >= r.free_before) {
      r.state = State::kScript;
      r.count = 0;
    }
  }
  // One scatter-add for the whole call, its flat indices copied in through pinned memory without waiting
  // (a per-row `logits[j][t] += 1e4` is three dispatches a row). Its host time counts in the loop's decode
  // and feed times, which a real model's rollout would not spend: steer_seconds().
  at::Tensor steer(const std::vector<int64_t>& rows, at::Tensor logits) {
    std::vector<int64_t> at;  // flat (row, token) entries to force
    for (size_t j = 0; j < rows.size(); ++j)
      force(rows_[rows[j]], rows[j], static_cast<int64_t>(j), logits.size(1), at);
    return steer_at(at, logits);
  }
  // The entries of logits row j that sequence n's state r forces.
  void force(const Row& r, int64_t n, int64_t j, int64_t V, std::vector<int64_t>& at) const {
    if (r.state == State::kScript) at.push_back(j * V + o_.scripts[r.script][r.count]);
    if (budget_ && r.fed + 1 >= budget_(first_ + n)) at.push_back(j * V + eos_);
  }
  at::Tensor steer_at(const std::vector<int64_t>& at, at::Tensor logits) {
    max_rows_ = std::max(max_rows_, inner_.cache_rows());
    const auto t0 = std::chrono::steady_clock::now();
    if (!at.empty()) {
      const int64_t k = static_cast<int64_t>(at.size());
      logits.view(-1).index_add_(0, to_device_async(at, logits.device()), at::full({k}, 1e4, logits.options()));
    }
    steer_s_ += seconds_since(t0);
    return logits;
  }

  DecodeEngine inner_;
  SteerOptions o_;
  std::vector<Row> rows_;                       // by sequence
  std::map<int64_t, std::vector<Row>> before_;  // the latest extend_each: each row's state before each token
  int64_t prompts_ = 0;                         // prompts started
  int64_t eos_ = -1, first_ = 0;
  std::function<int64_t(int64_t)> budget_;
  double steer_s_ = 0;
  int64_t extends_ = 0, mixed_extends_ = 0, max_rows_ = 0, last_admitted_ = -1;
  bool fed_before_admitted_ = false;
};

}  // namespace rlt::testing
