// The one configuration reader: YAML files plus `--set section.key=value` overrides -> the options
// structs of whatever sections an app declares, through each struct's field visitor (common/fields.h),
// so names, types, ranges and documentation are declared once, next to the field. Every problem is a
// ConfigError naming the key and where its value came from (file:line, or the --set argument); apps turn
// it into a message on stderr and exit code 2.
//
// Layers, each overriding the ones before: the structs' defaults; the --config files in order, each
// preceded by the files its `defaults:` key names (a path or a list of paths, relative to that file);
// the --set overrides in order. An unknown key is an error in any layer.
//
// An app declares its sections once:
//   struct BenchConfig {
//     LossOptions loss;
//     template <class V> void visit_sections(V&& v) { v("loss", loss, "log-prob module"); }
//   };
// and reads them with load_config<BenchConfig>(paths, overrides). The trainer's Config
// (trainer/config.h) is the same thing with every section, plus the rules that span sections.
// A field is a scalar, or a list of small mappings whose keys are an options struct's own fields
// (std::vector<T>, T with visit() and check(): `reward.combine: [{kind: boxed, weight: 1}]`).
// Leaves out: other lists and nested mappings inside a section.
#pragma once

#include <cstdint>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "common/fields.h"

namespace CLI {
class App;
}

namespace rlt {

class ConfigError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// One `section.key: value` as written, before it is matched to a field. `scalar` is false for a list,
// a mapping or an empty value, which only a list field accepts: its `value` is then the node as YAML text
// ("" for an empty value).
struct ConfigEntry {
  std::string section, key, value;
  bool scalar = true;
  std::string where;  // "file.yaml:12" or "--set section.key=value"
};

// Reads a YAML file into entries (a missing file, a syntax error or a top level that is not a mapping
// of sections is a ConfigError). The order of the file is kept. A top-level `defaults:` key (a path, or
// a list of paths, relative to the file's folder) names files read first, the same way, in its order;
// a file that names itself again through `defaults:` is a ConfigError (a cycle).
std::vector<ConfigEntry> read_config_file(const std::string& path);
// Parses one `section.key=value` override (the value is read as YAML, so quotes work as in a file).
ConfigEntry read_config_override(const std::string& arg);

// Scalar parsing, one overload per field type; `where`/`key` only name the value in errors.
void parse_field(const std::string& s, bool& out, const std::string& where, const std::string& key);
void parse_field(const std::string& s, int64_t& out, const std::string& where, const std::string& key);
void parse_field(const std::string& s, double& out, const std::string& where, const std::string& key);
void parse_field(const std::string& s, std::string& out, const std::string& where, const std::string& key);
template <class E, class = std::enable_if_t<std::is_enum_v<E>>>
void parse_field(const std::string& s, E& out, const std::string& where, const std::string& key) {
  std::string allowed;
  for (const auto& [name, v] : enum_names(E{})) {
    if (s == name) {
      out = v;
      return;
    }
    allowed += allowed.empty() ? name : std::string(" | ") + name;
  }
  throw ConfigError(where + ": " + key + ": unknown value '" + s + "' (one of: " + allowed + ")");
}

// A list field's YAML text (ConfigEntry::value) as its items, each a list of (key, scalar value) pairs in
// the order written. ConfigError naming `where` and key[i] for anything but a list (or nothing) of
// mappings of scalars.
std::vector<std::vector<std::pair<std::string, std::string>>> parse_list_items(const std::string& yaml,
                                                                               const std::string& where,
                                                                               const std::string& key);

template <class T>
struct is_list_field : std::false_type {};
template <class T>
struct is_list_field<std::vector<T>> : std::true_type {};

// A list field: each item's keys are T's fields, parsed as those fields are, unknown keys refused; then
// each item's ranges and check() as validate() does, failures named key[i].field.
template <class T>
void parse_field(const std::string& yaml, std::vector<T>& out, const std::string& where, const std::string& key) {
  std::vector<T> items;
  const auto parsed = parse_list_items(yaml, where, key);
  for (size_t i = 0; i < parsed.size(); ++i) {
    T item{};
    const std::string name = key + "[" + std::to_string(i) + "]";
    for (const auto& [k, v] : parsed[i]) {
      bool found = false;
      std::string known;
      item.visit([&](const char* field, auto& ref, const char*, FieldRange = {}) {
        known += known.empty() ? field : std::string(", ") + field;
        if (k != field) return;
        found = true;
        parse_field(v, ref, where, name + "." + k);
      });
      if (!found) throw ConfigError(where + ": " + name + "." + k + ": unknown key (known keys: " + known + ")");
    }
    validate(item, [&](const std::string& field, const std::string& why) {
      throw ConfigError(where + ": " + name + "." + field + ": " + why);
    });
    items.push_back(std::move(item));
  }
  out = std::move(items);
}

// A field's value as the YAML that reads it back (strings JSON-quoted, so escapes round-trip).
std::string format_field(bool v);
std::string format_field(int64_t v);
std::string format_field(double v);
std::string format_field(const std::string& v);
template <class E, class = std::enable_if_t<std::is_enum_v<E>>>
std::string format_field(E v) {
  return enum_to_string(v);
}
// A list field in YAML's flow style: [{kind: boxed, weight: 1}, {kind: model, weight: 0.5}].
template <class T>
std::string format_field(std::vector<T> items) {
  std::string out = "[";
  for (size_t i = 0; i < items.size(); ++i) {
    out += i == 0 ? "{" : ", {";
    bool first = true;
    items[i].visit([&](const char* field, auto& ref, const char*, FieldRange = {}) {
      out += (first ? "" : ", ") + std::string(field) + ": " + format_field(ref);
      first = false;
    });
    out += "}";
  }
  return out + "]";
}

// Reads entries into a sections struct C, then runs validate() on every section (field ranges, then the
// section's own check()). `where` of a failed rule is where its key was last set, or "(default)".
template <class C>
class ConfigReader {
 public:
  C config;

