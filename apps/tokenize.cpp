// tokenize: text <-> ids through a tokenizer.json, a sentencepiece .model, or a checkpoint folder (the
// trainer's own Tokenizer, data/tokenizer.h). One JSON object per input line on stdout:
//   build/bin/tokenize --tokenizer DIR --text "Hello"          -> {"ids": [9707]}
//   build/bin/tokenize --tokenizer DIR --file ids.txt --decode -> {"text": "..."} per line of ids
// --file reads one input per line ("\n" ends a line and is not part of it); with --jsonl each line is a
// JSON string, so an input can hold newlines; --text is one input, newlines included. Bad input (a missing
// tokenizer, an id outside the vocabulary, a non-integer id, a tokenizer.json field the code does not
// read) is exit code 2 with a message naming it.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <fstream>
#include <iostream>
#include <sstream>

#include "data/dataset.h"
#include "data/tokenizer.h"

namespace {

struct UsageError {
  std::string what;
};

std::vector<int64_t> parse_ids(const std::string& line, size_t line_no) {
  std::vector<int64_t> ids;
  std::string tok;
  std::istringstream in(line);
  while (in >> tok) {
    for (char& c : tok) c = c == ',' ? ' ' : c;
    std::istringstream parts(tok);
    std::string part;
    while (parts >> part) {
      size_t used = 0;
      long long v = 0;
      try {
        v = std::stoll(part, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != part.size()) {
        throw UsageError{"line " + std::to_string(line_no) + ": '" + part + "' is not a token id"};
      }
      ids.push_back(v);
    }
  }
  return ids;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tokenize: encode text (or decode ids) with a tokenizer.json, a sentencepiece model or a checkpoint"};
  std::string tokenizer_path, text, file;
  bool decode = false, as_json = false, add_special = false, jsonl = false;
  app.add_option("--tokenizer", tokenizer_path, "tokenizer.json, a .model file, or a checkpoint folder")->required();
  auto* text_opt = app.add_option("--text", text, "one input");
  auto* file_opt = app.add_option("--file", file, "one input per line");
  app.add_flag("--jsonl", jsonl, "each --file line is a JSON string to encode (newlines inside an input)");
  app.add_flag("--decode", decode, "inputs are ids (comma or space separated); print the text");
  app.add_flag("--json", as_json, "one JSON object per input (the default output is also JSON; kept for scripts)");
  app.add_flag("--add-special-tokens", add_special, "encode with the tokenizer's framing (BOS of Llama-3 / Mistral)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return e.get_exit_code() == 0 ? app.exit(e) : (app.exit(e), 2);
  }
  (void)as_json;
  if ((text_opt->count() > 0) == (file_opt->count() > 0)) {
    std::cerr << "tokenize: give exactly one of --text and --file\n";
    return 2;
  }
  try {
    const rlt::Tokenizer tok = rlt::Tokenizer::load(tokenizer_path);
    std::vector<std::string> inputs;
    if (text_opt->count() > 0) {
      inputs.push_back(text);
    } else {
      std::ifstream in(file, std::ios::binary);
      if (!in) throw UsageError{"--file " + file + ": cannot open"};
      for (std::string line; std::getline(in, line);) {
        if (!jsonl || decode) {
          inputs.push_back(line);
          continue;
        }
        const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
        if (!j.is_string())
          throw UsageError{"--file " + file + " line " + std::to_string(inputs.size() + 1) +
                           ": not a JSON string (--jsonl)"};
        inputs.push_back(j.get<std::string>());
      }
    }
    for (size_t i = 0; i < inputs.size(); ++i) {
      nlohmann::json out;
      if (decode) {
        const std::vector<int64_t> ids = parse_ids(inputs[i], i + 1);
        out["text"] = tok.decode(ids);
      } else {
        out["ids"] = tok.encode(inputs[i], add_special);
      }
      // Replace, not throw, on invalid UTF-8 in the output: decode already yields valid UTF-8.
      std::cout << out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    }
  } catch (const UsageError& e) {
    std::cerr << "tokenize: " << e.what << "\n";
    return 2;
  } catch (const rlt::DataError& e) {
    std::cerr << "tokenize: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
