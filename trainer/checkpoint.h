// Atomic checkpoints of a run: the model as a Hugging Face folder, the optimizer state (per parameter, as
// parallel/shard.h's pieces, whatever the ranks and shard stage), run.model.extra, PPO's separate critic
// (trainer/critic.h) and the step counters (and the old log-probs in force, train.old_logprobs), written
// under a temporary name and renamed into place.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
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
// state.json, written under a temporary name and renamed; the previous checkpoint stays until the new one is
// complete. Tensors go to the files one at a time (a GPU model is never copied to the host whole). A save
// the file system cannot hold is refused before it writes anything (RunError with the bytes needed and
// free; every writing rank refuses alike), and the previous checkpoint stays whole.
void save_checkpoint(Run& run);
// The bytes a checkpoint of the run holds, every rank's part together: the model's weights (or its
// adapters), the optimizer state as save_optimizer_pieces and ShardedState write it (fp32 masters and moments
// of a sharded state), extra.pt's tensors, a separate critic's model and optimizer state, and train.async's
// rollout weights. Small files (config, tokenizer, state.json) are left out.
uint64_t checkpoint_bytes(const Run& run);
// The free bytes of the file system holding `dir` (std::filesystem::space); a test replaces it with a fake
// figure (nullptr restores it).
using FreeSpaceProbe = std::function<uint64_t(const std::string& dir)>;
void set_free_space_probe(FreeSpaceProbe probe);
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
