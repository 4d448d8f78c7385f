// YAML -> options structs through each struct's field visitor (loss/fields.h), so names, types, ranges
// and documentation are declared once, next to the field.
#include "trainer/config.h"

#include <yaml-cpp/yaml.h>

#include <nlohmann/json.hpp>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <sstream>

namespace rlt {

namespace {

[[noreturn]] void fail_at(const std::string& where, const std::string& key, const std::string& why) {
  throw ConfigError(where + ": " + key + ": " + why);
}

std::string scalar_of(const YAML::Node& node, const std::string& where, const std::string& key) {
  if (!node.IsScalar()) fail_at(where, key, "expected a single value, got a list or mapping");
  return node.Scalar();
}

void parse_value(const YAML::Node& n, bool& out, const std::string& where, const std::string& key) {
  const std::string s = scalar_of(n, where, key);
  if (s == "true" || s == "True")
    out = true;
  else if (s == "false" || s == "False")
    out = false;
  else
    fail_at(where, key, "expected true or false, got '" + s + "'");
}

void parse_value(const YAML::Node& n, int64_t& out, const std::string& where, const std::string& key) {
  const std::string s = scalar_of(n, where, key);
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || *end != '\0' || errno == ERANGE) fail_at(where, key, "expected an integer, got '" + s + "'");
  out = v;
}

void parse_value(const YAML::Node& n, double& out, const std::string& where, const std::string& key) {
  const std::string s = scalar_of(n, where, key);
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(s.c_str(), &end);
  if (s.empty() || *end != '\0' || errno == ERANGE || !std::isfinite(v)) {
    fail_at(where, key, "expected a finite number, got '" + s + "'");
  }
  out = v;
}

void parse_value(const YAML::Node& n, std::string& out, const std::string& where, const std::string& key) {
  out = scalar_of(n, where, key);
}

template <class E, class = std::enable_if_t<std::is_enum_v<E>>>
void parse_value(const YAML::Node& n, E& out, const std::string& where, const std::string& key) {
  const std::string s = scalar_of(n, where, key);
  std::string allowed;
  for (const auto& [name, v] : enum_names(E{})) {
    if (s == name) {
      out = v;
      return;
    }
    allowed += allowed.empty() ? name : std::string(" | ") + name;
  }
  fail_at(where, key, "unknown value '" + s + "' (one of: " + allowed + ")");
}

template <class T>
void check_range(const T& value, FieldRange r, const std::string& where, const std::string& key) {
  if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
    const double v = static_cast<double>(value);
    if (v < r.lo || v > r.hi) {
      std::ostringstream os;
      os << "value " << value << " out of range [" << r.lo << ", " << r.hi << "]";
      fail_at(where, key, os.str());
    }
  }
}

template <class T>
std::string format_value(const T& v) {
  if constexpr (std::is_same_v<T, bool>)
    return v ? "true" : "false";
  else if constexpr (std::is_enum_v<T>)
    return enum_to_string(v);
  else if constexpr (std::is_same_v<T, std::string>)
    return nlohmann::json(v).dump();  // a JSON string is a YAML double-quoted scalar: escapes round-trip
  else {
    std::ostringstream os;
    os.precision(17);
    os << v;
    return os.str();
  }
}

// Sets one field of a section by name.
struct FieldSetter {
  const std::string& name;
  const YAML::Node& node;
  const std::string& where;
  const std::string& key;  // "section.name" for messages
  bool found = false;
  template <class T>
  void operator()(const char* field, T& ref, const char* /*doc*/, FieldRange range = {}) {
    if (found || name != field) return;
    found = true;
    parse_value(node, ref, where, key);
    check_range(ref, range, where, key);
  }
};

struct FieldNames {
  std::string list;
  template <class T>
  void operator()(const char* field, T&, const char*, FieldRange = {}) {
    list += list.empty() ? field : std::string(", ") + field;
  }
};

struct FieldPrinter {
  std::ostream& os;
  template <class T>
  void operator()(const char* field, T& ref, const char* doc, FieldRange = {}) {
    os << "  " << field << ": " << format_value(ref) << "  # " << doc << "\n";
  }
};

class Loader {
 public:
  Config config;

