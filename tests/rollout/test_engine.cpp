// DecodeEngine, the model behind the ReTool loop, against each sequence's full forward on the same model:
// its KV cache through holes, compaction, growth and sliding windows; steps and feeds eager, at the graphs'
// fixed shape and as replayed CUDA graphs; the fused decode kernels; spans; kept caches; admits into
// released rows. On the CPU in float64 (CUDA variants skip without a GPU).
#include "rollout/engine.h"

#ifdef RLT_HAVE_CUDA
#include <ATen/cuda/Sleep.h>
#endif

#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <iostream>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "common/cuda/launch.h"
#include "common/memory.h"
#include "model/config.h"
#include "model/transformer.h"
#include "rollout/sampler.h"
#include "tests/common/tiny_model.h"

namespace rlt {
namespace {

using testing::tiny_family_config;
using testing::tiny_model;

// Last-position logits of one sequence, from a full forward without cache or mask on the model's device:
// the reference. Returned on the CPU.
at::Tensor full_logits(const Transformer& m, const std::vector<int64_t>& ids) {
  at::NoGradGuard no_grad;
  const int64_t L = static_cast<int64_t>(ids.size());
  const auto dev = m.lm_head().device();
  at::Tensor x = at::tensor(ids, at::kLong).view({1, L}).to(dev);
  at::Tensor h = m.forward(x, at::arange(L, at::kLong).view({1, L}).to(dev), at::Tensor());
  return m.logits(h.select(1, L - 1))[0].cpu();
}

// (family, device): on "cuda" every decode step and every multi-token feed is a replayed CUDA graph,
// recaptured at each compaction; "cpu_fixed" runs the feeds eagerly at the graphs' bucketed fixed shape
// (padding rows, hole slots past each run, the write slots on the device). "cuda_f32" is "cuda" in
// float32, where the engine's cache forwards run the fused decode kernels (model/cuda/decode_kernels.h;
// float64 keeps the ATen forms) against the ATen full forward.
class DecodeEngineTest : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(DecodeEngineTest, MatchesFullForwardThroughHolesAndCompaction) {
  const auto& [family, device] = GetParam();
  const bool cuda = device.rfind("cuda", 0) == 0, f32 = device == "cuda_f32";
  if (cuda && !at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  // The reference is each sequence's full forward on the same device: the RoPE tables are fp32 (as in
  // transformers), and CPU and CUDA fp32 cos/sin differ by an ulp, which shows as ~1e-5 in these logits.
  const Transformer m =
      tiny_model(family, 3, cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU), f32 ? at::kFloat : at::kDouble);
  EngineOptions po;
  po.slot_chunk = 2;  // the cache fills every few steps: compaction and growth run many times
  po.slot_align = 1;  // the cache sizes as slot_chunk sets them
  po.switches.cuda_graphs = true;
  po.fixed_shape_extend = device == "cpu_fixed";
  po.fixed_shape_step = device == "cpu_fixed";
  po.switches.feed_graphs = true;
  DecodeEngine engine(m, po);
  const std::vector<std::vector<int64_t>> prompts = {{5, 17, 9}, {1, 2, 3, 4, 5, 6, 7}, {250, 8, 60, 61, 62}};
  const int64_t G = 2, N = 6;
  std::vector<std::vector<int64_t>> seqs;
  for (int64_t n = 0; n < N; ++n) seqs.push_back(prompts[n / G]);
  // float64 on CPU, so rounding cannot hide a small error: the cached, masked, gathered forward matches the
  // plain one to 1e-9 for both families (an attention that takes its softmax in fp32 for float64 inputs
  // shows here as 6e-7). A wrong slot, position or window moves logits by more than 1e-2
  // (the known-bad check at the end).
  // float32 (cuda_f32): the fused RMSNorm sums its squares in another order than ATen's mean, and the
  // cache's SDPA kernels differ from the full forward's: ~1e-6 relative, on logits of magnitude ~50.
  const double kTol = f32 ? 2e-3 : 1e-9;
  at::Tensor first = engine.start(prompts, G).cpu().to(at::kDouble);
  for (int64_t n = 0; n < N; ++n) {
    EXPECT_LT((first[n] - full_logits(m, seqs[n]).to(at::kDouble)).abs().max().item<double>(), kTol)
        << "prefill row " << n;
  }
  std::vector<bool> released(N, false);
  int64_t reallocations_at_half = 0;  // after half the rows were released
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1);
  for (int64_t t = 0; t < 14; ++t) {
    if (t == 5) {  // row 1 finishes early
      engine.release({1});
      released[1] = true;
    }
    if (t == 9) {
      engine.release({0, 4});
      released[0] = released[4] = true;
      reallocations_at_half = engine.reallocations();
    }
    // Every third step feeds runs of 1 to 4 tokens in one forward (a tool's reply): the other rows and
    // the shorter runs leave holes, and the next compaction squeezes them out.
    const bool runs_step = t % 3 == 2;
    std::vector<int64_t> rows, tokens;
    std::vector<std::vector<int64_t>> runs;
    for (int64_t n = 0; n < N; ++n) {
      // Idle rows leave holes. At t = 2 three of the six rows feed: a fixed-shape feed pads them to the
      // cache's six rows with idle ones, whose slots must stay holes.
      if (released[n] || (t + n) % 3 == 0 || (t == 2 && n == 5)) continue;
      rows.push_back(n);
      const int64_t k = runs_step ? 1 + (n + t) % 4 : 1;
      runs.emplace_back();
      for (int64_t i = 0; i < k; ++i) {
        runs.back().push_back(at::randint(400, {1}, gen, at::kLong).item<int64_t>());
        seqs[n].push_back(runs.back().back());
      }
      tokens.push_back(runs.back().back());
    }
    at::Tensor logits = (runs_step ? engine.extend(rows, runs) : engine.step(rows, tokens)).cpu().to(at::kDouble);
    ASSERT_EQ(logits.size(0), int64_t(rows.size()));
    for (size_t j = 0; j < rows.size(); ++j) {
      const at::Tensor ref = full_logits(m, seqs[rows[j]]).to(at::kDouble);
      const double err = (logits[j] - ref).abs().max().item<double>();
      EXPECT_LT(err, kTol) << (runs_step ? "multi-token feed " : "step ") << t << " sequence " << rows[j]
                           << " max|logit| " << ref.abs().max().item<double>();
    }
  }
  // The cache this small grows at almost every compaction (CompactionInPlace below squeezes in place).
  EXPECT_GT(engine.compactions(), 3);
  EXPECT_GT(engine.reallocations(), 0);
  // Released rows go when half the cache is released (t = 9) without graphs; with graphs, at the next
  // reallocation after that (a dead row costs a graphed step little, a recapture much).
  const bool dropped = !cuda || engine.reallocations() > reallocations_at_half;
  EXPECT_EQ(engine.cache_rows(), dropped ? 3 : 6);
  // One step graph per cache tensors the one-token steps ran on: the first, and at most one after each
  // reallocation; an in-place compaction keeps it. Plus the feeds' graphs (one per bucket and cache).
  const int64_t step_captures = engine.graph_captures() - engine.feed_graph_captures();
  if (cuda) {
    EXPECT_GE(step_captures, 1);
    EXPECT_LE(step_captures, engine.reallocations() + 1);
  } else {
    EXPECT_EQ(engine.graph_captures(), 0);
  }
  // A known-bad check: a sequence's logits are not another's (the tolerance can fail).
  EXPECT_GT((full_logits(m, seqs[2]) - full_logits(m, seqs[3])).abs().max().item<double>(), 100 * kTol);
}

// The fused decode kernels against the ATen forms inside the engine, on one float32 model: the same
// rollout with them on (with and without packed q/k/v and gate/up weights) and off gives logits within
// float32 noise, and a model whose second layer's
// post-attention norm is off by 1% (w -> 1.01 w + 0.01: gemma's norms scale by 1 + w, and its random
// init leaves w = 0) is rejected by that tolerance: a kernel reading the wrong norm weight or dropping it
// moves logits by far more.
TEST(DecodeEngineCuda, FusedDecodeKernelsMatchTheAtenForms) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  for (const char* family : {"llama", "qwen2", "qwen3", "gemma2"}) {
    Transformer m = tiny_model(family, 4, at::Device(at::kCUDA, 0), at::kFloat);
    auto run = [&](bool fused, bool packed = true) {
      m.set_fused_kernels(fused);
      EngineOptions po;
      po.slot_chunk = 3;
      po.slot_align = 1;  // the cache sizes as slot_chunk sets them
      po.switches.packed_weights = packed;
      DecodeEngine engine(m, po);
      std::vector<at::Tensor> out{engine.start({{5, 17, 9}, {1, 2, 3, 4, 5}}, 2).cpu()};
      for (int64_t t = 0; t < 6; ++t) {
        out.push_back(t % 2 ? engine.extend({0, 3}, {{7, 8, 9}, {int64_t(10 + t)}}).cpu()
                            : engine.step({0, 1, 2, 3}, {t + 1, t + 2, t + 3, t + 4}).cpu());
      }
      return at::cat(out);
    };
    // The fused path ran for the fused runs and not for the other (in float32 their logits may be equal).
    const int64_t before = Transformer::fused_forward_count();
    const at::Tensor on = run(true);
    const int64_t after_on = Transformer::fused_forward_count();
    const at::Tensor off = run(false);
    EXPECT_GE(after_on - before, 7) << family << ": the fused kernels did not run (prefill, 6 steps or feeds)";
    EXPECT_EQ(Transformer::fused_forward_count(), after_on) << family << ": fused kernels ran while off";
    const at::Tensor unpacked = run(true, false);
    const double scale = off.abs().max().item<double>(), err = (on - off).abs().max().item<double>();
    EXPECT_LT(err, 1e-5 * scale) << family << ": fused (packed weights) against ATen, max |logit| " << scale;
    EXPECT_LT((unpacked - off).abs().max().item<double>(), 1e-5 * scale) << family << ": fused, unpacked weights";
    {
      at::NoGradGuard ng;
      const auto params = m.named_parameters();
      for (const auto& [name, t] : params) {
        if (name == "model.layers.1.post_attention_layernorm.weight") t.mul_(1.01).add_(0.01);
      }
    }
    const double moved = (run(true) - off).abs().max().item<double>();
    EXPECT_GT(moved, 10 * 1e-5 * scale) << family << ": a 1% norm weight change must exceed the tolerance";
    m.set_fused_kernels(true);
  }
}

// The fused feed (cuda::rope_cache_attention: the new keys and values into the listed rows' slots, attention
// over their cache where it lies) inside the engine, in bfloat16 at a head size the kernel takes (64, four query heads
// over two KV heads): feeds eager and at the graphs' fixed shape, between steps that leave holes. Every logit is
// measured against the float64 full forward of the same bf16 weights; the run with the fused kernels must
// stay within twice the error of the run with the ATen forms (bf16 activations set both), and the in-place
// attention must have taken every feed of the fused run. A known-bad check: another sequence's logits are
// far outside that tolerance.
// A bf16 model on CUDA at a head size cache_attention takes (64; four query heads over two KV heads), and
// `ref`, the same weights in float64 on the CPU: the reference of the fused feeds' tests.
Transformer bf16_hd64_model(std::unique_ptr<Transformer>& ref, const std::string& family = "qwen2") {
  nlohmann::json j = tiny_family_config(family);
  j["hidden_size"] = 256;
  j["intermediate_size"] = 512;
  const ModelConfig cfg = model_config_from_json(j, "tiny " + family + ", head size 64");
  Transformer m(cfg, at::kBFloat16, at::Device(at::kCUDA, 0), 11);
  ref = std::make_unique<Transformer>(cfg, at::kDouble, at::kCPU, 11);
  at::NoGradGuard ng;
  const auto src = m.named_parameters(), dst = ref->named_parameters();
  for (size_t i = 0; i < src.size(); ++i) {
    src[i].second.mul_(4.0);  // std 0.08: logits far from uniform
    dst[i].second.copy_(src[i].second.to(at::kCPU, at::kDouble));
  }
  return m;
}

