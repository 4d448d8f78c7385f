// bench_rollout: the ReTool loop's sampled tokens/s with real sandboxed tool calls, beside plain decoding
// through the same loop at the same batch (the target: tools at 80% of plain or more).
//
// A random model writes no code, so each trajectory's turns are steered (tests/common/steered_policy.h):
// after --tool-every free samples, the logits are pushed (+1e4) to a fixed code block,
// "<code>\nprint(...)\n</code>", which the loop parses as a tool call and runs in the sandbox; the
// interpreter's reply comes back in the protocol's framing and the next turn starts free again. Everything
// else is the trainer's path: rollout() with DecodeEngine
// (CUDA graphs on a GPU), sample_tokens, a SandboxPool of real interpreters, trajectories ended by
// rollout.max_context = prompt + new tokens.
//
// Modes, run in this order in one process on the same prompts and seed:
//   plain                 tools off: --new-tokens sampled per trajectory
//   tools                 the steered loop with the rollout's defaults (rollout.multi_token_feed: a reply in
//                         one forward; rollout.feed_wait = 4: a ready reply waits up to 4 decode steps so
//                         that others share its forward; rollout.feed_graphs)
//   tools_eager           feed_wait 4 (--feed-wait sets it here and in the modes below that hold replies
//                         back; `tools` keeps the default), each feed an eager forward (feed_graphs off)
//   tools_graphs          feed_wait 4, each feed a replayed CUDA graph per (rows, tokens) bucket and span
//                         (feed_graphs on); at --feed-wait 4 one of these two repeats `tools`: their gap is
//                         the noise
//   tools_feednow         each reply fed at the next step (feed_wait 0), eager
//   tools_feednow_graphs  the same, feed graphs on
//   tools_merged          feed_wait 4, the pass's one-token rows taken in the feed (rollout.merge_feeds), eager
//   tools_onetoken        tool replies fed one token per decode step
//   spread_eager          tools_eager with the calls spread: row n's first call comes after
//                         every + (37 n mod every) free samples, so the rows do not all call at once
//                         (in the other modes every row calls after the same count, 64 calls at once into
//                         the sandbox's workers)
//   spread_graphs         the same with feed graphs on
//   spread_merged         spread_graphs with rollout.merge_feeds: merged passes (below), their graphs captured in
//                         the timed run as every graph of the modes not kept
//   plain_kept, tools_kept, spread_kept   plain, tools_graphs and spread_graphs with rollout.keep_cache:
//                         one engine for the warm-up run and the timed one, so the timed rollout replays
//                         the graphs the warm-up captured (as a training run's steps after the first);
//                         their ratio is to plain_kept
//   spread_merged_kept    spread_kept with rollout.merge_feeds: on a GPU (bf16, hd 64 or 128) a pass's one-token
//                         rows and replies run as one merged forward (DecodeEngine::merged_extend)
//   spread_merged_now_kept  the same with each reply fed at the next pass (feed_wait 0)
//   plain_spec, tools_spec, plain_kept_spec, tools_kept_spec   plain, tools, plain_kept and tools_kept with
//                         rollout.speculative: suffix (--draft-tokens, --speculative-max-rows): drafts from the
//                         rows' own text (a random model's rarely match; a steered call repeats the row's
//                         earlier ones), verified in one forward
// With --refill R, continuous batching against waves (tools off, trajectories of uneven lengths): R x batch
// prompts through batch rows, refilled as rows finish (rollout.max_batch = batch), against R rollouts of
// batch prompts one after the other (records lengths_waves, lengths_refill).
// Prints a table; --json writes the records {mode, batch, prompt_len, new_tokens, sampled_tokens,
// tool_calls, seconds, sampled_tokens_per_s, ratio_to_plain, decode_s, feed_s, tool_wait_s, decode_steps,
// feed_steps, speculative, verify_passes, drafted_tokens, accepted_tokens, verify_sampled, verify_sampling_rows
// (RolloutStats' speculation counts, --speculative suffix), tail_passes and tail_s (decode passes of at most 16
// rows, and their seconds), feed_wait, merge_feeds, feed_graphs, forced_tokens, cache_compactions, cache_reallocations
// (of them, those that made new cache tensors), step_graph_captures, feed_graph_captures, capture_s (host seconds in
// those captures), spread, compact_s (host seconds in compactions), step_gpu_s and feed_gpu_s (device seconds
// of the replayed step and feed graphs, CUDA events), step_gpu_by_span {span: [steps, device seconds]}, steer_s
// (host seconds the bench's steering took, inside decode_s and feed_s), turn_s (of sample_s, the host reading the
// sampled tokens: turn ends, tool calls sent), tool_latency_s (summed over the calls: submitted to collected;
// tool_run_s of it the sandbox's own clock, SandboxResult::wall_ms),
// tool_wait_row_steps and feed_wait_row_steps (sequences that sat out a decode step waiting on a tool call, or
// holding a reply back for a shared feed, summed over the steps; the table prints them per sequence, with
// call_ms, a call's mean latency)};
// --modes runs only the listed ones (plain always, for the ratio); with --refill also
// {mode lengths_waves | lengths_refill, batch, prompts, prompt_len, new_tokens_min, new_tokens_max,
// sampled_tokens, seconds, sampled_tokens_per_s, ratio_to_waves, prefill_s, decode_s, decode_steps, refills,
// cache_compactions, cache_reallocations, step_graph_captures}, the counts summed over the waves' rollouts.
#include <ATen/core/grad_mode.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <functional>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "apps/bench_common.h"
#include "common/memory.h"
#include "data/tokenizer.h"
#include "rollout/retool.h"
#include "tests/common/steered_policy.h"

