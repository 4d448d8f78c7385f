// Data-parallel gradient reduction: the backward's gradients summed over the ranks in buckets, while the
// backward still runs (parallel/dist.h holds the collectives it starts).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "parallel/dist.h"

namespace torch::autograd {
struct Node;
}

namespace rlt {

// Sums the optimizer's gradients over the ranks, bucket by bucket, while the backward still runs: a hook
// on each parameter's gradient accumulator marks it ready (with fp32 master weights it first adds the bf16
// gradient into the master's); a bucket is started once all of its gradients are ready and every earlier
// bucket has started, so the ranks start the same buckets in the same order. Buckets hold up to
// bucket_bytes of one dtype, in reverse parameter order (the order the backward produces them).
//   arm()     before the backward that ends an optimizer step (earlier micro-batches accumulate locally)
//   finish()  after it: starts what is left, waits; then every gradient the optimizer reads is the sum
// A parameter the backward does not reach gets a zero gradient (so AdamW still decays it, unlike one
// process, where it would have none); every parameter of the decoder and the value head is reached.
class GradReducer {
 public:
  // params: the autograd leaves the backward reaches (the policy's trainable parameters, then the extra
  // ones); masters: the fp32 tensors the optimizer updates for the first masters.size() of them (mixed
  // precision), else empty. bucket_bytes: train.dist_bucket_mb.
  GradReducer(Collectives& dist, std::vector<at::Tensor> params, std::vector<at::Tensor> masters, int64_t bucket_bytes);
  ~GradReducer();
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;
  void arm();
  void finish();
  double wait_seconds() const { return wait_s_; }  // spent in finish() waiting for the collectives
  int64_t buckets() const { return static_cast<int64_t>(buckets_.size()); }

 private:
  void ready(size_t i);
  void start_ready_buckets();
  const at::Tensor& target(size_t i) const;  // what the optimizer updates for parameter i (its master, or it)
  at::Tensor& grad(size_t i);                // and the gradient it reads

  Collectives& dist_;
  std::vector<at::Tensor> params_;   // autograd leaves: the policy's parameters, then the extra ones
  std::vector<at::Tensor> masters_;  // fp32 masters of the first masters_.size() params_, or none
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // kept alive: the tensors hold them weakly
  std::vector<uintptr_t> hook_keys_;
  std::vector<std::vector<size_t>> buckets_;
  std::vector<size_t> bucket_of_;
  std::vector<size_t> remaining_;  // per bucket: gradients not yet ready in the armed backward
  std::vector<bool> done_;         // per parameter, in the armed backward
  std::vector<std::unique_ptr<Pending>> pending_;
  size_t next_bucket_ = 0;
  bool armed_ = false;
  double wait_s_ = 0;
};

// With fp32 master weights: adds a parameter's bf16 gradient into its master's fp32 one and releases the
// bf16 one, so micro-batches accumulate in fp32 (GradReducer does it as each gradient becomes ready).
void accumulate_gradient(const at::Tensor& param, const at::Tensor& master);

}  // namespace rlt
