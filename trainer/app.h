// The command line shared by grpo_train and ppo_train: --config, --set, --out, --resume,
// --print-config; bad configs and inputs exit with code 2 and a message naming what is wrong.
#pragma once

#include <functional>
#include <map>
#include <string>

#include "trainer/run.h"

namespace rlt {

// `train` runs the algorithm on a set-up run and returns its last metrics. `extra` makes the parameters
// trained beside the policy (PPO's value head); see make_run.
using TrainFn = std::function<std::map<std::string, double>(Run&)>;
int train_main(int argc, char** argv, const std::string& name, const std::string& about, const TrainFn& train,
               const ExtraParams& extra = {});

}  // namespace rlt
