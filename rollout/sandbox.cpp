// The sandboxed interpreter (sandbox.h). One call is four processes:
//
//   caller thread P --clone(CLONE_VM | CLONE_VFORK), execve--> B: rlt-sandbox-init (sandbox_init.cpp)
//   B --clone(new user, pid, net, ipc, mount namespaces)--> B2: pid 1 of the new namespaces; B writes
//     its uid maps and waits for it
//   B2: builds the read-only root (the jail) --fork--> C: setpgid, chdir, rlimits, drop capabilities (and
//     the uid when the interpreter is reachable by uid 65534), no_new_privs, Landlock, seccomp,
//     execve(python3 -I -B -u -c <python_script_runner()> -)
//
// P never copies its own address space: B shares it only until its immediate execve of the small init
// program (P's thread is suspended meanwhile, as in posix_spawn), and B2 and C are forks of that small
// program. So a call costs the same whatever the trainer's resident memory. P decides everything before
// the clone and hands it to B as a plan (rollout/sandbox_plan.h) in a memfd; after the clone it moves B
// into the call's pids and memory cgroups and lets it go. B2 stays outside every restriction so it can
// report C's exit status on a pipe (kDone) and then kill whatever C left behind: as pid 1 it takes the
// whole namespace down with it. P enforces the wall clock (SIGKILL to B, whose death kills B2 and so the
// namespace), reads stdout/stderr (kept up to the cap, the rest drained), then gives the cgroups back and
// removes the private directory. Where the kernel refuses a level (kLevels), the next is tried: without
// a mount namespace reads are confined by Landlock where the kernel has it; without any namespace B does
// B2's part itself as a child subreaper and kills C's process group and every descendant reparented to
// it, so even setsid() daemons die; only a process that escapes while B itself is being killed (a second
// timeout past the grace) could survive there.
#include "rollout/sandbox.h"

#include "common/files.h"
#include "rollout/sandbox_plan.h"

#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/filter.h>
#include <poll.h>
#include <sched.h>
#include <seccomp.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

extern char** environ;