  // An entry of a section that C::renamed_sections() lists under its old name is read as the new one,
  // with a warning on stderr naming the new key (also kept in warnings()).
  void apply(ConfigEntry e) {
    if constexpr (has_renamed_sections<C>::value) {
      for (const auto& [old_name, new_name] : C::renamed_sections()) {
        if (e.section != old_name) continue;
        e.section = new_name;
        if (e.key.empty()) continue;  // the section's own line: its keys warn
        warnings_.push_back(e.where + ": " + old_name + "." + e.key + " is " + new_name + "." + e.key + " (" +
                            old_name + ".* is read for one release)");
        std::cerr << "warning: " << warnings_.back() << "\n";
      }
    }
    bool section_found = false;
    std::string sections;
    config.visit_sections([&](const char* name, auto& opts, const char*) {
      sections += sections.empty() ? name : std::string(", ") + name;
      if (e.section != name) return;
      section_found = true;
      if (e.key.empty()) return;  // the section name itself (its keys follow as their own entries)
      const std::string key = e.section + "." + e.key;
      bool found = false;
      std::string known;
      opts.visit([&](const char* field, auto& ref, const char*, FieldRange = {}) {
        known += known.empty() ? field : std::string(", ") + field;
        if (found || e.key != field) return;
        found = true;
        if (!e.scalar && !is_list_field<std::decay_t<decltype(ref)>>::value) {
          throw ConfigError(e.where + ": " + key +
                            ": expected a single value, got a list, a mapping or nothing (write \"\" for an "
                            "empty string)");
        }
        parse_field(e.value, ref, e.where, key);
      });
      if (!found)
        throw ConfigError(e.where + ": " + key + ": unknown key (known keys in '" + e.section + "': " + known + ")");
      origin_[key] = e.where;
    });
    if (!section_found) {
      throw ConfigError(e.where + ": " + e.section + ": unknown section (known sections: " + sections + ")");
    }
  }

  // The renamed keys read so far, one line each.
  const std::vector<std::string>& warnings() const { return warnings_; }

  // Where `section.key` was set, for messages about it.
  std::string origin(const std::string& key) const {
    auto it = origin_.find(key);
    return it == origin_.end() ? std::string("(default)") : it->second;
  }
  [[noreturn]] void fail(const std::string& key, const std::string& why) const {
    throw ConfigError(origin(key) + ": " + key + ": " + why);
  }

  void validate_sections() {
    config.visit_sections([&](const char* section, auto& opts, const char*) {
      validate(opts, [&](const std::string& field, const std::string& why) {
        fail(std::string(section) + "." + field, why);
      });
    });
  }

 private:
  template <class T, class = void>
  struct has_renamed_sections : std::false_type {};
  template <class T>
  struct has_renamed_sections<T, std::void_t<decltype(T::renamed_sections())>> : std::true_type {};

