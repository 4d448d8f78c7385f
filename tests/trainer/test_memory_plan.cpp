// The memory plan against what the code allocates on the CPU (the tracking allocator of common/memory.h):
// the parameter count against built models, the training state and one micro-batch's activations against
// measured peaks, and the refusal of a plan over the device with suggestions that re-plan under it.
#include "trainer/memory_plan.h"

#include <gtest/gtest.h>

#include <c10/util/llvmMathExtras.h>

#include <cmath>
#include <fstream>
#include <iostream>
#include <map>
#include <shared_mutex>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/memory.h"
#include "model/transformer.h"
#include "parallel/shard.h"
#include "rollout/engine.h"
#include "rollout/sampler.h"
#include "tests/common/threads.h"
#include "tests/common/tiny_model.h"
#include "tests/common/tmpdir.h"
#include "trainer/batch.h"
#include "trainer/metrics.h"
#include "trainer/optim.h"
#include "trainer/run.h"

#ifdef RLT_HAVE_CUDA
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace rlt {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

// A small decoder of family `type` (model_type) with the given switches.
ModelConfig small_config(const std::string& type, bool tied, int64_t vocab = 256, int64_t hidden = 128,
                         int64_t layers = 4, int64_t intermediate = 384, bool attention_bias = false) {
  nlohmann::json j = {{"model_type", type},
                      {"vocab_size", vocab},
                      {"hidden_size", hidden},
                      {"intermediate_size", intermediate},
                      {"num_hidden_layers", layers},
                      {"num_attention_heads", 4},
                      {"num_key_value_heads", 2},
                      {"rms_norm_eps", 1e-6},
                      {"tie_word_embeddings", tied},
                      {"rope_theta", 10000.0},
                      {"attention_bias", attention_bias}};
  return model_config_from_json(j, "small " + type);
}

// Qwen2.5-7B's config.json (hidden 3584, 28 layers, 28 heads over 4 KV heads, MLP 18944, vocabulary 152064,
// untied, q/k/v biases).
ModelConfig qwen25_7b() {
  const nlohmann::json j = {{"model_type", "qwen2"},
                            {"vocab_size", 152064},
                            {"hidden_size", 3584},
                            {"intermediate_size", 18944},
                            {"num_hidden_layers", 28},
                            {"num_attention_heads", 28},
                            {"num_key_value_heads", 4},
                            {"rms_norm_eps", 1e-6},
                            {"tie_word_embeddings", false},
                            {"rope_theta", 1000000.0},
                            {"max_position_embeddings", 32768}};
  return model_config_from_json(j, "Qwen2.5-7B");
}

int64_t built_count(const ModelConfig& m) {
  const Transformer t(m, at::kFloat, at::kCPU, 0);
  int64_t n = 0;
  for (const auto& p : t.parameters()) n += p.numel();
  return n;
}

// The step's memory metrics against their definitions: each phase's peak over what it began with and its
// absolute peak, and the step's absolute peak, the largest phase's, not the last one's.
TEST(PhasePeaks, ReportEachPhaseOverItsStartAndTheStepsAbsolutePeak) {
  install_cpu_memory_tracking();
  const at::Device cpu(at::kCPU);
  constexpr double kMiB = 1048576.0;
  const int64_t base = PeakMemory::allocated_bytes(cpu);
  PhasePeaks peaks(cpu);
  at::Tensor held = at::empty({1 << 20}, at::kFloat);  // 4 MiB, kept through both phases
  {
    at::Tensor transient = at::empty({2 << 20}, at::kFloat);  // 8 MiB, freed within the phase
  }
  peaks.end("rollout");
  {
    at::Tensor small = at::empty({1 << 19}, at::kFloat);  // 2 MiB
  }
  peaks.end("update");
  const auto m = peaks.metrics();
  EXPECT_EQ(m.at("peak_memory_rollout_mib"), 12.0);
  EXPECT_EQ(m.at("peak_memory_update_mib"), 2.0) << "the held 4 MiB were there when the update began";
  EXPECT_EQ(m.at("peak_memory_mib"), 12.0);
  EXPECT_EQ(m.at("memory_allocated_peak_mib"), (base + (int64_t(12) << 20)) / kMiB);
  // Each phase's absolute peak: the rollout's 12 MiB over the base, the update's the held 4 and its 2.
  EXPECT_EQ(m.at("memory_allocated_peak_rollout_mib"), (base + (int64_t(12) << 20)) / kMiB);
  EXPECT_EQ(m.at("memory_allocated_peak_update_mib"), (base + (int64_t(6) << 20)) / kMiB);
  // The wrong twin reports the last phase's absolute peak: 4 + 2 MiB over the base.
  EXPECT_NE(m.at("memory_allocated_peak_mib"), (base + (int64_t(6) << 20)) / kMiB);
  EXPECT_EQ(m.at("memory_reserved_peak_mib"), m.at("memory_allocated_peak_mib")) << "the CPU caches nothing";
}

TEST(MemoryPlan, ParameterCountIsTheBuiltModels) {
  struct Case {
    std::string name;
    ModelConfig m;
  };
  std::vector<Case> cases = {
      {"llama tied", small_config("llama", true)},
      {"llama untied, attention_bias", small_config("llama", false, 256, 128, 4, 384, /*attention_bias=*/true)},
      {"qwen2 (q/k/v biases)", small_config("qwen2", false)},
      {"qwen3 (q/k norms) tied", small_config("qwen3", true)},
      {"gemma2 (four norms a layer)", model_config_from_json(testing::tiny_family_config("gemma2"), "gemma2")},
  };
  for (const Case& c : cases) {
    const int64_t built = built_count(c.m);
    EXPECT_EQ(parameter_count(c.m), built) << c.name;
    // Twin: a count that forgets the biases.
    if (c.m.qkv_bias || c.m.o_bias) {
      ModelConfig no_bias = c.m;
      no_bias.qkv_bias = no_bias.o_bias = false;
      EXPECT_NE(parameter_count(no_bias), built) << c.name << ": a count without biases must differ";
    }
  }
  // Qwen2.5-7B: 7,615,616,512 parameters (its safetensors hold 15,231,233,024 bytes of bf16).
  EXPECT_EQ(parameter_count(qwen25_7b()), int64_t{7615616512});
  // Score heads instead of the LM head: a tied config ties nothing, the head is num_labels x D (and its
  // bias for token classification).
  for (const char* arch : {"Qwen2ForSequenceClassification", "Qwen2ForTokenClassification"}) {
    nlohmann::json j = small_config("qwen2", true).raw;
    j["architectures"] = {arch};
    j["id2label"] = {{"0", "LABEL_0"}};
    const ModelConfig m = model_config_from_json(j, arch);
    const int64_t built = built_count(m);
    EXPECT_EQ(parameter_count(m), built) << arch;
    EXPECT_EQ(built, parameter_count(small_config("qwen2", true)) + 128 + (m.head == ModelHead::kTokenScore ? 1 : 0))
        << arch << ": the tied causal LM's count plus the head";
  }
}

// The host memory of a replicated AdamW's parked state: one buffer per moment of every parameter of the
// built model (and per fp32 master of a bf16 one), each whole pages (pinned_host_zeros); with LoRA, the
// adapters' moments alone. Twins: torch's pinned allocator's power-of-two rounding of each buffer, and one
// buffer the size of them all.
TEST(MemoryPlan, PinnedBuffersAreWholePages) {
  const ModelConfig m = small_config("qwen2", false);
  const Transformer built(m, at::kFloat, at::kCPU, 0);
  auto pages = [](int64_t b) { return pinned_host_bytes(b) - b; };
  auto power_of_two = [](int64_t b) { return int64_t(c10::llvm::PowerOf2Ceil(uint64_t(b))) - b; };
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    Config c = load_config("", {});
    c.model.dtype = dtype;
    c.train.phase_offload = PhaseOffload::kOptimizer;
    const MemoryPlan p = plan_memory(c, m, 1);
    int64_t expected = 0, rounded = 0, whole = 0;
    for (const at::Tensor& t : built.parameters()) {
      const int64_t n = t.numel(), buffers = dtype == DType::kBFloat16 ? 3 : 2;
      expected += buffers * pages(4 * n);
      rounded += buffers * power_of_two(4 * n);
      whole += 4 * buffers * n;
    }
    EXPECT_EQ(p.host_rounding, expected) << p.table();
    EXPECT_EQ(p.parked, whole);
    EXPECT_EQ(p.host_total(), p.parked + expected);
    EXPECT_NE(p.host_rounding, rounded) << "twin: torch's pinned allocator";
    EXPECT_NE(p.host_rounding, pages(whole)) << "twin: one buffer";
  }
  Config lora = load_config("", {"lora.rank=4", "lora.targets=q,v"});
  lora.train.phase_offload = PhaseOffload::kOptimizer;
  Transformer adapted(m, at::kFloat, at::kCPU, 0);
  adapted.attach_lora(lora.lora, 0);
  int64_t expected = 0;
  for (const at::Tensor& t : adapted.trainable_parameters()) expected += 2 * pages(4 * t.numel());
  EXPECT_EQ(plan_memory(lora, m, 1).host_rounding, expected);
}

