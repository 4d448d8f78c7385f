// What the model benchmarks (bench_model, bench_step, bench_update, bench_rollout) share after parsing their
// flags: the --device / --dtype values checked and turned into LibTorch's, CPU memory tracking switched on,
// and the model loaded (or made with random weights) with any error printed as "<app>: ..." (each returns
// nullopt after printing; the app exits with code 2); and the JSON records written out.
#pragma once

#include <ATen/ATen.h>
#include <CLI/CLI.hpp>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

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

}  // namespace rlt
