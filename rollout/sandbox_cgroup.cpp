// The per-call pids and memory cgroups (root only): taken from the idle ones or made, limited, joined by
// B, emptied and given back. Finding the cgroup directories is sandbox_host.cpp's; the rlimits that stand
// in where no cgroup can be made are rlt-sandbox-init's.
#include "rollout/sandbox_internal.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <thread>

namespace rlt::sandbox {

namespace {

// Cleared when a per-call cgroup turns out to lack the controller (v2 without delegation).
std::atomic<bool> g_pids_cgroup_ok{true}, g_memory_cgroup_ok{true};

void write_file(const std::string& path, const std::string& text) {
  Fd fd(open(path.c_str(), O_WRONLY | O_CLOEXEC));
  if (fd.fd < 0) throw SandboxError("open " + path + ": " + errno_text(errno));
  if (write(fd.fd, text.data(), text.size()) != ssize_t(text.size())) {
    throw SandboxError("write " + path + ": " + errno_text(errno));
  }
}

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

}  // namespace

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

}  // namespace rlt::sandbox
