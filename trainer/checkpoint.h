// Atomic checkpoints of a run: the model as a Hugging Face folder, the optimizer state, run.extra and the
// step counters (and the old log-probs in force, train.old_logprobs), written under a temporary name and
// renamed into place.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "trainer/run.h"

namespace rlt {

// out_dir/checkpoint.
std::string checkpoint_dir(const Run& run);

// Checkpoint out_dir/checkpoint: model folder (HF), optimizer.pt, extra.pt (run.extra), state.json,
// written under a temporary name and renamed; the previous checkpoint stays until the new one is complete.
void save_checkpoint(Run& run);
// Restores the state saved by save_checkpoint into a run made for it (make_run calls it with resume).
void load_checkpoint(Run& run);

}  // namespace rlt
