// What the trainer (P) hands the sandbox's init process (B, the rlt-sandbox-init executable) for one
// call, and the reports B sends back. Shared by the trainer's side (rollout/sandbox_internal.h) and
// rollout/sandbox_init.cpp; the plan travels as bytes in a memfd (SandboxPlan::encode / decode), the
// reports as fixed-size records on a pipe. Both ends are built from the same tree, so the format has no versioning.
#pragma once

#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace rlt::sandbox {

// Descriptor numbers in B and C: P arranges them before B's execve.
constexpr int kFdCode = 0, kFdOut = 1, kFdErr = 2, kFdStatus = 3, kFdSync = 4, kFdPlan = 5, kNumChildFds = 6;

// The uid/gid a call drops to when the caller is root and the interpreter is reachable by it.
constexpr uint32_t kSandboxUid = 65534, kSandboxGid = 65534;

// Reports on the status pipe (atomic writes: smaller than PIPE_BUF).
enum ReportKind : int32_t { kFailed = 1, kStarted = 2, kDone = 3 };
struct Report {
  int32_t kind, a, b;  // kFailed: stage, errno; kStarted: C's pid (as B sees it); kDone: C's wait status
};
// One record to `fd` (async-signal-safe: B's side of P's clone uses it before the execve).
inline void write_report(int fd, const Report& r) {
  ssize_t n;
  do {
    n = write(fd, &r, sizeof r);
  } while (n < 0 && errno == EINTR);
}

// Where a setup step failed (kFailed's a). Steps before kStageExec ran no sandboxed code; kStageNamespaces,
// kStageMaps and kStageJail failing mean this kernel refuses the level's namespaces, their uid maps or the
// mount namespace's root, so the caller moves to the next level.
enum Stage : int32_t {
  kStageFds,
  kStageInit,
  kStagePlan,
  kStageSync,
  kStageNamespaces,
  kStageMaps,
  kStageJail,
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
inline const char* stage_name(int32_t s) {
  static const char* names[] = {"arranging descriptors",
                                "starting rlt-sandbox-init",
                                "reading the plan",
                                "waiting for the caller",
                                "making the namespaces",
                                "writing the uid maps",
                                "building the read-only root",
                                "starting the interpreter",
                                "entering the working directory",
                                "setting resource limits",
                                "dropping capabilities",
                                "dropping to the sandbox uid",
                                "prctl",
                                "applying Landlock",
                                "installing the seccomp filter",
                                "executing the interpreter"};
  return s >= 0 && s < int32_t(sizeof(names) / sizeof(names[0])) ? names[s] : "?";
}

struct SandboxPlan {
  // The namespaces B makes (clone flags); with CLONE_NEWUSER, B maps uid and gid 0 of the new namespace to
  // map_uid / map_gid, and with map_sandbox_ids (root only) kSandboxUid / kSandboxGid to themselves.
  int64_t ns_flags = 0;
  int64_t map_uid = 0, map_gid = 0;
  bool map_sandbox_ids = false;
  std::string exe;                        // the interpreter, an absolute path
  std::vector<std::string> argv, envp;    // its arguments (argv[0] included) and whole environment
  std::string workdir;                    // the call's private directory (the same path inside the jail)
  int64_t cpu_soft = 0, cpu_hard = 0;     // RLIMIT_CPU, seconds
  int64_t as = 0, fsize = 0, nofile = 0;  // RLIMIT_AS and RLIMIT_FSIZE (bytes), RLIMIT_NOFILE
  int64_t nproc = 0;                      // RLIMIT_NPROC, applied when set_nproc
  int64_t nice = 0;                       // added to C's niceness (nice(2)) before the execve
  bool set_nproc = false;
  bool drop_uid = false;  // C runs as kSandboxUid
  bool pidns = false;     // B is pid 1 of a pid namespace (else a subreaper)
  // jail: B is in a mount namespace of its own and builds a read-only root of read_paths, a few /dev
  // nodes and a tmpfs of disk_bytes (and disk_inodes entries) at workdir, owned by work_uid/work_gid as
  // the namespace sees them.
  bool jail = false;
  int64_t disk_bytes = 0, disk_inodes = 0;
  int64_t work_uid = 0, work_gid = 0;
  // Landlock ABI (0: none): writes only inside workdir (and to /dev/null); with landlock_read, reads and
  // execution only beneath read_paths, the /dev nodes and workdir.
  int64_t landlock_abi = 0;
  bool landlock_read = false;
  std::vector<std::string> read_paths;  // absolute; a symlink among them is recreated, not followed
  std::string seccomp;                  // a BPF program (sock_filter array), empty: none

  std::string encode() const {
    std::string out;
    auto put_str = [&](const std::string& s) {
      const uint64_t n = s.size();
      out.append(reinterpret_cast<const char*>(&n), sizeof n);
      out += s;
    };
    auto put_int = [&](int64_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof v); };
    auto put_list = [&](const std::vector<std::string>& l) {
      put_int(static_cast<int64_t>(l.size()));
      for (const auto& s : l) put_str(s);
    };
    put_int(ns_flags), put_int(map_uid), put_int(map_gid), put_int(map_sandbox_ids), put_str(exe), put_list(argv),
        put_list(envp), put_str(workdir);
    for (int64_t v :
         {cpu_soft, cpu_hard, as, fsize, nofile, nproc, nice, int64_t(set_nproc), int64_t(drop_uid), int64_t(pidns),
          int64_t(jail), disk_bytes, disk_inodes, work_uid, work_gid, landlock_abi, int64_t(landlock_read)}) {
      put_int(v);
    }
    put_list(read_paths), put_str(seccomp);
    return out;
  }

  // False when `bytes` is not a whole plan.
  bool decode(const std::string& bytes) {
    size_t at = 0;
    bool ok = true;
    auto get_int = [&]() -> int64_t {
      int64_t v = 0;
      if (!ok || bytes.size() - at < sizeof v) return ok = false, 0;
      std::memcpy(&v, bytes.data() + at, sizeof v);
      at += sizeof v;
      return v;
    };
    auto get_str = [&]() -> std::string {
      const uint64_t n = static_cast<uint64_t>(get_int());
      if (!ok || bytes.size() - at < n) return ok = false, std::string();
      std::string s = bytes.substr(at, n);
      at += n;
      return s;
    };
    auto get_list = [&]() {
      std::vector<std::string> l;
      const int64_t n = get_int();
      for (int64_t i = 0; ok && i < n; ++i) l.push_back(get_str());
      return l;
    };
    ns_flags = get_int(), map_uid = get_int(), map_gid = get_int(), map_sandbox_ids = get_int();
    exe = get_str(), argv = get_list(), envp = get_list(), workdir = get_str();
    cpu_soft = get_int(), cpu_hard = get_int(), as = get_int(), fsize = get_int(), nofile = get_int();
    nproc = get_int(), nice = get_int(), set_nproc = get_int(), drop_uid = get_int(), pidns = get_int(),
    jail = get_int();
    disk_bytes = get_int(), disk_inodes = get_int(), work_uid = get_int(), work_gid = get_int();
    landlock_abi = get_int(), landlock_read = get_int();
    read_paths = get_list(), seccomp = get_str();
    return ok && at == bytes.size();
  }
};

}  // namespace rlt::sandbox
