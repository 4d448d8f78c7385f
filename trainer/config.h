// The trainer's configuration: every component's options struct as one YAML section, read by the one
// config reader (common/config.h), plus the rules that span sections (e.g. a JSONL prompt source needs
// data.path). Apps that need fewer sections declare their own smaller struct and link no trainer code.
#pragma once

#include <string>
#include <vector>

#include "common/config.h"
#include "data/chat_template.h"
#include "data/dataset.h"
#include "data/reward.h"
#include "data/synthetic.h"
#include "loss/options.h"
#include "loss/policy_loss.h"
#include "model/lora.h"
#include "rollout/retool.h"
#include "rollout/sampler.h"
#include "rollout/sandbox.h"
#include "trainer/options.h"

namespace rlt {

struct Config {
  ModelOptions model;           // `model:`     checkpoint or new model, tokenizer, device, dtype
  LoraOptions lora;             // `lora:`      low-rank adapters instead of full fine-tuning
  DatasetOptions data;          // `data:`      JSONL prompts (train.prompts: jsonl)
  SyntheticOptions synthetic;   // `synthetic:` the built-in task (train.prompts: synthetic)
  ChatTemplateOptions chat;     // `chat:`      prompt framing
  SamplingOptions sampling;     // `sampling:`  temperature, top-k/p, tokens per turn, G
  RolloutOptions rollout;       // `rollout:`   the ReTool loop's limits
  SandboxOptions sandbox;       // `sandbox:`   the interpreter's limits
  RewardOptions reward;         // `reward:`    reward function
  LossOptions loss;             // `loss:`      the log-prob module (loss/logprob.h)
  PolicyLossOptions objective;  // `objective:` the PPO/GRPO objective: ratio, clipping, KL (loss/policy_loss.h)
  TrainOptions train;           // `train:`     the RL loop and its optimizer
  SftOptions sft;               // `sft:`       supervised warm-up
  PpoOptions ppo;               // `ppo:`       GAE, the shared value head, the value loss
  CriticOptions critic;         // `critic:`    PPO's value model: shared head or a model of its own
  LoggingOptions logging;       // `logging:`   TensorBoard event files

  // Sections read under an older name for one release, each with a one-line warning naming the new key.
  static const std::vector<std::pair<const char*, const char*>>& renamed_sections() {
    static const std::vector<std::pair<const char*, const char*>> renamed{{"policy", "objective"}};
    return renamed;
  }

  template <class V>
  void visit_sections(V&& v) {
    v("model", model, "checkpoint or new model, tokenizer, device, dtype");
    v("lora", lora, "low-rank adapters (rank > 0) instead of full fine-tuning");
    v("data", data, "JSONL prompt dataset");
    v("synthetic", synthetic, "the built-in multiplication task");
    v("chat", chat, "prompt template");
    v("sampling", sampling, "temperature, top-k, top-p, tokens per turn, samples per prompt");
    v("rollout", rollout, "multi-turn tool loop limits");
    v("sandbox", sandbox, "sandboxed interpreter limits");
    v("reward", reward, "reward function");
    // loss.temperature is sampling.temperature (make_run copies it): one value for both.
    FieldsWithout<LossOptions> loss_fields{loss, {"temperature"}};
    v("loss", loss_fields, "log-prob module: paths, row selection, chunking, entropy");
    v("objective", objective, "the objective: ratio, clipping, KL, entropy bonus, aggregation");
    v("train", train, "RL loop, optimizer, schedule, checkpoints");
    v("sft", sft, "supervised warm-up on synthetic tool-use traces");
    v("ppo", ppo, "PPO's GAE, value loss and shared value head");
    v("critic", critic, "PPO's critic: a head on the policy's trunk, or a model of its own");
    v("logging", logging, "TensorBoard event files beside metrics.jsonl");
  }
};

// Reads the trainer's sections (common/config.h) and checks the rules that span them. Throws ConfigError.
Config load_config(const std::string& path, const std::vector<std::string>& overrides);
// The files in order, each with its `defaults:` layers, then the overrides (common/config.h).
Config load_config(const std::vector<std::string>& paths, const std::vector<std::string>& overrides);
// load_config + --print-config for the trainer apps; false after printing a ConfigError (exit code 2).
bool load_cli_config(const ConfigCli& cli, Config& out);

}  // namespace rlt