namespace rlt {

namespace {

using namespace sandbox;
using Clock = std::chrono::steady_clock;

#ifndef SYS_landlock_create_ruleset
#define SYS_landlock_create_ruleset 444
#endif
#ifndef SYS_close_range
#define SYS_close_range 436
#endif
constexpr uint32_t kLandlockCreateRulesetVersion = 1u << 0;

std::string errno_text(int err) { return std::strerror(err); }

// ---------------------------------------------------------------------------------------------------
// Levels, strongest first. The first call tries level 0 and moves down (for good: the result is kept in
// g_level) when the kernel refuses it; levels without a user namespace need CAP_SYS_ADMIN, so only root
// tries them. `jail`: a mount namespace with a minimal read-only root and a tmpfs working directory.
struct Level {
  int ns_flags;
  bool jail;
  bool root_only;
};
constexpr Level kLevels[] = {
    {CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWNS, true, false},
    {CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWNS, true, true},
    {CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC, false, false},
    {CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC, false, true},
    {0, false, false},
};
constexpr int kNumLevels = sizeof(kLevels) / sizeof(kLevels[0]);
std::atomic<int> g_level{0};

// What the host offers, probed once.
struct Host {
  bool root = false;
  int landlock_abi = 0;    // 0: no Landlock
  std::string pids_dir;    // our cgroup directory with the pids controller, where per-call cgroups are made
  std::string memory_dir;  // the same for the memory controller (v1: another hierarchy; v2: the same dir)
  bool memory_v1 = false;  // memory.limit_in_bytes (v1) rather than memory.max (v2)
};

// Landlock ABI version, 0 when the kernel has none (or it is disabled).
int probe_landlock() {
  const long v = syscall(SYS_landlock_create_ruleset, nullptr, 0, kLandlockCreateRulesetVersion);
  return v > 0 ? static_cast<int>(v) : 0;
}

// The directory of this process's cgroup for `controller` (its v1 hierarchy, or v2 when only the
// unified hierarchy has it), if we may make child cgroups there; empty otherwise. `v1` tells which.
std::string probe_cgroup(const std::string& controller, bool& v1) {
  std::ifstream cg("/proc/self/cgroup");
  std::string line, v1_path, v2_path;
  while (std::getline(cg, line)) {
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = "," + line.substr(a + 1, b - a - 1) + ",";
    if (controllers.find("," + controller + ",") != std::string::npos) v1_path = line.substr(b + 1);
    if (line.compare(0, a, "0") == 0 && b == a + 1) v2_path = line.substr(b + 1);
  }
  std::ifstream mi("/proc/self/mountinfo");
  std::string v1_dir, v2_dir;
  while (std::getline(mi, line)) {
    // id parent major:minor root mount-point options [optional...] - fstype source super-options
    std::istringstream in(line);
    std::string id, parent, dev, root, mount_point, word;
    in >> id >> parent >> dev >> root >> mount_point;
    while (in >> word && word != "-") {
    }
    std::string fstype, source, super;
    in >> fstype >> source >> super;
    auto under = [&](const std::string& path) -> std::string {
      if (root == "/") return mount_point + path;
      if (path.compare(0, root.size(), root) == 0) return mount_point + path.substr(root.size());
      return "";
    };
    if (fstype == "cgroup" && !v1_path.empty() &&
        ("," + super + ",").find("," + controller + ",") != std::string::npos) {
      v1_dir = under(v1_path);
    } else if (fstype == "cgroup2" && !v2_path.empty()) {
      v2_dir = under(v2_path);
    }
  }
  v1 = !v1_dir.empty();
  std::string dir = v1 ? v1_dir : v2_dir;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  if (dir.empty() || access(dir.c_str(), W_OK) != 0) return "";
  return dir;
}

void remove_stale_cgroups(const std::string& dir);

const Host& host() {
  static const Host h = [] {
    Host x;
    x.root = geteuid() == 0;
    x.landlock_abi = probe_landlock();
    if (x.root) {
      bool v1 = false;
      x.pids_dir = probe_cgroup("pids", v1);
      x.memory_dir = probe_cgroup("memory", x.memory_v1);
      remove_stale_cgroups(x.pids_dir);
      if (x.memory_dir != x.pids_dir) remove_stale_cgroups(x.memory_dir);
    }
    return x;
  }();
  return h;
}
// Cleared when a per-call cgroup turns out to lack the controller (v2 without delegation).
std::atomic<bool> g_pids_cgroup_ok{true}, g_memory_cgroup_ok{true};

// ---------------------------------------------------------------------------------------------------
// Seccomp: built with libseccomp in the caller (it allocates), exported as BPF once per variant, and
// installed in C with one syscall. Default: allow; the denied calls fail with an errno, so Python raises
// a clean OSError. Syscalls of other architectures (an x86-64 process using int 0x80) kill the process.
struct SeccompVariant {
  bool pidns;              // signals cannot reach outside (else: kill rules)
  bool owns_host_files;    // C keeps the caller's uid (else: chmod/chown/utime/xattr are denied)
  bool landlock_truncate;  // Landlock handles truncate(2) (else seccomp denies it)
  bool operator<(const SeccompVariant& o) const {
    return std::tie(pidns, owns_host_files, landlock_truncate) <
           std::tie(o.pidns, o.owns_host_files, o.landlock_truncate);
  }
};

// Denied outright (EPERM): nothing that inspects or changes other processes, the kernel, or the mount table.
// clang-format off
constexpr const char* kDeniedSyscalls[] = {
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "keyctl", "add_key", "request_key",
    "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr", "unshare", "setns", "swapon", "swapoff", "reboot", "kexec_load",
    "kexec_file_load", "init_module", "finit_module", "delete_module", "acct", "name_to_handle_at",
    "open_by_handle_at", "fanotify_init", "quotactl"};
// clang-format on

// Empty when libseccomp or a required rule failed (the call then runs without seccomp).
std::vector<sock_filter> build_seccomp(const SeccompVariant& v) {
  scmp_filter_ctx ctx = seccomp_init(SCMP_ACT_ALLOW);
  if (ctx == nullptr) return {};
  bool required_ok = true;
  // A 32-bit argument (int pid, int domain) is compared on its low half only: the kernel truncates the
  // register, so a caller could otherwise set the high bits to slip past an equality test.
  auto low32 = [](unsigned arg, uint32_t value) {
    return scmp_arg_cmp{arg, SCMP_CMP_MASKED_EQ, 0xffffffffull, static_cast<scmp_datum_t>(value)};
  };
  auto deny = [&](const char* name, int err, std::vector<scmp_arg_cmp> args = {}) {
    const int nr = seccomp_syscall_resolve_name(name);
    if (nr == __NR_SCMP_ERROR) return false;  // not a syscall on this architecture / libseccomp version
    return seccomp_rule_add_array(ctx, SCMP_ACT_ERRNO(err), nr, static_cast<unsigned>(args.size()),
                                  args.empty() ? nullptr : args.data()) == 0;
  };
  // No network even where the namespace could not be made: IPv4, IPv6 and raw packet sockets.
  for (int domain : {AF_INET, AF_INET6, AF_PACKET}) required_ok &= deny("socket", EACCES, {low32(0, domain)});
  for (const char* name : kDeniedSyscalls) deny(name, EPERM);
  // New namespaces through clone (clone3 passes its flags in memory, out of a filter's reach: ENOSYS
  // makes glibc fall back to clone).
  deny("clone3", ENOSYS);
  for (uint64_t flag :
       {CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWIPC, CLONE_NEWUTS, CLONE_NEWCGROUP}) {
    deny("clone", EPERM, {scmp_arg_cmp{0, SCMP_CMP_MASKED_EQ, flag, flag}});
  }
  if (v.owns_host_files) {
    // C owns every file the caller owns: Landlock stops opening them for writing, but not changing their
    // mode, owner, times or extended attributes, which only needs ownership.
    for (const char* name : {"chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat",
                             "utime", "utimes", "futimesat", "utimensat", "setxattr", "lsetxattr", "fsetxattr",
                             "removexattr", "lremovexattr", "fremovexattr"}) {
      deny(name, EPERM);
    }
  }
  if (!v.landlock_truncate) deny("truncate", EPERM);
  if (!v.pidns) {
    // Without a pid namespace the caller is visible: no signal to it, to its process group, or to every
    // process at once (kill(-1)), and no thread-directed signals at all.
    const uint32_t self = static_cast<uint32_t>(getpid()), group = static_cast<uint32_t>(-getpgrp());
    for (uint32_t pid : {self, group, static_cast<uint32_t>(-1)}) required_ok &= deny("kill", EPERM, {low32(0, pid)});
    required_ok &= deny("tgkill", EPERM, {low32(0, self)});
    required_ok &= deny("tkill", EPERM);
    deny("rt_sigqueueinfo", EPERM, {low32(0, self)});
    deny("rt_tgsigqueueinfo", EPERM, {low32(0, self)});
    deny("pidfd_open", EPERM, {low32(0, self)});
  }
  std::vector<sock_filter> program;
  const int fd = memfd_create("rlt-seccomp", MFD_CLOEXEC);
  if (required_ok && fd >= 0 && seccomp_export_bpf(ctx, fd) == 0) {
    const off_t size = lseek(fd, 0, SEEK_END);
    if (size > 0 && size % sizeof(sock_filter) == 0 && lseek(fd, 0, SEEK_SET) == 0) {
      program.resize(size / sizeof(sock_filter));
      if (pread(fd, program.data(), size, 0) != size) program.clear();
    }
  }
  if (fd >= 0) close(fd);
  seccomp_release(ctx);
  return program;
}

const std::vector<sock_filter>& seccomp_program(const SeccompVariant& v) {
  static std::mutex mu;
  static std::map<SeccompVariant, std::vector<sock_filter>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(v);
  if (it == cache.end()) it = cache.emplace(v, build_seccomp(v)).first;
  return it->second;
}

// ---------------------------------------------------------------------------------------------------
// P's side.

void write_file(const std::string& path, const std::string& text) {
  Fd fd(open(path.c_str(), O_WRONLY | O_CLOEXEC));
  if (fd.fd < 0) throw SandboxError("open " + path + ": " + errno_text(errno));
  if (write(fd.fd, text.data(), text.size()) != ssize_t(text.size())) {
    throw SandboxError("write " + path + ": " + errno_text(errno));
  }
}

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

// The interpreter, resolved once per (python, tmp root, namespaces): the real executable, the host paths
// it reads (kSystemReadPaths, its prefixes and sys.path), and whether the sandbox can run it as
// kSandboxUid (only asked when we are root).
struct Interpreter {
  std::string exe;
  std::vector<std::string> read_paths;
  bool drop_uid = false;
};

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

// rlt-sandbox-init: $RLT_SANDBOX_INIT, else beside this executable, else where the build put it.
const std::string& init_path() {
  static const std::string path = [] {
    std::vector<std::string> tried;
    if (const char* env = std::getenv("RLT_SANDBOX_INIT"); env != nullptr && env[0] != '\0') tried.push_back(env);
    char self[PATH_MAX];
    const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n > 0) {
      const std::string exe(self, n);
      tried.push_back(exe.substr(0, exe.rfind('/')) + "/rlt-sandbox-init");
    }
#ifdef RLT_SANDBOX_INIT_PATH
    tried.push_back(RLT_SANDBOX_INIT_PATH);
#endif
    for (const auto& p : tried) {
      if (access(p.c_str(), X_OK) == 0) return p;
    }
    return std::string();
  }();
  if (path.empty()) {
    throw SandboxError("rlt-sandbox-init not found: set RLT_SANDBOX_INIT, or keep it beside the executable");
  }
  return path;
}

std::string tmp_root_of(const SandboxOptions& o) {
  if (!o.tmp_root.empty()) return o.tmp_root;
  const char* env = std::getenv("TMPDIR");
  return env != nullptr && env[0] == '/' ? env : "/tmp";
}

SandboxResult run_levels(const std::string& code, const SandboxOptions& o, const Interpreter& in);

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

// Cuts a trailing incomplete UTF-8 sequence (the cap may split a character).
void trim_partial_utf8(std::string& s) {
  const size_t n = s.size();
  for (size_t back = 1; back <= 4 && back <= n; ++back) {
    const unsigned char c = static_cast<unsigned char>(s[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // continuation byte: keep looking for the lead
    const size_t len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 1;
    if (len > back) s.resize(n - back);
    return;
  }
}

// `s` with every byte that is not part of a valid UTF-8 sequence replaced by U+FFFD.
std::string valid_utf8(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    size_t len = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      len = 1;
      cp = c;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    }
    bool ok = len > 0 && i + len <= n;
    for (size_t k = 1; ok && k < len; ++k) {
      const unsigned char d = static_cast<unsigned char>(s[i + k]);
      ok = (d & 0xC0) == 0x80;
      cp = (cp << 6) | (d & 0x3F);
    }
    // Overlong forms, surrogates and code points past U+10FFFF are invalid too.
    static const uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
    ok = ok && cp >= kMin[len] && cp <= 0x10FFFF && !(cp >= 0xD800 && cp <= 0xDFFF);
    if (ok) {
      out.append(s, i, len);
      i += len;
    } else {
      out += "\xEF\xBF\xBD";
      i += 1;
    }
  }
  return out;
}

void validate(const SandboxOptions& options) {
  SandboxOptions copy = options;  // visit() is non-const by the fields.h convention
  std::string errors;
  rlt::validate(copy, [&](const std::string& key, const std::string& why) { errors += " " + key + ": " + why + ";"; });
  if (!errors.empty()) throw SandboxError("bad sandbox options:" + errors);
}

// What P makes for one call. Members are destroyed in reverse: the cgroup is removed, the descriptors are
// What P makes for one call. Members are destroyed in reverse: the cgroups are removed, the descriptors
// are closed, and the private directory is removed last.
struct CallFiles {
  struct DirGuard {
    std::string path;  // empty until mkdtemp made it
    ~DirGuard() {
      if (!path.empty()) remove_tree(path);
    }
  } dir;
  Fd code;    // the interpreter's stdin
  Fd code_p;  // prestarted: P's end of the stdin socket, which the script is written into when it comes
  Fd plan;    // the encoded SandboxPlan, B's fd 5
  Fd out_r, out_w, err_r, err_w, status_r, status_w;  // C's stdout and stderr; B's (and C's) reports
  Fd sync_p, sync_c;                                  // P's "go" to B
  // The call's cgroups (root only), B moved in before it may start C: one directory per hierarchy (v1
  // keeps pids and memory apart; v2 has one directory for both), taken from the idle ones and given back.
  struct CgroupGuard {
    std::vector<std::string> paths;
    bool pids = false, memory = false;  // which limits are set
    ~CgroupGuard();
  } cgroups;
};

// Per-call cgroups are reused: making and removing a memory cgroup costs milliseconds, so a call takes an
// idle set (every process of its last call gone) and gives it back; they are removed at exit, and the
// ones a killed trainer left behind when the next one starts (host()).
struct CgroupPool {
  std::mutex mu;
  std::vector<std::vector<std::string>> idle;
  ~CgroupPool() {
    for (const auto& set : idle) {
      for (const auto& path : set) rmdir(path.c_str());
    }
  }
};
CgroupPool& cgroup_pool() {
  static CgroupPool pool;
  return pool;
}

CallFiles::CgroupGuard::~CgroupGuard() {
  if (paths.empty()) return;
  // Every task in them is the sandbox's, so whatever is still listed (a process that slipped out of a
  // fallback level's kills) is killed here; the set is idle once none is listed.
  bool empty = false;
  for (int i = 0; i < 400 && !empty; ++i) {
    empty = true;
    for (const std::string& path : paths) {
      std::ifstream procs(path + "/cgroup.procs");
      for (pid_t pid; procs >> pid;) kill(pid, SIGKILL), empty = false;
    }
    if (!empty) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (empty) {
    std::lock_guard<std::mutex> lock(cgroup_pool().mu);
    cgroup_pool().idle.push_back(std::move(paths));
  } else {
    for (const std::string& path : paths) rmdir(path.c_str());
  }
}

// Removes the per-call cgroups of trainers that are gone (named rlt-sandbox-<pid>-<n>).
void remove_stale_cgroups(const std::string& dir) {
  if (dir.empty()) return;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return;
  while (dirent* e = readdir(d)) {
    const char* name = e->d_name;
    if (std::strncmp(name, "rlt-sandbox-", 12) != 0) continue;
    const long pid = std::strtol(name + 12, nullptr, 10);
    if (pid > 0 && kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) rmdir((dir + "/" + name).c_str());
  }
  closedir(d);
}

// The private working directory: the interpreter's cwd on the host, or the mount point of the jail.
void make_private_dir(CallFiles& f, const SandboxOptions& o, bool drop_uid) {
  std::string dir = tmp_root_of(o) + "/rlt-sandbox-XXXXXX";
  if (mkdtemp(dir.data()) == nullptr) throw SandboxError("mkdtemp " + dir + ": " + errno_text(errno));
  f.dir.path = dir;
  if (drop_uid && chown(dir.c_str(), kSandboxUid, kSandboxGid) != 0) {
    throw SandboxError("chown " + dir + ": " + errno_text(errno));
  }
}

// A memfd holding `bytes`, its offset at the end.
int memfd_with(const char* name, const std::string& bytes) {
  Fd fd(memfd_create(name, MFD_CLOEXEC));
  if (fd.fd < 0) throw SandboxError("memfd_create: " + errno_text(errno));
  for (size_t done = 0; done < bytes.size();) {
    const ssize_t n = write(fd.fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw SandboxError(std::string("writing ") + name + ": " + errno_text(errno));
    done += n;
  }
  return fd.release();
}

// The code, as the interpreter's stdin (a script read from stdin: tracebacks say File "<stdin>").
void make_code_fd(CallFiles& f, const std::string& code) {
  f.code.reset(memfd_with("rlt-sandbox-code", code));
  {
    // A read-only descriptor, so the code cannot rewrite its own script.
    const std::string self = "/proc/self/fd/" + std::to_string(f.code.fd);
    const int ro = open(self.c_str(), O_RDONLY | O_CLOEXEC);
    if (ro >= 0) f.code.reset(ro);
    lseek(f.code.fd, 0, SEEK_SET);
  }
}

// A prestarted interpreter's stdin: a socket pair (P writes the script with MSG_NOSIGNAL, so an interpreter
// that died leaves P an EPIPE, never a SIGPIPE), P's end shut for writing once the script is in.
void make_code_socket(CallFiles& f) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    throw SandboxError("socketpair: " + errno_text(errno));
  }
  f.code_p.reset(sv[0]), f.code.reset(sv[1]);
  shutdown(f.code.fd, SHUT_WR);  // the interpreter's end only reads
}

// The output and status pipes, and the sync socket pair.
void make_channels(CallFiles& f) {
  int pipe_fds[3][2];
  for (auto& pf : pipe_fds) {
    if (pipe2(pf, O_CLOEXEC) != 0) throw SandboxError("pipe: " + errno_text(errno));
  }
  f.out_r.reset(pipe_fds[0][0]), f.out_w.reset(pipe_fds[0][1]);
  f.err_r.reset(pipe_fds[1][0]), f.err_w.reset(pipe_fds[1][1]);
  f.status_r.reset(pipe_fds[2][0]), f.status_w.reset(pipe_fds[2][1]);
  {
    // A socket pair, so that P's "go" to a B that already died is EPIPE without a SIGPIPE.
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
      throw SandboxError("socketpair: " + errno_text(errno));
    }
    f.sync_p.reset(sv[0]), f.sync_c.reset(sv[1]);
  }
}

