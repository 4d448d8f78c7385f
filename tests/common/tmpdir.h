// Temporary folders for tests, removed with common/files.h's remove_tree (not std::filesystem::remove_all:
// see there why).
#pragma once

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "common/files.h"

namespace rlt::testing {

inline void remove_tree(const std::filesystem::path& p) { rlt::remove_tree(p.string()); }

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
