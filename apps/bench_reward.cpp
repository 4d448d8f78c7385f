// bench_reward: what scoring a step's trajectories costs with the built-in boxed matcher (data/reward.h)
// and with a Python reward (reward.kind python, rollout/python_reward.h) on the sandbox's pool. The
// trajectories are made from a JSONL dataset's answers: a quarter each of the answer as written, an
// equivalent form (2n/2 for an integer n), a wrong answer, and an unclosed box, each after ~1 KB of
// LaTeX reasoning. Prints one JSON object: per-trajectory latency p50/p99 (the matcher's call; the
// script's reward() call in its interpreter) and each batch's wall time (--repeats batches; the pool's
// interpreters are started before the first). Bad flags or files are exit code 2.
//   build/bin/bench_reward --script examples/rewards/math_verify.py --trajectories 256 --workers 4
// With --reward-model DIR it measures reward.kind model instead (rollout/reward_model.h): each batch's
// conversations rendered and encoded on the host (RewardModel::encode on ATen's threads, as score_rewards
// once did), then scored (RewardModel::score, the device synchronized), with responses of --response-tokens
// random ids of the reward model's tokenizer decoded to text; the forwards' rate in TFLOP/s (model/flops.h);
// and the two overlapped (RewardModel::score_texts, as score_rewards calls it) on other new responses.
//   build/bin/bench_reward --reward-model DIR --device cuda --dtype bfloat16 --trajectories 256
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "apps/bench_common.h"
#include "common/memory.h"
#include "common/timing.h"
#include "data/dataset.h"
#include "data/reward.h"
#include "model/flops.h"
#include "rollout/python_reward.h"
#include "rollout/reward_model.h"

