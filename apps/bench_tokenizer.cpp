// bench_tokenizer: one thread's encode and decode throughput of the trainer's Tokenizer (a tokenizer.json,
// a sentencepiece .model or a checkpoint folder) on a text file, one input per line. scripts/bench_tokenizer.py
// runs it beside Hugging Face `tokenizers` on the same lines. Prints one JSON object:
//   {"tokenizer", "lines", "bytes", "tokens", "encode_s", "encode_mb_s", "encode_tokens_s", "decode_s", "decode_mb_s"}
// (times are the median of --reps passes; MB = 10^6 bytes of input text). Bad input is exit code 2.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "data/tokenizer.h"

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"encode/decode throughput of a tokenizer on a text file, one thread"};
  std::string tokenizer_path, file;
  int reps = 3;
  app.add_option("--tokenizer", tokenizer_path, "tokenizer.json, .model, or a checkpoint folder")->required();
  app.add_option("--file", file, "text file; each line is one input")->required();
  app.add_option("--reps", reps, "timed passes (median)")->check(CLI::Range(1, 1000));
  CLI11_PARSE(app, argc, argv);

  std::ifstream in(file, std::ios::binary);
  if (!in) {
    std::cerr << "bench_tokenizer: cannot read --file " << file << "\n";
    return 2;
  }
  std::vector<std::string> lines;
  int64_t bytes = 0;
  for (std::string line; std::getline(in, line);) {
    bytes += static_cast<int64_t>(line.size());
    lines.push_back(std::move(line));
  }
  if (lines.empty()) {
    std::cerr << "bench_tokenizer: --file " << file << " holds no lines\n";
    return 2;
  }
  try {
    const rlt::Tokenizer tok = rlt::Tokenizer::load(tokenizer_path);
    std::vector<std::vector<int64_t>> ids(lines.size());
    std::vector<double> enc, dec;
    int64_t tokens = 0;
    size_t checksum = 0;  // keeps the decoded text alive, so the compiler cannot drop the work
    for (int r = 0; r < reps; ++r) {
      const auto t0 = Clock::now();
      for (size_t i = 0; i < lines.size(); ++i) ids[i] = tok.encode(lines[i]);
      const auto t1 = Clock::now();
      for (const auto& v : ids) checksum += tok.decode(v).size();
      const auto t2 = Clock::now();
      enc.push_back(std::chrono::duration<double>(t1 - t0).count());
      dec.push_back(std::chrono::duration<double>(t2 - t1).count());
    }
    for (const auto& v : ids) tokens += static_cast<int64_t>(v.size());
    const double e = median(enc), d = median(dec);
    nlohmann::json j = {{"tokenizer", tokenizer_path},
                        {"lines", lines.size()},
                        {"bytes", bytes},
                        {"tokens", tokens},
                        {"encode_s", e},
                        {"encode_mb_s", bytes / e / 1e6},
                        {"encode_tokens_s", tokens / e},
                        {"decode_s", d},
                        {"decode_mb_s", bytes / d / 1e6},
                        {"decoded_bytes", checksum / reps}};
    std::cout << j.dump() << "\n";
  } catch (const rlt::DataError& e) {
    std::cerr << "bench_tokenizer: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