// reward.kind model: the plan holds the reward model's weights and one scoring forward, on the training
// ranks and on rollout ranks alike, and prints its line. Twin: a plan that forgets its weights.
TEST(MemoryPlan, CountsTheRewardModel) {
  const testing::TempDir dir("memory_plan_rm");
  nlohmann::json j = small_config("qwen2", false, 256, 128, 2, 384).raw;
  j["architectures"] = {"Qwen2ForSequenceClassification"};
  j["id2label"] = {{"0", "LABEL_0"}};
  std::ofstream(dir.path() / "config.json") << j.dump();
  const ModelConfig rm = model_config_from_json(j, "rm");
  const Config plain = load_config("", {});
  Config scored = plain;  // set directly: the plan reads only config.json (a run's config check reads more)
  scored.reward.kind = RewardKind::kModel;
  scored.reward.model_path = dir.path().string();
  scored.reward.model_batch_tokens = 1000;
  const int64_t weights = 4 * parameter_count(rm);
  // Attention's temporaries, with the keys and values gathered for shared prefixes (8 a token), outgrow the
  // MLP's here.
  const int64_t forward = 4 * 1000 * (2 * 128 + std::max<int64_t>((4 + 2 * 2) * 32 + 4 * 32 + 8 * 2 * 2 * 32, 3 * 384));
  const ModelConfig policy = small_config("llama", true);
  const MemoryPlan a = plan_memory(plain, policy, 1), b = plan_memory(scored, policy, 1);
  EXPECT_EQ(b.reward_model, weights + forward);
  EXPECT_EQ(b.device_total() - a.device_total(), weights + forward);
  EXPECT_NE(b.reward_model, forward) << "twin: the forward without the weights";
  EXPECT_NE(b.table().find("reward model"), std::string::npos) << b.table();
  EXPECT_EQ(a.table().find("reward model"), std::string::npos);
  EXPECT_EQ(plan_rollout_rank(scored, policy, 1).reward_model, weights + forward);
}

// PPO's separate critic: its weights, masters and moments in the persistent part, its gradients in the
// update's, at its own shard stage. Hand counts from the critic's shape (the policy's trunk, a one-output
// score head and its bias in place of the LM head); the twin plans it at the policy's stage.
TEST(MemoryPlan, CountsTheSeparateCritic) {
  const ModelConfig policy = small_config("llama", false);
  ModelConfig value = policy;
  value.head = ModelHead::kTokenScore;
  value.num_labels = 1;
  const int64_t P = parameter_count(value);
  EXPECT_EQ(P, parameter_count(policy) - policy.vocab_size * policy.hidden_size + policy.hidden_size + 1);
  Config shared = load_config("", {});
  shared.train.micro_batch_size = shared.train.mini_batch_size = 8;  // one backward a step: no grad buffers
  Config own = shared;
  own.critic.shared = false;
  const MemoryPlan a = plan_memory(shared, policy, 1), b = plan_memory(own, policy, 1);
  EXPECT_EQ(b.critic, 4 * P + 8 * P) << "fp32: weights and two moments";
  EXPECT_EQ(b.critic_gradients, 4 * P);
  EXPECT_EQ(b.persistent() - a.persistent(), b.critic);
  EXPECT_GE(b.device_total() - a.device_total(), b.critic);
  EXPECT_NE(b.table().find("critic"), std::string::npos) << b.table();
  EXPECT_EQ(a.table().find("critic"), std::string::npos);
  // Beside LoRA's adapters the critic is a whole model of its own: the same bytes as beside a full policy.
  Config adapters = own;
  adapters.lora.rank = 8;
  const MemoryPlan d = plan_memory(adapters, policy, 1);
  EXPECT_EQ(d.critic, b.critic) << "twin: the critic planned as adapters";
  EXPECT_EQ(d.critic_gradients, b.critic_gradients);
  // bf16 over 2 ranks, the critic sharded at gradients while the policy is not: its bf16 weights whole and
  // its half of them rounded from the masters (the all-gather's input), its fp32 masters and moments halved,
  // and its fp32 gradient chunk, which a sharded state keeps through the rollout.
  own.model.dtype = DType::kBFloat16;
  own.critic.shard = CriticShard::kGradients;
  const MemoryPlan c = plan_memory(own, policy, 2);
  EXPECT_EQ(c.critic, 2 * P + 2 * P / 2 + (4 * P + 8 * P) / 2 + 4 * P / 2);
  EXPECT_NE(c.critic, 2 * P + 4 * P + 8 * P) << "twin: the policy's stage (none)";
  EXPECT_EQ(c.critic_gradients, plan_memory(own, policy, 2).critic_gradients);
  Config parked = own;
  parked.train.phase_offload = PhaseOffload::kOptimizer;  // the chunk freed while the rollout runs
  EXPECT_EQ(plan_memory(parked, policy, 2).critic_gradients - c.critic_gradients, 4 * P / 2);
}

// train.phase_offload optimizer: the masters and moments (and a separate critic's) leave the persistent part
// for the update's phase alone, so the total is the weights plus the larger of the rollout and the update
// with them; the twin counts them in both phases.
TEST(MemoryPlan, ParkedStateCountsInTheUpdateOnly) {
  const ModelConfig policy = small_config("llama", false);
  Config resident = load_config("", {});
  resident.model.dtype = DType::kBFloat16;
  resident.rollout.max_context = 4096;
  Config parked = resident;
  parked.train.phase_offload = PhaseOffload::kOptimizer;
  const MemoryPlan a = plan_memory(resident, policy, 1), b = plan_memory(parked, policy, 1);
  ASSERT_GT(a.masters, 0);
  EXPECT_EQ(b.parked, a.masters + a.moments);
  EXPECT_EQ(b.persistent(), a.persistent() - b.parked);
  EXPECT_EQ(b.update_phase(), a.update_phase() + b.parked);
  EXPECT_EQ(b.device_total(), b.persistent() + std::max(b.rollout_phase(), b.update_phase()));
  EXPECT_LE(b.device_total(), a.device_total());
  EXPECT_NE(b.device_total(), a.persistent() + std::max(a.rollout_phase(), a.update_phase() + b.parked))
      << "twin: parked in both phases";
  EXPECT_NE(b.table().find("parked"), std::string::npos) << b.table();
  parked.critic.shared = false;
  const MemoryPlan c = plan_memory(parked, policy, 1);
  EXPECT_EQ(c.parked - b.parked, c.critic - c.critic / 7)
      << "the critic's fp32 masters and moments (12 of its 14 bytes)";
}

// train.phase_offload training_state: the sharded weight chunks leave too: at shard parameters on 2 ranks the
// parked bytes are the optimizer mode's plus the rank's bf16 chunk (2 bytes a parameter over 2), and under
// train.offload (masters and moments in host memory) the chunk alone. The twin parks the whole weights.
TEST(MemoryPlan, TrainingStateParksTheWeightChunks) {
  const ModelConfig policy = small_config("llama", false);
  Config c = load_config("", {});
  c.model.dtype = DType::kBFloat16;
  c.train.shard = ShardStage::kParameters;
  c.train.phase_offload = PhaseOffload::kOptimizer;
  const MemoryPlan a = plan_memory(c, policy, 2);
  c.train.phase_offload = PhaseOffload::kTrainingState;
  const MemoryPlan b = plan_memory(c, policy, 2);
  const int64_t P = a.parameters;
  EXPECT_EQ(b.parked - a.parked, 2 * P / 2);
  EXPECT_NE(b.parked - a.parked, 2 * P) << "twin: the whole weights";
  EXPECT_EQ(b.persistent(), a.persistent() - 2 * P / 2);
  c.train.offload = Offload::kOptimizer;
  const MemoryPlan o = plan_memory(c, policy, 2);
  EXPECT_EQ(o.masters + o.moments, 0);
  EXPECT_EQ(o.parked, 2 * P / 2);
}

// configs/retool_32b.yaml on the published Qwen2.5-32B shape (configs/models/qwen2.5-32b): as shipped, LoRA
// rank 64, it fits one H200 (143,771 MiB); with the full fine-tuning overrides its header names it fits
// 4 ranks, where the resident training state does not, and training_state takes the weight and gradient
// chunks off the rollout's phase, the larger.
TEST(MemoryPlan, TheThirtyTwoBRecipeFitsItsGpus) {
  const std::string root = RLT_SOURCE_DIR;
  const ModelConfig m = load_model_config(root + "/configs/models/qwen2.5-32b");
  EXPECT_EQ(parameter_count(m), int64_t{32763876352});
  const int64_t h200 = int64_t{143771} << 20;
  const std::string recipe = root + "/configs/retool_32b.yaml";
  const Config lora = load_config(recipe, {});
  const MemoryPlan one = plan_memory(lora, m, 1);
  EXPECT_LE(one.device_total(), h200) << one.table();
  EXPECT_NO_THROW(check_memory_plan(one, lora, m, 1, h200));
  const std::vector<std::string> full = {"lora.rank=0", "train.shard=parameters", "train.offload=optimizer",
                                         "train.phase_offload=training_state"};
  const Config c = load_config(recipe, full);
  const MemoryPlan four = plan_memory(c, m, 4);
  EXPECT_LE(four.device_total(), h200) << four.table();
  EXPECT_NO_THROW(check_memory_plan(four, c, m, 4, h200));
  const Config resident = load_config(recipe, {"lora.rank=0", "train.shard=parameters"});
  EXPECT_GT(plan_memory(resident, m, 4).device_total(), h200) << "18 bytes a parameter over 4 ranks";
  const Config offload = load_config(recipe, {"lora.rank=0", "train.shard=parameters", "train.offload=optimizer"});
  EXPECT_EQ(plan_memory(offload, m, 4).device_total() - four.device_total(), four.parked + four.gradients)
      << "the weight chunks and the gradient chunk leave the rollout's phase, the larger";
}

