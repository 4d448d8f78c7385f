// bench_update: one GRPO policy update (forward, log-probs of the response rows through the loss module,
// clipped-surrogate loss, backward) of B sequences in micro-batches of --micro, under each memory setting
// of the trainer and each layout (right-padded rows, sequences packed end to end, or packed with a prompt
// run once for its answers: --samples answers a prompt), so the cost of every switch is measured on the
// same model, batch and GPU. Each sequence is a prompt of P tokens and a response of L - P tokens (or,
// with --min-response, a length drawn from [min, L - P]) in which a share of tokens (tool output, in
// spans) has loss_mask = 0. Reports per setting: milliseconds (median of --reps), the batch's tokens a
// second, model TFLOP/s and MFU (model/flops.h, over the tokens forwarded), peak extra memory over the
// weights and their gradient buffers, and the mean response log-prob, which must agree across settings.
// --trace-top N traces one update per setting (Kineto): GPU-busy and idle time, time by kernel family
// (GEMMs, attention, the loss module's kernels, the rest) and the N kernels that took the most.
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
#include <string>
#include <vector>

#include "apps/bench_common.h"
#include "common/memory.h"
#include "loss/policy_loss.h"
#include "model/flops.h"
#include "model/safetensors.h"
#include "trainer/batch.h"
#include "trainer/config.h"
#include "trainer/metrics.h"

using namespace rlt;
using json = nlohmann::json;

