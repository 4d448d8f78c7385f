// bench_sandbox: what a sandboxed tool call costs beyond the interpreter's own start-up, measured from a
// trainer-sized caller (--resident-gb of touched memory, so page-table copies would show), beside the
// peers in the same process:
//   bare       posix_spawn of `python -I -S -c pass` (the interpreter's start-up: the floor)
//   fork_exec  fork() + execve of the same (what a call cost when each clone copied the caller's tables)
//   bwrap      bubblewrap running the same in a jail like ours (--unshare-all, read-only binds), if on PATH
//   sandbox    run_python("pass") without site-packages, one call at a time and on --workers threads,
//              and one at a time with sandbox.cgroups off
//   pool       a one-worker SandboxPool, calls --gap-ms apart (a tool call now and then, as a rollout makes
//              them): the latency from submit to result, cold (sandbox.prestart off) and prestarted, with
//              and without site-packages
// then --load-s seconds of the demo's tool calls on --workers workers: calls/s, p50/p99 latency, calls
// lost or timed out, and processes or directories left behind. Prints a table, or one JSON object with
// --json. Bad flags are exit code 2.
//   build/bin/bench_sandbox --resident-gb 4 --calls 100 --workers 16 --load-s 60 [--json]
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <dirent.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <future>
#include <iostream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "common/timing.h"
#include "rollout/sandbox.h"

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;

using rlt::ms_since;
using rlt::percentile;

double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / v.size();
}

// Runs argv with stdin, stdout and stderr on /dev/null and waits; false when it could not start or failed.
bool spawn_wait(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  for (int fd = 0; fd < 3; ++fd)
    posix_spawn_file_actions_addopen(&fa, fd, "/dev/null", fd == 0 ? O_RDONLY : O_WRONLY, 0);
  pid_t pid = -1;
  const int err = posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (err != 0) return false;
  int st = 0;
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

// fork() + execve: the child copies this process's page tables before it can exec.
bool fork_exec_wait(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    const int null = open("/dev/null", O_RDWR);
    dup2(null, 0), dup2(null, 1), dup2(null, 2);
    execve(argv[0], argv.data(), environ);
    _exit(127);
  }
  int st = 0;
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  return pid > 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

// `calls` runs of `one` on `threads` threads: per-call latencies (ms) and calls per second.
struct Rate {
  std::vector<double> ms;
  double calls_per_s = 0;
  int64_t failed = 0;
};
Rate measure(int64_t calls, int64_t threads, const std::function<bool()>& one) {
  Rate r;
  std::vector<std::vector<double>> per(threads);
  std::atomic<int64_t> next{0}, failed{0};
  const auto t0 = Clock::now();
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      while (next.fetch_add(1) < calls) {
        const auto c0 = Clock::now();
        if (!one()) ++failed;
        per[t].push_back(ms_since(c0));
      }
    });
  }
  for (auto& th : pool) th.join();
  const double wall_ms = ms_since(t0);
  for (auto& v : per) r.ms.insert(r.ms.end(), v.begin(), v.end());
  r.calls_per_s = calls / (wall_ms / 1000);
  r.failed = failed;
  return r;
}

nlohmann::json summary(const Rate& r) {
  return {{"calls", r.ms.size()},
          {"failed", r.failed},
          {"calls_per_s", r.calls_per_s},
          {"mean_ms", mean(r.ms)},
          {"p50_ms", percentile(r.ms, 0.5)},
          {"p99_ms", percentile(r.ms, 0.99)}};
}

// The sandbox's processes still alive (rlt-sandbox-init, or the interpreter reading its script from
// stdin), and this tmp root's rlt-sandbox-* entries: what a leak would leave.
int64_t count_sandbox_processes(const std::string& exe) {
  int64_t n = 0;
  if (DIR* d = opendir("/proc")) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] < '1' || e->d_name[0] > '9') continue;
      std::ifstream in(std::string("/proc/") + e->d_name + "/cmdline");
      std::string cmd((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      const bool init = cmd.rfind("rlt-sandbox-init", 0) == 0;
      const bool script = cmd.rfind(exe + '\0', 0) == 0 && cmd.size() >= 3 &&
                          cmd.compare(cmd.size() - 3, 3, std::string("\0-\0", 3)) == 0;
      n += init || script;
    }
    closedir(d);
  }
  return n;
}
int64_t count_sandbox_dirs(const std::string& root) {
  int64_t n = 0;
  if (DIR* d = opendir(root.c_str())) {
    while (dirent* e = readdir(d)) n += std::strncmp(e->d_name, "rlt-sandbox-", 12) == 0;
    closedir(d);
  }
  return n;
}

