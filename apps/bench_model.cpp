// bench_model: prefill and decode throughput of the decoder through its KV cache. B sequences of P prompt
// tokens are prefilled in one forward, then N tokens are decoded one step at a time:
//   decode_greedy / decode_sample   the bare decoder on a preallocated cache (argmax, or multinomial);
//   rollout_eager / rollout_graph   the rollout's own path: DecodeEngine (compacting cache, masked steps)
//                                   and its step_draw (counter-based Gumbel noise, log-probs through the
//                                   loss module, ids to the host every step), without and with a CUDA
//                                   graph per decode step, which holds the LM head and the draw too
//                                   (rollout_graph on CUDA only);
//   rollout_graph_aten              rollout_graph with the fused decode and sampling kernels off (their
//                                   ATen forms): the before and after of those kernels in one command;
//   rollout_graph_unpacked          rollout_graph without packed q/k/v and gate/up weights;
//   rollout_graph_sdpa              rollout_graph with each step's attention through SDPA (cuDNN) over its
//                                   span instead of cuda::cache_attention in place.
// Every cache forward here (prefill included) runs the fused kernels unless said otherwise.
// Prints a table and writes JSON records {impl, mode, batch, prompt_len, new_tokens, dtype, tokens_per_s,
// seconds, peak_extra_mb}, and for the graphed rollout modes graph_pool_mb (the memory pool its CUDA graphs
// share, at the run's end). The transformers peer is scripts/bench_model_peers.py, run in the same command
// (scripts/gpu/model.sh).
// --trace FILE profiles one short run of each mode, plus a multi-token extend (a tool reply's feed), with
// the Kineto profiler (CPU ops and CUDA kernels) into a Chrome trace; scripts/dev/trace_summary.py splits it
// by phase into GPU-busy time, launch gaps and the top kernels.
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <tuple>

#include "apps/bench_common.h"
#include "common/config.h"
#include "common/memory.h"
#include "common/timing.h"
#include "model/safetensors.h"
#include "model/transformer.h"
#include "rollout/engine.h"
#include "rollout/sampler.h"

using namespace rlt;
using json = nlohmann::json;

