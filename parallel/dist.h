// Data-parallel training: the launch environment, the collectives a run uses, how a step's prompts are
// shared among the ranks, and the gradient reduction that overlaps the backward.
//
// Every rank holds the whole model and optimizer, unless train.shard splits them (parallel/shard.h). A
// step's P prompts are drawn by every rank in the same order (the prompt stream and its noise streams are
// the single-process ones); each rank samples its share, with a prompt's G samples on one rank, so group
// advantages need no communication. Per optimizer step:
//   - the loss denominators (tokens, sequences) are summed over the ranks before the loss, so each rank's
//     loss is its share of the single-process loss;
//   - gradients are summed (not averaged) over the ranks in buckets launched as the backward produces
//     them, so every rank holds the single-process gradient and clips by its global norm;
//   - metrics are reduced (sums, maxima) or gathered (per-trajectory rows) once a step.
// Rank 0 writes checkpoints (each rank its optimizer pieces when sharded), metrics.jsonl, samples.jsonl
// and the plot. A checkpoint's optimizer state is per parameter, so a run resumes with any number of ranks.
//
// Two backends behind one interface: NCCL through c10d's ProcessGroupNCCL for CUDA runs (dist_nccl.cpp),
// and collectives through c10d's key-value store for CPU runs and the CPU tests (the torch wheel ships no
// Gloo). The store's collectives copy every tensor through the rendezvous process: correct, and fast
// enough for the tiny CPU models, nothing more.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace rlt {

// A peer rank that died, hung past train.dist_timeout_s, or could not be reached. The apps exit with
// code 1 (not bad input) and the message names the rank.
class DistError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// torchrun's variables (--nproc sets them too): RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
// Without RANK, WORLD_SIZE and LOCAL_RANK, Slurm's: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, and
// MASTER_ADDR, MASTER_PORT (which the sbatch script exports), read when SLURM_PROCID is set and
// SLURM_NTASKS > 1 (srun's tasks; one task per GPU). Neither: one process (launched = false). A partial or
// malformed set is refused, naming the variable (RunError). A rank's GPU is cuda:local_rank.
struct DistEnv {
  bool launched = false;
  int rank = 0, world = 1, local_rank = 0;
  std::string master_addr;
  int master_port = 0;
  // TORCHELASTIC_USE_AGENT_STORE=True (torchrun): the launcher's agent serves the store at MASTER_ADDR:PORT
  // and every rank is a client; otherwise rank 0 serves it.
  bool agent_store = false;
};
DistEnv dist_env(const std::function<const char*(const char*)>& getenv);
DistEnv dist_env();  // from the process environment

enum class ReduceOp { kSum, kMax };

// A collective started in the background (a gradient bucket); wait() makes what follows see its result.
class Pending {
 public:
  virtual ~Pending() = default;
  virtual void wait() = 0;
};

