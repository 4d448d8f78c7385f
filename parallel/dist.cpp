// Launch environment, the store's collectives, the step's shares and the gradient reducer; see dist.h.
#include "parallel/dist.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "common/errors.h"
#include "common/memory.h"
#include "common/timing.h"

namespace rlt {

namespace {

using Clock = std::chrono::steady_clock;

// A whole decimal number in [lo, hi], or a RunError naming the variable.
int env_int(const char* name, const char* value, int lo, int hi) {
  errno = 0;
  char* end = nullptr;
  const long v = std::strtol(value, &end, 10);
  if (errno != 0 || end == value || *end != '\0' || v < lo || v > hi) {
    throw RunError(std::string(name) + "=" + value + ": expected a whole number in [" + std::to_string(lo) + ", " +
                   std::to_string(hi) + "]");
  }
  return static_cast<int>(v);
}

std::string mark_key(int r) { return "rlt/mark/" + std::to_string(r); }

[[noreturn]] void store_gone(int rank, const c10::Error& e) {
  throw DistError("rank " + std::to_string(rank) +
                  ": the rendezvous store is gone (rank 0 serves it; did it exit?): " + e.what_without_backtrace());
}

class Done : public Pending {
 public:
  void wait() override {}
};

// The shapes every reduce_scatter / all_gather takes: `whole` = world x `part` elements, one dtype.
void check_scatter_shapes(const at::Tensor& whole, const at::Tensor& part, int world, const char* what) {
  TORCH_CHECK(whole.is_contiguous() && part.is_contiguous() && whole.scalar_type() == part.scalar_type() &&
                  whole.numel() == part.numel() * world,
              what, ": contiguous tensors of one dtype, ", world, " x ", part.numel(), " elements against ",
              whole.numel());
}

class SingleProcess : public Collectives {
 public:
  SingleProcess() : Collectives(0, 1) {}
  void all_reduce(const std::vector<at::Tensor>&, ReduceOp) override {}
  std::unique_ptr<Pending> reduce_scatter_start(const at::Tensor& out, const at::Tensor& in) override {
    check_scatter_shapes(in, out, 1, "reduce_scatter");
    if (!out.is_same(in)) out.copy_(in);
    return std::make_unique<Done>();
  }
  std::unique_ptr<Pending> all_gather_start(const at::Tensor& out, const at::Tensor& in) override {
    check_scatter_shapes(out, in, 1, "all_gather");
    if (!out.is_same(in)) out.copy_(in);
    return std::make_unique<Done>();
  }
  void broadcast(const std::vector<at::Tensor>&, int) override {}
  void barrier() override {}
  std::shared_ptr<Collectives> fork(const std::string&) override { return std::make_shared<SingleProcess>(); }

 protected:
  std::shared_ptr<Collectives> make_group(const std::string&, int, int) override {
    return std::make_shared<SingleProcess>();
  }
};

// Every call posts one value per rank under "rlt/c/<call>/<rank>" and waits for all of them, so having
// read call n's values a rank knows every other rank has finished call n - 1: it then deletes its own key
// of call n - 1, and the store holds at most two calls' values.
class StoreCollectives : public Collectives {
 public:
  StoreCollectives(c10::intrusive_ptr<c10d::Store> store, int rank, int world, std::chrono::milliseconds timeout)
      : Collectives(rank, world), store_(std::move(store)), timeout_(timeout) {}

  void all_reduce(const std::vector<at::Tensor>& tensors, ReduceOp op) override {
    std::vector<at::Tensor> host = to_host(tensors);
    const std::vector<std::vector<uint8_t>> all = exchange(pack(host));
    for (size_t i = 0; i < tensors.size(); ++i) {
      at::Tensor acc;
      for (int r = 0; r < world(); ++r) {  // rank order: every rank adds the same values in the same order
        const at::Tensor v = unpack(all[r], host, i);
        acc = !acc.defined() ? v.clone() : op == ReduceOp::kSum ? acc + v : at::maximum(acc, v);
      }
      tensors[i].copy_(acc);
    }
  }