// The largest |logit - float64 full forward's| over (logits, sequence) pairs.
double max_error(const Transformer& ref, const std::vector<std::pair<at::Tensor, std::vector<int64_t>>>& got) {
  double e = 0;
  for (const auto& [logits, ids] : got) {
    e = std::max(e, (logits.to(at::kDouble) - full_logits(ref, ids)).abs().max().item<double>());
  }
  return e;
}

TEST(DecodeEngineCuda, FusedFeedsReadTheCacheInPlaceAsTheAtenFormsDo) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  std::unique_ptr<Transformer> ref_model;
  Transformer m = bf16_hd64_model(ref_model);
  const Transformer& ref = *ref_model;
  for (bool graphs : {false, true}) {
    std::vector<std::vector<int64_t>> seqs;
    // Each fed row's logits and its sequence so far, for the reference.
    auto run = [&](bool fused, std::vector<std::pair<at::Tensor, std::vector<int64_t>>>& got) {
      m.set_fused_kernels(fused);
      EngineOptions po;
      po.switches.feed_graphs = graphs;
      DecodeEngine engine(m, po);
      seqs = {{5, 17, 9}, {1, 2, 3, 4, 5, 6}, {250, 8}, {7, 7, 7, 7, 7}, {30, 31}};
      engine.start(seqs, 1);
      int64_t feeds = 0;
      for (int64_t t = 0; t < 12; ++t) {
        std::vector<int64_t> rows;
        std::vector<std::vector<int64_t>> runs;
        if (t % 3 == 2) {  // two rows fed runs of 3-19 tokens
          rows = {t % 5, (t + 2) % 5};
          runs = {{}, {}};
          for (int64_t k = 0; k < 3 + (5 * t) % 17; ++k) runs[0].push_back(40 + (t * 7 + k) % 300);
          for (int64_t k = 0; k < 3 + t % 4; ++k) runs[1].push_back(60 + (t * 3 + k) % 300);
          ++feeds;
        } else {  // three rows step, two wait (holes)
          rows = {t % 5, (t + 1) % 5, (t + 3) % 5};
          for (int64_t r : rows) runs.push_back({(r * 31 + t * 13) % 400});
        }
        at::Tensor logits;
        if (runs.size() == 2 && t % 3 == 2) {
          logits = engine.extend(rows, runs).cpu();
        } else {
          std::vector<int64_t> tokens;
          for (const auto& r : runs) tokens.push_back(r[0]);
          logits = engine.step(rows, tokens).cpu();
        }
        for (size_t i = 0; i < rows.size(); ++i) {
          seqs[rows[i]].insert(seqs[rows[i]].end(), runs[i].begin(), runs[i].end());
          got.emplace_back(logits[static_cast<int64_t>(i)], seqs[rows[i]]);
        }
      }
      return feeds;
    };
    std::vector<std::pair<at::Tensor, std::vector<int64_t>>> fused_got, aten_got;
    // Eager, every feed is a forward; graphed, only the captures' forwards run (a warm-up and the capture each).
    const int64_t before = Transformer::in_place_feed_count();
    const int64_t feeds = run(true, fused_got), in_place = Transformer::in_place_feed_count() - before;
    if (graphs) {
      EXPECT_GE(in_place, 2) << "graphed feeds missed the kernel";
    } else {
      EXPECT_EQ(in_place, feeds) << "an eager feed missed the kernel";
    }
    run(false, aten_got);
    EXPECT_EQ(Transformer::in_place_feed_count() - before, in_place) << "the ATen run took the fused feed";
    const double fused_err = max_error(ref, fused_got), aten_err = max_error(ref, aten_got);
    EXPECT_LE(fused_err, 2 * aten_err) << "graphs " << graphs << ": fused " << fused_err << ", ATen " << aten_err;
    const double other =
        (fused_got[0].first.to(at::kDouble) - full_logits(ref, fused_got[1].second)).abs().max().item<double>();
    EXPECT_GT(other, 10 * aten_err) << "another sequence's logits must be rejected";
  }
  m.set_fused_kernels(true);
}

// The merged pass (DecodeEngine::merged_extend, Transformer::forward_mixed): a pass's one-token rows and its
// tool replies in one graphed forward, in bf16 on the model above. The same passes run as a step then a feed
// give each sequence's logits; both are measured against the float64 full forward, and the merged ones must
// stay within twice the separate ones' error. Every mixed pass must have run merged, and none of the
// separate ones. A known-bad check: another sequence's logits are far outside the tolerance.
TEST(DecodeEngineCuda, AMergedPassGivesTheLogitsOfAStepThenAFeed) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  std::unique_ptr<Transformer> ref_model;
  const Transformer m = bf16_hd64_model(ref_model);
  const Transformer& ref = *ref_model;
  auto run = [&](bool merged, std::vector<std::pair<at::Tensor, std::vector<int64_t>>>& got) {
    EngineOptions po;
    po.switches.feed_graphs = true;
    DecodeEngine engine(m, po);
    std::vector<std::vector<int64_t>> seqs = {{5, 17, 9}, {1, 2, 3, 4, 5, 6}, {250, 8}, {7, 7, 7, 7, 7}, {30, 31}};
    engine.start(seqs, 1);
    for (int64_t t = 0; t < 12; ++t) {
      // Rows t and t + 2 get runs of 2-20 tokens every third pass; two of the others one token each, the
      // fifth waits (holes).
      std::vector<int64_t> rows, one_rows, one_tokens, run_rows;
      std::vector<std::vector<int64_t>> runs, long_runs;
      for (int64_t r : {t % 5, (t + 1) % 5, (t + 2) % 5, (t + 3) % 5}) {
        rows.push_back(r);
        if (t % 3 == 2 && (r == t % 5 || r == (t + 2) % 5)) {
          runs.emplace_back();
          for (int64_t k = 0; k < 2 + (5 * t + r) % 19; ++k) runs.back().push_back(40 + (t * 7 + r + k) % 300);
          run_rows.push_back(r);
          long_runs.push_back(runs.back());
        } else {
          runs.push_back({(r * 31 + t * 13) % 400});
          one_rows.push_back(r);
          one_tokens.push_back(runs.back()[0]);
        }
      }
      std::vector<at::Tensor> logits(rows.size());
      if (merged || run_rows.empty()) {
        at::Tensor out = engine.extend(rows, runs).cpu();
        for (size_t i = 0; i < rows.size(); ++i) logits[i] = out[static_cast<int64_t>(i)];
      } else {
        at::Tensor a = engine.step(one_rows, one_tokens).cpu(), b = engine.extend(run_rows, long_runs).cpu();
        for (size_t i = 0, x = 0, y = 0; i < rows.size(); ++i) {
          logits[i] = runs[i].size() == 1 ? a[static_cast<int64_t>(x++)] : b[static_cast<int64_t>(y++)];
        }
      }
      for (size_t i = 0; i < rows.size(); ++i) {
        seqs[rows[i]].insert(seqs[rows[i]].end(), runs[i].begin(), runs[i].end());
        got.emplace_back(logits[i], seqs[rows[i]]);
      }
    }
    return engine.merged_passes();
  };
  std::vector<std::pair<at::Tensor, std::vector<int64_t>>> merged_got, separate_got;
  EXPECT_EQ(run(true, merged_got), 4) << "every pass with replies and one-token rows runs merged";
  EXPECT_EQ(run(false, separate_got), 0);
  const double merged_err = max_error(ref, merged_got), separate_err = max_error(ref, separate_got);
  EXPECT_LE(merged_err, 2 * separate_err) << "merged " << merged_err << ", step then feed " << separate_err;
  const double other =
      (merged_got[0].first.to(at::kDouble) - full_logits(ref, merged_got[1].second)).abs().max().item<double>();
  EXPECT_GT(other, 10 * separate_err) << "another sequence's logits must be rejected";
}

// Decode steps whose attention reads every row's cache in place (EngineSwitches::cache_attention:
// cuda::cache_attention over all rows) in bf16 on the model above (of each family below), eager at the
// graphs' fixed shape and as replayed graphs. Prompts of 40-230 tokens put the keys in several of the kernel's blocks,
// which it splits between blocks; a row waits every fourth step (holes). Every step's logits are measured against the
// float64 full forward and must stay within twice the error of the same steps through SDPA over the span.
// The in-place kernel must have run in the in-place runs only. Known-bad checks: another sequence's
// logits, and the logits of the sequence one token short (the tolerance tells a sequence from its prefix),
// fail that same tolerance. (At these lengths bf16 rounding alone moves a logit by several units, so the margin of
// the shorter tests, ten times the error, does not hold here.)
class StepsInPlace : public ::testing::TestWithParam<std::string> {};

TEST_P(StepsInPlace, ReadTheCacheAsSdpaDoes) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  std::unique_ptr<Transformer> ref_model;
  const Transformer m = bf16_hd64_model(ref_model, GetParam());
  const Transformer& ref = *ref_model;
  for (bool graphs : {false, true}) {
    using Got = std::vector<std::pair<at::Tensor, std::vector<int64_t>>>;
    auto run = [&](bool in_place, Got& got) {
      EngineOptions po;
      po.switches.cuda_graphs = graphs;
      po.fixed_shape_step = true;
      po.switches.cache_attention = in_place;
      DecodeEngine engine(m, po);
      std::vector<std::vector<int64_t>> seqs;
      for (int64_t n : {230, 40, 151, 97, 64}) {
        seqs.emplace_back();
        for (int64_t j = 0; j < n; ++j) seqs.back().push_back((n * 7 + j * 13) % 399 + 1);
      }
      engine.start(seqs, 1);
      for (int64_t t = 0; t < 10; ++t) {
        std::vector<int64_t> rows, tokens;
        for (int64_t r = 0; r < 5; ++r) {
          if ((r + t) % 4 == 0) continue;  // this row waits: a hole in its slots
          rows.push_back(r);
          tokens.push_back((r * 31 + t * 17) % 400);
        }
        const at::Tensor logits = engine.step(rows, tokens).cpu();
        for (size_t i = 0; i < rows.size(); ++i) {
          seqs[rows[i]].push_back(tokens[i]);
          got.emplace_back(logits[static_cast<int64_t>(i)], seqs[rows[i]]);
        }
      }
    };
    Got in_place_got, sdpa_got;
    const int64_t before = Transformer::in_place_step_count();
    run(true, in_place_got);
    const int64_t ran = Transformer::in_place_step_count() - before;
    // Eager, every step is a forward; graphed, only the captures' forwards run (a warm-up and the capture).
    if (graphs) {
      EXPECT_GE(ran, 2) << "graphed steps missed the kernel";
    } else {
      EXPECT_EQ(ran, 10) << "an eager step missed the kernel";
    }
    run(false, sdpa_got);
    EXPECT_EQ(Transformer::in_place_step_count() - before, ran) << "the SDPA run took the in-place kernel";
    const double in_place_err = max_error(ref, in_place_got), sdpa_err = max_error(ref, sdpa_got);
    EXPECT_LE(in_place_err, 2 * sdpa_err)
        << "graphs " << graphs << ": in place " << in_place_err << ", SDPA " << sdpa_err;
    const auto& [logits, seq] = in_place_got.back();
    const double other = (logits.to(at::kDouble) - full_logits(ref, in_place_got[0].second)).abs().max().item<double>();
    EXPECT_GT(other, 2 * sdpa_err) << "another sequence's logits must be rejected";
    const std::vector<int64_t> short_seq(seq.begin(), seq.end() - 1);
    const double short_by_one = (logits.to(at::kDouble) - full_logits(ref, short_seq)).abs().max().item<double>();
    EXPECT_GT(short_by_one, 2 * sdpa_err) << "the sequence one token short must be rejected";
    std::cout << "graphs " << graphs << ": max |logit error| in place " << in_place_err << ", SDPA " << sdpa_err
              << "; another sequence " << other << ", one token short " << short_by_one << "\n";
  }
}

