// Starting one call: its private directory, descriptors and cgroups, the plan B follows, and B itself,
// cloned with CLONE_VM | CLONE_VFORK straight into rlt-sandbox-init. Watching the call run is
// sandbox_supervise.cpp's.
#include "rollout/sandbox_internal.h"

#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>

#ifndef SYS_close_range
#define SYS_close_range 436
#endif

namespace rlt::sandbox {

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

namespace {

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

}  // namespace

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

}  // namespace rlt::sandbox
