// The training FLOP count (model/flops.h) against a hand count for small shapes, product by product, and the
// peak table's lookups. Wrong twins it must tell apart: attention counted over every key (not the causal
// prefix), the window ignored on a sliding layer, the head over every row instead of the scored ones, and
// LoRA's backward counted as full fine-tuning's, and a continuation's context ignored.
#include "model/flops.h"

#include <gtest/gtest.h>

namespace rlt {
namespace {

// D 32, F 64, 4 heads of 8 over 2 KV heads, 2 layers, V 400.
ModelConfig small_shape() {
  ModelConfig c;
  c.vocab_size = 400;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.sliding_layers = {false, false};
  return c;
}

TEST(Flops, AForwardIsItsProductsCountedByHand) {
  const ModelConfig c = small_shape();
  const SequenceWork s{10, 3};
  const ForwardFlops f = forward_flops(c, s);
  // Per token and layer: q 32x32, k 16x32, v 16x32, o 32x32, gate 64x32, up 64x32, down 32x64 weights.
  const double weights = 32 * 32 + 16 * 32 + 16 * 32 + 32 * 32 + 64 * 32 + 64 * 32 + 32 * 64;
  EXPECT_DOUBLE_EQ(f.projections, 2.0 * weights * 10 * 2);
  // Position t sees t keys: 55 keys over 10 positions; 2 hd FLOPs a key for the scores and 2 hd for the
  // values, 4 heads, 2 layers.
  EXPECT_DOUBLE_EQ(f.attention, 4.0 * 8 * 4 * 55 * 2);
  EXPECT_NE(f.attention, 4.0 * 8 * 4 * 100 * 2) << "every key for every position is not causal";
  EXPECT_DOUBLE_EQ(f.head, 2.0 * 400 * 32 * 3);
  EXPECT_NE(f.head, 2.0 * 400 * 32 * 10) << "the head runs over the scored rows only";
  EXPECT_DOUBLE_EQ(f.total(), f.projections + f.attention + f.head);
}

TEST(Flops, ASlidingLayerSeesItsWindowOnly) {
  ModelConfig c = small_shape();
  c.sliding_window = 4;
  c.sliding_layers = {true, false};
  const ForwardFlops f = forward_flops(c, SequenceWork{10, 0});
  // Layer 0: positions 1..4 see 1..4 keys (10), positions 5..10 see 4 each (24): 34. Layer 1: 55.
  EXPECT_DOUBLE_EQ(f.attention, 4.0 * 8 * 4 * (34 + 55));
  EXPECT_NE(f.attention, 4.0 * 8 * 4 * (55 + 55)) << "the window ignored";
}

// A sequence that continues a shared prompt (trainer/batch.h): 4 tokens after 6 of context see 7..10 keys
// (34) on a full layer and 4 each on a window of 4; the prompt's forward plus the continuation's equal the
// whole sequence's. Wrong twin: the context ignored (1..4 keys, 10).
TEST(Flops, AContinuationAttendsOverItsContext) {
  ModelConfig c = small_shape();
  c.sliding_window = 4;
  c.sliding_layers = {true, false};
  const ForwardFlops f = forward_flops(c, SequenceWork{4, 2, 6});
  EXPECT_DOUBLE_EQ(f.attention, 4.0 * 8 * 4 * (16 + 34));
  EXPECT_NE(f.attention, 4.0 * 8 * 4 * (10 + 10)) << "the context ignored";
  const ForwardFlops prompt = forward_flops(c, SequenceWork{6, 0}), whole = forward_flops(c, SequenceWork{10, 2});
  EXPECT_DOUBLE_EQ(prompt.attention + f.attention, whole.attention);
  EXPECT_DOUBLE_EQ(prompt.projections + f.projections, whole.projections);
  EXPECT_DOUBLE_EQ(f.head, whole.head);
}

TEST(Flops, ABackwardTakesTwiceTheForwardAndARecomputeOnceMore) {
  const ModelConfig c = small_shape();
  const std::vector<SequenceWork> seqs = {{10, 3}, {1, 1}, {7, 7}};
  double fwd = 0, layers = 0, products = 0, attention = 0;
  for (const auto& s : seqs) {
    const ForwardFlops f = forward_flops(c, s);
    fwd += f.total();
    layers += f.layers();
    products += f.projections + f.head;
    attention += f.attention;
  }
  const PassFlops full = training_flops(c, seqs, /*weight_grads=*/true, /*recomputed_layers=*/0);
  EXPECT_DOUBLE_EQ(full.model, 3 * fwd);
  EXPECT_DOUBLE_EQ(full.hardware, full.model);
  const PassFlops ckpt = training_flops(c, seqs, true, /*recomputed_layers=*/c.num_layers);
  EXPECT_DOUBLE_EQ(ckpt.model, 3 * fwd) << "a recompute is not model work";
  EXPECT_DOUBLE_EQ(ckpt.hardware, 3 * fwd + layers);
  // model.checkpoint_layers: one layer of the two recomputes its forward, half the layers' FLOPs.
  ASSERT_EQ(c.num_layers, 2);
  const PassFlops one = training_flops(c, seqs, true, 1);
  EXPECT_DOUBLE_EQ(one.hardware, 3 * fwd + layers / 2);
  // Frozen weights (LoRA): a product's backward is the input's gradient alone.
  const PassFlops lora = training_flops(c, seqs, /*weight_grads=*/false, 0);
  EXPECT_DOUBLE_EQ(lora.model, 2 * products + 3 * attention);
  EXPECT_LT(lora.model, full.model) << "LoRA counted as full fine-tuning";
}

TEST(Flops, PeaksByDeviceName) {
  EXPECT_DOUBLE_EQ(bf16_peak_flops("NVIDIA H200"), 989.4e12);
  EXPECT_DOUBLE_EQ(bf16_peak_flops("NVIDIA H100 80GB HBM3"), 989.4e12);
  EXPECT_DOUBLE_EQ(bf16_peak_flops("NVIDIA H100 PCIe"), 756.0e12);
  EXPECT_DOUBLE_EQ(bf16_peak_flops("NVIDIA A100-SXM4-80GB"), 312.0e12);
  EXPECT_EQ(bf16_peak_flops("NVIDIA GeForce RTX 3090"), 0) << "a device outside the table has no peak";
}

}  // namespace
}  // namespace rlt
