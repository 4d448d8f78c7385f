// Files the tests read whole: a file's bytes, and a JSON file parsed.
#pragma once

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace rlt::testing {

// The file's bytes ("" when it cannot be read).
inline std::string bytes_of(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

// The file parsed as JSON (nlohmann's parse error when it is not).
inline nlohmann::json read_json(const std::filesystem::path& p) {
  std::ifstream f(p);
  return nlohmann::json::parse(f);
}

}  // namespace rlt::testing
