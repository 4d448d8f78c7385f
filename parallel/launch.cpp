// check_launch, launch_ranks; see launch.h.
#include "parallel/launch.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <iostream>
#include <set>
#include <thread>

#include "common/errors.h"

extern char** environ;

namespace rlt {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

volatile sig_atomic_t g_stop_signal = 0;

void on_stop(int sig) { g_stop_signal = sig; }

// A socket listening on a loopback port the kernel picks, kept open and handed to rank 0's store
// (RLT_MASTER_LISTEN_FD): no other process can take the port between the choice and the rendezvous, and
// the store is reachable from this machine only. -1 when none could be made (the store then binds the
// port itself).
int listening_socket(int& port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || listen(fd, 128) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    close(fd);
    return -1;
  }
  port = ntohs(a.sin_port);
  return fd;
}

std::string describe(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return "was killed by signal " + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")";
  }
  return "stopped (status " + std::to_string(status) + ")";
}

// ---- The nodes' launchers meet in node 0's store (keys under rlt/launch/) ----

// The launch cannot go on: `code` 2 for flags the launchers disagree on, 1 for a node that is not there.
struct LaunchFailure {
  int code;
  std::string message;
};

const char* const kShapeKey = "rlt/launch/shape";    // node 0's "--nnodes M --nproc N"
const char* const kRefusedKey = "rlt/launch/error";  // why a launcher refused the launch, for the others
const char* const kFailedKey = "rlt/launch/failed";  // the first failure once the ranks run
const char* const kDoneKey = "rlt/launch/done";      // how many launchers have seen their ranks end
std::string node_key(int r) { return "rlt/launch/node/" + std::to_string(r); }

std::string str(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
std::vector<uint8_t> bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

std::string seconds(milliseconds t) { return std::to_string(t.count() / 1000) + " s (train.dist_timeout_s)"; }

// A TCPStore at --master-addr:--master-port; node 0's launcher serves it. SIGINT and SIGTERM are blocked
// while it is made, so the server's thread inherits the mask and the signals reach the thread that waits
// for the ranks.
c10::intrusive_ptr<c10d::Store> open_store(const LaunchOptions& o, bool server, milliseconds timeout) {
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(o.master_port);
  so.isServer = server;
  so.waitWorkers = false;  // the ranks count themselves in (connect, parallel/dist.cpp); launchers do not
  so.timeout = timeout;
  sigset_t block, old;
  sigemptyset(&block);
  sigaddset(&block, SIGINT);
  sigaddset(&block, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &block, &old);
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(o.master_addr, so);
  } catch (...) {
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
    throw;
  }
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  return store;
}

// Refuses the launch on this launcher and, through the store, on every other.
[[noreturn]] void refuse(c10d::Store& store, const std::string& why) {
  store.set(kRefusedKey, bytes(why));
  throw LaunchFailure{2, why};
}

// Polls until every key of `keys` is in the store; another launcher's refusal or the deadline ends the wait.
void wait_for(c10d::Store& store, const std::vector<std::string>& keys, Clock::time_point deadline,
              const std::function<std::string()>& late) {
  while (!store.check(keys)) {
    if (store.check({kRefusedKey})) {
      throw LaunchFailure{2, "another node's launcher refused the launch: " + str(store.get(kRefusedKey))};
    }
    if (Clock::now() > deadline) throw LaunchFailure{1, late()};
    std::this_thread::sleep_for(milliseconds(50));
  }
  if (store.check({kRefusedKey})) {
    throw LaunchFailure{2, "another node's launcher refused the launch: " + str(store.get(kRefusedKey))};
  }
}

