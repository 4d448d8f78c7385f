// bench_adamw: one AdamW step over a flat fp32 slice of --elems elements, each way the trainer can take:
// adamw_step on the CPU (all of ATen's threads, one pass) beside ATen's op-by-op sequence (what
// torch::optim::AdamW runs), adamw_step on the GPU, and OffloadedAdamW's two drivers (host step; stream
// through the GPU) with the gradient on the GPU and bf16 weights written back to it, for each --chunks
// size. With --model (a config.json, or a folder holding one), the trainer's replicated optimizer step over
// that model's trainable tensors instead: bf16 weights under fp32 masters (configs/retool.yaml's), clipped
// at 1.0, stepped and rounded into the weights, once as torch runs it (clip_grad_norm_, one
// torch::optim::AdamW::step, a copy a tensor) and once as the trainer does (clip_gradients,
// step_multi_tensor, one _foreach_copy_), each from the same start and gradients, and the master elements
// where the two differ after all their steps. Prints one JSON object: milliseconds per step (median of
// --reps after one warm-up) and the bytes each moves. Exit code 2 for bad flags or a failed allocation.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/memory.h"
#include "model/config.h"
#include "model/transformer.h"
#include "parallel/adamw.h"
#include "trainer/optim.h"

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

// The replicated step over `path`'s model on `device`, both ways (see the top of the file).
json model_step(const std::string& path, int reps, const at::Device& device) {
  const rlt::ModelConfig config = rlt::load_model_config(path);
  rlt::Transformer model(config, at::kBFloat16, device, /*seed=*/0);
  std::vector<at::Tensor> weights;
  int64_t elems = 0;
  for (const at::Tensor& w : model.trainable_parameters()) {
    weights.push_back(w.detach());
    elems += w.numel();
  }
  at::manual_seed(1);
  std::vector<at::Tensor> grads;  // a step's gradients, norm ~0.02 sqrt(elems): the clip scales them
  for (const at::Tensor& w : weights) grads.push_back(at::randn(w.sizes(), w.options().dtype(at::kFloat)) * 0.02);
  json out = {{"model", path}, {"tensors", weights.size()}, {"elems", elems}};
  std::vector<at::Tensor> final_masters;
  for (const bool multi : {false, true}) {
    std::vector<at::Tensor> masters;
    for (size_t i = 0; i < weights.size(); ++i) {
      masters.push_back(weights[i].to(at::kFloat));
      masters.back().mutable_grad() = grads[i].clone();  // the clip scales them in place, step after step
    }
    torch::optim::AdamW opt(masters, torch::optim::AdamWOptions(1e-6).betas({0.9, 0.98}).weight_decay(0.1));
    const double ms = median_ms(reps, device, [&] {
      at::NoGradGuard no_grad;
      if (multi) {
        rlt::clip_gradients(masters, 1.0);
        rlt::step_multi_tensor(opt);
        at::_foreach_copy_(weights, masters);
      } else {
        torch::nn::utils::clip_grad_norm_(masters, 1.0);
        opt.step();
        for (size_t i = 0; i < weights.size(); ++i) weights[i].copy_(masters[i]);
      }
    });
    out[multi ? "multi_tensor_ms" : "torch_ms"] = ms;
    if (multi) {
      int64_t different = 0;
      for (size_t i = 0; i < masters.size(); ++i) different += masters[i].ne(final_masters[i]).sum().item<int64_t>();
      out["masters_different"] = different;
    } else {
      final_masters = masters;
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_adamw: one AdamW step of a flat fp32 slice, on the CPU, the GPU and offloaded"};
  double elems_f = 1e8;
  int reps = 10;
  int threads = 0;
  std::vector<int64_t> chunks = {int64_t(1) << 20, int64_t(1) << 22, int64_t(1) << 24};
  bool skip_aten = false;
  std::string model;
  app.add_option("--elems", elems_f, "elements in the slice")->check(CLI::Range(1.0, 4e9));
  app.add_option("--reps", reps, "timed steps per case (median)")->check(CLI::Range(1, 1000));
  app.add_option("--threads", threads, "ATen intra-op threads (0: ATen's default)")->check(CLI::Range(0, 1024));
  app.add_option("--chunks", chunks, "OffloadedAdamW chunk sizes, elements")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 32));
  app.add_flag("--skip-aten", skip_aten,
               "leave out the op-by-op CPU baseline (its temporaries need 2 x elems x 4 bytes)");
  app.add_option("--model", model,
                 "the replicated step over this model's tensors (a config.json or its folder), torch's and the "
                 "trainer's, on the GPU when there is one");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return e.get_exit_code() == 0 ? app.exit(e) : (app.exit(e), 2);
  }
  if (threads > 0) at::set_num_threads(threads);
  if (!model.empty()) {
    try {
      const at::Device device = at::hasCUDA() ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
      std::cout << model_step(model, reps, device).dump(2) << "\n";
    } catch (const std::exception& e) {
      std::cerr << "bench_adamw: " << e.what() << "\n";
      return 2;
    }
    return 0;
  }
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
