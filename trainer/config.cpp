// The trainer's cross-section rules; everything else is the generic reader in common/config.h.
#include "trainer/config.h"

#include <filesystem>

#include "model/config.h"
#include "rollout/python_reward.h"
#include "rollout/reward_model.h"

namespace rlt {

namespace {

// critic.shared false: what a critic of its own needs, and its folder (critic.path, made absolute like the
// reward model's) read before anything loads.
template <class Absolute>
void check_critic(const ConfigReader<Config>& r, const Absolute& absolute) {
  const Config& c = r.config;
  if (c.critic.init == CriticInit::kRewardModel && c.reward.model_path.empty()) {
    r.fail("critic.init", "reward_model starts the critic from reward.model_path, which is empty");
  }
  const ShardStage stage = c.critic.stage(c.train.shard);
  if (stage == ShardStage::kParameters && !c.model.activation_checkpointing) {
    r.fail("critic.shard",
           "parameters gathers each layer again for its backward: set model.activation_checkpointing: true");
  }
  if (stage == ShardStage::kParameters && c.model.checkpoint_layers >= 0) {
    r.fail("model.checkpoint_layers", "a critic sharded at parameters recomputes every layer: leave it at -1");
  }
  if (stage != ShardStage::kNone && c.train.master_weights == MasterWeights::kNone &&
      c.model.dtype == DType::kBFloat16) {
    r.fail("train.master_weights", "a sharded critic (critic.shard) always keeps fp32 masters");
  }
  if (c.critic.init != CriticInit::kPath) return;
  const std::string dir = absolute("critic.path", c.critic.path);
  try {
    const ModelConfig mc = load_model_config(dir);
    if (mc.head != ModelHead::kCausalLm && mc.num_labels != 1) {
      r.fail("critic.path", dir + " is a " + mc.architecture + " of " + std::to_string(mc.num_labels) +
                                " labels (id2label): a critic's head has one output");
    }
  } catch (const ModelConfigError& e) {
    r.fail("critic.path", e.what());
  }
  const_cast<Config&>(c).critic.path = dir;
}

void check_sections(const ConfigReader<Config>& r) {
  const Config& c = r.config;
  if (c.train.prompts == PromptSource::kJsonl && c.data.path.empty()) {
    r.fail("data.path", "train.prompts is jsonl, so a JSONL file is needed");
  }
  if (c.objective.entropy_coef > 0 && c.loss.entropy != EntropyMode::kGrad) {
    r.fail("loss.entropy", "objective.entropy_coef > 0 needs loss.entropy: grad (the bonus is differentiated)");
  }
  // TIS and IcePop weigh each token by rho = exp(logprobs_old - logprobs_rollout): with the rollout's own
  // log-probs as the old ones, rho is 1 and the correction would silently do nothing.
  const bool corrects = c.objective.tis != 0 || c.objective.icepop_low != 0 || c.objective.icepop_high != 0;
  if (corrects && c.train.old_logprobs == OldLogprobs::kRollout) {
    r.fail("train.old_logprobs",
           "objective.tis / objective.icepop_* correct the rollout's log-probs against recomputed ones: set "
           "train.old_logprobs: recompute (with rollout, rho = 1)");
  }
  // A layer's weights are gathered for its forward and freed after it, and gathered again for its backward:
  // only a layer recomputed in the backward holds no weights between the two.
  if (c.train.shard == ShardStage::kParameters && !c.model.activation_checkpointing) {
    r.fail("train.shard",
           "parameters gathers each layer again for its backward: set model.activation_checkpointing: true");
  }
  if (c.train.shard == ShardStage::kParameters && c.model.checkpoint_layers >= 0) {
    r.fail("model.checkpoint_layers", "train.shard parameters recomputes every layer: leave it at -1");
  }
  const bool sharded = c.train.shard != ShardStage::kNone || c.train.offload != Offload::kNone;
  if (sharded && c.train.master_weights == MasterWeights::kNone && c.model.dtype == DType::kBFloat16) {
    r.fail("train.master_weights", "the sharded state (train.shard, train.offload) always keeps fp32 masters");
  }
  // The warm-up trains the model's weights with an AdamW of its own: whole weights, and no fp32 masters
  // for a bf16 model outside the replicated optimizer.
  if (sharded && c.sft.steps > 0 && (c.train.shard == ShardStage::kParameters || c.model.dtype != DType::kFloat32)) {
    r.fail("sft.steps",
           "the warm-up trains whole weights in place: with train.shard parameters, or a bf16 model with "
           "train.shard / train.offload, run it apart (sft.steps: 0)");
  }
  // The leave-one-out baseline of a lone sample is the mean of no other sample.
  if (c.train.advantage == Advantage::kRloo && c.sampling.samples_per_prompt < 2) {
    r.fail("sampling.samples_per_prompt", "train.advantage rloo needs at least 2 samples per prompt");
  }
  // One sample per prompt is a group of one: its rewards are always equal, so every group would be dropped.
  if (c.train.dynamic_sampling && c.sampling.samples_per_prompt < 2) {
    r.fail("train.dynamic_sampling", "drops groups of equal rewards: it needs sampling.samples_per_prompt >= 2");
  }
  // A partial rollout's unfinished groups wait for the next step's rollout: only a rollout running beside
  // the update has one that overlaps. Dynamic sampling draws its rounds whole, with no carry between them.
  if (c.rollout.partial && c.train.async != AsyncMode::kOneStep) {
    r.fail("rollout.partial", "continues unfinished groups in the next step's rollout: set train.async: one_step");
  }
  // Carried groups come first in the next rollout's batch: with no more of them than a step takes, each is
  // returned by the next rollout, and no token trains more than max_staleness versions behind the update.
  if (c.rollout.partial && c.rollout.partial_extra_prompts > c.train.prompts_per_step) {
    r.fail("rollout.partial_extra_prompts", "at most train.prompts_per_step (" +
                                                std::to_string(c.train.prompts_per_step) +
                                                "): a carried group must fit the next step's batch");
  }
  if (c.rollout.partial && c.train.dynamic_sampling) {
    r.fail("rollout.partial", "is not built with train.dynamic_sampling (its rounds draw whole groups)");
  }
  // A partial rollout's carry lives beside the update, on the ranks that train.
  if (c.train.rollout_ranks > 0 && c.rollout.partial) {
    r.fail("train.rollout_ranks", "is not built with rollout.partial (the carry lives beside the update)");
  }
  if (c.train.shard == ShardStage::kParameters && c.lora.enabled()) {
    r.fail("train.shard",
           "with LoRA the frozen base is replicated (the rollout decodes it); optimizer or gradients shard the "
           "adapters' state");
  }
  // The streamed step runs on the GPU the gradients are on: it needs train.offload's host state and CUDA.
  if (c.train.offload_step == OffloadStep::kDevice) {
    if (c.train.offload != Offload::kOptimizer) {
      r.fail("train.offload_step",
             "device streams train.offload's host state through the GPU: set train.offload: optimizer");
    }
    if (c.model.device.rfind("cuda", 0) != 0) {
      r.fail("train.offload_step", "device steps on the GPU, and model.device is " + c.model.device + ": use host");
    }
  }
  // train.phase_offload moves the optimizer state out while the rollout runs, between updates.
  if (c.train.phase_offload != PhaseOffload::kNone) {
    if (c.train.async != AsyncMode::kOff) {
      r.fail("train.phase_offload", "the rollout runs beside the update (train.async), which uses the optimizer state");
    }
    if (c.train.rollout_ranks > 0) {
      r.fail("train.phase_offload", "the rollout runs on other ranks (train.rollout_ranks): nothing to make room for");
    }
    if (c.train.phase_offload == PhaseOffload::kOptimizer && c.train.offload == Offload::kOptimizer) {
      r.fail("train.phase_offload",
             "train.offload optimizer keeps the optimizer state in host memory already (training_state moves the "
             "gradient and weight chunks it leaves on the device)");
    }
    if (c.train.phase_offload == PhaseOffload::kTrainingState && c.train.shard == ShardStage::kNone &&
        c.train.offload == Offload::kNone) {
      r.fail("train.phase_offload",
             "training_state adds the sharded state's weight and gradient chunks, which only train.shard or "
             "train.offload make; without them use optimizer");
    }
  }
  // reward.kind at its default is what --print-config writes beside a list: only another value conflicts.
  if (!c.reward.combine.empty() && c.reward.kind != RewardOptions{}.kind) {
    r.fail("reward.kind", "reward.combine names the terms: set one of reward.kind and reward.combine");
  }
  // reward.script and reward.model_path are relative to the folder of the file that set them (the working
  // directory for --set). They are made absolute in the config itself, the values this check rewrites (the
  // reader's config, const here only by the signature), so the run and --print-config hold paths that work
  // from anywhere.
  namespace fs = std::filesystem;
  auto absolute = [&](const std::string& key, const std::string& value) {
    const std::string where = r.origin(key);
    fs::path path = value;
    if (path.is_relative() && where.rfind("--set ", 0) != 0 && where.find(':') != std::string::npos) {
      path = fs::path(where.substr(0, where.rfind(':'))).parent_path() / path;
    }
    return fs::absolute(path).lexically_normal().string();
  };
  if (c.reward.uses(RewardKind::kModel)) {
    const std::string dir = absolute("reward.model_path", c.reward.model_path);
    try {
      check_reward_model_folder(dir);  // a one-label score head, a tokenizer and a template, before anything loads
    } catch (const std::exception& e) {
      r.fail("reward.model_path", e.what());
    }
    const_cast<Config&>(c).reward.model_path = dir;
  }
  if (!c.critic.shared) check_critic(r, absolute);
  if (c.reward.uses(RewardKind::kPython)) {
    const fs::path script = absolute("reward.script", c.reward.script);
    try {
      check_reward_script(script.string(), c.sandbox);  // one sandboxed import: it defines reward
    } catch (const RewardScriptError& e) {
      r.fail("reward.script", e.what());
    } catch (const SandboxError& e) {
      r.fail("reward.script", std::string("the sandbox could not import it: ") + e.what());
    }
    const_cast<Config&>(c).reward.script = script.string();
  }
}

}  // namespace

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  return load_config<Config>(path, overrides, check_sections);
}

Config load_config(const std::vector<std::string>& paths, const std::vector<std::string>& overrides) {
  return load_config<Config>(paths, overrides, check_sections);
}

bool load_cli_config(const ConfigCli& cli, Config& out) { return load_cli_config<Config>(cli, out, check_sections); }

}  // namespace rlt
