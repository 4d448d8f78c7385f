// bench_step: the step-cost table of the rollout's decode step, each cell against its floor.
//
// For each model shape (--models), rows R (--rows) and context C (--contexts): one prompt of C tokens is
// prefilled once and copied into R cache rows (DecodeEngine::start with R repeats), then the engine decodes
// as the rollout does, DecodeEngine::step_draw with every row fed: the step, the LM head, the draw and its
// log-probs, ids to the host. After the warm-up (the capture), --steps steps are timed, --reps times
// (median). Each cell also gets:
//   floor_ms      the bytes a step must read (every weight once, the embedding only where it is the LM
//                 head, and the R x C cached keys and values) over the HBM bandwidth, measured in the same
//                 process by a device-to-device copy (read and write counted);
//   kernels, gpu_busy_ms, idle_ms
//                 from a Kineto trace of --trace-steps steady steps: device activities per step (kernels,
//                 copies, memsets), the union of their intervals per step, and the step's time minus it
//                 (launch gaps between a graph's kernels count as idle), with --top-kernels the activities
//                 that take the most time, and the host's CUDA runtime calls and operators that take the
//                 most of its time (a call that waits for the device counts its wait);
//   launch_gap_ms, host_ms
//                 idle split in two: the trace's holes shorter than kLaunchGapNs between a graph's kernels
//                 (per step), and the rest of idle_ms: the host's turn between replays (the draw's ids read,
//                 the next step's inputs copied in, the graph launched), what device-side inputs would hide;
//   mode          default (the rollout's path), and with --variants the same cell with one part off:
//                 no_graph_draw (the head and the draw outside the step's graph), no_dependent_launch (the
//                 graph's kernels joined by plain edges, EngineSwitches::dependent_launch off), no_step_ahead
//                 (EngineSwitches::step_ahead off: each step starts once the host has read the draw before
//                 it; in the default the loop passes the next keys and each step starts the next),
//                 separate_rope (RoPE and the cache write in a kernel of their own before the attention,
//                 cuda::set_rope_in_attention(false)), full_scratch (the attention's warps with scratch for
//                 all their scores, probabilities and product at once, cuda::set_attention_lean_scratch(false));
//                 or with one part on: tuned_gemms (EngineSwitches::tuned_gemms, model/tuned_gemm.h).
// Prints a table and writes JSON records. Without a GPU it runs eagerly on the CPU (no floor, no kernels):
// the smoke test's form.
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#ifdef RLT_HAVE_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAStream.h>

#include "model/cuda/decode_kernels.h"
#endif

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "apps/bench_common.h"
#include "common/config.h"
#include "common/memory.h"
#include "common/timing.h"
#include "model/transformer.h"
#include "model/tuned_gemm.h"
#include "rollout/engine.h"
#include "rollout/sampler.h"

using namespace rlt;
using json = nlohmann::json;