// The collectives of a data-parallel run. Every rank calls them in the same order. Tensors are reduced in
// place, contiguous; a backend may take host tensors and copy them through its device.
class Collectives {
 public:
  Collectives(int rank, int world) : rank_(rank), world_(world) {}
  virtual ~Collectives() = default;
  int rank() const { return rank_; }
  int world() const { return world_; }
  bool lead() const { return rank_ == 0; }
  virtual void all_reduce(const std::vector<at::Tensor>& tensors, ReduceOp op) = 0;
  // An in-place sum over the ranks of tensors of one dtype (a gradient bucket), started now; the default
  // runs it at once.
  virtual std::unique_ptr<Pending> all_reduce_start(const std::vector<at::Tensor>& tensors);
  // The sharded state's two collectives (parallel/shard.h), started now, on contiguous tensors of one dtype.
  // reduce_scatter: `in` (world x n elements) summed element-wise over the ranks; `out` (n) receives
  // elements [rank n, (rank + 1) n) of the sum. all_gather: `out` (world x n) receives every rank's `in`
  // (n), in rank order.
  virtual std::unique_ptr<Pending> reduce_scatter_start(const at::Tensor& out, const at::Tensor& in) = 0;
  virtual std::unique_ptr<Pending> all_gather_start(const at::Tensor& out, const at::Tensor& in) = 0;
  virtual void broadcast(const std::vector<at::Tensor>& tensors, int root) = 0;
  virtual void barrier() = 0;
  // A second set of collectives between the same ranks, independent of this one: collectives on the two may
  // run at once from two threads (train.async's rollout thread has its own). Every rank forks in the same
  // order with the same name.
  virtual std::shared_ptr<Collectives> fork(const std::string& name);
  // The collectives among `members` (ranks of this set, ascending), ranked by their place in it; nullptr on
  // a rank that is not a member. Every rank calls it in the same order with the same name and members; the
  // group's collectives involve its members alone.
  std::shared_ptr<Collectives> group(const std::string& name, const std::vector<int>& members);
  // Where this rank is ("step 3: update"): read when a collective times out, to name the late rank.
  virtual void mark(const std::string& where) {}
  // The end of a clean run, on every rank: rank 0 (which may serve the store) waits until every rank has
  // said goodbye, so none loses the store while it still reads it.
  virtual void close() {}
  // The key-value store the collectives meet through (nullptr: one process), for what a run keeps beside
  // them (the placement's signs of life, parallel/placement.h).
  virtual c10::intrusive_ptr<c10d::Store> store() const { return {}; }

 protected:
  // group()'s backend part, on a member: a set of `world` ranks in which this one is `rank`.
  virtual std::shared_ptr<Collectives> make_group(const std::string& name, int rank, int world);

 private:
  int rank_, world_;
};

// One process: every collective is the identity.
std::shared_ptr<Collectives> single_process();

// Collectives through a c10d key-value store (a TCPStore across processes, a HashStore across threads):
// each rank posts its tensors under a per-call key and sums every rank's in rank order, so all ranks get
// the same bits. A rank whose key does not come within `timeout` is named in the DistError.
std::shared_ptr<Collectives> store_collectives(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world,
                                               std::chrono::milliseconds timeout);
// What both backends keep in the rendezvous store beside their collectives. store_mark: `rank`'s mark
// (Collectives::mark). store_read_mark: rank r's mark, "" when it has none (throws c10::Error when the
// store is gone: for the timeout messages, which catch it). store_farewell: close()'s goodbye, each rank
// counting itself under "rlt/closed" and rank 0 waiting for all. The store gone while marking or saying
// goodbye is a DistError naming `rank`.
void store_mark(c10d::Store& store, int rank, const std::string& where);
std::string store_read_mark(c10d::Store& store, int r);
void store_farewell(c10d::Store& store, int rank, int world, std::chrono::milliseconds timeout);
// An in-memory store for ranks on threads of one process (tests).
c10::intrusive_ptr<c10d::Store> thread_store();

// NCCL (ProcessGroupNCCL) on `device`, rendezvous through `store`. Throws DistError when this build has no
// NCCL (nccl_available() false).
std::shared_ptr<Collectives> nccl_collectives(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world,
                                              at::Device device, std::chrono::milliseconds timeout);
bool nccl_available();

// The launched process's collectives: a TCPStore at MASTER_ADDR:MASTER_PORT (rank 0 serves it), then
// NCCL for a CUDA device, the store's collectives for the CPU.
std::shared_ptr<Collectives> connect(const DistEnv& env, at::Device device, std::chrono::milliseconds timeout);

// ---- How a step's work is shared ----

// The global prompt indices (of 0..P-1) rank `rank` samples. Within each mini-batch's prompts
// (prompts_per_mini of them) a rank takes a contiguous 1/world share, so the ranks' k-th local mini-batches
// together are the single-process k-th mini-batch and a mini-batch's update is the single-process one.
std::vector<int64_t> rank_prompts(int64_t P, int64_t prompts_per_mini, int world, int rank);

}  // namespace rlt
