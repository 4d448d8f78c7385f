// reward.kind python: the driver that runs the script in the sandbox, the batching over the pool, and the
// reading of its answers; see python_reward.h.
#include "rollout/python_reward.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <future>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace rlt {

namespace {

// The driver. The runner (sandbox_runner.py) compiles the call as "<stdin>", so frames with that file name
// are the driver's and leave the script's tracebacks; the script is compiled under its own path, and its
// source is put in linecache (the sandbox may not let it read the file), so its tracebacks show its lines.
constexpr const char* kDriver = R"PY(
def _rlt_reward(payload):
    import base64, json, linecache, math, numbers, os, signal, sys, time, traceback, types
    p = json.loads(base64.b64decode(payload))
    out = os.fdopen(os.dup(1), 'w', encoding='ascii')
    os.dup2(2, 1)
    path, source, limit = p['path'], p['source'], p['timeout']

    def emit(obj):
        out.write(json.dumps(obj) + '\n')
        out.flush()

    class Timeout(BaseException):  # not an Exception: a script's `except Exception` lets it through
        pass

    def on_alarm(signum, frame):
        raise Timeout()

    signal.signal(signal.SIGALRM, on_alarm)

    def timed(fn, *args):
        signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            return fn(*args)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    def trace(e):
        if isinstance(e, Timeout):
            return 'timed out after %g s (sandbox.timeout_s)' % limit
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == '<stdin>':
            tb = tb.tb_next
        text = ''.join(traceback.format_exception(type(e), e, tb))
        return text if len(text) <= 4000 else '...' + text[-4000:]

    def finite(x):
        try:
            return isinstance(x, numbers.Real) and math.isfinite(float(x))
        except Exception:
            return False

    def shown(x):
        try:
            text = repr(x)
        except Exception:
            text = '?'
        return type(x).__name__ + ' ' + (text if len(text) <= 80 else text[:80] + '...')

    linecache.cache[path] = (len(source), None, source.splitlines(True), path)
    module = types.ModuleType('reward_script')
    module.__file__ = path
    sys.modules['reward_script'] = module
    try:
        timed(exec, compile(source, path, 'exec', dont_inherit=True), module.__dict__)
    except BaseException as e:
        emit({'fatal': 'importing ' + path + ' failed:\n' + trace(e)})
        return
    fn = module.__dict__.get('reward')
    if not callable(fn):
        emit({'fatal': path + ' defines no function reward(prompt, response, answer)'})
        return
    if not p['queries']:
        emit({'ready': True})
        return
    class Bad(Exception):  # a result outside the contract: the message says how, without a traceback
        pass

    for i, (prompt, response, answer) in enumerate(p['queries']):
        t0 = time.perf_counter()
        try:
            v = timed(fn, prompt, response, answer)
            fields, correct, score = {}, None, v
            if isinstance(v, dict):
                if 'score' not in v:
                    raise Bad('returned a dict without "score" (keys: %s)' % ', '.join(sorted(map(str, v))[:10]))
                score = v['score']
                correct = v.get('correct')
                if 'correct' in v and not isinstance(correct, bool):
                    raise Bad('returned "correct": %s, expected a bool' % shown(correct))
                for k, x in v.items():
                    if k not in ('score', 'correct') and finite(x):
                        fields[str(k)] = float(x)
            if not finite(score):
                raise Bad('returned %s, expected a finite number or a dict with one under "score"' % shown(score))
            emit({'i': i, 'score': float(score), 'correct': correct, 'fields': fields, 's': time.perf_counter() - t0})
        except Bad as e:
            emit({'i': i, 'error': 'reward(prompt, response, answer) ' + str(e), 's': time.perf_counter() - t0})
        except BaseException as e:
            emit({'i': i, 'error': trace(e), 's': time.perf_counter() - t0})
    emit({'done': len(p['queries'])})
)PY";

std::string base64(const std::string& in) {
  static const char* kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  for (size_t i = 0; i < in.size(); i += 3) {
    const uint32_t b0 = static_cast<unsigned char>(in[i]);
    const uint32_t b1 = i + 1 < in.size() ? static_cast<unsigned char>(in[i + 1]) : 0;
    const uint32_t b2 = i + 2 < in.size() ? static_cast<unsigned char>(in[i + 2]) : 0;
    const uint32_t v = (b0 << 16) | (b1 << 8) | b2;
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += i + 1 < in.size() ? kAlphabet[(v >> 6) & 63] : '=';
    out += i + 2 < in.size() ? kAlphabet[v & 63] : '=';
  }
  return out;
}