// qwen2 (q/k/v biases, packed q/k/v), qwen3 (q/k norms: q and k unpacked, normed before RoPE) and llama.
INSTANTIATE_TEST_SUITE_P(CudaFamilies, StepsInPlace, ::testing::Values("qwen2", "qwen3", "llama"),
                         [](const auto& info) { return info.param; });

// Rows fed in turn (one row per step, a two-row feed every third step) leave three holes in four slots:
// each compaction squeezes them out in place, keeping the cache's tensors and shape (and on CUDA the
// captured step graph), and the logits still match each sequence's full forward in float64. A squeeze
// that moved a row's tokens out of order, kept a hole, or left the values or positions behind (gemma2's
// sliding window reads each slot's position) moves them by far more than 1e-9.
class CompactionInPlace : public ::testing::TestWithParam<std::string> {};

TEST_P(CompactionInPlace, KeepsTheCacheAndItsGraphsAndMatchesTheFullForward) {
  const bool cuda = GetParam() == "cuda";
  if (cuda && !at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const Transformer m = tiny_model("gemma2", 5, cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU));
  EngineOptions po;
  po.slot_chunk = 80;
  po.slot_align = 1;  // the cache sizes as slot_chunk sets them
  po.switches.feed_graphs = true;
  po.fixed_shape_extend = true;  // on the CPU too, feeds attend over every slot, as graphed steps do
  DecodeEngine engine(m, po);
  std::vector<std::vector<int64_t>> seqs = {{5, 17, 9}, {1, 2, 3, 4}, {250, 8}, {7, 7, 7, 7, 7}};
  engine.start(seqs, 1);
  const int64_t slots = engine.cache_slots();
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(2);
  for (int64_t t = 0; t < 60; ++t) {
    std::vector<int64_t> rows;
    std::vector<std::vector<int64_t>> runs;
    if (t % 3 == 2) {
      rows = {t % 4, (t + 2) % 4};
      runs = {{1 + t % 50, 2 + t % 50}, {3 + t % 50}};
    } else {
      rows = {t % 4};
      runs = {{at::randint(400, {1}, gen, at::kLong).item<int64_t>()}};
    }
    for (size_t j = 0; j < rows.size(); ++j) seqs[rows[j]].insert(seqs[rows[j]].end(), runs[j].begin(), runs[j].end());
    at::Tensor logits = (rows.size() > 1 ? engine.extend(rows, runs) : engine.step(rows, {runs[0][0]})).cpu();
    for (size_t j = 0; j < rows.size(); ++j) {
      EXPECT_LT((logits[j] - full_logits(m, seqs[rows[j]])).abs().max().item<double>(), 1e-9)
          << "t " << t << " sequence " << rows[j];
    }
  }
  EXPECT_GE(engine.compactions(), 2);
  EXPECT_EQ(engine.reallocations(), 0) << "every compaction here frees about three quarters of the slots";
  EXPECT_EQ(engine.cache_slots(), slots);
  if (cuda) {
    EXPECT_EQ(engine.graph_captures() - engine.feed_graph_captures(), 1) << "one step graph for the whole run";
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, CompactionInPlace, ::testing::Values("cpu", "cuda"),
                         [](const auto& info) { return info.param; });

// Feed graphs are captured per (rows, tokens) bucket, rows to a power of two of at least 8: on a cache of 40
// rows, feeds of 1, 5 and 8 rows (runs of 2 to 16 tokens) replay one graph, a feed of 16 rows takes a second
// and one of 17 rows a third. Each feed's logits match the sequences' full forwards in float64, so the padding
// rows (up to 7 idle rows a feed) write only holes. Buckets that start at one row would capture a graph for
// 1, 5 and 8 rows each (3 captures, not 1), which the checks reject.
TEST(DecodeEngineCuda, FeedsOfUpToEightRowsShareOneGraph) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const Transformer m = tiny_model("qwen2", 13, at::Device(at::kCUDA, 0));
  EngineOptions po;
  po.slot_chunk = 256;  // room for every feed: no reallocation, so the graphs stay
  po.slot_align = 1;    // the cache sizes as slot_chunk sets them
  po.switches.feed_graphs = true;
  DecodeEngine engine(m, po);
  std::vector<std::vector<int64_t>> seqs;
  for (int64_t n = 0; n < 40; ++n) seqs.push_back({1 + n, 2 + n % 7, 3, 4 + n % 3});
  engine.start(seqs, 1);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(3);
  auto feed = [&](int64_t first, int64_t count) {
    std::vector<int64_t> rows;
    std::vector<std::vector<int64_t>> runs;
    for (int64_t j = 0; j < count; ++j) {
      const int64_t n = (first + 3 * j) % 40;
      rows.push_back(n);
      runs.emplace_back();
      for (int64_t t = 0; t < 2 + (n + j) % 15; ++t)
        runs.back().push_back(at::randint(400, {1}, gen, at::kLong).item<int64_t>());
      seqs[n].insert(seqs[n].end(), runs.back().begin(), runs.back().end());
    }
    at::Tensor logits = engine.extend(rows, runs).cpu();
    for (int64_t j = 0; j < count; ++j) {
      EXPECT_LT((logits[j] - full_logits(m, seqs[rows[j]])).abs().max().item<double>(), 1e-9)
          << "feed of " << count << " rows, sequence " << rows[j];
    }
  };
  feed(0, 1);
  feed(1, 5);
  feed(2, 8);
  EXPECT_EQ(engine.feed_graph_captures(), 1) << "feeds of 1, 5 and 8 rows share the 8-row bucket";
  feed(3, 16);
  EXPECT_EQ(engine.feed_graph_captures(), 2) << "16 rows take the 16-row bucket";
  feed(0, 17);
  EXPECT_EQ(engine.feed_graph_captures(), 3) << "17 rows take the 32-row bucket";
  EXPECT_EQ(engine.reallocations(), 0);
}

// A step at the graphs' fixed shape attends over the slots in use rounded up to span_chunk (here 4, in a
// cache of 44 slots), not over every slot: one step graph per span on CUDA (and no other capture, as the
// cache is never reallocated), and the logits match each sequence's full forward in float64 on both
// devices, idle rows leaving holes. A span one slot short (the slot the step writes left out) moves them
// by far more: this test fails on the CPU with it.
class StepSpans : public ::testing::TestWithParam<std::string> {};

TEST_P(StepSpans, AStepReadsOnlyTheSlotsInUse) {
  const bool cuda = GetParam() == "cuda";
  if (cuda && !at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const Transformer m = tiny_model("qwen3", 23, cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU));
  EngineOptions po;
  po.slot_chunk = 40;
  po.slot_align = 1;  // the cache sizes as slot_chunk sets them
  po.span_chunk = 4;
  po.fixed_shape_step = true;
  po.squeeze_holes = false;  // the spans as the holes leave them (HolesAreSqueezedOnceTheyCostAChunk: squeezed)
  DecodeEngine engine(m, po);
  std::vector<std::vector<int64_t>> seqs = {{5, 17, 9, 4}, {1, 2}, {250, 8, 60}};
  engine.start(seqs, 1);
  std::set<int64_t> spans;
  for (int64_t t = 0; t < 30; ++t) {
    spans.insert(std::min(engine.cache_slots(), (engine.cache_length() + 1 + 3) / 4 * 4));
    std::vector<int64_t> rows, tokens;
    for (int64_t n = 0; n < 3; ++n) {
      if ((n + t) % 4 == 3) continue;
      rows.push_back(n);
      tokens.push_back(20 + 3 * n + t);
      seqs[n].push_back(tokens.back());
    }
    at::Tensor logits = engine.step(rows, tokens).cpu();
    for (size_t j = 0; j < rows.size(); ++j) {
      EXPECT_LT((logits[j] - full_logits(m, seqs[rows[j]])).abs().max().item<double>(), 1e-9)
          << "step " << t << " sequence " << rows[j];
    }
  }
  EXPECT_EQ(engine.cache_slots(), 44);
  EXPECT_EQ(engine.reallocations(), 0);
  EXPECT_GE(spans.size(), 7u);
  EXPECT_EQ(engine.graph_captures(), cuda ? int64_t(spans.size()) : 0) << "one step graph per span";
#ifdef RLT_HAVE_CUDA
  if (cuda) {
    // Every replay is timed on the device, under its span; read while the last one may still run (queued
    // behind a sleep): the accessor waits for it instead of throwing.
    at::cuda::sleep(20'000'000);
    engine.step({0, 1, 2}, {1, 2, 3});
    const auto& times = engine.step_replay_times();
    int64_t steps = 0;
    std::set<int64_t> timed;
    for (const auto& [span, t] : times) {
      steps += t.count;
      timed.insert(span);
      EXPECT_GT(t.seconds, 0.0) << "span " << span;
    }
    EXPECT_EQ(steps, 31) << "every step replayed a graph (the captures' runs are not replays)";
    spans.insert(std::min(engine.cache_slots(), (engine.cache_length() + 3) / 4 * 4));
    EXPECT_EQ(timed, spans);
  }
#endif
}

