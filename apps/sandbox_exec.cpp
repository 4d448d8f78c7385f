// sandbox_exec [--timeout S] [--memory-mb M] [...] < code.py: runs stdin once in the sandbox the trainer
// uses for tool calls (rollout/sandbox.h) and prints one JSON object {"stdout", "stderr", "exit_code",
// "timed_out", "truncated", "wall_ms", "isolation"}. Exit status: 0 whenever the sandbox worked, whatever
// the code did (its own status is "exit_code"); 2 for bad flags; 1 when the sandbox itself failed.
#include <CLI/CLI.hpp>
#include <iostream>
#include <iterator>
#include <sstream>
#include <string>

#include "rollout/sandbox.h"

int main(int argc, char** argv) {
  rlt::SandboxOptions options;
  CLI::App app{"sandbox_exec: run Python code from stdin in the tool-call sandbox; print one JSON result"};
  app.add_option("--timeout", options.timeout_s, "wall-clock limit, seconds")->capture_default_str();
  app.add_option("--memory-mb", options.memory_mb, "address-space limit per process, MiB")->capture_default_str();
  app.add_option("--max-output-bytes", options.max_output_bytes, "stdout and stderr bytes kept, each")
      ->capture_default_str();
  app.add_option("--max-processes", options.max_processes, "processes and threads at once")->capture_default_str();
  app.add_option("--python", options.python, "interpreter: a path or a name in PATH")->capture_default_str();
  app.add_option("--tmp-root", options.tmp_root, "root of the private working directory (default: $TMPDIR or /tmp)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);  // prints the message and the usage line
    return 2;
  }
  // The same range and cross-field checks as a `sandbox:` config section, named by their flags.
  auto flag_of = [](std::string key) {
    if (key == "timeout_s") return std::string("--timeout");
    for (char& c : key) c = c == '_' ? '-' : c;
    return "--" + key;
  };
  std::string bad;
  rlt::validate(options,
                [&](const std::string& key, const std::string& why) { bad += " " + flag_of(key) + ": " + why + ";"; });
  if (!bad.empty()) {
    std::cerr << "sandbox_exec: bad option:" << bad << "\n";
    return 2;
  }
  const std::string code{std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>()};
  try {
    const rlt::SandboxResult r = rlt::run_python(code, options);
    std::cout << r.to_json().dump() << "\n";
    return 0;
  } catch (const rlt::SandboxError& e) {
    std::cerr << "sandbox_exec: sandbox failed: " << e.what() << "\n";
    return 1;
  }
}