// The call's cgroups: pids capped at max_processes (plus B and B2), memory at memory_mb for the whole call
// (its processes and what it keeps in its tmpfs). Each is left out where there is none to make.
void make_cgroups(CallFiles& f, const Host& h, const SandboxOptions& o, const Level& level) {
  const bool want_pids = o.cgroups && !h.pids_dir.empty() && g_pids_cgroup_ok.load();
  const bool want_memory = o.cgroups && !h.memory_dir.empty() && g_memory_cgroup_ok.load();
  if (!want_pids && !want_memory) return;
  {
    std::lock_guard<std::mutex> lock(cgroup_pool().mu);
    if (!cgroup_pool().idle.empty()) {
      f.cgroups.paths = std::move(cgroup_pool().idle.back());
      cgroup_pool().idle.pop_back();
    }
  }
  if (f.cgroups.paths.empty()) {
    static std::atomic<uint64_t> seq{0};
    const std::string name = "/rlt-sandbox-" + std::to_string(getpid()) + "-" + std::to_string(seq.fetch_add(1));
    for (const std::string& root : {h.pids_dir, h.memory_dir}) {
      const std::string path = root + name;
      if (root.empty() || std::find(f.cgroups.paths.begin(), f.cgroups.paths.end(), path) != f.cgroups.paths.end()) {
        continue;
      }
      if (mkdir(path.c_str(), 0755) == 0) f.cgroups.paths.push_back(path);
    }
  }
  auto in_set = [&](const std::string& root) -> std::string {
    for (const auto& p : f.cgroups.paths) {
      if (!root.empty() && p.compare(0, root.size() + 1, root + "/") == 0) return p;
    }
    return "";
  };
  if (const std::string path = in_set(h.pids_dir); want_pids && !path.empty()) {
    try {
      const int64_t inits = level.ns_flags != 0 ? 2 : 1;  // B, and B2 where it makes namespaces
      write_file(path + "/pids.max", std::to_string(o.max_processes + inits));
      f.cgroups.pids = true;
    } catch (const SandboxError&) {
      g_pids_cgroup_ok = false;  // no pids controller here (v2 without delegation): stop trying
    }
  }
  if (const std::string path = in_set(h.memory_dir); want_memory && !path.empty()) {
    const std::string bytes = std::to_string(o.memory_mb << 20);
    // No swap either, where the kernel accounts it. v1 keeps memory <= memory+swap at every write, so the
    // combined limit is written before and after (one of the two fits, whichever way the limit moves).
    auto no_swap = [&] {
      try {
        write_file(path + (h.memory_v1 ? "/memory.memsw.limit_in_bytes" : "/memory.swap.max"),
                   h.memory_v1 ? bytes : "0");
      } catch (const SandboxError&) {
      }
    };
    try {
      no_swap();
      write_file(path + (h.memory_v1 ? "/memory.limit_in_bytes" : "/memory.max"), bytes);
      no_swap();
      f.cgroups.memory = true;
    } catch (const SandboxError&) {
      g_memory_cgroup_ok = false;
    }
  }
}

