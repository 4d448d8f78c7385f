// bench_rollout: the ReTool loop's sampled tokens/s with real sandboxed tool calls, beside plain decoding
// through the same loop at the same batch (the issue-14 target: tools >= 80% of plain).
//
// A random model writes no code, so each trajectory's turns are steered: after --tool-every free samples,
// the logits are pushed (+1e4) to a fixed code block, "<code>\nprint(...)\n</code>", which the loop parses
// as a tool call and runs in the sandbox; the interpreter's reply comes back in the protocol's framing and
// the next turn starts free again. Everything else is the trainer's path: rollout() with ModelPolicy
// (CUDA graphs on a GPU), sample_tokens, a SandboxPool of real interpreters, trajectories ended by
// rollout.max_context = prompt + new tokens.
//
// Modes, run in this order in one process on the same prompts and seed:
//   plain            tools off: --new-tokens sampled per trajectory
//   tools            the steered loop, tool replies fed in one forward (rollout.multi_token_feed), an
//                    eager one at its exact shape (the default)
//   tools_feedgraphs the same, each feed a replayed CUDA graph per (rows, tokens) bucket
//                    (ModelPolicyOptions::feed_graphs)
//   tools_onetoken   the same with tool replies fed one token per decode step
// Prints a table; --json writes the records {mode, batch, prompt_len, new_tokens, sampled_tokens,
// tool_calls, seconds, sampled_tokens_per_s, ratio_to_plain, decode_s, feed_s, tool_wait_s, decode_steps,
// feed_steps, forced_tokens, cache_compactions, cache_reallocations (of them, those that made new cache
// tensors), step_graph_captures, feed_graph_captures}.
#include <ATen/core/grad_mode.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>

#include "apps/bench_common.h"
#include "data/tokenizer.h"
#include "rollout/retool.h"

using namespace rlt;
using json = nlohmann::json;

namespace {

// ModelPolicy with each turn steered into a tool call after `every` free samples. The state of a row
// follows the tokens it is fed: free samples count up to `every`, then the script's tokens are forced one by
// one, then the row waits; the reply (whose last tokens are the framing's close) starts a free turn again.
class ToolSteered : public TokenPolicy {
 public:
  ToolSteered(const Transformer& m, ModelPolicyOptions po, std::vector<int64_t> script, std::vector<int64_t> reply_end,
              int64_t every)
      : inner_(m, po), script_(std::move(script)), reply_end_(std::move(reply_end)), every_(every) {}
  const ModelPolicy& inner() const { return inner_; }

  at::Tensor start(const std::vector<std::vector<int64_t>>& prompts, int64_t repeats) override {
    const size_t N = prompts.size() * repeats;
    rows_.assign(N, Row{});
    std::vector<int64_t> all(N);
    for (size_t n = 0; n < N; ++n) all[n] = static_cast<int64_t>(n);
    return steer(all, inner_.start(prompts, repeats));
  }
  at::Tensor step(const std::vector<int64_t>& rows, const std::vector<int64_t>& tokens) override {
    for (size_t j = 0; j < rows.size(); ++j) fed(rows_[rows[j]], tokens[j]);
    return steer(rows, inner_.step(rows, tokens));
  }
  at::Tensor extend(const std::vector<int64_t>& rows, const std::vector<std::vector<int64_t>>& runs) override {
    for (size_t j = 0; j < rows.size(); ++j) {
      for (int64_t t : runs[j]) fed(rows_[rows[j]], t);
    }
    return steer(rows, inner_.extend(rows, runs));
  }
  void release(const std::vector<int64_t>& rows) override { inner_.release(rows); }
  int64_t vocab_size() const override { return inner_.vocab_size(); }

 private:
  enum class State { kFree, kScript, kWaiting };
  struct Row {
    State state = State::kFree;
    int64_t count = 0;          // free samples of this turn, or script tokens fed
    std::vector<int64_t> tail;  // the last tokens fed, to see the reply's end
  };
  void fed(Row& r, int64_t t) {
    r.tail.push_back(t);
    if (r.tail.size() > reply_end_.size()) r.tail.erase(r.tail.begin());
    if (r.state == State::kWaiting) {
      if (r.tail == reply_end_) r = Row{};
      return;
    }
    if (r.tail == reply_end_) {  // feedback for a malformed turn (random text can close a tag)
      r = Row{};
      return;
    }
    r.count += 1;
    if (r.state == State::kScript && r.count == static_cast<int64_t>(script_.size())) {
      r.state = State::kWaiting;
    } else if (r.state == State::kFree && r.count >= every_) {
      r.state = State::kScript;
      r.count = 0;
    }
  }
  at::Tensor steer(const std::vector<int64_t>& rows, at::Tensor logits) {
    for (size_t j = 0; j < rows.size(); ++j) {
      const Row& r = rows_[rows[j]];
      if (r.state == State::kScript) logits[static_cast<int64_t>(j)][script_[r.count]] += 1e4;
    }
    return logits;
  }
  ModelPolicy inner_;
  std::vector<int64_t> script_, reply_end_;

