// save_checkpoint / load_checkpoint; see checkpoint.h.
#include "trainer/checkpoint.h"

#include <torch/serialize.h>

#include <filesystem>
#include <fstream>

#include "common/files.h"

namespace rlt {

namespace fs = std::filesystem;

std::string checkpoint_dir(const Run& run) { return (fs::path(run.out_dir) / "checkpoint").string(); }

void save_checkpoint(Run& run) {
  const auto& extra = run.extra;
  const std::string dir = checkpoint_dir(run), tmp = dir + ".tmp", old = dir + ".old";
  remove_tree(tmp);
  fs::create_directories(tmp);
  run.policy->save((fs::path(tmp) / "model").string());
  torch::save(*run.optimizer, (fs::path(tmp) / "optimizer.pt").string());
  if (!extra.empty()) {
    torch::serialize::OutputArchive a;
    for (const auto& [name, t] : extra) a.write(name, t.detach().cpu());
    a.save_to((fs::path(tmp) / "extra.pt").string());
  }
  nlohmann::json state = {{"step", run.step},
                          {"optimizer_steps", run.optimizer_steps},
                          {"skipped_steps", run.skipped_steps},
                          {"prompts_consumed", run.prompts->consumed()}};
  {
    std::ofstream f((fs::path(tmp) / "state.json").string());
    f << state.dump(2) << "\n";
    if (!f) throw RunError(tmp + "/state.json: cannot write");
  }
  // The previous checkpoint is moved aside, not deleted, until the new one is in place.
  remove_tree(old);
  if (fs::exists(dir)) fs::rename(dir, old);
  fs::rename(tmp, dir);
  remove_tree(old);
}

void load_checkpoint(Run& run) {
  std::string dir = checkpoint_dir(run);
  if (!fs::exists(dir)) dir += ".old";  // interrupted between the two renames
  const std::string state_path = (fs::path(dir) / "state.json").string();
  std::ifstream f(state_path);
  if (!f) throw RunError(state_path + ": missing; the checkpoint is incomplete");
  nlohmann::json state;
  try {
    state = nlohmann::json::parse(f);
    run.step = state.at("step").get<int64_t>();
    run.optimizer_steps = state.at("optimizer_steps").get<int64_t>();
    run.skipped_steps = state.at("skipped_steps").get<int64_t>();
    run.prompts->seek(state.at("prompts_consumed").get<int64_t>());
  } catch (const nlohmann::json::exception& e) {
    throw RunError(state_path + ": " + e.what());
  }
  try {
    torch::load(*run.optimizer, (fs::path(dir) / "optimizer.pt").string());
    if (!run.extra.empty()) {
      torch::serialize::InputArchive a;
      a.load_from((fs::path(dir) / "extra.pt").string());
      for (auto& [name, t] : run.extra) {
        at::Tensor v;
        a.read(name, v);
        at::NoGradGuard no_grad;
        t.copy_(v);
      }
    }
  } catch (const c10::Error& e) {
    throw RunError(dir + ": cannot restore the optimizer state: " + e.what_without_backtrace());
  }
}

}  // namespace rlt
