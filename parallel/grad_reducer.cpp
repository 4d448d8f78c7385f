// GradReducer; see grad_reducer.h.
#include "parallel/grad_reducer.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <chrono>
#include <utility>

#include "common/timing.h"

namespace rlt {

using Clock = std::chrono::steady_clock;

void accumulate_gradient(const at::Tensor& param, const at::Tensor& master) {
  at::Tensor& g = param.mutable_grad();
  if (!g.defined()) return;
  at::NoGradGuard no_grad;
  at::Tensor& mg = master.mutable_grad();
  if (mg.defined())
    mg.add_(g);  // bf16 + fp32 -> fp32: the sum is never rounded to bf16
  else
    mg = g.to(at::kFloat);
  g = at::Tensor();  // released: the next backward starts a fresh bf16 gradient
}

GradReducer::GradReducer(Collectives& dist, std::vector<at::Tensor> params, std::vector<at::Tensor> masters,
                         int64_t bucket_bytes)
    : dist_(dist), params_(std::move(params)), masters_(std::move(masters)) {
  TORCH_CHECK(masters_.size() <= params_.size(), "GradReducer: more masters than parameters");
  const size_t n = params_.size();
  bucket_of_.assign(n, 0);
  done_.assign(n, false);
  // Buckets in reverse parameter order, one dtype each, up to bucket_bytes.
  int64_t bytes = 0;
  for (size_t k = n; k-- > 0;) {
    const at::Tensor& t = target(k);
    if (buckets_.empty() || bytes + static_cast<int64_t>(t.nbytes()) > bucket_bytes ||
        t.scalar_type() != target(buckets_.back().front()).scalar_type()) {
      buckets_.emplace_back();
      bytes = 0;
    }
    buckets_.back().push_back(k);
    bucket_of_[k] = buckets_.size() - 1;
    bytes += static_cast<int64_t>(t.nbytes());
  }
  remaining_.resize(buckets_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) remaining_[b] = buckets_[b].size();
  for (size_t i = 0; i < n; ++i) {
    std::shared_ptr<torch::autograd::Node> acc = torch::autograd::impl::grad_accumulator(params_[i]);
    TORCH_CHECK(acc, "GradReducer: parameter ", i, " is not a leaf that requires grad");
    hook_keys_.push_back(acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          ready(i);
          return outputs;
        })));
    accumulators_.push_back(acc);
  }
}

GradReducer::~GradReducer() {
  for (size_t i = 0; i < accumulators_.size(); ++i) {
    accumulators_[i]->del_post_hook(hook_keys_[i]);
  }
}

const at::Tensor& GradReducer::target(size_t i) const { return i < masters_.size() ? masters_[i] : params_[i]; }

at::Tensor& GradReducer::grad(size_t i) { return target(i).mutable_grad(); }

void GradReducer::arm() {
  TORCH_CHECK(!armed_ && pending_.empty(), "GradReducer::arm: the previous reduction did not finish");
  armed_ = true;
}

void GradReducer::ready(size_t i) {
  if (!armed_ || done_[i]) return;
  done_[i] = true;
  if (i < masters_.size()) accumulate_gradient(params_[i], masters_[i]);
  at::Tensor& g = grad(i);
  if (!g.defined()) g = at::zeros_like(target(i));  // the hook ran for an undefined incoming gradient
  if (--remaining_[bucket_of_[i]] == 0) start_ready_buckets();
}

void GradReducer::start_ready_buckets() {
  for (; next_bucket_ < buckets_.size() && remaining_[next_bucket_] == 0; ++next_bucket_) {
    std::vector<at::Tensor> grads;
    for (size_t i : buckets_[next_bucket_]) grads.push_back(grad(i));
    pending_.push_back(dist_.all_reduce_start(grads));
  }
}

void GradReducer::finish() {
  TORCH_CHECK(armed_, "GradReducer::finish without arm()");
  // Parameters the backward did not reach: their gradient is what earlier micro-batches left, or zero.
  for (size_t i = 0; i < params_.size(); ++i) {
    if (done_[i]) continue;
    done_[i] = true;
    if (i < masters_.size()) accumulate_gradient(params_[i], masters_[i]);
    at::Tensor& g = grad(i);
    if (!g.defined()) g = at::zeros_like(target(i));
    --remaining_[bucket_of_[i]];
  }
  start_ready_buckets();
  const auto t0 = Clock::now();
  for (auto& p : pending_) p->wait();
  wait_s_ += seconds_since(t0);
  pending_.clear();
  next_bucket_ = 0;
  for (size_t b = 0; b < buckets_.size(); ++b) remaining_[b] = buckets_[b].size();
  done_.assign(params_.size(), false);
  armed_ = false;
}

}  // namespace rlt
