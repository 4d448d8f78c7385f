// A tool runner for rollout tests: answers from a table (unknown code: an error), after an optional delay,
// and records the calls and when they returned.
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
  ToolRunner runner() {
    return [this](const std::string& code) {
      {
        std::lock_guard<std::mutex> lock(mu);
        calls.push_back(code);
      }
      return std::async(std::launch::async, [this, code] {
        if (delay_ms.count(code)) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms[code]));
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
      });
    };
  }
};

}  // namespace rlt::testing
