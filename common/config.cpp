// YAML text -> ConfigEntry lists, and the scalar parsers the reader applies to them (common/config.h).
#include "common/config.h"

#include <yaml-cpp/yaml.h>

#include <nlohmann/json.hpp>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iostream>

namespace rlt {

namespace {

[[noreturn]] void fail_at(const std::string& where, const std::string& key, const std::string& why) {
  throw ConfigError(where + ": " + key + ": " + why);
}

ConfigEntry entry_of(const std::string& section, const std::string& key, const YAML::Node& value,
                     const std::string& where) {
  ConfigEntry e{section, key, "", value.IsScalar(), where};
  if (e.scalar) e.value = value.Scalar();
  return e;
}

}  // namespace

std::vector<ConfigEntry> read_config_file(const std::string& path) {
  if (!std::filesystem::exists(path)) throw ConfigError(path + ": config file not found");
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (const YAML::Exception& e) {
    throw ConfigError(path + ":" + std::to_string(e.mark.line + 1) + ": YAML syntax error: " + e.msg);
  }
  std::vector<ConfigEntry> entries;
  if (root.IsNull()) return entries;  // an empty file: all defaults
  auto at = [&](const YAML::Node& n) { return path + ":" + std::to_string(n.Mark().line + 1); };
  if (!root.IsMap()) throw ConfigError(at(root) + ": the top level must be a mapping of sections");
  for (const auto& sec : root) {
    const std::string section = sec.first.as<std::string>();
    entries.push_back({section, "", "", false, at(sec.first)});  // the section name, checked at its own line
    if (sec.second.IsNull()) continue;                           // `loss:` with nothing under it
    if (!sec.second.IsMap()) fail_at(at(sec.first), section, "expected a mapping of keys");
    for (const auto& kv : sec.second)
      entries.push_back(entry_of(section, kv.first.as<std::string>(), kv.second, at(kv.first)));
  }
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

void print_config_error(const ConfigError& e) { std::cerr << "config error: " << e.what() << "\n"; }

}  // namespace rlt
