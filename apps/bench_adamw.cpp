// bench_adamw: one AdamW step over a flat fp32 slice of --elems elements, each way the trainer can take:
// adamw_step on the CPU (all of ATen's threads, one pass) beside ATen's op-by-op sequence (what
// torch::optim::AdamW runs), adamw_step on the GPU, and OffloadedAdamW's two drivers (host step; stream
// through the GPU) with the gradient on the GPU and bf16 weights written back to it, for each --chunks
// size. Prints one JSON object: milliseconds per step (median of --reps after one warm-up) and the
// bytes each moves. Exit code 2 for bad flags or a failed allocation.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/memory.h"
#include "parallel/adamw.h"

using json = nlohmann::json;

namespace {

// Median milliseconds of `reps` calls of f after one warm-up, each ended by a device synchronisation.
double median_ms(int reps, const at::Device& device, const std::function<void()>& f) {
  f();
  rlt::device_synchronize(device);
  std::vector<double> ms;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    rlt::device_synchronize(device);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// torch::optim::AdamW's op sequence (the baseline the one-pass kernel replaces).
void aten_adamw(at::Tensor& p, const at::Tensor& g, at::Tensor& m, at::Tensor& v, const rlt::AdamWStep& s) {
  const double bc1 = 1 - std::pow(s.beta1, double(s.step)), bc2 = 1 - std::pow(s.beta2, double(s.step));
  p.mul_(1 - s.lr * s.weight_decay);
  m.mul_(s.beta1).add_(g, 1 - s.beta1);
  v.mul_(s.beta2).addcmul_(g, g, 1 - s.beta2);
  const at::Tensor denom = (v.sqrt() / std::sqrt(bc2)).add_(s.eps);
  p.addcdiv_(m, denom, -(s.lr / bc1));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_adamw: one AdamW step of a flat fp32 slice, on the CPU, the GPU and offloaded"};
  double elems_f = 1e8;
  int reps = 10;
  int threads = 0;
  std::vector<int64_t> chunks = {int64_t(1) << 20, int64_t(1) << 22, int64_t(1) << 24};
  bool skip_aten = false;
  app.add_option("--elems", elems_f, "elements in the slice")->check(CLI::Range(1.0, 4e9));
  app.add_option("--reps", reps, "timed steps per case (median)")->check(CLI::Range(1, 1000));
  app.add_option("--threads", threads, "ATen intra-op threads (0: ATen's default)")->check(CLI::Range(0, 1024));
  app.add_option("--chunks", chunks, "OffloadedAdamW chunk sizes, elements")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 32));
  app.add_flag("--skip-aten", skip_aten,
               "leave out the op-by-op CPU baseline (its temporaries need 2 x elems x 4 bytes)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return e.get_exit_code() == 0 ? app.exit(e) : (app.exit(e), 2);
  }
  if (threads > 0) at::set_num_threads(threads);
  const int64_t n = static_cast<int64_t>(elems_f);
  rlt::AdamWStep s;  // torch's defaults; step 10 so the bias corrections are not trivial
  s.step = 10;
  json result = {{"elems", n}, {"threads", at::get_num_threads()}, {"reps", reps}};
  try {
    at::manual_seed(0);
    const at::Device cpu(at::kCPU);
    at::Tensor p = at::randn({n}), g = at::randn({n}), m = at::zeros({n}), v = at::zeros({n});
    // Host traffic per element: read p, g, m, v and write p, m, v.
    const double host_bytes = 28.0 * double(n);
    const double ms_cpu = median_ms(reps, cpu, [&] { rlt::adamw_step(p, g, m, v, s); });
    result["cpu_adamw_step"] = {{"ms", ms_cpu}, {"GBps", host_bytes / ms_cpu / 1e6}};
    if (!skip_aten) {
      const double ms_aten = median_ms(reps, cpu, [&] { aten_adamw(p, g, m, v, s); });
      result["cpu_aten_ops"] = {{"ms", ms_aten}, {"GBps_useful", host_bytes / ms_aten / 1e6}};
    }
    if (at::hasCUDA()) {
      const at::Device gpu(at::kCUDA, 0);
      at::Tensor pd = p.to(gpu), gd = g.to(gpu), md = m.to(gpu), vd = v.to(gpu);
      const double ms_gpu = median_ms(reps, gpu, [&] { rlt::adamw_step(pd, gd, md, vd, s); });
      result["cuda_adamw_step"] = {{"ms", ms_gpu}};
      pd = md = vd = at::Tensor();  // only the gradient and the weights stay on the device
      at::Tensor out = at::empty({n}, at::TensorOptions().dtype(at::kBFloat16).device(gpu));
      json offload = json::array();
      for (const int64_t chunk : chunks) {
        for (const auto mode : {rlt::OffloadMode::kHostStep, rlt::OffloadMode::kStreamDevice}) {
          rlt::OffloadedAdamW off(p, {mode, chunk});
          const double ms = median_ms(reps, gpu, [&] { off.step(gd, s, out); });
          const bool host = mode == rlt::OffloadMode::kHostStep;
          // PCIe bytes per element: host step: the gradient to the host (4), bf16 weights back (2);
          // stream: p, m, v to the GPU and back (24).
          const double pcie = (host ? 6.0 : 24.0) * double(n);
          offload.push_back({{"mode", host ? "host_step" : "stream_device"},
                             {"chunk", chunk},
                             {"ms", ms},
                             {"pcie_GBps", pcie / ms / 1e6},
                             {"host_bytes", off.host_bytes()}});
        }
      }
      result["offload"] = offload;
      result["device"] = "cuda";
    } else {
      result["device"] = "cpu";
    }
  } catch (const std::exception& e) {
    std::cerr << "bench_adamw: " << e.what() << "\n";
    return 2;
  }
  std::cout << result.dump(2) << "\n";
  return 0;
}