  int64_t every_;
  std::vector<Row> rows_;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_rollout: the ReTool loop's sampled tokens/s with sandboxed tool calls, beside plain decoding"};
  std::string model_dir, device = "cpu", dtype = "bfloat16", json_path, tokenizer_dir;
  int64_t B = 64, P = 256, N = 512, every = 96, workers = 16;
  bool site_packages = true, graphs = true;
  uint64_t seed = 1;
  add_model_options(app, model_dir, device, dtype, B);
  app.add_option("--tokenizer", tokenizer_dir, "folder with tokenizer.json (a checkpoint's tokenizer files)")
      ->required();
  app.add_option("--prompt-len", P, "prompt tokens per sequence (random ids)")->check(CLI::Range(1, 1 << 20));
  app.add_option("--new-tokens", N, "response tokens per trajectory (rollout.max_context = prompt + this)")
      ->check(CLI::Range(16, 1 << 20));
  app.add_option("--tool-every", every, "free samples before each steered tool call")->check(CLI::Range(1, 1 << 20));
  app.add_option("--workers", workers, "sandbox workers")->check(CLI::Range(1, 4096));
  app.add_option("--site-packages", site_packages, "sandbox.site_packages (true: as configs/retool.yaml)");
  app.add_option("--cuda-graphs", graphs, "rollout.cuda_graphs");
  app.add_option("--seed", seed, "sampling seed");
  app.add_option("--json", json_path, "write the records to this JSON file");
  CLI11_PARSE(app, argc, argv);
  std::optional<BenchModel> bench = load_bench_model("bench_rollout", model_dir, device, dtype);
  if (!bench) return 2;
  std::optional<Tokenizer> tok;
  try {
    tok.emplace(Tokenizer::from_checkpoint(tokenizer_dir));
  } catch (const std::exception& e) {
    std::cerr << "bench_rollout: " << e.what() << "\n";
    return 2;
  }
  const Transformer& model = *bench->model;
  const int64_t V = std::min(model.config().vocab_size, tok->vocab_size());
  const ToolProtocol protocol;  // <code>...</code>, replies in <interpreter> blocks
  const std::vector<int64_t> script = tok->encode("<code>\nprint(sum(i * i for i in range(1000)))\n</code>");
  const std::vector<int64_t> reply_end = tok->encode(protocol.reply_close);

  SandboxOptions so;
  so.workers = workers;
  so.site_packages = site_packages;
  so.timeout_s = 10;
  SandboxPool pool(so);
  ToolRunner tools = [&pool](const std::string& code) { return pool.submit(code); };

  // Random prompts of ordinary ids (below the tokenizer's and the model's vocabularies).
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<std::vector<int64_t>> prompts(B);
  for (auto& p : prompts) {
    at::Tensor ids = at::randint(std::min<int64_t>(V, 100000), {P}, gen, at::kLong);
    p.assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + P);
  }
  SamplingOptions sampling;
  sampling.samples_per_prompt = 1;
  sampling.seed = seed;
  ModelPolicyOptions po;
  po.cuda_graphs = graphs;

