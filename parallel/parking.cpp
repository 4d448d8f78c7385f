// PhaseParking; see parking.h.
#include "parallel/parking.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

namespace rlt {

void PhaseParking::park(const std::vector<at::Tensor>& tensors) {
  TORCH_CHECK(!parked_, "PhaseParking::park: already parked");
  at::NoGradGuard no_grad;
  const bool reuse = host_.size() == tensors.size();
  if (!reuse) host_.clear();
  tensors_.clear();
  devices_.clear();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (!t.defined()) {
      if (!reuse) host_.emplace_back();
      tensors_.emplace_back();
      devices_.push_back(at::kCPU);
      continue;
    }
    at::Tensor& h = reuse ? host_[i] : host_.emplace_back();
    const bool fresh = !h.defined() || h.sizes() != t.sizes() || h.scalar_type() != t.scalar_type();
    if (fresh) {
      h = at::empty(t.sizes(),
                    at::TensorOptions().dtype(t.scalar_type()).device(at::kCPU).pinned_memory(at::hasCUDA()));
    }
    if (fresh || fault_ != Fault::kStaleCopy) h.copy_(t, /*non_blocking=*/t.is_cuda());
    tensors_.push_back(t);
    devices_.push_back(t.device());
    tensors_.back().set_data(h);  // the device storage is freed once nothing else holds it
  }
  parked_ = true;
}

void PhaseParking::unpark() {
  TORCH_CHECK(parked_, "PhaseParking::unpark: nothing parked");
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (!tensors_[i].defined()) continue;
    at::Tensor d = at::empty(host_[i].sizes(), host_[i].options().device(devices_[i]).pinned_memory(false));
    d.copy_(host_[i], /*non_blocking=*/d.is_cuda());
    tensors_[i].set_data(d);
  }
  tensors_.clear();
  parked_ = false;
}

int64_t PhaseParking::host_bytes() const {
  int64_t b = 0;
  for (const at::Tensor& h : host_) b += h.defined() ? h.nbytes() : 0;
  return b;
}

}  // namespace rlt