// The 32B recipe's full fine-tune pins its masters and moments (12 bytes a parameter) and its parked bf16
// chunks (2) in host memory, whatever the ranks of one host: 3 fp32 chunks and a bf16 one on each rank, each
// exactly its size in whole pages, 427 GiB on the host. A 2 x H200 host (256 GB) is refused before anything
// loads, a 4 x H200 host (512 GB: 477 GiB of memory) is not. Twin: torch's pinned allocator, which would
// round the chunks up to 64, 64, 64 and 32 GiB on each of 2 ranks (448 GiB on the host).
TEST(MemoryPlan, RefusesPinnedHostMemoryTheHostLacks) {
  const std::string root = RLT_SOURCE_DIR;
  const ModelConfig m = load_model_config(root + "/configs/models/qwen2.5-32b");
  const double P = double(parameter_count(m));
  const Config c = load_config(
      root + "/configs/retool_32b.yaml",
      {"lora.rank=0", "train.shard=parameters", "train.offload=optimizer", "train.phase_offload=training_state"});
  const MemoryPlan two = plan_memory(c, m, 2), four = plan_memory(c, m, 4);
  const int64_t gib = int64_t{1} << 30;
  for (const MemoryPlan* p : {&two, &four}) {
    EXPECT_NEAR(double(p->host_optimizer + p->parked) * p->world, 14 * P, 0.001 * 14 * P) << p->table();
    EXPECT_GE(p->host_total(), p->host_optimizer + p->parked) << p->table();
    EXPECT_LT(p->host_total(), p->host_optimizer + p->parked + 4 * kHostPageBytes) << "4 buffers, whole pages";
    EXPECT_NE(p->host_total(), (3 * 128 + 64) * gib / p->world) << "twin: torch's pinned allocator";
  }
  try {
    check_host_memory(two, 2, 240 * gib);
    ADD_FAILURE() << "2 ranks of 214 GiB on a host of 240 GiB";
  } catch (const RunError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("needs 427 GiB"), std::string::npos) << what;
    EXPECT_NE(what.find("2 ranks x 214 GiB"), std::string::npos) << what;
    EXPECT_NE(what.find("has 240 GiB available"), std::string::npos) << what;
  }
  EXPECT_NO_THROW(check_host_memory(four, 4, 460 * gib));
  EXPECT_NO_THROW(check_host_memory(four, 4, 440 * gib)) << "torch's pinned allocator would take 448 GiB";
  EXPECT_THROW(check_host_memory(four, 4, 420 * gib), RunError) << "four ranks share one host";
  EXPECT_NO_THROW(check_host_memory(four, 1, 420 * gib)) << "one rank alone fits";
  EXPECT_NO_THROW(check_host_memory(two, 2, 0)) << "no figure, no check";
  const MemoryPlan lora = plan_memory(load_config(root + "/configs/retool_32b.yaml", {}), m, 1);
  EXPECT_EQ(lora.host_total(), 0) << "nothing pinned";
  EXPECT_EQ(two.table().find("host memory") == std::string::npos, false) << two.table();
  EXPECT_GT(host_memory_bytes(), 0) << "this host's /proc/meminfo";
}

// Trajectories of `tokens` tokens each: a one-token prompt and a sampled response.
std::vector<Trajectory> trajectories(int64_t count, int64_t tokens, int64_t vocab) {
  std::vector<Trajectory> out(count);
  for (int64_t s = 0; s < count; ++s) {
    Trajectory& t = out[s];
    t.prompt_ids = {1 + s % (vocab - 1)};
    for (int64_t j = 1; j < tokens; ++j) {
      t.response_ids.push_back((7 * j + 3 * s) % vocab);
      t.loss_mask.push_back(1);
      t.logprobs.push_back(-1.0f);
    }
  }
  return out;
}

// One micro-batch's forward through the loss module and its backward, as GRPO's update runs it.
void micro_batch(Run& run, const std::vector<Trajectory>& trajs, int64_t begin, int64_t end, bool ends_step) {
  const PackedBatch b = pack(trajs, begin, end, run.device);
  const ResponseLogprobs r = response_logprobs(*run.model.policy, b, run.config.loss);
  const at::Tensor loss = -(r.logprobs * b.loss_mask).sum() / double(b.loss_mask.sum().item<float>());
  backward(run, loss, nullptr, ends_step);
}

Config small_run_config(DType dtype, int64_t micro, int64_t context) {
  Config c = load_config("", {});
  c.model.dtype = dtype;
  c.model.device = "cpu";
  c.train.prompts_per_step = 2;
  c.sampling.samples_per_prompt = 2;  // 4 sequences a step, one mini-batch
  c.train.micro_batch_size = micro;
  c.rollout.max_context = context;
  c.train.eval_prompts = 0;
  return c;
}

// Relative error of a planned figure against a measured one.
double off(int64_t planned, int64_t measured) { return std::abs(double(planned) / double(measured) - 1.0); }

// What the trainer allocates from building the model to its second optimizer step (each over the step's
// micro-batches of a few tokens, so the training state dominates) against the plan's update phase.
struct StateCase {
  DType dtype;
  int64_t micro;  // 4: one backward a step; 2: two, accumulated
  Offload offload = Offload::kNone;
};

TEST(MemoryPlan, TrainingStateMatchesTheMeasuredPeak) {
  install_cpu_memory_tracking();
  const at::Device cpu(at::kCPU);
  const ModelConfig m = small_config("llama", false, /*vocab=*/256, /*hidden=*/256, /*layers=*/4, 768);
  for (const StateCase sc :
       {StateCase{DType::kFloat32, 4}, StateCase{DType::kFloat32, 2}, StateCase{DType::kBFloat16, 4},
        StateCase{DType::kBFloat16, 2}, StateCase{DType::kBFloat16, 2, Offload::kOptimizer},
        StateCase{DType::kFloat32, 4, Offload::kOptimizer}}) {
    Config c = small_run_config(sc.dtype, sc.micro, /*context=*/8);
    c.train.offload = sc.offload;
    const std::string name = std::string(sc.dtype == DType::kFloat32 ? "fp32" : "bf16") + ", micro-batch " +
                             std::to_string(sc.micro) + (sc.offload == Offload::kOptimizer ? ", offload" : "");
    const std::vector<Trajectory> trajs = trajectories(4, 8, m.vocab_size);
    int64_t measured = 0, host_state = 0;
    {
      PeakMemory peak(cpu);
      rlt::Run run;
      run.config = c;
      run.model.policy =
          std::make_unique<Transformer>(m, sc.dtype == DType::kBFloat16 ? at::kBFloat16 : at::kFloat, at::kCPU,
                                        /*seed=*/0);
      make_optimizer(run, {});
      for (int step = 0; step < 2; ++step) {
        zero_gradients(run.model);
        for (int64_t b = 0; b < 4; b += sc.micro) micro_batch(run, trajs, b, b + sc.micro, b + sc.micro == 4);
        apply_gradients(run, at::zeros({}), /*total_optimizer_steps=*/10);
      }
      measured = peak.peak_extra_bytes();
      host_state = run.model.sharded ? run.model.sharded->host_bytes() : 0;
    }
    const MemoryPlan plan = plan_memory(c, m, 1);
    // Without CUDA the offloaded optimizer's host memory comes from the tracked CPU allocator. With CUDA it
    // is pinned, from CUDA's host allocator, which the tracking does not see: it is then checked against
    // what the optimizer holds.
    const bool pinned = sc.offload == Offload::kOptimizer && at::hasCUDA();
    const int64_t planned = plan.persistent() + plan.update_phase() + (pinned ? 0 : plan.host_optimizer);
    if (pinned) {
      EXPECT_LT(off(plan.host_optimizer, host_state), 0.10) << name << ": pinned host state";
      EXPECT_GT(off(plan.host_optimizer / 2, host_state), 0.10) << name << ": half the host state";
    }
    std::cout << name << ": planned " << planned << ", measured " << measured << "\n";
    EXPECT_LT(off(planned, measured), 0.10) << name;
    EXPECT_LT(plan.activations, planned / 10) << name << ": the training state is what this case measures";
    // Twins: a plan that forgets the offloaded state, a plan with bf16 moments (make_optimizer's fp32
    // masters forgotten), and a plan that gives an fp32 model masters.
    if (sc.offload == Offload::kOptimizer && !pinned) {
      EXPECT_GT(off(planned - plan.host_optimizer, measured), 0.10) << name << ": the host state forgotten";
    } else if (pinned) {
      EXPECT_GT(off(planned + plan.host_optimizer, measured), 0.10) << name << ": the host state counted on the device";
    } else if (sc.dtype == DType::kBFloat16) {
      EXPECT_GT(off(planned - plan.moments / 2 - plan.masters, measured), 0.10) << name << ": bf16 moments, no masters";
    } else {
      EXPECT_GT(off(planned + 4 * plan.parameters, measured), 0.10) << name << ": an fp32 model with masters";
    }
  }
}