// Before any rank starts: node 0's launcher serves the store, every launcher claims its node there, the
// others check node 0's shape, and all wait until every node is claimed. Returns the store, which the
// launcher keeps to post and watch for failures.
c10::intrusive_ptr<c10d::Store> join_nodes(const LaunchOptions& o) {
  const std::string node = "--node-rank " + std::to_string(o.node_rank);
  const std::string at = o.master_addr + ":" + std::to_string(o.master_port);
  c10::intrusive_ptr<c10d::Store> store;
  std::string cannot_serve;
  if (o.node_rank == 0) {
    try {
      store = open_store(o, /*server=*/true, o.timeout);
    } catch (const c10::Error& e) {
      cannot_serve =
          "--master-port " + std::to_string(o.master_port) +
          ": node 0's launcher cannot serve the rendezvous store on this machine: " + e.what_without_backtrace();
      // The port may be another node-0 launcher's: join it, so that the claim below names the clash to both.
      try {
        store = open_store(o, /*server=*/false, std::min<milliseconds>(o.timeout, std::chrono::seconds(5)));
      } catch (const c10::Error&) {
      }
      if (!store) {
        throw LaunchFailure{2, cannot_serve};
      }
    }
  } else {
    try {
      store = open_store(o, /*server=*/false, o.timeout);
    } catch (const c10::Error& e) {
      throw LaunchFailure{1, node + ": no rendezvous store at " + at + " (node 0's launcher serves it) within " +
                                 seconds(o.timeout) + ": " + e.what_without_backtrace()};
    }
  }
  try {
    const auto deadline = Clock::now() + o.timeout;
    // A node is claimed once its launcher agrees with node 0's shape, so that every node claimed is one
    // that runs. A second claim is refused; it comes too late to stop a launch whose nodes are all there.
    auto claim = [&] {
      if (store->add(node_key(o.node_rank), 1) != 1) {
        refuse(*store, node + ": node " + std::to_string(o.node_rank) +
                           " is claimed by two launchers; each node's launcher takes its own --node-rank, 0 to " +
                           std::to_string(o.nnodes - 1));
      }
    };
    const std::string shape = "--nnodes " + std::to_string(o.nnodes) + " --nproc " + std::to_string(o.nproc);
    if (o.node_rank == 0) {
      if (!cannot_serve.empty()) {
        // The store that holds the port is another node-0 launcher's once it claims node 0 there: claim
        // after it, so that the clash is named to both. A store that never claims is someone else's.
        const auto brief = Clock::now() + std::min<milliseconds>(o.timeout, std::chrono::seconds(5));
        while (!store->check({node_key(0)}) && Clock::now() < brief) {
          std::this_thread::sleep_for(milliseconds(50));
        }
        if (!store->check({node_key(0)})) throw LaunchFailure{2, cannot_serve};
        claim();  // refuses: node 0 is claimed already
        throw LaunchFailure{2, cannot_serve};
      }
      claim();
      store->set(kShapeKey, bytes(shape));
    } else {
      wait_for(*store, {kShapeKey}, deadline,
               [&] { return node + ": node 0's launcher did not come to " + at + " within " + seconds(o.timeout); });
      const std::string theirs = str(store->get(kShapeKey));
      if (theirs != shape) {
        refuse(*store, node + " has " + shape + " and node 0's launcher " + theirs +
                           ": every node's launcher takes the same --nnodes and --nproc");
      }
      claim();
    }
    std::vector<std::string> all;
    for (int r = 0; r < o.nnodes; ++r) all.push_back(node_key(r));
    wait_for(*store, all, deadline, [&] {
      std::string missing;
      for (int r = 0; r < o.nnodes; ++r) {
        if (!store->check({node_key(r)})) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
      return node + ": the launcher of node(s) " + missing + " did not come to " + at + " within " + seconds(o.timeout);
    });
  } catch (const c10::Error& e) {
    throw LaunchFailure{1, node + ": the rendezvous store at " + at + " went away: " + e.what_without_backtrace()};
  }
  return store;
}

// The first failure of the job, for every other node's launcher; nothing when the store is gone.
void post_failure(const c10::intrusive_ptr<c10d::Store>& store, const std::string& what) {
  if (!store) return;
  try {
    if (!store->check({kFailedKey})) store->set(kFailedKey, bytes(what));
  } catch (const c10::Error&) {
  }
}

// Every launcher counts itself out once its ranks have ended; node 0's, which serves the store, waits for
// the others (up to 30 s: one may be gone with its machine), so that none loses the store while it still
// watches it.
void leave_nodes(c10d::Store& store, const LaunchOptions& o) {
  try {
    store.add(kDoneKey, 1);
    if (o.node_rank != 0) return;
    const auto until = Clock::now() + std::chrono::seconds(30);
    while (store.add(kDoneKey, 0) < o.nnodes && Clock::now() < until) {
      std::this_thread::sleep_for(milliseconds(20));
    }
  } catch (const c10::Error&) {
  }
}

}  // namespace

