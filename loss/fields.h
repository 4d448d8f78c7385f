// Field-visitor conventions shared by every options struct, so the YAML reader (trainer/config.cpp) can
// parse, range-check, document and print them without a second list of names.
//
// An options struct declares its fields once:
//   template <class V> void visit(V&& v) {
//     v("chunk_size", chunk_size, "rows per chunk; 0 = all rows at once", FieldRange{0, 1e9});
//   }
// and checks cross-field rules in `void check(const FieldFail& fail) const`, calling
// fail("key", "why") for each violation (the reader turns that into file:line and exit code 2).
// Supported field types: bool, int64_t, double, std::string, and enums that provide
// `enum_names(E)` returning the name table below (found by argument-dependent lookup).
#pragma once

#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace rlt {

// Inclusive range a numeric field must lie in.
struct FieldRange {
  double lo = -std::numeric_limits<double>::infinity();
  double hi = std::numeric_limits<double>::infinity();
};

template <class E>
using EnumNames = std::vector<std::pair<const char*, E>>;

// Name of an enum value from its table (the YAML spelling).
template <class E>
const char* enum_to_string(E value) {
  for (const auto& [name, v] : enum_names(E{})) {
    if (v == value) return name;
  }
  return "?";
}

using FieldFail = std::function<void(const std::string& key, const std::string& why)>;

}  // namespace rlt