// squeeze_holes: feeds of uneven runs and rows idle through steps leave holes; a step squeezes them out in
// place once they cost its span a chunk (here 8), so every step's span stays within a chunk of the longest
// row's, while the logits keep matching each sequence's full forward in float64 and nothing is reallocated
// (on CUDA: one graph per span, spans revisited after a squeeze replay theirs). Without the squeeze (the
// control run) the span outgrows the rows by several chunks, which the same check rejects.
TEST_P(StepSpans, HolesAreSqueezedOnceTheyCostAChunk) {
  const bool cuda = GetParam() == "cuda";
  if (cuda && !at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const Transformer m = tiny_model("qwen2", 29, cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU));
  for (bool squeeze : {true, false}) {
    EngineOptions po;
    po.slot_chunk = 160;
    po.slot_align = 1;  // the cache sizes as slot_chunk sets them
    po.span_chunk = 8;
    po.fixed_shape_step = true;
    po.squeeze_holes = squeeze;
    DecodeEngine engine(m, po);
    std::vector<std::vector<int64_t>> seqs = {{5, 17, 9, 4}, {1, 2}, {250, 8, 60}, {7}};
    engine.start(seqs, 1);
    std::set<int64_t> spans;
    int64_t worst_excess = 0;  // the most slots a step's span had beyond the longest row's span
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
    for (int64_t t = 0; t < 40; ++t) {
      int64_t held = 0;
      for (const auto& q : seqs) held = std::max<int64_t>(held, q.size());
      if (t % 5 == 4) {  // a feed of two rows' runs of 3 and 7 tokens: 7 slots for every row
        std::vector<int64_t> rows = {t % 4, (t + 2) % 4};
        std::vector<std::vector<int64_t>> runs(2);
        for (int64_t j = 0; j < 2; ++j) {
          for (int64_t k = 0; k < 3 + 4 * j; ++k)
            runs[j].push_back(at::randint(400, {1}, gen, at::kLong).item<int64_t>());
          seqs[rows[j]].insert(seqs[rows[j]].end(), runs[j].begin(), runs[j].end());
        }
        at::Tensor logits = engine.extend(rows, runs).cpu();
        for (int64_t j = 0; j < 2; ++j) {
          EXPECT_LT((logits[j] - full_logits(m, seqs[rows[j]])).abs().max().item<double>(), 1e-9)
              << "feed at " << t << " sequence " << rows[j];
        }
        continue;
      }
      std::vector<int64_t> rows, tokens;
      for (int64_t n = 0; n < 4; ++n) {
        if ((n + t) % 3 == 0) continue;  // idle: a hole
        rows.push_back(n);
        tokens.push_back(30 + 5 * n + t);
        seqs[n].push_back(tokens.back());
      }
      const int64_t before = engine.step_span_slots();
      at::Tensor logits = engine.step(rows, tokens).cpu();
      const int64_t span = engine.step_span_slots() - before;
      spans.insert(span);
      worst_excess = std::max(worst_excess, span - (held + 1 + 7) / 8 * 8);
      for (size_t j = 0; j < rows.size(); ++j) {
        EXPECT_LT((logits[j] - full_logits(m, seqs[rows[j]])).abs().max().item<double>(), 1e-9)
            << "step " << t << " sequence " << rows[j] << (squeeze ? "" : " (no squeeze)");
      }
    }
    EXPECT_EQ(engine.reallocations(), 0);
    if (squeeze) {
      EXPECT_LT(worst_excess, 8) << "a step read a chunk or more of holes";
      EXPECT_GE(engine.compactions(), 2);
      EXPECT_EQ(engine.graph_captures() - engine.feed_graph_captures(), cuda ? int64_t(spans.size()) : 0);
    } else {
      EXPECT_GE(worst_excess, 24) << "the control run: the holes should have grown the span by chunks";
      EXPECT_EQ(engine.compactions(), 0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, StepSpans, ::testing::Values("cpu", "cuda"),
                         [](const auto& info) { return info.param; });

// A fixed-shape feed's tokens go to a multiple of 8 of at least 16 up to 64 slots, then to a power of two: runs
// of 3, 17, 40 and 65 tokens take 16, 24, 40 and 128 slots of the cache (powers of two from 16 would take 32
// for 17 and 64 for 40, which the checks reject), and the logits match each sequence's full forward (float64).
TEST(StepSpans, FeedTokenBucketsAreMultiplesOfEightUpTo64) {
  const Transformer m = tiny_model("qwen2", 31, at::Device(at::kCPU));
  EngineOptions po;
  po.slot_chunk = 300;
  po.slot_align = 1;
  po.fixed_shape_extend = true;
  DecodeEngine engine(m, po);
  std::vector<std::vector<int64_t>> seqs = {{5, 17, 9}, {1, 2, 3}};
  engine.start(seqs, 1);
  for (const auto& [K, slots] : std::vector<std::pair<int64_t, int64_t>>{{3, 16}, {17, 24}, {40, 40}, {65, 128}}) {
    std::vector<std::vector<int64_t>> runs = {{}, {7, 8}};
    for (int64_t i = 0; i < K; ++i) runs[0].push_back(30 + (7 * i + K) % 300);
    for (int64_t n = 0; n < 2; ++n) seqs[n].insert(seqs[n].end(), runs[n].begin(), runs[n].end());
    const int64_t before = engine.cache_length();
    at::Tensor logits = engine.extend({0, 1}, runs);
    EXPECT_EQ(engine.cache_length() - before, slots) << "a run of " << K << " tokens";
    for (int64_t n = 0; n < 2; ++n)
      EXPECT_LT((logits[n] - full_logits(m, seqs[n])).abs().max().item<double>(), 1e-9) << "run of " << K;
  }
  EXPECT_EQ(engine.reallocations(), 0);
}

// A feed at the graphs' fixed shape attends over the slots filled and its own, rounded up to span_chunk (here 8, in
// a cache of 4 + 120 slots), not over every slot, and its logits match each sequence's full forward in float64.
// On CUDA it replays one feed graph per (bucket, span). A span that leaves out the feed's own slots (span_of(L))
// moves the logits by far more: this test fails on the CPU with it.
TEST_P(StepSpans, AFeedReadsOnlyTheSlotsInUse) {
  const bool cuda = GetParam() == "cuda";
  if (cuda && !at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const Transformer m = tiny_model("qwen3", 29, cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU));
  EngineOptions po;
  po.slot_chunk = 120;
  po.slot_align = 1;
  po.span_chunk = 8;
  po.fixed_shape_step = true;
  po.fixed_shape_extend = true;
  po.switches.feed_graphs = true;
  po.squeeze_holes = false;
  DecodeEngine engine(m, po);
  std::vector<std::vector<int64_t>> seqs = {{5, 17, 9, 4}, {1, 2}, {250, 8, 60}};
  engine.start(seqs, 1);
  std::set<int64_t> spans;
  for (int64_t t = 0; t < 7; ++t) {
    spans.insert(std::min(engine.cache_slots(), (engine.cache_length() + 16 + 7) / 8 * 8));  // runs of <= 16
    const std::vector<int64_t> rows = {t % 3, (t + 1) % 3};
    std::vector<std::vector<int64_t>> runs = {{}, {30 + t, 31 + t}};
    for (int64_t i = 0; i < 3 + t; ++i) runs[0].push_back(40 + 5 * i + t);
    for (size_t j = 0; j < rows.size(); ++j) seqs[rows[j]].insert(seqs[rows[j]].end(), runs[j].begin(), runs[j].end());
    at::Tensor logits = engine.extend(rows, runs).cpu();
    for (size_t j = 0; j < rows.size(); ++j) {
      EXPECT_LT((logits[j] - full_logits(m, seqs[rows[j]])).abs().max().item<double>(), 1e-9)
          << "feed " << t << " sequence " << rows[j];
    }
  }
  EXPECT_EQ(engine.reallocations(), 0);
  EXPECT_EQ(spans.size(), 7u) << "each feed reads 16 slots more than the one before";
  EXPECT_LT(*spans.rbegin(), engine.cache_slots()) << "no feed read every slot of the cache";
  EXPECT_EQ(engine.feed_span_slots(), std::accumulate(spans.begin(), spans.end(), int64_t(0)))
      << "the feeds attended over these spans (over every slot: " << 7 * engine.cache_slots() << ")";
  EXPECT_EQ(engine.feed_graph_captures(), cuda ? int64_t(spans.size()) : 0) << "one feed graph per span";
  if (cuda) {
    EXPECT_EQ(engine.feed_replay_time().count, 7) << "each feed's replay timed on the device";
  }
}

// A new cache's slots are a multiple of slot_align (64 by default), at start() and after a growth, so a span
// that ends at the cache's last slot is never of odd length (an odd span slows the graphed step's masked
// attention: EngineOptions::slot_align). The steps' logits stay each sequence's full forward (float64). Control:
// with slot_align 1 the same calls make caches of 3 + 5, then 14, 20, ... slots, which the checks reject.
TEST(StepSpans, ANewCacheHoldsAMultipleOfSlotAlignSlots) {
  const Transformer m = tiny_model("qwen3", 23, at::Device(at::kCPU));
  for (const int64_t align : {int64_t(64), int64_t(1)}) {
    EngineOptions po;
    po.slot_chunk = 5;
    po.slot_align = align;
    DecodeEngine engine(m, po);
    std::vector<std::vector<int64_t>> seqs = {{5, 17, 9}, {1, 2}};
    engine.start(seqs, 1);
    std::vector<int64_t> sizes = {engine.cache_slots()};
    for (int64_t t = 0; t < 66; ++t) {  // 3 + 66 tokens: past the first cache's 64 slots
      std::vector<int64_t> rows = {0, 1}, tokens = {20 + t, 40 + t};
      seqs[0].push_back(tokens[0]);
      seqs[1].push_back(tokens[1]);
      at::Tensor logits = engine.step(rows, tokens);
      if (sizes.back() != engine.cache_slots()) sizes.push_back(engine.cache_slots());
      if (t % 13 == 0 || t == 65) {
        for (int64_t n = 0; n < 2; ++n)
          EXPECT_LT((logits[n] - full_logits(m, seqs[n])).abs().max().item<double>(), 1e-9) << "step " << t;
      }
    }
    if (align == 64) {
      EXPECT_EQ(sizes, (std::vector<int64_t>{64, 128})) << "a cache of 3 + 5 slots, then a growth, each aligned";
    } else {
      EXPECT_EQ(sizes.front(), 8)
          << "the control: slot_align 1 leaves the cache at 3 + 5 slots, then grows it to 14, 20, ...";
      for (int64_t s : sizes) EXPECT_NE(s % 64, 0) << "the control's caches are not aligned by chance";
    }
  }
}

// keep_cache: later rollouts (start()) on the same engine, after the weights were updated in place as the
// optimizer does, reuse the cache's tensors (no reallocation) and on CUDA its captured graphs (the third
// rollout, with the second's shapes, captures none), and their logits are a fresh engine's on the new weights: float64
// on the CPU (1e-12: the same arithmetic over more, masked slots), float32 on CUDA through the fused kernels and the
// packed q/k/v and gate/up weights, packed again in place (1e-5 of the largest logit, as
// FusedDecodeKernelsMatchTheAtenForms). Known-bad: the same rollout on the old weights (what a graph reading stale
// packed weights would give) is far outside that tolerance. (The last rollout's keys stay hidden through admit(), which
// clears each row it fills; AdmitIntoReleasedRows tests that path. The repack itself: PackWeightsIntoWritesInPlace.)
class KeepCache : public ::testing::TestWithParam<std::string> {};

TEST_P(KeepCache, ASecondRolloutReusesTheCacheAndMatchesAFreshPolicy) {
  const bool cuda = GetParam() == "cuda";
  if (cuda && !at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  Transformer m =
      tiny_model("qwen2", 17, cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU), cuda ? at::kFloat : at::kDouble);
  EngineOptions po;
  po.slot_chunk = 8;  // the first rollout grows the cache; the second fits in it
  po.slot_align = 1;  // the cache sizes as slot_chunk sets them
  po.switches.feed_graphs = true;
  po.switches.keep_cache = true;
  // A rollout: two samples of each prompt, 12 passes of one-token steps over the rows not idle, every
  // fourth pass a three-token feed of rows 0 and 2 instead. Returns every logit it got, in order.
  auto roll = [&](DecodeEngine& p, const std::vector<std::vector<int64_t>>& prompts) {
    std::vector<at::Tensor> out{p.start(prompts, 2).cpu()};
    for (int64_t t = 0; t < 12; ++t) {
      if (t % 4 == 3) {
        out.push_back(p.extend({0, 2}, {{3 + t, 4, 5}, {6, 7 + t, 8}}).cpu());
        continue;
      }
      std::vector<int64_t> rows, tokens;
      for (int64_t n = 0; n < 2 * int64_t(prompts.size()); ++n) {
        if ((n + t) % 5 == 4) continue;
        rows.push_back(n);
        tokens.push_back(10 + 7 * n + t);
      }
      out.push_back(p.step(rows, tokens).cpu());
    }
    return at::cat(out).to(at::kDouble);
  };
  DecodeEngine kept(m, po);
  roll(kept, {{5, 17, 9, 4}, {1, 2, 3}, {250, 8, 60, 61}});
  const int64_t slots = kept.cache_slots(), reallocations = kept.reallocations();
  EXPECT_GT(reallocations, 0) << "the first rollout grows its cache";
  const std::vector<std::vector<int64_t>> next = {{7, 7, 7}, {30, 31, 32, 33}, {99}};
  // The rollout after it may capture a graph the last cache never met (a feed after its last growth); the
  // one after that meets only shapes met before.
  roll(kept, next);
  const int64_t captures = kept.graph_captures();
  EngineOptions fresh_po = po;
  fresh_po.switches.keep_cache = false;
  const at::Tensor stale = [&] {
    DecodeEngine fresh(m, fresh_po);
    return roll(fresh, next);
  }();
  {
    at::NoGradGuard no_grad;
    for (auto& p : m.parameters()) p.mul_(1.01).add_(0.001);  // in place, as AdamW and the master copy do
  }
  const at::Tensor second = roll(kept, next);
  EXPECT_EQ(kept.cache_slots(), slots);
  EXPECT_EQ(kept.reallocations(), reallocations) << "the later rollouts run in the first one's cache";
  if (cuda) {
    EXPECT_EQ(kept.graph_captures(), captures) << "and replay its graphs";
  }
  DecodeEngine fresh(m, fresh_po);
  const at::Tensor ref = roll(fresh, next);
  const double tol = cuda ? 1e-5 * ref.abs().max().item<double>() : 1e-12;
  EXPECT_LT((second - ref).abs().max().item<double>(), tol);
  EXPECT_GT((stale - ref).abs().max().item<double>(), 100 * tol) << "the old weights must be told apart";
}

INSTANTIATE_TEST_SUITE_P(Devices, KeepCache, ::testing::Values("cpu", "cuda"),
                         [](const auto& info) { return info.param; });

// Transformer::pack_weights_into rewrites packed weights in their own tensors (a captured graph reads them
// there) with the parameters as they are now: equal to a new pack_weights(), bit for bit, where the packed
// weights before it are not.
TEST(KeepCache, PackWeightsIntoWritesInPlace) {
  for (const char* family : {"qwen2", "llama"}) {  // q/k/v biases, none
    Transformer m = tiny_model(family, 19);
    PackedWeights p = m.pack_weights();
    const void* qkv = p.qkv_w[1].data_ptr();
    const void* gate_up = p.gate_up_w[1].data_ptr();
    {
      at::NoGradGuard no_grad;
      for (auto& w : m.parameters()) w.add_(0.5);
    }
    const PackedWeights now = m.pack_weights();
    EXPECT_FALSE(at::equal(p.qkv_w[1], now.qkv_w[1])) << family;
    m.pack_weights_into(p);
    EXPECT_EQ(p.qkv_w[1].data_ptr(), qkv) << family;
    EXPECT_EQ(p.gate_up_w[1].data_ptr(), gate_up) << family;
    for (size_t i = 0; i < now.gate_up_w.size(); ++i) {
      EXPECT_TRUE(at::equal(p.qkv_w[i], now.qkv_w[i])) << family << " layer " << i;
      EXPECT_TRUE(at::equal(p.gate_up_w[i], now.gate_up_w[i])) << family << " layer " << i;
      EXPECT_EQ(p.qkv_b[i].defined(), now.qkv_b[i].defined());
      if (now.qkv_b[i].defined()) {
        EXPECT_TRUE(at::equal(p.qkv_b[i], now.qkv_b[i])) << family << " layer " << i;
      }
    }
  }
}

// A step or a feed that is refused (a sequence listed twice) leaves every sequence's positions as they
// were: the next step still matches the full forward. A engine that advanced a sequence's position before
// checking the rest of the list would give the sequence listed first a position one (or a run) too far.
TEST(DecodeEngine, ARefusedStepOrFeedLeavesThePositionsAsTheyWere) {
  for (bool fixed : {false, true}) {
    const Transformer m = tiny_model("llama", 3);
    EngineOptions po;
    po.fixed_shape_extend = fixed;
    DecodeEngine engine(m, po);
    std::vector<std::vector<int64_t>> seqs = {{5, 17, 9}, {1, 2, 3, 4}};
    engine.start(seqs, 1);
    EXPECT_THROW(engine.step({0, 0}, {7, 8}), c10::Error);
    EXPECT_THROW(engine.extend({1, 0, 1}, {{3, 4}, {5}, {6, 7}}), c10::Error);
    at::Tensor logits = engine.extend({0, 1}, {{7, 8}, {9}}).cpu();
    seqs[0].insert(seqs[0].end(), {7, 8});
    seqs[1].push_back(9);
    for (int64_t n = 0; n < 2; ++n) {
      EXPECT_LT((logits[n] - full_logits(m, seqs[n])).abs().max().item<double>(), 1e-9)
          << (fixed ? "fixed-shape" : "exact") << " feed, sequence " << n;
    }
  }
}

// Last-position logits of one sequence at the given RoPE positions, from a full forward: a known-bad
// reference (positions that do not count from 0 by one). Returned on the CPU.
at::Tensor positioned_logits(const Transformer& m, const std::vector<int64_t>& ids, const std::vector<int64_t>& pos) {
  at::NoGradGuard no_grad;
  const int64_t L = static_cast<int64_t>(ids.size());
  const auto dev = m.lm_head().device();
  at::Tensor h = m.forward(at::tensor(ids, at::kLong).view({1, L}).to(dev),
                           at::tensor(pos, at::kLong).view({1, L}).to(dev), at::Tensor());
  return m.logits(h.select(1, L - 1))[0].cpu();
}

// admit() puts new prompts into the rows that released sequences left, in the cache's own tensors (rows,
// slots and, on CUDA, the captured step graph stay), and each sequence's logits still match its full
// forward in float64, through decode steps and multi-token feeds after it; the first admitted pair also
// matches a fresh engine started on its prompt alone and fed the same tokens (1e-12: the same arithmetic
// over more, masked slots). The other placements: more new sequences than free rows (a new cache of the
// live rows and the new ones), a prompt longer than the slots filled so far (placed in place, the fill
// moves to its end), and one longer than the cache (a new, longer cache). A new row that still saw the
// released sequence's keys, or whose RoPE positions went on from its slots rather than its prompt, moves
// the logits by far more than the tolerance (the known-bad checks at the end; DecodeEngine::admit broken
// either way fails this test).
class AdmitIntoReleasedRows : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(AdmitIntoReleasedRows, MatchesAFreshStartAndTheFullForward) {
  const auto& [family, device] = GetParam();
  const bool cuda = device == "cuda";
  if (cuda && !at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const Transformer m = tiny_model(family, 11, cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU));
  EngineOptions po;
  po.slot_chunk = 24;
  po.slot_align = 1;  // the cache sizes as slot_chunk sets them
  po.fixed_shape_extend = device == "cpu_fixed";
  po.switches.feed_graphs = true;
  DecodeEngine engine(m, po), fresh(m, po);
  // float64: the cached, masked forward against the plain one (as in DecodeEngineTest), and the same
  // sequence decoded in a refilled row against a fresh engine (only the masked slots differ).
  const double kTol = 1e-9, kSame = 1e-12;
  std::vector<std::vector<int64_t>> seqs;  // by sequence id: its tokens so far
  std::vector<bool> live;
  std::map<int64_t, int64_t> in_fresh;  // sequence id -> its id in `fresh`
  auto admit = [&](const std::vector<std::vector<int64_t>>& prompts, int64_t G, bool start = false) {
    const int64_t base = static_cast<int64_t>(seqs.size());
    at::Tensor first = (start ? engine.start(prompts, G) : engine.admit(prompts, G)).cpu();
    EXPECT_EQ(first.size(0), int64_t(prompts.size()) * G);
    for (size_t u = 0; u < prompts.size(); ++u) {
      for (int64_t g = 0; g < G; ++g) {
        seqs.push_back(prompts[u]);
        live.push_back(true);
      }
    }
    for (int64_t n = base; n < int64_t(seqs.size()); ++n) {
      EXPECT_LT((first[n - base] - full_logits(m, seqs[n])).abs().max().item<double>(), kTol)
          << "first logits of sequence " << n;
    }
    return first;
  };
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
  // Passes over the live sequences, idle ones leaving holes; every third pass feeds runs of 1 to 3 tokens
  // in one forward. Each sequence's logits against its full forward, and the mirrored ones against `fresh`.
  auto decode = [&](int64_t passes) {
    for (int64_t t = 0; t < passes; ++t) {
      const bool runs_step = t % 3 == 2;
      std::vector<int64_t> rows, frows, fj;
      std::vector<std::vector<int64_t>> runs, fruns;
      for (int64_t n = 0; n < int64_t(seqs.size()); ++n) {
        if (!live[n] || (t + n) % 4 == 3) continue;
        const int64_t k = runs_step ? 1 + (n + t) % 3 : 1;
        runs.emplace_back();
        for (int64_t i = 0; i < k; ++i) runs.back().push_back(at::randint(400, {1}, gen, at::kLong).item<int64_t>());
        seqs[n].insert(seqs[n].end(), runs.back().begin(), runs.back().end());
        if (in_fresh.count(n)) {
          frows.push_back(in_fresh[n]);
          fruns.push_back(runs.back());
          fj.push_back(static_cast<int64_t>(rows.size()));
        }
        rows.push_back(n);
      }
      if (rows.empty()) continue;
      const at::Tensor logits = engine.extend(rows, runs).cpu();  // one token each: a decode step
      for (size_t j = 0; j < rows.size(); ++j) {
        EXPECT_LT((logits[j] - full_logits(m, seqs[rows[j]])).abs().max().item<double>(), kTol)
            << "pass " << t << " sequence " << rows[j];
      }
      if (frows.empty()) continue;
      const at::Tensor alone = fresh.extend(frows, fruns).cpu();
      for (size_t j = 0; j < frows.size(); ++j) {
        EXPECT_LT((alone[j] - logits[fj[j]]).abs().max().item<double>(), kSame)
            << "pass " << t << " sequence " << rows[fj[j]] << " against a fresh start";
      }
    }
  };
  auto release = [&](const std::vector<int64_t>& ids) {
    engine.release(ids);
    for (int64_t n : ids) live[n] = false;
  };
  admit({{5, 17, 9}, {1, 2, 3, 4, 5, 6, 7}, {250, 8, 60}}, 2, /*start=*/true);  // sequences 0..5
  decode(7);
  // Two rows released, two sequences admitted: in place.
  release({1, 2});
  const int64_t rows0 = engine.cache_rows(), slots0 = engine.cache_slots(), reallocs0 = engine.reallocations();
  const int64_t length_at_admit = engine.cache_length();
  const std::vector<int64_t> prompt = {11, 12, 13, 14};
  const at::Tensor first = admit({prompt}, 2);  // sequences 6, 7
  const at::Tensor alone = fresh.start({prompt}, 2).cpu();
  EXPECT_LT((first - alone).abs().max().item<double>(), kSame) << "admitted against a fresh start";
  in_fresh = {{6, 0}, {7, 1}};
  EXPECT_EQ(engine.cache_rows(), rows0) << "the released rows were refilled";
  EXPECT_EQ(engine.cache_slots(), slots0);
  EXPECT_EQ(engine.reallocations(), reallocs0) << "admitted in place";
  EXPECT_GT(length_at_admit, int64_t(prompt.size())) << "the new rows hold holes after their prompt";
  const int64_t step_graphs = engine.graph_captures() - engine.feed_graph_captures();
  decode(1);  // a one-token pass: on CUDA the step graph captured before the admit is replayed
  if (cuda && engine.reallocations() == reallocs0) {
    EXPECT_EQ(engine.graph_captures() - engine.feed_graph_captures(), step_graphs) << "admit kept the step graph";
  }
  decode(8);
  const std::vector<int64_t> stale = seqs[1], admitted = seqs[6];
  // Four new sequences, two free rows: a new cache of the four live rows and four new ones.
  release({0, 6});
  in_fresh.clear();
  const int64_t reallocs1 = engine.reallocations();
  admit({{21, 22}, {23, 24, 25, 26, 27}}, 2);  // sequences 8..11
  EXPECT_EQ(engine.reallocations(), reallocs1 + 1);
  EXPECT_EQ(engine.cache_rows(), 8);
  // A prompt longer than the slots filled so far, one free row: in place, the fill moves to its end.
  release({3});
  const int64_t L = engine.cache_length(), reallocs2 = engine.reallocations();
  std::vector<int64_t> longer(L + 5);
  for (int64_t i = 0; i < L + 5; ++i) longer[i] = 30 + i % 200;
  ASSERT_LE(L + 5, engine.cache_slots());
  admit({longer}, 1);  // sequence 12
  EXPECT_EQ(engine.cache_length(), L + 5);
  EXPECT_EQ(engine.reallocations(), reallocs2);
  EXPECT_EQ(engine.cache_rows(), 8);
  decode(5);
  // A prompt longer than the cache: a new, longer one.
  release({4});
  const int64_t too_long = engine.cache_slots() + 5, reallocs3 = engine.reallocations();
  std::vector<int64_t> longest(too_long);
  for (int64_t i = 0; i < too_long; ++i) longest[i] = 7 + i % 300;
  admit({longest}, 1);  // sequence 13
  EXPECT_EQ(engine.reallocations(), reallocs3 + 1);
  EXPECT_GE(engine.cache_slots(), too_long);
  decode(5);
  // Known-bad: the admitted sequence's logits with the released sequence's tokens visible before it, and
  // with positions that go on from the slot the admit saw filled, are far from the right ones.
  std::vector<int64_t> with_stale = stale;
  with_stale.insert(with_stale.end(), admitted.begin(), admitted.end());
  std::vector<int64_t> slot_pos(admitted.size());
  for (size_t i = 0; i < admitted.size(); ++i) {
    slot_pos[i] = i < prompt.size() ? int64_t(i) : length_at_admit + int64_t(i - prompt.size());
  }
  const at::Tensor right = full_logits(m, admitted);
  EXPECT_GT((full_logits(m, with_stale) - right).abs().max().item<double>(), 100 * kTol);
  EXPECT_GT((positioned_logits(m, admitted, slot_pos) - right).abs().max().item<double>(), 100 * kTol);
}

INSTANTIATE_TEST_SUITE_P(Families, AdmitIntoReleasedRows,
                         ::testing::Combine(::testing::Values("llama", "qwen3", "gemma2"),
                                            ::testing::Values("cpu", "cpu_fixed", "cuda")),
                         [](const auto& info) { return std::get<0>(info.param) + "_" + std::get<1>(info.param); });

// DecodeEngine::reserve_rows: with admits to come, a growing reallocation keeps released rows as free rows,
// so the next admit goes in place (no new cache, no recapture). Without the hint the growth drops the
// released row and the admit must reallocate: the check fails there. Every logit against the sequence's
// full forward (float64).
class ReservedRows : public ::testing::TestWithParam<std::string> {};

TEST_P(ReservedRows, OutliveAGrowthSoThatTheNextAdmitStaysInPlace) {
  const bool cuda = GetParam() == "cuda";
  if (cuda && !at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const Transformer m = tiny_model("llama", 13, cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU));
  for (bool reserve : {true, false}) {
    SCOPED_TRACE(reserve ? "reserve_rows(4)" : "no reserve");
    EngineOptions po;
    po.slot_chunk = 4;
    po.slot_align = 1;  // the cache sizes as slot_chunk sets them
    DecodeEngine engine(m, po);
    if (reserve) engine.reserve_rows(4);
    std::vector<std::vector<int64_t>> seqs = {{5, 17, 9}, {5, 17, 9}, {1, 2, 3, 4}, {1, 2, 3, 4}};
    engine.start({seqs[0], seqs[2]}, 2);
    engine.release({1});
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(3);
    auto step = [&](const std::vector<int64_t>& rows) {
      std::vector<int64_t> tokens;
      for (int64_t n : rows) {
        tokens.push_back(at::randint(400, {1}, gen, at::kLong).item<int64_t>());
        seqs[n].push_back(tokens.back());
      }
      const at::Tensor logits = engine.step(rows, tokens).cpu();
      for (size_t j = 0; j < rows.size(); ++j) {
        EXPECT_LT((logits[j] - full_logits(m, seqs[rows[j]])).abs().max().item<double>(), 1e-9)
            << "sequence " << rows[j];
      }
    };
    const int64_t before = engine.reallocations();
    for (int t = 0; t < 40 && engine.reallocations() == before; ++t) step({0, 2, 3});
    ASSERT_GT(engine.reallocations(), before) << "the cache never grew";
    EXPECT_EQ(engine.cache_rows(), reserve ? 4 : 3);
    const int64_t grown = engine.reallocations(), captures = engine.graph_captures();
    seqs.push_back({7, 8, 9, 10, 11});
    const at::Tensor first = engine.admit({seqs[4]}, 1).cpu();
    EXPECT_LT((first[0] - full_logits(m, seqs[4])).abs().max().item<double>(), 1e-9);
    EXPECT_EQ(engine.reallocations(), reserve ? grown : grown + 1) << "the admit made a new cache";
    EXPECT_EQ(engine.cache_rows(), 4);
    for (int t = 0; t < 3; ++t) step({0, 2, 3, 4});
    if (cuda) {
      EXPECT_EQ(engine.graph_captures(), reserve ? captures : captures + 1) << "the admit cost a recapture";
    }
  }
  if (!cuda) {
    // Without graphs, released rows are dropped once they are half the cache, but not while reserved:
    // else every step would drop them and remake as many free rows.
    EngineOptions po;
    po.slot_chunk = 64;  // no growth here
    po.slot_align = 1;   // the cache sizes as slot_chunk sets them
    DecodeEngine engine(m, po);
    engine.reserve_rows(4);
    engine.start({{5, 17, 9}, {1, 2, 3, 4}}, 2);
    engine.release({1, 3});
    for (int t = 0; t < 3; ++t) engine.step({0, 2}, {7, 8});
    EXPECT_EQ(engine.reallocations(), 0);
    EXPECT_EQ(engine.cache_rows(), 4);
    engine.reserve_rows(0);
    engine.step({0, 2}, {7, 8});
    EXPECT_EQ(engine.reallocations(), 1);
    EXPECT_EQ(engine.cache_rows(), 2);
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, ReservedRows, ::testing::Values("cpu", "cuda"),
                         [](const auto& info) { return info.param; });

// EngineSwitches::dependent_launch: a rollout whose captured graphs join the fused kernels by programmatic
// edges draws the ids, with the log-probs, and feeds the logits of one whose graphs have plain edges, bit for
// bit: a bf16 model at a head size the in-place attention takes, so that every fused kernel of a step runs
// (the norms, RoPE with the cache write, the attention and its split combine, the SiLU gate, the draw), with
// a feed graph every third step. The switch reaches the kernels: launches with the attribute are counted
// while the first run captures, and none while the second does.
TEST(DecodeEngineCuda, DependentLaunchDrawsWhatPlainLaunchesDraw) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  std::unique_ptr<Transformer> ref_model;
  const Transformer m = bf16_hd64_model(ref_model);
  SamplingOptions so;
  so.seed = 3;
  auto run = [&](bool on, int64_t& launched) {
    EngineOptions po;
    po.switches.dependent_launch = on;
    po.switches.feed_graphs = true;
    const int64_t before = cuda::dependent_launch_count();
    DecodeEngine engine(m, po);
    const int64_t N = 5;
    engine.start({{5, 17, 9}, {1, 2, 3, 4, 5, 6}, {250, 8}, {7, 7, 7, 7, 7}, {30, 31}}, 1);
    std::vector<int64_t> rows(N), next = {3, 4, 5, 6, 7};
    std::iota(rows.begin(), rows.end(), 0);
    std::vector<at::Tensor> out;
    for (int64_t t = 0; t < 24; ++t) {
      if (t % 3 == 2) {
        at::Tensor logits = engine.extend({t % N, (t + 2) % N}, {{40 + t, 41, 42}, {9, int64_t(100 + t)}});
        out.push_back(logits.cpu().to(at::kDouble).flatten());
        continue;
      }
      const at::Tensor streams = at::arange(N, at::kLong) + 100, counters = at::full({N}, t, at::kLong);
      const SampleOutput got = engine.step_draw(rows, next, so, sample_row_keys(so.seed, streams, counters), 400);
      for (int64_t n = 0; n < N; ++n) next[n] = got.ids[n].item<int64_t>();
      out.push_back(got.ids.cpu().to(at::kDouble));
      out.push_back(got.logprobs.cpu().to(at::kDouble));
    }
    EXPECT_GT(engine.graph_captures(), 1);
    launched = cuda::dependent_launch_count() - before;
    return at::cat(out);
  };
  int64_t with = 0, without = 0;
  const at::Tensor a = run(true, with), b = run(false, without);
  EXPECT_TRUE(at::equal(a, b)) << "max difference " << (a - b).abs().max().item<double>();
  EXPECT_GT(with, 0) << "the switch did not reach the kernels";
  EXPECT_EQ(without, 0) << "kernels launched with the attribute while the switch was off";
}

// step_draw inside the step (graph_draw: on the CPU at the graphs' fixed shape, on CUDA inside the replayed
// graph) against a step's logits drawn from by sample_tokens, with the same noise keys: the same ids and the
// same log-probs, row for row, along a rollout that feeds back what it drew, with rows waiting (holes) and
// listed out of cache order. The draw runs over every cache row, so a wrong row pick shows as another
// row's token. Known-bad twins fail the same checks: keys one counter on (another draw), and a draw at
// temperature 1 (other log-probs).
class StepDraw : public ::testing::TestWithParam<std::string> {};

TEST_P(StepDraw, DrawsInsideTheStepWhatSamplingTheStepsLogitsDraws) {
  const bool cuda = GetParam() == "cuda";
  if (cuda && !at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const Transformer m =
      tiny_model("qwen3", 5, cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU), cuda ? at::kFloat : at::kDouble);
  SamplingOptions so;
  so.temperature = 6;  // the tiny model's logits span tens of units: a flatter softmax makes draws differ
  so.seed = 11;
  const int64_t vocab_limit = 300;  // below the model's 400: columns past it are never drawn
  auto engine_options = [&](bool graph_draw) {
    EngineOptions po;
    po.slot_chunk = 4;  // compactions and growths along the way
    po.slot_align = 1;
    po.switches.cuda_graphs = true;
    po.fixed_shape_step = true;
    po.switches.graph_draw = graph_draw;
    return po;
  };
  for (double top_p : {1.0, 0.9}) {
    so.top_p = top_p;
    SCOPED_TRACE("top_p " + std::to_string(top_p));
    DecodeEngine inside(m, engine_options(true)), apart(m, engine_options(false));
    const std::vector<std::vector<int64_t>> prompts = {{5, 17, 9}, {1, 2, 3, 4, 5, 6, 7}, {250, 8}};
    inside.start(prompts, 2);
    apart.start(prompts, 2);
    const int64_t N = 6;
    std::vector<int64_t> next = {3, 4, 5, 6, 7, 8}, counter(N, 0);
    int64_t compared = 0, moved_counter = 0;
    double max_err = 0, untempered_err = 0;
    for (int64_t t = 0; t < 12; ++t) {
      std::vector<int64_t> rows, tokens, streams, counters;
      for (int64_t n = N - 1; n >= 0; --n) {  // out of cache order
        if ((n + t) % 4 == 0) continue;       // this row waits: a hole
        rows.push_back(n);
        tokens.push_back(next[n]);
        streams.push_back(100 + n);
        counters.push_back(counter[n]);
      }
      const at::Tensor st = at::tensor(streams, at::kLong), ct = at::tensor(counters, at::kLong);
      const SampleOutput got = inside.step_draw(rows, tokens, so, sample_row_keys(so.seed, st, ct), vocab_limit);
      const at::Tensor logits = apart.step(rows, tokens);
      const SampleOutput ref = sample_tokens(logits, so, st, ct, vocab_limit);
      ASSERT_EQ(got.ids.numel(), int64_t(rows.size()));
      EXPECT_TRUE(at::equal(got.ids, ref.ids)) << "step " << t << ": " << got.ids << " against " << ref.ids;
      EXPECT_LT(got.ids.max().item<int64_t>(), vocab_limit);
      max_err = std::max(max_err, (got.logprobs - ref.logprobs).abs().max().item<double>());
      moved_counter += (sample_tokens(logits, so, st, ct + 1, vocab_limit).ids != got.ids).sum().item<int64_t>();
      SamplingOptions t1 = so;
      t1.temperature = 1.0;
      untempered_err =
          std::max(untempered_err,
                   (sample_tokens(logits, t1, st, ct, vocab_limit).logprobs - got.logprobs).abs().max().item<double>());
      for (size_t j = 0; j < rows.size(); ++j) {
        next[rows[j]] = got.ids[static_cast<int64_t>(j)].item<int64_t>();
        counter[rows[j]] += 1;
      }
      compared += static_cast<int64_t>(rows.size());
    }
    // Both forms share the loss module's log-softmax; the head's GEMM over every cache row against the fed
    // rows alone may round differently (float32 on CUDA).
    const double kTol = cuda ? 1e-5 : 1e-9;
    EXPECT_LT(max_err, kTol);
    EXPECT_GT(moved_counter, compared / 3) << "keys one counter on must draw other tokens";
    EXPECT_GT(untempered_err, 100 * kTol) << "a draw without the temperature must give other log-probs";
    EXPECT_EQ(inside.cache_length(), apart.cache_length());
    if (cuda) {
      EXPECT_GT(inside.graph_captures(), 0);
    }
    std::cout << "top_p " << top_p << ": " << compared << " draws, max |log-prob error| " << max_err
              << "; keys one counter on move " << moved_counter << ", temperature 1 moves log-probs by "
              << untempered_err << "\n";
  }
}

// EngineSwitches::step_ahead: step_draw given the next step's keys starts that step before it returns, and
// the next step_draw takes it. A rollout driven through every case draws the ids and log-probs, bit for
// bit, of one whose steps all run when asked (no next keys): steps taken whole, steps that leave a row out
// (it waits, or was released: a hole), a row that comes back (the started step dropped), a row fed another
// token than it drew, a feed between steps, and other keys. The engine counts both outcomes. The wrong
// twin (EngineOptions::ahead_holes false) leaves the rows left out marked as fed in the taken step's slot:
// when they come back they see it, and their draws must differ.
// The listed rows' noise keys: stream 100 + row, counter counter[row] + on.
at::Tensor row_keys_on(int64_t seed, const std::vector<int64_t>& rows, const std::vector<int64_t>& counter,
                       int64_t on) {
  std::vector<int64_t> st, ct;
  for (int64_t n : rows) {
    st.push_back(100 + n);
    ct.push_back(counter[n] + on);
  }
  return sample_row_keys(seed, at::tensor(st, at::kLong), at::tensor(ct, at::kLong));
}

class StepAhead : public ::testing::TestWithParam<std::string> {};

TEST_P(StepAhead, StepsStartedAheadDrawWhatStepsDrawWhenAsked) {
  const bool cuda = GetParam() == "cuda";
  if (cuda && !at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const Transformer m =
      tiny_model("qwen3", 7, cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU), cuda ? at::kFloat : at::kDouble);
  SamplingOptions so;
  so.temperature = 6;  // a flatter softmax: a changed context changes draws
  so.seed = 21;
  auto run = [&](bool ahead, bool holes, int64_t& taken, int64_t& dropped) {
    EngineOptions po;
    po.switches.cuda_graphs = true;
    po.fixed_shape_step = true;
    po.ahead_holes = holes;
    DecodeEngine engine(m, po);
    const int64_t N = 6;
    engine.start({{5, 17, 9}, {1, 2, 3, 4}, {250, 8}}, 2);
    std::vector<int64_t> next = {3, 4, 5, 6, 7, 8}, counter(N, 0);
    std::vector<at::Tensor> out;
    for (int64_t t = 0; t < 22; ++t) {
      if (t == 9) {  // a feed between steps: rows 1 and 3 take a reply
        out.push_back(engine.extend({1, 3}, {{40, 41, 42}, {9, 10}}).cpu().to(at::kDouble).flatten());
        continue;
      }
      std::vector<int64_t> rows;
      for (int64_t n = 0; n < N; ++n) {
        if (t >= 4 && t < 7 && n == 2) continue;    // row 2 waits from step 4 (left out), back at 7
        if (t >= 12 && t < 14 && n == 0) continue;  // row 0 waits at 12 and 13, back at 14
        if (t >= 17 && n == 4) continue;            // row 4 finishes at 17 (released)
        rows.push_back(n);
      }
      if (t == 17) engine.release({4});
      std::vector<int64_t> tokens;
      for (int64_t n : rows) tokens.push_back(t == 15 && n == 5 ? 77 : next[n]);  // row 5 fed another token
      const bool other_keys = t == 19;  // the step's keys differ from those it was started with
      if (other_keys) counter[3] += 5;
      const at::Tensor next_keys = ahead && t != 20 ? row_keys_on(so.seed, rows, counter, 1) : at::Tensor();
      const SampleOutput d = engine.step_draw(rows, tokens, so, row_keys_on(so.seed, rows, counter, 0), 300, next_keys);
      for (size_t j = 0; j < rows.size(); ++j) {
        next[rows[j]] = d.ids[static_cast<int64_t>(j)].item<int64_t>();
        counter[rows[j]] += 1;
      }
      out.push_back(d.ids.to(at::kDouble));
      out.push_back(d.logprobs.to(at::kDouble));
    }
    taken = engine.steps_ahead_taken();
    dropped = engine.steps_ahead_dropped();
    out.push_back(at::full({1}, double(engine.cache_length()), at::kDouble));
    return at::cat(out);
  };
  int64_t taken = 0, dropped = 0, plain_taken = 0, plain_dropped = 0, twin_taken = 0, twin_dropped = 0;
  const at::Tensor got = run(true, true, taken, dropped), want = run(false, true, plain_taken, plain_dropped);
  ASSERT_EQ(got.sizes(), want.sizes());
  EXPECT_TRUE(at::equal(got, want)) << "max difference " << (got - want).abs().max().item<double>();
  // Taken at steps 1-6, 8, 11-13, 16-18 and 20 (4, 12 and 17 leave a row out). Dropped at 7 and 14 (a row
  // back), 9 (the feed), 15 (another token) and 19 (other keys); 20 starts none, 21's is never taken.
  EXPECT_EQ(taken, 14);
  EXPECT_EQ(dropped, 5);
  EXPECT_EQ(plain_taken + plain_dropped, 0);
  const at::Tensor twin = run(true, false, twin_taken, twin_dropped);
  EXPECT_EQ(twin_taken, taken);
  EXPECT_FALSE(at::equal(twin, want)) << "rows left out of a taken step must not see its slot";
}

INSTANTIATE_TEST_SUITE_P(Devices, StepAhead, ::testing::Values("cpu", "cuda"),
                         [](const auto& info) { return info.param; });

// Random schedules of everything that comes between steps, on the CPU at the graphs' fixed shape: rows
// that wait and come back, given in another order or fed another token, feeds, releases (up to half the
// cache, which drops them), admits, growths and in-place squeezes (small slot and span chunks), steps with
// no next keys. Each schedule draws, with steps started ahead, the ids and log-probs of the same schedule
// with steps started when asked, bit for bit, through as many compactions and reallocations. The wrong
// twin (no holes for the rows a taken step leaves out) must differ in some schedule.
TEST(StepAheadCpu, RandomSchedulesDrawWhatStepsDrawWhenAsked) {
  at::NoGradGuard no_grad;
  const Transformer m = tiny_model("qwen3", 7, at::Device(at::kCPU), at::kDouble);
  SamplingOptions so;
  so.temperature = 6;
  so.seed = 21;
  struct Run {
    at::Tensor out;
    int64_t taken = 0, dropped = 0, compactions = 0, reallocations = 0;
  };
  auto run = [&](uint64_t seed, int64_t chunk, bool ahead, bool holes) {
    EngineOptions po;
    po.switches.cuda_graphs = true;
    po.fixed_shape_step = true;
    po.ahead_holes = holes;
    po.span_chunk = chunk;
    po.slot_chunk = 2 * chunk;
    po.slot_align = std::min<int64_t>(chunk, 64);
    DecodeEngine engine(m, po);
    std::mt19937_64 rng(seed);  // the same draws whether steps start ahead or not
    engine.start({{5, 17, 9}, {1, 2, 3, 4}, {250, 8}}, 2);
    std::vector<int64_t> next = {3, 4, 5, 6, 7, 8}, counter(6, 0);
    std::vector<uint8_t> live(6, 1), waits(6, 0);
    std::vector<at::Tensor> out;
    for (int t = 0; t < 90; ++t) {
      const int64_t N = static_cast<int64_t>(live.size());
      const uint64_t what = rng() % 100;
      if (what < 6) {  // a feed of two tokens to some live rows
        std::vector<int64_t> rows;
        std::vector<std::vector<int64_t>> runs;
        for (int64_t n = 0; n < N; ++n) {
          if (!live[n] || rng() % 2) continue;
          rows.push_back(n);
          runs.push_back({int64_t(rng() % 300), int64_t(rng() % 300)});
          counter[n] += 2;
        }
        if (!rows.empty()) out.push_back(engine.extend(rows, runs).flatten());
        continue;
      }
      if (what < 10) {  // a row finishes; a prompt may take its place
        std::vector<int64_t> alive;
        for (int64_t n = 0; n < N; ++n) {
          if (live[n]) alive.push_back(n);
        }
        if (alive.size() > 1) {
          const int64_t n = alive[rng() % alive.size()];
          engine.release({n});
          live[n] = 0;
        }
        if (rng() % 2) {
          out.push_back(engine.admit({{int64_t(rng() % 300), 7, 8}}, 1).flatten());
          live.push_back(1);
          waits.push_back(0);
          next.push_back(11);
          counter.push_back(0);
        }
      }
      std::vector<int64_t> rows, tokens;
      for (size_t n = 0; n < live.size(); ++n) {
        if (rng() % 10 == 0) waits[n] ^= 1;
        if (live[n] && !waits[n]) rows.push_back(static_cast<int64_t>(n));
      }
      if (rows.empty()) continue;
      if (rng() % 7 == 0) std::reverse(rows.begin(), rows.end());
      for (int64_t n : rows) tokens.push_back(rng() % 40 == 0 ? 77 : next[n]);
      const bool give = rng() % 9 != 0;
      const SampleOutput d = engine.step_draw(rows, tokens, so, row_keys_on(so.seed, rows, counter, 0), 300,
                                              ahead && give ? row_keys_on(so.seed, rows, counter, 1) : at::Tensor());
      for (size_t j = 0; j < rows.size(); ++j) {
        next[rows[j]] = d.ids[static_cast<int64_t>(j)].item<int64_t>();
        counter[rows[j]] += 1;
      }
      out.push_back(d.ids.to(at::kDouble));
      out.push_back(d.logprobs.to(at::kDouble));
    }
    out.push_back(at::full({1}, double(engine.cache_length()), at::kDouble));
    return Run{at::cat(out), engine.steps_ahead_taken(), engine.steps_ahead_dropped(), engine.compactions(),
               engine.reallocations()};
  };
  int64_t taken = 0, dropped = 0, compactions = 0, reallocations = 0, twins_apart = 0;
  for (const uint64_t seed : {1, 2, 3}) {
    for (const int64_t chunk : {4, 8, 256}) {
      SCOPED_TRACE(::testing::Message() << "seed " << seed << ", span chunk " << chunk);
      const Run got = run(seed, chunk, true, true), want = run(seed, chunk, false, true);
      ASSERT_EQ(got.out.sizes(), want.out.sizes());
      EXPECT_TRUE(at::equal(got.out, want.out)) << "max difference " << (got.out - want.out).abs().max().item<double>();
      EXPECT_EQ(got.compactions, want.compactions);
      EXPECT_EQ(got.reallocations, want.reallocations);
      EXPECT_EQ(want.taken + want.dropped, 0);
      taken += got.taken;
      dropped += got.dropped;
      compactions += got.compactions;
      reallocations += got.reallocations;
      if (chunk == 8) twins_apart += !at::equal(run(seed, chunk, true, false).out, want.out);
    }
  }
  EXPECT_GT(taken, 200);
  EXPECT_GT(dropped, 50);
  EXPECT_GT(compactions, 50) << "the schedules must squeeze and grow the cache";
  EXPECT_GT(reallocations, 5);
  EXPECT_GT(twins_apart, 0) << "rows left out of a taken step must not see its slot";
  std::cout << "steps taken " << taken << ", dropped " << dropped << "; compactions " << compactions
            << ", reallocations " << reallocations << "; twins apart in " << twins_apart << " of 3 schedules\n";
}

// A speculative rollout's engine side (rollout.speculative): extend_each returns every position's logits of
// runs of 1 to 5 tokens, each equal to the full forward over the sequence so far (float64, 1e-9), and
// retract takes back a random number of each run's last tokens, after which the sequence's logits are
// those of its kept tokens alone: the taken-back slots are holes, and the next token's position follows
// the kept ones. Compactions and growths run along the way (a small cache). On "cpu_fixed" the runs go
// at the graphs' verify buckets (2, 4, 8 tokens), on "cuda" each is a replayed feed graph. A twin engine
// fed the same but never taken back must fail the check, and a retract after another forward is refused.
class Retract : public ::testing::TestWithParam<std::string> {};

TEST_P(Retract, TakenBackTokensLeaveTheContext) {
  const bool cuda = GetParam() == "cuda";
  if (cuda && !at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const Transformer m = tiny_model("qwen3", 9, cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU));
  EngineOptions po;
  po.slot_chunk = 4;
  po.slot_align = 1;
  po.switches.cuda_graphs = true;
  po.fixed_shape_extend = po.fixed_shape_step = GetParam() == "cpu_fixed";
  DecodeEngine engine(m, po), twin(m, po);
  std::vector<std::vector<int64_t>> seqs = {{5, 17, 9}, {1, 2, 3, 4, 5, 6, 7}, {250, 8}};
  engine.start(seqs, 1);
  twin.start(seqs, 1);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(3);
  auto draw = [&](int64_t n) { return at::randint(n, {1}, gen, at::kLong).item<int64_t>(); };
  double worst = 0, twin_worst = 0;
  int64_t taken_back = 0;
  for (int64_t t = 0; t < 10; ++t) {
    std::vector<int64_t> rows;
    std::vector<std::vector<int64_t>> runs;
    for (int64_t n = 0; n < 3; ++n) {
      if ((n + t) % 4 == 3) continue;  // this row waits: a hole
      rows.push_back(n);
      runs.emplace_back();
      for (int64_t i = 0, k = 1 + draw(5); i < k; ++i) runs.back().push_back(draw(400));
    }
    const at::Tensor logits = engine.extend_each(rows, runs).cpu();
    const at::Tensor twin_logits = twin.extend_each(rows, runs).cpu();
    std::vector<int64_t> back;
    int64_t at = 0;
    for (size_t j = 0; j < rows.size(); ++j) {
      std::vector<int64_t>& seq = seqs[rows[j]];
      const int64_t k = static_cast<int64_t>(runs[j].size());
      for (int64_t i = 0; i < k; ++i, ++at) {
        std::vector<int64_t> prefix = seq;
        prefix.insert(prefix.end(), runs[j].begin(), runs[j].begin() + i + 1);
        const at::Tensor ref = full_logits(m, prefix);
        worst = std::max(worst, (logits[at] - ref).abs().max().item<double>());
        twin_worst = std::max(twin_worst, (twin_logits[at] - ref).abs().max().item<double>());
      }
      const int64_t keep = 1 + draw(k);
      seq.insert(seq.end(), runs[j].begin(), runs[j].begin() + keep);
      back.push_back(k - keep);
      taken_back += k - keep;
    }
    engine.retract(rows, back);
  }
  EXPECT_LT(worst, 1e-9);
  EXPECT_GT(taken_back, 5);
  EXPECT_GT(twin_worst, 1e-2) << "tokens left in the cache must change the logits";
  EXPECT_GT(engine.compactions(), 0);
  // Only the latest forward's tokens can be taken back.
  engine.extend_each({0}, {{7, 8}});
  engine.step({1}, {9});
  EXPECT_THROW(engine.retract({0}, {1}), c10::Error) << "a step since";
  engine.extend_each({1}, {{9, 10}});
  EXPECT_THROW(engine.retract({1}, {3}), c10::Error) << "more tokens than the run";
  EXPECT_NO_THROW(engine.retract({1}, {2}));
}

INSTANTIATE_TEST_SUITE_P(Devices, Retract, ::testing::Values("cpu", "cpu_fixed", "cuda"),
                         [](const auto& info) { return info.param; });

// A verifying forward's draw inside its fixed-shape forward (graph_draw: on the CPU at the fixed shape, on
// CUDA inside the replayed graph) against extend_each's logits drawn from by sample_keyed with the same keys:
// the same ids and log-probs at every position, along runs of 1 to 5 tokens with rows waiting, taken back in
// part after each forward. Keys one counter on (another position's noise) must draw other tokens.
class VerifyDraw : public ::testing::TestWithParam<std::string> {};

TEST_P(VerifyDraw, DrawsInsideTheForwardWhatSamplingItsLogitsDraws) {
  const bool cuda = GetParam() == "cuda";
  if (cuda && !at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const Transformer m =
      tiny_model("qwen3", 5, cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU), cuda ? at::kFloat : at::kDouble);
  SamplingOptions so;
  so.temperature = 6;  // a flatter softmax: draws that differ with the noise
  so.top_p = 0.9;
  so.seed = 3;
  auto engine_options = [&](bool graph_draw) {
    EngineOptions po;
    po.slot_chunk = 4;
    po.slot_align = 1;
    po.switches.cuda_graphs = true;
    po.fixed_shape_extend = po.fixed_shape_step = true;
    po.switches.graph_draw = graph_draw;
    return po;
  };
  DecodeEngine inside(m, engine_options(true)), apart(m, engine_options(false));
  const std::vector<std::vector<int64_t>> prompts = {{5, 17, 9}, {1, 2, 3, 4, 5, 6, 7}, {250, 8}};
  inside.start(prompts, 1);
  apart.start(prompts, 1);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(4);
  auto draw = [&](int64_t n) { return at::randint(n, {1}, gen, at::kLong).item<int64_t>(); };
  int64_t compared = 0, moved = 0;
  double max_err = 0;
  for (int64_t t = 0; t < 8; ++t) {
    std::vector<int64_t> rows, streams, counters;
    std::vector<std::vector<int64_t>> runs;
    for (int64_t n = 2; n >= 0; --n) {  // out of cache order
      if ((n + t) % 4 == 1) continue;
      rows.push_back(n);
      runs.emplace_back();
      for (int64_t i = 0, k = 1 + draw(5); i < k; ++i) {
        runs.back().push_back(draw(400));
        streams.push_back(50 + n);
        counters.push_back(10 * t + i);
      }
    }
    const at::Tensor st = at::tensor(streams, at::kLong), ct = at::tensor(counters, at::kLong);
    const SampleOutput got = inside.extend_each_draw(rows, runs, so, sample_row_keys(so.seed, st, ct), 300);
    const at::Tensor logits = apart.extend_each(rows, runs);
    const SampleOutput ref = sample_keyed(logits, so, sample_row_keys(so.seed, st, ct), 300);
    ASSERT_EQ(got.ids.numel(), int64_t(streams.size()));
    EXPECT_TRUE(at::equal(got.ids, ref.ids)) << "forward " << t;
    max_err = std::max(max_err, (got.logprobs - ref.logprobs).abs().max().item<double>());
    moved += (sample_keyed(logits, so, sample_row_keys(so.seed, st, ct + 1), 300).ids != got.ids).sum().item<int64_t>();
    compared += got.ids.numel();
    std::vector<int64_t> back;
    for (const auto& r : runs) back.push_back(draw(static_cast<int64_t>(r.size())));
    inside.retract(rows, back);
    apart.retract(rows, back);
  }
  EXPECT_LT(max_err, cuda ? 1e-5 : 1e-9);
  EXPECT_GT(moved, compared / 3) << "keys one counter on must draw other tokens";
  if (cuda) {
    EXPECT_GT(inside.feed_graph_captures(), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, VerifyDraw, ::testing::Values("cpu", "cuda"),
                         [](const auto& info) { return info.param; });

INSTANTIATE_TEST_SUITE_P(Devices, StepDraw, ::testing::Values("cpu", "cuda"),
                         [](const auto& info) { return info.param; });

INSTANTIATE_TEST_SUITE_P(Families, DecodeEngineTest,
                         ::testing::Combine(::testing::Values("llama", "qwen3", "gemma2"),
                                            ::testing::Values("cpu", "cpu_fixed", "cuda", "cuda_f32")),
                         [](const auto& info) { return std::get<0>(info.param) + "_" + std::get<1>(info.param); });

// EngineOptions::max_slots (rollout.max_context): the cache grows to the bound and no further while the
// sequences fit in it, as the memory plan counts it. Without the bound the same decode grows past it (a
// quarter more, or slot_chunk, at each growth): the check fails there. Every logit against the sequence's
// full forward (float64).
class BoundedCache : public ::testing::TestWithParam<std::string> {};

TEST_P(BoundedCache, GrowsToMaxSlotsAndNoFurther) {
  const bool cuda = GetParam() == "cuda";
  if (cuda && !at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const Transformer m = tiny_model("llama", 13, cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU));
  for (int64_t bound : {40, 0}) {
    SCOPED_TRACE("max_slots " + std::to_string(bound));
    EngineOptions po;
    po.slot_chunk = 4;
    po.slot_align = 1;  // the cache sizes as slot_chunk and the bound set them
    po.max_slots = bound;
    DecodeEngine engine(m, po);
    std::vector<std::vector<int64_t>> seqs = {{5, 17, 9}, {1, 2, 3, 4}};
    engine.start(seqs, 1);
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
    int64_t most = engine.cache_slots();
    while (seqs[1].size() < 40) {  // until the longer sequence holds the bound's 40 tokens
      std::vector<int64_t> tokens;
      for (auto& seq : seqs) {
        tokens.push_back(at::randint(400, {1}, gen, at::kLong).item<int64_t>());
        seq.push_back(tokens.back());
      }
      const at::Tensor logits = engine.step({0, 1}, tokens).cpu();
      for (size_t j = 0; j < seqs.size(); ++j) {
        EXPECT_LT((logits[j] - full_logits(m, seqs[j])).abs().max().item<double>(), 1e-9) << "sequence " << j;
      }
      most = std::max(most, engine.cache_slots());
    }
    EXPECT_GE(engine.reallocations(), 2) << "the cache grew";
    if (bound > 0) {
      EXPECT_EQ(most, bound);
    } else {
      EXPECT_GT(most, 40) << "unbounded, a growth adds a quarter";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, BoundedCache, ::testing::Values("cpu", "cuda"),
                         [](const auto& info) { return info.param; });

// KvCache::regather, the engine's growth: the same cache as gather(), holding the new cache and about a
// layer of the old beyond what the old one held (the CPU allocator's peak, within 4 layers); gather(),
// which keeps the old cache whole until it returns, holds both and fails that bound.
TEST(KvCacheRegather, EqualsGatherAndHoldsOneLayerOfTheOld) {
  install_cpu_memory_tracking();
  const Transformer m = tiny_model("llama", 13, at::Device(at::kCPU));
  ModelConfig c = m.config();
  c.num_layers = 8;  // the old cache many layers deep: gather's old copy is what the bound must reject
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  KvCache old = KvCache::allocate(c, 3, 24, opts);
  at::manual_seed(1);
  for (size_t i = 0; i < old.k.size(); ++i) {
    old.k[i].normal_();
    old.v[i].normal_();
  }
  old.positions.copy_(at::arange(24, at::kLong).expand({3, 24}));
  old.length = 24;
  const at::Tensor rows = at::tensor({2, 0, 1}, at::kLong);
  const at::Tensor slots = at::arange(20, at::kLong).flip(0).expand({3, 20}).contiguous();
  const int64_t layer = old.k[0].nbytes();  // one old layer's keys (or values)
  const int64_t old_bytes = 2 * c.num_layers * layer, new_bytes = old_bytes / 24 * 64;
  int64_t gather_extra = 0, regather_extra = 0;
  KvCache whole;
  {
    PeakMemory peak(at::Device(at::kCPU));
    whole = old.gather(rows, slots, 64);
    gather_extra = peak.peak_extra_bytes();
  }
  KvCache grown;
  {
    PeakMemory peak(at::Device(at::kCPU));
    grown = old.regather(rows, slots, 64);
    regather_extra = peak.peak_extra_bytes();
  }
  const int64_t bound = new_bytes - old_bytes + 4 * layer;
  EXPECT_LE(regather_extra, bound) << "regather: the new cache, and a layer of the old at a time";
  EXPECT_GE(gather_extra, new_bytes) << "gather: the new cache beside the old";
  EXPECT_GT(gather_extra, bound) << "twin: gather fails the bound";
  EXPECT_TRUE(old.k.empty() && old.v.empty() && !old.positions.defined());
  ASSERT_EQ(grown.k.size(), whole.k.size());
  for (size_t i = 0; i < whole.k.size(); ++i) {
    EXPECT_TRUE(at::equal(grown.k[i], whole.k[i]) && at::equal(grown.v[i], whole.v[i])) << "layer " << i;
  }
  EXPECT_TRUE(at::equal(grown.positions, whole.positions));
  EXPECT_EQ(grown.length, 20);
  EXPECT_EQ(grown.max_len, 64);
}

}  // namespace
}  // namespace rlt