// Whether B made it into every cgroup made for the call.
bool join_cgroups(const CallFiles& f, pid_t b) {
  if (f.cgroups.paths.empty()) return false;
  try {
    for (const auto& path : f.cgroups.paths) write_file(path + "/cgroup.procs", std::to_string(b));
    return true;
  } catch (const SandboxError&) {
    return false;
  }
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

// The limits and the confinement B and C apply, all settled before the clone.
SandboxPlan make_plan(const SandboxOptions& o, const Host& h, const Interpreter& in, const Level& level,
                      const std::string& workdir) {
  const bool userns = level.ns_flags & CLONE_NEWUSER, pidns = level.ns_flags & CLONE_NEWPID;
  SandboxPlan plan;
  plan.ns_flags = level.ns_flags;
  plan.map_uid = h.root ? 0 : geteuid();
  plan.map_gid = h.root ? 0 : getegid();
  plan.map_sandbox_ids = h.root;
  make_command(plan, o, in.exe, workdir);
  plan.workdir = workdir;
  plan.cpu_soft = static_cast<int64_t>(std::ceil(o.timeout_s)) + 1;
  plan.cpu_hard = plan.cpu_soft + 1;
  plan.as = o.memory_mb << 20;
  plan.fsize = o.max_file_mb << 20;
  plan.nofile = o.max_open_files;
  // RLIMIT_NPROC counts the tasks of a uid within a user namespace (Linux >= 5.14), and is never
  // enforced for uid 0, namespace or not: it is this call's own count only in a user namespace of its own
  // and under a uid other than 0 (dropped to 65534, or a non-root caller's).
  plan.set_nproc = userns && (in.drop_uid || !h.root);
  plan.nproc = o.max_processes;
  plan.nice = o.nice;
  plan.drop_uid = in.drop_uid;
  plan.pidns = pidns;
  plan.jail = level.jail;
  plan.disk_bytes = o.disk_mb << 20;
  plan.disk_inodes = 1024 + 64 * o.disk_mb;
  // The owner of the jail's working directory as B's namespace sees it (map_ids maps these; a level
  // without a user namespace is root's).
  plan.work_uid = in.drop_uid ? kSandboxUid : 0;
  plan.work_gid = in.drop_uid ? kSandboxGid : 0;
  plan.landlock_abi = h.landlock_abi;
  plan.landlock_read = h.landlock_abi > 0;
  plan.read_paths = in.read_paths;
  const std::vector<sock_filter>& filter = seccomp_program({pidns, !in.drop_uid, h.landlock_abi >= 3});
  plan.seccomp.assign(reinterpret_cast<const char*>(filter.data()), filter.size() * sizeof(sock_filter));
  return plan;
}

// The plan in a memfd, B's fd 5 (B reads it from the start).
void make_plan_fd(CallFiles& f, const SandboxPlan& plan) {
  f.plan.reset(memfd_with("rlt-sandbox-plan", plan.encode()));
}

// What B's clone runs on its own small stack, in P's address space while P's thread waits: the
// descriptors moved into place, then straight into rlt-sandbox-init. Only raw descriptor calls here.
struct Spawn {
  const char* init;
  int fds[kNumChildFds];
};

// Moves fds[0..n) to 0..n-1 and closes every other descriptor (P's other files, and the pipes of other
// calls running at the same time, whose readers would otherwise wait for our exit to see EOF).
bool arrange_fds(int* fds, int n) {
  for (int i = 0; i < n; ++i) {
    if (fds[i] < n) {
      fds[i] = fcntl(fds[i], F_DUPFD, n);
      if (fds[i] < 0) return false;
    }
  }
  for (int i = 0; i < n; ++i) {
    if (dup2(fds[i], i) < 0) return false;
  }
  if (syscall(SYS_close_range, static_cast<unsigned>(n), ~0u, 0u) != 0) {
    rlimit r{};
    const rlim_t top = getrlimit(RLIMIT_NOFILE, &r) == 0 ? std::min<rlim_t>(r.rlim_cur, 1 << 16) : 1024;
    for (rlim_t fd = n; fd < top; ++fd) close(static_cast<int>(fd));
  }
  return true;
}

int spawn_init(void* arg) {
  Spawn& s = *static_cast<Spawn*>(arg);
  prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);  // kept across the execve
  if (!arrange_fds(s.fds, kNumChildFds)) {
    write_report(s.fds[kFdStatus] >= 0 ? s.fds[kFdStatus] : kFdStatus, {kFailed, kStageFds, errno});
    _exit(125);
  }
  char name[] = "rlt-sandbox-init";
  char* argv[] = {name, nullptr};
  char* envp[] = {nullptr};
  execve(s.init, argv, envp);
  write_report(kFdStatus, {kFailed, kStageInit, errno});
  _exit(127);
}

