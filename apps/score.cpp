// score: per-token log-probs of one sequence under a checkpoint, computed the way training computes them
// (hidden states -> the loss module, loss.impl and its options from --config/--set), so any path can be
// checked against transformers from the command line. logprobs[i] = log p(ids[i+1] | ids[0..i]), i < L-1.
// Leaves out: batches, sampling, chat templates; one sequence scored with full attention from position 0.
#include <ATen/core/grad_mode.h>
#include <sentencepiece_processor.h>

#include <CLI/CLI.hpp>
#include <cstdint>
#include <iomanip>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "common/config.h"
#include "loss/logprob.h"
#include "model/config.h"
#include "model/safetensors.h"
#include "model/transformer.h"

using namespace rlt;
using json = nlohmann::json;

namespace {

// Bad input: printed as "score: <message>" on stderr, exit code 2.
struct UsageError {
  std::string message;
};

// "1,2,3" -> {1, 2, 3}. Every item must be a non-negative decimal integer (spaces around it allowed);
// the vocabulary bound is checked once the model is loaded.
std::vector<int64_t> parse_ids(const std::string& s) {
  std::vector<int64_t> ids;
  size_t start = 0;
  while (true) {
    const size_t comma = s.find(',', start);
    std::string item = s.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    const size_t b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
    item = b == std::string::npos ? "" : item.substr(b, e - b + 1);
    if (item.empty()) throw UsageError{"--ids \"" + s + "\": empty item " + std::to_string(ids.size() + 1)};
    int64_t v = 0;
    for (char c : item) {
      if (c < '0' || c > '9') {
        throw UsageError{"--ids \"" + s + "\": item " + std::to_string(ids.size() + 1) + " \"" + item +
                         "\" is not a non-negative integer"};
      }
      if (v > (std::numeric_limits<int64_t>::max() - (c - '0')) / 10) {
        throw UsageError{"--ids \"" + s + "\": item \"" + item + "\" is out of range"};
      }
      v = v * 10 + (c - '0');
    }
    ids.push_back(v);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return ids;
}

// `s` left-aligned in `width` columns, counting UTF-8 code points rather than bytes (pieces hold "▁").
std::string padded(const std::string& s, size_t width) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return s + std::string(n < width ? width - n : 0, ' ');
}

// Loads the checkpoint folder; every failure of the model code (missing or bad config.json, missing or
// corrupt safetensors, a shape mismatch) becomes a UsageError naming the folder.
Transformer load_model(const std::string& dir, at::ScalarType dtype, const at::Device& device) {
  try {
    return Transformer::load(dir, dtype, device);
  } catch (const ModelConfigError& e) {
    throw UsageError{"--model " + dir + ": bad model config: " + e.what()};
  } catch (const safetensors::Error& e) {
    throw UsageError{"--model " + dir + ": bad checkpoint: " + e.what()};
  } catch (const c10::Error& e) {
    throw UsageError{"--model " + dir + ": cannot load: " + e.what_without_backtrace()};
  } catch (const std::exception& e) {
    throw UsageError{"--model " + dir + ": cannot load: " + e.what()};
  }
}

// Log-probs (L-1) fp32/fp64 on the model's device of ids[1:] given their prefixes, through the loss module.
at::Tensor score_ids(const Transformer& model, const at::Tensor& ids /*(L)*/, const LossOptions& options) {
  at::NoGradGuard ng;
  const int64_t L = ids.size(0);
  at::Tensor positions = at::arange(L, ids.options()).unsqueeze(0);                  // (1, L)
  at::Tensor h = model.forward(ids.unsqueeze(0), positions, /*attention_mask=*/{});  // (1, L, D)
  LogprobInputs in;
  in.hidden = h.select(0, 0).narrow(0, 0, L - 1).contiguous();  // (L-1, D): row i predicts ids[i+1]
  in.lm_head = model.lm_head();                                 // (V, D)
  in.targets = ids.narrow(0, 1, L - 1).contiguous();            // (L-1)
  in.logit_softcap = model.config().final_softcap;              // gemma2: 30; else 0
  return token_logprobs(in, options).logprobs;                  // (L-1)
}

// score reads one section, the loss module's options (the same keys as the trainer's `loss:`).
struct ScoreConfig {
  LossOptions loss;
  template <class V>
  void visit_sections(V&& v) {
    v("loss", loss, "log-prob module: paths, row selection, chunking, entropy");
  }
};

int run(int argc, char** argv) {
  CLI::App app{
      "score: per-token log-probs of one sequence under a checkpoint, through the loss module "
      "(loss.impl and the other loss.* options apply). logprobs[i] is log p(ids[i+1] | ids[0..i])."};
  ConfigCli cc;
  add_config_flags(app, cc);
  std::string model_dir, ids_arg, text, tokenizer_path, device = "cpu", dtype = "float32";
  bool as_json = false;
  app.add_option("--model", model_dir, "checkpoint folder: config.json + safetensors (Hugging Face layout)")
      ->required();
  auto* ids_opt = app.add_option("--ids", ids_arg, "token ids, comma-separated: 1,2,3 (at least 2, each < vocab)");
  auto* text_opt = app.add_option("--text", text, "text to tokenize with --tokenizer (instead of --ids)");
  app.add_option("--tokenizer", tokenizer_path, "sentencepiece model file for --text (also names the pieces)");
  app.add_flag("--json", as_json, "print one JSON object {\"ids\": [...], \"logprobs\": [...]} instead of a table");
  app.add_option("--device", device, "cpu | cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--dtype", dtype, "weights and activations: float32 | bfloat16 (log-probs are fp32 either way)")
      ->check(CLI::IsMember({"float32", "bfloat16"}));
  if (int rc = parse_cli(app, argc, argv); rc >= 0) return rc;
  ScoreConfig cfg;
  if (!load_cli_config(cc, cfg)) return 2;

  // Everything that can be checked without the model comes first, so bad input fails fast.
  const bool have_ids = ids_opt->count() > 0, have_text = text_opt->count() > 0;
  if (have_ids == have_text) throw UsageError{"give exactly one of --ids and --text"};
  if (have_text && tokenizer_path.empty()) throw UsageError{"--text needs --tokenizer FILE (a sentencepiece model)"};
  if (device == "cuda" && !at::hasCUDA()) throw UsageError{"--device cuda but no CUDA device is available"};
  std::optional<sentencepiece::SentencePieceProcessor> sp;
  if (!tokenizer_path.empty()) {
    sp.emplace();
    const auto status = sp->Load(tokenizer_path);
    if (!status.ok()) throw UsageError{"--tokenizer " + tokenizer_path + ": cannot load: " + status.ToString()};
  }
  std::vector<int64_t> ids;
  if (have_ids) {
    ids = parse_ids(ids_arg);
  } else {
    std::vector<int> pieces;
    const auto status = sp->Encode(text, &pieces);
    if (!status.ok()) throw UsageError{"--text: cannot encode: " + status.ToString()};
    ids.assign(pieces.begin(), pieces.end());
  }
  if (ids.size() < 2) {
    throw UsageError{"need at least 2 tokens to score (got " + std::to_string(ids.size()) +
                     "): the first token has no log-prob"};
  }

  const at::Device dev = device == "cuda" ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  const Transformer model = load_model(model_dir, dtype == "bfloat16" ? at::kBFloat16 : at::kFloat, dev);
  const int64_t V = model.config().vocab_size;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] >= V) {
      throw UsageError{(have_ids ? "--ids" : "--tokenizer") + std::string(": token ") + std::to_string(i) + " is id " +
                       std::to_string(ids[i]) + ", outside the model's vocabulary (vocab_size " + std::to_string(V) +
                       ")"};
    }
  }

  // score has no response windows nor loss mask: every row is scored, whatever the config says.
  LossOptions options = cfg.loss;
  options.response_only = false;
  options.loss_mask_only = false;
  options.entropy = EntropyMode::kNone;                         // only log-probs are reported
  const at::Tensor ids_t = at::tensor(ids, at::kLong).to(dev);  // (L)
  const at::Tensor lp = score_ids(model, ids_t, options).to(at::kCPU, at::kDouble).contiguous();  // (L-1)
  const std::vector<double> logprobs(lp.data_ptr<double>(), lp.data_ptr<double>() + lp.numel());

  if (as_json) {
    // nlohmann::json prints doubles with 17 significant digits: the fp32 values round-trip exactly.
    std::cout << json{{"ids", ids}, {"logprobs", logprobs}}.dump() << "\n";
    return 0;
  }
  std::cout << std::left << std::setw(6) << "pos" << std::right << std::setw(8) << "id";
  if (sp) std::cout << "  " << std::left << std::setw(16) << "piece" << std::right;
  std::cout << std::setw(14) << "logprob"
            << "\n";
  double sum = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    std::cout << std::left << std::setw(6) << i << std::right << std::setw(8) << ids[i];
    if (sp) std::cout << "  " << padded(sp->IdToPiece(int(ids[i])), 16);
    if (i == 0) {
      std::cout << std::setw(14) << "-"
                << "\n";  // the first token has no prefix to be scored against
      continue;
    }
    sum += logprobs[i - 1];
    std::cout << std::setw(14) << std::fixed << std::setprecision(6) << logprobs[i - 1] << std::defaultfloat << "\n";
  }
  std::cout << "sum " << std::fixed << std::setprecision(6) << sum << "  mean " << sum / double(logprobs.size())
            << "  over " << logprobs.size() << " tokens (" << model.config().model_type << ", loss.impl "
            << enum_to_string(options.impl) << ")\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const UsageError& e) {
    std::cerr << "score: " << e.message << "\n";
    return 2;
  } catch (const c10::Error& e) {  // a failure past input checking (e.g. out of memory): report, do not crash
    std::cerr << "score: error: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "score: error: " << e.what() << "\n";
    return 1;
  }
}
