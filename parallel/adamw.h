// AdamW on one flat fp32 slice: the update the sharded optimizer (train.shard) applies to a rank's slice
// of the masters and moments, and OffloadedAdamW, which keeps that slice in pinned host memory for
// train.offload: optimizer. AdamW over a list of tensors (adamw_step_tensors) and the global-norm clip over
// one (clip_grad_norm_tensors): the replicated trainer's optimizer step, in multi-tensor kernels. The
// arithmetic is torch::optim::AdamW's (libtorch 2.11, decoupled weight decay, amsgrad off); amsgrad,
// maximize and gradient scaling are left out.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "parallel/options.h"

namespace rlt {

// One AdamW step's hyper-parameters; the defaults are torch::optim::AdamWOptions'.
struct AdamWStep {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  int64_t step = 1;  // t of the bias corrections: the 1-based count of steps, this one included
};

// Elements per task of the CPU step on ATen's intra-op threads (128 KiB of each of the four arrays).
constexpr int64_t kAdamWCpuGrain = int64_t(1) << 15;

// One AdamW update of a flat slice, in place, with torch::optim::AdamW's operations and roundings:
//   p = p * (1 - lr wd)
//   m = m b1 + (1 - b1) g                      (mul_ then add_, fused multiply-add as ATen's AVX2 add_)
//   v = v b2 + (1 - b2) g g                    (mul_ then addcmul_, likewise fused)
//   p = p + (-lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps)
// with every scalar computed in double and rounded to float once, the element arithmetic in float.
// param, grad, exp_avg, exp_avg_sq: (n) contiguous fp32 on one device. On the CPU one pass over memory on
// all of ATen's threads; elsewhere adamw_step_tensors over the one slice. The CPU sqrt is
// correctly rounded where ATen's (MKL's) is within an ulp, so p can differ from torch's CPU step by an ulp.
// Its speed against ATen's op sequence: docs/benchmarks.md, "AdamW and the optimizer offload".
void adamw_step(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                const AdamWStep& s);

// One AdamW step over many tensors at one step count, in place: torch::optim::AdamW's ops, in its order,
// with its roundings, as ATen's multi-tensor ops (_foreach_*), so that on CUDA each op is one kernel over a
// list of tensors where torch::optim::AdamW launches one a tensor: about 30 rounds of nine list ops for a
// 0.5B model where it launches 2,600 kernels. A round holds at most round_elems elements (a tensor larger
// than that is cut into slices): 16M bounds the denominator's temporary to 64 MiB. On the CPU ATen runs the
// same ops tensor by tensor, so the result is torch's there too. params, grads, exp_avgs, exp_avg_sqs:
// equal counts, each quadruple contiguous and of one shape; one floating dtype and one device for all.
// `fault`: a deliberate mistake, for the tests only.
struct AdamWTensors {
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs;
};
constexpr int64_t kAdamWRoundElems = int64_t(1) << 24;
// kSkipRoundTail: each round's last slice is left unstepped. kSliceOffsetIgnored: every slice of a cut
// tensor takes its gradient from the tensor's start.
enum class AdamWTensorsFault { kNone, kSkipRoundTail, kSliceOffsetIgnored };
void adamw_step_tensors(const AdamWTensors& t, const AdamWStep& s, int64_t round_elems = kAdamWRoundElems,
                        AdamWTensorsFault fault = AdamWTensorsFault::kNone);

// The gradients of `grads` (undefined ones skipped) scaled as torch::nn::utils::clip_grad_norm_ scales them:
// by max_norm / (norm + 1e-6), at most 1, where norm is the 2-norm of the per-tensor norms; returns norm
// (one host sync). The per-tensor norms and the scaling are multi-tensor ops (_foreach_norm, _foreach_mul_):
// two kernels on CUDA where clip_grad_norm_ launches two a tensor. max_norm may be +inf (no clipping).
double clip_grad_norm_tensors(const std::vector<at::Tensor>& grads, double max_norm);

// Where OffloadedAdamW::step computes (OffloadMode, parallel/options.h): both keep the masters and moments
// in pinned host memory. kHostStep: the gradient slice comes to the host in chunks, the host steps each
// (all cores) and sends the weights back: 4 + 2 bytes over PCIe per element with bf16 weights, host memory
// traffic 28. kStreamDevice: masters and moments stream through the GPU in chunks, up, adamw_step on the
// device, back down: 24 bytes over PCIe per element, none through the host's cores.
// Measured by apps/bench_adamw (one H100, 16 Xeon cores, bf16 weights, 4M-element chunks, median of 15):
// 1e8 elements: kHostStep 20.9 ms, kStreamDevice 25.2 ms (PCIe at 95 GB/s both ways together);
// 4e8: 78.5 ms and 98.7 ms: kHostStep ~20% faster for a rank alone on its host. It is bound by host memory
// (~150 GB/s), which every rank of a host shares, while each GPU streams over its own PCIe link:
// train.offload_step auto takes kStreamDevice where several ranks share a host.
struct OffloadOptions {
  OffloadMode mode = OffloadMode::kHostStep;
  // Elements per copy (16 MiB of fp32); of 1M, 4M and 16M, 4M is kHostStep's fastest (21.3 ms against
  // 24.1 and 23.6 for 1e8 elements).
  int64_t chunk_elems = int64_t(1) << 22;
};

// Device bytes a kStreamDevice step over n elements allocates while it runs (none are held between steps):
// three slots of a chunk of masters, moments and second moments, and adamw_step's denominator over one
// chunk. The memory plan's figure for train.offload_step device.
int64_t stream_step_device_bytes(int64_t n, const OffloadOptions& options = {});

// Masters and moments of one rank's slice in pinned host memory (plain host memory when CUDA is not
// available), stepped for train.offload: optimizer. The gradient slice comes from the device; the updated
// weights go back to the device rounded to the weights' dtype.
class OffloadedAdamW {
 public:
  // master: the rank's fp32 master slice (n), any device: copied to the host; the moments start at zero.
  explicit OffloadedAdamW(const at::Tensor& master, OffloadOptions options = {});
  // numel zero masters on the host, for a caller that fills master() itself: a sharded state copies its
  // slices there from the whole weights, and never holds the masters on the device.
  explicit OffloadedAdamW(int64_t numel, OffloadOptions options = {});

  // grad: (n) fp32 contiguous gradient slice, CUDA or CPU. out: (n) contiguous weights slice, fp32, bf16
  // or fp16, CUDA or CPU; receives the updated masters rounded to nearest (even). Chunked, the copies on
  // side streams overlapping the compute of the neighbouring chunks; returns when the host state is
  // updated, and the current stream of out's device waits for out's copies.
  void step(const at::Tensor& grad, const AdamWStep& s, at::Tensor out);

  at::Tensor master() const { return master_; }  // (n) host fp32
  at::Tensor exp_avg() const { return exp_avg_; }
  at::Tensor exp_avg_sq() const { return exp_avg_sq_; }
  const OffloadOptions& options() const { return options_; }
  // Host bytes held: masters, moments and the pinned staging chunks.
  int64_t host_bytes() const;

 private:
  void step_on_host(const at::Tensor& grad, const AdamWStep& s, at::Tensor& out);
  void step_through_device(const at::Tensor& grad, const AdamWStep& s, at::Tensor& out);

  OffloadOptions options_;
  at::Tensor master_, exp_avg_, exp_avg_sq_;  // (n) host fp32
  at::Tensor grad_stage_;                     // (2, chunk) pinned fp32: gradient chunks from the device
  at::Tensor out_stage_;                      // (2, chunk) pinned, out's dtype: weight chunks to the device
};

}  // namespace rlt
