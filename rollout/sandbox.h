// The sandboxed Python interpreter that runs the policy's tool calls: each call is one `python3 -I` in a
// child process with resource limits, a private working directory, an (almost) empty environment, no
// network, and as much kernel isolation as the host allows (namespaces, a minimal read-only root, Landlock,
// seccomp, a dropped uid, pids and memory cgroups); `isolation` in the result says which were applied.
// The trainer keeps running whatever the code does. rollout/sandbox_internal.h lays out the processes of
// one call and the files that implement it.
//
// What the code sees: its private directory as cwd, HOME and TMPDIR (a tmpfs of disk_mb in the jail);
// stdin at end of file; PATH, LANG and one-thread math libraries as the whole environment. Reads: in the
// jail (a mount namespace) only the interpreter's own files (prefix, standard library, sys.path), the
// system's /usr and /lib, the loader's /etc files and five /dev nodes exist; without one, Landlock
// allows reads only there. It may write only inside its directory (and /dev/null), so no /dev/shm
// (multiprocessing's locks fail). Where the uid cannot be dropped (no jail, and the interpreter is
// reachable by root only, e.g. a pyenv under /root), chmod/chown/utime fail too (shutil.copy does;
// shutil.copyfile works).
#pragma once

#include <cstdint>
#include <future>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

#include "common/fields.h"

namespace rlt {

// The sandbox itself failed (no interpreter, no temporary directory, a setup step refused): never thrown
// for anything the sandboxed code does, which always comes back as a SandboxResult.
class SandboxError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct SandboxOptions {
  // RLIMIT_CPU, set a little above it, is a second line.
  double timeout_s = 5.0;
  // The memory cgroup counts all the call's processes and the files in its tmpfs directory. numpy and
  // sympy import in 256; 1024 leaves room for work.
  int64_t memory_mb = 1024;
  // A pids cgroup where the host lets us make one, and RLIMIT_NPROC where the call has a user namespace
  // of its own and a uid other than 0 (uid 0 is exempt from it). With neither, only the timeout bounds a
  // fork bomb.
  int64_t max_processes = 64;
  int64_t max_file_mb = 16;
  // The tmpfs also holds at most 1024 + 64 per MiB entries (files and directories). Without a jail only
  // max_file_mb bounds each file.
  int64_t disk_mb = 64;
  int64_t max_open_files = 64;
  // The rest is still read, so the child never blocks on a full pipe.
  int64_t max_output_bytes = 8192;
  int64_t workers = 4;
  // Shims (pyenv) are resolved once to the real executable (its sys.executable), since the sandbox gets
  // no environment to run them with.
  std::string python = "python3";
  std::string tmp_root;
  // false starts a call in a quarter of the time where site-packages hold many packages (10 ms against
  // 37 ms on the development machine), which is most of a tiny model's step.
  bool site_packages = true;
  // false: no jail, the fallback of hosts that refuse namespaces (to test that path, or for hosts where
  // they misbehave); rlimits, cgroups, Landlock (reads included), seccomp and the uid still apply.
  bool namespaces = true;
  // On a cgroup v1 host, moving each call's init into them costs 1 to 10 ms (an RCU grace period).
  // false leaves RLIMIT_NPROC and RLIMIT_AS.
  bool cgroups = true;
  // The trainer's decode loop launches the GPU's work from the host, so tool code competes with it for the
  // CPU. Off by default: 10 makes the 2-core CPU demo's RL steps slower (tool replies come later: more
  // decode steps), and on 16-core GPU hosts its effect stays within the runs' spread (docs/benchmarks.md,
  // design notes).
  int64_t nice = 0;
  // A call then skips the interpreter's start-up (docs/benchmarks.md, "A prestarted call and the pool");
  // its wall_ms and timeout count from its script's delivery. Costs one idle interpreter per worker.
  // run_python() always starts cold.
  bool prestart = true;