namespace {

// Device-to-device copy bandwidth in bytes/s (read plus write), median of 9 copies of 1 GiB; 0 on the CPU.
double copy_bandwidth(const at::Device& dev) {
#ifdef RLT_HAVE_CUDA
  if (!dev.is_cuda()) return 0;
  const int64_t bytes = int64_t(1) << 30;
  at::Tensor a = at::ones({bytes / 2}, at::TensorOptions().dtype(at::kBFloat16).device(dev)), b = at::empty_like(a);
  b.copy_(a);
  std::vector<double> s;
  const auto stream = c10::cuda::getCurrentCUDAStream(dev.index());
  for (int i = 0; i < 9; ++i) {
    at::cuda::CUDAEvent t0(cudaEventDefault), t1(cudaEventDefault);
    t0.record(stream);
    b.copy_(a);
    t1.record(stream);
    t1.synchronize();
    s.push_back(t0.elapsed_time(t1) / 1e3);
  }
  std::sort(s.begin(), s.end());
  return 2.0 * double(bytes) / s[s.size() / 2];
#else
  (void)dev;
  return 0;
#endif
}

// The bytes of weights one decode step reads: every parameter once, but for an untied embedding (a step
// gathers R of its rows; tied, it is the LM head and read whole).
int64_t weight_bytes(const Transformer& m) {
  int64_t total = 0;
  for (const auto& [name, p] : m.named_parameters()) {
    if (!m.config().tie_word_embeddings && name.find("embed_tokens") != std::string::npos) continue;
    total += p.numel() * static_cast<int64_t>(p.element_size());
  }
  return total;
}

// The cached keys and values a step over R rows of C slots reads: every layer's.
int64_t kv_bytes(const Transformer& m, int64_t R, int64_t C) {
  const ModelConfig& c = m.config();
  return R * C * c.num_layers * 2 * c.num_kv_heads * c.head_dim * static_cast<int64_t>(m.lm_head().element_size());
}

// A hole in the trace shorter than this lies between two kernels of one graph: a replay launches its
// kernels 1-3 us apart, while the host's turn between replays (a device-to-host copy waited for, the
// next inputs copied in, a graph launched) takes tens of microseconds.
constexpr uint64_t kLaunchGapNs = 10000;

struct Cell {
  double ms = 0;                                 // median wall time of a step
  double kernels = 0, busy_ms = 0, idle_ms = 0;  // per step, from the trace
  double launch_gap_ms = 0, host_ms = 0;         // idle_ms split: holes between a graph's kernels, the rest
  json top = json::array();                      // the activities that took the most time, per step
  json top_runtime = json::array(), top_host_ops = json::array();  // the host's CUDA calls and operators
};

Cell run_cell(const Transformer& m, const at::Device& dev, int64_t R, int64_t C, int steps, int reps, int trace_steps,
              int top_kernels, const EngineSwitches& switches) {
  at::NoGradGuard ng;
  EngineOptions po;
  po.switches = switches;
  DecodeEngine engine(m, po);
  std::vector<int64_t> prompt(C);
  for (int64_t j = 0; j < C; ++j) prompt[j] = (j * 7919 + 13) % std::min<int64_t>(m.config().vocab_size, 150000);
  SamplingOptions so;
  so.seed = 5;
  const at::Tensor streams = at::arange(R, at::kLong);
  at::Tensor counters = at::zeros({R}, at::kLong);
  std::vector<int64_t> rows(R);
  for (int64_t r = 0; r < R; ++r) rows[r] = r;
  const SampleOutput first = sample_tokens(engine.start({prompt}, R), so, streams, counters);
  std::vector<int64_t> next(first.ids.data_ptr<int64_t>(), first.ids.data_ptr<int64_t>() + R);
  auto step = [&] {
    counters += 1;
    const SampleOutput d = engine.step_draw(rows, next, so, sample_row_keys(so.seed, streams, counters), 0,
                                            sample_row_keys(so.seed, streams, counters + 1));
    std::copy(d.ids.data_ptr<int64_t>(), d.ids.data_ptr<int64_t>() + R, next.begin());
  };
  for (int i = 0; i < 4; ++i) step();  // the capture and a few replays
  device_synchronize(dev);
  std::vector<double> per_step;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < steps; ++i) step();
    device_synchronize(dev);
    per_step.push_back(seconds_since(t0) * 1e3 / steps);
  }
  std::sort(per_step.begin(), per_step.end());
  Cell cell;
  cell.ms = per_step[per_step.size() / 2];
  if (trace_steps > 0 && dev.is_cuda()) {
    const DeviceTrace t = trace_device(dev, [&] {
      for (int i = 0; i < trace_steps; ++i) step();
    });
    cell.kernels = double(t.activities) / trace_steps;
    cell.busy_ms = t.busy_ms / trace_steps;
    cell.idle_ms = std::max(0.0, cell.ms - cell.busy_ms);
    uint64_t launch_gaps = 0;
    for (uint64_t g : t.gaps_ns) launch_gaps += g < kLaunchGapNs ? g : 0;
    cell.launch_gap_ms = std::min(cell.idle_ms, double(launch_gaps) / 1e6 / trace_steps);
    cell.host_ms = cell.idle_ms - cell.launch_gap_ms;
    auto listed = [&](const DeviceTrace::ByName& by, json& into) {
      for (const std::string& name : t.top(static_cast<size_t>(top_kernels), &by)) {
        const auto& [count, ms] = by.at(name);
        into.push_back({{"name", name}, {"per_step", double(count) / trace_steps}, {"ms_per_step", ms / trace_steps}});
      }
    };
    listed(t.by_name, cell.top);
    listed(t.runtime, cell.top_runtime);
    listed(t.host_ops, cell.top_host_ops);
  }
  return cell;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_step: the decode step's cost per model, rows and context, against its weight-read floor"};
  std::vector<std::string> models;
  std::string device = "cuda", dtype = "bfloat16", json_path;
  std::vector<int64_t> rows = {1, 16, 64, 256}, contexts = {512, 2048};
  int steps = 32, reps = 3, trace_steps = 8, top_kernels = 0;
  std::vector<std::string> variants = {"default"};
  app.add_option("--models", models, "model folders (config.json, weights or random)")->required()->delimiter(',');
  app.add_option("--device", device, "cuda or cpu")->check(CLI::IsMember({"cuda", "cpu"}));
  app.add_option("--dtype", dtype, "bfloat16 or float32")->check(CLI::IsMember({"bfloat16", "float32"}));
  app.add_option("--rows", rows, "cache rows a step decodes")->delimiter(',')->check(CLI::Range(1, 1 << 16));
  app.add_option("--contexts", contexts, "tokens each row holds")->delimiter(',')->check(CLI::Range(1, 1 << 20));
  app.add_option("--steps", steps, "timed steps per repetition")->check(CLI::Range(1, 100000));
  app.add_option("--reps", reps, "repetitions (median)")->check(CLI::Range(1, 100));
  app.add_option("--trace-steps", trace_steps, "steps traced per cell for kernels and GPU-busy time (0: none)")
      ->check(CLI::Range(0, 1000));
  app.add_option("--top-kernels", top_kernels, "record the N device activities that take the most time a step")
      ->check(CLI::Range(0, 1000));
  app.add_option("--variants", variants,
                 "variants timed per cell: default, no_graph_draw (the head and the draw outside the step's "
                 "graph), no_dependent_launch (no programmatic edges in the graph), no_step_ahead (each step "
                 "starts once the host has read the draw before it), separate_rope (RoPE and the cache write "
                 "in a kernel of their own), full_scratch (the attention's scratch for all its scores, "
                 "probabilities and product at once), tuned_gemms (the projections through cuBLASLt's algorithm "
                 "timed fastest)")
      ->delimiter(',')
      ->check(CLI::IsMember({"default", "no_graph_draw", "no_dependent_launch", "no_step_ahead", "separate_rope",
                             "full_scratch", "tuned_gemms"}));
  app.add_option("--json", json_path, "write the records to this JSON file");
  if (int rc = parse_cli(app, argc, argv); rc >= 0) return rc;
  json records = json::array();
  std::cout << std::left << std::setw(22) << "model" << std::setw(22) << "mode" << std::right << std::setw(6) << "rows"
            << std::setw(9) << "context" << std::setw(10) << "ms/step" << std::setw(10) << "floor_ms" << std::setw(8)
            << "x_floor" << std::setw(9) << "kernels" << std::setw(9) << "busy_ms" << std::setw(9) << "idle_ms"
            << std::setw(9) << "gaps_ms" << std::setw(9) << "host_ms"
            << "\n";
  for (const std::string& dir : models) {
    std::optional<BenchModel> bench = load_bench_model("bench_step", dir, device, dtype);
    if (!bench) return 2;
    const Transformer& m = *bench->model;
    const at::Device dev = bench->device;
    const double bw = copy_bandwidth(dev);
    const int64_t wbytes = weight_bytes(m);
    const std::string name = std::filesystem::path(dir).filename().string();
    for (int64_t C : contexts) {
      for (int64_t R : rows) {
        for (const std::string& mode : variants) {
          EngineSwitches sw;
          sw.graph_draw = mode != "no_graph_draw";
          sw.dependent_launch = mode != "no_dependent_launch";
          sw.step_ahead = mode != "no_step_ahead";
          sw.tuned_gemms = mode == "tuned_gemms";
#ifdef RLT_HAVE_CUDA
          cuda::set_rope_in_attention(mode != "separate_rope");
          cuda::set_attention_lean_scratch(mode != "full_scratch");
#endif
          const Cell c = run_cell(m, dev, R, C, steps, reps, trace_steps, top_kernels, sw);
          const int64_t kv = kv_bytes(m, R, C);
          const double floor_ms = bw > 0 ? double(wbytes + kv) / bw * 1e3 : 0;
          std::cout << std::left << std::setw(22) << name << std::setw(22) << mode << std::right << std::setw(6) << R
                    << std::setw(9) << C << std::fixed << std::setprecision(3) << std::setw(10) << c.ms << std::setw(10)
                    << floor_ms << std::setprecision(2) << std::setw(8) << (floor_ms > 0 ? c.ms / floor_ms : 0)
                    << std::setprecision(1) << std::setw(9) << c.kernels << std::setprecision(3) << std::setw(9)
                    << c.busy_ms << std::setw(9) << c.idle_ms << std::setw(9) << c.launch_gap_ms << std::setw(9)
                    << c.host_ms << std::endl;
          records.push_back({{"model", name},
                             {"mode", mode},
                             {"rows", R},
                             {"context", C},
                             {"dtype", dtype},
                             {"ms_per_step", c.ms},
                             {"tokens_per_s", double(R) / c.ms * 1e3},
                             {"weight_bytes", wbytes},
                             {"kv_bytes", kv},
                             {"hbm_bytes_per_s", bw},
                             {"floor_ms", floor_ms},
                             {"kernels_per_step", c.kernels},
                             {"gpu_busy_ms_per_step", c.busy_ms},
                             {"idle_ms_per_step", c.idle_ms},
                             {"launch_gap_ms_per_step", c.launch_gap_ms},
                             {"host_ms_per_step", c.host_ms},
                             {"top_kernels", c.top},
                             {"top_runtime_calls", c.top_runtime},
                             {"top_host_ops", c.top_host_ops}});
        }
      }
    }
  }
  if (!json_path.empty()) write_json_records(json_path, records);
  if (std::find(variants.begin(), variants.end(), "tuned_gemms") != variants.end()) {
    const rlt::TunedGemmCounts t = rlt::tuned_gemm_counts();
    std::cout << "tuned_gemms: " << t.shapes << " shapes tuned, " << t.lt_chosen
              << " of them taking a cuBLASLt algorithm over ATen's call\n";
  }
  return 0;
}