using namespace rlt;
using json = nlohmann::json;
using rlt::testing::SteeredPolicy;
using rlt::testing::SteerOptions;

namespace {

// A DecodeEngine's counters: what it has done so far, or (since()) during one rollout.
struct PolicyCounts {
  int64_t compactions = 0, reallocations = 0, step_graphs = 0, feed_graphs = 0;
  double capture_s = 0, compact_s = 0;
  int64_t span_slots = 0;  // summed over the graphed steps (DecodeEngine::step_span_slots)
  // The replayed graphs' device time (DecodeEngine::step_replay_times, feed_replay_time).
  std::map<int64_t, DecodeEngine::ReplayTime> step_replays;  // span -> graphed steps
  DecodeEngine::ReplayTime feed_replays;
  static PolicyCounts of(DecodeEngine& p) {
    return {p.compactions(),         p.reallocations(),     p.graph_captures() - p.feed_graph_captures(),
            p.feed_graph_captures(), p.capture_seconds(),   p.compact_seconds(),
            p.step_span_slots(),     p.step_replay_times(), p.feed_replay_time()};
  }
  PolicyCounts since(const PolicyCounts& b) const {
    PolicyCounts d{compactions - b.compactions,
                   reallocations - b.reallocations,
                   step_graphs - b.step_graphs,
                   feed_graphs - b.feed_graphs,
                   capture_s - b.capture_s,
                   compact_s - b.compact_s,
                   span_slots - b.span_slots,
                   {},
                   {feed_replays.count - b.feed_replays.count, feed_replays.seconds - b.feed_replays.seconds}};
    for (const auto& [span, t] : step_replays) {
      const auto it = b.step_replays.find(span);
      const DecodeEngine::ReplayTime before = it == b.step_replays.end() ? DecodeEngine::ReplayTime{} : it->second;
      if (t.count > before.count) d.step_replays[span] = {t.count - before.count, t.seconds - before.seconds};
    }
    return d;
  }
  DecodeEngine::ReplayTime step_replay_total() const {
    DecodeEngine::ReplayTime all;
    for (const auto& [span, t] : step_replays) all.count += t.count, all.seconds += t.seconds;
    return all;
  }
};

// ---- Options ----

struct Options {
  std::string model_dir, device = "cpu", dtype = "bfloat16", json_path, tokenizer_dir;
  int64_t B = 64, P = 256, N = 512, every = 96, workers = 16, nice = SandboxOptions{}.nice, feed_wait = 4;
  bool site_packages = true, graphs = true, prestart = SandboxOptions{}.prestart,
       squeeze = EngineOptions{}.squeeze_holes, step_ahead = EngineSwitches{}.step_ahead;
  uint64_t seed = 1;
  std::vector<std::string> only;  // --modes
  int64_t refill = 0;
  int64_t draft_tokens = RolloutOptions{}.draft_tokens;
  int64_t speculative_max_rows = RolloutOptions{}.speculative_max_rows;
};

// The exit code when the program should stop here (--help, a bad option); nullopt to go on.
std::optional<int> parse_options(int argc, char** argv, Options& o) {
  CLI::App app{"bench_rollout: the ReTool loop's sampled tokens/s with sandboxed tool calls, beside plain decoding"};
  add_model_options(app, o.model_dir, o.device, o.dtype, o.B);
  app.add_option("--tokenizer", o.tokenizer_dir, "folder with tokenizer.json (a checkpoint's tokenizer files)")
      ->required();
  app.add_option("--prompt-len", o.P, "prompt tokens per sequence (random ids)")->check(CLI::Range(1, 1 << 20));
  app.add_option("--new-tokens", o.N, "response tokens per trajectory (rollout.max_context = prompt + this)")
      ->check(CLI::Range(16, 1 << 20));
  app.add_option("--tool-every", o.every, "free samples before each steered tool call")->check(CLI::Range(1, 1 << 20));
  app.add_option("--workers", o.workers, "sandbox workers")->check(CLI::Range(1, 4096));
  app.add_option("--feed-wait", o.feed_wait,
                 "rollout.feed_wait of the modes that hold replies back (not tools, *_feednow or tools_onetoken)")
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--site-packages", o.site_packages, "sandbox.site_packages (true: as configs/retool.yaml)");
  app.add_option("--nice", o.nice, "sandbox.nice: added to the interpreters' niceness")->check(CLI::Range(0, 19));
  app.add_option("--prestart", o.prestart,
                 "sandbox.prestart: each worker's next interpreter started ahead of its call");
  app.add_option("--cuda-graphs", o.graphs, "rollout.cuda_graphs");
  app.add_option("--step-ahead", o.step_ahead,
                 "rollout.step_ahead: a graphed step starts the next one before the host reads its draw");
  app.add_option("--squeeze-holes", o.squeeze,
                 "EngineOptions::squeeze_holes: squeeze the cache's holes once they cost a step's span a chunk");
  app.add_option("--seed", o.seed, "sampling seed");
  app.add_option("--draft-tokens", o.draft_tokens, "rollout.draft_tokens (the *_spec modes)")->check(CLI::Range(1, 7));
  app.add_option("--speculative-max-rows", o.speculative_max_rows, "rollout.speculative_max_rows (the *_spec modes)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 40));
  app.add_option("--json", o.json_path, "write the records to this JSON file");
  app.add_option("--modes", o.only, "run only these modes (comma-separated; plain always runs)")->delimiter(',');
  app.add_option("--refill", o.refill,
                 "also compare continuous batching: R x batch prompts of uneven lengths (new/4 to new tokens, "
                 "tools off) through batch rows, refilled (rollout.max_batch) against R waves of batch prompts")
      ->check(CLI::Range(0, 64));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return std::nullopt;
}

// ---- The model, the tokenizer, the sandbox and the prompts ----

struct Setup {
  std::optional<BenchModel> bench;
  std::optional<Tokenizer> tok;
  ToolProtocol protocol;           // <code>...</code>, replies in <interpreter> blocks
  std::vector<int64_t> script;     // the steered tool call
  std::vector<int64_t> reply_end;  // the reply's last tokens: the next turn starts
  std::unique_ptr<SandboxPool> pool;
  ToolRunner tools;
  std::vector<std::vector<int64_t>> prompts;
  SamplingOptions sampling;
  EngineOptions po;
  const Transformer& model() const { return *bench->model; }
};

// nullptr after printing the error (exit code 2).
std::unique_ptr<Setup> build_setup(const Options& o) {
  std::optional<BenchModel> bench = load_bench_model("bench_rollout", o.model_dir, o.device, o.dtype);
  if (!bench) return nullptr;
  auto s = std::make_unique<Setup>();
  s->bench.emplace(std::move(*bench));
  try {
    s->tok.emplace(Tokenizer::from_checkpoint(o.tokenizer_dir));
  } catch (const std::exception& e) {
    std::cerr << "bench_rollout: " << e.what() << "\n";
    return nullptr;
  }
  const Tokenizer& tok = *s->tok;
  const int64_t V = std::min(s->model().config().vocab_size, tok.vocab_size());
  s->script = tok.encode("<code>\nprint(sum(i * i for i in range(1000)))\n</code>");
  s->reply_end = tok.encode(s->protocol.reply_close);

  SandboxOptions so;
  so.workers = o.workers;
  so.site_packages = o.site_packages;
  so.prestart = o.prestart;
  so.nice = o.nice;
  so.timeout_s = 10;
  s->pool = std::make_unique<SandboxPool>(so);
  s->tools = [pool = s->pool.get()](const std::string& code) { return pool->submit(code); };

  // Random prompts of ordinary ids (below the tokenizer's and the model's vocabularies).
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(o.seed);
  s->prompts.resize(o.B);
  for (auto& p : s->prompts) {
    at::Tensor ids = at::randint(std::min<int64_t>(V, 100000), {o.P}, gen, at::kLong);
    p.assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + o.P);
  }
  s->sampling.samples_per_prompt = 1;
  s->sampling.seed = o.seed;
  s->po.switches.cuda_graphs = o.graphs;
  s->po.switches.step_ahead = o.step_ahead;
  s->po.squeeze_holes = o.squeeze;
  return s;
}

// ---- The modes ----

struct Mode {
  std::string name;
  bool tools, multi_token, feed_graphs;
  int64_t feed_wait;
  bool merge_feeds, spread;
  bool keep = false;         // rollout.keep_cache: one engine for the warm-up and the timed run
  bool speculative = false;  // rollout.speculative: suffix
};

// The modes in their order, those --modes leaves out removed (plain and plain_kept always run); nullopt
// after printing an unknown name.
std::optional<std::vector<Mode>> select_modes(const Options& o) {
  const RolloutOptions defaults;
  const int64_t wait = o.feed_wait;  // --feed-wait: the modes that hold replies back
  std::vector<Mode> modes = {
      {"plain", false, true, defaults.engine.feed_graphs, defaults.feed_wait, defaults.merge_feeds, false},
      {"tools", true, true, defaults.engine.feed_graphs, defaults.feed_wait, defaults.merge_feeds, false},
      {"tools_eager", true, true, false, wait, false, false},
      {"tools_graphs", true, true, true, wait, false, false},
      {"tools_feednow", true, true, false, 0, false, false},
      {"tools_feednow_graphs", true, true, true, 0, false, false},
      {"tools_merged", true, true, false, wait, true, false},
      {"tools_onetoken", true, false, false, 0, false, false},
      {"spread_eager", true, true, false, wait, false, true},
      {"spread_graphs", true, true, true, wait, false, true},
      {"spread_merged", true, true, true, wait, true, true},
      {"plain_kept", false, true, true, wait, false, false, true},
      {"tools_kept", true, true, true, wait, false, false, true},
      {"spread_kept", true, true, true, wait, false, true, true},
      {"spread_merged_kept", true, true, true, wait, true, true, true},
      {"spread_merged_now_kept", true, true, true, 0, true, true, true},
      {"plain_spec", false, true, defaults.engine.feed_graphs, defaults.feed_wait, defaults.merge_feeds, false, false,
       true},
      {"tools_spec", true, true, defaults.engine.feed_graphs, defaults.feed_wait, defaults.merge_feeds, false, false,
       true},
      {"plain_kept_spec", false, true, true, wait, false, false, true, true},
      {"tools_kept_spec", true, true, true, wait, false, false, true, true}};
  if (o.only.empty()) return modes;
  for (const std::string& name : o.only) {
    if (std::none_of(modes.begin(), modes.end(), [&](const Mode& m) { return m.name == name; })) {
      std::cerr << "bench_rollout: --modes: no mode " << name << "\n";
      return std::nullopt;
    }
  }
  modes.erase(std::remove_if(modes.begin(), modes.end(),
                             [&](const Mode& m) {
                               return m.name != "plain" && m.name != "plain_kept" &&
                                      std::find(o.only.begin(), o.only.end(), m.name) == o.only.end();
                             }),
              modes.end());
  return modes;
}

// One rollout of a mode and what it cost.
struct ModeRun {
  std::vector<Trajectory> trajs;
  RolloutStats stats;
  PolicyCounts counts;  // the policy's counters during this rollout
  double steer_s = 0;   // host seconds steering (SteeredPolicy)
};

// Runs the modes' rollouts; the keep modes' policies stay from one run of a mode to the next.
class ModeRunner {
 public:
  ModeRunner(const Options& o, const Setup& s) : o_(o), s_(s) {}