// clone(CLONE_VM | CLONE_VFORK) of spawn_init: returns B's pid once B has executed the init program (or
// died trying), -1 with errno when the kernel refused the clone.
pid_t spawn_b(const CallFiles& f) {
  Spawn s{init_path().c_str(), {f.code.fd, f.out_w.fd, f.err_w.fd, f.status_w.fd, f.sync_c.fd, f.plan.fd}};
  constexpr size_t kStack = 64 << 10;
  void* stack = mmap(nullptr, kStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
  if (stack == MAP_FAILED) throw SandboxError("mmap: " + errno_text(errno));
  // Every signal blocked, so none of P's handlers runs on B's side of the shared memory before the execve
  // (which resets them).
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  const pid_t b = clone(spawn_init, static_cast<char*>(stack) + kStack, CLONE_VM | CLONE_VFORK | SIGCHLD, &s);
  const int err = errno;
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  munmap(stack, kStack);
  errno = err;
  return b;
}

// B, killed and reaped on every way out unless P has reaped it already.
struct ChildGuard {
  pid_t pid = -1;
  bool reaped = false;
  ~ChildGuard() {
    if (reaped || pid <= 0) return;
    kill(pid, SIGKILL);
    while (waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
    }
  }
};

// What P learns of a call while it runs.
struct Watch {
  std::string out, err;      // kept up to the cap
  std::string status_bytes;  // B's reports not parsed yet
  bool timed_out = false, hard_killed = false, truncated = false;
  pid_t c_pid = -1;  // C as B sees it (only used without a pid namespace, where it is also P's view)
  bool done = false, failed = false;
  int c_status = 0, fail_stage = 0, fail_errno = 0, b_status = 0;
};

void kill_sandbox(pid_t b, bool pidns, const Watch& w) {
  if (pidns) {
    kill(b, SIGKILL);  // init gone: the kernel kills the rest of the namespace
  } else if (w.c_pid > 0 && !w.done) {
    kill(-w.c_pid, SIGKILL);  // C's group; B reaps it, kills the daemons that left it, and reports
  } else {
    kill(b, SIGKILL);
  }
}

// One read of C's stdout or stderr into `text`, kept up to the cap and drained past it; EOF closes `fd`.
void read_stream(Fd& fd, std::string& text, size_t cap, bool& truncated) {
  char buf[65536];
  const ssize_t got = read(fd.fd, buf, sizeof buf);
  if (got < 0 && (errno == EINTR || errno == EAGAIN)) return;
  if (got <= 0) {
    fd.reset();
    return;
  }
  const size_t keep = std::min(static_cast<size_t>(got), cap - std::min(cap, text.size()));
  text.append(buf, keep);
  if (keep < static_cast<size_t>(got)) truncated = true;
}

// One read of the status pipe. Returns true at its end, with `status_r` closed.
bool read_reports(Fd& status_r, Watch& w) {
  char buf[65536];
  const ssize_t got = read(status_r.fd, buf, sizeof buf);
  if (got < 0 && (errno == EINTR || errno == EAGAIN)) return false;
  // Status: fixed-size records, then EOF once B (and C, before its execve) are gone.
  if (got > 0) {
    w.status_bytes.append(buf, got);
    while (w.status_bytes.size() >= sizeof(Report)) {
      Report r;
      std::memcpy(&r, w.status_bytes.data(), sizeof r);
      w.status_bytes.erase(0, sizeof r);
      if (r.kind == kStarted) w.c_pid = r.a;
      if (r.kind == kDone) w.done = true, w.c_status = r.a;
      if (r.kind == kFailed && !w.failed) w.failed = true, w.fail_stage = r.a, w.fail_errno = r.b;
    }
    return false;
  }
  status_r.reset();
  return true;
}

// Read stdout/stderr (kept up to the cap, drained past it) and B's reports until B is gone, killing the
// sandbox at the deadline (and B itself 2 s later). Returns with B reaped, or with nothing left to read.
void supervise(Watch& w, ChildGuard& b, bool pidns, const SandboxOptions& o, Clock::time_point t0, CallFiles& f) {
  const size_t cap = static_cast<size_t>(o.max_output_bytes);
  const auto deadline = t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.timeout_s));
  auto hard_deadline = Clock::time_point::max(), drain_deadline = Clock::time_point::max();
  struct Stream {
    Fd* fd;
    std::string* text;
  } streams[2] = {{&f.out_r, &w.out}, {&f.err_r, &w.err}};
  for (;;) {
    const auto now = Clock::now();
    if (!w.timed_out && !b.reaped && now >= deadline) {
      w.timed_out = true;
      kill_sandbox(b.pid, pidns, w);
      hard_deadline = now + std::chrono::seconds(2);
    }
    if (w.timed_out && !w.hard_killed && !b.reaped && now >= hard_deadline) {
      w.hard_killed = true;
      kill(b.pid, SIGKILL);
      if (w.c_pid > 0 && !pidns && !w.done) kill(-w.c_pid, SIGKILL);
    }
    if (b.reaped && (now >= drain_deadline || (f.out_r.fd < 0 && f.err_r.fd < 0))) break;
    auto next = b.reaped ? drain_deadline : w.timed_out ? hard_deadline : deadline;
    const long wait_ms =
        std::max<long>(0, std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count() + 1);
    pollfd pfds[3];
    int which[3];  // 0, 1: streams[i]; 2: status
    int n = 0;
    for (int i = 0; i < 2; ++i) {
      if (streams[i].fd->fd >= 0) pfds[n] = {streams[i].fd->fd, POLLIN, 0}, which[n++] = i;
    }
    if (f.status_r.fd >= 0) pfds[n] = {f.status_r.fd, POLLIN, 0}, which[n++] = 2;
    if (n == 0) break;
    if (poll(pfds, n, static_cast<int>(std::min<long>(wait_ms, INT_MAX))) < 0) {
      if (errno == EINTR) continue;
      throw SandboxError("poll: " + errno_text(errno));
    }
    for (int i = 0; i < n; ++i) {
      if (pfds[i].revents == 0) continue;
      if (which[i] < 2) {
        read_stream(*streams[which[i]].fd, *streams[which[i]].text, cap, w.truncated);
      } else if (read_reports(f.status_r, w)) {
        while (waitpid(b.pid, &w.b_status, 0) < 0 && errno == EINTR) {
        }
        b.reaped = true;
        // In a pid namespace every writer is dead once init is reaped; without one, a process that slipped
        // out may still hold the pipes: give them a moment, then stop reading.
        drain_deadline = Clock::now() + std::chrono::milliseconds(pidns ? 1000 : 250);
      }
    }
  }
}