  struct Mode {
    std::string name;
    bool tools, multi_token, feed_graphs;
  };
  const std::vector<Mode> modes = {{"plain", false, true, true},
                                   {"tools", true, true, false},
                                   {"tools_feedgraphs", true, true, true},
                                   {"tools_onetoken", true, false, false}};
  struct PolicyCounts {
    int64_t compactions = 0, reallocations = 0, step_graphs = 0, feed_graphs = 0;
  };
  PolicyCounts counts;  // of the last run
  auto run = [&](const Mode& mode, int64_t new_tokens, RolloutStats& stats) {
    RolloutOptions o;
    o.tools = mode.tools;
    o.multi_token_feed = mode.multi_token;
    o.cuda_graphs = graphs;
    o.max_context = P + new_tokens;
    o.max_turns = 1 << 20;
    o.max_tool_calls = 1 << 20;
    o.progress_s = 0;
    SamplingOptions s = sampling;
    s.max_new_tokens = new_tokens;
    ModelPolicyOptions mpo = po;
    mpo.feed_graphs = mode.feed_graphs;
    ToolSteered policy(model, mpo, script, reply_end, mode.tools ? every : (1 << 30));
    auto out = rollout(policy, *tok, prompts, s, o, tools, {}, protocol, &stats);
    const ModelPolicy& inner = policy.inner();
    counts = {inner.compactions(), inner.reallocations(), inner.graph_captures() - inner.feed_graph_captures(),
              inner.feed_graph_captures()};
    return out;
  };
  // Warm-up: one whole run of every mode, so that kernels, the allocator, the sandbox pool and the
  // attention plans of every cache shape the runs meet (cuDNN builds one per new shape, ~40 ms each on an
  // H200, then caches it process-wide) stay out of the timed runs and no mode pays for the next one.
  for (const Mode& m : modes) {
    RolloutStats st;
    run(m, N, st);
  }
  std::cout << "model " << model_dir << ", " << dtype << " on " << device << ", batch " << B << ", prompt " << P
            << ", new " << N << ", a tool call every " << every << " free samples, " << workers << " sandbox workers\n";
  std::cout << std::left << std::setw(16) << "mode" << std::right << std::setw(10) << "sampled" << std::setw(8)
            << "calls" << std::setw(10) << "seconds" << std::setw(12) << "sampled/s" << std::setw(9) << "ratio"
            << std::setw(10) << "decode_s" << std::setw(9) << "feed_s" << std::setw(9) << "wait_s" << std::setw(8)
            << "steps" << std::setw(8) << "feeds" << std::setw(10) << "captures" << std::setw(12) << "compactions"
            << "\n";
  json records = json::array();
  double plain_tps = 0;
  for (const Mode& m : modes) {
    RolloutStats st;
    const auto trajs = run(m, N, st);
    int64_t sampled = 0, calls = 0;
    for (const auto& t : trajs) {
      sampled += t.sampled_tokens();
      calls += t.tool_calls;
    }
    const double tps = double(sampled) / st.total_s;
    if (m.name == "plain") plain_tps = tps;
    const double ratio = plain_tps > 0 ? tps / plain_tps : 0;
    std::cout << std::left << std::setw(16) << m.name << std::right << std::setw(10) << sampled << std::setw(8) << calls
              << std::setw(10) << std::fixed << std::setprecision(3) << st.total_s << std::setw(12)
              << std::setprecision(0) << tps << std::setw(9) << std::setprecision(3) << ratio << std::setw(10)
              << st.decode_s << std::setw(9) << st.feed_s << std::setw(9) << st.tool_wait_s << std::setw(8)
              << st.decode_steps << std::setw(8) << st.feed_steps << std::setw(10)
              << (std::to_string(counts.step_graphs) + "+" + std::to_string(counts.feed_graphs)) << std::setw(12)
              << (std::to_string(counts.compactions) + " (" + std::to_string(counts.reallocations) + " new)") << "\n";
    records.push_back({{"mode", m.name},
                       {"batch", B},
                       {"prompt_len", P},
                       {"new_tokens", N},
                       {"tool_every", every},
                       {"dtype", dtype},
                       {"sampled_tokens", sampled},
                       {"tool_calls", calls},
                       {"seconds", st.total_s},
                       {"sampled_tokens_per_s", tps},
                       {"ratio_to_plain", ratio},
                       {"prefill_s", st.prefill_s},
                       {"decode_s", st.decode_s},
                       {"feed_s", st.feed_s},
                       {"sample_s", st.sample_s},
                       {"tool_wait_s", st.tool_wait_s},
                       {"decode_steps", st.decode_steps},
                       {"feed_steps", st.feed_steps},
                       {"forced_tokens", st.forced_tokens},
                       {"cache_compactions", counts.compactions},
                       {"cache_reallocations", counts.reallocations},
                       {"step_graph_captures", counts.step_graphs},
                       {"feed_graph_captures", counts.feed_graphs}});
  }
  if (!json_path.empty()) {
    const auto parent = std::filesystem::path(json_path).parent_path();
    std::error_code ec;
    if (!parent.empty()) std::filesystem::create_directories(parent, ec);
    std::ofstream(json_path) << records.dump(1) << "\n";
  }
  return 0;
}