// The tail of a call's stderr, for a failure that has no message of its own.
std::string stderr_tail(const SandboxResult& r) {
  const size_t keep = 2000;
  const std::string& e = r.stderr_text;
  return e.size() <= keep ? e : "..." + e.substr(e.size() - keep);
}

// Why a call left queries without an answer.
std::string call_failure(const SandboxResult& r) {
  if (r.timed_out) {
    return "the reward call was killed at its own time limit (sandbox.timeout_s x " +
           std::to_string(PythonReward::kMaxQueriesPerCall + 2) + ") before this trajectory was scored";
  }
  std::string why = "the interpreter ended (exit code " + std::to_string(r.exit_code) + ")";
  if (r.truncated) why += " or its answers were cut at the output limit";
  why += " before this trajectory was scored";
  const std::string tail = stderr_tail(r);
  return tail.empty() ? why : why + "; its stderr:\n" + tail;
}

}  // namespace

void RewardTally::add(const std::vector<ScriptScore>& scores) {
  for (const ScriptScore& s : scores) {
    ++scored;
    failed += s.failed;
    for (const auto& [name, value] : s.fields) {
      auto& [sum, count] = fields[name];
      sum += value;
      ++count;
    }
  }
}

void RewardTally::add(const RewardTally& other) {
  scored += other.scored;
  failed += other.failed;
  seconds += other.seconds;
  for (const auto& [name, sc] : other.fields) {
    auto& [sum, count] = fields[name];
    sum += sc.first;
    count += sc.second;
  }
  for (const auto& [name, sc] : other.terms) {
    auto& [sum, count] = terms[name];
    sum += sc.first;
    count += sc.second;
  }
}

std::string read_reward_script(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) throw RewardScriptError(path + ": cannot read the reward script");
  std::ifstream f(path, std::ios::binary);
  if (!f) throw RewardScriptError(path + ": cannot read the reward script");
  std::ostringstream s;
  s << f.rdbuf();
  if (f.bad()) throw RewardScriptError(path + ": cannot read the reward script");
  return s.str();
}

SandboxOptions reward_sandbox_options(const SandboxOptions& sandbox, int64_t max_queries) {
  SandboxOptions o = sandbox;
  o.site_packages = true;
  o.timeout_s = sandbox.timeout_s * static_cast<double>(max_queries + 2);
  // An answer line is about 100 bytes plus the fields; a failure's traceback at most 4000.
  o.max_output_bytes = std::max<int64_t>(sandbox.max_output_bytes, 8 * 1024 * 1024);
  return o;
}

std::string reward_call_code(const std::string& path, const std::string& source, double timeout_s,
                             const std::vector<RewardQuery>& queries) {
  nlohmann::json q = nlohmann::json::array();
  for (const RewardQuery& r : queries) q.push_back({r.prompt, r.response, r.answer});
  const nlohmann::json payload{{"path", path}, {"source", source}, {"timeout", timeout_s}, {"queries", q}};
  // Invalid UTF-8 (a response cut inside a character) becomes U+FFFD rather than failing the dump.
  const std::string text = payload.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return std::string(kDriver) + "\n_rlt_reward('" + base64(text) + "')\n";
}