// The result of a call that ran, from what P saw; `wall` runs from the clone to the end of supervise.
SandboxResult make_result(Watch& w, const SandboxOptions& o, Clock::duration wall) {
  const size_t cap = static_cast<size_t>(o.max_output_bytes);
  auto code_of = [](int st) { return WIFEXITED(st) ? WEXITSTATUS(st) : WIFSIGNALED(st) ? 128 + WTERMSIG(st) : 1; };
  SandboxResult result;
  result.stdout_text = std::move(w.out);
  result.stderr_text = std::move(w.err);
  if (result.stdout_text.size() >= cap) trim_partial_utf8(result.stdout_text);
  if (result.stderr_text.size() >= cap) trim_partial_utf8(result.stderr_text);
  result.truncated = w.truncated;
  result.timed_out = w.timed_out;
  // Without B's report (B killed by code that could reach it in a fallback level): B's own status.
  result.exit_code = w.timed_out ? 128 + SIGKILL : w.done ? code_of(w.c_status) : code_of(w.b_status);
  result.wall_ms = std::chrono::duration<double, std::milli>(wall).count();
  return result;
}

// What confined the call, as "+"-joined tokens (SandboxResult::isolation).
std::string isolation_of(const Level& level, const SandboxPlan& plan, bool in_cgroups, const CallFiles& f) {
  std::string iso;
  auto add = [&iso](const char* token) { iso += iso.empty() ? token : std::string("+") + token; };
  const int ns = level.ns_flags;
  if (ns & CLONE_NEWUSER) add("userns");
  if (ns & CLONE_NEWPID) add("pidns");
  if (ns & CLONE_NEWNET) add("netns");
  if (ns & CLONE_NEWIPC) add("ipcns");
  if (plan.jail) add("mountns"), add("disk-quota");
  if (plan.drop_uid) add("setuid");
  if (in_cgroups && f.cgroups.pids) add("pids-cgroup");
  if (in_cgroups && f.cgroups.memory) add("memory-cgroup");
  if (plan.set_nproc) add("nproc");
  if (plan.landlock_abi > 0) add("landlock");
  if (plan.landlock_abi > 0 && plan.landlock_read) add("landlock-read");
  if (!plan.seccomp.empty()) add("seccomp");
  return iso;
}

