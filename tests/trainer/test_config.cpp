// The config reader: defaults, files, --set overrides, and a clear error (key + file:line) for every
// kind of bad input the apps must reject with exit code 2.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "trainer/config.h"

namespace rlt {
namespace {

namespace fs = std::filesystem;

std::string write_yaml(const std::string& name, const std::string& text) {
  const fs::path dir = fs::temp_directory_path() / "rlt_test_config";
  fs::create_directories(dir);
  const fs::path p = dir / name;
  std::ofstream(p) << text;
  return p.string();
}

// Expects load_config to throw a ConfigError whose message contains every fragment.
void expect_error(const std::string& path, const std::vector<std::string>& sets,
                  const std::vector<std::string>& fragments) {
  try {
    load_config(path, sets);
    ADD_FAILURE() << "no error for " << path;
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "'" << f << "' not in: " << msg;
  }
}

TEST(Config, DefaultsWithoutAFile) {
  Config c = load_config("", {});
  EXPECT_EQ(c.loss.impl, LogprobImpl::kSelective);
  EXPECT_TRUE(c.loss.response_only);
  EXPECT_FALSE(c.loss.loss_mask_only);
  EXPECT_EQ(c.loss.chunk_size, 0);
  EXPECT_EQ(c.policy.agg, LossAgg::kTokenMean);
}

TEST(Config, ShippedDefaultsFileMatchesTheStructDefaults) {
  Config from_file = load_config(std::string(RLT_SOURCE_DIR) + "/configs/loss_defaults.yaml", {});
  EXPECT_EQ(describe_config(from_file), describe_config(Config{}));
}

TEST(Config, FileThenOverrides) {
  const std::string p = write_yaml("ok.yaml",
                                   "loss:\n  impl: cce\n  chunk_size: 256\n  loss_mask_only: true\n"
                                   "policy:\n  clip_eps_high: 0.28\n  agg: seq-mean-token-mean\n");
  Config c = load_config(p, {"loss.chunk_size=512", "sampling.temperature=0.7", "policy.kl_estimator=k1"});
  EXPECT_EQ(c.loss.impl, LogprobImpl::kCce);
  EXPECT_EQ(c.loss.chunk_size, 512) << "--set wins over the file";
  EXPECT_TRUE(c.loss.loss_mask_only);
  EXPECT_DOUBLE_EQ(c.sampling.temperature, 0.7);
  EXPECT_DOUBLE_EQ(c.policy.clip_eps_high, 0.28);
  EXPECT_EQ(c.policy.agg, LossAgg::kSeqMeanTokenMean);
  EXPECT_EQ(c.policy.kl_estimator, KlEstimator::kK1);
}

TEST(Config, DescribeRoundTrips) {
  Config c = load_config("", {"loss.impl=naive", "loss.entropy=grad", "policy.clip_c=3"});
  const std::string p = write_yaml("roundtrip.yaml", describe_config(c));
  EXPECT_EQ(describe_config(load_config(p, {})), describe_config(c));
}

TEST(Config, UnknownKeyNamesFileLineAndKnownKeys) {
  const std::string p = write_yaml("unknown.yaml", "loss:\n  impl: cce\n  chunk: 3\n");
  expect_error(p, {}, {p + ":3", "loss.chunk", "unknown key", "chunk_size"});
}

TEST(Config, UnknownSection) {
  const std::string p = write_yaml("section.yaml", "los:\n  impl: cce\n");
  expect_error(p, {}, {p + ":1", "los", "unknown section", "loss, policy"});
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
  expect_error("", {"policy.clip_eps_low=2"}, {"policy.clip_eps_low", "out of range"});
}

TEST(Config, CrossFieldRulesNameTheKeyAndWhereItWasSet) {
  const std::string p = write_yaml("mask.yaml", "loss:\n  response_only: false\n  loss_mask_only: true\n");
  expect_error(p, {}, {p + ":3", "loss.loss_mask_only", "response_only"});
  expect_error("", {"loss.response_only=false", "loss.loss_mask_only=true"},
               {"--set loss.loss_mask_only=true", "loss.loss_mask_only"});
  expect_error("", {"policy.clip_c=0.5"}, {"policy.clip_c"});
  expect_error("", {"policy.agg=seq-mean-token-sum-norm"}, {"policy.agg_norm"});
  // Rules across sections: the trainer scores what was sampled, a JSONL source needs a file, an entropy
  // bonus needs the entropy's gradient.
  // One value per setting: the trainer's log-probs use sampling.temperature, so `loss:` has no temperature
  // key, and the noise seed derives from train.seed, so `sampling:` has no seed key.
  expect_error("", {"loss.temperature=0.7"}, {"loss.temperature", "unknown key"});
  expect_error("", {"sampling.seed=3"}, {"sampling.seed", "unknown key"});
  expect_error("", {"train.prompts=jsonl"}, {"data.path", "jsonl"});
  expect_error("", {"policy.entropy_coef=0.01", "loss.entropy=value"}, {"loss.entropy", "grad"});
  // TIS / IcePop weigh by exp(logprobs_old - logprobs_rollout): 1 when the old log-probs are the rollout's.
  expect_error("", {"policy.tis=2"}, {"train.old_logprobs", "recompute"});
  expect_error("", {"policy.icepop_low=0.5", "policy.icepop_high=2"}, {"train.old_logprobs", "recompute"});
  EXPECT_NO_THROW(load_config("", {"policy.tis=2", "train.old_logprobs=recompute"}));
  EXPECT_NO_THROW(load_config("", {"sampling.temperature=0", "policy.entropy_coef=0.01", "loss.entropy=grad"}))
      << "greedy sampling scores at any temperature";
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

}  // namespace
}  // namespace rlt
