// Device tensors moved to host memory for one phase of a step and back (train.phase_offload): the
// optimizer's masters and moments leave the GPU while the rollout holds its KV cache and weight copies, and
// return before the update. Each tensor keeps its identity (its TensorImpl, through Variable::set_data), so
// an optimizer that keys its state by the tensor, or a struct that holds it, finds it again.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace rlt {

class PhaseParking {
 public:
  // A deliberate mistake for the tests: the host buffers are written on the first park only, so from the
  // second phase on the state comes back as it was a step earlier (a stale copy).
  enum class Fault { kNone, kStaleCopy };
  explicit PhaseParking(Fault fault = Fault::kNone) : fault_(fault) {}

  // Moves `tensors` to host buffers (pinned when CUDA is present; made on the first park and reused
  // after), freeing their device memory; the copies run on the current stream. Undefined tensors are
  // skipped. The same tensors, in the same order, must come back through unpark() before the next park.
  void park(const std::vector<at::Tensor>& tensors);
  // Each parked tensor back on the device it left, in fresh device memory (the caching allocator reuses
  // the blocks the phase freed), copied asynchronously on the current stream.
  void unpark();
  bool parked() const { return parked_; }
  // Bytes of the host buffers.
  int64_t host_bytes() const;

 private:
  std::vector<at::Tensor> tensors_;  // the parked tensors (sharing each one's impl)
  std::vector<at::Tensor> host_;     // their host buffers, reused
  std::vector<at::Device> devices_;
  bool parked_ = false;
  Fault fault_;
};

}  // namespace rlt