  // The whole sum, in rank order as all_reduce makes it, of which this rank keeps its part.
  std::unique_ptr<Pending> reduce_scatter_start(const at::Tensor& out, const at::Tensor& in) override {
    check_scatter_shapes(in, out, world(), "reduce_scatter");
    at::Tensor sum = in.detach().clone();
    all_reduce({sum}, ReduceOp::kSum);
    out.copy_(sum.view(-1).narrow(0, rank() * out.numel(), out.numel()).view(out.sizes()));
    return std::make_unique<Done>();
  }

  std::unique_ptr<Pending> all_gather_start(const at::Tensor& out, const at::Tensor& in) override {
    check_scatter_shapes(out, in, world(), "all_gather");
    std::vector<at::Tensor> host = to_host({in});
    const std::vector<std::vector<uint8_t>> all = exchange(pack(host));
    at::Tensor flat = out.view(-1);
    for (int r = 0; r < world(); ++r) {
      flat.narrow(0, r * in.numel(), in.numel()).copy_(unpack(all[r], host, 0).view(-1));
    }
    return std::make_unique<Done>();
  }

  void broadcast(const std::vector<at::Tensor>& tensors, int root) override {
    std::vector<at::Tensor> host = to_host(tensors);
    const std::vector<std::vector<uint8_t>> all = exchange(rank() == root ? pack(host) : std::vector<uint8_t>{});
    if (rank() == root) return;
    for (size_t i = 0; i < tensors.size(); ++i) tensors[i].copy_(unpack(all[root], host, i));
  }

  std::shared_ptr<Collectives> fork(const std::string& name) override {
    return std::make_shared<StoreCollectives>(c10::make_intrusive<c10d::PrefixStore>("rlt/fork/" + name, store_),
                                              rank(), world(), timeout_);
  }

  void barrier() override { exchange({}); }

  void mark(const std::string& where) override { store_mark(*store_, rank(), where); }

  void close() override { store_farewell(*store_, rank(), world(), timeout_); }

  c10::intrusive_ptr<c10d::Store> store() const override { return store_; }

 protected:
  std::shared_ptr<Collectives> make_group(const std::string& name, int rank, int world) override {
    return std::make_shared<StoreCollectives>(c10::make_intrusive<c10d::PrefixStore>("rlt/group/" + name, store_), rank,
                                              world, timeout_);
  }

 private:
  std::string key(int64_t call, int r) const { return "rlt/c/" + std::to_string(call) + "/" + std::to_string(r); }

  static std::vector<at::Tensor> to_host(const std::vector<at::Tensor>& tensors) {
    std::vector<at::Tensor> host;
    for (const auto& t : tensors) host.push_back(t.detach().to(at::kCPU).contiguous());
    return host;
  }
  static std::vector<uint8_t> pack(const std::vector<at::Tensor>& host) {
    std::vector<uint8_t> bytes;
    for (const auto& t : host) {
      const auto* p = static_cast<const uint8_t*>(t.data_ptr());
      bytes.insert(bytes.end(), p, p + t.nbytes());
    }
    return bytes;
  }
  // Tensor i of a packed value; every rank reduces tensors of the same shapes and dtypes.
  static at::Tensor unpack(const std::vector<uint8_t>& bytes, const std::vector<at::Tensor>& like, size_t i) {
    size_t offset = 0;
    for (size_t j = 0; j < i; ++j) offset += like[j].nbytes();
    TORCH_CHECK(offset + like[i].nbytes() <= bytes.size(), "store collectives: a rank posted ", bytes.size(),
                " bytes where ", offset + like[i].nbytes(), " were expected (ranks disagree on the tensors)");
    at::Tensor t = at::empty_like(like[i]);
    std::memcpy(t.data_ptr(), bytes.data() + offset, like[i].nbytes());
    return t;
  }

  // A store operation; the store gone (rank 0 serves it) is a DistError.
  template <class F>
  void guard(F&& f) const {
    try {
      f();
    } catch (const c10::Error& e) {
      store_gone(rank(), e);
    }
  }

  std::vector<std::vector<uint8_t>> exchange(const std::vector<uint8_t>& mine) {
    const int64_t call = calls_++;
    guard([&] { store_->set(key(call, rank()), mine); });
    std::vector<std::vector<uint8_t>> all(world());
    for (int r = 0; r < world(); ++r) {
      if (r == rank()) {
        all[r] = mine;
        continue;
      }
      try {
        store_->wait({key(call, r)}, timeout_);
        all[r] = store_->get(key(call, r));
      } catch (const c10::Error& e) {
        throw DistError(late_rank(r, e.what_without_backtrace()));
      }
    }
    if (call > 0) guard([&] { store_->deleteKey(key(call - 1, rank())); });
    return all;
  }

