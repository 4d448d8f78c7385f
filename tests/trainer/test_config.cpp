// The config reader: defaults, layered files (--config repeated, `defaults:`), --set overrides, the
// markdown reference, and a clear error (key + file:line) for every kind of bad input the apps must
// reject with exit code 2.
#include <gtest/gtest.h>

#include <CLI/CLI.hpp>
#include <filesystem>
#include <fstream>

#include "trainer/config.h"

namespace rlt {
namespace {

namespace fs = std::filesystem;

// `name` may hold folders (made as needed) under the test's temporary folder.
std::string write_yaml(const std::string& name, const std::string& text) {
  const fs::path p = fs::temp_directory_path() / "rlt_test_config" / name;
  fs::create_directories(p.parent_path());
  std::ofstream(p) << text;
  return p.string();
}

// The ConfigError message of loading `paths` with `sets`, or "" when it loads.
std::string error_of(const std::vector<std::string>& paths, const std::vector<std::string>& sets) {
  try {
    load_config(paths, sets);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

// Expects loading the files to throw a ConfigError whose message contains every fragment and none of
// `absent`.
void expect_error(const std::vector<std::string>& paths, const std::vector<std::string>& sets,
                  const std::vector<std::string>& fragments, const std::vector<std::string>& absent = {}) {
  const std::string msg = error_of(paths, sets);
  if (msg.empty()) {
    ADD_FAILURE() << "no error for " << (paths.empty() ? std::string("(no file)") : paths.back());
    return;
  }
  for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "'" << f << "' not in: " << msg;
  for (const auto& f : absent) EXPECT_EQ(msg.find(f), std::string::npos) << "'" << f << "' in: " << msg;
}
void expect_error(const std::string& path, const std::vector<std::string>& sets,
                  const std::vector<std::string>& fragments) {
  expect_error(path.empty() ? std::vector<std::string>{} : std::vector<std::string>{path}, sets, fragments);
}

TEST(Config, DefaultsWithoutAFile) {
  Config c = load_config("", {});
  EXPECT_EQ(c.loss.impl, LogprobImpl::kSelective);
  EXPECT_TRUE(c.loss.response_only);
  EXPECT_FALSE(c.loss.loss_mask_only);
  EXPECT_EQ(c.loss.chunk_size, 0);
  EXPECT_EQ(c.objective.agg, LossAgg::kTokenMean);
}

// --print-config of the defaults, read back, is the defaults: the printed YAML is a complete config.
TEST(Config, PrintedDefaultsReadBackAsTheDefaults) {
  const std::string p = write_yaml("defaults.yaml", describe_config(Config{}));
  EXPECT_EQ(describe_config(load_config(p, {})), describe_config(Config{}));
  // The control: one changed value in the printed file shows in what it reads back.
  std::string changed = describe_config(Config{});
  const std::string from = "impl: selective", to = "impl: cce";
  ASSERT_NE(changed.find(from), std::string::npos);
  changed.replace(changed.find(from), from.size(), to);
  EXPECT_NE(describe_config(load_config(write_yaml("changed.yaml", changed), {})), describe_config(Config{}));
}

TEST(Config, FileThenOverrides) {
  const std::string p = write_yaml("ok.yaml",
                                   "loss:\n  impl: cce\n  chunk_size: 256\n  loss_mask_only: true\n"
                                   "objective:\n  clip_eps_high: 0.28\n  agg: seq-mean-token-mean\n");
  Config c = load_config(p, {"loss.chunk_size=512", "sampling.temperature=0.7", "objective.kl_estimator=k1"});
  EXPECT_EQ(c.loss.impl, LogprobImpl::kCce);
  EXPECT_EQ(c.loss.chunk_size, 512) << "--set wins over the file";
  EXPECT_TRUE(c.loss.loss_mask_only);
  EXPECT_DOUBLE_EQ(c.sampling.temperature, 0.7);
  EXPECT_DOUBLE_EQ(c.objective.clip_eps_high, 0.28);
  EXPECT_EQ(c.objective.agg, LossAgg::kSeqMeanTokenMean);
  EXPECT_EQ(c.objective.kl_estimator, KlEstimator::kK1);
}

TEST(Config, DescribeRoundTrips) {
  Config c = load_config("", {"loss.impl=naive", "loss.entropy=grad", "objective.clip_c=3"});
  const std::string p = write_yaml("roundtrip.yaml", describe_config(c));
  EXPECT_EQ(describe_config(load_config(p, {})), describe_config(c));
}

TEST(Config, UnknownKeyNamesFileLineAndKnownKeys) {
  const std::string p = write_yaml("unknown.yaml", "loss:\n  impl: cce\n  chunk: 3\n");
  expect_error(p, {}, {p + ":3", "loss.chunk", "unknown key", "chunk_size"});
}

TEST(Config, UnknownSection) {
  const std::string p = write_yaml("section.yaml", "los:\n  impl: cce\n");
  expect_error(p, {}, {p + ":1", "los", "unknown section", "loss, objective"});
}

// A section read under its older name (Config::renamed_sections) lands in the new one, with one warning
// line per key naming the new key and where the old one was written.
TEST(Config, ARenamedSectionIsReadWithAWarningNamingTheNewKey) {
  const std::string p = write_yaml("renamed.yaml", "policy:\n  kl_coef: 0.05\n");
  ::testing::internal::CaptureStderr();
  const Config c = load_config(p, {"policy.agg=seq-mean-token-mean"});
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_DOUBLE_EQ(c.objective.kl_coef, 0.05);
  EXPECT_EQ(c.objective.agg, LossAgg::kSeqMeanTokenMean);
  EXPECT_NE(err.find(p + ":2: policy.kl_coef is objective.kl_coef"), std::string::npos) << err;
  EXPECT_NE(err.find("policy.agg is objective.agg"), std::string::npos) << err;
  size_t lines = 0;
  for (size_t at = err.find("warning: "); at != std::string::npos; at = err.find("warning: ", at + 1)) ++lines;
  EXPECT_EQ(lines, 2u) << err;
  // The controls: both values differ from the defaults, and a key the section lacks is still refused
  // under the old name, naming the new section's keys.
  EXPECT_NE(Config{}.objective.kl_coef, 0.05);
  EXPECT_NE(Config{}.objective.agg, LossAgg::kSeqMeanTokenMean);
  ::testing::internal::CaptureStderr();
  expect_error("", {"policy.kl_coeff=0.1"}, {"objective.kl_coeff", "unknown key", "kl_coef"});
  ::testing::internal::GetCapturedStderr();
}

TEST(Config, WrongTypes) {
  expect_error(write_yaml("t1.yaml", "loss:\n  response_only: maybe\n"), {},
               {":2", "loss.response_only", "true or false"});
  expect_error(write_yaml("t2.yaml", "loss:\n\n  chunk_size: 1.5\n"), {}, {":3", "loss.chunk_size", "integer"});
  expect_error(write_yaml("t3.yaml", "sampling:\n  temperature: hot\n"), {}, {":2", "sampling.temperature", "number"});
  expect_error(write_yaml("t4.yaml", "loss:\n  impl: fast\n"), {}, {":2", "loss.impl", "naive | selective | cce"});
  expect_error("", {"train.old_logprobs=cached"},
               {"--set train.old_logprobs=cached", "train.old_logprobs", "rollout | recompute"});
  expect_error(write_yaml("t5.yaml", "loss:\n  impl: [cce]\n"), {}, {":2", "loss.impl", "single value"});
  expect_error(write_yaml("t6.yaml", "loss: 3\n"), {}, {":1", "loss", "mapping"});
}

TEST(Config, OutOfRange) {
  expect_error(write_yaml("r1.yaml", "loss:\n  chunk_size: -1\n"), {}, {":2", "loss.chunk_size", "out of range"});
  expect_error("", {"sampling.temperature=-1"}, {"--set sampling.temperature=-1", "out of range"});
  expect_error("", {"objective.clip_eps_low=2"}, {"objective.clip_eps_low", "out of range"});
  expect_error("", {"train.eval_temperature=-0.5"}, {"train.eval_temperature", "-1 (automatic) or >= 0"});
  EXPECT_NO_THROW(load_config("", {"train.eval_temperature=-1"}));
  EXPECT_NO_THROW(load_config("", {"train.eval_temperature=0.6"}));
}

TEST(Config, CrossFieldRulesNameTheKeyAndWhereItWasSet) {
  const std::string p = write_yaml("mask.yaml", "loss:\n  response_only: false\n  loss_mask_only: true\n");
  expect_error(p, {}, {p + ":3", "loss.loss_mask_only", "response_only"});
  expect_error("", {"loss.response_only=false", "loss.loss_mask_only=true"},
               {"--set loss.loss_mask_only=true", "loss.loss_mask_only"});
  expect_error("", {"objective.clip_c=0.5"}, {"objective.clip_c"});
  expect_error("", {"objective.agg=seq-mean-token-sum-norm"}, {"objective.agg_norm"});
  // Rules across sections: the trainer scores what was sampled, a JSONL source needs a file, an entropy
  // bonus needs the entropy's gradient.
  // One value per setting: the trainer's log-probs use sampling.temperature, so `loss:` has no temperature
  // key, and the noise seed derives from train.seed, so `sampling:` has no seed key.
  expect_error("", {"loss.temperature=0.7"}, {"loss.temperature", "unknown key"});
  expect_error("", {"sampling.seed=3"}, {"sampling.seed", "unknown key"});
  expect_error("", {"train.prompts=jsonl"}, {"data.path", "jsonl"});
  expect_error("", {"objective.entropy_coef=0.01", "loss.entropy=value"}, {"loss.entropy", "grad"});
  // TIS / IcePop weigh by exp(logprobs_old - logprobs_rollout): 1 when the old log-probs are the rollout's.
  expect_error("", {"objective.tis=2"}, {"train.old_logprobs", "recompute"});
  expect_error("", {"objective.icepop_low=0.5", "objective.icepop_high=2"}, {"train.old_logprobs", "recompute"});
  EXPECT_NO_THROW(load_config("", {"objective.tis=2", "train.old_logprobs=recompute"}));
  EXPECT_NO_THROW(load_config("", {"sampling.temperature=0", "objective.entropy_coef=0.01", "loss.entropy=grad"}))
      << "greedy sampling scores at any temperature";
  // The sharded state: the parameters stage recomputes each layer, keeps the base whole under LoRA, and the
  // state always keeps fp32 masters; the warm-up trains whole fp32 weights.
  expect_error("", {"train.shard=parameters"}, {"train.shard", "activation_checkpointing"});
  expect_error("", {"train.shard=parameters", "model.activation_checkpointing=true", "lora.rank=8"},
               {"train.shard", "LoRA"});
  expect_error("", {"train.shard=gradients", "model.dtype=bfloat16", "train.master_weights=none"},
               {"train.master_weights", "fp32 masters"});
  expect_error("", {"train.offload=optimizer", "model.dtype=bfloat16", "sft.steps=5"}, {"sft.steps"});
  expect_error("", {"lora.targets=q,ffn"}, {"lora.targets", "ffn"});
  EXPECT_NO_THROW(load_config("", {"train.shard=parameters", "model.activation_checkpointing=true"}));
  EXPECT_NO_THROW(load_config("", {"train.shard=gradients", "sft.steps=5"})) << "an fp32 warm-up under sharding";
  EXPECT_NO_THROW(load_config("", {"train.offload=optimizer", "lora.rank=8"}));
  // train.phase_offload moves the optimizer state out while the rollout runs, between updates.
  expect_error("", {"train.phase_offload=optimizer", "train.async=one_step"}, {"train.phase_offload", "train.async"});
  expect_error("", {"train.phase_offload=optimizer", "train.rollout_ranks=1"},
               {"train.phase_offload", "train.rollout_ranks"});
  expect_error("", {"train.phase_offload=optimizer", "train.offload=optimizer"},
               {"train.phase_offload", "host memory already"});
  expect_error("", {"train.phase_offload=training_state"}, {"train.phase_offload", "training_state", "train.shard"});
  expect_error("", {"train.phase_offload=training_state", "train.shard=gradients", "train.async=one_step"},
               {"train.phase_offload", "train.async"});
  EXPECT_NO_THROW(load_config("", {"train.phase_offload=optimizer", "train.shard=gradients"}));
  EXPECT_NO_THROW(load_config(
      "", {"train.phase_offload=training_state", "train.shard=parameters", "model.activation_checkpointing=true"}));
  EXPECT_NO_THROW(load_config("", {"train.phase_offload=training_state", "train.offload=optimizer"}))
      << "the chunks offload leaves on the device";
  // train.offload_step device streams train.offload's host state through the run's GPU.
  expect_error("", {"train.offload_step=device", "model.device=cuda"},
               {"train.offload_step", "train.offload: optimizer"});
  expect_error("", {"train.offload_step=device", "train.offload=optimizer"},
               {"train.offload_step", "model.device is cpu"});
  expect_error("", {"train.offload_step=gpu"}, {"train.offload_step", "gpu"});
  EXPECT_NO_THROW(load_config("", {"train.offload_step=device", "train.offload=optimizer", "model.device=cuda:1"}));
  EXPECT_NO_THROW(load_config("", {"train.offload_step=host", "train.offload=optimizer"}));
  // Partial rollouts carry groups into the next step's rollout, which runs beside the update; dynamic
  // sampling's rounds draw whole groups. A trajectory spans at least its own version and the next.
  expect_error("", {"rollout.partial=true"}, {"rollout.partial", "train.async: one_step"});
  expect_error("", {"rollout.partial=true", "train.async=one_step", "train.dynamic_sampling=true"},
               {"rollout.partial", "train.dynamic_sampling"});
  expect_error("", {"rollout.partial=true", "train.async=one_step", "rollout.max_staleness=1"},
               {"rollout.max_staleness"});
  expect_error("", {"rollout.partial=true", "train.async=one_step", "rollout.partial_extra_prompts=17"},
               {"rollout.partial_extra_prompts", "train.prompts_per_step (16)"});
  EXPECT_NO_THROW(load_config("", {"rollout.partial=true", "train.async=one_step"}));
  EXPECT_NO_THROW(
      load_config("", {"rollout.partial=true", "train.async=one_step", "rollout.partial_extra_prompts=16"}));
}

// PPO's separate critic: its folder and its start are read before anything loads.
TEST(Config, ASeparateCriticNamesWhatItLacks) {
  expect_error("", {"critic.shared=false", "critic.init=path"}, {"critic.path", "folder is needed"});
  expect_error("", {"critic.path=/somewhere"}, {"critic.path", "critic.init: path"});
  expect_error("", {"critic.shared=false", "critic.init=reward_model"}, {"critic.init", "reward.model_path"});
  expect_error("", {"critic.shared=false", "critic.shard=parameters"}, {"critic.shard", "activation_checkpointing"});
  expect_error("", {"critic.shared=false", "critic.init=path", "critic.path=/nonexistent/critic"},
               {"critic.path", "/nonexistent/critic"});
  expect_error("", {"critic.shard=everything"}, {"critic.shard", "everything"});
  // A folder whose score head has two labels.
  const fs::path two = fs::path(write_yaml("two/config.json", "")).parent_path();
  std::ofstream(two / "config.json") << R"({"model_type": "qwen2", "architectures": ["Qwen2ForTokenClassification"],
    "id2label": {"0": "a", "1": "b"}, "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1})";
  expect_error("", {"critic.shared=false", "critic.init=path", "critic.path=" + two.string()},
               {"critic.path", "2 labels", "one output"});
  expect_error("",
               {"critic.shared=false", "critic.shard=parameters", "model.activation_checkpointing=true",
                "model.checkpoint_layers=2"},
               {"model.checkpoint_layers", "critic"});
  EXPECT_NO_THROW(load_config("", {"critic.shared=false"}));
  EXPECT_NO_THROW(load_config("", {"critic.shared=false", "lora.rank=8"}));  // a whole critic beside adapters
  EXPECT_NO_THROW(
      load_config("", {"critic.shared=false", "critic.shard=parameters", "model.activation_checkpointing=true"}));
}

TEST(Config, MissingFileAndBadSyntax) {
  expect_error("/nonexistent/x.yaml", {}, {"/nonexistent/x.yaml", "not found"});
  const std::string p = write_yaml("syntax.yaml", "loss:\n  impl: [cce\n  chunk_size: 3\n");
  expect_error(p, {}, {p + ":", "YAML syntax error"});
}

TEST(Config, BadOverrides) {
  expect_error("", {"loss.impl"}, {"--set loss.impl", "section.key=value"});
  expect_error("", {"impl=cce"}, {"section.key"});
  expect_error("", {"loss.impl.x=cce"}, {"section.key"});
  expect_error("", {"loss.nope=1"}, {"--set loss.nope=1", "unknown key"});
}

// Layers: --config files in order, then --set; each later one wins, keys it leaves alone keep theirs.
TEST(ConfigLayers, LaterFileWins) {
  const std::string base = write_yaml("layers/base.yaml", "loss:\n  chunk_size: 256\ntrain:\n  lr: 0.1\n");
  const std::string variant = write_yaml("layers/variant.yaml", "loss:\n  chunk_size: 512\n");
  Config c = load_config(std::vector<std::string>{base, variant}, {});
  EXPECT_EQ(c.loss.chunk_size, 512) << "the variant, given later, wins";
  EXPECT_DOUBLE_EQ(c.train.lr, 0.1) << "a key the variant leaves alone keeps the base's value";
  EXPECT_EQ(load_config(std::vector<std::string>{variant, base}, {}).loss.chunk_size, 256)
      << "the order decides: the base, given later, wins";
}

TEST(ConfigLayers, SetWinsOverEveryFile) {
  const std::string base = write_yaml("set/base.yaml", "loss:\n  chunk_size: 256\n");
  const std::string via_defaults = write_yaml("set/variant.yaml", "defaults: base.yaml\nloss:\n  chunk_size: 512\n");
  for (const auto& paths : {std::vector<std::string>{base}, std::vector<std::string>{base, via_defaults},
                            std::vector<std::string>{via_defaults}}) {
    EXPECT_EQ(load_config(paths, {"loss.chunk_size=1024"}).loss.chunk_size, 1024) << paths.back();
    EXPECT_NE(load_config(paths, {}).loss.chunk_size, 1024) << "the files alone set another value";
  }
}

// An unknown key in any layer is an error naming that layer's file and line, not the file that named it.
TEST(ConfigLayers, UnknownKeyInBaseOrVariantNamesItsFile) {
  const std::string base = write_yaml("unknown/base.yaml", "loss:\n  chunk_size: 256\n  chunk: 3\n");
  const std::string good_base = write_yaml("unknown/good_base.yaml", "loss:\n  chunk_size: 256\n");
  const std::string variant = write_yaml("unknown/variant.yaml", "train:\n  lr: 0.1\n  stepz: 3\n");
  const std::string good_variant = write_yaml("unknown/good_variant.yaml", "train:\n  lr: 0.1\n");
  expect_error({base, good_variant}, {}, {base + ":3", "loss.chunk", "unknown key"}, {good_variant});
  expect_error({good_base, variant}, {}, {variant + ":3", "train.stepz", "unknown key"}, {good_base});
  // The same through `defaults:`.
  const std::string names_bad = write_yaml("unknown/names_bad.yaml", "defaults: base.yaml\ntrain:\n  lr: 0.1\n");
  expect_error({names_bad}, {}, {base + ":3", "loss.chunk", "unknown key"}, {names_bad});
  const std::string bad_on_good =
      write_yaml("unknown/bad_on_good.yaml", "defaults: good_base.yaml\ntrain:\n  stepz: 3\n");
  expect_error({bad_on_good}, {}, {bad_on_good + ":3", "train.stepz", "unknown key"}, {good_base});
  EXPECT_EQ(error_of({good_base, good_variant}, {}), "") << "the control: the good layers load";
}

// `defaults:` paths are relative to the file that names them, not to the working folder; the file's own
// keys win over its bases wherever `defaults:` stands; a list's later bases win over earlier ones.
TEST(ConfigLayers, DefaultsPathsAreRelativeToTheirFile) {
  const fs::path root = fs::temp_directory_path() / "rlt_test_config" / "relative";
  write_yaml("relative/base.yaml", "loss:\n  chunk_size: 128\n");  // a decoy in the working folder
  write_yaml("relative/sub/base.yaml", "loss:\n  chunk_size: 256\n  vocab_chunk_size: 32\n");
  write_yaml("relative/sub/more/other.yaml", "loss:\n  vocab_chunk_size: 64\n");
  write_yaml("relative/sub/variant.yaml", "train:\n  lr: 0.1\ndefaults: base.yaml\n");
  write_yaml("relative/sub/list.yaml", "defaults: [base.yaml, more/other.yaml]\nloss:\n  chunk_size: 512\n");
  write_yaml("relative/sub/more/up.yaml", "defaults: ../base.yaml\n");
  const fs::path cwd = fs::current_path();
  fs::current_path(root);
  Config variant = load_config("sub/variant.yaml", {});
  Config list = load_config("sub/list.yaml", {});
  Config up = load_config("sub/more/up.yaml", {});
  fs::current_path(cwd);
  EXPECT_EQ(variant.loss.chunk_size, 256) << "sub/base.yaml, not the working folder's base.yaml (128)";
  EXPECT_DOUBLE_EQ(variant.train.lr, 0.1);
  EXPECT_EQ(list.loss.chunk_size, 512) << "the file's own key wins over its bases";
  EXPECT_EQ(list.loss.vocab_chunk_size, 64) << "the list's later base wins";
  EXPECT_EQ(up.loss.chunk_size, 256) << "../ from the file's folder";
  // A base that is not there is named as resolved, at the line that names it.
  const std::string missing = write_yaml("relative/missing.yaml", "loss:\n  chunk_size: 1\ndefaults: nope.yaml\n");
  expect_error(missing, {}, {missing + ":3", (root / "nope.yaml").string(), "not found"});
  expect_error(write_yaml("relative/mapping.yaml", "defaults:\n  x: 1\n"), {}, {":1", "defaults", "list of paths"});
}

TEST(ConfigLayers, ACycleIsRejected) {
  const std::string a = write_yaml("cycle/a.yaml", "defaults: b.yaml\nloss:\n  chunk_size: 1\n");
  const std::string b = write_yaml("cycle/b.yaml", "loss:\n  chunk_size: 2\ndefaults: [c.yaml, a.yaml]\n");
  write_yaml("cycle/c.yaml", "loss:\n  chunk_size: 3\n");
  expect_error({a}, {}, {b + ":3", "defaults", "cycle", a + " -> " + b + " -> " + a});
  const std::string self = write_yaml("cycle/self.yaml", "defaults: ./self.yaml\n");
  expect_error({self}, {}, {self + ":1", "cycle"});
  // The control: a base reached twice along different paths (a diamond) is no cycle.
  write_yaml("diamond/d.yaml", "loss:\n  chunk_size: 4\n");
  write_yaml("diamond/b.yaml", "defaults: d.yaml\n");
  write_yaml("diamond/c.yaml", "defaults: d.yaml\n");
  const std::string top = write_yaml("diamond/a.yaml", "defaults: [b.yaml, c.yaml]\n");
  EXPECT_EQ(error_of({top}, {}), "");
  EXPECT_EQ(load_config(top, {}).loss.chunk_size, 4);
}

// --config repeats; the last file names the run; --config-reference asks for the reference.
TEST(ConfigLayers, CommandLineTakesSeveralFiles) {
  CLI::App app;
  ConfigCli cli;
  add_config_flags(app, cli);
  std::vector<std::string> args = {"app", "--config", "a.yaml", "--set", "loss.impl=cce", "--config", "b.yaml"};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  ASSERT_EQ(parse_cli(app, static_cast<int>(argv.size()), argv.data()), -1);
  EXPECT_EQ(cli.paths, (std::vector<std::string>{"a.yaml", "b.yaml"}));
  EXPECT_EQ(cli.path, "b.yaml");
  EXPECT_EQ(cli.overrides, std::vector<std::string>{"loss.impl=cce"});
  EXPECT_FALSE(cli.print);
  EXPECT_FALSE(cli.reference);

  CLI::App app2;
  ConfigCli cli2;
  add_config_flags(app2, cli2);
  std::vector<std::string> args2 = {"app", "--config-reference"};
  std::vector<char*> argv2;
  for (auto& a : args2) argv2.push_back(a.data());
  ASSERT_EQ(parse_cli(app2, static_cast<int>(argv2.size()), argv2.data()), -1);
  EXPECT_TRUE(cli2.print) << "the app prints and exits";
  EXPECT_TRUE(cli2.reference);
  EXPECT_TRUE(cli2.paths.empty());
}

// The reference of a hand-made section, cell by cell: each type, an enum's names, ranges, and `|` escaped.
enum class Shade { kLight, kDark };
const EnumNames<Shade>& enum_names(Shade) {
  static const EnumNames<Shade> names = {{"light", Shade::kLight}, {"dark", Shade::kDark}};
  return names;
}
struct DemoOptions {
  bool on = true;
  int64_t rows = 4;
  double eps = 0.2;
  std::string text = "a|b";
  Shade shade = Shade::kDark;
  int64_t steps = -3;
  template <class V>
  void visit(V&& v) {
    v("on", on, "a switch");
    v("rows", rows, "rows per chunk | 0 = all", FieldRange{0, 1e9});
    v("eps", eps, "a threshold", FieldRange{1e-6, 1});
    v("text", text, "free text");
    v("shade", shade, "a colour");
    v("steps", steps, "any count");
  }
  void check(const FieldFail&) const {}
};
struct DemoConfig {
  DemoOptions demo;
  template <class V>
  void visit_sections(V&& v) {
    v("demo", demo, "a section for the test");
  }
};

TEST(ConfigReference, EveryKeyWithTypeDefaultRangeAndDoc) {
  const std::string ref = describe_reference<DemoConfig>();
  const std::string expected =
      "## Sections\n\n"
      "- [demo](#demo): a section for the test\n"
      "\n## demo\n\na section for the test\n\n"
      "| key | type | default | allowed | description |\n|---|---|---|---|---|\n"
      "| `demo.on` | bool | `true` |  | a switch |\n"
      "| `demo.rows` | integer | `4` | 0 to 1e9 | rows per chunk \\| 0 = all |\n"
      "| `demo.eps` | number | `0.2` | 1e-6 to 1 | a threshold |\n"
      "| `demo.text` | string | `\"a\\|b\"` |  | free text |\n"
      "| `demo.shade` | enum | `dark` | `light`, `dark` | a colour |\n"
      "| `demo.steps` | integer | `-3` | any | any count |\n";
  ASSERT_GE(ref.size(), expected.size());
  EXPECT_EQ(ref.substr(0, reference_preamble().size()), reference_preamble());
  EXPECT_EQ(ref.substr(ref.size() - expected.size()), expected) << ref;
}

TEST(ConfigReference, FormatsBoundsShortest) {
  EXPECT_EQ(format_number(1e9), "1e9");
  EXPECT_EQ(format_number(1e-6), "1e-6");
  EXPECT_EQ(format_number(0.2), "0.2");
  EXPECT_EQ(format_number(0.000244140625), "0.000244140625");
  EXPECT_EQ(format_number(1e6), "1e6");
  EXPECT_EQ(format_number(65536), "65536");
  EXPECT_EQ(format_number(300), "300");
  EXPECT_EQ(format_number(9e18), "9e18");
  EXPECT_EQ(format_number(-1), "-1");
  EXPECT_EQ(markdown_code("a`b"), "`` a`b ``");
}

// The trainers' reference holds every key --print-config prints, with the same default (numbers compared
// as numbers: the reference writes the shortest form).
TEST(ConfigReference, TheTrainersReferenceListsEveryKey) {
  const std::string ref = describe_reference<Config>();
  std::istringstream yaml(describe_config(Config{}));
  std::string line, section;
  int keys = 0;
  while (std::getline(yaml, line)) {
    if (line[0] != ' ') {
      section = line.substr(0, line.find(':'));
      continue;
    }
    const auto colon = line.find(':');
    const std::string key = line.substr(2, colon - 2);
    std::string value = line.substr(colon + 2, line.find("  # ") - colon - 2);
    std::string cell;
    for (char ch : value) cell += ch == '|' ? std::string("\\|") : std::string(1, ch);
    const std::string row_start = "| `" + section + "." + key + "` | ";
    const auto at = ref.find(row_start);
    ASSERT_NE(at, std::string::npos) << section << "." << key << " missing";
    const std::string row = ref.substr(at, ref.find('\n', at) - at);
    // The cells are split by " | " (a `|` inside one is escaped: "\\|"); the third is the default.
    std::vector<std::string> cells;
    for (size_t from = 0, to; from != std::string::npos; from = to == std::string::npos ? to : to + 3) {
      to = row.find(" | ", from);
      cells.push_back(row.substr(from, to == std::string::npos ? to : to - from));
    }
    ASSERT_EQ(cells.size(), 5u) << row;
    const std::string shown = cells[2].substr(1, cells[2].size() - 2);  // inside the backticks
    char* end = nullptr;
    const double number = std::strtod(value.c_str(), &end);
    if (!value.empty() && *end == '\0' && value.find_first_not_of("0123456789.e+-") == std::string::npos) {
      EXPECT_EQ(std::strtod(shown.c_str(), nullptr), number) << row << ": the default is " << value;
    } else {
      EXPECT_EQ(shown, cell) << row << ": the default is " << value;
    }
    ++keys;
  }
  EXPECT_GT(keys, 100);
}

}  // namespace
}  // namespace rlt

namespace rlt {
namespace {

// A list field (reward.combine): items read into their options struct from a file and from --set, printed
// back as YAML that reads the same, and every kind of bad item named as key[i].field.
TEST(ConfigLists, RewardCombineReadsItsTermsFromAFileAndFromSet) {
  const std::string p = write_yaml("combine.yaml", "reward:\n  combine:\n    - kind: boxed\n      weight: 2.5\n");
  Config c = load_config(p, {});
  ASSERT_EQ(c.reward.combine.size(), 1u);
  EXPECT_EQ(c.reward.combine[0].weight, 2.5);
  // --set replaces the whole list.
  c = load_config(p, {"reward.combine=[{kind: boxed_tool_shaping, weight: 3}]"});
  ASSERT_EQ(c.reward.combine.size(), 1u);
  EXPECT_EQ(c.reward.combine[0].kind, RewardKind::kBoxedToolShaping);
  c = load_config("", {"reward.combine=[{kind: boxed, weight: 2.5}]"});
  ASSERT_EQ(c.reward.combine.size(), 1u);
  EXPECT_EQ(c.reward.combine[0].kind, RewardKind::kBoxed);
  EXPECT_EQ(c.reward.combine[0].weight, 2.5);
  EXPECT_FALSE(c.reward.single_rule());
  EXPECT_TRUE(load_config("", {}).reward.single_rule());
  // Printed and read back: the same list.
  const Config back = load_config(write_yaml("combine_back.yaml", describe_config(c)), {});
  ASSERT_EQ(back.reward.combine.size(), 1u);
  EXPECT_EQ(back.reward.combine[0].weight, 2.5);
  EXPECT_EQ(describe_config(back), describe_config(c));
  EXPECT_NE(describe_config(c).find("combine: [{kind: boxed, weight: 2.5}]"), std::string::npos);
  // An empty value is no terms.
  EXPECT_TRUE(load_config(write_yaml("combine_empty.yaml", "reward:\n  combine:\n"), {}).reward.combine.empty());
}

// data.eval_sets: each file with the keys that read it, the data section's when left empty.
TEST(ConfigLists, EvalSetsTakeTheDataSectionsKeysUnlessTheyNameTheirOwn) {
  const Config c =
      load_config("", {"data.answer_key=label",
                       "data.eval_sets=[{path: a.jsonl}, {path: b.jsonl, answer_key: solution, max_examples: 5}]"});
  ASSERT_EQ(c.data.eval_sets.size(), 2u);
  EXPECT_EQ(c.data.eval_set_options(0).path, "a.jsonl");
  EXPECT_EQ(c.data.eval_set_options(0).answer_key, "label");
  EXPECT_EQ(c.data.eval_set_options(1).answer_key, "solution");
  EXPECT_EQ(c.data.eval_set_options(1).prompt_key, "prompt");
  EXPECT_EQ(c.data.eval_set_options(1).max_examples, 5);
  EXPECT_TRUE(c.data.eval_set_options(1).eval_sets.empty());
  expect_error("", {"data.eval_sets=[{answer_key: x}]"}, {"data.eval_sets[0].path", "needs a path"});
  expect_error("", {"data.eval_sets=[{path: a.jsonl, answer_key: prompt}]"}, {"data.eval_sets", "item 0"});
}

TEST(ConfigLists, BadTermsAreNamedByIndexAndField) {
  expect_error("", {"reward.combine=[{kind: boxd}]"}, {"reward.combine[0].kind", "unknown value 'boxd'"});
  expect_error("", {"reward.combine=[{kind: boxed}, {kind: boxed, wieght: 1}]"},
               {"reward.combine[1].wieght", "unknown key", "kind, weight"});
  expect_error("", {"reward.combine={kind: boxed}"}, {"reward.combine", "expected a list of mappings"});
  expect_error("", {"reward.combine=[boxed]"}, {"reward.combine[0]", "expected a mapping"});
  expect_error("", {"reward.combine=[{kind: boxed, weight: 0}]"}, {"reward.combine[0].weight", "adds nothing"});
  expect_error("", {"reward.combine=[{kind: boxed, weight: 1e7}]"}, {"reward.combine[0].weight", "out of range"});
  expect_error("", {"reward.combine=[{kind: boxed, weight: [1]}]"}, {"reward.combine[0].weight", "single value"});
  expect_error("", {"reward.combine=[{kind: boxed}, {kind: boxed}]"}, {"reward.combine", "named twice"});
  expect_error("", {"reward.combine=[{kind: boxed}, {kind: boxed_tool_shaping}]"}, {"same matcher"});
  expect_error("", {"reward.combine=[{kind: boxed}]", "reward.kind=boxed"}, {"reward.kind", "one of"});
  // The default kind, as --print-config writes it beside the list, is no conflict.
  EXPECT_EQ(error_of({}, {"reward.combine=[{kind: boxed}]", "reward.kind=boxed_tool_shaping"}), "");
  expect_error("", {"reward.combine=[{kind: boxed}, {kind: model}]"}, {"reward.model_path", "needs a model_path"});
  expect_error("", {"reward.kind=model"}, {"reward.model_path", "needs a model_path"});
  // A scalar field still takes no list.
  expect_error("", {"reward.correct=[1]"}, {"reward.correct", "expected a single value"});
  // A model_path whose config.json is a causal LM's, not a reward model's.
  const fs::path dir = fs::path(write_yaml("lm/config.json", "")).parent_path();
  std::ofstream(dir / "config.json") << R"({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
    "vocab_size": 32, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
    "num_attention_heads": 2})";
  expect_error("", {"reward.kind=model", "reward.model_path=" + dir.string()},
               {"reward.model_path", "Qwen2ForCausalLM", "not a *ForSequenceClassification"});
}

}  // namespace
}  // namespace rlt
