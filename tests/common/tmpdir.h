// Temporary folders for tests. Removal goes through POSIX nftw, not std::filesystem::remove_all: the
// torch wheel's libtorch.so exports its own std::filesystem symbols and the dynamic linker binds
// remove_all to that copy, which crashes (seen with torch 2.11.0 + GCC 12).
#pragma once

#include <ftw.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>

namespace rlt::testing {

inline void remove_tree(const std::filesystem::path& p) {
  nftw(
      p.c_str(), [](const char* path, const struct stat*, int, struct FTW*) { return ::remove(path); }, 16,
      FTW_DEPTH | FTW_PHYS);
}

// A fresh, empty folder unique to this process, removed when the object goes out of scope.
class TempDir {
 public:
  explicit TempDir(const std::string& tag)
      : path_(std::filesystem::temp_directory_path() / ("rlt_" + tag + "_" + std::to_string(::getpid()))) {
    remove_tree(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { remove_tree(path_); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace rlt::testing
