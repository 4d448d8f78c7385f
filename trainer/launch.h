// `--nproc N`: the ranks of a data-parallel run started by the trainer itself, for users without torchrun.
#pragma once

#include <string>
#include <vector>

namespace rlt {

// Runs this program (`args`, argv without --nproc) as `nproc` ranks on this machine, each with torchrun's
// variables: RANK = LOCAL_RANK = i, WORLD_SIZE = nproc, MASTER_ADDR = 127.0.0.1, MASTER_PORT = a loopback
// port whose listening socket rank 0's store takes over (RLT_MASTER_LISTEN_FD).
// Waits for them all. The first rank to fail (a non-zero exit or a signal) is named, the others are
// stopped (SIGTERM, SIGKILL 10 s later), and its exit code is returned (1 for a signal). SIGINT and SIGTERM
// reach every rank. 0 when every rank exits 0.
int launch_ranks(const std::string& name, int nproc, const std::vector<std::string>& args);

// argv without "--nproc N" / "--nproc=N".
std::vector<std::string> without_nproc(int argc, char** argv);

}  // namespace rlt
