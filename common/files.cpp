// remove_tree walks with openat/unlinkat from one descriptor, climbing back through "..", so its depth
// costs memory for names only and a symlink planted in the tree is unlinked, never followed.
#include "common/files.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>

#include <cerrno>
#include <set>
#include <vector>

namespace rlt {

void remove_tree(const std::string& path) {
  Fd cur(open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (cur.fd < 0) {
    unlink(path.c_str());
    return;
  }
  std::vector<std::string> stack;  // names from `path` down to cur
  std::set<std::string> stuck;     // relative paths we failed to enter
  auto rel = [&](const std::string& name) {
    std::string r;
    for (const auto& s : stack) r += s + "/";
    return r + name;
  };
  for (long steps = 0; steps < 10000000; ++steps) {
    std::string subdir;
    {
      DIR* d = fdopendir(dup(cur.fd));
      if (d == nullptr) break;
      while (dirent* e = readdir(d)) {
        const std::string name = e->d_name;
        if (name == "." || name == "..") continue;
        if (unlinkat(cur.fd, name.c_str(), 0) == 0) continue;
        if (errno == EACCES || errno == EPERM) {
          fchmod(cur.fd, 0700);
          if (unlinkat(cur.fd, name.c_str(), 0) == 0) continue;
        }
        if (errno == EISDIR && !stuck.count(rel(name))) {
          subdir = name;
          break;
        }
      }
      closedir(d);
    }
    if (!subdir.empty()) {
      int next = openat(cur.fd, subdir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (next < 0 && errno == EACCES && fchmodat(cur.fd, subdir.c_str(), 0700, 0) == 0) {
        next = openat(cur.fd, subdir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      }
      if (next < 0) {
        if (unlinkat(cur.fd, subdir.c_str(), AT_REMOVEDIR) != 0) stuck.insert(rel(subdir));
        continue;
      }
      stack.push_back(subdir);
      cur.reset(next);
      continue;
    }
    if (stack.empty()) break;
    // cur is as empty as we can make it: up one level (".." is the real parent, never a symlink).
    const int parent = openat(cur.fd, "..", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (parent < 0) break;
    cur.reset(parent);
    const std::string name = stack.back();
    stack.pop_back();
    if (unlinkat(cur.fd, name.c_str(), AT_REMOVEDIR) != 0) stuck.insert(rel(name));
  }
  cur.reset();
  rmdir(path.c_str());
}

}  // namespace rlt
