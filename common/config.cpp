// YAML files (with their `defaults:` layers) -> ConfigEntry lists, the scalar parsers the reader applies
// to them, the reference's markdown, and the command-line flags (common/config.h).
#include "common/config.h"

#include <yaml-cpp/yaml.h>

#include <nlohmann/json.hpp>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iostream>

namespace rlt {

namespace {

namespace fs = std::filesystem;

[[noreturn]] void fail_at(const std::string& where, const std::string& key, const std::string& why) {
  throw ConfigError(where + ": " + key + ": " + why);
}

ConfigEntry entry_of(const std::string& section, const std::string& key, const YAML::Node& value,
                     const std::string& where) {
  ConfigEntry e{section, key, "", value.IsScalar(), where};
  if (e.scalar) {
    e.value = value.Scalar();
  } else if (value.IsDefined() && !value.IsNull()) {
    YAML::Emitter out;
    out << YAML::Flow << value;
    e.value = out.c_str();
  }
  return e;
}

// The files being read, outermost first: a `defaults:` path already among them is a cycle.
struct Chain {
  std::vector<std::string> canonical, shown;
};

void read_layer(const std::string& path, Chain& chain, std::vector<ConfigEntry>& entries) {
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (const YAML::Exception& e) {
    throw ConfigError(path + ":" + std::to_string(e.mark.line + 1) + ": YAML syntax error: " + e.msg);
  }
  if (root.IsNull()) return;  // an empty file: nothing set
  auto at = [&](const YAML::Node& n) { return path + ":" + std::to_string(n.Mark().line + 1); };
  if (!root.IsMap()) throw ConfigError(at(root) + ": the top level must be a mapping of sections");
  chain.canonical.push_back(fs::weakly_canonical(path).string());
  chain.shown.push_back(path);
  // `defaults:` first, wherever it stands in the file: the file's own sections override its bases.
  for (const auto& top : root) {
    if (top.first.as<std::string>() != "defaults") continue;
    std::vector<YAML::Node> bases;
    if (top.second.IsScalar()) {
      bases.push_back(top.second);
    } else if (top.second.IsSequence()) {
      for (const auto& b : top.second) bases.push_back(b);
    }
    if (bases.empty()) fail_at(at(top.first), "defaults", "expected a path or a list of paths (relative to this file)");
    for (const auto& b : bases) {
      if (!b.IsScalar() || b.Scalar().empty()) fail_at(at(b), "defaults", "expected a path (relative to this file)");
      fs::path base = b.Scalar();
      if (base.is_relative()) base = fs::path(path).parent_path() / base;
      const std::string shown = base.lexically_normal().string();
      if (!fs::exists(shown)) fail_at(at(b), "defaults", shown + ": config file not found");
      const std::string canonical = fs::weakly_canonical(shown).string();
      for (const auto& c : chain.canonical) {
        if (c != canonical) continue;
        std::string cycle;
        for (const auto& s : chain.shown) cycle += s + " -> ";
        fail_at(at(b), "defaults", "a cycle: " + cycle + shown);
      }
      read_layer(shown, chain, entries);
    }
  }
  for (const auto& sec : root) {
    const std::string section = sec.first.as<std::string>();
    if (section == "defaults") continue;
    entries.push_back({section, "", "", false, at(sec.first)});  // the section name, checked at its own line
    if (sec.second.IsNull()) continue;                           // `loss:` with nothing under it
    if (!sec.second.IsMap()) fail_at(at(sec.first), section, "expected a mapping of keys");
    for (const auto& kv : sec.second)
      entries.push_back(entry_of(section, kv.first.as<std::string>(), kv.second, at(kv.first)));
  }
  chain.canonical.pop_back();
  chain.shown.pop_back();
}

}  // namespace

std::vector<ConfigEntry> read_config_file(const std::string& path) {
  if (!fs::exists(path)) throw ConfigError(path + ": config file not found");
  std::vector<ConfigEntry> entries;
  Chain chain;
  read_layer(path, chain, entries);
  return entries;
}

ConfigEntry read_config_override(const std::string& arg) {
  const std::string where = "--set " + arg;
  const auto eq = arg.find('=');
  if (eq == std::string::npos) throw ConfigError(where + ": expected section.key=value");
  const std::string path = arg.substr(0, eq), text = arg.substr(eq + 1);
  const auto dot = path.find('.');
  if (dot == std::string::npos || path.find('.', dot + 1) != std::string::npos) {
    throw ConfigError(where + ": the key must be section.key, got '" + path + "'");
  }
  YAML::Node value;
  try {
    value = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw ConfigError(where + ": cannot parse value: " + e.msg);
  }
  if (!value.IsDefined() || value.IsNull()) value = YAML::Node(text);  // `--set chat.system=` is ""
  return entry_of(path.substr(0, dot), path.substr(dot + 1), value, where);
}

std::vector<std::vector<std::pair<std::string, std::string>>> parse_list_items(const std::string& yaml,
                                                                               const std::string& where,
                                                                               const std::string& key) {
  std::vector<std::vector<std::pair<std::string, std::string>>> items;
  if (yaml.empty()) return items;  // `key:` with nothing: no items
  YAML::Node node;
  try {
    node = YAML::Load(yaml);
  } catch (const YAML::Exception& e) {
    fail_at(where, key, "cannot parse: " + e.msg);
  }
  if (node.IsNull()) return items;
  if (!node.IsSequence()) fail_at(where, key, "expected a list of mappings, e.g. [{kind: boxed, weight: 1}]");
  for (size_t i = 0; i < node.size(); ++i) {
    const std::string name = key + "[" + std::to_string(i) + "]";
    if (!node[i].IsMap()) fail_at(where, name, "expected a mapping of keys, e.g. {kind: boxed, weight: 1}");
    std::vector<std::pair<std::string, std::string>> item;
    for (const auto& kv : node[i]) {
      const std::string k = kv.first.as<std::string>();
      if (!kv.second.IsScalar()) fail_at(where, name + "." + k, "expected a single value");
      for (const auto& [seen, v] : item) {
        if (seen == k) fail_at(where, name + "." + k, "given twice");
      }
      item.emplace_back(k, kv.second.Scalar());
    }
    items.push_back(std::move(item));
  }
  return items;
}

void parse_field(const std::string& s, bool& out, const std::string& where, const std::string& key) {
  if (s == "true" || s == "True")
    out = true;
  else if (s == "false" || s == "False")
    out = false;
  else
    fail_at(where, key, "expected true or false, got '" + s + "'");
}

void parse_field(const std::string& s, int64_t& out, const std::string& where, const std::string& key) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || *end != '\0' || errno == ERANGE) fail_at(where, key, "expected an integer, got '" + s + "'");
  out = v;
}

