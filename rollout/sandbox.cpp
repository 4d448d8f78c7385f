// The sandboxed interpreter (sandbox.h). One call is three processes:
//
//   caller thread P --clone(new user, pid, net, ipc namespaces)--> init B (pid 1 of the new namespace)
//   init B --clone--> C: setpgid, chdir, rlimits, drop capabilities (and the uid when the interpreter is
//                    reachable by uid 65534), no_new_privs, Landlock, seccomp, execve(python3 -I -B -u -)
//
// B stays outside every restriction so it can report C's exit status on a pipe (kDone) and then kill
// whatever C left behind: as pid 1 it takes the whole namespace down with it. P enforces the wall clock
// (SIGKILL to B, which kills the namespace), reads stdout/stderr (kept up to the cap, the rest drained),
// then removes the pids cgroup and the private directory. Where the kernel refuses namespaces, levels
// fall back (kLevels); without a pid namespace B is a child subreaper and kills C's process group and
// every descendant reparented to it, so even setsid() daemons die; only a process that escapes while B
// itself is being killed (a second timeout past the grace) could survive there.
//
// Everything the children need is prepared before the clone: they are copies of a multithreaded
// process, so between clone and execve they use only async-signal-safe calls and raw syscalls (no
// malloc, no glibc setuid wrapper, which would signal threads that do not exist in the copy). The
// clones are raw syscalls rather than fork() for the same reason: no atfork handlers run. Each clone
// copies the caller's page tables, so its cost grows with the trainer's resident memory (milliseconds
// for a few GiB).
#include "rollout/sandbox.h"

#include "common/files.h"

#include <fcntl.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
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

#include <dirent.h>
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

// ---------------------------------------------------------------------------------------------------
// Kernel interfaces the Debian 12 headers (Linux 6.1) may lack. Numbers are the same on every arch.
#ifndef SYS_landlock_create_ruleset
#define SYS_landlock_create_ruleset 444
#define SYS_landlock_add_rule 445
#define SYS_landlock_restrict_self 446
#endif
#ifndef SYS_close_range
#define SYS_close_range 436
#endif

// Landlock ABI 1..6 (linux/landlock.h; later ABIs add nothing used here): the ruleset attribute grew a field at v4 and
// at v6; the kernel accepts the prefix it knows, so the size passed follows the ABI.
struct LandlockRulesetAttr {
  uint64_t handled_access_fs = 0;
  uint64_t handled_access_net = 0;  // ABI >= 4
  uint64_t scoped = 0;              // ABI >= 6
};
struct __attribute__((packed)) LandlockPathBeneath {
  uint64_t allowed_access;
  int32_t parent_fd;
};
constexpr int kLandlockRulePathBeneath = 1;
constexpr uint32_t kLandlockCreateRulesetVersion = 1u << 0;
// Write-side filesystem rights (reads and execution are not handled, so they stay allowed everywhere).
constexpr uint64_t kFsWriteFile = 1ull << 1;
constexpr uint64_t kFsRemoveDir = 1ull << 4;
constexpr uint64_t kFsRemoveFile = 1ull << 5;
constexpr uint64_t kFsMakeChar = 1ull << 6;
constexpr uint64_t kFsMakeDir = 1ull << 7;
constexpr uint64_t kFsMakeReg = 1ull << 8;
constexpr uint64_t kFsMakeSock = 1ull << 9;
constexpr uint64_t kFsMakeFifo = 1ull << 10;
constexpr uint64_t kFsMakeBlock = 1ull << 11;
constexpr uint64_t kFsMakeSym = 1ull << 12;
constexpr uint64_t kFsRefer = 1ull << 13;     // ABI >= 2
constexpr uint64_t kFsTruncate = 1ull << 14;  // ABI >= 3
constexpr uint64_t kNetBindTcp = 1ull << 0;   // ABI >= 4
constexpr uint64_t kNetConnectTcp = 1ull << 1;
constexpr uint64_t kScopeAbstractUnix = 1ull << 0;  // ABI >= 6
constexpr uint64_t kScopeSignal = 1ull << 1;

