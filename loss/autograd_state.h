// The non-tensor state of the loss module's autograd functions (options, resolved block sizes), saved
// in the autograd context as one typed struct rather than as string-keyed scalars.
#pragma once

#include <utility>

#include <torch/csrc/autograd/custom_function.h>

namespace rlt {

template <class State>
struct BoxedState : torch::CustomClassHolder {
  explicit BoxedState(State s) : value(std::move(s)) {}
  State value;
};

template <class State>
void save_state(torch::autograd::AutogradContext* ctx, State state) {
  ctx->saved_data["state"] = at::IValue::make_capsule(c10::make_intrusive<BoxedState<State>>(std::move(state)));
}

// Valid while ctx lives (its saved_data keeps the box alive).
template <class State>
const State& saved_state(torch::autograd::AutogradContext* ctx) {
  return static_cast<const BoxedState<State>*>(ctx->saved_data.at("state").toCapsule().get())->value;
}

}  // namespace rlt
