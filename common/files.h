// Small POSIX file helpers every folder shares: a descriptor that closes itself, and a tree removal that
// survives hostile trees (the sandbox's call directories) and does not go through std::filesystem's
// remove_all (the torch wheel's libtorch.so exports its own std::filesystem symbols; remove_all bound to
// that copy crashed with torch 2.11.0 + GCC 12).
#pragma once

#include <unistd.h>

#include <string>
#include <utility>

namespace rlt {

// RAII for one file descriptor (-1 = none).
struct Fd {
  int fd = -1;
  Fd() = default;
  explicit Fd(int f) : fd(f) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  void reset(int f = -1) {
    if (fd >= 0) close(fd);
    fd = f;
  }
  int release() { return std::exchange(fd, -1); }
};

// Removes the directory tree (or file) at `path`, never following a symlink anywhere in it and without
// an open descriptor per level (code may nest directories thousands deep). Entries it cannot remove
// (a non-root caller meeting a mode-000 directory it cannot fix) are left and the walk goes on. A
// missing path is not an error.
void remove_tree(const std::string& path);

}  // namespace rlt
