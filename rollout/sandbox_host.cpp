// What the host allows the sandbox, probed once: root or not, Landlock's ABI, the cgroup directories where
// per-call cgroups can be made, and the isolation level calls start at, moved down for good when the
// kernel refuses one. Applying them is left to the other files and to rlt-sandbox-init.
#include "rollout/sandbox_internal.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <sstream>
#include <string>

#ifndef SYS_landlock_create_ruleset
#define SYS_landlock_create_ruleset 444
#endif

namespace rlt::sandbox {

namespace {

constexpr uint32_t kLandlockCreateRulesetVersion = 1u << 0;

// The level calls start at: the first of kLevels the kernel has not refused.
std::atomic<int> g_level{0};

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

}  // namespace

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

}  // namespace rlt::sandbox