// Said once per process where neither a mount namespace nor Landlock confines what the code reads.
void warn_if_reads_unconfined(const SandboxPlan& plan) {
  static std::once_flag once;
  if (plan.jail || (plan.landlock_abi > 0 && plan.landlock_read)) return;
  std::call_once(once, [] {
    std::fprintf(stderr,
                 "rlt sandbox: this host allows neither a mount namespace nor Landlock, so tool code can read every "
                 "file the trainer's user can (isolation lacks mountns and landlock-read)\n");
  });
}

// One call's sandbox from its files to its end. launch() makes the files and starts B (the code's memfd as
// stdin, or with no code yet a socket the script is written into later); finish() supervises it to the end.
// Member order matters: the guard kills and reaps B before the files (cgroups, descriptors, directory) go.
struct Launched {
  explicit Launched(const Level& l) : level(l) {}
  Level level;
  CallFiles f;
  SandboxPlan plan;
  ChildGuard b;
  Watch w;
  bool in_cgroups = false;
  bool pidns() const { return level.ns_flags & CLONE_NEWPID; }
};

std::unique_ptr<Launched> launch(const std::string* code, const SandboxOptions& o, const Interpreter& in,
                                 const Level& level) {
  const Host& h = host();
  auto l = std::make_unique<Launched>(level);
  CallFiles& f = l->f;
  make_private_dir(f, o, in.drop_uid);
  if (code != nullptr) {
    make_code_fd(f, *code);
  } else {
    make_code_socket(f);
  }
  make_channels(f);
  make_cgroups(f, h, o, level);
  l->plan = make_plan(o, h, in, level, f.dir.path);
  make_plan_fd(f, l->plan);

  const pid_t b = spawn_b(f);
  if (b < 0) throw SandboxError("clone: " + errno_text(errno));
  // From here on B exists: the guard kills and reaps it on every way out.
  l->b.pid = b;
  f.code.reset(), f.out_w.reset(), f.err_w.reset(), f.status_w.reset(), f.sync_c.reset(), f.plan.reset();

  // B has run the init program or died trying; a failed execve reported before B's exit released us.
  if (pollfd p{f.status_r.fd, POLLIN, 0}; poll(&p, 1, 0) == 1) {
    read_reports(f.status_r, l->w);
    if (l->w.failed) {
      throw SandboxError(std::string("sandbox setup failed while ") + stage_name(l->w.fail_stage) + " (" + init_path() +
                         "): " + errno_text(l->w.fail_errno));
    }
  }
  l->in_cgroups = join_cgroups(f, b);
  const char go = 1;
  if (send(f.sync_p.fd, &go, 1, MSG_NOSIGNAL) != 1) {
    // B died before it could be released: fall through, the status pipe tells why.
  }
  return l;
}

// Supervises a launched call to its end, its wall clock (and its timeout) counted from t0. Returns false
// (and leaves `result` alone) when the kernel refused the level's namespaces or its read-only root, so the
// caller can try the next one.
bool finish(Launched& l, const SandboxOptions& o, const Interpreter& in, Clock::time_point t0, SandboxResult& result) {
  Watch& w = l.w;
  supervise(w, l.b, l.pidns(), o, t0, l.f);
  const auto t1 = Clock::now();
  if (!l.b.reaped) {
    kill(l.b.pid, SIGKILL);
    while (waitpid(l.b.pid, &w.b_status, 0) < 0 && errno == EINTR) {
    }
    l.b.reaped = true;
  }
  if (w.failed && !w.timed_out) {
    // No code ran: the kernel refused this level's namespaces, their maps or the jail. Only a refusal
    // moves to the next level for good; running out of processes or memory is an error of this call.
    const int e = w.fail_errno;
    const bool refused = e == EPERM || e == EACCES || e == EINVAL || e == ENOSPC || e == EUSERS || e == ENOSYS;
    if (refused && (w.fail_stage == kStageNamespaces || w.fail_stage == kStageMaps || w.fail_stage == kStageJail)) {
      return false;
    }
    throw SandboxError(std::string("sandbox setup failed while ") + stage_name(w.fail_stage) + " (" +
                       (w.fail_stage <= kStageInit ? init_path() : in.exe) + "): " + errno_text(w.fail_errno));
  }
  result = make_result(w, o, t1 - t0);
  result.isolation = isolation_of(l.level, l.plan, l.in_cgroups, l.f);
  warn_if_reads_unconfined(l.plan);
  return true;
}

// One attempt at `level`, the code in a memfd from the start.
bool run_at_level(const std::string& code, const SandboxOptions& o, const Interpreter& in, const Level& level,
                  SandboxResult& result) {
  const auto t0 = Clock::now();
  std::unique_ptr<Launched> l = launch(&code, o, in, level);
  return finish(*l, o, in, t0, result);
}

// The level a call tries first, and the move down for good once `level` was refused.
int first_level(const SandboxOptions& o) {
  int level = o.namespaces ? g_level.load() : kNumLevels - 1;
  while (level + 1 < kNumLevels && kLevels[level].root_only && !host().root) ++level;
  return level;
}
void level_refused(int level) {
  if (level + 1 >= kNumLevels) throw SandboxError("no sandbox level could start");
  int expected = g_level.load();
  while (expected <= level && !g_level.compare_exchange_weak(expected, level + 1)) {
  }
}

