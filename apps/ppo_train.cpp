// ppo_train --config FILE [--set key=value ...] [--out DIR] [--resume]: PPO with a value head and the
// ReTool rollout.
#include "trainer/app.h"
#include "trainer/ppo.h"

int main(int argc, char** argv) {
  return rlt::train_main(argc, argv, "ppo_train",
                         "PPO post-training (value head, GAE) with multi-turn sandboxed tool use "
                         "(configs/ppo_tiny.yaml)",
                         rlt::train_ppo, rlt::value_head_params());
}