  ModeRun run(const Mode& mode) {
    RolloutOptions ro;
    ro.tools = mode.tools;
    ro.multi_token_feed = mode.multi_token;
    ro.feed_wait = mode.feed_wait;
    ro.merge_feeds = mode.merge_feeds;
    ro.engine.feed_graphs = mode.feed_graphs;  // what the trainer passes on (engine_options); set below directly
    ro.engine.cuda_graphs = o_.graphs;
    ro.engine.step_ahead = o_.step_ahead;
    ro.max_context = o_.P + o_.N;
    ro.max_turns = 1 << 20;
    ro.max_tool_calls = 1 << 20;
    ro.progress_s = 0;
    ro.speculative = mode.speculative ? Speculative::kSuffix : Speculative::kNone;
    ro.draft_tokens = o_.draft_tokens;
    ro.speculative_max_rows = o_.speculative_max_rows;
    SamplingOptions smp = s_.sampling;
    smp.max_new_tokens = o_.N;
    EngineOptions mpo = s_.po;
    mpo.switches.feed_graphs = mode.feed_graphs;
    mpo.switches.keep_cache = mode.keep;
    std::unique_ptr<SteeredPolicy>& policy = kept_[mode.name];
    if (!policy || !mode.keep) {
      SteerOptions steer;
      steer.scripts = {s_.script};
      steer.reply_end = s_.reply_end;
      steer.free_before = mode.tools ? o_.every : (1 << 30);
      steer.spread = mode.spread;
      policy = std::make_unique<SteeredPolicy>(s_.model(), steer, mpo);
    }
    DecodeEngine& inner = policy->inner();
    const PolicyCounts before = PolicyCounts::of(inner);  // a kept engine's counters include earlier runs
    const double steer_before = policy->steer_seconds();
    ModeRun r;
    r.trajs = rollout(*policy, *s_.tok, s_.prompts, smp, ro, s_.tools, {}, s_.protocol, &r.stats);
    r.counts = PolicyCounts::of(inner).since(before);
    r.steer_s = policy->steer_seconds() - steer_before;
    return r;
  }