// The uid/gid a call drops to when the caller is root and the interpreter is reachable by it.
constexpr uid_t kSandboxUid = 65534;
constexpr gid_t kSandboxGid = 65534;

using Clock = std::chrono::steady_clock;

std::string errno_text(int err) { return std::strerror(err); }

// ---------------------------------------------------------------------------------------------------
// Namespace levels, strongest first. The first call tries level 0 and moves down (for good: the result
// is kept in g_level) when the kernel refuses it; level 1 needs CAP_SYS_ADMIN, so only root tries it.
constexpr int kLevels[] = {CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC,
                           CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC, 0};
constexpr int kNumLevels = 3;
std::atomic<int> g_level{0};

// What the host offers, probed once.
struct Host {
  bool root = false;
  int landlock_abi = 0;   // 0: no Landlock
  std::string pids_root;  // our pids cgroup directory, where per-call cgroups are made; empty: none
};

// Landlock ABI version, 0 when the kernel has none (or it is disabled).
int probe_landlock() {
  const long v = syscall(SYS_landlock_create_ruleset, nullptr, 0, kLandlockCreateRulesetVersion);
  return v > 0 ? static_cast<int>(v) : 0;
}

// The directory of this process's pids cgroup (v1 "pids" hierarchy, or v2 when the unified hierarchy is
// the only one), if we may make child cgroups there; empty otherwise.
std::string probe_pids_cgroup() {
  std::ifstream cg("/proc/self/cgroup");
  std::string line, v1_path, v2_path;
  while (std::getline(cg, line)) {
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = "," + line.substr(a + 1, b - a - 1) + ",";
    if (controllers.find(",pids,") != std::string::npos) v1_path = line.substr(b + 1);
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
    if (fstype == "cgroup" && !v1_path.empty() && ("," + super + ",").find(",pids,") != std::string::npos) {
      v1_dir = under(v1_path);
    } else if (fstype == "cgroup2" && !v2_path.empty()) {
      v2_dir = under(v2_path);
    }
  }
  std::string dir = !v1_dir.empty() ? v1_dir : v2_dir;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  if (dir.empty() || access(dir.c_str(), W_OK) != 0) return "";
  return dir;
}

const Host& host() {
  static const Host h = [] {
    Host x;
    x.root = geteuid() == 0;
    x.landlock_abi = probe_landlock();
    if (x.root) x.pids_root = probe_pids_cgroup();
    return x;
  }();
  return h;
}
// Cleared when a per-call cgroup turns out to have no pids controller (v2 without delegation).
std::atomic<bool> g_pids_cgroup_ok{true};

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
// The children. Reports go to P on a pipe as fixed-size records (atomic: smaller than PIPE_BUF).
enum ReportKind : int32_t { kFailed = 1, kStarted = 2, kDone = 3 };
enum Stage : int32_t {
  kStageFds,
  kStageSync,
  kStageClone,
  kStageChdir,
  kStageRlimit,
  kStageCaps,
  kStageUid,
  kStagePrctl,
  kStageLandlock,
  kStageSeccomp,
  kStageExec,
};
const char* stage_name(int32_t s) {
  static const char* names[] = {"arranging descriptors",       "waiting for the caller",
                                "starting the interpreter",    "entering the working directory",
                                "setting resource limits",     "dropping capabilities",
                                "dropping to the sandbox uid", "prctl",
                                "applying Landlock",           "installing the seccomp filter",
                                "executing the interpreter"};
  return s >= 0 && s < int32_t(sizeof(names) / sizeof(names[0])) ? names[s] : "?";
}
struct Report {
  int32_t kind, a, b;
};

// Descriptor numbers inside B and C, after arrange_fds.
constexpr int kFdCode = 0, kFdOut = 1, kFdErr = 2, kFdStatus = 3, kFdSync = 4, kNumChildFds = 5;

