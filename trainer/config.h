// The one place where configuration is read: YAML file + `--set section.key=value` overrides ->
// the options structs of every component, each field range-checked and each cross-field rule checked.
// Any problem is a ConfigError naming the key and where it came from (file:line, or the --set
// argument); apps turn it into a message on stderr and exit code 2.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include "data/chat_template.h"
#include "data/dataset.h"
#include "data/reward.h"
#include "data/synthetic.h"
#include "loss/options.h"
#include "loss/policy_loss.h"
#include "rollout/retool.h"
#include "rollout/sampler.h"
#include "rollout/sandbox.h"
#include "trainer/options.h"

namespace CLI {
class App;
}

namespace rlt {

struct Config {
  ModelOptions model;          // `model:`     checkpoint or new model, tokenizer, device, dtype
  DatasetOptions data;         // `data:`      JSONL prompts (train.prompts: jsonl)
  SyntheticOptions synthetic;  // `synthetic:` the built-in task (train.prompts: synthetic)
  ChatTemplateOptions chat;    // `chat:`      prompt framing
  SamplingOptions sampling;    // `sampling:`  temperature, top-k/p, tokens per turn, G
  RolloutOptions rollout;      // `rollout:`   the ReTool loop's limits
  SandboxOptions sandbox;      // `sandbox:`   the interpreter's limits
  RewardOptions reward;        // `reward:`    reward function
  LossOptions loss;            // `loss:`      the log-prob module (loss/logprob.h)
  PolicyLossOptions policy;    // `policy:`    the PPO/GRPO policy loss (loss/policy_loss.h)
  TrainOptions train;          // `train:`     the RL loop and its optimizer
  SftOptions sft;              // `sft:`       supervised warm-up
  PpoOptions ppo;              // `ppo:`       critic, GAE

  template <class V>
  void visit_sections(V&& v) {
    v("model", model, "checkpoint or new model, tokenizer, device, dtype");
    v("data", data, "JSONL prompt dataset");
    v("synthetic", synthetic, "the built-in multiplication task");
    v("chat", chat, "prompt template");
    v("sampling", sampling, "temperature, top-k, top-p, tokens per turn, samples per prompt");
    v("rollout", rollout, "multi-turn tool loop limits");
    v("sandbox", sandbox, "sandboxed interpreter limits");
    v("reward", reward, "reward function");
    v("loss", loss, "log-prob module: paths, row selection, chunking, entropy");
    v("policy", policy, "policy loss: clipping, KL, entropy bonus, aggregation");
    v("train", train, "RL loop, optimizer, schedule, checkpoints");
    v("sft", sft, "supervised warm-up on synthetic tool-use traces");
    v("ppo", ppo, "PPO critic and GAE");
  }
};

class ConfigError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// path may be empty (defaults + overrides only). Throws ConfigError.
Config load_config(const std::string& path, const std::vector<std::string>& overrides);

// Every field with its value in use and its documentation, as YAML (loadable by load_config).
std::string describe_config(Config config);

// Command-line plumbing shared by every app: --config FILE, --set key=value (repeatable),
// --print-config. Call add_config_flags before parsing, load_cli_config after.
struct ConfigCli {
  std::string path;
  std::vector<std::string> overrides;
  bool print = false;
};
void add_config_flags(CLI::App& app, ConfigCli& cli);
// Parses argv with CLI11. Returns -1 to continue, else the exit code to return from main (0 for
// --help, 2 for bad arguments, with the message already printed).
int parse_cli(CLI::App& app, int argc, char** argv);
// load_config + --print-config; on ConfigError prints it and returns false (the app exits with 2).
bool load_cli_config(const ConfigCli& cli, Config& out);

}  // namespace rlt
