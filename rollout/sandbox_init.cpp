// rlt-sandbox-init: the init process (B) of one sandboxed call, and the interpreter's set-up (C). The
// trainer (P, rollout/sandbox_spawn.cpp) starts it with clone(CLONE_VM | CLONE_VFORK) and an immediate execve
// (what posix_spawn does), so a call never copies the trainer's page tables; this small static program then
// does everything that needs a process of its own:
//
//   B: reads the plan (fd 5), waits for P's "go" (P has moved B into the call's cgroups by then), makes
//      the namespaces with a child B2 and writes B2's uid maps, then waits for B2.
//   B2: pid 1 of the new namespaces: builds the mount namespace's read-only root (jail), forks C, waits
//      for it, reports its status and kills whatever it left behind (as pid 1 of its pid namespace, or
//      as a subreaper where no namespace was made, and B itself does this part).
//   C: chdir, rlimits, capabilities and uid dropped, no_new_privs, Landlock, seccomp, execve(python).
//
// B is single-threaded and small, so B2 and C are plain forks and may allocate. The jail: a tmpfs root holding
// read-only binds of the plan's read_paths (the system's /usr and /lib, a few /etc files, the
// interpreter's prefix and sys.path), five /dev nodes, and the call's directory as a tmpfs of its own
// whose size is the disk quota; everything else of the host is absent. See rollout/sandbox_plan.h.
#include <fcntl.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/mount.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "rollout/sandbox_plan.h"