  template <class V>
  void visit(V&& v) {
    v("timeout_s", timeout_s, "wall-clock limit of one call, seconds; its whole process tree is killed at it",
      FieldRange{0.01, 3600});
    v("memory_mb", memory_mb, "memory per process (RLIMIT_AS) and per call (memory cgroup), MiB", FieldRange{16, 1e7});
    v("max_processes", max_processes, "processes and threads (python included) one call may run at once",
      FieldRange{1, 1e6});
    v("max_file_mb", max_file_mb, "largest file the code may write (RLIMIT_FSIZE), MiB; 0 = no file at all",
      FieldRange{0, 1e7});
    v("disk_mb", disk_mb, "size of the call's tmpfs directory in the jail (all its files together), MiB",
      FieldRange{1, 1e6});
    v("max_open_files", max_open_files, "open files per process (RLIMIT_NOFILE)", FieldRange{8, 1e6});
    v("max_output_bytes", max_output_bytes,
      "stdout and stderr bytes kept, each; the rest is dropped and the result marked truncated", FieldRange{1, 1e9});
    v("workers", workers, "concurrent calls in a SandboxPool", FieldRange{1, 4096});
    v("python", python, "interpreter: a path or a name in PATH");
    v("tmp_root", tmp_root, "root of the private working directories, an absolute path; empty: $TMPDIR or /tmp");
    v("site_packages", site_packages, "site-packages importable (false: python -S, stdlib only, faster start)");
    v("namespaces", namespaces, "user/pid/net/ipc/mount namespaces where the kernel allows them");
    v("cgroups", cgroups, "per-call pids and memory cgroups where they can be made");
    v("nice", nice, "added to the interpreter's niceness: tool code yields the CPU to the trainer", FieldRange{0, 19});
    v("prestart", prestart, "pool workers start their next interpreter before its call arrives");
  }
  void check(const FieldFail& fail) const {
    if (python.empty()) fail("python", "must name an interpreter");
    if (!tmp_root.empty() && tmp_root[0] != '/') fail("tmp_root", "must be an absolute path");
  }
};

struct SandboxResult {
  std::string stdout_text, stderr_text;  // each at most max_output_bytes (cut at a UTF-8 boundary)
  // The interpreter's exit status, or 128 + signal when a signal ended it (a timeout kill: 137; a C stack
  // overflow: 139). A timed-out call reports 137 even if some other signal was in flight.
  int exit_code = 0;
  bool timed_out = false;  // the wall-clock limit killed it
  bool truncated = false;  // stdout or stderr went past max_output_bytes
  // From starting the sandbox (a prestarted one: from writing the script into it) to its last process gone.
  double wall_ms = 0;
  // What was applied, '+'-joined from: userns, pidns, netns, ipcns, mountns (the minimal read-only root),
  // disk-quota (the tmpfs directory of disk_mb), setuid (ran as uid 65534), pids-cgroup, memory-cgroup
  // (memory_mb for the whole call), nproc (RLIMIT_NPROC effective), landlock (writes confined),
  // landlock-read (reads confined), seccomp. The other rlimits, the private directory and the empty
  // environment are always applied. Without mountns and landlock-read, reads are not confined (a
  // warning says so once per process).
  std::string isolation;
  // {"stdout", "stderr", "exit_code", "timed_out", "truncated", "wall_ms", "isolation"}; invalid UTF-8 in
  // the output becomes U+FFFD, so dump() never throws.
  nlohmann::json to_json() const;
};

// The program the sandboxed interpreter runs (`python -I -B -u -c <it> -`): it reads the script from stdin and
// runs it as `python -` does, then ends the process without tearing the interpreter down. Its source is
// rollout/sandbox_runner.py, embedded at build time.
const char* python_script_runner();

// Runs `code` (fed to the interpreter as its script on stdin) in a fresh sandbox and waits for it.
// Thread-safe; throws SandboxError only when the sandbox itself fails.
SandboxResult run_python(const std::string& code, const SandboxOptions& options);

// Up to options.workers run_python calls at once, each in a sandbox of its own; with options.prestart each
// worker keeps the next one started (a spare that died while it waited is replaced by a fresh sandbox for
// the call). The destructor waits for the running calls (each ends within its timeout), fails the queued
// ones with SandboxError and ends the spares.
class SandboxPool {
 public:
  explicit SandboxPool(SandboxOptions o);
  ~SandboxPool();
  SandboxPool(const SandboxPool&) = delete;
  SandboxPool& operator=(const SandboxPool&) = delete;
  std::future<SandboxResult> submit(std::string code);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace rlt