// Everything B and C need, built by P before the clone.
struct Plan {
  const char* exe = nullptr;
  char* const* argv = nullptr;
  char* const* envp = nullptr;
  const char* workdir = nullptr;
  int fds[kNumChildFds] = {-1, -1, -1, -1, -1};  // P's numbers for code, out, err, status, sync
  rlim_t cpu_soft = 0, cpu_hard = 0, as = 0, fsize = 0, nofile = 0, nproc = 0;
  bool set_nproc = false;
  bool drop_uid = false;
  bool pidns = false;
  int landlock_abi = 0;
  sock_fprog seccomp{0, nullptr};  // len 0: none
};

void child_report(int fd, int32_t kind, int32_t a, int32_t b) {
  const Report r{kind, a, b};
  ssize_t n;
  do {
    n = write(fd, &r, sizeof r);
  } while (n < 0 && errno == EINTR);
}

[[noreturn]] void child_fail(int fd, Stage stage) {
  const int err = errno;
  child_report(fd, kFailed, stage, err);
  _exit(125);
}

pid_t raw_clone(unsigned long flags) {
  // clone(flags, stack = 0 (the child continues on its copy of this stack), ...): fork semantics.
  return static_cast<pid_t>(syscall(SYS_clone, flags | SIGCHLD, nullptr, nullptr, nullptr, nullptr));
}

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

void set_limit(int resource, rlim_t soft, rlim_t hard) {
  const rlimit r{soft, hard};
  if (setrlimit(resource, &r) != 0) child_fail(kFdStatus, kStageRlimit);
}

bool apply_landlock(int abi) {
  uint64_t fs = kFsWriteFile | kFsRemoveDir | kFsRemoveFile | kFsMakeChar | kFsMakeDir | kFsMakeReg | kFsMakeSock |
                kFsMakeFifo | kFsMakeBlock | kFsMakeSym;
  if (abi >= 2) fs |= kFsRefer;
  if (abi >= 3) fs |= kFsTruncate;
  LandlockRulesetAttr attr;
  attr.handled_access_fs = fs;
  if (abi >= 4) attr.handled_access_net = kNetBindTcp | kNetConnectTcp;  // no rule: every TCP bind/connect
  if (abi >= 6) attr.scoped = kScopeAbstractUnix | kScopeSignal;         // no signal leaves the domain
  const size_t size = abi >= 6 ? 24 : abi >= 4 ? 16 : 8;
  const int ruleset = static_cast<int>(syscall(SYS_landlock_create_ruleset, &attr, size, 0u));
  if (ruleset < 0) return false;
  bool ok = true;
  // Writes: the working directory (C's cwd by now), and /dev/null (subprocess.DEVNULL opens it).
  const int dir = open(".", O_PATH | O_DIRECTORY | O_CLOEXEC);
  LandlockPathBeneath rule{fs, dir};
  ok &= dir >= 0 && syscall(SYS_landlock_add_rule, ruleset, kLandlockRulePathBeneath, &rule, 0u) == 0;
  const int null = open("/dev/null", O_PATH | O_CLOEXEC);
  if (null >= 0) {
    LandlockPathBeneath devnull{kFsWriteFile | (abi >= 3 ? kFsTruncate : 0), null};
    syscall(SYS_landlock_add_rule, ruleset, kLandlockRulePathBeneath, &devnull, 0u);
    close(null);
  }
  if (dir >= 0) close(dir);
  ok &= ok && syscall(SYS_landlock_restrict_self, ruleset, 0u) == 0;
  close(ruleset);
  return ok;
}

