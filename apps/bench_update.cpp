// bench_update: one GRPO policy update (forward, log-probs of the response rows through the loss module,
// clipped-surrogate loss, backward) of B sequences of L tokens, under each memory setting of the trainer,
// so the cost of every switch is measured on the same model, batch and GPU. Each sequence is a prompt of
// P tokens and a response of L - P tokens in which a share of tokens (tool output, in spans) has
// loss_mask = 0. Reports per setting: milliseconds (median of --reps), peak extra memory over the
// weights and their gradient buffers, and the mean response log-prob, which must agree across settings.
// The transformers peer is scripts/bench_update_peer.py, run in the same command (scripts/gpu/train.sh).
#include <ATen/core/grad_mode.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>

#include "apps/bench_common.h"
#include "common/memory.h"
#include "loss/policy_loss.h"
#include "model/safetensors.h"
#include "trainer/batch.h"
#include "trainer/config.h"

using namespace rlt;
using json = nlohmann::json;

namespace {

struct Setting {
  std::string name;
  LogprobImpl impl;
  bool response_only, loss_mask_only, checkpointing;
};

// B trajectories: random prompt and response ids; loss_mask 0 on spans of 64 tool tokens, tool_fraction of
// the response in all.
std::vector<Trajectory> make_batch(int64_t B, int64_t L, int64_t P, double tool_fraction, int64_t vocab) {
  at::manual_seed(7);
  at::Tensor ids = at::randint(0, vocab, {B, L}, at::kLong);
  std::vector<Trajectory> out(B);
  const int64_t span = 64, period = tool_fraction > 0 ? std::max<int64_t>(span + 1, int64_t(span / tool_fraction)) : 0;
  for (int64_t b = 0; b < B; ++b) {
    auto row = ids[b];
    for (int64_t i = 0; i < P; ++i) out[b].prompt_ids.push_back(row[i].item<int64_t>());
    for (int64_t j = 0; j < L - P; ++j) {
      out[b].response_ids.push_back(row[P + j].item<int64_t>());
      const bool tool = period > 0 && (j % period) >= period - span;
      out[b].loss_mask.push_back(tool ? 0 : 1);
      out[b].logprobs.push_back(0.0f);
    }
  }
  return out;
}

struct Result {
  double ms = 0, peak_mib = 0, logprob_mean = 0;
};

Result run_once(Transformer& m, const PackedBatch& b, const LossOptions& lo, const at::Tensor& adv) {
  const at::Device dev = m.lm_head().device();
  for (auto& p : m.parameters()) {
    if (p.grad().defined()) p.grad().zero_();
  }
  device_synchronize(dev);
  PeakMemory mem(dev);
  const auto t0 = std::chrono::steady_clock::now();
  ResponseLogprobs r = response_logprobs(m, b, lo);  // (B, R)
  PolicyLossInputs in;
  in.logprobs = r.logprobs;
  in.logprobs_old = r.logprobs.detach();
  in.advantages = adv;
  in.loss_mask = b.loss_mask;
  PolicyLossOptions po;
  po.clip_eps_high = 0.28;
  po.agg = LossAgg::kSeqMeanTokenMean;
  PolicyLossOutput out = policy_loss(in, po);
  r.hidden = at::Tensor();  // not kept past the forward
  out.loss.backward();
  device_synchronize(dev);
  Result res;
  res.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  res.peak_mib = mem.peak_extra_bytes() / 1048576.0;
  res.logprob_mean = ((r.logprobs.detach() * b.loss_mask).sum() / b.loss_mask.sum()).item<double>();
  return res;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_update: one GRPO policy update under each memory setting of the trainer"};
  ConfigCli cc;
  add_config_flags(app, cc);
  std::string model_dir, device = "cpu", dtype = "bfloat16", json_path, only;
  int64_t B = 8, L = 4096, P = 256;
  double tool_fraction = 0.2;
  int reps = 3;
  add_model_options(app, model_dir, device, dtype, B);
  app.add_option("--seq-len", L, "tokens per sequence (prompt + response)")->check(CLI::Range(2, 1 << 22));
  app.add_option("--prompt-len", P, "prompt tokens per sequence")->check(CLI::Range(1, 1 << 22));
  app.add_option("--tool-fraction", tool_fraction, "share of response tokens with loss_mask 0")
      ->check(CLI::Range(0.0, 0.9));
  app.add_option("--reps", reps, "timed repetitions (median)")->check(CLI::Range(1, 100));
  app.add_option("--only", only, "run only the setting of this name");
  app.add_option("--json", json_path, "write the records to this JSON file");
  if (int rc = parse_cli(app, argc, argv); rc >= 0) return rc;
  Config cfg;
  if (!load_cli_config(cc, cfg)) return 2;
  if (P >= L) {
    std::cerr << "bench_update: --prompt-len " << P << " leaves no response in --seq-len " << L << "\n";
    return 2;
  }
  std::optional<BenchModel> bench = load_bench_model("bench_update", model_dir, device, dtype);
  if (!bench) return 2;
  const at::Device dev = bench->device;
  std::optional<Transformer>& model = bench->model;
  const std::vector<Trajectory> trajs = make_batch(B, L, P, tool_fraction, model->config().vocab_size);
  const PackedBatch batch = pack(trajs, 0, B, dev);
  at::manual_seed(11);
  const at::Tensor adv = at::randn({B}, at::kFloat).to(dev);
  // From every switch off (what a plain PyTorch trainer does) to every switch on (configs/retool.yaml).
  const std::vector<Setting> settings = {
      {"naive_all_rows_no_ckpt", LogprobImpl::kNaive, false, false, false},
      {"naive_all_rows", LogprobImpl::kNaive, false, false, true},
      {"selective_all_rows", LogprobImpl::kSelective, false, false, true},
      {"selective_response_mask", LogprobImpl::kSelective, true, true, true},
      {"cce_all_rows", LogprobImpl::kCce, false, false, true},
      {"cce_response", LogprobImpl::kCce, true, false, true},
      {"cce_response_mask", LogprobImpl::kCce, true, true, true},
      {"cce_response_mask_no_ckpt", LogprobImpl::kCce, true, true, false},
  };
  std::cout << "bench_update: " << model->config().model_type << ", B=" << B << " L=" << L << " P=" << P
            << " tool_fraction=" << tool_fraction << ", " << dtype << " on " << device
            << " (peak: extra over weights and gradient buffers)\n";
  std::cout << std::left << std::setw(28) << "setting" << std::right << std::setw(12) << "ms" << std::setw(14)
            << "peak_MiB" << std::setw(18) << "logprob_mean"
            << "\n";
  json records = json::array();
  for (const Setting& s : settings) {
    if (!only.empty() && s.name != only) continue;
    LossOptions lo = cfg.loss;
    lo.impl = s.impl;
    lo.response_only = s.response_only;
    lo.loss_mask_only = s.loss_mask_only;
    lo.entropy = EntropyMode::kNone;
    model->set_activation_checkpointing(s.checkpointing);
    Result warm;
    std::vector<Result> runs;
    try {
      warm = run_once(*model, batch, lo, adv);  // allocates the gradient buffers, picks kernels
      for (int i = 0; i < reps; ++i) runs.push_back(run_once(*model, batch, lo, adv));
    } catch (const c10::OutOfMemoryError& e) {
      std::cout << std::left << std::setw(28) << s.name << "  out of memory\n";
      records.push_back({{"impl", "rlt"}, {"setting", s.name}, {"oom", true}});
      continue;
    }
    auto median = [&](auto get) {
      std::vector<double> v;
      for (const auto& r : runs) v.push_back(get(r));
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    const double ms = median([](const Result& r) { return r.ms; });
    const double peak = median([](const Result& r) { return r.peak_mib; });
    std::cout << std::left << std::setw(28) << s.name << std::right << std::fixed << std::setprecision(1)
              << std::setw(12) << ms << std::setw(14) << peak << std::setw(18) << std::setprecision(7)
              << runs[0].logprob_mean << "\n";
    records.push_back({{"impl", "rlt"},
                       {"setting", s.name},
                       {"loss_impl", enum_to_string(s.impl)},
                       {"response_only", s.response_only},
                       {"loss_mask_only", s.loss_mask_only},
                       {"activation_checkpointing", s.checkpointing},
                       {"batch", B},
                       {"seq_len", L},
                       {"prompt_len", P},
                       {"tool_fraction", tool_fraction},
                       {"dtype", dtype},
                       {"ms", ms},
                       {"tokens_per_s", B * L / (ms / 1000)},
                       {"peak_extra_mib", peak},
                       {"logprob_mean", runs[0].logprob_mean}});
  }
  if (!json_path.empty()) {
    const auto parent = std::filesystem::path(json_path).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent);
    std::ofstream(json_path) << records.dump(1) << "\n";
  }
  return 0;
}