  void apply(const std::string& section, const std::string& field, const YAML::Node& value, const std::string& where) {
    check_section(section, where);
    config.visit_sections([&](const char* name, auto& opts, const char*) {
      if (section != name) return;
      const std::string key = section + "." + field;
      FieldSetter setter{field, value, where, key};
      opts.visit(setter);
      if (!setter.found) {
        FieldNames names;
        opts.visit(names);
        fail_at(where, key, "unknown key (known keys in '" + section + "': " + names.list + ")");
      }
      origin_[key] = where;
    });
  }

  void check_section(const std::string& section, const std::string& where) {
    bool found = false;
    std::string sections;
    config.visit_sections([&](const char* name, auto&, const char*) {
      sections += sections.empty() ? name : std::string(", ") + name;
      found = found || section == name;
    });
    if (!found) fail_at(where, section, "unknown section (known sections: " + sections + ")");
  }

  void apply_file(const std::string& path) {
    if (!std::filesystem::exists(path)) throw ConfigError(path + ": config file not found");
    YAML::Node root;
    try {
      root = YAML::LoadFile(path);
    } catch (const YAML::Exception& e) {
      throw ConfigError(path + ":" + std::to_string(e.mark.line + 1) + ": YAML syntax error: " + e.msg);
    }
    if (root.IsNull()) return;  // an empty file: all defaults
    auto at = [&](const YAML::Node& n) { return path + ":" + std::to_string(n.Mark().line + 1); };
    if (!root.IsMap()) throw ConfigError(at(root) + ": the top level must be a mapping of sections");
    for (const auto& sec : root) {
      const std::string section = sec.first.as<std::string>();
      check_section(section, at(sec.first));
      if (sec.second.IsNull()) continue;  // `loss:` with nothing under it
      if (!sec.second.IsMap()) fail_at(at(sec.first), section, "expected a mapping of keys");
      for (const auto& kv : sec.second) apply(section, kv.first.as<std::string>(), kv.second, at(kv.first));
    }
  }

  void apply_override(const std::string& arg) {
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
    if (!value.IsDefined() || value.IsNull()) value = YAML::Node(text);
    apply(path.substr(0, dot), path.substr(dot + 1), value, where);
  }

  void check() {
    config.visit_sections([&](const char* section, auto& opts, const char*) {
      opts.check([&](const std::string& field, const std::string& why) {
        const std::string key = std::string(section) + "." + field;
        auto it = origin_.find(key);
        fail_at(it == origin_.end() ? std::string("(default)") : it->second, key, why);
      });
    });
    // Rules that span sections.
    auto fail = [&](const std::string& key, const std::string& why) {
      auto it = origin_.find(key);
      fail_at(it == origin_.end() ? std::string("(default)") : it->second, key, why);
    };
    const Config& c = config;
    if (c.train.prompts == PromptSource::kJsonl && c.data.path.empty()) {
      fail("data.path", "train.prompts is jsonl, so a JSONL file is needed");
    }
    if (c.sampling.temperature > 0 && c.loss.temperature != c.sampling.temperature) {
      fail("loss.temperature", "must equal sampling.temperature (" + format_value(c.sampling.temperature) +
                                   "): the trainer's log-probs must be those of the distribution sampled from");
    }
    if (c.policy.entropy_coef > 0 && c.loss.entropy != EntropyMode::kGrad) {
      fail("loss.entropy", "policy.entropy_coef > 0 needs loss.entropy: grad (the bonus is differentiated)");
    }
  }

 private:
  std::map<std::string, std::string> origin_;  // "section.key" -> where its value was set
};

}  // namespace

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  Loader loader;
  if (!path.empty()) loader.apply_file(path);
  for (const auto& o : overrides) loader.apply_override(o);
  loader.check();
  return loader.config;
}

std::string describe_config(Config config) {
  std::ostringstream os;
  config.visit_sections([&](const char* name, auto& opts, const char* doc) {
    os << name << ":  # " << doc << "\n";
    FieldPrinter p{os};
    opts.visit(p);
  });
  return os.str();
}

void add_config_flags(CLI::App& app, ConfigCli& cli) {
  app.add_option("--config", cli.path, "YAML config file");
  app.add_option("--set", cli.overrides, "override a config value: section.key=value (repeatable)");
  app.add_flag("--print-config", cli.print, "print every config value in use, with its documentation");
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

bool load_cli_config(const ConfigCli& cli, Config& out) {
  try {
    out = load_config(cli.path, cli.overrides);
  } catch (const ConfigError& e) {
    std::cerr << "config error: " << e.what() << "\n";
    return false;
  }
  if (cli.print) std::cout << describe_config(out);
  return true;
}

}  // namespace rlt
