// Device tensors moved to host memory for one phase of a step and back (train.phase_offload): the
// optimizer's masters and moments (and with training_state the sharded weight chunks) leave the GPU while
// the rollout holds its KV cache and weight copies, and return before the update. Each tensor keeps its
// identity (its TensorImpl, through Variable::set_data), so an optimizer that keys its state by the tensor,
// or a struct that holds it, finds it again.
#pragma once

#include <ATen/ATen.h>

#include <future>
#include <vector>

namespace rlt {

// What a phase takes off the device: `moved` to host memory and back, `zeroed` (all zeros) freed and made
// again as zeros, and `chunks` (a sharded state's weight chunks) moved too, but only once the whole weights
// they are gathered into are (ParkedTrainingState parks them second).
struct PhaseTensors {
  std::vector<at::Tensor> moved, zeroed, chunks;
};

class PhaseParking {
 public:
  // Deliberate mistakes for the tests. kStaleCopy: the host buffers are written on the first park only, so
  // from the second phase on the state comes back as it was a step earlier. kWrongSlice: each tensor comes
  // back one element over (element i holds what was at i - 1), as moments put back on the wrong slice.
  enum class Fault { kNone, kStaleCopy, kWrongSlice };
  explicit PhaseParking(Fault fault = Fault::kNone) : fault_(fault) {}
  ~PhaseParking();
  PhaseParking(const PhaseParking&) = delete;
  PhaseParking& operator=(const PhaseParking&) = delete;

  // Makes the host buffers for tensors shaped and typed as `like`, in the order later parks pass them, on a
  // thread of its own: pinning host memory costs about 0.2 s a GB (17.25 GiB in 3.16 s on an H200 host,
  // the first copy included), which then runs beside the loading and the warm-up instead of inside the
  // first steps. park() waits for it. Only sizes and dtypes are read.
  void reserve(const std::vector<at::Tensor>& like);
  // Moves `moved` to host buffers (pinned when CUDA is present; the i-th reuses the i-th buffer when its
  // shape and dtype match, else one is made), freeing their device memory; the copies run on the current
  // stream. `zeroed` hold zeros (the gradient chunks between steps): freed without a copy and made again as
  // zeros. Undefined tensors are skipped. A park while parked adds to what is parked (its tensors take the
  // next buffers); unpark() brings everything back, before the next phase's first park. A park that throws
  // (a host buffer it cannot make) leaves parked() true with what it moved before: unpark() brings that
  // back.
  void park(const std::vector<at::Tensor>& moved, const std::vector<at::Tensor>& zeroed = {});
  // Each parked tensor back on the device it left, in fresh device memory (the caching allocator reuses
  // the blocks the phase freed), copied asynchronously on the current stream.
  void unpark();
  bool parked() const { return parked_; }
  // reserve() was called or a park made buffers.
  bool reserved() const { return reserving_.valid() || !host_.empty(); }
  // Bytes of the host buffers.
  int64_t host_bytes() const;
  // Bytes the phase took off the device so far: copied out, and freed as zeros.
  int64_t moved_bytes() const { return moved_bytes_; }
  int64_t zeroed_bytes() const { return zeroed_bytes_; }

 private:
  void take_reserved();

  // A tensor freed as zeros (its storage empty, its dtype and device kept), and its sizes to make them
  // again.
  struct Zeroed {
    at::Tensor tensor;
    std::vector<int64_t> sizes;
  };
  std::vector<at::Tensor> tensors_;  // the parked tensors (sharing each one's impl), in buffer order
  std::vector<at::Tensor> host_;     // their host buffers, reused
  std::vector<bool> written_;        // per buffer: a park has copied into it (kStaleCopy copies only then)
  std::vector<at::Device> devices_;  // per parked tensor: the device it left
  std::vector<Zeroed> zeroed_;
  std::future<std::vector<at::Tensor>> reserving_;
  int64_t moved_bytes_ = 0, zeroed_bytes_ = 0;
  bool parked_ = false;
  Fault fault_;
};

}  // namespace rlt