  std::map<std::string, std::string> origin_;  // "section.key" -> where its value was last set
  std::vector<std::string> warnings_;
};

// The files apply in order, then the overrides; later ones win. No files: defaults + overrides only.
// `cross_check` sees the validated config and reports rules that span sections through
// reader.fail(key, why). Throws ConfigError.
template <class C>
C load_config(const std::vector<std::string>& paths, const std::vector<std::string>& overrides,
              const std::function<void(const ConfigReader<C>&)>& cross_check = {}) {
  ConfigReader<C> reader;
  for (const auto& path : paths) {
    for (const auto& e : read_config_file(path)) reader.apply(e);
  }
  for (const auto& o : overrides) reader.apply(read_config_override(o));
  reader.validate_sections();
  if (cross_check) cross_check(reader);
  return reader.config;
}
// One file, or none when path is empty.
template <class C>
C load_config(const std::string& path, const std::vector<std::string>& overrides,
              const std::function<void(const ConfigReader<C>&)>& cross_check = {}) {
  return load_config<C>(path.empty() ? std::vector<std::string>{} : std::vector<std::string>{path}, overrides,
                        cross_check);
}

// Every field with its value in use and its documentation, as YAML (loadable by load_config).
template <class C>
std::string describe_config(C config) {
  std::ostringstream os;
  config.visit_sections([&](const char* name, auto& opts, const char* doc) {
    os << name << ":  # " << doc << "\n";
    opts.visit([&](const char* field, auto& ref, const char* field_doc, FieldRange = {}) {
      os << "  " << field << ": " << format_field(ref) << "  # " << field_doc << "\n";
    });
  });
  return os.str();
}

// Markdown helpers of describe_reference.
std::string markdown_cell(const std::string& text);  // `|` escaped, so a table cell holds it
std::string markdown_code(const std::string& text);  // a code span (escaped for a table cell)
std::string format_number(double v);                 // the shortest text that reads back as v: 1e9, 0.2
inline const char* field_type(bool) { return "bool"; }
inline const char* field_type(int64_t) { return "integer"; }
inline const char* field_type(double) { return "number"; }
inline const char* field_type(const std::string&) { return "string"; }
template <class E, class = std::enable_if_t<std::is_enum_v<E>>>
const char* field_type(E) {
  return "enum";
}
template <class T>
const char* field_type(const std::vector<T>&) {
  return "list";
}

// The text above the sections of describe_reference: how files, `defaults:` and --set combine.
std::string reference_preamble();

// The reference of a sections struct, as markdown: per section a table of every key with its type,
// default, allowed values (a numeric range, or an enum's names) and documentation. The defaults are C{}'s,
// whatever the files and overrides say; docs/config.md is the trainers' reference.
template <class C>
std::string describe_reference() {
  C defaults{};
  std::ostringstream toc, body;
  defaults.visit_sections([&](const char* name, auto& opts, const char* doc) {
    toc << "- [" << name << "](#" << name << "): " << markdown_cell(doc) << "\n";
    body << "\n## " << name << "\n\n"
         << doc << "\n\n"
         << "| key | type | default | allowed | description |\n|---|---|---|---|---|\n";
    opts.visit([&](const char* field, auto& ref, const char* field_doc, FieldRange range = {}) {
      using T = std::decay_t<decltype(ref)>;
      std::string allowed;
      if constexpr (std::is_enum_v<T>) {
        for (const auto& [value, e] : enum_names(T{})) allowed += (allowed.empty() ? "" : ", ") + markdown_code(value);
      } else if constexpr (is_list_field<T>::value) {
        typename T::value_type item{};
        item.visit([&](const char* key, auto&, const char*, FieldRange = {}) {
          allowed += (allowed.empty() ? "items of " : ", ") + markdown_code(key);
        });
      } else if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
        const bool has_lo = range.lo > -std::numeric_limits<double>::infinity();
        const bool has_hi = range.hi < std::numeric_limits<double>::infinity();
        if (has_lo && has_hi)
          allowed = format_number(range.lo) + " to " + format_number(range.hi);
        else if (has_lo)
          allowed = ">= " + format_number(range.lo);
        else if (has_hi)
          allowed = "<= " + format_number(range.hi);
        else
          allowed = "any";
      }
      std::string value;
      if constexpr (std::is_same_v<T, double>)
        value = format_number(ref);  // 0.2, where --print-config writes every digit (0.20000000000000001)
      else
        value = format_field(ref);
      body << "| " << markdown_code(std::string(name) + "." + field) << " | " << field_type(ref) << " | "
           << markdown_code(value) << " | " << allowed << " | " << markdown_cell(field_doc) << " |\n";
    });
  });
  return reference_preamble() + "\n## Sections\n\n" + toc.str() + body.str();
}

// Command-line plumbing shared by every app: --config FILE (repeatable), --set key=value (repeatable),
// --print-config, --config-reference. Call add_config_flags before parsing, load_cli_config after.
struct ConfigCli {
  std::vector<std::string> paths;  // the --config files, in order
  std::string path;                // the last of them ("" without one): apps name their output after it
  std::vector<std::string> overrides;
  bool print = false;      // print something, then exit: --print-config or --config-reference
  bool reference = false;  // --config-reference: the markdown reference instead of the values in use
};
void add_config_flags(CLI::App& app, ConfigCli& cli);
// Parses argv with CLI11. Returns -1 to continue, else the exit code to return from main (0 for
// --help, 2 for bad arguments, with the message already printed).
int parse_cli(CLI::App& app, int argc, char** argv);
// Prints "config error: ..." to stderr.
void print_config_error(const ConfigError& e);

// load_config + --print-config / --config-reference; on ConfigError prints it and returns false (the
// app exits with 2).
template <class C>
bool load_cli_config(const ConfigCli& cli, C& out,
                     const std::function<void(const ConfigReader<C>&)>& cross_check = {}) {
  try {
    out = load_config<C>(cli.paths, cli.overrides, cross_check);
  } catch (const ConfigError& e) {
    print_config_error(e);
    return false;
  }
  if (cli.reference)
    std::cout << describe_reference<C>();
  else if (cli.print)
    std::cout << describe_config(out);
  return true;
}

}  // namespace rlt
