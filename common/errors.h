// Bad input found while setting a run up (a missing checkpoint, a tokenizer that does not match the model,
// launch flags that do not go together): the apps print it and exit with code 2. Every floor above common
// throws it, so it lives here.
#pragma once

#include <stdexcept>

namespace rlt {

class RunError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace rlt
