// How a rank learns its place (parallel/dist.h dist_env: torchrun's variables, else Slurm's) and the
// launcher's flags (parallel/launch.h: --nproc, --nnodes, --node-rank, --master-addr, --master-port). The
// launches themselves run as processes in tests/apps/check_multinode.py.
#include <gtest/gtest.h>

#include <map>

#include "common/errors.h"
#include "parallel/dist.h"
#include "parallel/launch.h"

namespace rlt {
namespace {

using Vars = std::map<std::string, std::string>;

DistEnv env_of(const Vars& vars) {
  return dist_env([&](const char* n) -> const char* {
    auto it = vars.find(n);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

std::string error_of(const Vars& vars) {
  try {
    env_of(vars);
  } catch (const RunError& e) {
    return e.what();
  }
  return "";
}

Vars with(Vars m, const std::string& k, const std::string& v) {
  m[k] = v;
  return m;
}

Vars without(Vars m, const std::string& k) {
  m.erase(k);
  return m;
}

// Task 5 of 8, the second on its node: rank, world and local rank are three different numbers, so reading
// any one variable in another's place (the GPU from SLURM_PROCID, the world from SLURM_LOCALID) fails below.
const Vars kSlurmTask = {{"SLURM_PROCID", "5"},
                         {"SLURM_NTASKS", "8"},
                         {"SLURM_LOCALID", "1"},
                         {"MASTER_ADDR", "gpu-node-01"},
                         {"MASTER_PORT", "29511"}};

TEST(DistEnv, ReadsSlurmsTasksWhenTorchrunsVariablesAreAbsent) {
  const DistEnv e = env_of(kSlurmTask);
  EXPECT_TRUE(e.launched);
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world, 8);
  EXPECT_EQ(e.local_rank, 1) << "the GPU is cuda:SLURM_LOCALID";
  EXPECT_EQ(e.master_addr, "gpu-node-01");
  EXPECT_EQ(e.master_port, 29511);
  EXPECT_FALSE(e.agent_store) << "rank 0 serves the store";
  EXPECT_FALSE(env_of(with(kSlurmTask, "TORCHELASTIC_USE_AGENT_STORE", "True")).agent_store)
      << "no torchrun agent under srun";
}

TEST(DistEnv, OneSlurmTaskOrNoneIsOneProcess) {
  EXPECT_FALSE(env_of(with(kSlurmTask, "SLURM_NTASKS", "1")).launched) << "a step of one task";
  EXPECT_FALSE(env_of(without(kSlurmTask, "SLURM_NTASKS")).launched) << "a batch script without --ntasks";
  EXPECT_FALSE(env_of(without(kSlurmTask, "SLURM_PROCID")).launched) << "salloc's shell: no task of a step";
  EXPECT_FALSE(env_of({{"MASTER_ADDR", "gpu-node-01"}, {"MASTER_PORT", "29511"}}).launched)
      << "the sbatch script's exports alone";
  // A one-task step with nothing else set, as a plain sbatch job has.
  EXPECT_FALSE(env_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_LOCALID", "0"}}).launched);
}

TEST(DistEnv, RefusesAPartialOrBadSlurmSetNamingTheVariable) {
  EXPECT_NE(error_of(without(kSlurmTask, "SLURM_LOCALID")).find("SLURM_LOCALID is not set"), std::string::npos);
  EXPECT_NE(error_of(without(kSlurmTask, "MASTER_ADDR")).find("MASTER_ADDR is not set"), std::string::npos);
  EXPECT_NE(error_of(without(kSlurmTask, "MASTER_PORT")).find("MASTER_PORT is not set"), std::string::npos);
  EXPECT_NE(error_of(with(kSlurmTask, "SLURM_PROCID", "8")).find("SLURM_PROCID=8"), std::string::npos)
      << "a task outside the step";
  EXPECT_NE(error_of(with(kSlurmTask, "SLURM_LOCALID", "-1")).find("SLURM_LOCALID=-1"), std::string::npos);
  EXPECT_NE(error_of(with(kSlurmTask, "SLURM_NTASKS", "8(x2)")).find("SLURM_NTASKS=8(x2)"), std::string::npos);
  EXPECT_EQ(error_of(kSlurmTask), "");
}

TEST(DistEnv, TorchrunsVariablesComeBeforeSlurms) {
  // srun torchrun ...: torchrun's ranks inherit the srun task's variables beside their own.
  Vars both = kSlurmTask;
  for (const auto& [k, v] : Vars{{"RANK", "3"},
                                 {"WORLD_SIZE", "16"},
                                 {"LOCAL_RANK", "3"},
                                 {"MASTER_PORT", "29400"},
                                 {"TORCHELASTIC_USE_AGENT_STORE", "True"}}) {
    both[k] = v;
  }
  const DistEnv e = env_of(both);
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world, 16);
  EXPECT_EQ(e.local_rank, 3);
  EXPECT_EQ(e.master_port, 29400);
  EXPECT_TRUE(e.agent_store);
  // A partial torchrun set is refused even with a whole Slurm set beside it.
  EXPECT_NE(error_of(without(both, "LOCAL_RANK")).find("LOCAL_RANK is not set"), std::string::npos);
}

std::string launch_error(LaunchOptions o) {
  try {
    check_launch(o);
  } catch (const RunError& e) {
    return e.what();
  }
  return "";
}

LaunchOptions launch(int nproc, int nnodes = 0, int node_rank = -1, const std::string& addr = "", int port = 0) {
  LaunchOptions o;
  o.nproc = nproc;
  o.nnodes = nnodes;
  o.node_rank = node_rank;
  o.master_addr = addr;
  o.master_port = port;
  return o;
}

TEST(CheckLaunch, FillsTheDefaultsOfOneNodeAndOfSeveral) {
  LaunchOptions one = launch(2);
  check_launch(one);
  EXPECT_EQ(one.nnodes, 1);
  EXPECT_EQ(one.node_rank, 0);
  EXPECT_EQ(one.world(), 2);
  EXPECT_TRUE(one.loopback());
  LaunchOptions node = launch(4, 3, 2, "10.0.0.1", 29500);
  check_launch(node);
  EXPECT_EQ(node.world(), 12);
  EXPECT_FALSE(node.loopback());
  LaunchOptions none = launch(0);
  EXPECT_EQ(launch_error(none), "") << "no launch flag: this process trains";
}

TEST(CheckLaunch, RefusesBadCombinationsNamingTheFlag) {
  auto starts = [](const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; };
  EXPECT_TRUE(starts(launch_error(launch(0, 2)), "--nnodes needs --nproc")) << launch_error(launch(0, 2));
  EXPECT_TRUE(starts(launch_error(launch(0, 0, 1)), "--node-rank needs --nproc"));
  EXPECT_TRUE(starts(launch_error(launch(0, 0, -1, "h")), "--master-addr needs --nproc"));
  EXPECT_TRUE(starts(launch_error(launch(0, 0, -1, "", 29500)), "--master-port needs --nproc"));
  EXPECT_TRUE(starts(launch_error(launch(1, 2, 2, "h", 29500)), "--node-rank 2: nodes are numbered 0 to 1"));
  EXPECT_TRUE(starts(launch_error(launch(1, 0, 1)), "--node-rank 1: nodes are numbered 0 to 0")) << "one node";
  EXPECT_TRUE(starts(launch_error(launch(1, 2, 1, "", 29500)), "--nnodes 2 needs --master-addr"));
  EXPECT_TRUE(starts(launch_error(launch(1, 2, 1, "h")), "--nnodes 2 needs --master-port"));
  EXPECT_TRUE(starts(launch_error(launch(1, 1, 0, "", 29500)), "--master-port needs --master-addr"));
  EXPECT_TRUE(starts(launch_error(launch(1, 1, 0, "h")), "--master-addr needs --master-port"));
  EXPECT_EQ(launch_error(launch(1, 1, 0, "h", 29500)), "") << "one node may name its own address";
}

TEST(WithoutLaunchFlags, DropsEachLaunchFlagAndItsValueInBothForms) {
  std::vector<std::string> in = {"grpo_train",
                                 "--config",
                                 "c.yaml",
                                 "--nproc",
                                 "2",
                                 "--nnodes=2",
                                 "--node-rank",
                                 "1",
                                 "--master-addr",
                                 "node-0",
                                 "--set",
                                 "train.steps=4",
                                 "--master-port=29500",
                                 "--master-address",
                                 "x",
                                 "--out",
                                 "o"};
  std::vector<char*> argv;
  for (auto& a : in) argv.push_back(a.data());
  const std::vector<std::string> out = without_launch_flags(static_cast<int>(argv.size()), argv.data());
  // An unknown flag that starts like one of them (--master-address) is the trainer's to refuse, and stays.
  const std::vector<std::string> want = {"grpo_train",       "--config", "c.yaml", "--set", "train.steps=4",
                                         "--master-address", "x",        "--out",  "o"};
  EXPECT_EQ(out, want);
}

}  // namespace
}  // namespace rlt
