// train_main; see app.h.
#include "trainer/app.h"

#include <CLI/CLI.hpp>
#include <filesystem>
#include <iostream>

#include "model/config.h"
#include "model/safetensors.h"
#include "rollout/sandbox.h"

namespace rlt {

int train_main(int argc, char** argv, const std::string& name, const std::string& about, const TrainFn& train,
               const ExtraParams& extra) {
  CLI::App app{name + ": " + about};
  ConfigCli cc;
  add_config_flags(app, cc);
  std::string out;
  bool resume = false;
  app.add_option("--out", out, "run folder: metrics.jsonl, plot.svg, checkpoint/ (default runs/<config name>)");
  app.add_flag("--resume", resume, "continue from the run folder's checkpoint");
  int64_t stop_after = 0;
  app.add_option("--stop-after", stop_after, "checkpoint and exit once this many RL steps are done (0 = run all)")
      ->check(CLI::NonNegativeNumber);
  if (int rc = parse_cli(app, argc, argv); rc >= 0) return rc;
  Config cfg;
  if (!load_cli_config(cc, cfg)) return 2;
  if (cc.print) return 0;
  if (out.empty()) {
    out = "runs/" + (cc.path.empty() ? name : std::filesystem::path(cc.path).stem().string());
  }
  try {
    Run run = make_run(cfg, out, resume, extra);
    run.stop_after = stop_after;
    if (resume) std::cerr << name << ": resuming " << out << " at step " << run.step << "\n";
    train(run);
    std::cerr << name << ": done; metrics in " << out << "/metrics.jsonl, plot in " << out << "/plot.svg\n";
    return 0;
  } catch (const ConfigError& e) {
    std::cerr << name << ": config error: " << e.what() << "\n";
  } catch (const RunError& e) {
    std::cerr << name << ": " << e.what() << "\n";
  } catch (const DataError& e) {
    std::cerr << name << ": data error: " << e.what() << "\n";
  } catch (const ModelConfigError& e) {
    std::cerr << name << ": model config error: " << e.what() << "\n";
  } catch (const safetensors::Error& e) {
    std::cerr << name << ": checkpoint error: " << e.what() << "\n";
  } catch (const SandboxError& e) {  // the machine, not the input: python3 missing, no fork
    std::cerr << name << ": sandbox error: " << e.what() << "\n";
    return 1;
  } catch (const std::filesystem::filesystem_error& e) {  // e.g. an --out folder that cannot be written
    std::cerr << name << ": " << e.what() << "\n";
  } catch (const c10::Error& e) {  // a broken invariant inside the trainer: a bug, not bad input
    std::cerr << name << ": internal error: " << e.what_without_backtrace() << "\n";
    return 1;
  }
  return 2;
}

}  // namespace rlt
