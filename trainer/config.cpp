// The trainer's cross-section rules; everything else is the generic reader in common/config.h.
#include "trainer/config.h"

namespace rlt {

namespace {

void check_sections(const ConfigReader<Config>& r) {
  const Config& c = r.config;
  if (c.train.prompts == PromptSource::kJsonl && c.data.path.empty()) {
    r.fail("data.path", "train.prompts is jsonl, so a JSONL file is needed");
  }
  if (c.policy.entropy_coef > 0 && c.loss.entropy != EntropyMode::kGrad) {
    r.fail("loss.entropy", "policy.entropy_coef > 0 needs loss.entropy: grad (the bonus is differentiated)");
  }
}

}  // namespace

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  return load_config<Config>(path, overrides, check_sections);
}

bool load_cli_config(const ConfigCli& cli, Config& out) { return load_cli_config<Config>(cli, out, check_sections); }

}  // namespace rlt