// C: limits, identity, confinement, execve. Never returns.
[[noreturn]] void interpreter_main(const Plan& p) {
  setpgid(0, 0);  // its own group, so P (or B) can kill the group without hitting B
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  fcntl(kFdStatus, F_SETFD, FD_CLOEXEC);  // closed by a successful execve: EOF means exec'd or dead
  if (chdir(p.workdir) != 0) child_fail(kFdStatus, kStageChdir);
  set_limit(RLIMIT_CPU, p.cpu_soft, p.cpu_hard);
  set_limit(RLIMIT_AS, p.as, p.as);
  set_limit(RLIMIT_FSIZE, p.fsize, p.fsize);
  set_limit(RLIMIT_NOFILE, p.nofile, p.nofile);
  set_limit(RLIMIT_CORE, 0, 0);
  if (p.set_nproc) set_limit(RLIMIT_NPROC, p.nproc, p.nproc);
  // Empty the bounding set first (needs CAP_SETPCAP, which the uid change would take away), so that not
  // even a uid-0 execve can grant capabilities again. EINVAL past the last capability the kernel knows.
  for (int cap = 0; cap <= 63; ++cap) prctl(PR_CAPBSET_DROP, cap, 0, 0, 0);
  prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
  if (p.drop_uid) {
    if (syscall(SYS_setgroups, 0, nullptr) != 0 || syscall(SYS_setresgid, kSandboxGid, kSandboxGid, kSandboxGid) != 0 ||
        syscall(SYS_setresuid, kSandboxUid, kSandboxUid, kSandboxUid) != 0) {
      child_fail(kFdStatus, kStageUid);
    }
  } else {
    __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
    __user_cap_data_struct data[2] = {};
    if (syscall(SYS_capset, &header, data) != 0) child_fail(kFdStatus, kStageCaps);
  }
  // Set after the credential change, which clears it: C dies with B.
  if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0 || prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) {
    child_fail(kFdStatus, kStagePrctl);
  }
  if (p.landlock_abi > 0 && !apply_landlock(p.landlock_abi)) child_fail(kFdStatus, kStageLandlock);
  if (p.seccomp.len > 0 && syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0u, &p.seccomp) != 0) {
    child_fail(kFdStatus, kStageSeccomp);
  }
  execve(p.exe, p.argv, p.envp);
  const int err = errno;
  child_report(kFdStatus, kFailed, kStageExec, err);
  _exit(127);
}

// Without a pid namespace: kill every child of B (a subreaper, so C's orphans, daemons included, end up
// here) and reap, until none is left. Children are listed in /proc/self/task/<tid>/children.
void kill_descendants() {
  char path[64] = "/proc/self/task/";
  {
    char digits[16];
    int n = 0;
    for (long t = syscall(SYS_gettid); t > 0; t /= 10) digits[n++] = static_cast<char>('0' + t % 10);
    size_t at = std::strlen(path);
    while (n > 0) path[at++] = digits[--n];
    std::memcpy(path + at, "/children", 10);
  }
  for (int rounds = 0; rounds < 100000; ++rounds) {
    const int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) break;  // no CONFIG_PROC_CHILDREN: the process-group kill is all we can do
    char buf[4096];
    long pid = 0;
    bool in_number = false;
    for (ssize_t n; (n = read(fd, buf, sizeof buf)) > 0;) {
      for (ssize_t i = 0; i < n; ++i) {
        if (buf[i] >= '0' && buf[i] <= '9') {
          pid = pid * 10 + (buf[i] - '0');
          in_number = true;
        } else if (in_number) {
          kill(static_cast<pid_t>(pid), SIGKILL);
          pid = 0;
          in_number = false;
        }
      }
    }
    if (in_number) kill(static_cast<pid_t>(pid), SIGKILL);
    close(fd);
    const pid_t w = waitpid(-1, nullptr, 0);
    if (w < 0 && errno == ECHILD) return;
  }
  while (waitpid(-1, nullptr, WNOHANG) > 0) {
  }
}

