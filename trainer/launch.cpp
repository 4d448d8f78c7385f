// launch_ranks; see launch.h.
#include "trainer/launch.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <iostream>
#include <thread>

extern char** environ;

namespace rlt {

namespace {

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

}  // namespace

std::vector<std::string> without_nproc(int argc, char** argv) {
  std::vector<std::string> out;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--nproc") {
      ++i;  // and its value
      continue;
    }
    if (a.rfind("--nproc=", 0) == 0) continue;
    out.push_back(a);
  }
  return out;
}

int launch_ranks(const std::string& name, int nproc, const std::vector<std::string>& args) {
  int port = 29500;
  const int listen_fd = listening_socket(port);
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

  std::vector<pid_t> pids(nproc, -1);
  for (int r = 0; r < nproc; ++r) {
    std::vector<std::string> env = base;
    env.push_back("RANK=" + std::to_string(r));
    env.push_back("LOCAL_RANK=" + std::to_string(r));
    env.push_back("WORLD_SIZE=" + std::to_string(nproc));
    env.push_back("MASTER_ADDR=127.0.0.1");
    env.push_back("MASTER_PORT=" + std::to_string(port));
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
      std::cerr << name << ": cannot start rank " << r << ": " << std::strerror(rc) << "\n";
      if (listen_fd >= 0) close(listen_fd);
      for (int q = 0; q < r; ++q) kill(pids[q], SIGTERM);
      for (int q = 0; q < r; ++q) waitpid(pids[q], nullptr, 0);
      return 1;
    }
  }
  if (listen_fd >= 0) close(listen_fd);  // rank 0 holds it now
  std::cerr << name << ": " << nproc << " ranks started (rendezvous 127.0.0.1:" << port << ")\n";

  int running = nproc, code = 0;
  bool stopping = false;
  auto stop_all = [&](int sig) {
    for (pid_t p : pids) {
      if (p > 0) kill(p, sig);
    }
  };
  auto stop_deadline = std::chrono::steady_clock::time_point::max();
  while (running > 0) {
    if (g_stop_signal && !stopping) {  // a signal that came between two waits
      std::cerr << name << ": " << strsignal(g_stop_signal) << ": stopping every rank\n";
      stopping = true;
      code = 1;
      stop_all(SIGTERM);
      stop_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    }
    int status = 0;
    // Blocking until the first failure; then polled, so that ranks still alive get SIGKILL at the deadline.
    const pid_t pid = waitpid(-1, &status, stopping ? WNOHANG : 0);
    if (pid < 0 && errno == EINTR) continue;  // a signal: handled at the top
    if (pid < 0) break;                       // no children left
    if (pid == 0) {                           // polling: none exited yet
      if (std::chrono::steady_clock::now() > stop_deadline) {
        stop_all(SIGKILL);
        stop_deadline = std::chrono::steady_clock::time_point::max();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
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
      std::cerr << name << ": rank " << rank << " " << describe(status) << "; stopping the other " << running
                << " rank(s)\n";
      code = WIFEXITED(status) ? WEXITSTATUS(status) : 1;
      stopping = true;
      stop_all(SIGTERM);
      stop_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    }
  }
  return code;
}

}  // namespace rlt
