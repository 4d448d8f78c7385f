// Finding the interpreter: the real executable behind a name or a shim, the host paths it reads, whether
// the sandbox can run it as uid 65534, and its command line and environment in the sandbox. The program
// it runs is rollout/sandbox_runner.py, embedded at build time as python_script_runner().
#include "rollout/sandbox_internal.h"

#include <fcntl.h>
#include <spawn.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <iterator>
#include <map>
#include <mutex>

extern char** environ;

namespace rlt::sandbox {

namespace {

// The system files every interpreter needs: the loader's cache, the libraries, the usual bin
// directories (many are symlinks into /usr on merged-/usr systems, recreated as such). Nothing else of
// /etc: no passwd, no hosts, no certificates (there is no network).
constexpr const char* kSystemReadPaths[] = {"/usr",
                                            "/bin",
                                            "/sbin",
                                            "/lib",
                                            "/lib32",
                                            "/lib64",
                                            "/libx32",
                                            "/etc/ld.so.cache",
                                            "/etc/ld.so.conf",
                                            "/etc/ld.so.conf.d",
                                            "/etc/localtime",
                                            "/etc/alternatives"};

// Sorted, without duplicates, without entries beneath another entry, and without the tmp root or its
// ancestors (the call's directory is made beneath it, so it cannot be a read-only bind).
std::vector<std::string> normalize_read_paths(std::vector<std::string> paths, const std::string& tmp_root) {
  for (auto& p : paths) {
    while (p.size() > 1 && p.back() == '/') p.pop_back();
  }
  std::sort(paths.begin(), paths.end());
  paths.erase(std::unique(paths.begin(), paths.end()), paths.end());
  auto beneath = [](const std::string& p, const std::string& dir) {
    return p == dir || (p.compare(0, dir.size(), dir) == 0 && (dir == "/" || p[dir.size()] == '/'));
  };
  std::vector<std::string> out;
  for (const auto& p : paths) {
    if (p.empty() || p[0] != '/' || beneath(tmp_root, p)) continue;
    if (!out.empty() && beneath(p, out.back())) continue;  // sorted: an ancestor comes just before
    out.push_back(p);
  }
  return out;
}

// Runs `python -I -c <script>` in the caller's own environment (a pyenv shim needs it); its stdout.
std::string run_in_caller_env(const std::string& python, const std::string& script) {
  int out[2];
  if (pipe2(out, O_CLOEXEC) != 0) throw SandboxError("pipe: " + errno_text(errno));
  Fd read_end(out[0]), write_end(out[1]);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, write_end.fd, 1);
  std::vector<std::string> args = {python, "-I", "-c", script};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  const int err = posix_spawnp(&pid, python.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (err != 0) throw SandboxError("cannot run the interpreter '" + python + "': " + errno_text(err));
  write_end.reset();
  std::string text;
  char buf[4096];
  for (ssize_t n; (n = read(read_end.fd, buf, sizeof buf)) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    text.append(buf, n);
  }
  int st = 0;
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
    throw SandboxError("the interpreter '" + python + "' failed to describe itself (status " + std::to_string(st) +
                       ")");
  }
  return text;
}

// The real executable (sys.executable: a pyenv shim resolves to it) and the directories it reads.
Interpreter probe_interpreter(const SandboxOptions& o, const std::string& tmp_root) {
  const std::string text = run_in_caller_env(
      o.python,
      "import json, os, sys\n"
      "p = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, os.path.dirname(sys.executable)}\n"
      "p.update(x for x in sys.path if x)\n"
      "paths = sorted({f(x) for x in p if os.path.exists(x) for f in (os.path.abspath, os.path.realpath)})\n"
      "sys.stdout.write(json.dumps({'exe': sys.executable, 'paths': paths}))\n");
  Interpreter in;
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    in.exe = j.at("exe").get<std::string>();
    in.read_paths = j.at("paths").get<std::vector<std::string>>();
  } catch (const nlohmann::json::exception&) {
    throw SandboxError("the interpreter '" + o.python + "' described itself as '" + text.substr(0, 200) + "'");
  }
  if (in.exe.empty() || in.exe[0] != '/') {
    throw SandboxError("the interpreter '" + o.python + "' reports no absolute sys.executable");
  }
  in.read_paths.insert(in.read_paths.end(), std::begin(kSystemReadPaths), std::end(kSystemReadPaths));
  in.read_paths = normalize_read_paths(std::move(in.read_paths), tmp_root);
  return in;
}

}  // namespace

std::string tmp_root_of(const SandboxOptions& o) {
  if (!o.tmp_root.empty()) return o.tmp_root;
  const char* env = std::getenv("TMPDIR");
  return env != nullptr && env[0] == '/' ? env : "/tmp";
}

Interpreter interpreter_for(const SandboxOptions& o) {
  static std::mutex mu;
  static std::map<std::tuple<std::string, std::string, bool>, Interpreter> cache;
  const std::string tmp_root = tmp_root_of(o);
  const auto key = std::make_tuple(o.python, tmp_root, o.namespaces);
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  Interpreter in = probe_interpreter(o, tmp_root);
  if (host().root) {
    // Can uid 65534 reach the interpreter, its libraries and the tmp root? Ask the sandbox itself (in a
    // jail it can, wherever the interpreter lives: the jail's own directories are world-readable).
    SandboxOptions probe = o;
    probe.timeout_s = std::max(o.timeout_s, 10.0);
    Interpreter as_nobody = in;
    as_nobody.drop_uid = true;
    try {
      const SandboxResult r = run_levels("import sys, encodings\n", probe, as_nobody);
      in.drop_uid = !r.timed_out && r.exit_code == 0;
    } catch (const SandboxError&) {
      in.drop_uid = false;  // e.g. execve: EACCES (a pyenv under a 0700 /root)
    }
  }
  cache.emplace(key, in);
  return in;
}

// The interpreter's argv and environment. The trailing "-" is the runner's sys.argv[1] (it makes sys.argv
// ['-']); process listings find a sandboxed interpreter by it.
void make_command(SandboxPlan& plan, const SandboxOptions& o, const std::string& exe, const std::string& dir) {
  plan.exe = exe;
  plan.argv = {exe, "-I", "-B", "-u", "-c", python_script_runner(), "-"};
  if (!o.site_packages) plan.argv.insert(plan.argv.begin() + 1, "-S");
  plan.envp = {"PATH=/usr/local/bin:/usr/bin:/bin", "HOME=" + dir, "TMPDIR=" + dir, "LANG=C.UTF-8",
               // One thread per math library: python's threads count as processes.
               "OMP_NUM_THREADS=1", "OPENBLAS_NUM_THREADS=1", "MKL_NUM_THREADS=1"};
}

}  // namespace rlt::sandbox
