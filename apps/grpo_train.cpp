// grpo_train --config FILE [--set key=value ...] [--out DIR] [--resume]: GRPO with the ReTool rollout.
#include "trainer/app.h"
#include "trainer/grpo.h"

int main(int argc, char** argv) {
  return rlt::train_main(argc, argv, "grpo_train",
                         "GRPO post-training with multi-turn sandboxed tool use (configs/retool.yaml, "
                         "configs/retool_tiny.yaml)",
                         [](rlt::Run& run) { return rlt::train_grpo(run); });
}