void parse_field(const std::string& s, double& out, const std::string& where, const std::string& key) {
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(s.c_str(), &end);
  if (s.empty() || *end != '\0' || errno == ERANGE || !std::isfinite(v)) {
    fail_at(where, key, "expected a finite number, got '" + s + "'");
  }
  out = v;
}

void parse_field(const std::string& s, std::string& out, const std::string&, const std::string&) { out = s; }

std::string format_field(bool v) { return v ? "true" : "false"; }
std::string format_field(int64_t v) { return std::to_string(v); }
std::string format_field(double v) {
  std::ostringstream os;
  os.precision(17);
  os << v;
  return os.str();
}
std::string format_field(const std::string& v) { return nlohmann::json(v).dump(); }

std::string markdown_cell(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '|') out += '\\';
    out += c == '\n' ? ' ' : c;
  }
  return out;
}

std::string markdown_code(const std::string& text) {
  // A code span holding backticks is fenced by a longer run of them, with spaces inside.
  std::string fence = "`";
  while (text.find(fence) != std::string::npos) fence += '`';
  const std::string pad = fence.size() > 1 ? " " : "";
  return fence + pad + markdown_cell(text) + pad + fence;
}

std::string format_number(double v) {
  std::string text;
  for (int precision = 1; precision <= 17; ++precision) {
    std::ostringstream os;
    os.precision(precision);
    os << v;
    text = os.str();
    if (std::strtod(text.c_str(), nullptr) == v) break;
  }
  // 1e+09 -> 1e9, 1e-06 -> 1e-6
  const auto e = text.find('e');
  if (e == std::string::npos) return text;
  std::string exponent = text.substr(e + 1);
  const bool negative = exponent[0] == '-';
  if (exponent[0] == '+' || exponent[0] == '-') exponent.erase(0, 1);
  exponent.erase(0, std::min(exponent.find_first_not_of('0'), exponent.size() - 1));
  text = text.substr(0, e + 1) + (negative ? "-" : "") + exponent;
  // An integer keeps its digits unless the exponent form is shorter: 300, 65536, but 1e9.
  if (v == std::floor(v) && std::fabs(v) < 1e18) {
    const std::string digits = std::to_string(static_cast<long long>(v));
    if (digits.size() <= text.size()) return digits;
  }
  return text;
}

std::string reference_preamble() {
  return R"(<!-- Generated by --config-reference from the options structs, where each key's type, default,
range and description are declared beside the field: edit those, not this file. This file is the
output of `build/bin/grpo_train --config-reference > docs/config.md` (ppo_train prints the same), and
`ctest -R config_reference` fails when the two differ. -->
# Configuration reference

Every config key, by section: grpo_train and ppo_train read all of them, the other apps the sections
their `--config-reference` lists. A config is read in layers, each overriding the ones before:

1. the defaults below;
2. each `--config FILE`, in the order given. A file's `defaults:` key (a path, or a list of paths,
   relative to that file) names files read before the file itself, in the list's order;
3. each `--set section.key=value`, in the order given (the value is read as YAML).

An unknown section or key, a value of the wrong type or outside its range, and a `defaults:` cycle are
errors naming the file and line (or the `--set` argument); the app exits with code 2. `--print-config`
prints every value in use, with its description, as YAML that `--config` reads back.

A variant names its base and sets only what differs (configs/ppo_tiny.yaml is the demo with PPO):

```yaml
defaults: retool_tiny.yaml   # the demo, from this file's folder
train:
  lr: 0.0002                 # why this value
```
)";
}

void add_config_flags(CLI::App& app, ConfigCli& cli) {
  app.add_option("--config", cli.paths,
                 "YAML config file; repeatable, later files win (a file's defaults: key names files read first)")
      ->each([&cli](const std::string& path) { cli.path = path; });
  app.add_option("--set", cli.overrides, "override a config value: section.key=value (repeatable)");
  app.add_flag("--print-config", cli.print, "print every config value in use, with its documentation");
  app.add_flag_function(
      "--config-reference", [&cli](int64_t) { cli.print = cli.reference = true; },
      "print every config key with its type, default, range and description, as markdown (docs/config.md)");
}

int parse_cli(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return 2;
  }
  return -1;
}

void print_config_error(const ConfigError& e) { std::cerr << "config error: " << e.what() << "\n"; }

}  // namespace rlt
