// Atomic checkpoints of a run: the model as a Hugging Face folder, the optimizer state (per parameter, as
// parallel/shard.h's pieces, whatever the ranks and shard stage), run.model.extra, PPO's separate critic
// (trainer/critic.h) and the step counters (and the old log-probs in force, train.old_logprobs), written
// under a temporary name and renamed into place.
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

// Whether every rank writes into the checkpoint (save_checkpoint then runs on every rank): with several
// ranks, a sharded state's pieces, and rollout.partial's carried groups.
bool checkpoint_on_every_rank(const Run& run);

// Checkpoint out_dir/checkpoint: model folder (HF), optimizer-<rank>.safetensors, extra.pt (run.model.extra),
// state.json,
// written under a temporary name and renamed; the previous checkpoint stays until the new one is complete.
void save_checkpoint(Run& run);
// Restores the state saved by save_checkpoint into a run made for it (make_run calls it with resume).
// With LoRA the checkpoint holds adapter/, a PEFT adapter folder (model/peft.h), instead of model/.
void load_checkpoint(Run& run);
// A replicated AdamW's state (model.optimizer over optimizer_params(model)) as whole-parameter pieces
// (parallel/shard.h, OptimizerPieces) in dir/optimizer-0.safetensors, so a run resumes it with another number
// of ranks or a shard stage; and back from every optimizer-*.safetensors in dir (a sharded state's pieces
// too), its moments at `optimizer_steps` (RunError naming a tensor no piece covers).
void save_optimizer_pieces(const ModelState& model, const std::string& dir);
void load_optimizer_pieces(ModelState& model, const std::string& dir, int64_t optimizer_steps);

// The policy as one Hugging Face folder at `dir`: with LoRA its adapters merged into the base weights
// (rollout_model), with the checkpoint's side files (tokenizer, generation config, chat template).
void save_merged_model(Run& run, const std::string& dir);

}  // namespace rlt