 private:
  const Options& o_;
  const Setup& s_;
  std::map<std::string, std::unique_ptr<SteeredPolicy>> kept_;  // the keep modes' policies, by mode
};

void print_modes_header(const Options& o) {
  std::cout << "model " << o.model_dir << ", " << o.dtype << " on " << o.device << ", batch " << o.B << ", prompt "
            << o.P << ", new " << o.N << ", a tool call every " << o.every << " free samples, " << o.workers
            << " sandbox workers" << (o.prestart ? " (prestarted)" : "") << ", nice " << o.nice << "\n";
  std::cout << std::left << std::setw(26) << "mode" << std::right << std::setw(10) << "sampled" << std::setw(8)
            << "calls" << std::setw(10) << "seconds" << std::setw(12) << "sampled/s" << std::setw(9) << "ratio"
            << std::setw(10) << "decode_s" << std::setw(9) << "feed_s" << std::setw(9) << "wait_s" << std::setw(8)
            << "steps" << std::setw(8) << "feeds" << std::setw(10) << "captures" << std::setw(10) << "capture_s"
            << std::setw(12) << "compactions" << std::setw(7) << "span" << std::setw(11) << "step_ms" << std::setw(10)
            << "gpu_ms" << std::setw(10) << "feed_ms" << std::setw(10) << "gpu_ms" << std::setw(9) << "steer_s"
            << std::setw(9) << "call_ms" << std::setw(8) << "run_ms" << std::setw(10) << "sat_tool" << std::setw(10)
            << "sat_feed"
            << "\n";
}

// Prints a mode's row of the table and returns its record. ratio: to plain decoding with the same policy
// setting (plain, or plain_kept for the keep modes).
json report_mode(const Options& o, const Mode& m, const ModeRun& r, int64_t sampled, int64_t calls, double tps,
                 double ratio) {
  const RolloutStats& st = r.stats;
  const PolicyCounts& counts = r.counts;
  const double mean_span = st.decode_steps > 0 ? double(counts.span_slots) / double(st.decode_steps) : 0;
  const DecodeEngine::ReplayTime step_gpu = counts.step_replay_total();
  auto per = [](double s, int64_t n) { return n > 0 ? 1e3 * s / double(n) : 0.0; };  // ms each
  std::cout << std::left << std::setw(26) << m.name << std::right << std::setw(10) << sampled << std::setw(8) << calls
            << std::setw(10) << std::fixed << std::setprecision(3) << st.total_s << std::setw(12)
            << std::setprecision(0) << tps << std::setw(9) << std::setprecision(3) << ratio << std::setw(10)
            << st.decode_s << std::setw(9) << st.feed_s << std::setw(9) << st.tool_wait_s << std::setw(8)
            << st.decode_steps << std::setw(8) << st.feed_steps << std::setw(10)
            << (std::to_string(counts.step_graphs) + "+" + std::to_string(counts.feed_graphs)) << std::setw(10)
            << std::setprecision(3) << counts.capture_s << std::setw(12)
            << (std::to_string(counts.compactions) + " (" + std::to_string(counts.reallocations) + " new)")
            << std::setw(7) << std::setprecision(0) << mean_span << std::setprecision(3) << std::setw(11)
            << per(st.decode_s, st.decode_steps) << std::setw(10) << per(step_gpu.seconds, step_gpu.count)
            << std::setw(10) << per(st.feed_s, st.feed_steps) << std::setw(10)
            << per(counts.feed_replays.seconds, counts.feed_replays.count) << std::setw(9) << r.steer_s << std::setw(9)
            << per(st.tool_latency_s, calls) << std::setw(8) << per(st.tool_run_s, calls) << std::setw(10)
            << std::setprecision(1) << double(st.tool_wait_row_steps) / double(r.trajs.size()) << std::setw(10)
            << double(st.feed_wait_row_steps) / double(r.trajs.size()) << "\n";
  json by_span = json::object();
  for (const auto& [span, t] : counts.step_replays) by_span[std::to_string(span)] = {t.count, t.seconds};
  return {{"mode", m.name},
          {"batch", o.B},
          {"prompt_len", o.P},
          {"new_tokens", o.N},
          {"tool_every", o.every},
          {"prestart", o.prestart},
          {"nice", o.nice},
          {"dtype", o.dtype},
          {"sampled_tokens", sampled},
          {"tool_calls", calls},
          {"seconds", st.total_s},
          {"sampled_tokens_per_s", tps},
          {"ratio_to_plain", ratio},
          {"prefill_s", st.prefill_s},
          {"decode_s", st.decode_s},
          {"feed_s", st.feed_s},
          {"sample_s", st.sample_s},
          {"turn_s", st.turn_s},
          {"tool_wait_s", st.tool_wait_s},
          {"tool_latency_s", st.tool_latency_s},
          {"tool_run_s", st.tool_run_s},
          {"tool_wait_row_steps", st.tool_wait_row_steps},
          {"feed_wait_row_steps", st.feed_wait_row_steps},
          {"decode_steps", st.decode_steps},
          {"feed_steps", st.feed_steps},
          {"speculative", m.speculative},
          {"verify_passes", st.verify_passes},
          {"drafted_tokens", st.drafted_tokens},
          {"accepted_tokens", st.accepted_tokens},
          {"verify_sampled", st.verify_sampled},
          {"verify_sampling_rows", st.verify_sampling_rows},
          {"tail_passes", st.tail_passes},
          {"tail_s", st.tail_s},
          {"feed_wait", m.feed_wait},
          {"merge_feeds", m.merge_feeds},
          {"feed_graphs", m.feed_graphs},
          {"spread", m.spread},
          {"keep_cache", m.keep},
          {"forced_tokens", st.forced_tokens},
          {"cache_compactions", counts.compactions},
          {"cache_reallocations", counts.reallocations},
          {"step_graph_captures", counts.step_graphs},
          {"feed_graph_captures", counts.feed_graphs},
          {"capture_s", counts.capture_s},
          {"mean_step_span", mean_span},
          {"squeeze_holes", o.squeeze},
          {"step_ahead", o.step_ahead},
          {"compact_s", counts.compact_s},
          {"steer_s", r.steer_s},
          {"step_gpu_s", step_gpu.seconds},
          {"feed_gpu_s", counts.feed_replays.seconds},
          {"feed_replays", counts.feed_replays.count},
          {"step_gpu_by_span", by_span}};
}

// Every mode once untimed, then once timed with its row printed; returns the timed runs' records.
json measure_modes(const Options& o, const Setup& s, const std::vector<Mode>& modes) {
  ModeRunner runner(o, s);
  // Warm-up: one whole run of every mode, so that kernels, the allocator, the sandbox pool and the
  // attention plans of every cache shape the runs meet (cuDNN builds one per new shape, ~40 ms each on an
  // H200, then caches it process-wide) stay out of the timed runs and no mode pays for the next one.
  for (const Mode& m : modes) runner.run(m);
  print_modes_header(o);
  json records = json::array();
  double plain_tps = 0, plain_kept_tps = 0;
  for (const Mode& m : modes) {
    const ModeRun r = runner.run(m);
    int64_t sampled = 0, calls = 0;
    for (const auto& t : r.trajs) {
      sampled += t.sampled_tokens();
      calls += t.tool_calls;
    }
    const double tps = double(sampled) / r.stats.total_s;
    if (m.name == "plain") plain_tps = tps;
    if (m.name == "plain_kept") plain_kept_tps = tps;
    const double base = m.keep ? plain_kept_tps : plain_tps;  // plain decoding with the same policy setting
    records.push_back(report_mode(o, m, r, sampled, calls, tps, base > 0 ? tps / base : 0));
  }
  return records;
}

// ---- Continuous batching against waves ----

// What the rollouts of one side took, summed over them (the waves').
struct Outcome {
  int64_t sampled = 0, steps = 0, refills = 0;
  double seconds = 0, decode_s = 0, prefill_s = 0;
  PolicyCounts counts;
};

// Tools off: R x B prompts whose trajectories end (EOS, steered) after new/4 to new tokens, a length fixed
// per prompt. Waves: R rollouts of B prompts each, every one as long as its longest trajectory. Refill: one
// rollout holding B rows, finished rows taking the next prompts (rollout.max_batch = B; an eighth of the
// rows at a time). Prints the comparison and appends its records.
void measure_refill(const Options& o, const Setup& s, json& records) {
  const int64_t B = o.B, N = o.N;
  std::vector<std::vector<int64_t>> all;
  for (int64_t r = 0; r < o.refill; ++r) all.insert(all.end(), s.prompts.begin(), s.prompts.end());
  const int64_t lo = std::max<int64_t>(1, N / 4);
  auto budget = [lo, N](int64_t n) {
    uint64_t h = static_cast<uint64_t>(n) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 31;
    return lo + static_cast<int64_t>(h % static_cast<uint64_t>(N - lo + 1));
  };
  auto run_lengths = [&](const std::vector<std::vector<int64_t>>& ps, int64_t first, int64_t max_batch,
                         RolloutStats& stats) {
    RolloutOptions ro;
    ro.tools = false;
    ro.engine.cuda_graphs = o.graphs;
    ro.max_context = o.P + N;
    ro.max_batch = max_batch;
    ro.progress_s = 0;
    SamplingOptions smp = s.sampling;
    smp.max_new_tokens = N;
    SteerOptions steer;
    steer.scripts = {s.script};
    steer.reply_end = s.reply_end;
    steer.free_before = 1 << 30;
    SteeredPolicy policy(s.model(), steer, s.po);
    policy.set_lengths(s.tok->eos_id(), budget, first);
    auto out = rollout(policy, *s.tok, ps, smp, ro, s.tools, {}, s.protocol, &stats);
    return std::make_pair(std::move(out), PolicyCounts::of(policy.inner()));
  };
  auto measure = [&](bool waves) {
    Outcome oc;
    auto add = [&](const std::pair<std::vector<Trajectory>, PolicyCounts>& run, const RolloutStats& st) {
      for (const auto& t : run.first) oc.sampled += t.sampled_tokens();
      oc.counts.compactions += run.second.compactions;
      oc.counts.reallocations += run.second.reallocations;
      oc.counts.step_graphs += run.second.step_graphs;
      oc.seconds += st.total_s;
      oc.decode_s += st.decode_s;
      oc.prefill_s += st.prefill_s;
      oc.steps += st.decode_steps;
      oc.refills += st.refills;
    };
    if (waves) {
      for (int64_t r = 0; r < o.refill; ++r) {
        RolloutStats st;
        const std::vector<std::vector<int64_t>> wave(all.begin() + r * B, all.begin() + (r + 1) * B);
        add(run_lengths(wave, r * B, 0, st), st);
      }
    } else {
      RolloutStats st;
      add(run_lengths(all, 0, B, st), st);
    }
    return oc;
  };
  measure(false);  // warm-up (shapes, plans, allocator)
  measure(true);
  std::cout << "\ncontinuous batching: " << o.refill * B << " prompts of " << lo << "-" << N << " tokens through " << B
            << " rows, tools off\n"
            << std::left << std::setw(10) << "mode" << std::right << std::setw(10) << "sampled" << std::setw(10)
            << "seconds" << std::setw(12) << "sampled/s" << std::setw(9) << "ratio" << std::setw(10) << "decode_s"
            << std::setw(10) << "prefill_s" << std::setw(8) << "steps" << std::setw(9) << "refills"
            << "\n";
  double waves_tps = 0;
  for (bool waves : {true, false}) {
    const Outcome oc = measure(waves);
    const double tps = double(oc.sampled) / oc.seconds;
    if (waves) waves_tps = tps;
    const std::string name = waves ? "waves" : "refill";
    std::cout << std::left << std::setw(10) << name << std::right << std::setw(10) << oc.sampled << std::setw(10)
              << std::fixed << std::setprecision(3) << oc.seconds << std::setw(12) << std::setprecision(0) << tps
              << std::setw(9) << std::setprecision(3) << tps / waves_tps << std::setw(10) << oc.decode_s
              << std::setw(10) << oc.prefill_s << std::setw(8) << oc.steps << std::setw(9) << oc.refills << "\n";
    records.push_back({{"mode", "lengths_" + name},
                       {"batch", B},
                       {"prompts", o.refill * B},
                       {"prompt_len", o.P},
                       {"new_tokens_min", lo},
                       {"new_tokens_max", N},
                       {"dtype", o.dtype},
                       {"sampled_tokens", oc.sampled},
                       {"seconds", oc.seconds},
                       {"sampled_tokens_per_s", tps},
                       {"ratio_to_waves", tps / waves_tps},
                       {"prefill_s", oc.prefill_s},
                       {"decode_s", oc.decode_s},
                       {"decode_steps", oc.steps},
                       {"refills", oc.refills},
                       {"cache_compactions", oc.counts.compactions},
                       {"cache_reallocations", oc.counts.reallocations},
                       {"step_graph_captures", oc.counts.step_graphs}});
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (const std::optional<int> code = parse_options(argc, argv, o)) return *code;
  const std::unique_ptr<Setup> setup = build_setup(o);
  if (!setup) return 2;
  const std::optional<std::vector<Mode>> modes = select_modes(o);
  if (!modes) return 2;
  json records = measure_modes(o, *setup, *modes);
  if (o.refill > 0) measure_refill(o, *setup, records);
  if (!o.json_path.empty()) write_json_records(o.json_path, records);
  return 0;
}
