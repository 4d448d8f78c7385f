// The floating-point operations of a decoder's training passes, counted from its shape (ModelConfig), and
// the peak bf16 rate of the GPUs they run on: what update_mfu divides. A multiply-add is 2 FLOPs. Counted:
// every projection of every layer (q, k, v, o, and the MLP's gate, up and down), attention's two products
// over the causal prefix each position sees (capped at the window on sliding layers), and the LM head over
// the rows the loss module scores. Not counted: norms, RoPE, softmax, activations, biases and LoRA
// adapters, a few percent at most.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

namespace rlt {

// One sequence of a training pass: its tokens, and the rows of them whose logits the LM head computes;
// `context` tokens before them (a prompt another sequence of the pass ran, trainer/batch.h) are attended
// over and not computed: the sequence's positions run from context + 1 to context + tokens.
struct SequenceWork {
  int64_t tokens = 0;
  int64_t scored = 0;
  int64_t context = 0;
};

// A forward over one sequence, split by part.
struct ForwardFlops {
  double projections = 0, attention = 0, head = 0;
  double layers() const { return projections + attention; }
  double total() const { return projections + attention + head; }
};
ForwardFlops forward_flops(const ModelConfig& c, const SequenceWork& s);

// One forward and backward over the sequences. The backward of a product takes twice its forward (the
// input's gradient and the weight's), once where the weights are frozen (LoRA: the input's gradient
// alone); attention's backward twice its forward. `model`: that work (model FLOPs, what MFU counts);
// `hardware`: plus the forward again of the `recomputed_layers` layers that activation checkpointing
// recomputes (their share of the layers' forward: sliding-window layers weigh as the others).
struct PassFlops {
  double model = 0, hardware = 0;
};
PassFlops training_flops(const ModelConfig& c, const std::vector<SequenceWork>& seqs, bool weight_grads,
                         int64_t recomputed_layers);

// The dense bf16 tensor-core rate of a GPU (FLOP/s, float32 accumulation) from its name as CUDA reports
// it, for the NVIDIA data-center parts in docs/training.md's table; 0 for any other.
double bf16_peak_flops(const std::string& device_name);

}  // namespace rlt