namespace {

struct Run {
  double prefill_s = 0, decode_s = 0;
  int64_t peak = 0;
  int64_t graph_pool = 0;  // the rollout's path: what its graphs' memory pool reserves at the end
};

// One prefill of (B, P) and N decode steps on a fresh cache.
Run run_once(const Transformer& m, const at::Device& dev, int64_t B, int64_t P, int64_t N, bool sample, uint64_t seed) {
  at::NoGradGuard ng;
  const auto& c = m.config();
  auto opts = at::TensorOptions().device(dev);
  at::manual_seed(seed);
  at::Tensor ids = at::randint(0, c.vocab_size, {B, P}, opts.dtype(at::kLong));
  at::Tensor pos = at::arange(P, opts.dtype(at::kLong)).unsqueeze(0).expand({B, P}).contiguous();
  device_synchronize(dev);
  PeakMemory mem(dev);
  KvCache cache = KvCache::allocate(c, B, P + N, opts.dtype(m.lm_head().scalar_type()));
  Run r;
  auto t0 = std::chrono::steady_clock::now();
  at::Tensor h;
  {
    RECORD_USER_SCOPE("phase:prefill");
    h = m.forward(ids, pos, at::Tensor(), &cache);  // (B, P, D)
    device_synchronize(dev);
  }
  r.prefill_s = seconds_since(t0);
  t0 = std::chrono::steady_clock::now();
  for (int64_t s = 0; s < N; ++s) {
    at::Tensor logits = m.logits(h.select(1, h.size(1) - 1)).to(at::kFloat);  // (B, V)
    at::Tensor next = sample ? at::multinomial(at::softmax(logits, -1), 1) : logits.argmax(-1, /*keepdim=*/true);
    h = m.forward(next, at::full({B, 1}, cache.length, opts.dtype(at::kLong)), at::Tensor(), &cache);
  }
  device_synchronize(dev);
  r.decode_s = seconds_since(t0);
  r.peak = mem.peak_extra_bytes();
  return r;
}

// The rollout's path: B prompts x 1 sample through DecodeEngine, N sampled tokens each, every one fed back.
// fused = false: the ATen forms of the decoder's and the sampler's fused kernels (the before of
// rollout_graph).
Run run_engine_once(Transformer& m, const at::Device& dev, int64_t B, int64_t P, int64_t N, bool graphs,
                    SamplingOptions so, uint64_t seed, bool fused = true, bool packed = true,
                    bool cache_attention = true) {
  at::NoGradGuard ng;
  m.set_fused_kernels(fused);
  at::manual_seed(seed);
  at::Tensor ids = at::randint(0, m.config().vocab_size, {B, P}, at::kLong);
  std::vector<std::vector<int64_t>> prompts(B);
  for (int64_t b = 0; b < B; ++b) prompts[b].assign(ids[b].data_ptr<int64_t>(), ids[b].data_ptr<int64_t>() + P);
  std::vector<int64_t> rows(B);
  for (int64_t b = 0; b < B; ++b) rows[b] = b;
  so.seed = static_cast<int64_t>(seed);
  at::Tensor streams = at::arange(B, at::kLong), counters = at::zeros({B}, at::kLong);
  device_synchronize(dev);
  PeakMemory mem(dev);
  EngineOptions po;
  po.switches.cuda_graphs = graphs;
  po.switches.packed_weights = packed;
  po.switches.cache_attention = cache_attention;
  po.switches.fused_kernels = fused;
  DecodeEngine engine(m, po);
  Run r;
  auto t0 = std::chrono::steady_clock::now();
  at::Tensor logits = engine.start(prompts, 1);  // (B, V)
  device_synchronize(dev);
  r.prefill_s = seconds_since(t0);
  t0 = std::chrono::steady_clock::now();
  // The first token from the prefill's logits, each next one drawn by the step itself (step_draw: inside
  // the step's graph when graphed), as the rollout's loop does.
  SampleOutput out = sample_tokens(logits, so, streams, counters, 0, fused);  // ids on the host
  for (int64_t s = 1; s < N; ++s) {
    counters.fill_(s);
    const int64_t* next = out.ids.data_ptr<int64_t>();
    out = engine.step_draw(rows, std::vector<int64_t>(next, next + B), so, sample_row_keys(so.seed, streams, counters),
                           0);
  }
  {
    const int64_t* next = out.ids.data_ptr<int64_t>();
    engine.step(rows, std::vector<int64_t>(next, next + B));  // the last sampled token enters the cache
  }
  device_synchronize(dev);
  r.decode_s = seconds_since(t0);
  r.peak = mem.peak_extra_bytes();
  r.graph_pool = engine.graph_pool_bytes();
  m.set_fused_kernels(true);
  return r;
}

// The profiled phases: each inside a user scope named after it, ending in a device synchronisation so
// that its kernels fall inside it. Short runs (8 decode steps): enough to see each step's pattern.
void trace_phases(Transformer& m, const at::Device& dev, int64_t B, int64_t P, const SamplingOptions& so,
                  const std::string& path) {
  namespace prof = torch::autograd::profiler;
  const prof::ProfilerConfig config(prof::ProfilerState::KINETO, /*report_input_shapes=*/true);
  std::set<torch::profiler::impl::ActivityType> acts{torch::profiler::impl::ActivityType::CPU};
  if (dev.is_cuda()) acts.insert(torch::profiler::impl::ActivityType::CUDA);
  prof::prepareProfiler(config, acts);
  prof::enableProfiler(config, acts);
  const int64_t steps = 8;
  for (bool sample : {false, true}) {
    RECORD_USER_SCOPE(sample ? "phase:prefill+decode_sample" : "phase:prefill+decode_greedy");
    run_once(m, dev, B, P, steps, sample, 7);
  }
  std::vector<bool> graph_modes = {false};
  if (dev.is_cuda()) graph_modes.push_back(true);
  for (bool graphs : graph_modes) {
    RECORD_USER_SCOPE(graphs ? "phase:rollout_graph" : "phase:rollout_eager");
    run_engine_once(m, dev, B, P, steps, graphs, so, 7);
  }
  for (bool fused : {true, false}) {
    if (!dev.is_cuda()) break;
    // The rollout's decode step in steady state, split: 16 graphed steps after the capture, alone (the
    // engine's part: inputs in, graph replay, LM head), then 16 samplings of one step's logits alone
    // (sample_tokens: noise, draw, log-probs, ids to the host). Their sum is one step of rollout_graph.
    // Then the same with the decoder's and the sampler's fused kernels off (their ATen forms).
    at::NoGradGuard ng;
    m.set_fused_kernels(fused);
    DecodeEngine engine(m, EngineOptions{});
    std::vector<std::vector<int64_t>> prompts(B, std::vector<int64_t>(P, 1));
    at::Tensor logits = engine.start(prompts, 1);
    std::vector<int64_t> rows(B), tokens(B, 3);
    for (int64_t b = 0; b < B; ++b) rows[b] = b;
    for (int i = 0; i < 4; ++i) logits = engine.step(rows, tokens);  // the capture and a few replays
    device_synchronize(dev);
    SamplingOptions steady = so;
    steady.seed = 7;
    at::Tensor streams = at::arange(B, at::kLong), counters = at::zeros({B}, at::kLong);
    const std::string tag = fused ? "_x16" : "_aten_x16";
    {
      // The two together, as rollout_graph runs them: sample, ids to the host, step.
      RECORD_USER_SCOPE(("phase:steady_loop" + tag).c_str());
      for (int i = 0; i < 16; ++i) {
        counters.fill_(i);
        SampleOutput out = sample_tokens(logits, steady, streams, counters, 0, fused);
        const int64_t* next = out.ids.data_ptr<int64_t>();
        logits = engine.step(rows, std::vector<int64_t>(next, next + B));
      }
      device_synchronize(dev);
    }
    {
      RECORD_USER_SCOPE(("phase:steady_policy_step" + tag).c_str());
      for (int i = 0; i < 16; ++i) logits = engine.step(rows, tokens);
      device_synchronize(dev);
    }
    {
      RECORD_USER_SCOPE(("phase:steady_sample" + tag).c_str());
      for (int i = 0; i < 16; ++i) {
        counters.fill_(i);
        sample_tokens(logits, steady, streams, counters, 0, fused);
      }
      device_synchronize(dev);
    }
    m.set_fused_kernels(true);
  }
  {
    // A tool reply's feed: 4 of the B rows (spread over the batch) take 24 tokens each in one forward
    // (DecodeEngine::extend).
    at::NoGradGuard ng;
    EngineOptions po;
    DecodeEngine engine(m, po);
    std::vector<std::vector<int64_t>> prompts(B, std::vector<int64_t>(P, 1));
    engine.start(prompts, 1);
    device_synchronize(dev);
    std::vector<int64_t> rows;
    for (int64_t r = 0; r < B && rows.size() < 4; r += std::max<int64_t>(1, B / 4)) rows.push_back(r);
    // The first feed, the same shape again 24 slots later (a new context length), then fewer rows and
    // tokens. Phase names carry the real row counts (fewer than 4 when B < 4).
    const size_t few = std::min<size_t>(2, rows.size());
    const std::string many = "phase:extend_" + std::to_string(rows.size()) + "x24";
    const std::vector<std::tuple<std::string, size_t, int64_t>> feeds = {
        {many, rows.size(), 24},
        {many + "_next", rows.size(), 24},
        {"phase:extend_" + std::to_string(few) + "x10", few, 10}};
    for (const auto& [name, n_rows, n_tokens] : feeds) {
      RECORD_USER_SCOPE(name);
      std::vector<int64_t> r(rows.begin(), rows.begin() + n_rows);
      engine.extend(r, std::vector<std::vector<int64_t>>(r.size(), std::vector<int64_t>(n_tokens, 2)));
      device_synchronize(dev);
    }
  }
  if (dev.is_cuda() && B >= 16) {
    // The ReTool loop's feed as its graphs run it (EngineOptions::fixed_shape_extend, eager here so
    // that each kernel shows): 12 rows of 17 tokens in their bucket (16 x 24: rows to a power of two, tokens
    // to a multiple of 8), attention over the slots in use. The third such feed is recorded (the first two pay
    // cuBLAS's and SDPA's set-up).
    at::NoGradGuard ng;
    EngineOptions po;
    po.fixed_shape_extend = true;
    DecodeEngine engine(m, po);
    std::vector<std::vector<int64_t>> prompts(B, std::vector<int64_t>(P, 1));
    engine.start(prompts, 1);
    std::vector<int64_t> rows;
    for (int64_t r = 0; r < 12; ++r) rows.push_back(r * B / 12);
    const std::vector<std::vector<int64_t>> runs(rows.size(), std::vector<int64_t>(17, 2));
    for (int i = 0; i < 2; ++i) engine.extend(rows, runs);
    device_synchronize(dev);
    RECORD_USER_SCOPE("phase:extend_fixed_12x17");
    engine.extend(rows, runs);
    device_synchronize(dev);
  }
  prof::disableProfiler()->save(path);
}

}  // namespace

