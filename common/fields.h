// Field-visitor conventions shared by every options struct, so the YAML reader (common/config.h) can
// parse, range-check (validate() below), document and print them without a second list of names.
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
#include <sstream>
#include <string>
#include <type_traits>
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

// The one validation of an options struct: every numeric field inside its FieldRange, then the struct's
// own cross-field rules (check()). The config reader calls it on every section; code that builds options
// itself (tests, the sandbox_exec app, the loss functions' entry checks) calls it too, so a range is
// written once, next to its field, and never re-checked by hand.
template <class O>
void validate(O& options, const FieldFail& fail) {
  options.visit([&](const char* field, auto& ref, const char*, FieldRange range = {}) {
    using T = std::decay_t<decltype(ref)>;
    if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
      const double v = static_cast<double>(ref);
      if (v < range.lo || v > range.hi) {
        std::ostringstream os;
        os.precision(17);
        os << "value " << ref << " out of range [" << range.lo << ", " << range.hi << "]";
        fail(field, os.str());
      }
    }
  });
  static_cast<const O&>(options).check(fail);
}

// An options struct seen without some of its fields: an app whose section takes a value from elsewhere
// hides that field from the YAML, so the value is set in one place only (the trainer's `loss:` section
// has no temperature: the trainer scores at sampling.temperature).
template <class O>
struct FieldsWithout {
  O& options;
  std::vector<std::string> omitted;
  template <class V>
  void visit(V&& v) {
    options.visit([&](const char* field, auto& ref, const char* doc, FieldRange range = {}) {
      for (const auto& name : omitted) {
        if (name == field) return;
      }
      v(field, ref, doc, range);
    });
  }
  void check(const FieldFail& fail) const { options.check(fail); }
};

}  // namespace rlt