namespace {

struct Setting {
  std::string name;
  LogprobImpl impl;
  bool response_only, loss_mask_only, checkpointing;
};

// B trajectories: random prompt and response ids, responses of L - P tokens or, with min_response < L - P,
// of lengths drawn uniformly from [min_response, L - P]; loss_mask 0 on spans of 64 tool tokens,
// tool_fraction of the response in all. Each run of `samples` trajectories answers one prompt (the first's).
std::vector<Trajectory> make_batch(int64_t B, int64_t L, int64_t P, int64_t min_response, double tool_fraction,
                                   int64_t vocab, int64_t samples) {
  at::manual_seed(7);
  const at::Tensor ids = at::randint(0, vocab, {B, L}, at::kLong);
  const at::Tensor lengths = at::randint(std::min(min_response, L - P), L - P + 1, {B}, at::kLong);
  std::vector<Trajectory> out(B);
  const int64_t span = 64, period = tool_fraction > 0 ? std::max<int64_t>(span + 1, int64_t(span / tool_fraction)) : 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* row = ids[b].data_ptr<int64_t>();
    if (b % samples == 0) {
      out[b].prompt_ids.assign(row, row + P);
    } else {
      out[b].prompt_ids = out[b - 1].prompt_ids;
    }
    for (int64_t j = 0; j < lengths[b].item<int64_t>(); ++j) {
      out[b].response_ids.push_back(row[P + j]);
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

// One update: every micro-batch's forward, loss and backward, gradients accumulated; the loss of each
// micro-batch is its sum over the batch's sequences (a global denominator of B), as the trainer's.
Result run_once(Transformer& m, const std::vector<PackedBatch>& batches, const LossOptions& lo, const at::Tensor& adv) {
  const at::Device dev = m.lm_head().device();
  for (auto& p : m.parameters()) {
    if (p.grad().defined()) p.grad().zero_();
  }
  device_synchronize(dev);
  PeakMemory mem(dev);
  const auto t0 = std::chrono::steady_clock::now();
  at::Tensor logp_sum = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(dev)), tokens = logp_sum.clone();
  int64_t begin = 0;
  for (const PackedBatch& b : batches) {
    ResponseLogprobs r = response_logprobs(m, b, lo);  // (S_m, R)
    PolicyLossInputs in;
    in.logprobs = r.logprobs;
    in.logprobs_old = r.logprobs.detach();
    in.advantages = adv.narrow(0, begin, b.S);
    in.loss_mask = b.loss_mask;
    in.global_denominator = static_cast<double>(adv.size(0));
    PolicyLossOptions po;
    po.clip_eps_high = 0.28;
    po.agg = LossAgg::kSeqMeanTokenMean;
    PolicyLossOutput out = policy_loss(in, po);
    r.hidden = at::Tensor();  // not kept past the forward
    out.loss.backward();
    logp_sum += (r.logprobs.detach() * b.loss_mask).sum();
    tokens += b.loss_mask.sum();
    begin += b.S;
  }
  device_synchronize(dev);
  Result res;
  res.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  res.peak_mib = mem.peak_extra_bytes() / 1048576.0;
  res.logprob_mean = (logp_sum / tokens).item<double>();
  return res;
}

// A kernel's family by its name: the GEMMs (cuBLAS, CUTLASS), attention (flash, memory-efficient), the loss
// module's own kernels (CCE, selective log-softmax), and the rest (elementwise, norms, copies, reductions).
std::string kernel_family(const std::string& name) {
  std::string n = name;
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return std::tolower(c); });
  auto has = [&](const char* k) { return n.find(k) != std::string::npos; };
  if (has("cce") || has("::forward_kernel") || has("::backward_kernel")) return "loss";  // loss/cuda/, CUTLASS inside
  if (has("gemm") || has("nvjet") || has("xmma") || has("cutlass")) return "gemm";
  if (has("flash") || has("fmha") || has("attention")) return "attention";
  return "other";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_update: one GRPO policy update under each memory setting and layout of the trainer"};
  ConfigCli cc;
  add_config_flags(app, cc);
  std::string model_dir, device = "cpu", dtype = "bfloat16", json_path, only;
  std::vector<std::string> layouts = {"padded", "packed"}, kernel_sets = {"fused"};
  int64_t B = 8, L = 4096, P = 256, micro = 0, min_response = -1, samples = 1;
  double tool_fraction = 0.2;
  int reps = 3, trace_top = -1;
  add_model_options(app, model_dir, device, dtype, B);
  app.add_option("--seq-len", L, "tokens per sequence (prompt + response), the longest with --min-response")
      ->check(CLI::Range(2, 1 << 22));
  app.add_option("--prompt-len", P, "prompt tokens per sequence")->check(CLI::Range(1, 1 << 22));
  app.add_option("--min-response", min_response,
                 "response lengths drawn uniformly from [this, seq-len - prompt-len]; default: all the longest")
      ->check(CLI::Range(1, 1 << 22));
  app.add_option("--micro", micro, "sequences per micro-batch (forward/backward); 0: the whole batch")
      ->check(CLI::Range(0, 4096));
  app.add_option("--samples", samples, "answers a prompt: each run of this many sequences shares its prompt")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--layouts", layouts,
                 "padded (right-padded rows), packed (end to end), shared (packed, a prompt once for its answers in "
                 "a micro-batch: train.share_prompts); comma-separated")
      ->delimiter(',')
      ->check(CLI::IsMember({"padded", "packed", "shared"}));
  app.add_option("--kernels", kernel_sets,
                 "fused (the fused RMSNorm, RoPE and SiLU-gate kernels with their backwards, on CUDA), aten (the "
                 "ATen forms), or both")
      ->delimiter(',')
      ->check(CLI::IsMember({"fused", "aten"}));
  app.add_option("--tool-fraction", tool_fraction, "share of response tokens with loss_mask 0")
      ->check(CLI::Range(0.0, 0.9));
  app.add_option("--reps", reps, "timed repetitions (median)")->check(CLI::Range(1, 100));
  app.add_option("--only", only, "run only the setting of this name");
  app.add_option("--trace-top", trace_top,
                 "trace one update per setting (CUDA): busy and idle time, kernel families, the N longest kernels")
      ->check(CLI::Range(0, 100));
  app.add_option("--json", json_path, "write the records to this JSON file");
  if (int rc = parse_cli(app, argc, argv); rc >= 0) return rc;
  Config cfg;
  if (!load_cli_config(cc, cfg)) return 2;
  if (P >= L) {
    std::cerr << "bench_update: --prompt-len " << P << " leaves no response in --seq-len " << L << "\n";
    return 2;
  }

  if (min_response < 0) min_response = L - P;
  if (micro == 0) micro = B;
  std::optional<BenchModel> bench = load_bench_model("bench_update", model_dir, device, dtype);
  if (!bench) return 2;
  const at::Device dev = bench->device;
  std::optional<Transformer>& model = bench->model;
  const ModelConfig& mc = model->config();
  const std::vector<Trajectory> trajs = make_batch(B, L, P, min_response, tool_fraction, mc.vocab_size, samples);
  int64_t real_tokens = 0;
  for (const Trajectory& t : trajs) real_tokens += t.window_end();
  at::manual_seed(11);
  const at::Tensor adv = at::randn({B}, at::kFloat).to(dev);
  const double peak = device_bf16_peak_flops(dev);  // the GPU's bf16 rate (model/flops.h's table)
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
  std::cout << "bench_update: " << mc.model_type << ", B=" << B << " in micro-batches of " << micro << ", L=" << L
            << " P=" << P << " (" << samples << " answers a prompt) response " << min_response << ".." << L - P << " ("
            << real_tokens << " tokens) tool_fraction=" << tool_fraction << ", " << dtype << " on " << device
            << " (peak: extra over weights and gradient buffers)\n";
  std::cout << std::left << std::setw(28) << "setting" << std::setw(13) << "layout" << std::right << std::setw(10)
            << "ms" << std::setw(12) << "tokens/s" << std::setw(8) << "MFU" << std::setw(12) << "peak_MiB"
            << std::setw(16) << "logprob_mean"
            << "\n";
  json records = json::array();
  struct PendingTrace {  // a timed run to trace once every run is timed
    size_t record;
    std::string label;
    std::vector<PackedBatch> batches;
    LossOptions lo;
    bool fused, checkpointing;
    double ms;
  };
  std::vector<PendingTrace> traces;
  for (const std::string& kernels : kernel_sets)
    for (const std::string& layout_name : layouts) {
      model->set_training_kernels(kernels == "fused");
      const bool packed = layout_name != "padded", shared = layout_name == "shared";
      const std::string layout = layout_name + (kernels == "fused" ? "" : "/aten");
      std::vector<PackedBatch> batches;
      for (int64_t b = 0; b < B; b += micro) {
        batches.push_back(pack(trajs, b, std::min(B, b + micro), dev, packed, shared));
      }
      int64_t grid = 0;  // tokens the forwards take, padding included
      for (const PackedBatch& b : batches) grid += b.ids.numel();
      for (const Setting& s : settings) {
        if (!only.empty() && s.name != only) continue;
        LossOptions lo = cfg.loss;
        lo.impl = s.impl;
        lo.response_only = s.response_only;
        lo.loss_mask_only = s.loss_mask_only;
        lo.entropy = EntropyMode::kNone;
        model->set_activation_checkpointing(s.checkpointing);
        std::vector<Result> runs;
        try {
          run_once(*model, batches, lo, adv);  // allocates the gradient buffers, picks kernels
          for (int i = 0; i < reps; ++i) runs.push_back(run_once(*model, batches, lo, adv));
        } catch (const c10::OutOfMemoryError& e) {
          std::cout << std::left << std::setw(28) << s.name << std::setw(13) << layout << "  out of memory\n";
          records.push_back(
              {{"impl", "rlt"}, {"setting", s.name}, {"packed", packed}, {"kernels", kernels}, {"oom", true}});
          continue;
        }
        auto median = [&](auto get) {
          std::vector<double> v;
          for (const auto& r : runs) v.push_back(get(r));
          std::sort(v.begin(), v.end());
          return v[v.size() / 2];
        };
        const double ms = median([](const Result& r) { return r.ms; });
        const double peak_mib = median([](const Result& r) { return r.peak_mib; });
        // Model FLOPs of the tokens forwarded (a shared prompt once): the LM head over the rows the setting
        // scores.
        const std::vector<SequenceWork> work = update_work(lo, trajs, batches);
        const PassFlops flops = training_flops(mc, work, /*weight_grads=*/true, s.checkpointing ? mc.num_layers : 0);
        const double tflops = flops.model / (ms / 1000) / 1e12, mfu = peak > 0 ? flops.model / (ms / 1000) / peak : 0;
        std::cout << std::left << std::setw(28) << s.name << std::setw(13) << layout << std::right << std::fixed
                  << std::setprecision(1) << std::setw(10) << ms << std::setw(12) << std::setprecision(0)
                  << real_tokens / (ms / 1000) << std::setw(7) << std::setprecision(1) << 100 * mfu << "%"
                  << std::setw(12) << peak_mib << std::setw(16) << std::setprecision(7) << runs[0].logprob_mean << "\n";
        json rec = {{"impl", "rlt"},
                    {"setting", s.name},
                    {"packed", packed},
                    {"shared_prompts", shared},
                    {"samples", samples},
                    {"kernels", kernels},
                    {"loss_impl", enum_to_string(s.impl)},
                    {"response_only", s.response_only},
                    {"loss_mask_only", s.loss_mask_only},
                    {"activation_checkpointing", s.checkpointing},
                    {"batch", B},
                    {"micro", micro},
                    {"seq_len", L},
                    {"prompt_len", P},
                    {"min_response", min_response},
                    {"tokens", real_tokens},
                    {"grid_tokens", grid},
                    {"tool_fraction", tool_fraction},
                    {"dtype", dtype},
                    {"ms", ms},
                    {"tokens_per_s", real_tokens / (ms / 1000)},
                    {"model_tflops", flops.model / 1e12},
                    {"hardware_tflops", flops.hardware / 1e12},
                    {"model_tflop_per_s", tflops},
                    {"mfu", mfu},
                    {"peak_flops", peak},
                    {"peak_extra_mib", peak_mib},
                    {"logprob_mean", runs[0].logprob_mean}};
        if (trace_top >= 0 && dev.is_cuda()) {
          traces.push_back(
              {records.size(), s.name + " " + layout, batches, lo, kernels == "fused", s.checkpointing, ms});
        }
        records.push_back(rec);
      }
    }
  // The traces after every timed run, so that no timed run follows the profiler in the process.
  for (const PendingTrace& p : traces) {
    model->set_training_kernels(p.fused);
    model->set_activation_checkpointing(p.checkpointing);
    const DeviceTrace t = trace_device(dev, [&] { run_once(*model, p.batches, p.lo, adv); });
    std::map<std::string, double> family;
    for (const auto& [name, v] : t.by_name) family[kernel_family(name)] += v.second;
    auto listed = [&](const DeviceTrace::ByName& m, size_t n) {  // the n names that took the most time
      json out = json::array();
      for (const std::string& name : t.top(n, &m)) {
        out.push_back({{"name", name}, {"count", m.at(name).first}, {"ms", m.at(name).second}});
      }
      return out;
    };
    const json runtime = listed(t.runtime, 8);  // the host's CUDA calls
    records[p.record]["trace"] = {{"host_cuda_calls", runtime},
                                  {"host_ops", listed(t.host_ops, 16)},  // the host's operators, callees included
                                  {"activities", t.activities},
                                  {"busy_ms", t.busy_ms},
                                  {"idle_ms", std::max(0.0, p.ms - t.busy_ms)},
                                  {"families_ms", family},
                                  {"top", listed(t.by_name, static_cast<size_t>(trace_top))}};
    std::cout << "trace " << p.label << ": busy " << std::fixed << std::setprecision(1) << t.busy_ms << " ms of "
              << p.ms << " (" << t.activities << " activities);";
    for (const auto& [f, v] : family) std::cout << " " << f << " " << v;
    std::cout << "\n  host:";
    for (const auto& r : runtime) {
      std::cout << " " << r["name"].get<std::string>() << " " << r["count"].get<int64_t>() << "x "
                << r["ms"].get<double>() << " ms;";
    }
    std::cout << "\n";
  }
  if (!json_path.empty()) write_json_records(json_path, records);
  return 0;
}
