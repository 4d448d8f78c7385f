// train_main; see app.h.
#include "trainer/app.h"

#include <ATen/Parallel.h>
#include <torch/cuda.h>

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>

#include "model/config.h"
#include "model/safetensors.h"
#include "parallel/launch.h"
#include "rollout/sandbox.h"
#include "trainer/checkpoint.h"
#include "trainer/rollout_ranks.h"

namespace rlt {

int train_main(int argc, char** argv, const std::string& name, const std::string& about, const TrainFn& train,
               const ExtraParams& extra) {
  // The caching allocator grows its segments in place (PyTorch's expandable segments) unless the
  // environment configures it: a step's tensors change size from phase to phase, and fixed-size segments
  // fragment into a reserve far above what is allocated (docs/training.md, "Memory"). torch's pinned host
  // memory (staging buffers; the run's offloaded and parked state is pinned_host_zeros's, exactly its
  // size) is malloc'ed and registered by 8 threads: 10 GB/s on an H200 host, where cudaHostAlloc pins 2
  // GB/s whatever the threads.
  setenv("PYTORCH_CUDA_ALLOC_CONF",
         "expandable_segments:True,pinned_use_cuda_host_register:True,pinned_num_register_threads:8",
         /*overwrite=*/0);
  CLI::App app{name + ": " + about};
  ConfigCli cc;
  add_config_flags(app, cc);
  std::string out;
  bool resume = false;
  app.add_option("--out", out, "run folder: metrics.jsonl, plot.svg, checkpoint/ (default runs/<config name>)");
  app.add_flag("--resume", resume, "continue from the run folder's checkpoint");
  int64_t stop_after = 0;
  app.add_option("--stop-after", stop_after, "checkpoint and exit once this many RL steps are done (0 = run all)")
      ->check(CLI::NonNegativeNumber);
  LaunchOptions launch;
  app.add_option("--nproc", launch.nproc,
                 "run N data-parallel ranks on this machine, one GPU each (cuda:0..N-1), as torchrun "
                 "--nproc-per-node N would")
      ->check(CLI::Range(1, 1024));
  app.add_option("--nnodes", launch.nnodes, "with --nproc: the nodes of the run, one launcher each (default 1)")
      ->check(CLI::Range(1, 1024));
  app.add_option("--node-rank", launch.node_rank, "with --nproc: this node, 0..nnodes-1 (default 0)")
      ->check(CLI::Range(0, 1023));
  app.add_option("--master-addr", launch.master_addr,
                 "with --nproc: node 0's address, where its launcher serves the rendezvous (several nodes)");
  app.add_option("--master-port", launch.master_port, "with --nproc: the rendezvous port on node 0")
      ->check(CLI::Range(1, 65535));
  std::string merge;
  app.add_option("--merge", merge,
                 "write the checkpoint in --out as one Hugging Face folder at this path (LoRA: the adapters merged "
                 "into the base weights) and exit; takes the run's --config");
  if (int rc = parse_cli(app, argc, argv); rc >= 0) return rc;
  Config cfg;
  if (!load_cli_config(cc, cfg)) return 2;
  if (cc.print) return 0;
  if (out.empty()) {
    out = "runs/" + (cc.path.empty() ? name : std::filesystem::path(cc.path).stem().string());
  }
  DistEnv env;
  try {
    check_launch(launch);
    // A launcher reads torchrun's variables only: under srun it is one task of its node (one per node).
    env = launch.nproc > 0
              ? dist_env([](const char* n) { return std::strncmp(n, "SLURM_", 6) == 0 ? nullptr : std::getenv(n); })
              : dist_env();
  } catch (const RunError& e) {
    std::cerr << name << ": " << e.what() << "\n";
    return 2;
  }
  if (!merge.empty() && (launch.nproc > 0 || env.launched)) {
    std::cerr << name << ": --merge runs in one process: drop --nproc and the launcher\n";
    return 2;
  }
  if (launch.nproc > 0) {
    if (env.launched) {
      std::cerr << name << ": --nproc inside a launched rank (RANK is set): use one launcher, torchrun or --nproc\n";
      return 2;
    }
    try {
      // Before any rank starts: the step splits over the ranks (over the training ranks, with rollout ranks).
      if (cfg.train.rollout_ranks > 0)
        check_placement(cfg, launch.world());
      else
        check_world(cfg, launch.world());
    } catch (const RunError& e) {
      std::cerr << name << ": --nproc " << launch.nproc
                << (launch.nnodes > 1 ? " x --nnodes " + std::to_string(launch.nnodes) : "") << ": " << e.what()
                << "\n";
      return 2;
    }
    launch.timeout = std::chrono::milliseconds(static_cast<int64_t>(1000 * cfg.train.dist_timeout_s));
    return launch_ranks(name, launch, without_launch_flags(argc, argv));
  }
  // Several ranks: messages say whose; rank 0 alone reports progress.
  const std::string who = env.launched && env.world > 1 ? name + " rank " + std::to_string(env.rank) : name;
  if (cfg.train.rollout_ranks > 0 && merge.empty() && !(env.launched && env.world > 1)) {
    std::cerr << name << ": train.rollout_ranks = " << cfg.train.rollout_ranks
              << " needs several ranks: launch with --nproc or torchrun\n";
    return 2;
  }
  try {
    std::shared_ptr<Collectives> dist;
    std::shared_ptr<Placement> placement;
    if (env.launched) {
      // One GPU per rank: model.device cuda means cuda:LOCAL_RANK.
      if (cfg.model.device.rfind("cuda", 0) == 0) {
        if (!at::hasCUDA() || static_cast<int64_t>(torch::cuda::device_count()) <= env.local_rank) {
          throw RunError("LOCAL_RANK=" + std::to_string(env.local_rank) +
                         " needs cuda:" + std::to_string(env.local_rank) + ", and this machine has " +
                         std::to_string(torch::cuda::device_count()) + " CUDA device(s)");
        }
        cfg.model.device = "cuda:" + std::to_string(env.local_rank);
      }
      dist = connect(env, at::Device(cfg.model.device),
                     std::chrono::milliseconds(static_cast<int64_t>(1000 * cfg.train.dist_timeout_s)));
      placement = place(cfg, dist);  // train.rollout_ranks: the two sides and their groups
      // train.cpu_threads: torchrun gives every rank OMP_NUM_THREADS=1 (the host step of train.offload then
      // runs on one core a rank), and ranks launched without it would each take every CPU. An
      // OMP_NUM_THREADS the user set is kept.
      const int threads = rank_cpu_threads(cfg.train.cpu_threads, user_omp_threads(std::getenv), host_cpus(),
                                           ranks_on_this_host(*dist));
      at::set_num_threads(threads);
      if (env.rank == 0) {
        const int64_t k = cfg.train.rollout_ranks;
        std::cerr << name << ": rank 0 of " << env.world << " ("
                  << (at::Device(cfg.model.device).is_cuda() ? "NCCL" : "store collectives, CPU") << "); "
                  << (k > 0 ? "ranks " + std::to_string(env.world - k) + ".." + std::to_string(env.world - 1) +
                                  " sample train.prompts_per_step / " + std::to_string(k) +
                                  " prompts a step, ranks 0.." + std::to_string(env.world - k - 1) + " train on them"
                            : "every rank samples train.prompts_per_step / " + std::to_string(env.world) +
                                  " prompts a step")
                  << "; " << threads << " CPU threads a rank\n";
      }
    } else if (cfg.train.cpu_threads > 0) {
      at::set_num_threads(int(cfg.train.cpu_threads));
    }
    if (!merge.empty()) {
      Run run = make_run(cfg, out, /*resume=*/true, extra);
      save_merged_model(run, merge);
      std::cerr << name << ": wrote " << merge << ", the policy of " << out << " at step " << run.counters.step << "\n";
      return 0;
    }
    Run run = make_run(cfg, out, resume, extra, placement ? placement->side : dist, placement);
    run.stop_after = stop_after;
    if (resume && run.lead()) std::cerr << name << ": resuming " << out << " at step " << run.counters.step << "\n";
    train(run);
    (run.placement ? run.placement->all : run.dist)->close();  // rank 0 keeps the store until every rank is done
    if (run.lead()) {
      std::cerr << name << ": done; metrics in " << out << "/metrics.jsonl, plot in " << out << "/plot.svg\n";
    }
    return 0;
  } catch (const ConfigError& e) {
    std::cerr << who << ": config error: " << e.what() << "\n";
  } catch (const RunError& e) {
    std::cerr << who << ": " << e.what() << "\n";
  } catch (const DataError& e) {
    std::cerr << who << ": data error: " << e.what() << "\n";
  } catch (const ModelConfigError& e) {
    std::cerr << who << ": model config error: " << e.what() << "\n";
  } catch (const safetensors::Error& e) {
    std::cerr << who << ": checkpoint error: " << e.what() << "\n";
  } catch (const SandboxError& e) {  // the machine, not the input: python3 missing, no fork
    std::cerr << who << ": sandbox error: " << e.what() << "\n";
    return 1;
  } catch (const DistError& e) {  // a peer died or hung: leave at once (NCCL's teardown could wait on it)
    std::cerr << who << ": " << e.what() << "\n";
    std::cerr.flush();
    std::_Exit(1);
  } catch (const std::filesystem::filesystem_error& e) {  // e.g. an --out folder that cannot be written
    std::cerr << who << ": " << e.what() << "\n";
  } catch (const c10::Error& e) {  // a broken invariant inside the trainer: a bug, not bad input
    std::cerr << who << ": internal error: " << e.what_without_backtrace() << "\n";
    return 1;
  }
  return 2;
}

}  // namespace rlt
