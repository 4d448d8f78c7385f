// PPO's separate critic; see critic.h.
#include "trainer/critic.h"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "common/files.h"
#include "parallel/shard.h"
#include "trainer/checkpoint.h"
#include "trainer/memory_plan.h"
#include "trainer/optim.h"

namespace rlt {

namespace fs = std::filesystem;

namespace {

constexpr const char* kCriticDir = "critic";
constexpr const char* kCriticOptimizerDir = "critic_optimizer";

// The folder a fresh critic starts from (critic.init reward_model or path); "" for the policy.
std::string init_folder(const Config& c) {
  switch (c.critic.init) {
    case CriticInit::kRewardModel:
      return c.reward.model_path;
    case CriticInit::kPath:
      return c.critic.path;
    case CriticInit::kPolicy:
      break;
  }
  return "";
}

// The critic's optimizer: a sharded state at critic.shard's stage (never offloaded), or a replicated AdamW at
// critic.lr, and with several ranks unsharded, a reducer of its gradients.
void make_critic_optimizer(Run& run, Critic& critic) {
  const Config& c = run.config;
  const ShardStage stage = c.critic.stage(c.train.shard);
  const double lr = c.critic.lr > 0 ? c.critic.lr : c.train.lr;
  if (stage != ShardStage::kNone) {
    const ShardOptions o{stage, Offload::kNone, /*keep_weights=*/false, run.lead()};
    critic.state.sharded = std::make_shared<ShardedState>(
        o, *run.dist, *critic.state.policy, std::vector<std::pair<std::string, at::Tensor>>{}, critic.counters);
  } else {
    make_replicated_optimizer(critic.state, c.train, lr, lr);
  }
  critic.reducer = make_reducer(critic.state, *run.dist, c.train.dist_bucket_mb << 20);
}

}  // namespace

ModelConfig critic_model_config(const Config& config, const ModelConfig& policy) {
  const std::string dir = init_folder(config);
  ModelConfig m = dir.empty() ? policy : load_model_config(dir);
  m.head = ModelHead::kTokenScore;
  m.num_labels = 1;
  return m;
}

void ensure_critic(Run& run) {
  const Config& c = run.config;
  if (c.critic.shared || run.model.critic) return;
  auto critic = std::make_shared<Critic>();
  const at::ScalarType dtype = scalar_type(c.model.dtype);
  if (run.counters.step > 0) {
    // A resumed run: the critic its checkpoint holds, and that critic's counters.
    const fs::path dir = fs::path(run.resumed_from) / kCriticDir;
    if (!fs::exists(dir / "config.json")) {
      throw RunError(dir.string() + ": missing; a resumed run with critic.shared false needs its critic");
    }
    critic->state.policy = std::make_unique<Transformer>(Transformer::load(dir.string(), dtype, run.device));
    std::ifstream f((fs::path(run.resumed_from) / "state.json").string());
    const nlohmann::json state = nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
    if (!state.is_object() || !state.contains("critic")) {
      throw RunError(run.resumed_from +
                     "/state.json: no \"critic\" counters; the checkpoint is not a separate critic's");
    }
    critic->counters.optimizer_steps = state["critic"].value("optimizer_steps", int64_t{0});
    critic->counters.skipped_steps = state["critic"].value("skipped_steps", int64_t{0});
    critic->from = dir.string();
  } else if (const std::string dir = init_folder(c); !dir.empty()) {
    critic->state.policy = std::make_unique<Transformer>(Transformer::load(dir, dtype, run.device).value_model());
    critic->from = dir;
  } else {
    const GatheredWeights whole(run.model.sharded);  // the parameters stage: whole weights to copy
    // Beside LoRA the critic is a whole model: the policy's base with its adapters merged in, every
    // weight its own and trained (the policy's base stays frozen).
    const Transformer& policy = *run.model.policy;
    critic->state.policy =
        std::make_unique<Transformer>(policy.has_lora() ? policy.merged().value_model() : policy.value_model());
    critic->state.policy->set_residency(nullptr);
    critic->from = policy.has_lora() ? "the policy, its adapters merged" : "the policy";
  }
  Transformer& model = *critic->state.policy;
  model.set_activation_checkpointing(c.model.activation_checkpointing, c.model.checkpoint_layers);
  model.set_training_kernels(c.model.fused_kernels);
  make_critic_optimizer(run, *critic);
  if (run.counters.step > 0) {
    const std::string dir = (fs::path(run.resumed_from) / kCriticOptimizerDir).string();
    if (critic->state.sharded)
      critic->state.sharded->load(dir);
    else
      load_optimizer_pieces(critic->state, dir, critic->counters.optimizer_steps);
  }
  if (run.lead()) {
    char lr[32];
    std::snprintf(lr, sizeof lr, "%g", c.critic.lr > 0 ? c.critic.lr : c.train.lr);
    std::cerr << "critic: " << model.config().architecture << ", " << count_text(parameter_count(model.config()))
              << " parameters from " << critic->from << "; AdamW at lr " << lr << ", shard "
              << enum_to_string(c.critic.stage(c.train.shard)) << "\n";
  }
  run.model.critic = std::move(critic);
}

at::Tensor critic_values(const Transformer& critic, const PackedBatch& batch) {
  const at::Tensor hidden = batch_hidden(critic, batch);  // (S, L, D) or packed (1, T, D)
  const at::Tensor h = hidden.reshape({-1, hidden.size(2)}).index_select(0, batch.sampled.rows).to(at::kFloat);
  return to_response_layout(critic.score(h).squeeze(1), batch.sampled, batch);  // (S, R)
}

void critic_backward(Critic& critic, const at::Tensor& loss, bool ends_step) {
  backward(critic.state, loss, critic.reducer.get(), ends_step);
}

double critic_learning_rate(const Config& config, int64_t step, int64_t total) {
  TrainOptions t = config.train;
  if (config.critic.lr > 0) t.lr = config.critic.lr;
  return learning_rate(t, step, total);
}

double critic_step(Run& run, Critic& critic, const at::Tensor& loss, int64_t total_optimizer_steps) {
  critic.counters.step = run.counters.step;  // a sharded critic's warnings name the RL step
  const double lr = critic_learning_rate(run.config, critic.counters.optimizer_steps, total_optimizer_steps);
  return step_optimizer(run, critic.state, critic.counters, loss, lr, "critic update");
}

void save_critic(Run& run, const std::string& dir, nlohmann::json& state) {
  Critic& critic = *run.model.critic;
  const std::string opt = (fs::path(dir) / kCriticOptimizerDir).string();
  if (critic.state.sharded) {
    critic.state.sharded->gather_weights();  // the parameters stage: a collective
    if (run.lead()) critic.state.policy->save((fs::path(dir) / kCriticDir).string());
    critic.state.sharded->release_weights();
    if (run.lead()) fs::create_directories(opt);
    if (checkpoint_on_every_rank(run)) run.dist->barrier();  // the folder exists before any rank writes into it
    critic.state.sharded->save(opt);
  } else if (run.lead()) {
    critic.state.policy->save((fs::path(dir) / kCriticDir).string());
    save_optimizer_pieces(critic.state, opt);
  }
  state["critic"] = {{"optimizer_steps", critic.counters.optimizer_steps},
                     {"skipped_steps", critic.counters.skipped_steps}};
}

}  // namespace rlt
