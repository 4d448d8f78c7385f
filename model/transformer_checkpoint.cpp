// How a forward runs one layer (Transformer::run_layer): with its weights made resident around it
// (WeightResidency, model/residency.h), and in training with activation checkpointing, whose recompute
// in the backward replays the LoRA adapters' dropout masks of the first run.
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <functional>
#include <memory>
#include <mutex>

#include "model/layer_kernels.h"
#include "model/transformer.h"

namespace rlt {

namespace {

// Activation checkpointing: the layer runs without a graph in the forward and again, with one, in the
// backward (reentrant, as torch.utils.checkpoint's original form), which accumulates the parameter
// gradients directly and returns the input's. The layer closure lives in the autograd context (a
// capsule), so it lasts exactly as long as the graph that needs it.
// `fn(x, backward)` runs the layer (backward: the recompute); `done` runs after the layer's backward.
struct LayerFnHolder : torch::CustomClassHolder {
  LayerFnHolder(std::function<at::Tensor(const at::Tensor&, bool)> f, std::function<void()> d)
      : fn(std::move(f)), done(std::move(d)) {}
  std::function<at::Tensor(const at::Tensor&, bool)> fn;
  std::function<void()> done;
};

class CheckpointFn : public torch::autograd::Function<CheckpointFn> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& h,
                                                c10::intrusive_ptr<LayerFnHolder> layer) {
    ctx->save_for_backward({h});
    at::Tensor out;
    {
      at::NoGradGuard ng;
      out = layer->fn(h, false);
    }
    ctx->saved_data["layer"] = c10::IValue::make_capsule(std::move(layer));
    return {out};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    at::Tensor h = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    auto layer = c10::static_intrusive_pointer_cast<LayerFnHolder>(ctx->saved_data["layer"].toCapsule());
    at::Tensor out;
    {
      at::AutoGradMode on(true);
      out = layer->fn(h, true);
    }
    torch::autograd::backward({out}, {grads[0]});
    if (layer->done) layer->done();
    return {h.grad(), at::Tensor()};
  }
};

}  // namespace

at::Tensor Transformer::run_layer(int64_t i, const at::Tensor& h, at::Tensor& pending, const ForwardPlan& p) const {
  const bool checkpointed = checkpointing_ && (checkpoint_layers_ < 0 || i < checkpoint_layers_);
  if (!checkpointed || p.cache || !at::GradMode::is_enabled()) {
    // A layer's weights go back after it: its graph must not need them (no grad, or a recompute below).
    TORCH_CHECK(!residency_ || !at::GradMode::is_enabled(),
                "a forward with gradients over sharded weights needs activation checkpointing");
    if (residency_) residency_->acquire(i, false);
    at::Tensor out = layer_forward(i, h, pending, p);
    if (residency_) residency_->release(i);
    return out;
  }
  // Checkpointed: the layer runs from h alone and returns its whole output, the residual that the layer
  // forms leave pending (LayerKernels::add_residual) added inside. Checkpointed layers are the first ones,
  // so none leaves a residual pending for this one.
  TORCH_CHECK(!pending.defined(), "run_layer: a checkpointed layer after one that left its residual pending");
  WeightResidency* res = residency_;
  // With adapter dropout the recompute must draw the masks the first run drew: it starts from the
  // generator's state as that run began (`drawn`), then puts back the state it found, so the forwards
  // that follow draw on as if no recompute had run (torch.utils.checkpoint's preserve_rng_state).
  auto drawn = std::make_shared<at::Tensor>();
  at::Generator gen = lora_gen_;
  auto layer = c10::make_intrusive<LayerFnHolder>(
      [this, i, p, res, drawn, gen](const at::Tensor& x, bool backward) mutable {
        if (res) res->acquire(i, backward);
        at::Tensor found;
        if (p.dropout) {
          std::lock_guard<std::mutex> lock(gen.mutex());  // not held while drawing: bernoulli_ takes it
          if (backward) {
            found = gen.get_state();
            gen.set_state(*drawn);
          } else {
            *drawn = gen.get_state();
          }
        }
        at::Tensor own_pending;
        at::Tensor y = layer_forward(i, x, own_pending, p);
        if (own_pending.defined()) y = y + own_pending;
        if (found.defined()) {
          std::lock_guard<std::mutex> lock(gen.mutex());
          gen.set_state(found);
        }
        if (res && !backward) res->release(i);  // the recompute's graph needs them until its backward
        return y;
      },
      res ? std::function<void()>([res, i] { res->release(i); }) : std::function<void()>());
  // A checkpointed layer's gradients reach its weights only through its input: the input must require grad
  // even when the embedding is frozen (LoRA), or the first layer's output would not, and the adapters would
  // get no gradient (torch.utils.checkpoint's reentrant form has the same need).
  const at::Tensor x = h.requires_grad() ? h : h.detach().requires_grad_(true);
  return CheckpointFn::apply(x, std::move(layer))[0];
}

}  // namespace rlt