std::vector<ScriptScore> parse_reward_call(const SandboxResult& result, int64_t count, const RewardOptions& options) {
  std::vector<ScriptScore> out(count);
  std::vector<bool> answered(count, false);
  std::string fatal;
  std::istringstream lines(result.stdout_text);
  for (std::string line; std::getline(lines, line);) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) continue;
    if (j.contains("fatal") && j["fatal"].is_string()) fatal = j["fatal"].get<std::string>();
    if (!j.contains("i") || !j["i"].is_number_integer()) continue;
    const int64_t i = j["i"].get<int64_t>();
    if (i < 0 || i >= count || answered[i]) continue;
    ScriptScore& s = out[i];
    if (j.contains("s") && j["s"].is_number()) s.seconds = j["s"].get<double>();
    if (j.contains("error")) {
      s.failed = true;
      s.error = j["error"].is_string() ? j["error"].get<std::string>() : "the script failed";
    } else if (j.contains("score") && j["score"].is_number() && std::isfinite(j["score"].get<double>())) {
      s.reward = j["score"].get<double>();
      const nlohmann::json& c = j.value("correct", nlohmann::json());
      s.correct = c.is_boolean() ? c.get<bool>() : s.reward >= options.correct;
      if (j.contains("fields") && j["fields"].is_object()) {
        for (const auto& [name, v] : j["fields"].items()) {
          if (v.is_number() && std::isfinite(v.get<double>())) s.fields[name] = v.get<double>();
        }
      }
    } else {
      continue;  // not an answer line
    }
    answered[i] = true;
  }
  const std::string missing = fatal.empty() ? call_failure(result) : fatal;
  for (int64_t i = 0; i < count; ++i) {
    if (!answered[i]) {
      out[i].failed = true;
      out[i].error = missing;
    }
    if (out[i].failed) {
      out[i].reward = options.wrong;
      out[i].correct = false;
      out[i].fields.clear();
    }
  }
  return out;
}

void check_reward_script(const std::string& path, const SandboxOptions& sandbox) {
  const std::string source = read_reward_script(path);
  const SandboxResult r =
      run_python(reward_call_code(path, source, sandbox.timeout_s, {}), reward_sandbox_options(sandbox, 0));
  std::istringstream lines(r.stdout_text);
  for (std::string line; std::getline(lines, line);) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) continue;
    if (j.value("ready", false)) return;
    if (j.contains("fatal") && j["fatal"].is_string()) throw RewardScriptError(j["fatal"].get<std::string>());
  }
  std::string why = r.timed_out ? "its import was killed at the time limit (sandbox.timeout_s)"
                                : "the interpreter ended (exit code " + std::to_string(r.exit_code) + ")";
  const std::string tail = stderr_tail(r);
  throw RewardScriptError("importing " + path + " failed: " + why + (tail.empty() ? "" : "; its stderr:\n" + tail));
}

PythonReward::PythonReward(const RewardOptions& options, const SandboxOptions& sandbox)
    : options_(options),
      source_(read_reward_script(options.script)),
      workers_(sandbox.workers),
      timeout_s_(sandbox.timeout_s),
      pool_(std::make_unique<SandboxPool>(reward_sandbox_options(sandbox, kMaxQueriesPerCall))) {}

std::vector<ScriptScore> PythonReward::score(const std::vector<RewardQuery>& queries) {
  const int64_t n = static_cast<int64_t>(queries.size());
  if (n == 0) return {};
  const int64_t per_worker = (n + workers_ - 1) / workers_;
  const int64_t calls = (n + std::min(kMaxQueriesPerCall, per_worker) - 1) / std::min(kMaxQueriesPerCall, per_worker);
  // Equal shares: 100 queries on 4 workers are 4 calls of 25; 300 are 5 calls of 60.
  std::vector<std::pair<int64_t, int64_t>> ranges;  // [begin, end) of each call
  std::vector<std::future<SandboxResult>> results;
  for (int64_t c = 0; c < calls; ++c) {
    const int64_t begin = n * c / calls, end = n * (c + 1) / calls;
    ranges.emplace_back(begin, end);
    results.push_back(
        pool_->submit(reward_call_code(options_.script, source_, timeout_s_,
                                       std::vector<RewardQuery>(queries.begin() + begin, queries.begin() + end))));
  }
  std::vector<ScriptScore> out;
  out.reserve(n);
  for (int64_t c = 0; c < calls; ++c) {
    const auto [begin, end] = ranges[c];
    for (ScriptScore& s : parse_reward_call(results[c].get(), end - begin, options_)) {
      if (s.failed && !shown_.exchange(true)) {
        std::cerr << "warning: reward.script " << options_.script
                  << " failed on a trajectory (its reward is reward.wrong = " << options_.wrong
                  << "; failures are counted in the metric reward_errors and not shown again):\n"
                  << s.error << (s.error.empty() || s.error.back() != '\n' ? "\n" : "");
      }
      out.push_back(std::move(s));
    }
  }
  return out;
}

}  // namespace rlt