std::string which(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::string p = path ? path : "/usr/bin:/bin";
  for (size_t a = 0; a <= p.size();) {
    const size_t b = std::min(p.find(':', a), p.size());
    const std::string full = p.substr(a, b - a) + "/" + name;
    if (b > a && access(full.c_str(), X_OK) == 0) return full;
    a = b + 1;
  }
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_sandbox: the cost of a sandboxed tool call beside the interpreter's own start-up"};
  double resident_gb = 4, load_s = 60;
  int64_t calls = 100, workers = 16;
  double gap_ms = 100;
  bool as_json = false;
  std::string python = "python3";
  app.add_option("--resident-gb", resident_gb, "memory this process touches first, GiB (a trainer's size)")
      ->check(CLI::Range(0.0, 1024.0));
  app.add_option("--calls", calls, "calls per latency measurement")->check(CLI::Range(1, 1000000));
  app.add_option("--workers", workers, "concurrent calls for the throughput runs")->check(CLI::Range(1, 4096));
  app.add_option("--load-s", load_s, "seconds of the demo's tool calls on --workers workers (0: skip)")
      ->check(CLI::Range(0.0, 86400.0));
  app.add_option("--gap-ms", gap_ms, "pause before each of the pool's spaced calls, ms")->check(CLI::Range(0.0, 1e5));
  app.add_option("--python", python, "interpreter: a path or a name in PATH");
  app.add_flag("--json", as_json, "print one JSON object instead of the table");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return e.get_exit_code() == 0 ? app.exit(e) : (app.exit(e), 2);
  }

  // The caller's size: touched pages, so that every one has a page-table entry to copy.
  const size_t resident = static_cast<size_t>(resident_gb * (1ull << 30));
  char* ballast = resident > 0 ? static_cast<char*>(std::malloc(resident)) : nullptr;
  if (resident > 0 && ballast == nullptr) {
    std::cerr << "bench_sandbox: --resident-gb " << resident_gb << ": cannot allocate\n";
    return 2;
  }
  for (size_t i = 0; i < resident; i += 4096) ballast[i] = static_cast<char>(i);

  rlt::SandboxOptions o;
  o.python = python;
  o.site_packages = false;
  o.timeout_s = 30;
  o.workers = workers;
  rlt::SandboxResult first;
  try {
    first = rlt::run_python("import sys\nprint(sys.executable)", o);  // resolves the interpreter once
  } catch (const rlt::SandboxError& e) {
    std::cerr << "bench_sandbox: --python " << python << ": " << e.what() << "\n";
    return 2;
  }
  std::string exe = first.stdout_text.substr(0, first.stdout_text.find('\n'));
  if (exe.empty() || exe[0] != '/') {
    std::cerr << "bench_sandbox: --python " << python << " does not report its executable: " << first.stderr_text
              << "\n";
    return 2;
  }
  const std::vector<std::string> bare_args = {exe, "-I", "-S", "-c", "pass"};
  auto sandbox_pass = [&] {
    const rlt::SandboxResult r = rlt::run_python("pass", o);
    return r.exit_code == 0 && !r.timed_out;
  };

  nlohmann::json out = {{"resident_gb", resident_gb}, {"python", exe}, {"isolation", first.isolation}};
  out["bare"] = {{"one", summary(measure(calls, 1, [&] { return spawn_wait(bare_args); }))},
                 {"workers", summary(measure(calls, workers, [&] { return spawn_wait(bare_args); }))}};
  out["fork_exec"] = {{"one", summary(measure(calls, 1, [&] { return fork_exec_wait(bare_args); }))}};
  out["sandbox"] = {{"one", summary(measure(calls, 1, sandbox_pass))},
                    {"workers", summary(measure(calls, workers, sandbox_pass))}};
  o.cgroups = false;  // the same without the per-call cgroups (their attach is the v1 hosts' cost)
  out["sandbox_no_cgroups"] = {{"one", summary(measure(calls, 1, sandbox_pass))}};
  o.cgroups = true;
  const std::string bwrap = which("bwrap");
  if (!bwrap.empty()) {
    // A jail like ours: new namespaces, the system and the interpreter's prefix read-only, a tmpfs home.
    const std::string prefix = exe.substr(0, exe.rfind("/bin/"));
    std::vector<std::string> args = {bwrap, "--unshare-all", "--die-with-parent", "--ro-bind", "/usr", "/usr"};
    for (const char* link : {"/bin", "/lib", "/lib64", "/sbin"}) {
      char target[4096];
      const ssize_t n = readlink(link, target, sizeof target - 1);
      if (n > 0) args.insert(args.end(), {"--symlink", std::string(target, n), link});
    }
    if (prefix.rfind("/usr", 0) != 0) args.insert(args.end(), {"--ro-bind", prefix, prefix});
    args.insert(args.end(), {"--dev", "/dev", "--tmpfs", "/tmp", "--chdir", "/tmp"});
    args.insert(args.end(), bare_args.begin(), bare_args.end());
    const Rate probe = measure(1, 1, [&] { return spawn_wait(args); });
    out["bwrap"] = probe.failed == 0 ? summary(measure(calls, 1, [&] { return spawn_wait(args); }))
                                     : nlohmann::json{{"error", "bwrap could not run the interpreter here"}};
  }
  // Spaced calls through a one-worker pool: what a rollout's occasional tool call waits, submit to result.
  for (bool prestart : {false, true}) {
    for (bool site : {false, true}) {
      rlt::SandboxOptions po = o;
      po.workers = 1;
      po.prestart = prestart;
      po.site_packages = site;
      rlt::SandboxPool pool(po);
      Rate r;
      for (int64_t i = 0; i < calls; ++i) {
        std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(gap_ms));
        const auto c0 = Clock::now();
        const rlt::SandboxResult res = pool.submit("pass").get();
        r.ms.push_back(ms_since(c0));
        r.failed += res.exit_code != 0 || res.timed_out;
      }
      nlohmann::json j = summary(r);
      j.erase("calls_per_s");  // the calls are spaced on purpose: no rate
      out["pool"][prestart ? "prestarted" : "cold"][site ? "site" : "no_site"] = j;
    }
  }
  const double overhead = out["sandbox"]["one"]["mean_ms"].get<double>() - out["bare"]["one"]["mean_ms"].get<double>();
  out["overhead_ms"] = overhead;

  if (load_s > 0) {
    // The demo's tool calls (print(a * b)) with site-packages, as the trainer runs them, for load_s.
    rlt::SandboxOptions lo = o;
    lo.site_packages = true;
    lo.timeout_s = 10;
    const std::string tmp_root =
        std::getenv("TMPDIR") && std::getenv("TMPDIR")[0] == '/' ? std::getenv("TMPDIR") : "/tmp";
    const int64_t procs_before = count_sandbox_processes(exe), dirs_before = count_sandbox_dirs(tmp_root);
    std::vector<double> lat;
    int64_t done = 0, wrong = 0, timed_out = 0, errors = 0;
    {
      rlt::SandboxPool pool(lo);
      const auto t0 = Clock::now();
      struct InFlight {
        std::future<rlt::SandboxResult> result;
        int64_t expected;
      };
      std::deque<InFlight> inflight;
      int64_t k = 0;
      while (ms_since(t0) < load_s * 1000 || !inflight.empty()) {
        while (ms_since(t0) < load_s * 1000 && static_cast<int64_t>(inflight.size()) < 2 * workers) {
          const int64_t a = 100 + k % 900, b = 10 + k % 90;
          inflight.push_back({pool.submit("print(" + std::to_string(a) + " * " + std::to_string(b) + ")"), a * b});
          ++k;
        }
        try {
          const rlt::SandboxResult r = inflight.front().result.get();
          lat.push_back(r.wall_ms);
          timed_out += r.timed_out;
          wrong += r.stdout_text != std::to_string(inflight.front().expected) + "\n";
        } catch (const rlt::SandboxError&) {
          ++errors;
        }
        ++done;
        inflight.pop_front();
      }
      out["load"] = {{"seconds", ms_since(t0) / 1000},
                     {"workers", workers},
                     {"calls", done},
                     {"calls_per_s", done / (ms_since(t0) / 1000)}};
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    out["load"].update({{"wrong_output", wrong},
                        {"timed_out", timed_out},
                        {"sandbox_errors", errors},
                        {"p50_ms", percentile(lat, 0.5)},
                        {"p99_ms", percentile(lat, 0.99)},
                        {"processes_left", count_sandbox_processes(exe) - procs_before},
                        {"dirs_left", count_sandbox_dirs(tmp_root) - dirs_before}});
  }
  std::free(ballast);

  if (as_json) {
    std::cout << out.dump() << "\n";
    return 0;
  }
  auto row = [](const char* name, const nlohmann::json& j) {
    const std::string rate =
        j.contains("calls_per_s")
            ? " " + std::to_string(static_cast<int64_t>(j["calls_per_s"].get<double>())) + " calls/s"
            : "";
    std::printf("%-24s %8.2f ms mean %8.2f p50 %8.2f p99%s%s\n", name, j["mean_ms"].get<double>(),
                j["p50_ms"].get<double>(), j["p99_ms"].get<double>(), rate.c_str(),
                j["failed"].get<int64_t>() > 0 ? "  (some failed)" : "");
  };
  std::printf("caller resident %.1f GiB; python %s; isolation %s\n", resident_gb, exe.c_str(), first.isolation.c_str());
  row("bare, 1", out["bare"]["one"]);
  row(("bare, " + std::to_string(workers)).c_str(), out["bare"]["workers"]);
  row("fork+exec, 1", out["fork_exec"]["one"]);
  if (out.contains("bwrap") && out["bwrap"].contains("mean_ms")) row("bwrap, 1", out["bwrap"]);
  row("sandbox, 1", out["sandbox"]["one"]);
  row(("sandbox, " + std::to_string(workers)).c_str(), out["sandbox"]["workers"]);
  row("sandbox no cgroups, 1", out["sandbox_no_cgroups"]["one"]);
  for (const char* mode : {"cold", "prestarted"}) {
    for (const char* site : {"no_site", "site"}) {
      row(("pool " + std::string(mode) + (std::string(site) == "site" ? ", site" : ", -S")).c_str(),
          out["pool"][mode][site]);
    }
  }
  std::printf("overhead beyond start-up: %.2f ms per call\n", overhead);
  if (out.contains("load")) std::cout << "load: " << out["load"].dump() << "\n";
  return 0;
}