// The rollout's phase on the CPU allocator: a DecodeEngine with the trainer's options (engine_options: the
// cache bounded at rollout.max_context) starts the step's 4 prompts x 4 samples and decodes until every row
// holds rollout.max_context tokens, against the plan's rollout phase (on the CPU the KV cache alone: no
// packed weights, no graph pool). Within 10%, the cache's growths and the steps' temporaries included. The
// wrong twin it rejects: the engine with its cache unbounded (max_slots 0), which grows past the context.
TEST(MemoryPlan, RolloutPhaseMatchesTheMeasuredPeak) {
  install_cpu_memory_tracking();
  const at::Device cpu(at::kCPU);
  const ModelConfig m = small_config("llama", false, /*vocab=*/256, /*hidden=*/64, /*layers=*/16, 128);
  Config c = small_run_config(DType::kFloat32, 4, /*context=*/512);
  c.train.prompts_per_step = 4;
  c.sampling.samples_per_prompt = 4;
  const Transformer model(m, at::kFloat, at::kCPU, /*seed=*/0);
  auto measure = [&](const EngineOptions& o) {
    at::NoGradGuard no_grad;
    PeakMemory peak(cpu);
    DecodeEngine engine(model, o);
    std::vector<std::vector<int64_t>> prompts;
    for (int64_t p = 0; p < 4; ++p) prompts.push_back(std::vector<int64_t>(16, 3 + p));
    engine.start(prompts, 4);
    const std::vector<int64_t> rows = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int64_t t = 16; t < c.rollout.max_context; ++t) engine.step(rows, std::vector<int64_t>(16, t % 256));
    EXPECT_GE(engine.cache_slots(), c.rollout.max_context);
    return peak.peak_extra_bytes();
  };
  const EngineOptions bounded = engine_options(c.rollout);
  const int64_t measured = measure(bounded);
  const MemoryPlan plan = plan_memory(c, m, 1);
  EXPECT_EQ(plan.graph_pool, 0);
  EXPECT_EQ(plan.rollout_weights, 0);
  std::cout << "rollout phase planned " << plan.rollout_phase() << ", measured " << measured << "\n";
  EXPECT_LT(off(plan.rollout_phase(), measured), 0.10);
  EngineOptions unbounded = bounded;
  unbounded.max_slots = 0;
  const int64_t grown = measure(unbounded);
  std::cout << "unbounded cache: measured " << grown << "\n";
  EXPECT_GT(off(plan.rollout_phase(), grown), 0.10) << "a cache that grows past rollout.max_context";
}

// One micro-batch's forward and backward with the gradients already allocated (as from the second
// micro-batch on), against the plan's activations. On `device` (c.model.device).
int64_t measured_activations(const Config& c, const ModelConfig& m, int64_t micro, int64_t context) {
  const at::Device device(c.model.device);
  // On one intra-op thread, as ctest runs the tests (OMP_NUM_THREADS=1): the CPU kernels' per-thread scratch
  // is not an activation the plan counts, and it grows with the host's cores (16 threads add 0.87 MB to the
  // bf16 checkpointed case's 2.9).
  const testing::IntraOpThreads one(1);
  Run run;
  run.config = c;
  run.device = device;
  run.model.policy =
      std::make_unique<Transformer>(m, c.model.dtype == DType::kBFloat16 ? at::kBFloat16 : at::kFloat, device,
                                    /*seed=*/0);
  run.model.policy->set_activation_checkpointing(c.model.activation_checkpointing, c.model.checkpoint_layers);
  run.model.policy->set_training_kernels(c.model.fused_kernels);
  const std::vector<Trajectory> trajs = trajectories(micro, context, m.vocab_size);
  micro_batch(run, trajs, 0, micro, true);  // the parameters' gradients, kept (and cuBLAS's workspace)
  device_synchronize(device);
  PeakMemory peak(device);
  micro_batch(run, trajs, 0, micro, true);
  device_synchronize(device);
  return peak.peak_extra_bytes();
}

TEST(MemoryPlan, ActivationsMatchTheMeasuredPeak) {
  install_cpu_memory_tracking();
  const int64_t micro = 4, context = 128;
  const ModelConfig layers_heavy = small_config("llama", false, /*vocab=*/256, /*hidden=*/64, /*layers=*/4, 192);
  const ModelConfig vocab_heavy = small_config("llama", false, /*vocab=*/4096, /*hidden=*/64, /*layers=*/1, 192);
  struct Case {
    std::string name;
    ModelConfig m;
    DType dtype;
    bool checkpointing;
    LogprobImpl impl;
    int64_t checkpoint_layers = -1;  // model.checkpoint_layers
  };
  const std::vector<Case> cases = {
      {"fp32", layers_heavy, DType::kFloat32, false, LogprobImpl::kSelective},
      {"fp32 checkpointed", layers_heavy, DType::kFloat32, true, LogprobImpl::kSelective},
      {"fp32, 2 of 4 layers checkpointed", layers_heavy, DType::kFloat32, true, LogprobImpl::kSelective, 2},
      {"bf16, 1 of 4 layers checkpointed", layers_heavy, DType::kBFloat16, true, LogprobImpl::kSelective, 1},
      {"bf16", layers_heavy, DType::kBFloat16, false, LogprobImpl::kSelective},
      {"bf16 checkpointed", layers_heavy, DType::kBFloat16, true, LogprobImpl::kSelective},
      {"fp32 vocab 4096 selective", vocab_heavy, DType::kFloat32, false, LogprobImpl::kSelective},
      {"fp32 vocab 4096 naive", vocab_heavy, DType::kFloat32, false, LogprobImpl::kNaive},
      {"fp32 vocab 4096 cce", vocab_heavy, DType::kFloat32, false, LogprobImpl::kCce},
      {"qwen3 (q/k norms) bf16", small_config("qwen3", false, 256, 64, 4, 192), DType::kBFloat16, false,
       LogprobImpl::kSelective},
      {"qwen2 (q/k/v biases) fp32", small_config("qwen2", false, 256, 64, 4, 192), DType::kFloat32, false,
       LogprobImpl::kSelective},
      {"gemma2 (soft-capped attention) fp32", model_config_from_json(testing::tiny_family_config("gemma2"), "g"),
       DType::kFloat32, false, LogprobImpl::kSelective},
  };
  for (const Case& k : cases) {
    Config c = small_run_config(k.dtype, micro, context);
    c.train.prompts_per_step = micro;
    c.sampling.samples_per_prompt = 1;
    c.model.activation_checkpointing = k.checkpointing;
    c.model.checkpoint_layers = k.checkpoint_layers;
    c.loss.impl = k.impl;
    const int64_t measured = measured_activations(c, k.m, micro, context);
    const int64_t planned = plan_memory(c, k.m, 1).activations;
    std::cout << k.name << ": activations planned " << planned << ", measured " << measured << "\n";
    EXPECT_LT(off(planned, measured), 0.10) << k.name;
    // Twins: the estimate without the MLP's saved activations (4 s F a token and layer), without
    // checkpointing for a checkpointed run, and with another loss path's working set.
    const int64_t s = k.dtype == DType::kBFloat16 ? 2 : 4;
    const int64_t T = micro * context, F = k.m.intermediate_size;
    if (k.m.attn_softcap > 0) {
      // The eager attention's scores: tanh's output and the fp32 softmax, a context's worth per head.
      const int64_t scores = T * k.m.num_layers * k.m.num_heads * context * 8;
      EXPECT_GT(off(planned - scores, measured), 0.10) << k.name << ": no quadratic scores";
    } else if (k.m.num_layers > 1 && !k.checkpointing) {
      EXPECT_GT(off(planned - T * (k.m.num_layers + 1) * 4 * s * F, measured), 0.10) << k.name << ": no MLP term";
    }
    if (k.checkpointing) {
      Config x = c;
      x.model.activation_checkpointing = false;
      EXPECT_GT(off(plan_memory(x, k.m, 1).activations, measured), 0.10) << k.name << ": planned as not checkpointed";
      if (k.checkpoint_layers >= 0) {
        x = c;
        x.model.checkpoint_layers = -1;
        EXPECT_GT(off(plan_memory(x, k.m, 1).activations, measured), 0.10) << k.name << ": planned as every layer";
      }
    }
    if (k.m.vocab_size >= 4096) {
      // The [T', V] working set: a plan that takes cce's for naive or selective, or selective's for cce.
      Config x = c;
      x.loss.impl = k.impl == LogprobImpl::kCce ? LogprobImpl::kSelective : LogprobImpl::kCce;
      EXPECT_GT(off(plan_memory(x, k.m, 1).activations, measured), 0.10) << k.name << ": planned as another path";
    }
  }
}

// The gradient buffers, counted by hand for a tied Qwen2-like model whose embedding is its largest tensor
// and unit. A tied embedding is used twice: the backward holds the LM head's gradient until the
// embedding's arrives and sums them, one more vocabulary-sized gradient than the untied model holds at
// once (on an H200 the 0.5B's update peaked 259 MiB over a plan without it; the CPU's backward peaks
// earlier, so only the GPU table measures it); a score head ties nothing. Under train.offload alone the
// fp32 wholes of every tensor meet the two reduce slots in the last backward: measured here as what that
// backward leaves allocated (the slots, freed by the optimizer step). The wrong twin: one slot.
TEST(MemoryPlan, CountsTheReduceSlotsAndATiedEmbeddingsHeldGradient) {
  install_cpu_memory_tracking();
  const at::Device cpu(at::kCPU);
  const int64_t vocab = 8192, hidden = 128;
  const ModelConfig tied = small_config("qwen2", true, vocab, hidden, /*layers=*/2, 384);
  const int64_t T = parameter_count(tied), E = vocab * hidden;
  Config c = small_run_config(DType::kBFloat16, /*micro=*/2, /*context=*/8);  // two backwards a step
  EXPECT_EQ(plan_memory(c, tied, 1).grad_buffers, 2 * T + 2 * E) << "the bf16 gradients whole, and the head's held";
  ModelConfig critic = tied;  // a score head ties nothing: no held gradient
  critic.head = ModelHead::kTokenScore;
  critic.num_labels = 1;
  EXPECT_EQ(plan_memory(c, critic, 1).grad_buffers, 2 * parameter_count(critic));
  c.train.offload = Offload::kOptimizer;
  const MemoryPlan plan = plan_memory(c, tied, 1);
  const int64_t slots = int64_t(ShardedState::kReduceSlots) * 4 * E;
  EXPECT_EQ(plan.grad_buffers, 4 * T + slots + 2 * E + 2 * E) << "wholes, slots, the largest's bf16 gradient, the held";

  rlt::Run run;
  run.config = c;
  run.model.policy = std::make_unique<Transformer>(tied, at::kBFloat16, at::kCPU, /*seed=*/0);
  make_optimizer(run, {});
  ASSERT_TRUE(run.model.sharded);
  const std::vector<Trajectory> trajs = trajectories(4, 8, vocab);
  zero_gradients(run.model);
  const int64_t before = PeakMemory::allocated_bytes(cpu);
  micro_batch(run, trajs, 0, 2, false);
  EXPECT_EQ(PeakMemory::allocated_bytes(cpu) - before, 4 * T) << "the fp32 wholes over the micro-batches";
  micro_batch(run, trajs, 2, 4, true);
  const int64_t held = PeakMemory::allocated_bytes(cpu) - before;
  EXPECT_EQ(held, slots) << "the wholes reduced into the chunk, the slots kept until the step";
  EXPECT_NE(held, slots / int64_t(ShardedState::kReduceSlots)) << "one slot";
  apply_gradients(run, at::zeros({}), /*total_optimizer_steps=*/10);
  EXPECT_EQ(PeakMemory::allocated_bytes(cpu), before) << "the step frees the slots";
  // optimizer_memory_mib's figure: the fp32 gradient chunk on the model's device (here the CPU), the
  // masters and moments in host memory.
  EXPECT_EQ(optimizer_memory_bytes(run.model), 4 * T);
}