SandboxResult run_levels(const std::string& code, const SandboxOptions& o, const Interpreter& in) {
  for (;;) {
    const int level = first_level(o);
    SandboxResult r;
    if (run_at_level(code, o, in, kLevels[level], r)) return r;
    level_refused(level);
  }
}

// ---------------------------------------------------------------------------------------------------
// Prestarted interpreters (SandboxOptions::prestart): a pool worker launches its next sandbox before the
// call arrives, so the interpreter's start-up (tens of milliseconds with site-packages) overlaps the wait;
// the call writes its script into the waiting interpreter's stdin and is supervised as any call, its wall
// clock and timeout counted from there.
struct Spare {
  std::unique_ptr<Launched> launched;
  Interpreter in;  // what it was launched with
  int level = 0;
};

// Still waiting for its script: no report of C's end or of a failure, and B's status pipe still open.
bool spare_alive(Launched& l) {
  for (;;) {
    if (l.f.status_r.fd < 0 || l.w.done || l.w.failed) return false;
    pollfd p{l.f.status_r.fd, POLLIN, 0};
    if (poll(&p, 1, 0) != 1) return true;
    if (read_reports(l.f.status_r, l.w)) return false;  // EOF: B is gone
  }
}

// Writes the whole script and ends the interpreter's stdin. False when the interpreter stopped reading
// (it died, or its socket stayed full for timeout_s).
bool deliver(Launched& l, const std::string& code, double timeout_s) {
  Fd& fd = l.f.code_p;
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(timeout_s);
  tv.tv_usec = static_cast<suseconds_t>((timeout_s - std::floor(timeout_s)) * 1e6);
  setsockopt(fd.fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  for (size_t done = 0; done < code.size();) {
    const ssize_t n = send(fd.fd, code.data() + done, code.size() - done, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  fd.reset();  // end of file for the interpreter
  return true;
}

// A spare, or none when launching one failed (the call then starts cold and reports the error itself).
Spare launch_spare(const SandboxOptions& o) {
  Spare s;
  try {
    s.in = interpreter_for(o);
    s.level = first_level(o);
    s.launched = launch(nullptr, o, s.in, kLevels[s.level]);
  } catch (const std::exception&) {
    s.launched.reset();
  }
  return s;
}

// Ends an unused spare: its interpreter reads an empty script and exits, and everything is torn down as
// after a call. A refused level is noted for the calls after it.
void discard_spare(Spare& s, const SandboxOptions& o) {
  if (!s.launched) return;
  s.launched->f.code_p.reset();
  SandboxOptions brief = o;
  brief.timeout_s = std::min(o.timeout_s, 5.0);
  SandboxResult ignored;
  try {
    if (!finish(*s.launched, brief, s.in, Clock::now(), ignored)) level_refused(s.level);
  } catch (const std::exception&) {
  }
  s.launched.reset();
}

// The call in the spare when it still waits for its script; in a fresh sandbox otherwise. The spare is
// used up either way (the worker launches the next), also when the call throws.
SandboxResult run_in_spare(Spare& s, const std::string& code, const SandboxOptions& o) {
  Spare spare = std::move(s);
  if (spare.launched && spare_alive(*spare.launched)) {
    const auto t0 = Clock::now();
    if (deliver(*spare.launched, code, o.timeout_s)) {
      SandboxResult r;
      if (finish(*spare.launched, o, spare.in, t0, r)) return r;
      level_refused(spare.level);
      return run_levels(code, o, spare.in);
    }
  }
  discard_spare(spare, o);
  return run_levels(code, o, interpreter_for(o));
}

}  // namespace

nlohmann::json SandboxResult::to_json() const {
  return {{"stdout", valid_utf8(stdout_text)},
          {"stderr", valid_utf8(stderr_text)},
          {"exit_code", exit_code},
          {"timed_out", timed_out},
          {"truncated", truncated},
          {"wall_ms", wall_ms},
          {"isolation", isolation}};
}

SandboxResult run_python(const std::string& code, const SandboxOptions& options) {
  validate(options);
  const Interpreter in = interpreter_for(options);
  return run_levels(code, options, in);
}

// ---------------------------------------------------------------------------------------------------
struct SandboxPool::Impl {
  SandboxOptions options;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::pair<std::string, std::promise<SandboxResult>>> queue;
  bool stopping = false;
  std::vector<std::thread> threads;

  void work() {
    Spare spare;  // with options.prestart: this worker's next sandbox, its interpreter waiting for a script
    for (;;) {
      std::pair<std::string, std::promise<SandboxResult>> job;
      {
        std::unique_lock<std::mutex> lock(mu);
        if (options.prestart && !spare.launched && !stopping) {
          lock.unlock();
          spare = launch_spare(options);
          lock.lock();
        }
        cv.wait(lock, [&] { return stopping || !queue.empty(); });
        if (queue.empty()) break;
        job = std::move(queue.front());
        queue.pop_front();
      }
      try {
        job.second.set_value(options.prestart ? run_in_spare(spare, job.first, options)
                                              : run_python(job.first, options));
      } catch (...) {
        job.second.set_exception(std::current_exception());
      }
    }
    discard_spare(spare, options);
  }
};

SandboxPool::SandboxPool(SandboxOptions o) : impl_(std::make_unique<Impl>()) {
  validate(o);
  impl_->options = std::move(o);
  for (int64_t i = 0; i < impl_->options.workers; ++i) impl_->threads.emplace_back([this] { impl_->work(); });
}

SandboxPool::~SandboxPool() {
  std::deque<std::pair<std::string, std::promise<SandboxResult>>> cancelled;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stopping = true;
    cancelled.swap(impl_->queue);
  }
  impl_->cv.notify_all();
  for (auto& job : cancelled) {
    job.second.set_exception(std::make_exception_ptr(SandboxError("SandboxPool destroyed before the call ran")));
  }
  for (auto& t : impl_->threads) t.join();
}

std::future<SandboxResult> SandboxPool::submit(std::string code) {
  std::promise<SandboxResult> promise;
  std::future<SandboxResult> future = promise.get_future();
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (impl_->stopping) throw SandboxError("SandboxPool::submit after destruction began");
    impl_->queue.emplace_back(std::move(code), std::move(promise));
  }
  impl_->cv.notify_one();
  return future;
}

}  // namespace rlt
