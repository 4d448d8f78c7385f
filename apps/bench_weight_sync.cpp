// bench_weight_sync: train.rollout_ranks' weight broadcast alone (parallel/placement.h's
// broadcast_in_buckets), between the ranks of a launched job (torchrun, or Slurm's variables): rank 0 sends
// a model's weights (random, of the --model folder's config.json, in bf16) to every other rank, for each
// --bucket-mb size, --reps times after one warm-up. Every rank checks that it holds rank 0's weights
// (their float64 sum, which a dropped or misplaced bucket changes). Rank 0 prints one JSON object: per
// bucket size, the median seconds and the bytes over them. Exit code 2 for bad flags or no launch.
#include <ATen/ATen.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/transformer.h"
#include "parallel/dist.h"
#include "trainer/rollout_ranks.h"

int main(int argc, char** argv) {
  CLI::App app{"bench_weight_sync: the rollout ranks' bucketed weight broadcast, between launched ranks"};
  std::string model_dir;
  std::vector<int64_t> bucket_mb = {25, 100, 400};
  int reps = 5;
  app.add_option("--model", model_dir, "folder with config.json (the weights are random)")->required();
  app.add_option("--bucket-mb", bucket_mb, "bucket sizes in MiB (train.rollout_sync_mb)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 16));
  app.add_option("--reps", reps, "timed broadcasts per bucket size, after one warm-up")->check(CLI::Range(1, 1000));
  CLI11_PARSE(app, argc, argv);
  const rlt::DistEnv env = rlt::dist_env();
  if (!env.launched || env.world < 2) {
    std::cerr << "bench_weight_sync: launch it on two ranks or more (torchrun --nproc-per-node 2 ...)\n";
    return 2;
  }
  if (!at::hasCUDA()) {
    std::cerr << "bench_weight_sync: needs a CUDA device per rank\n";
    return 2;
  }
  rlt::ModelConfig config;
  try {
    config = rlt::load_model_config(model_dir);
  } catch (const std::exception& e) {
    std::cerr << "bench_weight_sync: " << e.what() << "\n";
    return 2;
  }
  const at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank));
  const auto dist = rlt::connect(env, device, std::chrono::minutes(10));
  // Each rank its own random weights: the receivers' must become rank 0's.
  rlt::Transformer model(config, at::kBFloat16, device, static_cast<uint64_t>(env.rank));
  std::vector<at::Tensor> tensors;
  double bytes = 0;
  for (const auto& [name, t] : model.named_parameters()) {
    tensors.push_back(t.detach());
    bytes += static_cast<double>(t.nbytes());
  }
  auto checksum = [&] {
    double s = 0;
    for (const auto& t : tensors) s += t.sum(at::kDouble).item<double>();
    return s;
  };
  nlohmann::json out = {{"model", model_dir}, {"world", env.world}, {"bytes", bytes}, {"tensors", tensors.size()}};
  bool ok = true;
  for (int64_t mb : bucket_mb) {
    std::vector<double> s;
    rlt::SyncTiming timing;
    for (int r = 0; r <= reps; ++r) {
      rlt::broadcast_in_buckets(*dist, tensors, r, mb << 20, device, timing);
      if (r > 0) s.push_back(timing.seconds);
    }
    std::sort(s.begin(), s.end());
    const double median = s[s.size() / 2];
    // Rank 0's sum against every rank's: the largest difference must be 0.
    at::Tensor mine = at::tensor({checksum()}, at::kDouble), theirs = mine.clone();
    dist->broadcast({theirs}, 0);
    at::Tensor gap = (mine - theirs).abs();
    dist->all_reduce({gap}, rlt::ReduceOp::kMax);
    ok = ok && gap.item<double>() == 0;
    out["runs"].push_back({{"bucket_mb", mb},
                           {"buckets", timing.buckets},
                           {"seconds_median", median},
                           {"seconds_min", s.front()},
                           {"gbps", bytes / median / 1e9},
                           {"receivers_hold_rank0_weights", gap.item<double>() == 0}});
  }
  if (env.rank == 0) std::cout << out.dump(1) << std::endl;
  dist->close();
  return ok ? 0 : 1;
}
