// The built-in demo's supervised warm-up: synthetic multiplication traces (a share of them calling the
// interpreter) teach a new model the tool protocol before RL, and the text a new tokenizer is trained on.
// Leaves out: warm-up on a dataset of real traces.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "trainer/run.h"

namespace rlt {

// The text a new tokenizer learns from: prompts through the chat template and both kinds of warm-up
// traces, so every piece the demo writes is in its vocabulary.
std::vector<std::string> tokenizer_corpus(const Config& c, const ToolProtocol& tools);

// Supervised warm-up on synthetic tool-use traces (sft.*); returns the last loss. Tool output is masked
// out of the loss as in RL.
double sft_warmup(Run& run);

// The warm-up's problems: o.steps * o.batch_size of them, drawn apart from the RL prompts, cycling
// through operand lengths [o.operand_digits_min, digits] x [.., digits] (just the task's own lengths when
// operand_digits_min is 0).
std::vector<PromptExample> warmup_tasks(const SyntheticOptions& task, const SftOptions& o);

}  // namespace rlt