// B: the namespace's init (or a subreaper without one). Never returns.
[[noreturn]] void init_main(Plan p) {
  prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);  // the caller's thread gone: the whole sandbox goes
  // Default dispositions (P's handlers must not run here, and ignored signals would stay ignored in
  // python), then unblock (P blocked everything around the clone).
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  for (int sig = 1; sig < NSIG; ++sig) {
    if (sig != SIGKILL && sig != SIGSTOP) sigaction(sig, &dfl, nullptr);
  }
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  setsid();
  if (!arrange_fds(p.fds, kNumChildFds)) child_fail(p.fds[3] >= 0 ? p.fds[3] : kFdStatus, kStageFds);
  char go = 0;
  ssize_t got;
  do {
    got = read(kFdSync, &go, 1);
  } while (got < 0 && errno == EINTR);
  if (got != 1) _exit(125);  // P gave up (or died) before letting us go
  close(kFdSync);
  if (!p.pidns) prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
  const pid_t c = raw_clone(0);
  if (c == 0) interpreter_main(p);
  if (c < 0) child_fail(kFdStatus, kStageClone);
  child_report(kFdStatus, kStarted, c, 0);
  close(kFdCode);  // only C holds the code and the output pipes now
  close(kFdOut);
  close(kFdErr);
  int status = 0;
  for (;;) {
    int st = 0;
    const pid_t w = waitpid(-1, &st, 0);
    if (w == c) {
      status = st;
      break;
    }
    if (w < 0 && errno != EINTR) break;
  }
  if (p.pidns) {
    kill(-1, SIGKILL);  // from init: everything else in the namespace
    while (waitpid(-1, nullptr, 0) > 0 || errno == EINTR) {
    }
  } else {
    kill(-c, SIGKILL);
    kill_descendants();
  }
  child_report(kFdStatus, kDone, status, 0);
  _exit(0);
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

// The interpreter, resolved once per (python, tmp root): the real executable, and whether the sandbox
// can run it as kSandboxUid (only asked when we are root).
struct Interpreter {
  std::string exe;
  bool drop_uid = false;
};

// `python -I -c "print(sys.executable)"` in the caller's own environment (a pyenv shim needs it).
std::string resolve_executable(const std::string& python) {
  int out[2];
  if (pipe2(out, O_CLOEXEC) != 0) throw SandboxError("pipe: " + errno_text(errno));
  Fd read_end(out[0]), write_end(out[1]);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, write_end.fd, 1);
  std::vector<std::string> args = {python, "-I", "-c", "import sys; sys.stdout.write(sys.executable)"};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  const int err = posix_spawnp(&pid, python.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (err != 0) throw SandboxError("cannot run the interpreter '" + python + "': " + errno_text(err));
  write_end.reset();
  std::string exe;
  char buf[4096];
  for (ssize_t n; (n = read(read_end.fd, buf, sizeof buf)) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    exe.append(buf, n);
  }
  int st = 0;
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0 || exe.empty() || exe[0] != '/') {
    throw SandboxError("the interpreter '" + python + "' does not report its sys.executable (status " +
                       std::to_string(st) + ")");
  }
  return exe;
}

std::string tmp_root_of(const SandboxOptions& o) {
  if (!o.tmp_root.empty()) return o.tmp_root;
  const char* env = std::getenv("TMPDIR");
  return env != nullptr && env[0] == '/' ? env : "/tmp";
}

SandboxResult run_levels(const std::string& code, const SandboxOptions& o, const std::string& exe, bool drop_uid);

