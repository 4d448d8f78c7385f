// The NCCL backend of parallel/dist.h: c10d's ProcessGroupNCCL, built when the torch wheel's nccl.h is
// found (RLT_HAVE_NCCL, with USE_C10D_NCCL for c10d's headers).
#include "parallel/dist.h"

#ifdef RLT_HAVE_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace rlt {

#ifdef RLT_HAVE_NCCL

namespace {

class NcclCollectives;

class NcclPending : public Pending {
 public:
  NcclPending(const NcclCollectives* owner, c10::intrusive_ptr<c10d::Work> work)
      : owner_(owner), work_(std::move(work)) {}
  void wait() override;

 private:
  const NcclCollectives* owner_;
  c10::intrusive_ptr<c10d::Work> work_;
};

class NcclCollectives : public Collectives {
 public:
  NcclCollectives(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world, at::Device device,
                  std::chrono::milliseconds timeout)
      : Collectives(rank, world), store_(store), device_(device), timeout_(timeout) {
    c10::cuda::set_device(device.index());
    auto o = c10d::ProcessGroupNCCL::Options::create();
    // The watchdog aborts a collective a minute after our own waits give up, so that a timeout reaches
    // wait() below, which names the late rank, before it tears the process down.
    o->timeout = timeout + std::chrono::minutes(1);
    pg_ = c10::make_intrusive<c10d::ProcessGroupNCCL>(c10::make_intrusive<c10d::PrefixStore>("rlt/nccl", store), rank,
                                                      world, o);
  }

  // A clean exit tears the communicators down (a DistError exits without it: a hung peer could block it).
  ~NcclCollectives() override {
    try {
      pg_->shutdown();
    } catch (const std::exception&) {
    }
  }

  // Its own communicator, rendezvous under its own prefix of the same store.
  std::shared_ptr<Collectives> fork(const std::string& name) override {
    return std::make_shared<NcclCollectives>(c10::make_intrusive<c10d::PrefixStore>("rlt/fork/" + name, store_), rank(),
                                             world(), device_, timeout_);
  }

  void all_reduce(const std::vector<at::Tensor>& tensors, ReduceOp op) override {
    // NCCL coalesces tensors of one dtype per call: one call per dtype, host tensors through the device.
    std::vector<at::Tensor> dev;
    for (const auto& t : tensors) dev.push_back(t.device() == device_ ? t : t.to(device_));
    c10d::AllreduceCoalescedOptions o;
    o.reduceOp = op == ReduceOp::kSum ? c10d::ReduceOp::SUM : c10d::ReduceOp::MAX;
    std::vector<bool> done(dev.size(), false);
    for (size_t i = 0; i < dev.size(); ++i) {
      if (done[i]) continue;
      std::vector<at::Tensor> group;
      for (size_t j = i; j < dev.size(); ++j) {
        if (!done[j] && dev[j].scalar_type() == dev[i].scalar_type()) {
          group.push_back(dev[j]);
          done[j] = true;
        }
      }
      wait(pg_->allreduce_coalesced(group, o));
    }
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (!dev[i].is_same(tensors[i])) tensors[i].copy_(dev[i]);
    }
  }

  std::unique_ptr<Pending> all_reduce_start(const std::vector<at::Tensor>& tensors) override {
    for (const auto& t : tensors) {
      TORCH_CHECK(t.device() == device_ && t.is_contiguous() && t.scalar_type() == tensors.front().scalar_type(),
                  "all_reduce_start: contiguous tensors of one dtype on ", device_);
    }
    std::vector<at::Tensor> v = tensors;
    return std::make_unique<NcclPending>(this, pg_->allreduce_coalesced(v));
  }

  std::unique_ptr<Pending> reduce_scatter_start(const at::Tensor& out, const at::Tensor& in) override {
    check_on_device(out, in, "reduce_scatter");
    at::Tensor o = out, i = in;
    return std::make_unique<NcclPending>(this, pg_->_reduce_scatter_base(o, i));
  }

