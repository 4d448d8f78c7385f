// PhaseParking; see parking.h.
#include "parallel/parking.h"

#include "common/memory.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include <optional>

namespace rlt {

namespace {

// Exactly the tensor's size, page-locked where CUDA is present. No event guards it: a buffer is freed (replaced
// in park(), or with the parking) only once the device has run the copies that read or write it.
at::Tensor host_buffer(at::IntArrayRef sizes, at::ScalarType dtype) { return pinned_host_zeros(sizes, dtype); }

// Waits for the copies queued on `devices` (CUDA ones; a CPU device has none), each made current for it.
void wait_for_copies(const std::vector<at::Device>& devices) {
  for (const at::Device& d : devices) {
    if (!d.is_cuda()) continue;
    const c10::DeviceGuard guard(d);
    device_synchronize(d);
  }
}

bool fits(const at::Tensor& buffer, const at::Tensor& t) {
  return buffer.defined() && buffer.sizes() == t.sizes() && buffer.scalar_type() == t.scalar_type();
}

}  // namespace

PhaseParking::~PhaseParking() {
  if (reserving_.valid()) reserving_.wait();
  try {
    wait_for_copies(devices_);  // an unpark's copies may still read the buffers (an error path ends here)
  } catch (...) {
  }
}

void PhaseParking::reserve(const std::vector<at::Tensor>& like) {
  TORCH_CHECK(!parked_ && !reserving_.valid(), "PhaseParking::reserve: parked, or reserving already");
  struct Shape {
    bool defined;
    std::vector<int64_t> sizes;
    at::ScalarType dtype;
  };
  std::vector<Shape> shapes;
  std::optional<at::Device> cuda;
  for (const at::Tensor& t : like) {
    if (!t.defined()) {
      shapes.push_back({false, {}, at::kByte});
      continue;
    }
    shapes.push_back({true, t.sizes().vec(), t.scalar_type()});
    if (t.is_cuda() && !cuda) cuda = t.device();
  }
  reserving_ = std::async(std::launch::async, [shapes = std::move(shapes), cuda] {
    // The thread's device is the tensors' own: registering the pages would make a context on
    // device 0 otherwise.
    std::optional<c10::DeviceGuard> guard;
    if (cuda) guard.emplace(*cuda);
    std::vector<at::Tensor> out;
    for (const Shape& s : shapes) out.push_back(s.defined ? host_buffer(s.sizes, s.dtype) : at::Tensor());
    return out;
  });
}

void PhaseParking::take_reserved() {
  if (!reserving_.valid()) return;
  std::vector<at::Tensor> made = reserving_.get();
  if (host_.size() < made.size()) host_.resize(made.size());
  for (size_t i = 0; i < made.size(); ++i) {
    if (!host_[i].defined()) host_[i] = std::move(made[i]);
  }
}

void PhaseParking::park(const std::vector<at::Tensor>& moved, const std::vector<at::Tensor>& zeroed) {
  take_reserved();
  at::NoGradGuard no_grad;
  if (!parked_) {  // a phase's first park
    tensors_.clear();
    devices_.clear();
    zeroed_.clear();
    moved_bytes_ = zeroed_bytes_ = 0;
  }
  parked_ = true;  // from here on unpark() brings back whatever was recorded, should a buffer fail below
  const size_t base = tensors_.size();
  if (host_.size() < base + moved.size()) host_.resize(base + moved.size());
  if (written_.size() < host_.size()) written_.resize(host_.size(), false);
  for (size_t i = 0; i < moved.size(); ++i) {
    const at::Tensor& t = moved[i];
    if (t.defined()) {
      at::Tensor& h = host_[base + i];
      if (!fits(h, t)) {
        if (h.defined()) wait_for_copies({t.device()});  // the last unpark may still read it
        h = host_buffer(t.sizes(), t.scalar_type());
        written_[base + i] = false;
      }
      if (!written_[base + i] || fault_ != Fault::kStaleCopy) h.copy_(t, /*non_blocking=*/t.is_cuda());
      written_[base + i] = true;
      moved_bytes_ += t.nbytes();
    }
    // Recorded once its buffer holds it: a tensor is on the host exactly when it is in tensors_.
    tensors_.push_back(t);
    devices_.push_back(t.defined() ? t.device() : at::Device(at::kCPU));
    if (t.defined())
      tensors_.back().set_data(host_[base + i]);  // the device storage is freed once nothing else holds it
  }
  for (const at::Tensor& t : zeroed) {
    if (!t.defined()) continue;
    zeroed_.push_back({t, t.sizes().vec()});
    zeroed_bytes_ += t.nbytes();
    zeroed_.back().tensor.set_data(at::empty({0}, t.options()));
  }
}

void PhaseParking::unpark() {
  TORCH_CHECK(parked_, "PhaseParking::unpark: nothing parked");
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (!tensors_[i].defined()) continue;
    const at::Tensor& h = host_[i];
    at::Tensor d = at::empty(h.sizes(), h.options().device(devices_[i]).pinned_memory(false));
    if (fault_ == Fault::kWrongSlice && h.numel() > 1) {
      d.copy_(h.reshape({-1}).roll(1).view(h.sizes()));
    } else {
      d.copy_(h, /*non_blocking=*/d.is_cuda());
    }
    tensors_[i].set_data(d);
  }
  for (Zeroed& z : zeroed_) z.tensor.set_data(at::zeros(z.sizes, z.tensor.options()));
  tensors_.clear();
  zeroed_.clear();
  parked_ = false;
}

int64_t PhaseParking::host_bytes() const {
  int64_t b = 0;
  for (const at::Tensor& h : host_) b += h.defined() ? h.nbytes() : 0;
  return b;
}

}  // namespace rlt