namespace {

using Clock = std::chrono::steady_clock;

using rlt::ms_since;
using rlt::percentile;

bool is_integer(const std::string& s) {
  if (s.empty() || s.size() > 17) return false;
  for (size_t i = s[0] == '-' ? 1 : 0; i < s.size(); ++i) {
    if (s[i] < '0' || s[i] > '9') return false;
  }
  return s != "-";
}

// A model-like response to a problem whose reference is `answer`, of one of four kinds (i % 4).
std::string make_response(const std::string& answer, int64_t i) {
  std::string text;
  for (int k = 0; k < 6; ++k) {
    text += "Let $a_" + std::to_string(k) + " = \\frac{" + std::to_string(3 * k + 1) + "}{" + std::to_string(k + 2) +
            "}$, so that $a_" + std::to_string(k) + "^2 + \\sqrt{" + std::to_string(k + 5) +
            "} \\cdot x = 0$ holds; substituting into the previous equation and simplifying gives the next step.\n";
  }
  const bool integer = is_integer(answer);
  switch (i % 4) {
    case 0:
      return text + "Answer: \\boxed{" + answer + "}";
    case 1:  // equivalent, in another form
      return text + "Answer: \\boxed{" +
             (integer ? "\\frac{" + std::to_string(2 * std::stoll(answer)) + "}{2}" : " " + answer + " ") + "}";
    case 2:  // wrong
      return text + "Answer: \\boxed{" + (integer ? std::to_string(std::stoll(answer) + 1) : answer + "+1") + "}";
    default:  // cut off inside its box
      return text + "Answer: \\boxed{" + answer;
  }
}

// reward.kind model over `set`'s prompts: a JSON object of the host's encoding and the device's scoring per
// batch (the first batch warms the device up and is reported apart).
nlohmann::ordered_json bench_reward_model(const std::string& dir, const rlt::Dataset& set, int64_t trajectories,
                                          int64_t response_tokens, int64_t token_budget, int64_t repeats,
                                          const std::string& device_name, const std::string& dtype_name,
                                          int64_t trace_top, bool share_prefixes, bool scored_rows_only,
                                          int64_t samples) {
  if (device_name == "cuda" && !at::hasCUDA()) throw std::invalid_argument("--device cuda but no CUDA device");
  const at::Device device = device_name == "cuda" ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  const at::ScalarType dtype = dtype_name == "bfloat16" ? at::kBFloat16 : at::kFloat;
  const auto t_load = Clock::now();
  rlt::RewardModel rm = rlt::RewardModel::load(dir, dtype, device, token_budget);
  rm.set_share_prefixes(share_prefixes);
  rm.set_last_layer_scored_rows_only(scored_rows_only);
  const double load_ms = ms_since(t_load);
  // Responses as a random policy writes them: random pieces of the vocabulary, decoded; new ones each batch,
  // as each step's are (the tokenizer's cache of pre-tokens does not already hold them).
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(/*seed=*/7);
  std::vector<double> encode_ms, score_ms, overlapped_ms, tokens, forwarded, tflops;  // per batch
  std::vector<std::vector<int64_t>> sequences;
  auto new_responses = [&] {
    std::vector<std::string> responses;
    for (int64_t i = 0; i < trajectories; ++i) {
      const at::Tensor ids = at::randint(rm.tokenizer().vocab_size(), {response_tokens}, gen, at::kLong);
      responses.push_back(rm.tokenizer().decode(
          std::vector<int64_t>(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + response_tokens)));
    }
    return responses;
  };
  auto texts_of = [&](const std::vector<std::string>& responses) {
    std::vector<rlt::RewardModel::Text> texts;
    for (int64_t i = 0; i < trajectories; ++i) {
      const rlt::PromptExample& ex = set.examples[(i / samples) % set.examples.size()];
      texts.push_back({ex.messages, ex.prompt, responses[i]});
    }
    return texts;
  };
  for (int64_t r = 0; r <= repeats; ++r) {
    const std::vector<std::string> responses = new_responses();
    const auto t_encode = Clock::now();
    const std::vector<rlt::RewardModel::Text> texts = texts_of(responses);
    sequences = rm.encode(texts);
    encode_ms.push_back(ms_since(t_encode));
    rlt::device_synchronize(device);
    const auto t_score = Clock::now();
    int64_t ran = 0;
    rm.score(sequences, &ran);
    rlt::device_synchronize(device);
    score_ms.push_back(ms_since(t_score));
    // The batch's whole sequences: their tokens and FLOPs (what the forwards would run without shared
    // prefixes), and the tokens the forwards did run.
    double n = 0, flops = 0;
    for (const auto& seq : sequences) {
      n += static_cast<double>(seq.size());
      flops += rlt::forward_flops(rm.model().config(), {static_cast<int64_t>(seq.size()), 0}).layers();
    }
    tokens.push_back(n);
    forwarded.push_back(static_cast<double>(ran));
    tflops.push_back(flops / (score_ms.back() / 1000) / 1e12);
    // The two overlapped, as score_rewards runs them (RewardModel::score_texts), on responses of their own.
    const std::vector<std::string> others = new_responses();
    const std::vector<rlt::RewardModel::Text> other_texts = texts_of(others);
    const auto t_both = Clock::now();
    rm.score_texts(other_texts);
    rlt::device_synchronize(device);
    overlapped_ms.push_back(ms_since(t_both));
  }
  nlohmann::ordered_json trace;
  if (trace_top > 0) {
    // One more scoring under the profiler: the device's busy time and the kernels that take it.
    const rlt::DeviceTrace t = rlt::trace_device(device, [&] { rm.score(sequences); });
    trace = {{"busy_ms", t.busy_ms}, {"activities", t.activities}};
    for (const std::string& name : t.top(static_cast<size_t>(trace_top)))
      trace["top"].push_back({{"name", name}, {"count", t.by_name.at(name).first}, {"ms", t.by_name.at(name).second}});
    for (const std::string& name : t.top(static_cast<size_t>(trace_top), &t.runtime))
      trace["runtime"].push_back(
          {{"name", name}, {"count", t.runtime.at(name).first}, {"ms", t.runtime.at(name).second}});
  }
  // The batches after the first (it warms the device up).
  auto timed = [](const std::vector<double>& v) { return std::vector<double>(v.begin() + 1, v.end()); };
  const std::vector<double> timed_encode = timed(encode_ms);
  return {{"dir", dir},
          {"device", device_name},
          {"dtype", dtype_name},
          {"token_budget", token_budget},
          {"share_prefixes", share_prefixes},
          {"scored_rows_only", scored_rows_only},
          {"trajectories", trajectories},
          {"samples", samples},
          {"response_tokens", response_tokens},
          {"encode_threads", at::get_num_threads()},
          {"load_ms", load_ms},
          {"warmup_encode_ms", encode_ms.front()},
          {"warmup_score_ms", score_ms.front()},
          {"tokens_scored", timed(tokens)},
          {"tokens_forwarded", timed(forwarded)},
          {"encode_ms", timed_encode},
          {"score_ms", timed(score_ms)},
          {"encode_and_score_ms", timed(overlapped_ms)},
          {"encode_us_per_trajectory", 1000 * percentile(timed_encode, 0.5) / static_cast<double>(trajectories)},
          {"score_whole_sequence_tflops", timed(tflops)},
          {"trace", trace}};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_reward: the built-in boxed matcher against a Python reward script, per trajectory and batch"};
  std::string script = "examples/rewards/math_verify.py", data = "data/dapo-math-17k-200.jsonl";
  std::string answer_key = "label";
  int64_t trajectories = 256, repeats = 3;
  rlt::SandboxOptions sandbox;
  std::string reward_model, device = "cpu", dtype = "float32";
  int64_t response_tokens = 512, token_budget = 16384, trace_top = 0, samples = 8;
  bool share_prefixes = true, scored_rows_only = true;
  app.add_option("--script", script, "the reward script (reward.script)")->check(CLI::ExistingFile);
  app.add_option("--data", data, "JSONL problems whose answers the responses are made from")->check(CLI::ExistingFile);
  app.add_option("--answer-key", answer_key, "the answer's key in --data");
  app.add_option("--trajectories", trajectories, "trajectories a batch (a step)")->check(CLI::Range(1, 1 << 20));
  app.add_option("--repeats", repeats, "batches scored by each path")->check(CLI::Range(1, 1000));
  app.add_option("--workers", sandbox.workers, "sandbox.workers")->check(CLI::Range(1, 4096));
  app.add_option("--timeout-s", sandbox.timeout_s, "sandbox.timeout_s, per trajectory")
      ->check(CLI::Range(0.01, 3600.0));
  app.add_option("--memory-mb", sandbox.memory_mb, "sandbox.memory_mb")->check(CLI::Range(16, 10000000));
  app.add_option("--reward-model", reward_model,
                 "a sequence-classification folder: measure reward.kind model instead of the two rewards")
      ->check(CLI::ExistingDirectory);
  app.add_option("--response-tokens", response_tokens, "random tokens a response (--reward-model)")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--token-budget", token_budget, "reward.model_batch_tokens (--reward-model)")
      ->check(CLI::Range(1, 1 << 24));
  app.add_option("--share-prefixes", share_prefixes, "answers to one prompt run its tokens once (--reward-model)");
  app.add_option("--scored-rows-only", scored_rows_only,
                 "the last layer over each sequence's last token alone (--reward-model)");
  app.add_option("--samples", samples, "answers a prompt, consecutive as a step lists them (--reward-model)")
      ->check(CLI::Range(1, 1 << 16));
  app.add_option("--trace-top", trace_top, "trace one more scoring and list its N longest kernels (--reward-model)")
      ->check(CLI::Range(0, 100));
  app.add_option("--device", device, "cpu | cuda (--reward-model)")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--dtype", dtype, "float32 | bfloat16 (--reward-model)")
      ->check(CLI::IsMember({"float32", "bfloat16"}));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  try {
    rlt::DatasetOptions d;
    d.path = data;
    d.answer_key = answer_key;
    const rlt::Dataset set = rlt::load_jsonl(d);
    if (!reward_model.empty()) {
      const nlohmann::ordered_json out{
          {"repeats", repeats},
          {"data", data},
          {"reward_model", bench_reward_model(reward_model, set, trajectories, response_tokens, token_budget, repeats,
                                              device, dtype, trace_top, share_prefixes, scored_rows_only, samples)}};
      std::cout << out.dump(2) << "\n";
      return 0;
    }
    std::vector<rlt::RewardQuery> queries;
    for (int64_t i = 0; i < trajectories; ++i) {
      const rlt::PromptExample& ex = set.examples[i % set.examples.size()];
      queries.push_back({ex.prompt, make_response(ex.answer, i), ex.answer});
    }

    // (a) The built-in matcher, one trajectory after another, as assign_rewards runs it.
    rlt::RewardOptions boxed;
    boxed.kind = rlt::RewardKind::kBoxed;
    std::vector<double> builtin_us, builtin_batch_ms;
    std::vector<bool> builtin_correct(trajectories);
    for (int64_t r = 0; r < repeats; ++r) {
      const auto t_batch = Clock::now();
      for (int64_t i = 0; i < trajectories; ++i) {
        const auto t0 = Clock::now();
        builtin_correct[i] = rlt::compute_reward(queries[i].response, queries[i].answer, 0, boxed).correct;
        builtin_us.push_back(1000 * ms_since(t0));
      }
      builtin_batch_ms.push_back(ms_since(t_batch));
    }

    // (b) The script on the pool, its interpreters started (and prestarted) before the first batch.
    rlt::RewardOptions python;
    python.kind = rlt::RewardKind::kPython;
    python.script = script;
    rlt::check_reward_script(script, sandbox);
    rlt::PythonReward reward(python, sandbox);
    std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the spares reach their stdin read
    std::vector<double> call_ms, batch_ms;
    int64_t errors = 0, agree = 0, correct = 0, checker_sum = 0, checkers = 0;
    for (int64_t r = 0; r < repeats; ++r) {
      const auto t_batch = Clock::now();
      const std::vector<rlt::ScriptScore> scores = reward.score(queries);
      batch_ms.push_back(ms_since(t_batch));
      for (int64_t i = 0; i < trajectories; ++i) {
        const rlt::ScriptScore& s = scores[i];
        call_ms.push_back(1000 * s.seconds);
        errors += s.failed;
        if (r > 0) continue;
        correct += s.correct;
        agree += s.correct == builtin_correct[i];
        if (s.fields.count("checker")) {
          checker_sum += static_cast<int64_t>(s.fields.at("checker"));
          ++checkers;
        }
      }
    }
    const double n = static_cast<double>(trajectories);
    const int64_t per_call = std::min<int64_t>(rlt::PythonReward::kMaxQueriesPerCall,
                                               (trajectories + sandbox.workers - 1) / sandbox.workers);
    nlohmann::ordered_json out{
        {"trajectories", trajectories},
        {"repeats", repeats},
        {"data", data},
        {"builtin",
         {{"per_trajectory_p50_us", percentile(builtin_us, 0.5)},
          {"per_trajectory_p99_us", percentile(builtin_us, 0.99)},
          {"batch_ms", builtin_batch_ms},
          {"accuracy", static_cast<double>(std::count(builtin_correct.begin(), builtin_correct.end(), true)) / n}}},
        {"python",
         {{"script", script},
          {"workers", sandbox.workers},
          {"calls_per_batch", (trajectories + per_call - 1) / per_call},
          {"checker_mean", checkers ? static_cast<double>(checker_sum) / checkers : 0.0},
          {"reward_call_p50_ms", percentile(call_ms, 0.5)},
          {"reward_call_p99_ms", percentile(call_ms, 0.99)},
          {"batch_ms", batch_ms},
          {"batch_ms_per_trajectory", percentile(batch_ms, 0.5) / n},
          {"errors", errors},
          {"accuracy", static_cast<double>(correct) / n},
          {"agreement_with_builtin", static_cast<double>(agree) / n}}}};
    std::cout << out.dump(2) << "\n";
  } catch (const rlt::DataError& e) {
    std::cerr << "bench_reward: data error: " << e.what() << "\n";
    return 2;
  } catch (const rlt::RewardScriptError& e) {
    std::cerr << "bench_reward: " << e.what() << "\n";
    return 2;
  } catch (const rlt::SandboxError& e) {
    std::cerr << "bench_reward: sandbox error: " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {  // the reward model's folder (RewardModelError, ModelConfigError, ...)
    std::cerr << "bench_reward: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
