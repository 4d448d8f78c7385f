// Custom rewards in Python (reward.kind: python): a script defining reward(prompt, response, answer) runs in
// the sandbox's pool of prestarted interpreters (rollout/sandbox.h), many trajectories per call. Leaves out:
// a script of several files (only site-packages and the standard library are importable beside it), and
// keeping the script imported between calls (each sandboxed interpreter runs one call and ends, so every
// call imports it again).
//
// The contract. reward(prompt, response, answer) gets the question before any chat template, the model-written
// text (tool output left out, as the built-in matcher reads it) and the reference answer, all str, and
// returns a finite number, or a dict with a finite number under "score" and optionally:
//   "correct": bool, whether the trajectory counts as correct (the accuracy metrics); without it a
//              trajectory is correct when score >= reward.correct;
//   any other key with a finite number: logged as reward/<key>, its mean over the step's trajectories that
//              returned it; other values are left out of the metrics.
// A call that fails gets reward.wrong and is not correct: an exception (SystemExit included), more than
// sandbox.timeout_s for the trajectory, a result that is not a finite number (NaN, a string, None, a dict
// without "score", a "correct" that is no bool), or the interpreter ending before it answered (memory,
// a crash, the call's time limit). The import of the script has sandbox.timeout_s too. The per-trajectory
// limit is an ITIMER_REAL alarm in the interpreter (a script must not set its own SIGALRM), and the
// call's own limit, sandbox.timeout_s x (kMaxQueriesPerCall + 2), is the backstop for code that holds off
// the alarm (one share for the import, one for the interpreter and the driver).
//
// The protocol. The trainer sends one call per batch: a small driver, the script's source and the queries,
// base64-encoded JSON. The driver answers one JSON line per trajectory on a duplicate of the original stdout;
// fd 1 itself is pointed at stderr before the script is imported, so whatever the script or its C libraries
// print goes to the call's stderr and cannot be mistaken for a result.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "data/reward.h"
#include "rollout/sandbox.h"

namespace rlt {

// A script that cannot be used: unreadable, failing to import, or defining no callable `reward`. The message
// names the path.
class RewardScriptError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One trajectory to score.
struct RewardQuery {
  std::string prompt;    // the question, before any chat template (PromptExample::prompt)
  std::string response;  // the model-written text (Trajectory::response_text)
  std::string answer;    // the reference answer
};

struct ScriptScore {
  double reward = 0;     // the script's score; reward.wrong when the call failed
  bool correct = false;  // the dict's "correct" when it has one, else reward >= reward.correct; false on failure
  bool failed = false;
  std::string error;                     // failed: what went wrong, with the script's traceback when it raised
  std::map<std::string, double> fields;  // a dict's other finite numbers
  double seconds = 0;                    // the reward() call in the interpreter (0 when it never answered)
};

// The totals of some scorings, for one step's metrics.
struct RewardTally {
  int64_t scored = 0, failed = 0;
  std::map<std::string, std::pair<double, int64_t>> fields;  // name -> (sum, trajectories that returned it)
  // reward.combine or reward.kind model: each term's kind -> (sum of its unweighted values, trajectories)
  std::map<std::string, std::pair<double, int64_t>> terms;
  double seconds = 0;  // the scoring's wall time (score_rewards)
  void add(const std::vector<ScriptScore>& scores);
  // Another scoring's counts and sums; the times add up, as for rounds scored one after another.
  void add(const RewardTally& other);
};

// The script's source; RewardScriptError naming the path when it cannot be read.
std::string read_reward_script(const std::string& path);

// Imports the script at `path` in a fresh sandbox (the options PythonReward's calls use) and checks that it
// defines a callable `reward`; RewardScriptError naming the path otherwise (with the import's traceback).
// SandboxError when the sandbox itself fails.
void check_reward_script(const std::string& path, const SandboxOptions& sandbox);

// The sandbox options of the reward calls: `sandbox`'s limits, with site-packages importable whatever
// sandbox.site_packages says (that key is about the policy's tool code; a reward imports math_verify or
// sympy), room for every trajectory's answer line, and the call's limit sandbox.timeout_s x
// (max_queries + 2).
SandboxOptions reward_sandbox_options(const SandboxOptions& sandbox, int64_t max_queries);

class PythonReward {
 public:
  // The most trajectories in one call: a batch of n goes out as ceil(n / per_call) calls of equal size, with
  // per_call = min(kMaxQueriesPerCall, ceil(n / sandbox.workers)), spread over the pool's workers.
  static constexpr int64_t kMaxQueriesPerCall = 64;

  // Reads options.script (RewardScriptError when it cannot be read; its import is checked by
  // check_reward_script, when the config is read) and starts the pool of reward_sandbox_options.
  PythonReward(const RewardOptions& options, const SandboxOptions& sandbox);

  // One score per query, in order. Never throws for anything the script does (SandboxError only when the
  // sandbox itself fails). The first failure in this object's life is printed to stderr with its traceback.
  std::vector<ScriptScore> score(const std::vector<RewardQuery>& queries);

  const std::string& path() const { return options_.script; }

 private:
  RewardOptions options_;
  std::string source_;
  int64_t workers_ = 1;
  double timeout_s_ = 0;  // per trajectory and for the import
  std::unique_ptr<SandboxPool> pool_;
  std::atomic<bool> shown_{false};
};

// The code of one call: the driver, then its invocation on `queries` with the script's source (exposed for
// tests). With no queries the call only imports the script and answers {"ready": true}.
std::string reward_call_code(const std::string& path, const std::string& source, double timeout_s,
                             const std::vector<RewardQuery>& queries);

// The scores of `count` queries from one call's result: its answer lines, then for the queries left without
// one (the interpreter died, the call's limit came, its output was cut), a failure saying why (exposed for
// tests).
std::vector<ScriptScore> parse_reward_call(const SandboxResult& result, int64_t count, const RewardOptions& options);

}  // namespace rlt