// The same on a GPU, in bf16 (flash attention's (B, L, H, hd) output, the CUDA selective kernel, the
// fp32-output LM-head GEMM, the fused layer forms): what the plan counts for CUDA.
TEST(MemoryPlan, ActivationsMatchTheMeasuredPeakOnCuda) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const int64_t micro = 4, context = 128;
  struct Case {
    std::string name;
    ModelConfig m;
    bool checkpointing;
  };
  const std::vector<Case> cases = {
      {"bf16", small_config("llama", false, 256, 64, 4, 192), false},
      {"bf16 checkpointed", small_config("llama", false, 256, 64, 4, 192), true},
      {"bf16 vocab 4096", small_config("llama", false, 4096, 64, 1, 192), false},
  };
  for (const Case& k : cases) {
    Config c = small_run_config(DType::kBFloat16, micro, context);
    c.model.device = "cuda";
    c.train.prompts_per_step = micro;
    c.sampling.samples_per_prompt = 1;
    c.model.activation_checkpointing = k.checkpointing;
    const int64_t measured = measured_activations(c, k.m, micro, context);
    const int64_t planned = plan_memory(c, k.m, 1).activations;
    std::cout << k.name << " (CUDA): activations planned " << planned << ", measured " << measured << "\n";
    EXPECT_LT(off(planned, measured), 0.10) << k.name;
    // Twins: the CPU's figures (ATen loss chunks, the bf16 head upcast, the attention output's copy); the
    // ATen layer forms' saved tensors (fp32 norm inputs, normalised outputs, the SiLU's output).
    Config x = c;
    x.model.device = "cpu";
    if (k.m.vocab_size >= 4096) {
      EXPECT_GT(off(plan_memory(x, k.m, 1).activations, measured), 0.10) << k.name << ": planned as on the CPU";
    }
    if (!k.checkpointing && k.m.num_layers > 1) {
      x = c;
      x.model.fused_kernels = false;
      EXPECT_GT(off(plan_memory(x, k.m, 1).activations, measured), 0.10) << k.name << ": planned as the ATen forms";
    }
  }
}

// graph_pool_bytes: the pool of the rollout's CUDA graphs, counted by hand. A decode step draws at every
// cache row; a speculative rollout's verifying forward at its rows (speculative_max_rows to a power of two
// of at least 8, at most the cache's) x its bucket of positions. Nothing on the CPU or without graphs. In
// the plan: the rollout's phase, keep_cache's held bytes and a rollout rank's plan. The wrong twins it
// rejects: the verifying forward's bucket left out (its rows alone), and the pool left out of the phase.
TEST(MemoryPlan, CountsTheGraphPool) {
  const ModelConfig m = qwen25_7b();
  Config c;
  c.model.device = "cuda";
  const int64_t V = m.vocab_size, base = kGraphPoolTemporaries;
  EXPECT_EQ(graph_pool_bytes(c, m, 64), 2 * 64 * V * 4 + base);
  c.rollout.speculative = Speculative::kSuffix;
  c.rollout.speculative_max_rows = 20;  // 32 rows, 4 + 1 tokens a run: the bucket of 8
  c.rollout.draft_tokens = 4;
  EXPECT_EQ(graph_pool_bytes(c, m, 64), 2 * 32 * 8 * V * 4 + base);
  EXPECT_EQ(graph_pool_bytes(c, m, 16), 2 * 16 * 8 * V * 4 + base) << "at most the cache's rows";
  EXPECT_EQ(graph_pool_bytes(c, m, 512), 2 * 512 * V * 4 + base) << "the step's rows when they are more";
  c.rollout.draft_tokens = 1;
  EXPECT_EQ(graph_pool_bytes(c, m, 64), 2 * 64 * V * 4 + base) << "runs of 2 at 32 rows: the step's 64 rows";
  EXPECT_EQ(graph_pool_bytes(c, m, 16), 2 * 16 * 2 * V * 4 + base) << "runs of 2 at 16 rows: 32 positions";
  c.rollout.engine.cuda_graphs = false;
  EXPECT_EQ(graph_pool_bytes(c, m, 64), 0);
  c.rollout.engine.cuda_graphs = true;
  c.model.device = "cpu";
  EXPECT_EQ(graph_pool_bytes(c, m, 64), 0);
  // In the plan, at the cache's rows: 4 prompts x 8 samples.
  Config r;
  r.model.device = "cuda";
  r.train.prompts_per_step = 4;
  r.sampling.samples_per_prompt = 8;
  const MemoryPlan p = plan_memory(r, m, 1);
  EXPECT_EQ(p.graph_pool, graph_pool_bytes(r, m, 32));
  EXPECT_EQ(p.rollout_phase(), p.rollout_weights + p.kv_cache + p.graph_pool);
  EXPECT_NE(p.table().find("graph pool"), std::string::npos);
  r.rollout.engine.keep_cache = true;
  EXPECT_EQ(plan_memory(r, m, 1).held_through_update - p.held_through_update,
            p.kv_cache + p.rollout_weights + p.graph_pool)
      << "keep_cache holds the cache, the packed weights and the graphs";
  r.rollout.engine.keep_cache = false;
  EXPECT_EQ(plan_rollout_rank(r, m, 2).graph_pool, graph_pool_bytes(r, m, 16)) << "half the step's rows";
}

// The plan's pool against the pools bench_model measured on one H200 (docs/results/memory_plan_h200.json's
// graph_pools: `bench_model --modes rollout_graph --batch R --prompt-len 256` in bf16, every capture on one
// stream) at 16, 64 and 256 rows of the 0.5B and the 7B: it covers each. The wrong twins it rejects: the
// logits counted once in bf16, and once in fp32 without the temporaries.
TEST(MemoryPlan, GraphPoolCoversTheRecordedPools) {
  Config c;
  c.model.device = "cuda";
  const std::map<std::string, std::map<int64_t, double>> measured_mib = {
      {"qwen2.5-0.5b", {{16, 22}, {64, 60}, {256, 176}}}, {"qwen2.5-7b", {{16, 22}, {64, 64}, {256, 212}}}};
  bool bf16_short = false, fp32_short = false;
  for (const auto& [name, pools] : measured_mib) {
    const ModelConfig m = load_model_config(std::string(RLT_SOURCE_DIR) + "/configs/models/" + name);
    for (const auto& [rows, mib] : pools) {
      const int64_t measured = static_cast<int64_t>(mib * (1 << 20));
      EXPECT_GE(graph_pool_bytes(c, m, rows), measured) << name << ", " << rows << " rows";
      bf16_short |= rows * m.vocab_size * 2 + kGraphPoolTemporaries < measured;
      fp32_short |= rows * m.vocab_size * 4 < measured;
    }
  }
  EXPECT_TRUE(bf16_short) << "the logits once in bf16 must fall short of some measured pool";
  EXPECT_TRUE(fp32_short) << "the logits once in fp32, without temporaries, must fall short of some pool";
}

// The plan's graph pool against DecodeEngine's own (graph_pool_bytes, the allocator's segments of the
// pool), after 300 sampled steps over two spans at 16, 64 and 256 rows, on a bf16 model with Qwen2.5's
// vocabulary, whose logits dominate the pool: the plan covers it. The wrong twin it rejects: the step's
// logits counted once, in fp32, without the temporaries (on an H200 the pools measured 22, 40 and 154 MiB
// with every capture on one stream, where the logits alone are 9, 37 and 148).
TEST(MemoryPlan, GraphPoolCoversTheEnginesOnCuda) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const ModelConfig m = small_config("qwen2", false, 151936, 256, 2, 512);
  const Transformer model(m, at::kBFloat16, at::Device(at::kCUDA), 3);
  Config c;
  c.model.device = "cuda";
  at::manual_seed(3);
  bool twin_short = false;
  for (const int64_t rows : {int64_t(16), int64_t(64), int64_t(256)}) {
    DecodeEngine engine(model);
    const at::Tensor ids = at::randint(0, m.vocab_size, {rows, 8}, at::kLong);
    std::vector<std::vector<int64_t>> prompts(rows);
    std::vector<int64_t> seqs(rows);
    for (int64_t b = 0; b < rows; ++b) {
      prompts[b].assign(ids[b].data_ptr<int64_t>(), ids[b].data_ptr<int64_t>() + 8);
      seqs[b] = b;
    }
    engine.start(prompts, 1);
    SamplingOptions so;
    std::vector<int64_t> next(rows, 1);
    const at::Tensor streams = at::arange(rows, at::kLong);
    for (int64_t t = 0; t < 300; ++t) {
      const SampleOutput d =
          engine.step_draw(seqs, next, so, sample_row_keys(7, streams, at::full({rows}, t, at::kLong)), 0);
      next.assign(d.ids.data_ptr<int64_t>(), d.ids.data_ptr<int64_t>() + rows);
    }
    const int64_t measured = engine.graph_pool_bytes(), planned = graph_pool_bytes(c, m, rows);
    std::cout << rows << " rows: graph pool planned " << bytes_text(planned) << ", measured " << bytes_text(measured)
              << "\n";
    EXPECT_GT(engine.graph_captures(), 1) << rows << " rows";
    EXPECT_LE(measured, planned) << rows << " rows";
    twin_short |= rows * m.vocab_size * 4 < measured;
  }
  EXPECT_TRUE(twin_short) << "the logits once, without temporaries, must fall short of some measured pool";
}