  std::unique_ptr<Pending> all_gather_start(const at::Tensor& out, const at::Tensor& in) override {
    check_on_device(out, in, "all_gather");
    at::Tensor o = out, i = in;
    return std::make_unique<NcclPending>(this, pg_->_allgather_base(o, i));
  }

  void broadcast(const std::vector<at::Tensor>& tensors, int root) override {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    std::vector<at::Tensor> dev;
    for (const auto& t : tensors) {
      dev.push_back(t.device() == device_ ? t : t.to(device_));
      c10d::BroadcastOptions o;
      o.rootRank = root;
      std::vector<at::Tensor> one = {dev.back()};
      works.push_back(pg_->broadcast(one, o));
    }
    for (auto& w : works) wait(w);
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (!dev[i].is_same(tensors[i])) tensors[i].copy_(dev[i]);
    }
  }

  void barrier() override { all_reduce({at::zeros({1}, at::TensorOptions().device(device_))}, ReduceOp::kSum); }

  void mark(const std::string& where) override { store_mark(*store_, rank(), where); }

  void close() override { store_farewell(*store_, rank(), world(), timeout_); }

  c10::intrusive_ptr<c10d::Store> store() const override { return store_; }

 protected:
  // A communicator of the members alone, rendezvous under the group's prefix.
  std::shared_ptr<Collectives> make_group(const std::string& name, int rank, int world) override {
    return std::make_shared<NcclCollectives>(c10::make_intrusive<c10d::PrefixStore>("rlt/group/" + name, store_), rank,
                                             world, device_, timeout_);
  }

 public:
  // Waits for a collective; past train.dist_timeout_s, names the ranks whose last mark differs from ours.
  void wait(const c10::intrusive_ptr<c10d::Work>& work) const {
    try {
      work->wait(timeout_);
    } catch (const std::exception& e) {
      throw DistError(describe_timeout(e.what()));
    }
  }

 private:
  void check_on_device(const at::Tensor& a, const at::Tensor& b, const char* what) const {
    TORCH_CHECK(a.device() == device_ && b.device() == device_ && a.is_contiguous() && b.is_contiguous() &&
                    a.scalar_type() == b.scalar_type(),
                what, ": contiguous tensors of one dtype on ", device_);
  }

  std::string describe_timeout(const std::string& why) const {
    std::string mine, late;
    try {
      auto read = [&](int r) {
        const std::string at = store_read_mark(*store_, r);
        return at.empty() ? std::string("(no mark)") : at;
      };
      mine = read(rank());
      for (int r = 0; r < world(); ++r) {
        const std::string at = read(r);
        if (r != rank() && at != mine) late += " rank " + std::to_string(r) + " (last at " + at + ")";
      }
    } catch (const c10::Error&) {
      late = " rank 0 (it serves the rendezvous store, which is gone)";
    }
    return "rank " + std::to_string(rank()) + " (at " + mine + "): a collective did not complete within " +
           std::to_string(timeout_.count() / 1000) + " s (train.dist_timeout_s); " +
           (late.empty() ? std::string("every rank reached the same point") : "behind:" + late) + ": " + why;
  }

  c10::intrusive_ptr<c10d::Store> store_;
  at::Device device_;
  std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> pg_;
};

void NcclPending::wait() { owner_->wait(work_); }

}  // namespace

bool nccl_available() { return true; }

std::shared_ptr<Collectives> nccl_collectives(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world,
                                              at::Device device, std::chrono::milliseconds timeout) {
  try {
    return std::make_shared<NcclCollectives>(store, rank, world, device, timeout);
  } catch (const c10::Error& e) {
    throw DistError("rank " + std::to_string(rank) + ": NCCL on " + device.str() + ": " + e.what_without_backtrace());
  }
}

#else

bool nccl_available() { return false; }

std::shared_ptr<Collectives> nccl_collectives(const c10::intrusive_ptr<c10d::Store>&, int rank, int, at::Device device,
                                              std::chrono::milliseconds) {
  throw DistError("rank " + std::to_string(rank) + ": " + device.str() +
                  " needs NCCL, and this build has none (nccl.h from the nvidia-nccl wheel was not found at configure "
                  "time)");
}

#endif

}  // namespace rlt