void check_launch(LaunchOptions& o) {
  if (o.nproc <= 0) {
    const char* flag = o.nnodes > 0             ? "--nnodes"
                       : o.node_rank >= 0       ? "--node-rank"
                       : !o.master_addr.empty() ? "--master-addr"
                       : o.master_port > 0      ? "--master-port"
                                                : nullptr;
    if (flag) throw RunError(std::string(flag) + " needs --nproc N (the ranks this node's launcher starts)");
    return;
  }
  if (o.nnodes <= 0) o.nnodes = 1;
  if (o.node_rank < 0) o.node_rank = 0;
  const std::string m = std::to_string(o.nnodes);
  if (o.node_rank >= o.nnodes) {
    throw RunError("--node-rank " + std::to_string(o.node_rank) + ": nodes are numbered 0 to " +
                   std::to_string(o.nnodes - 1) + " (--nnodes " + m + ")");
  }
  if (o.nnodes > 1 && o.master_addr.empty()) {
    throw RunError("--nnodes " + m + " needs --master-addr: node 0's address, which every node reaches");
  }
  if (o.nnodes > 1 && o.master_port == 0) {
    throw RunError("--nnodes " + m + " needs --master-port: a free port on node 0, the same on every node");
  }
  if (!o.master_addr.empty() && o.master_port == 0) throw RunError("--master-addr needs --master-port");
  if (o.master_addr.empty() && o.master_port != 0) {
    throw RunError(
        "--master-port needs --master-addr (on one node, leave both out: the launcher picks a loopback "
        "port)");
  }
}

std::vector<std::string> without_launch_flags(int argc, char** argv) {
  static const std::set<std::string> flags = {"--nproc", "--nnodes", "--node-rank", "--master-addr", "--master-port"};
  std::vector<std::string> out;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (flags.count(a)) {
      ++i;  // and its value
      continue;
    }
    const size_t eq = a.find('=');
    if (eq != std::string::npos && flags.count(a.substr(0, eq))) continue;
    out.push_back(a);
  }
  return out;
}

