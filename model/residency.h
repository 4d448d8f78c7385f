// Where a model's weights are between forwards, when they are sharded over ranks. Transformer::forward
// asks for each layer's weights through this interface (model/transformer_checkpoint.cpp); parallel/shard.h
// implements it.
#pragma once

#include <cstdint>

namespace rlt {

// Where a model's weights are while they are sharded over ranks (train.shard parameters, parallel/shard.h):
// forward() asks for layer i's weights before running it and hands them back after it (a checkpointed
// layer asks again in the backward, and hands them back once its backward is done); the embedding, final
// norm and head (layer -1) are asked for at the start of every forward and handed back by the owner.
class WeightResidency {
 public:
  virtual ~WeightResidency() = default;
  // `backward`: asked by a checkpointed layer's recompute, so the next layer needed is i - 1, not i + 1.
  virtual void acquire(int64_t layer, bool backward) = 0;
  virtual void release(int64_t layer) = 0;
};

}  // namespace rlt
