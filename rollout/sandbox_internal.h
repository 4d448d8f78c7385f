// What the sandbox's source files share: the isolation levels, the host's probe, the seccomp variants, the
// resolved interpreter, and one call's files, launch and supervision. Internal to rlt_rollout (callers use
// rollout/sandbox.h); what B and C do with the plan is rlt-sandbox-init's (sandbox_init.cpp, sandbox_plan.h).
//
// One call is four processes:
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
//
// The files, one job each: sandbox_host.cpp (what the host allows, the level calls start at),
// sandbox_seccomp.cpp (the syscall filter), sandbox_cgroup.cpp (per-call pids and memory cgroups),
// sandbox_interpreter.cpp (the interpreter, its read paths and command line), sandbox_runner.py (the
// program it runs, embedded at build time), sandbox_spawn.cpp (a call's files and plan, and B's start),
// sandbox_supervise.cpp (a call watched to its end; run_python), sandbox_pool.cpp (SandboxPool, spares).
#pragma once

#include "common/files.h"
#include "rollout/sandbox.h"
#include "rollout/sandbox_plan.h"

#include <linux/filter.h>
#include <sched.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

namespace rlt::sandbox {

using Clock = std::chrono::steady_clock;

inline std::string errno_text(int err) { return std::strerror(err); }

// ---------------------------------------------------------------------------------------------------
// The host (sandbox_host.cpp).

// Levels, strongest first. The first call tries level 0 and moves down (for good: the result is kept in
// g_level) when the kernel refuses it; levels without a user namespace need CAP_SYS_ADMIN, so only root
// tries them. `jail`: a mount namespace with a minimal read-only root and a tmpfs working directory.
struct Level {
  int ns_flags;
  bool jail;
  bool root_only;
};
inline constexpr Level kLevels[] = {
    {CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWNS, true, false},
    {CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWNS, true, true},
    {CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC, false, false},
    {CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC, false, true},
    {0, false, false},
};
constexpr int kNumLevels = sizeof(kLevels) / sizeof(kLevels[0]);

// What the host offers, probed once.
struct Host {
  bool root = false;
  int landlock_abi = 0;    // 0: no Landlock
  std::string pids_dir;    // our cgroup directory with the pids controller, where per-call cgroups are made
  std::string memory_dir;  // the same for the memory controller (v1: another hierarchy; v2: the same dir)
  bool memory_v1 = false;  // memory.limit_in_bytes (v1) rather than memory.max (v2)
};
const Host& host();

// The level a call tries first (an index into kLevels), and the move down for good once it was refused.
int first_level(const SandboxOptions& o);
void level_refused(int level);

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

// The BPF program of a variant, built on first use (empty when libseccomp failed: no seccomp then).
const std::vector<sock_filter>& seccomp_program(const SeccompVariant& v);

// ---------------------------------------------------------------------------------------------------
// The interpreter (sandbox_interpreter.cpp).

// The interpreter, resolved once per (python, tmp root, namespaces): the real executable, the host paths
// it reads (kSystemReadPaths, its prefixes and sys.path), and whether the sandbox can run it as
// kSandboxUid (only asked when we are root).
struct Interpreter {
  std::string exe;
  std::vector<std::string> read_paths;
  bool drop_uid = false;
};

// SandboxOptions::tmp_root, else $TMPDIR, else /tmp.
std::string tmp_root_of(const SandboxOptions& o);
// The interpreter of `o`, probed on first use and cached.
Interpreter interpreter_for(const SandboxOptions& o);
// Sets the plan's exe, argv (the runner with its flags) and environment.
void make_command(SandboxPlan& plan, const SandboxOptions& o, const std::string& exe, const std::string& dir);

// ---------------------------------------------------------------------------------------------------
// One call (its files: sandbox_spawn.cpp; its cgroups: sandbox_cgroup.cpp; its supervision:
// sandbox_supervise.cpp).

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

// Per-call cgroups (sandbox_cgroup.cpp).
void remove_stale_cgroups(const std::string& dir);
void make_cgroups(CallFiles& f, const Host& h, const SandboxOptions& o, const Level& level);
bool join_cgroups(const CallFiles& f, pid_t b);

// The rlt-sandbox-init executable (B's program).
const std::string& init_path();

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

// Makes a call's files and starts B (sandbox_spawn.cpp); `code` null: a spare, its script comes later.
std::unique_ptr<Launched> launch(const std::string* code, const SandboxOptions& o, const Interpreter& in,
                                 const Level& level);
// One read of B's status pipe into `w`; true at its end.
bool read_reports(Fd& status_r, Watch& w);
// Supervises a launched call to its end; false when the kernel refused its level (sandbox_supervise.cpp).
bool finish(Launched& l, const SandboxOptions& o, const Interpreter& in, Clock::time_point t0, SandboxResult& result);
// Runs `code` at the first level the kernel accepts.
SandboxResult run_levels(const std::string& code, const SandboxOptions& o, const Interpreter& in);
// Throws SandboxError naming every bad option.
void validate(const SandboxOptions& options);

}  // namespace rlt::sandbox