int launch_ranks(const std::string& name, const LaunchOptions& o, const std::vector<std::string>& args) {
  const int nproc = o.nproc;
  const int first = o.node_rank * nproc;  // this node's ranks: first .. first + nproc - 1
  std::string addr = "127.0.0.1";
  int port = 29500, listen_fd = -1;
  c10::intrusive_ptr<c10d::Store> nodes;  // node 0's store, with several nodes' launchers
  if (o.loopback()) {
    listen_fd = listening_socket(port);
  } else {
    addr = o.master_addr;
    port = o.master_port;
    try {
      nodes = join_nodes(o);
    } catch (const LaunchFailure& f) {
      std::cerr << name << ": " << f.message << "\n";
      return f.code;
    }
  }
  // Each rank's environment: this one's without torchrun's variables, then its own.
  std::vector<std::string> base;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    bool ours = false;
    for (const char* k : {"RANK=", "WORLD_SIZE=", "LOCAL_RANK=", "MASTER_ADDR=", "MASTER_PORT=", "TORCHELASTIC_",
                          "RLT_MASTER_LISTEN_FD="}) {
      ours = ours || kv.rfind(k, 0) == 0;
    }
    if (!ours) base.push_back(kv);
  }
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);

  struct sigaction sa {};
  sa.sa_handler = on_stop;  // no SA_RESTART: waitpid returns EINTR, and the ranks are told
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  const std::string node = o.nnodes > 1 ? "node " + std::to_string(o.node_rank) + ": " : "";
  std::vector<pid_t> pids(nproc, -1);
  for (int r = 0; r < nproc; ++r) {
    std::vector<std::string> env = base;
    env.push_back("RANK=" + std::to_string(first + r));
    env.push_back("LOCAL_RANK=" + std::to_string(r));
    env.push_back("WORLD_SIZE=" + std::to_string(o.world()));
    env.push_back("MASTER_ADDR=" + addr);
    env.push_back("MASTER_PORT=" + std::to_string(port));
    if (nodes) env.push_back("TORCHELASTIC_USE_AGENT_STORE=True");  // this node's or node 0's launcher serves it
    if (r == 0 && listen_fd >= 0) env.push_back("RLT_MASTER_LISTEN_FD=" + std::to_string(listen_fd));
    std::vector<char*> envp;
    for (auto& kv : env) envp.push_back(kv.data());
    envp.push_back(nullptr);
    // Only rank 0 keeps the listening socket; the others close their inherited copy.
    posix_spawn_file_actions_t fa;
    int rc = posix_spawn_file_actions_init(&fa);
    if (rc == 0 && r != 0 && listen_fd >= 0) rc = posix_spawn_file_actions_addclose(&fa, listen_fd);
    if (rc == 0) rc = posix_spawn(&pids[r], "/proc/self/exe", &fa, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) {
      std::cerr << name << ": " << node << "cannot start rank " << first + r << ": " << std::strerror(rc) << "\n";
      post_failure(nodes, "node " + std::to_string(o.node_rank) + " could not start rank " + std::to_string(first + r));
      if (listen_fd >= 0) close(listen_fd);
      for (int q = 0; q < r; ++q) kill(pids[q], SIGTERM);
      for (int q = 0; q < r; ++q) waitpid(pids[q], nullptr, 0);
      return 1;
    }
  }
  if (listen_fd >= 0) close(listen_fd);  // rank 0 holds it now
  if (o.nnodes > 1) {
    std::cerr << name << ": " << node << "ranks " << first << ".." << first + nproc - 1 << " of " << o.world()
              << " started (rendezvous " << addr << ":" << port << ")\n";
  } else {
    std::cerr << name << ": " << nproc << " ranks started (rendezvous " << addr << ":" << port << ")\n";
  }

  int running = nproc, code = 0;
  bool stopping = false;
  // While stopping: SIGTERM at term_deadline, SIGKILL at stop_deadline.
  auto term_deadline = Clock::time_point::max(), stop_deadline = Clock::time_point::max();
  auto stop_all = [&](int sig) {
    for (pid_t p : pids) {
      if (p > 0) kill(p, sig);
    }
  };
  // `grace`: the other ranks may end on their own first. A rank that exits with code 2 refused its input
  // (a config, a device, a dataset), which its siblings check alike as they start: each is given 5 s to say
  // its own reason before it is stopped.
  auto begin_stop = [&](int exit_code, bool grace = false) {
    code = exit_code;
    stopping = true;
    const auto term = Clock::now() + std::chrono::seconds(grace ? 5 : 0);
    if (grace) {
      term_deadline = term;
    } else {
      stop_all(SIGTERM);
    }
    stop_deadline = term + std::chrono::seconds(10);
  };
  while (running > 0) {
    if (g_stop_signal && !stopping) {  // a signal that came between two waits
      std::cerr << name << ": " << node << strsignal(g_stop_signal) << ": stopping every rank\n";
      post_failure(nodes, "node " + std::to_string(o.node_rank) + "'s launcher got " + strsignal(g_stop_signal));
      begin_stop(1);
    }
    if (nodes && !stopping) {  // another node's failure
      std::string other;
      try {
        if (nodes->check({kFailedKey})) other = str(nodes->get(kFailedKey));
      } catch (const c10::Error&) {
        // The store is gone: node 0's launcher has exited. Its ranks said goodbye before (a clean end), or
        // this node's ranks fail on their own (they use the same store).
        nodes.reset();
      }
      if (!other.empty()) {
        std::cerr << name << ": " << other << "; stopping this node's " << running << " rank(s)\n";
        begin_stop(1);
      }
    }
    int status = 0;
    // Blocking until the first failure; polled while stopping, so that ranks still alive get SIGKILL at the
    // deadline, and with several nodes, to watch the store.
    const pid_t pid = waitpid(-1, &status, stopping || nodes ? WNOHANG : 0);
    if (pid < 0 && errno == EINTR) continue;  // a signal: handled at the top
    if (pid < 0) break;                       // no children left
    if (pid == 0) {                           // polling: none exited yet
      if (Clock::now() > term_deadline) {
        stop_all(SIGTERM);
        term_deadline = Clock::time_point::max();
      }
      if (Clock::now() > stop_deadline) {
        stop_all(SIGKILL);
        stop_deadline = Clock::time_point::max();
      }
      std::this_thread::sleep_for(milliseconds(50));
      continue;
    }
    int rank = -1;
    for (int r = 0; r < nproc; ++r) {
      if (pids[r] == pid) rank = r;
    }
    if (rank < 0) continue;
    pids[rank] = -1;
    --running;
    const bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    if (failed && !stopping) {
      const std::string what = "rank " + std::to_string(first + rank) + " " + describe(status);
      std::cerr << name << ": " << node << what << "; stopping the other " << running << " rank(s)"
                << (o.nnodes > 1 ? " of this node and the other nodes' ranks" : "") << "\n";
      post_failure(nodes, "node " + std::to_string(o.node_rank) + ": " + what);
      const bool refused = WIFEXITED(status) && WEXITSTATUS(status) == 2;
      begin_stop(WIFEXITED(status) ? WEXITSTATUS(status) : 1, refused);
    }
  }
  if (nodes) leave_nodes(*nodes, o);
  return code;
}

}  // namespace rlt
