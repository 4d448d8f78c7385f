// `--nproc N [--nnodes M --node-rank R --master-addr HOST --master-port P]`: the ranks of a data-parallel
// run started by the trainer itself, for users without torchrun: one launcher per node, each starting its
// node's N ranks. Slurm and torchrun launches read the environment instead (dist_env, parallel/dist.h).
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace rlt {

// The launcher's flags. A field left at its "not given" value takes its default in check_launch.
struct LaunchOptions {
  int nproc = 0;            // --nproc: ranks on this node (0: no launch, this process trains)
  int nnodes = 0;           // --nnodes: nodes, one launcher each (0: not given, one node)
  int node_rank = -1;       // --node-rank: this launcher's node, 0..nnodes-1 (-1: not given, node 0)
  std::string master_addr;  // --master-addr: node 0's address, reachable from every node ("": not given)
  int master_port = 0;      // --master-port: the rendezvous port on node 0 (0: not given)
  // How long the nodes' launchers wait for each other (train.dist_timeout_s).
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};

  int world() const { return nnodes * nproc; }
  // No address: one node, a loopback port the launcher picks, served by rank 0 (RLT_MASTER_LISTEN_FD).
  // With one, node 0's launcher serves the store at master_addr:master_port for every node's ranks.
  bool loopback() const { return master_addr.empty(); }
};

// Fills the defaults of the flags not given and checks the combination; a bad one is a RunError naming
// the flag (the apps exit with code 2): a node flag without --nproc, --node-rank outside 0..nnodes-1,
// several nodes without --master-addr and --master-port, one of those two without the other.
void check_launch(LaunchOptions& o);

// Runs this program (`args`: argv without the launch flags) as ranks node_rank * nproc .. + nproc - 1 of
// nnodes * nproc, each with torchrun's variables: RANK, LOCAL_RANK = 0..nproc-1, WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT.
//   - loopback (one node, no address): MASTER_ADDR 127.0.0.1 and a port whose listening socket rank 0's
//     store takes over (RLT_MASTER_LISTEN_FD).
//   - with an address: node 0's launcher serves the rendezvous store at the address and port, and the ranks
//     are its clients (TORCHELASTIC_USE_AGENT_STORE=True, as under torchrun), so the store outlives any
//     one rank. Before any rank starts, the launchers meet there: each claims its --node-rank, and every
//     launcher must have node 0's --nnodes and --nproc. A node claimed twice or a mismatch is refused on
//     every launcher that sees it (exit 2); nodes missing after `timeout` end the launch (exit 1).
// Waits for the node's ranks. The first rank to fail (a non-zero exit or a signal) is named, the node's
// other ranks are stopped (SIGTERM, SIGKILL 10 s later), and its exit code is returned (1 for a signal).
// With several nodes the failure is posted in the store and every other launcher stops its ranks and
// returns 1. SIGINT and SIGTERM reach every rank of the node. 0 when every rank exits 0.
int launch_ranks(const std::string& name, const LaunchOptions& o, const std::vector<std::string>& args);

// argv without the launch flags (--nproc, --nnodes, --node-rank, --master-addr, --master-port), each as
// "--flag VALUE" or "--flag=VALUE".
std::vector<std::string> without_launch_flags(int argc, char** argv);

}  // namespace rlt
