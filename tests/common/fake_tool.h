// A tool runner for rollout tests: answers from a table (unknown code: an error), on a thread after an
// optional delay or before the call returns, and records the calls and when they returned.
#pragma once

#include <chrono>
#include <future>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "rollout/retool.h"

namespace rlt::testing {

struct FakeTool {
  std::map<std::string, std::string> outputs;
  std::map<std::string, int> delay_ms;
  std::vector<std::string> calls;
  std::vector<std::chrono::steady_clock::time_point> returned;
  std::mutex mu;
  // The reply to `code` (unknown code: an error), recorded as returned now.
  SandboxResult answer(const std::string& code) {
    SandboxResult r;
    auto it = outputs.find(code);
    if (it != outputs.end()) {
      r.stdout_text = it->second;
    } else {
      r.exit_code = 1;
      r.stderr_text = "NameError: unknown code";
    }
    std::lock_guard<std::mutex> lock(mu);
    returned.push_back(std::chrono::steady_clock::now());
    return r;
  }
  // Each call answered on a thread of its own, after its delay.
  ToolRunner runner() {
    return [this](const std::string& code) {
      record(code);
      return std::async(std::launch::async, [this, code] {
        const int delay = delay_ms.count(code) ? delay_ms[code] : 0;
        if (delay > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay));
        SandboxResult r = answer(code);
        r.wall_ms = delay;  // the "sandbox's" own clock: its delay
        return r;
      });
    };
  }
  // Each call answered before it returns (no thread, no delay), so the rollout loop collects the reply in
  // the pass that made the call: schedules that do not depend on threads.
  ToolRunner ready_runner() {
    return [this](const std::string& code) {
      record(code);
      std::promise<SandboxResult> done;
      done.set_value(answer(code));
      return done.get_future();
    };
  }

 private:
  void record(const std::string& code) {
    std::lock_guard<std::mutex> lock(mu);
    calls.push_back(code);
  }
};

}  // namespace rlt::testing
