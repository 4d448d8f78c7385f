// Ranks of a data-parallel run on threads of the test process, their collectives through one in-memory
// store (parallel/dist.h): the multi-process arithmetic without processes.
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "parallel/dist.h"

namespace rlt::testing {

// Collectives that pass every call to another rank's: the base of the tests' counting and deliberately
// wrong ones, which override what they change.
class ForwardingCollectives : public Collectives {
 public:
  explicit ForwardingCollectives(std::shared_ptr<Collectives> inner)
      : Collectives(inner->rank(), inner->world()), inner_(std::move(inner)) {}
  void all_reduce(const std::vector<at::Tensor>& t, ReduceOp op) override { inner_->all_reduce(t, op); }
  std::unique_ptr<Pending> all_reduce_start(const std::vector<at::Tensor>& t) override {
    return inner_->all_reduce_start(t);
  }
  std::unique_ptr<Pending> reduce_scatter_start(const at::Tensor& out, const at::Tensor& in) override {
    return inner_->reduce_scatter_start(out, in);
  }
  std::unique_ptr<Pending> all_gather_start(const at::Tensor& out, const at::Tensor& in) override {
    return inner_->all_gather_start(out, in);
  }
  void broadcast(const std::vector<at::Tensor>& t, int root) override { inner_->broadcast(t, root); }
  void barrier() override { inner_->barrier(); }

 protected:
  std::shared_ptr<Collectives> inner_;
};

// Runs fn(rank, collectives) for each of `world` ranks on its own thread and waits for them all; the first
// exception a rank threw is rethrown. `wrap` may replace a rank's collectives (a deliberately wrong one).
inline void on_thread_ranks(
    int world, const std::function<void(int, std::shared_ptr<Collectives>)>& fn,
    std::chrono::milliseconds timeout = std::chrono::seconds(120),
    const std::function<std::shared_ptr<Collectives>(std::shared_ptr<Collectives>)>& wrap = nullptr) {
  const auto store = thread_store();
  std::vector<std::exception_ptr> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        std::shared_ptr<Collectives> c = store_collectives(store, r, world, timeout);
        fn(r, wrap ? wrap(c) : c);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace rlt::testing