#ifdef RLT_HAVE_CUDA
// A rollout of `rows` rows on a fresh engine: the prefill, then four graphed steps (their captures first).
void decode_rollout(const Transformer& model, int64_t rows) {
  DecodeEngine engine(model);
  std::vector<std::vector<int64_t>> prompts(rows, std::vector<int64_t>{1, 2, 3, 4});
  std::vector<int64_t> seqs(rows), next(rows, 1);
  for (int64_t b = 0; b < rows; ++b) seqs[b] = b;
  engine.start(prompts, 1);
  const at::Tensor streams = at::arange(rows, at::kLong);
  for (int64_t t = 0; t < 4; ++t) {
    const SampleOutput d =
        engine.step_draw(seqs, next, SamplingOptions{}, sample_row_keys(7, streams, at::full({rows}, t, at::kLong)), 0);
    next.assign(d.ids.data_ptr<int64_t>(), d.ids.data_ptr<int64_t>() + rows);
  }
  EXPECT_GE(engine.graph_captures(), 1) << rows << " rows";
  device_synchronize(model.lm_head().device());
}
#endif

// cublas_workspace_pairs, counted by hand: the training thread's stream and the backward's thread, the
// capture stream with CUDA graphs, the async rollout's stream; a rollout rank has no backward and no async
// update. Nothing on the CPU. The plan holds them in both phases. The wrong twin it rejects: one pair per
// capture (two a rollout of the 0.5B, each step adding two more).
TEST(MemoryPlan, CountsCublasWorkspaces) {
  const ModelConfig m = qwen25_7b();
  Config c;
  c.model.device = "cuda";
  const int64_t ws = cublas_workspace_bytes();
  EXPECT_EQ(cublas_workspace_pairs(c), 3);
  const MemoryPlan p = plan_memory(c, m, 1);
  EXPECT_EQ(p.workspaces, 3 * ws);
  Config x = c;
  x.rollout.engine.cuda_graphs = false;
  EXPECT_EQ(cublas_workspace_pairs(x), 2);
  EXPECT_EQ(p.persistent() - plan_memory(x, m, 1).persistent(), ws) << "the capture stream's pair";
  x = c;
  x.train.async = AsyncMode::kOneStep;
  EXPECT_EQ(cublas_workspace_pairs(x), 4);
  x.train.eval_prompts = 8;
  EXPECT_EQ(cublas_workspace_pairs(x), 5) << "the evaluation's captures from the training thread";
  x = c;
  x.train.rollout_ranks = 1;
  x.train.async = AsyncMode::kOneStep;
  EXPECT_EQ(cublas_workspace_pairs(x), 3) << "the rollout ranks decode; the trainer captures the evaluation";
  EXPECT_EQ(plan_rollout_rank(c, m, 2).workspaces, 2 * ws) << "a rollout rank: its thread and the captures";
  EXPECT_NE(p.table().find("cuBLAS"), std::string::npos);
  x = c;
  x.model.device = "cpu";
  EXPECT_EQ(plan_memory(x, m, 1).workspaces, 0);
  EXPECT_EQ(plan_memory(x, m, 1).table().find("cuBLAS"), std::string::npos);
}

// A rollout's graphs are captured on one stream a device: engine after engine, each capturing its step
// graphs, leaves nothing more allocated than the first (cuBLAS keeps a workspace for each stream it runs
// on, for the process). The wrong twin it must catch: a GEMM on a fresh stream of the pool, as each capture
// once ran on, leaves a workspace more allocated.
TEST(MemoryPlan, CapturesLeaveNoWorkspaceBehindOnCuda) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
#ifdef RLT_HAVE_CUDA
  const at::Device cuda(at::kCUDA, 0);
  const ModelConfig m = small_config("qwen2", false, 512, 128, 2, 256);
  const Transformer model(m, at::kBFloat16, cuda, 5);
  auto rollout = [&](int64_t rows) { decode_rollout(model, rows); };
  rollout(8);
  rollout(16);
  const int64_t after_first = PeakMemory::allocated_bytes(cuda);
  for (const int64_t rows : {int64_t(8), int64_t(16), int64_t(8), int64_t(16)}) {
    rollout(rows);
    EXPECT_EQ(PeakMemory::allocated_bytes(cuda), after_first) << "a rollout of " << rows << " rows";
  }
  // The twin: a GEMM on a stream no GEMM has run on.
  const at::Tensor a = at::randn({64, 64}, at::TensorOptions(cuda).dtype(at::kBFloat16));
  cudaStream_t raw = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking), cudaSuccess);
  {
    const c10::cuda::CUDAStreamGuard fresh(c10::cuda::getStreamFromExternal(raw, 0));
    const at::Tensor product = at::mm(a, a);
    device_synchronize(cuda);
  }
  EXPECT_GE(PeakMemory::allocated_bytes(cuda) - after_first - a.nbytes(), int64_t(1) << 20)
      << "a fresh stream's workspace";
#else
  GTEST_SKIP() << "built without CUDA";
#endif
}

// The plan's pairs against ATen's own table of cuBLAS workspaces (one entry a handle and stream) after a
// training micro-batch (the forward on this thread, the backward on autograd's device thread) and a
// graphed rollout on this thread, the table cleared first: cublas_workspace_pairs exactly. The wrong twin
// it must catch: a GEMM on one more stream, one pair more than the plan counts.
TEST(MemoryPlan, CublasWorkspacesAreThePlansPairsOnCuda) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
#ifdef RLT_HAVE_CUDA
  const at::Device cuda(at::kCUDA, 0);
  const ModelConfig m = small_config("qwen2", false, 512, 128, 2, 256);
  const int64_t micro = 4, context = 16;
  Config c = small_run_config(DType::kBFloat16, micro, context);
  c.model.device = "cuda";
  auto entries = [](at::cuda::WorkspaceMapWithMutex& w) {
    const std::shared_lock<std::shared_mutex> lock(w.mutex);
    return static_cast<int64_t>(w.map.size());
  };
  device_synchronize(cuda);
  at::cuda::clearCublasWorkspaces();  // what earlier tests of this process left
  ASSERT_EQ(entries(at::cuda::cublas_handle_stream_to_workspace()), 0);
  rlt::Run run;
  run.config = c;
  run.device = cuda;
  run.model.policy = std::make_unique<Transformer>(m, at::kBFloat16, cuda, /*seed=*/0);
  const std::vector<Trajectory> trajs = trajectories(micro, context, m.vocab_size);
  micro_batch(run, trajs, 0, micro, true);
  device_synchronize(cuda);
  decode_rollout(*run.model.policy, 8);
  const int64_t pairs = cublas_workspace_pairs(c);
  EXPECT_EQ(entries(at::cuda::cublas_handle_stream_to_workspace()), pairs);
  EXPECT_LE(entries(at::cuda::cublaslt_handle_stream_to_workspace()), pairs);
  cudaStream_t raw = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking), cudaSuccess);
  {
    const c10::cuda::CUDAStreamGuard other(c10::cuda::getStreamFromExternal(raw, 0));
    const at::Tensor a = at::randn({64, 64}, at::TensorOptions(cuda).dtype(at::kBFloat16));
    const at::Tensor product = at::mm(a, a);
    device_synchronize(cuda);
  }
  EXPECT_EQ(entries(at::cuda::cublas_handle_stream_to_workspace()), pairs + 1) << "a GEMM on one more stream";
#else
  GTEST_SKIP() << "built without CUDA";
#endif
}

// train.offload_step device: the optimizer step streams the host state through chunk slots made for the
// step. Its peak over the step's start is the plan's optimizer_step, and the device holds none of it after.
// The host step's peak is the gradient norm's temporaries, which the plan bounds (it counts the CPU's cast
// of the squares to float64; a CUDA reduction casts as it reads).
TEST(MemoryPlan, OffloadStepOnCudaHoldsItsSlotsOnlyWhileItRuns) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const at::Device cuda(at::kCUDA, 0);
  const ModelConfig m = small_config("llama", false, /*vocab=*/256, /*hidden=*/256, /*layers=*/4, 768);
  const std::vector<Trajectory> trajs = trajectories(4, 8, m.vocab_size);
  Config c = small_run_config(DType::kBFloat16, 4, /*context=*/8);
  c.model.device = "cuda";
  c.train.offload = Offload::kOptimizer;
  std::map<OffloadStep, int64_t> peak, planned, kept;  // kept: what the first step leaves allocated
  for (const OffloadStep mode : {OffloadStep::kHost, OffloadStep::kDevice}) {
    const std::string name = enum_to_string(mode);
    c.train.offload_step = mode;
    rlt::Run run;
    run.config = c;
    run.device = cuda;
    run.model.policy = std::make_unique<Transformer>(m, at::kBFloat16, cuda, /*seed=*/0);
    make_optimizer(run, {});
    int64_t after = 0;
    for (int step = 0; step < 2; ++step) {  // the second: every lazily made buffer exists
      zero_gradients(run.model);
      micro_batch(run, trajs, 0, 4, /*ends_step=*/true);
      device_synchronize(cuda);
      PeakMemory measured(cuda);
      apply_gradients(run, at::zeros({}), /*total_optimizer_steps=*/10);
      device_synchronize(cuda);
      peak[mode] = measured.peak_extra_bytes();
      after = PeakMemory::allocated_bytes(cuda) - (measured.peak_bytes() - peak[mode]);
      if (step == 0) kept[mode] = after;
    }
    planned[mode] = plan_memory(c, m, 1).optimizer_step;
    std::cout << name << ": optimizer step planned " << planned[mode] << ", measured " << peak[mode] << ", held after "
              << after << "\n";
    EXPECT_LE(after, 0) << name << ": the step leaves nothing of its own on the device";
  }
  const OffloadStep host = OffloadStep::kHost, device = OffloadStep::kDevice;
  EXPECT_LT(off(planned[device], peak[device]), 0.10);
  EXPECT_LE(peak[host], planned[host]);
  // The first step makes what both modes make lazily; the streamed one keeps no slots beyond it.
  EXPECT_LE(kept[device], kept[host]);
  // Twins: the streamed step planned as the host's (the slots forgotten), and measured as if nothing
  // streamed (the host step's peak).
  EXPECT_GT(off(planned[host], peak[device]), 0.10) << "the slots forgotten";
  EXPECT_GT(off(planned[device], peak[host]), 0.10) << "nothing streamed through the device";
}