namespace {

using namespace rlt::sandbox;

// ---------------------------------------------------------------------------------------------------
// Kernel interfaces the Debian 12 headers (Linux 6.1) may lack. Numbers are the same on every arch.
#ifndef SYS_landlock_create_ruleset
#define SYS_landlock_create_ruleset 444
#define SYS_landlock_add_rule 445
#define SYS_landlock_restrict_self 446
#endif
#ifndef SYS_mount_setattr
#define SYS_mount_setattr 442
#endif

// Landlock ABI 1..6 (linux/landlock.h): the ruleset attribute grew a field at v4 and at v6; the kernel
// accepts the prefix it knows, so the size passed follows the ABI.
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
constexpr uint64_t kFsExecute = 1ull << 0;
constexpr uint64_t kFsWriteFile = 1ull << 1;
constexpr uint64_t kFsReadFile = 1ull << 2;
constexpr uint64_t kFsReadDir = 1ull << 3;
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

// The device nodes the jail (and a Landlock read allowlist) keep.
constexpr const char* kDevNodes[] = {"/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"};

void report(int32_t kind, int32_t a, int32_t b) { write_report(kFdStatus, {kind, a, b}); }

[[noreturn]] void fail(Stage stage, int err = errno) {
  report(kFailed, stage, err);
  _exit(125);
}

// ---------------------------------------------------------------------------------------------------
// The jail (B, in its own mount namespace).

// mkdir -p, mode 0755 for what it makes.
bool make_dirs(const std::string& path) {
  for (size_t at = 1; at <= path.size(); ++at) {
    if (at != path.size() && path[at] != '/') continue;
    const std::string prefix = path.substr(0, at);
    if (mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) return false;
  }
  return true;
}

std::string parent_of(const std::string& path) { return path.substr(0, std::max<size_t>(1, path.rfind('/'))); }

// Read-only, no set-uid, no devices, for the bind at `target` and every mount beneath it. mount_setattr
// changes only these bits, so it works in a user namespace where the host mount's other flags are locked.
bool make_read_only(const std::string& target, bool keep_devices) {
  mount_attr attr{};
  attr.attr_set = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | (keep_devices ? 0 : MOUNT_ATTR_NODEV);
  if (syscall(SYS_mount_setattr, AT_FDCWD, target.c_str(), AT_RECURSIVE, &attr, sizeof attr) == 0) return true;
  if (errno != ENOSYS) return false;
  return mount(nullptr, target.c_str(), nullptr, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID, nullptr) == 0;
}

// `source` at root + source: a symlink is recreated, a directory or a file bound read-only. A missing
// source is left out.
bool add_read_path(const std::string& root, const std::string& source, bool keep_devices) {
  struct stat st {};
  if (lstat(source.c_str(), &st) != 0) return errno == ENOENT || errno == ENOTDIR;
  const std::string target = root + source;
  if (!make_dirs(parent_of(target))) return false;
  if (S_ISLNK(st.st_mode)) {
    char link[4096];
    const ssize_t n = readlink(source.c_str(), link, sizeof link - 1);
    if (n < 0) return false;
    link[n] = '\0';
    return symlink(link, target.c_str()) == 0 || errno == EEXIST;
  }
  if (S_ISDIR(st.st_mode)) {
    if (mkdir(target.c_str(), 0755) != 0 && errno != EEXIST) return false;
  } else {
    const int fd = open(target.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return false;
    close(fd);
  }
  if (mount(source.c_str(), target.c_str(), nullptr, MS_BIND | MS_REC, nullptr) != 0) return false;
  return make_read_only(target, keep_devices);
}

// The minimal root, built on a tmpfs mounted over the (empty) call directory P made, then pivoted into:
// afterwards nothing of the host is reachable but what was bound.
bool build_jail(const SandboxPlan& p) {
  if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return false;
  const std::string root = p.workdir;
  if (mount("rlt-sandbox", root.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755") != 0) {
    return false;
  }
  for (const std::string& path : p.read_paths) {
    if (!add_read_path(root, path, false)) return false;
  }
  // /dev: a tmpfs with the few nodes bound from the host's.
  const std::string dev = root + "/dev";
  if (mkdir(dev.c_str(), 0755) != 0 ||
      mount("rlt-sandbox-dev", dev.c_str(), "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,nr_inodes=64,mode=0755") != 0) {
    return false;
  }
  for (const char* node : kDevNodes) {
    if (!add_read_path(root, node, true)) return false;
    // Writable (subprocess.DEVNULL, /dev/full's ENOSPC): the bind's own read-only bit is cleared again.
    mount_attr attr{};
    attr.attr_clr = MOUNT_ATTR_RDONLY;
    const std::string target = root + node;
    if (syscall(SYS_mount_setattr, AT_FDCWD, target.c_str(), 0, &attr, sizeof attr) != 0 && errno != ENOSYS) {
      return false;
    }
  }
  for (const auto& [name, target] : {std::pair<const char*, const char*>{"fd", "/proc/self/fd"},
                                     {"stdin", "/proc/self/fd/0"},
                                     {"stdout", "/proc/self/fd/1"},
                                     {"stderr", "/proc/self/fd/2"}}) {
    if (symlink(target, (dev + "/" + name).c_str()) != 0) return false;
  }
  // The call's directory: a tmpfs of its own, whose size and entry count are the disk quota.
  const std::string work = root + p.workdir;
  const std::string options = "size=" + std::to_string(p.disk_bytes) + ",nr_inodes=" + std::to_string(p.disk_inodes) +
                              ",mode=0700,uid=" + std::to_string(p.work_uid) + ",gid=" + std::to_string(p.work_gid);
  if (!make_dirs(work) ||
      mount("rlt-sandbox-work", work.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, options.c_str()) != 0) {
    return false;
  }
  if (chdir(root.c_str()) != 0 || syscall(SYS_pivot_root, ".", ".") != 0 || umount2(".", MNT_DETACH) != 0 ||
      chdir("/") != 0) {
    return false;
  }
  return mount(nullptr, "/", nullptr, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, nullptr) == 0 &&
         mount(nullptr, "/dev", nullptr, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC, nullptr) == 0;
}

// ---------------------------------------------------------------------------------------------------
// C.

void set_limit(int resource, int64_t soft, int64_t hard) {
  const rlimit r{static_cast<rlim_t>(soft), static_cast<rlim_t>(hard)};
  if (setrlimit(resource, &r) != 0) fail(kStageRlimit);
}

bool add_rule(int ruleset, const char* path, uint64_t access) {
  const int fd = open(path, O_PATH | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT || errno == ENOTDIR;  // a missing allowlist entry allows nothing
  struct stat st {};
  // Rights that only apply to directories are refused on a file's rule.
  constexpr uint64_t kFileRights = kFsExecute | kFsWriteFile | kFsReadFile | kFsTruncate;
  if (fstat(fd, &st) == 0 && !S_ISDIR(st.st_mode)) access &= kFileRights;
  LandlockPathBeneath rule{access, fd};
  const bool ok = syscall(SYS_landlock_add_rule, ruleset, kLandlockRulePathBeneath, &rule, 0u) == 0;
  close(fd);
  return ok;
}

// Writes only inside the working directory (C's cwd by now) and to the /dev nodes; with read_paths,
// reads and execution only beneath them, the /dev nodes and the working directory.
bool apply_landlock(const SandboxPlan& p) {
  const int abi = static_cast<int>(p.landlock_abi);
  uint64_t write = kFsWriteFile | kFsRemoveDir | kFsRemoveFile | kFsMakeChar | kFsMakeDir | kFsMakeReg | kFsMakeSock |
                   kFsMakeFifo | kFsMakeBlock | kFsMakeSym;
  if (abi >= 2) write |= kFsRefer;
  if (abi >= 3) write |= kFsTruncate;
  const uint64_t read = p.landlock_read ? kFsExecute | kFsReadFile | kFsReadDir : 0;
  LandlockRulesetAttr attr;
  attr.handled_access_fs = write | read;
  if (abi >= 4) attr.handled_access_net = kNetBindTcp | kNetConnectTcp;  // no rule: every TCP bind/connect
  if (abi >= 6) attr.scoped = kScopeAbstractUnix | kScopeSignal;         // no signal leaves the domain
  const size_t size = abi >= 6 ? 24 : abi >= 4 ? 16 : 8;
  const int ruleset = static_cast<int>(syscall(SYS_landlock_create_ruleset, &attr, size, 0u));
  if (ruleset < 0) return false;
  bool ok = add_rule(ruleset, ".", write | read);
  for (const char* node : kDevNodes) ok = ok && add_rule(ruleset, node, kFsWriteFile | kFsTruncate | read);
  if (p.landlock_read) {
    for (const std::string& path : p.read_paths) ok = ok && add_rule(ruleset, path.c_str(), read);
  }
  ok = ok && syscall(SYS_landlock_restrict_self, ruleset, 0u) == 0;
  close(ruleset);
  return ok;
}

std::vector<char*> c_strings(const std::vector<std::string>& v) {
  std::vector<char*> out;
  for (const auto& s : v) out.push_back(const_cast<char*>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

// C: limits, identity, confinement, execve. Never returns.
[[noreturn]] void interpreter_main(const SandboxPlan& p) {
  setpgid(0, 0);  // its own group, so P (or B) can kill the group without hitting B
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  fcntl(kFdStatus, F_SETFD, FD_CLOEXEC);  // closed by a successful execve: EOF means exec'd or dead
  if (chdir(p.workdir.c_str()) != 0) fail(kStageChdir);
  std::vector<char*> argv = c_strings(p.argv), envp = c_strings(p.envp);  // before the limits bite
  set_limit(RLIMIT_CPU, p.cpu_soft, p.cpu_hard);
  set_limit(RLIMIT_AS, p.as, p.as);
  set_limit(RLIMIT_FSIZE, p.fsize, p.fsize);
  set_limit(RLIMIT_NOFILE, p.nofile, p.nofile);
  set_limit(RLIMIT_CORE, 0, 0);
  if (p.set_nproc) set_limit(RLIMIT_NPROC, p.nproc, p.nproc);
  // Below the trainer's priority (-1 is also a valid niceness, hence errno).
  errno = 0;
  if (p.nice > 0 && nice(static_cast<int>(p.nice)) == -1 && errno != 0) fail(kStageRlimit);
  // Empty the bounding set first (needs CAP_SETPCAP, which the uid change would take away), so that not
  // even a uid-0 execve can grant capabilities again. EINVAL past the last capability the kernel knows.
  for (int cap = 0; cap <= 63; ++cap) prctl(PR_CAPBSET_DROP, cap, 0, 0, 0);
  prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
  if (p.drop_uid) {
    if (syscall(SYS_setgroups, 0, nullptr) != 0 || syscall(SYS_setresgid, kSandboxGid, kSandboxGid, kSandboxGid) != 0 ||
        syscall(SYS_setresuid, kSandboxUid, kSandboxUid, kSandboxUid) != 0) {
      fail(kStageUid);
    }
  } else {
    __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
    __user_cap_data_struct data[2] = {};
    if (syscall(SYS_capset, &header, data) != 0) fail(kStageCaps);
  }
  // Set after the credential change, which clears it: C dies with B.
  if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0 || prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) {
    fail(kStagePrctl);
  }
  if (p.landlock_abi > 0 && !apply_landlock(p)) fail(kStageLandlock);
  if (!p.seccomp.empty()) {
    const sock_fprog prog{static_cast<unsigned short>(p.seccomp.size() / sizeof(sock_filter)),
                          reinterpret_cast<sock_filter*>(const_cast<char*>(p.seccomp.data()))};
    if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0u, &prog) != 0) fail(kStageSeccomp);
  }
  execve(p.exe.c_str(), argv.data(), envp.data());
  report(kFailed, kStageExec, errno);
  _exit(127);
}

// ---------------------------------------------------------------------------------------------------
// B.

// Without a pid namespace: kill every child of B (a subreaper, so C's orphans, daemons included, end up
// here) and reap, until none is left. Children are listed in /proc/self/task/<tid>/children.
void kill_descendants() {
  const std::string path = "/proc/self/task/" + std::to_string(getpid()) + "/children";
  for (int rounds = 0; rounds < 100000; ++rounds) {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
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

// `text` written to /proc/<pid>/<file>; false (errno set) when the kernel refuses it.
bool write_proc(pid_t pid, const char* file, const std::string& text) {
  const std::string path = "/proc/" + std::to_string(pid) + "/" + file;
  const int fd = open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  const int err = errno;
  close(fd);
  errno = err;
  return ok;
}

// B2's user namespace: uid and gid 0 to the caller's (root's 0, or its own uid), and for root the
// sandbox ids to themselves, so C may drop to them.
bool write_maps(pid_t b2, const SandboxPlan& p) {
  std::string uids = "0 " + std::to_string(p.map_uid) + " 1\n", gids = "0 " + std::to_string(p.map_gid) + " 1\n";
  if (p.map_sandbox_ids) {
    uids += std::to_string(kSandboxUid) + " " + std::to_string(kSandboxUid) + " 1\n";
    gids += std::to_string(kSandboxGid) + " " + std::to_string(kSandboxGid) + " 1\n";
  } else if (!write_proc(b2, "setgroups", "deny")) {
    return false;
  }
  return write_proc(b2, "gid_map", gids) && write_proc(b2, "uid_map", uids);
}

// B makes the plan's namespaces with a child, B2, writes its uid maps (B holds the caller's
// capabilities; B2 holds the new namespace's from the clone on, which an execve before the maps exist
// would have taken away), and lets it go. Returns in B2. B waits for B2 and exits with its status.
void enter_namespaces(const SandboxPlan& plan) {
  int ready[2];
  if (pipe2(ready, O_CLOEXEC) != 0) fail(kStageNamespaces);
  const pid_t b2 = static_cast<pid_t>(
      syscall(SYS_clone, static_cast<unsigned long>(plan.ns_flags) | SIGCHLD, nullptr, nullptr, nullptr, nullptr));
  if (b2 < 0) fail(kStageNamespaces);
  if (b2 == 0) {
    close(ready[1]);
    prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);  // B killed (the caller's timeout): B2 and its namespace go
    char go = 0;
    ssize_t got;
    do {
      got = read(ready[0], &go, 1);
    } while (got < 0 && errno == EINTR);
    if (got != 1) _exit(125);  // B is gone, or it could not write the maps (and said so)
    close(ready[0]);
    return;
  }
  close(ready[0]);
  if ((plan.ns_flags & CLONE_NEWUSER) && !write_maps(b2, plan)) {
    const int err = errno;
    kill(b2, SIGKILL);
    fail(kStageMaps, err);
  }
  if (write(ready[1], "1", 1) != 1) fail(kStageNamespaces);
  close(ready[1]);
  close(kFdCode);  // only B2 and C hold the code and the output pipes now
  close(kFdOut);
  close(kFdErr);
  close(kFdStatus);
  int st = 0;
  while (waitpid(b2, &st, 0) < 0 && errno == EINTR) {
  }
  _exit(WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
}

// The plan, from the start of its memfd.
bool read_plan(SandboxPlan& p) {
  std::string bytes;
  char buf[65536];
  if (lseek(kFdPlan, 0, SEEK_SET) != 0) return false;
  for (ssize_t n; (n = read(kFdPlan, buf, sizeof buf)) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return false;
    bytes.append(buf, n);
  }
  return p.decode(bytes);
}

}  // namespace

int main() {
  prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);  // the caller's thread gone: the whole sandbox goes
  // Default dispositions (ignored signals stay ignored across execve), then unblock (P blocked every
  // signal around the clone).
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  for (int sig = 1; sig < NSIG; ++sig) {
    if (sig != SIGKILL && sig != SIGSTOP) sigaction(sig, &dfl, nullptr);
  }
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  setsid();
  SandboxPlan plan;
  if (!read_plan(plan)) fail(kStagePlan, EINVAL);
  close(kFdPlan);
  char go = 0;
  ssize_t got;
  do {
    got = read(kFdSync, &go, 1);
  } while (got < 0 && errno == EINTR);
  if (got != 1) _exit(125);  // P gave up (or died) before letting us go
  close(kFdSync);
  if (plan.ns_flags != 0) enter_namespaces(plan);  // returns in B2, the namespaces' init
  if (plan.jail && !build_jail(plan)) fail(kStageJail);
  if (!plan.pidns) prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
  const pid_t c = fork();
  if (c == 0) interpreter_main(plan);
  if (c < 0) fail(kStageClone);
  report(kStarted, c, 0);
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
  if (plan.pidns) {
    kill(-1, SIGKILL);  // from init: everything else in the namespace
    while (waitpid(-1, nullptr, 0) > 0 || errno == EINTR) {
    }
  } else {
    kill(-c, SIGKILL);
    kill_descendants();
  }
  report(kDone, status, 0);
  return 0;
}