// bench_model reads one section: the sampler's options for the rollout's path (temperature, top-k/p).
struct BenchModelConfig {
  SamplingOptions sampling;
  template <class V>
  void visit_sections(V&& v) {
    v("sampling", sampling, "temperature, top-k, top-p of the rollout's path");
  }
};

int main(int argc, char** argv) {
  CLI::App app{"bench_model: prefill and decode tokens/s of the decoder with its KV cache"};
  ConfigCli cc;
  add_config_flags(app, cc);
  std::string model_dir, device = "cpu", dtype = "bfloat16", json_path;
  int64_t B = 8, P = 256, N = 64;
  int reps = 3;
  add_model_options(app, model_dir, device, dtype, B);
  app.add_option("--prompt-len", P, "prompt tokens per sequence")->check(CLI::Range(1, 1 << 20));
  app.add_option("--new-tokens", N, "decoded tokens per sequence")->check(CLI::Range(1, 1 << 20));
  app.add_option("--reps", reps, "timed repetitions (median)")->check(CLI::Range(1, 100));
  app.add_option("--json", json_path, "write the records to this JSON file");
  std::string trace_path;
  std::vector<std::string> only;
  app.add_option("--modes", only, "run only these modes (prefill comes with decode_greedy); default: all")
      ->delimiter(',')
      ->check(CLI::IsMember({"decode_greedy", "decode_sample", "rollout_eager", "rollout_graph", "rollout_graph_aten",
                             "rollout_graph_unpacked", "rollout_graph_sdpa"}));
  app.add_option("--trace", trace_path,
                 "also profile a short run of each mode into this Chrome trace (scripts/dev/trace_summary.py "
                 "reads it)");
  if (int rc = parse_cli(app, argc, argv); rc >= 0) return rc;
  BenchModelConfig cfg;
  if (!load_cli_config(cc, cfg)) return 2;
  if (cc.print) return 0;
  std::optional<BenchModel> bench = load_bench_model("bench_model", model_dir, device, dtype);
  if (!bench) return 2;
  const at::Device dev = bench->device;
  std::optional<Transformer>& model = bench->model;
  int64_t n_params = 0;
  for (const auto& p : model->parameters()) n_params += p.numel();
  std::cout << "model " << model_dir << ": " << model->config().model_type << ", " << n_params / 1e6 << "M parameters, "
            << dtype << " on " << device << "\n";
  // Warm-up at the measured batch and prompt size (8 decode steps, every mode), as the transformers peer
  // does: handles, kernel selection and allocator growth stay out of the timed runs.
  for (bool sample : {false, true}) run_once(*model, dev, B, P, std::min<int64_t>(N, 8), sample, 1);
  std::vector<bool> graph_modes = {false};
  if (dev.is_cuda()) graph_modes.push_back(true);
  for (bool graphs : graph_modes) run_engine_once(*model, dev, B, P, std::min<int64_t>(N, 8), graphs, cfg.sampling, 1);
  if (!trace_path.empty()) trace_phases(*model, dev, B, P, cfg.sampling, trace_path);
  json records = json::array();
  std::cout << std::left << std::setw(16) << "mode" << std::right << std::setw(7) << "batch" << std::setw(8) << "prompt"
            << std::setw(6) << "new" << std::setw(14) << "tokens/s" << std::setw(11) << "seconds" << std::setw(14)
            << "peak_MiB"
            << "\n";
  // Reps interleave the modes (greedy, sample, rollout eager, rollout graphed, greedy, ...) so that clock or
  // allocator drift over the run does not favour whichever mode would otherwise go last.
  // Modes 0, 1: the bare decoder, greedy and sampled; 2, 3: the rollout's path, eager and graphed.
  // Modes 4, 5 (CUDA): rollout_graph with the decoder's and the sampler's fused kernels off (their ATen
  // forms), and with the kernels but without packed projection weights. Mode 6 (CUDA): rollout_graph with
  // the steps' attention through SDPA.
  constexpr int kModes = 7;
  const char* names[kModes] = {"decode_greedy",      "decode_sample",          "rollout_eager",     "rollout_graph",
                               "rollout_graph_aten", "rollout_graph_unpacked", "rollout_graph_sdpa"};
  auto wanted = [&](int kind) {
    return only.empty() || std::find(only.begin(), only.end(), names[kind]) != only.end();
  };
  std::vector<Run> all_runs[kModes];
  for (int i = 0; i < reps; ++i) {
    for (bool sample : {false, true}) {
      if (wanted(sample)) all_runs[sample].push_back(run_once(*model, dev, B, P, N, sample, 100 + i));
    }
    for (bool graphs : graph_modes) {
      if (wanted(2 + graphs))
        all_runs[2 + graphs].push_back(run_engine_once(*model, dev, B, P, N, graphs, cfg.sampling, 100 + i));
    }
    if (dev.is_cuda()) {
      if (wanted(4))
        all_runs[4].push_back(run_engine_once(*model, dev, B, P, N, true, cfg.sampling, 100 + i, /*fused=*/false));
      if (wanted(5))
        all_runs[5].push_back(
            run_engine_once(*model, dev, B, P, N, true, cfg.sampling, 100 + i, /*fused=*/true, /*packed=*/false));
      if (wanted(6))
        all_runs[6].push_back(run_engine_once(*model, dev, B, P, N, true, cfg.sampling, 100 + i, /*fused=*/true,
                                              /*packed=*/true, /*cache_attention=*/false));
    }
    std::cerr << "rep " << i << ": decode s greedy/sample/eager/graph/graph_aten/graph_unpacked/graph_sdpa";
    for (auto& r : all_runs) std::cerr << " " << (r.empty() ? 0.0 : r.back().decode_s);
    std::cerr << "\n";
  }
  for (int kind = 0; kind < kModes; ++kind) {
    const std::vector<Run>& runs = all_runs[kind];
    if (runs.empty()) continue;
    auto median = [&](auto get) {
      std::vector<double> v;
      for (const auto& r : runs) v.push_back(get(r));
      std::sort(v.begin(), v.end());
      const size_t n = v.size();
      return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
    };
    const double pre = median([](const Run& r) { return r.prefill_s; });
    const double dec = median([](const Run& r) { return r.decode_s; });
    const double peak = median([](const Run& r) { return double(r.peak); }) / (1024.0 * 1024.0);
    const double pool = median([](const Run& r) { return double(r.graph_pool); }) / (1024.0 * 1024.0);
    std::vector<std::tuple<std::string, double, double>> rows;
    if (kind == 0) rows.push_back({"prefill", double(B * P) / pre, pre});
    rows.push_back({names[kind], double(B * N) / dec, dec});
    for (const auto& [mode, tps, secs] : rows) {
      std::cout << std::left << std::setw(16) << mode << std::right << std::setw(7) << B << std::setw(8) << P
                << std::setw(6) << N << std::setw(14) << std::fixed << std::setprecision(1) << tps << std::setw(11)
                << std::setprecision(4) << secs << std::setw(14) << std::setprecision(1) << peak << "\n";
      json record = {{"impl", "rlt"},
                     {"mode", mode},
                     {"batch", B},
                     {"prompt_len", P},
                     {"new_tokens", N},
                     {"dtype", dtype},
                     {"tokens_per_s", tps},
                     {"seconds", secs},
                     {"peak_extra_mb", peak},
                     {"note", kind < 2   ? "peak covers prefill + decode with the KV cache"
                              : kind < 4 ? "DecodeEngine + sample_tokens; peak covers prefill + decode"
                              : kind < 5 ? "rollout_graph with the fused decode and sampling kernels off"
                              : kind < 6 ? "rollout_graph without packed q/k/v and gate/up weights"
                                         : "rollout_graph with the steps' attention through SDPA over the span"}};
      if (kind >= 3) record["graph_pool_mb"] = pool;
      records.push_back(record);
    }
  }
  if (!json_path.empty()) write_json_records(json_path, records);
  return 0;
}