// The suggestions of a refusal: "key: value" lines after "What fits", as --set overrides.
std::vector<std::string> suggested_overrides(const std::string& message) {
  std::vector<std::string> out;
  std::istringstream in(message);
  std::string line;
  bool listing = false;
  while (std::getline(in, line)) {
    if (line.rfind("What fits", 0) == 0) {
      listing = true;
      continue;
    }
    if (!listing || line.size() < 3) continue;
    const size_t colon = line.find(": "), paren = line.find(" (");
    if (colon == std::string::npos || paren == std::string::npos) continue;
    const size_t b = line.find_first_not_of(' ');
    out.push_back(line.substr(b, colon - b) + "=" + line.substr(colon + 2, paren - colon - 2));
  }
  return out;
}

// check_memory_plan's message for `overrides` on `budget`, or "" when the plan fits.
std::string refusal(const std::vector<std::string>& overrides, const ModelConfig& m, int world, int64_t budget) {
  const Config c = load_config("", overrides);
  const MemoryPlan plan = plan_memory(c, m, world);
  try {
    check_memory_plan(plan, c, m, world, budget);
  } catch (const RunError& e) {
    return e.what();
  }
  return "";
}

std::string gib_text(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", double(bytes) / double(kGiB));
  return buf;
}

// The 7B run of the tests: 16 prompts x 8 samples a step, 32 rows at a time in the rollout, 4096 tokens of
// context, micro-batches of 2 sequences through checkpointed layers and CCE.
std::vector<std::string> seven_b_run() {
  return {"model.dtype=bfloat16",
          "model.device=cuda",
          "model.activation_checkpointing=true",
          "loss.impl=cce",
          "train.prompts_per_step=16",
          "sampling.samples_per_prompt=8",
          "rollout.max_context=4096",
          "rollout.max_batch=32",
          "train.micro_batch_size=2"};
}

TEST(MemoryPlan, RefusesAPlanOverTheDeviceAndSuggestsWhatFits) {
  const ModelConfig m = qwen25_7b();
  const std::vector<std::string> base = seven_b_run();
  const Config c = load_config("", base);
  const MemoryPlan plan = plan_memory(c, m, 1);
  // Full fine-tuning with shard none: 18 bytes a parameter before any activation; over 80 GiB.
  EXPECT_GT(plan.weights + plan.gradients + plan.masters + plan.moments, 18 * plan.parameters - 1);
  const std::string msg = refusal(base, m, 1, 80 * kGiB);
  ASSERT_FALSE(msg.empty()) << "a 7B full fine-tune on one 80 GiB device must be refused";
  std::cout << msg << "\n";
  EXPECT_NE(msg.find(gib_text(plan.device_total())), std::string::npos) << msg;
  EXPECT_NE(msg.find("80.00"), std::string::npos) << msg;
  EXPECT_NE(msg.find("weights"), std::string::npos) << msg;
  const std::vector<std::string> fixes = suggested_overrides(msg);
  ASSERT_FALSE(fixes.empty()) << msg;
  EXPECT_NE(std::find(fixes.begin(), fixes.end(), "lora.rank=64"), fixes.end()) << msg;
  for (const std::string& fix : fixes) {
    std::vector<std::string> o = base;
    o.push_back(fix);
    EXPECT_EQ(refusal(o, m, 1, 80 * kGiB), "") << fix << " was suggested but does not fit";
  }
  // With LoRA rank 64 the same run fits in 60 GiB.
  std::vector<std::string> lora = base;
  lora.push_back("lora.rank=64");
  EXPECT_LE(plan_memory(load_config("", lora), m, 1).device_total(), 60 * kGiB);
  EXPECT_EQ(refusal(lora, m, 1, 60 * kGiB), "");

  // Micro-batches of 128 sequences of 4,096 tokens under LoRA on 60 GiB: a token budget is suggested, and it is
  // the largest on its 1,024-token grid (1,024 more does not fit).
  std::vector<std::string> wide = lora;
  wide.push_back("train.micro_batch_size=128");
  const std::string msg_wide = refusal(wide, m, 1, 60 * kGiB);
  ASSERT_FALSE(msg_wide.empty()) << "128 checkpointed sequences of 4,096 tokens";
  std::cout << msg_wide << "\n";
  int64_t budget = 0;
  for (const std::string& fix : suggested_overrides(msg_wide)) {
    if (fix.rfind("train.micro_batch_tokens=", 0) == 0) budget = std::stoll(fix.substr(fix.find('=') + 1));
  }
  ASSERT_GT(budget, 4096) << msg_wide;
  EXPECT_EQ(budget % 1024, 0);
  std::vector<std::string> more = wide;
  more.push_back("train.micro_batch_tokens=" + std::to_string(budget + 1024));
  EXPECT_NE(refusal(more, m, 1, 60 * kGiB), "") << "a larger budget fits: the suggestion is not the largest";

  // Over eight ranks, a shard stage is among the suggestions, and every suggestion fits.
  const std::string msg8 = refusal(base, m, 8, 80 * kGiB);
  ASSERT_FALSE(msg8.empty());
  std::cout << msg8 << "\n";
  const std::vector<std::string> fixes8 = suggested_overrides(msg8);
  bool shard = false;
  for (const std::string& fix : fixes8) {
    shard = shard || fix.rfind("train.shard=", 0) == 0;
    std::vector<std::string> o = base;
    o.push_back(fix);
    EXPECT_EQ(refusal(o, m, 8, 80 * kGiB), "") << fix << " was suggested but does not fit";
  }
  EXPECT_TRUE(shard) << msg8;

  // A plan under the budget passes; the CPU (0 bytes) is never checked.
  EXPECT_EQ(refusal(base, m, 1, plan.device_total()), "");
  EXPECT_NE(refusal(base, m, 1, plan.device_total() - 1), "");
  EXPECT_EQ(refusal(base, m, 1, 0), "");
}

// "No single change fits; together, a: x, b: y plan N GiB." -> {"a=x", "b=y"}.
std::vector<std::string> combined_overrides(const std::string& message) {
  const std::string lead = "No single change fits; together, ";
  const size_t b = message.find(lead), e = message.find(" plan ", b);
  if (b == std::string::npos || e == std::string::npos) return {};
  std::vector<std::string> out;
  std::istringstream in(message.substr(b + lead.size(), e - b - lead.size()));
  std::string part;
  while (std::getline(in, part, ',')) {
    part = part.substr(part.find_first_not_of(' '));
    const size_t colon = part.find(": ");
    out.push_back(part.substr(0, colon) + "=" + part.substr(colon + 2));
  }
  return out;
}

TEST(MemoryPlan, NamesACombinationWhenNoSingleChangeFits) {
  const ModelConfig m = qwen25_7b();
  // Every prompt's samples in the cache at once (128 rows of 4096 tokens), no checkpointing, selective.
  const std::vector<std::string> base = {"model.dtype=bfloat16",      "model.device=cuda",
                                         "train.prompts_per_step=16", "sampling.samples_per_prompt=8",
                                         "rollout.max_context=4096",  "train.micro_batch_size=2"};
  const std::string msg = refusal(base, m, 1, 48 * kGiB);
  std::cout << msg << "\n";
  const std::vector<std::string> together = combined_overrides(msg);
  ASSERT_FALSE(together.empty()) << msg;
  EXPECT_TRUE(suggested_overrides(msg).empty()) << msg;
  std::vector<std::string> o = base;
  o.insert(o.end(), together.begin(), together.end());
  EXPECT_EQ(refusal(o, m, 1, 48 * kGiB), "") << "the combination was suggested but does not fit";
  // Twins: without any one of its changes the combination does not fit.
  for (size_t i = 0; i < together.size(); ++i) {
    std::vector<std::string> fewer = base;
    for (size_t j = 0; j < together.size(); ++j) {
      if (j != i) fewer.push_back(together[j]);
    }
    EXPECT_NE(refusal(fewer, m, 1, 48 * kGiB), "") << "fits without " << together[i];
  }
  // 12 GiB holds not even the bf16 weights: nothing fits, and the message says what is left.
  const std::string none = refusal(base, m, 1, 12 * kGiB);
  std::cout << none << "\n";
  EXPECT_NE(none.find("Nothing fits"), std::string::npos) << none;
  EXPECT_NE(none.find("more ranks"), std::string::npos) << none;
}

