// What the model benchmarks (bench_model, bench_step, bench_update, bench_rollout) share after parsing their
// flags: the --device / --dtype values checked and turned into LibTorch's, CPU memory tracking switched on,
// and the model loaded (or made with random weights) with any error printed as "<app>: ..." (each returns
// nullopt after printing; the app exits with code 2); the JSON records written out; and the device side of a
// Kineto trace (bench_step, bench_update).
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/memory.h"
#include "model/transformer.h"

namespace rlt {

struct BenchModel {
  at::Device device = at::kCPU;
  at::ScalarType dtype = at::kFloat;
  std::optional<Transformer> model;
};

// The options every model benchmark takes: --model, --device, --dtype, --batch.
inline void add_model_options(CLI::App& app, std::string& model_dir, std::string& device, std::string& dtype,
                              int64_t& batch) {
  app.add_option("--model", model_dir, "folder with config.json (random weights when it holds no safetensors)")
      ->required();
  app.add_option("--device", device, "cpu | cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--dtype", dtype, "float32 | bfloat16")->check(CLI::IsMember({"float32", "bfloat16"}));
  app.add_option("--batch", batch, "sequences")->check(CLI::Range(1, 4096));
}

inline std::optional<BenchModel> load_bench_model(const std::string& app, const std::string& model_dir,
                                                  const std::string& device, const std::string& dtype) {
  if (device == "cuda" && !at::hasCUDA()) {
    std::cerr << app << ": --device cuda but no CUDA device is available\n";
    return std::nullopt;
  }
  BenchModel b;
  b.device = device == "cuda" ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  b.dtype = dtype == "bfloat16" ? at::kBFloat16 : at::kFloat;
  if (b.device.is_cpu()) install_cpu_memory_tracking();
  try {
    b.model.emplace(Transformer::load_or_random(model_dir, b.dtype, b.device, /*seed=*/0));
  } catch (const std::exception& e) {
    std::cerr << app << ": " << e.what() << "\n";
    return std::nullopt;
  }
  return b;
}

// The records as indented JSON at `path`, its folder made first.
inline void write_json_records(const std::string& path, const nlohmann::json& records) {
  const auto parent = std::filesystem::path(path).parent_path();
  std::error_code ec;
  if (!parent.empty()) std::filesystem::create_directories(parent, ec);
  std::ofstream(path) << records.dump(1) << "\n";
}

// The device activities (kernels, copies) of a traced run: how many, their union's length (GPU-busy time),
// the holes between the union's intervals (GPU-idle stretches, in order), and count and time by name (names cut at 90
// characters); the host's CUDA runtime calls by name (cudaLaunchKernel, cudaMemcpyAsync, cudaStreamSynchronize...),
// where a host that waits shows; and the host's operators (aten::mm, autograd nodes...) by name, each with the time it
// took inside and out (a nested call counts in its caller's too), where a host that cannot keep the device fed shows.
struct DeviceTrace {
  using ByName = std::map<std::string, std::pair<int64_t, double>>;  // name -> count, ms
  int64_t activities = 0;
  double busy_ms = 0;
  std::vector<uint64_t> gaps_ns;
  ByName by_name, runtime, host_ops;
  // The `n` names of `m` (by_name by default) that took the most time, longest first.
  std::vector<std::string> top(size_t n, const ByName* m = nullptr) const {
    std::vector<std::pair<double, std::string>> order;
    for (const auto& [name, v] : m ? *m : by_name) order.emplace_back(v.second, name);
    std::sort(order.rbegin(), order.rend());
    std::vector<std::string> out;
    for (size_t i = 0; i < order.size() && i < n; ++i) out.push_back(order[i].second);
    return out;
  }
};

// Runs fn() under the Kineto profiler (CPU and CUDA activities; synchronising the device before it stops)
// and returns its device activities.
template <class F>
DeviceTrace trace_device(const at::Device& dev, F&& fn) {
  namespace prof = torch::autograd::profiler;
  const prof::ProfilerConfig config(prof::ProfilerState::KINETO);
  const std::set<torch::profiler::impl::ActivityType> acts{torch::profiler::impl::ActivityType::CPU,
                                                           torch::profiler::impl::ActivityType::CUDA};
  prof::prepareProfiler(config, acts);
  prof::enableProfiler(config, acts);
  fn();
  device_synchronize(dev);
  const auto result = prof::disableProfiler();
  DeviceTrace t;
  std::vector<std::pair<uint64_t, uint64_t>> iv;
  for (const auto& e : result->events()) {
    if (e.deviceType() != c10::DeviceType::CUDA) {
      auto& [count, ms] = (e.name().rfind("cuda", 0) == 0 ? t.runtime : t.host_ops)[e.name().substr(0, 90)];
      count += 1;
      ms += double(e.durationNs()) / 1e6;
      continue;
    }
    if (e.deviceType() != c10::DeviceType::CUDA || e.durationNs() == 0) continue;
    iv.emplace_back(e.startNs(), e.startNs() + e.durationNs());
    auto& [count, ms] = t.by_name[e.name().substr(0, 90)];
    count += 1;
    ms += double(e.durationNs()) / 1e6;
  }
  std::sort(iv.begin(), iv.end());
  t.activities = static_cast<int64_t>(iv.size());
  uint64_t end = 0, total = 0;
  for (const auto& [s, e] : iv) {
    if (s >= end) {
      if (end > 0 && s > end) t.gaps_ns.push_back(s - end);
      total += e - s;
      end = e;
    } else if (e > end) {
      total += e - end;
      end = e;
    }
  }
  t.busy_ms = double(total) / 1e6;
  return t;
}

}  // namespace rlt