Interpreter interpreter_for(const SandboxOptions& o) {
  static std::mutex mu;
  static std::map<std::pair<std::string, std::string>, Interpreter> cache;
  const auto key = std::make_pair(o.python, tmp_root_of(o));
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  Interpreter in;
  in.exe = resolve_executable(o.python);
  if (host().root) {
    // Can uid 65534 reach the interpreter, its libraries and the tmp root? Ask the sandbox itself.
    SandboxOptions probe = o;
    probe.timeout_s = std::max(o.timeout_s, 10.0);
    try {
      const SandboxResult r = run_levels("import sys, encodings\n", probe, in.exe, /*drop_uid=*/true);
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
// closed, and the private directory is removed last.
struct CallFiles {
  struct DirGuard {
    std::string path;  // empty until mkdtemp made it
    ~DirGuard() {
      if (!path.empty()) remove_tree(path);
    }
  } dir;
  Fd code;                                            // the interpreter's stdin
  Fd out_r, out_w, err_r, err_w, status_r, status_w;  // C's stdout and stderr; B's (and C's) reports
  Fd sync_p, sync_c;                                  // P's "go" to B
  // Per-call pids cgroup (root only): made before the clone, B moved in before it may start C.
  struct CgroupGuard {
    std::string path;
    ~CgroupGuard() {
      // Every task in it is the sandbox's, so whatever is still listed (a process that slipped out of a
      // fallback level's kills) is killed here; rmdir succeeds once the last one has exited.
      for (int i = 0; !path.empty() && i < 400 && rmdir(path.c_str()) != 0 && errno == EBUSY; ++i) {
        std::ifstream procs(path + "/cgroup.procs");
        for (pid_t pid; procs >> pid;) kill(pid, SIGKILL);
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
  } cgroup;
};

// The private working directory.
void make_private_dir(CallFiles& f, const SandboxOptions& o, bool drop_uid) {
  std::string dir = tmp_root_of(o) + "/rlt-sandbox-XXXXXX";
  if (mkdtemp(dir.data()) == nullptr) throw SandboxError("mkdtemp " + dir + ": " + errno_text(errno));
  f.dir.path = dir;
  if (drop_uid && chown(dir.c_str(), kSandboxUid, kSandboxGid) != 0) {
    throw SandboxError("chown " + dir + ": " + errno_text(errno));
  }
}

// The code, as the interpreter's stdin (a script read from stdin: tracebacks say File "<stdin>").
void make_code_fd(CallFiles& f, const std::string& code) {
  f.code.reset(memfd_create("rlt-sandbox-code", MFD_CLOEXEC));
  if (f.code.fd < 0) throw SandboxError("memfd_create: " + errno_text(errno));
  for (size_t done = 0; done < code.size();) {
    const ssize_t n = write(f.code.fd, code.data() + done, code.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw SandboxError("writing the code: " + errno_text(errno));
    done += n;
  }
  {
    // A read-only descriptor, so the code cannot rewrite its own script.
    const std::string self = "/proc/self/fd/" + std::to_string(f.code.fd);
    const int ro = open(self.c_str(), O_RDONLY | O_CLOEXEC);
    if (ro >= 0) f.code.reset(ro);
    lseek(f.code.fd, 0, SEEK_SET);
  }
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

// The call's pids cgroup, capped at max_processes (+1 for B); left out where there is none to make.
void make_pids_cgroup(CallFiles& f, const Host& h, const SandboxOptions& o) {
  if (!h.pids_root.empty() && g_pids_cgroup_ok.load()) {
    static std::atomic<uint64_t> seq{0};
    const std::string path =
        h.pids_root + "/rlt-sandbox-" + std::to_string(getpid()) + "-" + std::to_string(seq.fetch_add(1));
    if (mkdir(path.c_str(), 0755) == 0) {
      f.cgroup.path = path;
      try {
        write_file(path + "/pids.max", std::to_string(o.max_processes + 1));  // +1: B
      } catch (const SandboxError&) {
        g_pids_cgroup_ok = false;  // no pids controller here (v2 without delegation): stop trying
        rmdir(path.c_str());
        f.cgroup.path.clear();
      }
    }
  }
}

// The interpreter's argv and environment; a Plan points into them.
struct Command {
  std::vector<std::string> args, env;
  std::vector<char*> argv, envp;
};

void make_command(Command& cmd, const SandboxOptions& o, const std::string& exe, const std::string& dir) {
  cmd.args = {exe, "-I", "-B", "-u", "-"};
  if (!o.site_packages) cmd.args.insert(cmd.args.begin() + 1, "-S");
  cmd.env = {"PATH=/usr/local/bin:/usr/bin:/bin", "HOME=" + dir, "TMPDIR=" + dir, "LANG=C.UTF-8",
             // One thread per math library: python's threads count as processes.
             "OMP_NUM_THREADS=1", "OPENBLAS_NUM_THREADS=1", "MKL_NUM_THREADS=1"};
  for (auto& a : cmd.args) cmd.argv.push_back(a.data());
  cmd.argv.push_back(nullptr);
  for (auto& e : cmd.env) cmd.envp.push_back(e.data());
  cmd.envp.push_back(nullptr);
}

// The limits, the descriptors and the confinement B and C apply, all settled before the clone.
Plan make_plan(const SandboxOptions& o, const Host& h, const std::string& exe, bool drop_uid, int ns_flags,
               const CallFiles& f, const Command& cmd) {
  const bool userns = ns_flags & CLONE_NEWUSER, pidns = ns_flags & CLONE_NEWPID;
  const SeccompVariant variant{pidns, !drop_uid, h.landlock_abi >= 3};
  const std::vector<sock_filter>& filter = seccomp_program(variant);
  Plan plan;
  plan.exe = exe.c_str();
  plan.argv = cmd.argv.data();
  plan.envp = cmd.envp.data();
  plan.workdir = f.dir.path.c_str();
  plan.fds[kFdCode] = f.code.fd;
  plan.fds[kFdOut] = f.out_w.fd;
  plan.fds[kFdErr] = f.err_w.fd;
  plan.fds[kFdStatus] = f.status_w.fd;
  plan.fds[kFdSync] = f.sync_c.fd;
  const rlim_t cpu = static_cast<rlim_t>(std::ceil(o.timeout_s)) + 1;
  plan.cpu_soft = cpu;
  plan.cpu_hard = cpu + 1;
  plan.as = static_cast<rlim_t>(o.memory_mb) << 20;
  plan.fsize = static_cast<rlim_t>(o.max_file_mb) << 20;
  plan.nofile = static_cast<rlim_t>(o.max_open_files);
  // RLIMIT_NPROC counts the tasks of a uid within a user namespace (Linux >= 5.14), and is never
  // enforced for uid 0, namespace or not: it is this call's own count only in a user namespace of its own
  // and under a uid other than 0 (dropped to 65534, or a non-root caller's).
  plan.set_nproc = userns && (drop_uid || !h.root);
  plan.nproc = static_cast<rlim_t>(o.max_processes);
  plan.drop_uid = drop_uid;
  plan.pidns = pidns;
  plan.landlock_abi = h.landlock_abi;
  plan.seccomp = sock_fprog{static_cast<unsigned short>(filter.size()), const_cast<sock_filter*>(filter.data())};
  return plan;
}

// B, killed and reaped on every way out unless P has reaped it already.
struct ChildGuard {
  pid_t pid;
  bool reaped = false;
  ~ChildGuard() {
    if (reaped) return;
    kill(pid, SIGKILL);
    while (waitpid(pid, nullptr, 0) < 0 && errno == EINTR) {
    }
  }
};

// Map only the sandbox ids (identity) into B's namespace, so C can setresuid to them in there. False
// when the kernel refuses the maps.
bool map_sandbox_ids(pid_t b) {
  const std::string proc = "/proc/" + std::to_string(b);
  try {
    write_file(proc + "/gid_map", std::to_string(kSandboxGid) + " " + std::to_string(kSandboxGid) + " 1\n");
    write_file(proc + "/uid_map", std::to_string(kSandboxUid) + " " + std::to_string(kSandboxUid) + " 1\n");
  } catch (const SandboxError&) {
    return false;
  }
  return true;
}

// Whether B made it into the call's pids cgroup.
bool join_pids_cgroup(const CallFiles& f, pid_t b) {
  if (f.cgroup.path.empty()) return false;
  try {
    write_file(f.cgroup.path + "/cgroup.procs", std::to_string(b));
    return true;
  } catch (const SandboxError&) {
    return false;
  }
}

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
std::string isolation_of(int ns_flags, bool drop_uid, bool in_cgroup, const Plan& plan) {
  std::string iso;
  auto add = [&iso](const char* token) { iso += iso.empty() ? token : std::string("+") + token; };
  if (ns_flags & CLONE_NEWUSER) add("userns");
  if (ns_flags & CLONE_NEWPID) add("pidns");
  if (ns_flags & CLONE_NEWNET) add("netns");
  if (ns_flags & CLONE_NEWIPC) add("ipcns");
  if (drop_uid) add("setuid");
  if (in_cgroup) add("pids-cgroup");
  if (plan.set_nproc) add("nproc");
  if (plan.landlock_abi > 0) add("landlock");
  if (plan.seccomp.len > 0) add("seccomp");
  return iso;
}

// One attempt at namespace level `level`. Returns false (and leaves `result` alone) when the kernel
// refused that level's namespaces, so the caller can try the next one.
bool run_at_level(const std::string& code, const SandboxOptions& o, const std::string& exe, bool drop_uid, int level,
                  SandboxResult& result) {
  const Host& h = host();
  const int ns_flags = kLevels[level];
  const bool userns = ns_flags & CLONE_NEWUSER, pidns = ns_flags & CLONE_NEWPID;

  CallFiles f;
  make_private_dir(f, o, drop_uid);
  make_code_fd(f, code);
  make_channels(f);
  make_pids_cgroup(f, h, o);
  // argv, envp and the limits, before the clone.
  Command cmd;
  make_command(cmd, o, exe, f.dir.path);
  const Plan plan = make_plan(o, h, exe, drop_uid, ns_flags, f, cmd);

  // Clone with every signal blocked, so none of P's handlers runs in B before B resets them.
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  const auto t0 = Clock::now();
  const pid_t b = raw_clone(static_cast<unsigned long>(ns_flags));
  if (b == 0) init_main(plan);
  const int clone_errno = errno;
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  if (b < 0) {
    if (ns_flags != 0 && (clone_errno == EPERM || clone_errno == EINVAL || clone_errno == ENOSPC ||
                          clone_errno == EUSERS || clone_errno == ENOSYS)) {
      return false;
    }
    throw SandboxError("clone: " + errno_text(clone_errno));
  }
  // From here on B exists: make sure it is killed and reaped on every way out.
  ChildGuard b_guard{b};
  f.code.reset(), f.out_w.reset(), f.err_w.reset(), f.status_w.reset(), f.sync_c.reset();

  // This kernel's user namespaces are not usable for us: next level.
  if (userns && drop_uid && !map_sandbox_ids(b)) return false;
  const bool in_cgroup = join_pids_cgroup(f, b);
  const char go = 1;
  if (send(f.sync_p.fd, &go, 1, MSG_NOSIGNAL) != 1) {
    // B died before it could be released: fall through, the status pipe tells why.
  }

  Watch w;
  supervise(w, b_guard, pidns, o, t0, f);
  const auto t1 = Clock::now();
  if (!b_guard.reaped) {
    kill(b, SIGKILL);
    while (waitpid(b, &w.b_status, 0) < 0 && errno == EINTR) {
    }
    b_guard.reaped = true;
  }
  if (w.failed && !w.timed_out) {
    throw SandboxError(std::string("sandbox setup failed while ") + stage_name(w.fail_stage) + " (" + exe +
                       "): " + errno_text(w.fail_errno));
  }
  result = make_result(w, o, t1 - t0);
  result.isolation = isolation_of(ns_flags, drop_uid, in_cgroup, plan);
  return true;
}

SandboxResult run_levels(const std::string& code, const SandboxOptions& o, const std::string& exe, bool drop_uid) {
  for (;;) {
    int level = o.namespaces ? g_level.load() : kNumLevels - 1;
    if (level == 1 && !host().root) level = 2;  // namespaces without a user namespace need CAP_SYS_ADMIN
    SandboxResult r;
    if (run_at_level(code, o, exe, drop_uid, level, r)) return r;
    if (level + 1 >= kNumLevels) throw SandboxError("no sandbox level could start");
    int expected = g_level.load();
    while (expected <= level && !g_level.compare_exchange_weak(expected, level + 1)) {
    }
  }
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
  return run_levels(code, options, in.exe, in.drop_uid);
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
    for (;;) {
      std::pair<std::string, std::promise<SandboxResult>> job;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stopping || !queue.empty(); });
        if (queue.empty()) return;
        job = std::move(queue.front());
        queue.pop_front();
      }
      try {
        job.second.set_value(run_python(job.first, options));
      } catch (...) {
        job.second.set_exception(std::current_exception());
      }
    }
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