TEST(MemoryPlan, TablePrintsEachItemInGiB) {
  const Config c = load_config("", seven_b_run());
  const MemoryPlan plan = plan_memory(c, qwen25_7b(), 1);
  const std::string t = plan.table();
  std::cout << t;
  for (const char* item :
       {"weights", "gradients", "masters", "moments", "rollout weights", "kv cache", "activations", "device total"}) {
    EXPECT_NE(t.find(item), std::string::npos) << item << "\n" << t;
  }
  EXPECT_NE(t.find(gib_text(plan.weights) + " GiB"), std::string::npos) << t;
  EXPECT_NE(t.find(gib_text(plan.device_total()) + " GiB"), std::string::npos) << t;
  // 2 bytes a parameter: 14.19 GiB of bf16 weights.
  EXPECT_EQ(gib_text(plan.weights), "14.19");
  EXPECT_NE(t.find("(" + count_text(plan.parameters) + " parameters"), std::string::npos) << t;
}

// The header's counts in the unit that fits them: the demo's 0.83M-parameter model is not "0.00B".
TEST(MemoryPlan, CountsPrintInTheUnitThatFits) {
  EXPECT_EQ(count_text(832000), "0.83M");
  EXPECT_EQ(count_text(99999), "99999");
  EXPECT_EQ(count_text(100000), "0.10M");
  EXPECT_EQ(count_text(1000000), "1.00M");
  EXPECT_EQ(count_text(999000000), "999M");
  EXPECT_EQ(count_text(45700000), "45.7M");
  EXPECT_EQ(count_text(494032768), "494M");
  EXPECT_EQ(count_text(7615616512), "7.62B");
  EXPECT_EQ(count_text(32763876352), "32.8B");
  EXPECT_EQ(count_text(0), "0");
  EXPECT_EQ(bytes_text(0), "0 B");
  EXPECT_EQ(bytes_text(1023), "1023 B");
  EXPECT_EQ(bytes_text(1024), "1.00 KiB");
  EXPECT_EQ(bytes_text(461312), "450 KiB");
  EXPECT_EQ(bytes_text(int64_t(1) << 20), "1.00 MiB");
  EXPECT_EQ(bytes_text(int64_t(65) << 30), "65.0 GiB");
  EXPECT_EQ(bytes_text(int64_t(590) << 30), "590 GiB");
}

// train.async: the rollout's copy of the weights is held, and the rollout and the update hold their memory
// at once. Twin: a plan that still takes the larger of the two phases.
TEST(MemoryPlan, AsyncAddsTheRolloutsCopyAndBothPhases) {
  auto overrides = seven_b_run();
  const MemoryPlan in_turn = plan_memory(load_config("", overrides), qwen25_7b(), 1);
  overrides.push_back("train.async=one_step");
  const MemoryPlan async = plan_memory(load_config("", overrides), qwen25_7b(), 1);
  EXPECT_EQ(async.rollout_weights - in_turn.rollout_weights, 2 * parameter_count(qwen25_7b()));
  const int64_t expected = async.persistent() + async.rollout_phase() + async.update_phase();
  EXPECT_EQ(async.device_total(), expected);
  MemoryPlan twin = async;
  twin.phases_overlap = false;
  EXPECT_NE(twin.device_total(), expected);
}

// model.checkpoint_layers: the activations shrink as more layers are checkpointed, from none (0) to every
// layer but the last; the last one's recompute comes as the backward starts, beside every other layer's
// saved input, so under CCE's small head checkpointing it saves nothing (every layer: the plan of -1), and
// in the ATen forms costs its input's fp32 copy. On a
// device that fits with fewer, fewest_checkpointed_layers names the fewest within 90% of it (one fewer
// does not fit), and nothing when every layer is needed or none is checkpointed. The 7B LoRA run with
// micro-batches of 8, so that the update's phase sets the peak.
TEST(MemoryPlan, CheckpointedLayersTradeMemoryForRecompute) {
  const ModelConfig m = qwen25_7b();
  const int64_t L = m.num_layers;
  std::vector<std::string> o = seven_b_run();
  o.push_back("lora.rank=64");
  o.push_back("train.micro_batch_size=8");
  auto plan = [&](int64_t n) {
    std::vector<std::string> x = o;
    x.push_back("model.checkpoint_layers=" + std::to_string(n));
    return plan_memory(load_config("", x), m, 1);
  };
  for (int64_t n = 1; n < L; ++n) EXPECT_LT(plan(n).activations, plan(n - 1).activations) << n << " layers";
  // The fused input norm saves the very tensor CheckpointFn saved; the ATen one in bf16 an fp32 copy too.
  EXPECT_EQ(plan(L).activations, plan(L - 1).activations) << "the last layer's checkpoint saves nothing";
  EXPECT_EQ(plan(L).activations, plan(-1).activations);
  {
    std::vector<std::string> aten = o;
    aten.push_back("model.fused_kernels=false");
    auto plan_aten = [&](int64_t n) {
      std::vector<std::string> x = aten;
      x.push_back("model.checkpoint_layers=" + std::to_string(n));
      return plan_memory(load_config("", x), m, 1).activations;
    };
    EXPECT_GT(plan_aten(L), plan_aten(L - 1)) << "in the ATen forms it costs the input's fp32 copy";
  }
  const Config all = load_config("", o);
  ASSERT_GT(plan(0).update_phase(), plan(0).rollout_phase());
  const int64_t device = (plan(L / 2).device_total() + 8) / 9 * 10 + 10;  // half the layers fit in 90% of it
  const int64_t fewest = fewest_checkpointed_layers(all, m, 1, device);
  ASSERT_GT(fewest, 0);
  EXPECT_LE(fewest, L / 2);
  EXPECT_LE(plan(fewest).device_total(), device / 10 * 9);
  EXPECT_GT(plan(fewest - 1).device_total(), device / 10 * 9) << "one fewer fits too";
  EXPECT_EQ(fewest_checkpointed_layers(all, m, 1, plan(L).device_total()), -1) << "every layer is needed";
  EXPECT_EQ(fewest_checkpointed_layers(all, m, 1, 0), -1) << "no device size known";
  Config none = all;
  none.model.activation_checkpointing = false;
  EXPECT_EQ(fewest_checkpointed_layers(none, m, 1, device), -1) << "nothing is checkpointed";
  // train.shard parameters recomputes every layer: a count is refused, so none is suggested.
  Config sharded = all;
  sharded.train.shard = ShardStage::kParameters;
  ASSERT_GT(fewest_checkpointed_layers(all, m, 1, device), 0) << "the same plan unsharded names a count";
  EXPECT_EQ(fewest_checkpointed_layers(sharded, m, 1, plan(L).device_total() * 4), -1);
  Config critic = all;  // a separate critic sharded at parameters recomputes every layer too
  critic.critic.shared = false;
  critic.critic.shard = CriticShard::kParameters;
  EXPECT_EQ(fewest_checkpointed_layers(critic, m, 1, plan(L).device_total() * 4), -1);
  critic.critic.shared = true;  // then no critic is made: its shard is not read
  EXPECT_GT(fewest_checkpointed_layers(critic, m, 1, device), 0);
  EXPECT_THROW(
      load_config("", {"model.activation_checkpointing=true", "train.shard=parameters", "model.checkpoint_layers=3"}),
      std::exception);
}

// A token budget sizes the update's activations by its tokens: a budget of one context plans what one row a
// micro-batch plans, and a budget above the rows' tokens changes nothing (micro_batch_size still caps them).
TEST(MemoryPlan, ATokenBudgetPlansTheTokensItHolds) {
  auto with = [](std::vector<std::string> extra) {
    auto o = seven_b_run();
    o.insert(o.end(), extra.begin(), extra.end());
    return plan_memory(load_config("", o), qwen25_7b(), 1).activations;
  };
  const int64_t two_rows = with({}), one_row = with({"train.micro_batch_size=1"});
  ASSERT_GT(two_rows, one_row);
  EXPECT_EQ(with({"train.micro_batch_tokens=4096"}), one_row);
  EXPECT_EQ(with({"train.micro_batch_tokens=1000"}), one_row) << "a longer sequence runs alone";
  EXPECT_EQ(with({"train.micro_batch_tokens=100000"}), two_rows);
}

TEST(MemoryPlan, PartialRolloutsHoldTheExtraGroupsRows) {
  // rollout.partial keeps partial_extra_prompts groups in play beyond the step's: with every row at once,
  // the cache grows by their share; rollout.max_batch caps the rows either way.
  auto overrides = seven_b_run();
  overrides.insert(overrides.end(),
                   {"train.async=one_step", "rollout.max_batch=0", "train.prompts_per_step=8", "train.eval_prompts=0"});
  const MemoryPlan one_step = plan_memory(load_config("", overrides), qwen25_7b(), 1);
  auto partial = overrides;
  partial.push_back("rollout.partial=true");
  const MemoryPlan carried = plan_memory(load_config("", partial), qwen25_7b(), 1);
  EXPECT_EQ(carried.kv_cache * 8, one_step.kv_cache * 10) << "8 prompts and a quarter of them more";
  partial.push_back("rollout.partial_extra_prompts=4");
  EXPECT_EQ(plan_memory(load_config("", partial), qwen25_7b(), 1).kv_cache * 8, one_step.kv_cache * 12);
  partial.push_back("rollout.max_batch=16");
  overrides.push_back("rollout.max_batch=16");
  EXPECT_EQ(plan_memory(load_config("", partial), qwen25_7b(), 1).kv_cache,
            plan_memory(load_config("", overrides), qwen25_7b(), 1).kv_cache);
}

}  // namespace
}  // namespace rlt