  std::string late_rank(int r, const std::string& why) const {
    std::string where;
    try {
      const std::string mark = store_read_mark(*store_, r);
      if (!mark.empty()) where = " (it was last at " + mark + ")";
    } catch (const c10::Error&) {  // the store itself is gone (rank 0 serves it)
    }
    return "rank " + std::to_string(r) + " did not reach collective " + std::to_string(calls_ - 1) + " within " +
           std::to_string(timeout_.count() / 1000) + " s (train.dist_timeout_s)" + where + ": " + why;
  }

  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds timeout_;
  int64_t calls_ = 0;
};

}  // namespace

DistEnv dist_env(const std::function<const char*(const char*)>& getenv) {
  DistEnv env;
  // torchrun's set (and --nproc's): RANK, WORLD_SIZE or LOCAL_RANK makes a launch. MASTER_ADDR and
  // MASTER_PORT alone do not: an sbatch script exports them for its srun tasks, and its own shell runs
  // one process.
  const bool torchrun = getenv("RANK") || getenv("WORLD_SIZE") || getenv("LOCAL_RANK");
  // Slurm's: srun's tasks (and the batch script's shell, task 0) have SLURM_PROCID; a step of one task
  // is one process. With SLURM_NTASKS unset (no --ntasks) or 1 the process trains alone.
  const char* ntasks = getenv("SLURM_NTASKS");
  const bool slurm = !torchrun && getenv("SLURM_PROCID") && ntasks && env_int("SLURM_NTASKS", ntasks, 1, 1 << 20) > 1;
  if (!torchrun && !slurm) return env;
  const std::vector<const char*> names =
      torchrun
          ? std::vector<const char*>{"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
          : std::vector<const char*>{"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "MASTER_ADDR", "MASTER_PORT"};
  for (const char* n : names) {
    if (!getenv(n)) {
      throw RunError(std::string("distributed launch: ") + n +
                     (torchrun ? " is not set; RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT go together "
                                 "(torchrun sets them all; --nproc N sets them for its own ranks)"
                               : " is not set; a Slurm step of several tasks (SLURM_PROCID, SLURM_NTASKS > 1) needs "
                                 "SLURM_LOCALID, and MASTER_ADDR and MASTER_PORT from the sbatch script "
                                 "(docs/training.md, Several nodes)"));
    }
  }
  const char* rank = names[0];
  const char* world = names[1];
  const char* local = names[2];
  env.launched = true;
  env.world = env_int(world, getenv(world), 1, 1 << 20);
  env.rank = env_int(rank, getenv(rank), 0, env.world - 1);
  env.local_rank = env_int(local, getenv(local), 0, env.world - 1);
  env.master_addr = getenv("MASTER_ADDR");
  if (env.master_addr.empty()) throw RunError("MASTER_ADDR is empty");
  env.master_port = env_int("MASTER_PORT", getenv("MASTER_PORT"), 1, 65535);
  const char* agent = getenv("TORCHELASTIC_USE_AGENT_STORE");
  env.agent_store = torchrun && agent && std::string(agent) == "True";
  return env;
}

DistEnv dist_env() {
  return dist_env([](const char* n) { return std::getenv(n); });
}

std::shared_ptr<Collectives> Collectives::fork(const std::string& name) {
  throw DistError("these collectives cannot fork a second set (" + name + ")");
}

std::shared_ptr<Collectives> Collectives::group(const std::string& name, const std::vector<int>& members) {
  TORCH_CHECK(!members.empty() && std::is_sorted(members.begin(), members.end()) &&
                  std::adjacent_find(members.begin(), members.end()) == members.end() && members.front() >= 0 &&
                  members.back() < world_,
              "Collectives::group ", name, ": members must be distinct ranks of 0..", world_ - 1, ", ascending");
  const auto at = std::find(members.begin(), members.end(), rank_);
  if (at == members.end()) return nullptr;
  return make_group(name, static_cast<int>(at - members.begin()), static_cast<int>(members.size()));
}

std::shared_ptr<Collectives> Collectives::make_group(const std::string& name, int, int) {
  throw DistError("these collectives cannot make a group of ranks (" + name + ")");
}

std::unique_ptr<Pending> Collectives::all_reduce_start(const std::vector<at::Tensor>& tensors) {
  all_reduce(tensors, ReduceOp::kSum);
  return std::make_unique<Done>();
}

std::shared_ptr<Collectives> single_process() { return std::make_shared<SingleProcess>(); }

std::shared_ptr<Collectives> store_collectives(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world,
                                               std::chrono::milliseconds timeout) {
  return std::make_shared<StoreCollectives>(store, rank, world, timeout);
}

c10::intrusive_ptr<c10d::Store> thread_store() { return c10::make_intrusive<c10d::HashStore>(); }

void store_mark(c10d::Store& store, int rank, const std::string& where) {
  try {
    store.set(mark_key(rank), std::vector<uint8_t>(where.begin(), where.end()));
  } catch (const c10::Error& e) {
    store_gone(rank, e);
  }
}

std::string store_read_mark(c10d::Store& store, int r) {
  if (!store.check({mark_key(r)})) return "";
  const std::vector<uint8_t> v = store.get(mark_key(r));
  return std::string(v.begin(), v.end());
}

void store_farewell(c10d::Store& store, int rank, int world, std::chrono::milliseconds timeout) {
  try {
    store.add("rlt/closed", 1);
    if (rank != 0) return;
    const auto until = Clock::now() + timeout;
    while (store.add("rlt/closed", 0) < world) {
      if (Clock::now() > until) throw DistError("rank 0: not every rank finished within train.dist_timeout_s");
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  } catch (const c10::Error& e) {
    store_gone(rank, e);
  }
}

std::shared_ptr<Collectives> connect(const DistEnv& env, at::Device device, std::chrono::milliseconds timeout) {
  c10::intrusive_ptr<c10d::Store> store;
  try {
    c10d::TCPStoreOptions o;
    o.port = static_cast<uint16_t>(env.master_port);
    o.isServer = env.rank == 0 && !env.agent_store;  // torchrun's agent serves it
    o.numWorkers = env.world;
    o.waitWorkers = true;
    o.timeout = timeout;
    // --nproc: rank 0 takes over the launcher's listening socket (loopback, the port already held).
    if (const char* fd = std::getenv("RLT_MASTER_LISTEN_FD"); fd && o.isServer) {
      o.masterListenFd = env_int("RLT_MASTER_LISTEN_FD", fd, 0, 1 << 20);
    }
    store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, o);
    // The store owns the socket now: the processes this rank starts (the sandbox) get neither it nor its name.
    if (o.masterListenFd) fcntl(*o.masterListenFd, F_SETFD, FD_CLOEXEC);
    unsetenv("RLT_MASTER_LISTEN_FD");
  } catch (const c10::Error& e) {
    throw DistError("rank " + std::to_string(env.rank) + ": no rendezvous at " + env.master_addr + ":" +
                    std::to_string(env.master_port) + " within " + std::to_string(timeout.count() / 1000) +
                    " s (train.dist_timeout_s): " + e.what_without_backtrace());
  }
  if (device.is_cuda()) return nccl_collectives(store, env.rank, env.world, device, timeout);
  return store_collectives(store, env.rank, env.world, timeout);
}

std::vector<int64_t> rank_prompts(int64_t P, int64_t prompts_per_mini, int world, int rank) {
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world && prompts_per_mini >= 1, "rank_prompts: rank ", rank, " of ",
              world, ", ", prompts_per_mini, " prompts per mini-batch");
  std::vector<int64_t> mine;
  for (int64_t b = 0; b < P; b += prompts_per_mini) {
    const int64_t n = std::min(prompts_per_mini, P - b);
    TORCH_CHECK(n % world == 0, "rank_prompts: a mini-batch of ", n, " prompts does not split over ", world, " ranks");
    const int64_t share = n / world;
    for (int64_t j = 0; j < share; ++j) mine.push_back(b + rank * share + j);
  }
  return mine;
}

}  // namespace rlt
