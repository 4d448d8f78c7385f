// sentencepiece and tokenizer.json behind the Tokenizer interface; see tokenizer.h.
#include "data/tokenizer.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include <filesystem>

#include "data/dataset.h"
#include "data/hf_tokenizer.h"

namespace sentencepiece::logging {
void SetMinLogLevel(int v);  // exported by libsentencepiece, not declared in its public headers
}

namespace rlt {

namespace {

// Feeds an in-memory corpus to the trainer, one document per "sentence" (newlines stay inside).
class CorpusIterator : public sentencepiece::SentenceIterator {
 public:
  explicit CorpusIterator(const std::vector<std::string>& docs) : docs_(docs) {}
  bool done() const override { return i_ >= docs_.size(); }
  void Next() override { ++i_; }
  const std::string& value() const override { return docs_[i_]; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  const std::vector<std::string>& docs_;
  size_t i_ = 0;
};

// "▁" (U+2581) marks a space inside pieces.
constexpr const char* kSpaceMark = "\xe2\x96\x81";

std::string raw_piece_text(const sentencepiece::SentencePieceProcessor& sp, int id) {
  if (sp.IsControl(id)) return "";
  if (sp.IsUnknown(id)) return " \xe2\x81\x87 ";  // sentencepiece decodes unknown pieces as " ⁇ "
  const std::string& piece = sp.IdToPiece(id);
  if (sp.IsByte(id)) {  // "<0x0A>"
    return std::string(1, static_cast<char>(std::stoi(piece.substr(3, 2), nullptr, 16)));
  }
  std::string out;
  for (size_t i = 0; i < piece.size();) {
    if (piece.compare(i, 3, kSpaceMark) == 0) {
      out += ' ';
      i += 3;
    } else {
      out += piece[i++];
    }
  }
  return out;
}

}  // namespace

namespace {

// A special token as tokenizer_config.json writes it: "<|im_end|>", {"content": "<|im_end|>", ...}, or null.
std::string config_token(const nlohmann::json& cfg, const char* key) {
  if (!cfg.contains(key) || cfg[key].is_null()) return "";
  if (cfg[key].is_string()) return cfg[key].get<std::string>();
  if (cfg[key].is_object() && cfg[key].contains("content") && cfg[key]["content"].is_string()) {
    return cfg[key]["content"].get<std::string>();
  }
  return "";
}

}  // namespace

Tokenizer Tokenizer::load(const std::string& path) {
  if (std::filesystem::is_directory(path)) return from_checkpoint(path);
  const bool json = path.size() >= 5 && path.compare(path.size() - 5, 5, ".json") == 0;
  if (!json) return load_sentencepiece(path);
  Tokenizer t;
  t.hf_ = HfTokenizer::load(path);
  const int64_t V = t.hf_->vocab_size();
  t.piece_text_.reserve(V);
  for (int64_t id = 0; id < V; ++id) t.piece_text_.push_back(t.hf_->token_bytes(id));
  t.path_ = path;
  return t;
}

Tokenizer Tokenizer::from_checkpoint(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path json = fs::path(dir) / "tokenizer.json", model = fs::path(dir) / "tokenizer.model";
  Tokenizer t;
  if (fs::exists(json)) {
    t = load(json.string());
  } else if (fs::exists(model)) {
    t = load_sentencepiece(model.string());
  } else {
    throw DataError(dir + ": holds neither tokenizer.json nor tokenizer.model");
  }
  const fs::path cfg_path = fs::path(dir) / "tokenizer_config.json";
  if (fs::exists(cfg_path)) {
    std::ifstream f(cfg_path);
    nlohmann::json cfg;
    try {
      cfg = nlohmann::json::parse(f);
    } catch (const nlohmann::json::exception& e) {
      throw DataError(cfg_path.string() + ": not valid JSON: " + e.what());
    }
    auto id_of = [&](const char* key, int64_t dflt) -> int64_t {
      const std::string tok = config_token(cfg, key);
      if (tok.empty()) return cfg.contains(key) && cfg[key].is_null() ? -1 : dflt;
      const int64_t id = t.piece_id(tok);
      if (id < 0)
        throw DataError(cfg_path.string() + ": " + key + " '" + tok + "' is not in the tokenizer's vocabulary");
      return id;
    };
    t.bos_ = id_of("bos_token", t.bos_);
    t.eos_ = id_of("eos_token", t.eos_);
    t.pad_ = id_of("pad_token", t.pad_);
  }
  return t;
}

Tokenizer Tokenizer::load_sentencepiece(const std::string& model_file) {
  Tokenizer t;
  t.sp_ = std::make_shared<sentencepiece::SentencePieceProcessor>();
  std::ifstream in(model_file, std::ios::binary);
  if (!in) throw DataError(model_file + ": cannot open the tokenizer model");
  std::stringstream bytes;
  bytes << in.rdbuf();
  const auto status = t.sp_->LoadFromSerializedProto(bytes.str());
  if (!status.ok()) {
    throw DataError(model_file + ": not a sentencepiece model (" + std::string(status.message()) + ")");
  }
  const int V = t.sp_->GetPieceSize();
  if (V <= 0) throw DataError(model_file + ": the tokenizer model has an empty vocabulary");
  t.piece_text_.reserve(V);
  for (int id = 0; id < V; ++id) t.piece_text_.push_back(raw_piece_text(*t.sp_, id));
  t.bos_ = t.sp_->bos_id();
  t.eos_ = t.sp_->eos_id();
  t.pad_ = t.sp_->pad_id();
  if (t.eos_ < 0) throw DataError(model_file + ": the tokenizer model defines no end-of-sequence piece");
  t.path_ = model_file;
  return t;
}

void Tokenizer::train(const std::vector<std::string>& corpus, const std::string& model_file,
                      const TokenizerTrainOptions& options) {
  if (corpus.empty()) throw DataError("tokenizer training: the corpus is empty");
  std::string symbols;
  for (const auto& s : options.user_symbols) {
    if (s.empty() || s.find(',') != std::string::npos) {
      throw DataError("tokenizer training: user symbol '" + s + "' is empty or contains a comma");
    }
    symbols += (symbols.empty() ? "" : ",") + s;
  }
  const std::unordered_map<std::string, std::string> args{
      {"model_type", options.model_type},
      {"vocab_size", std::to_string(options.vocab_size)},
      {"hard_vocab_limit", "false"},  // a tiny corpus may not support the full size: take what it supports
      {"character_coverage", "1.0"},
      {"byte_fallback", "true"},  // any byte encodes: nothing maps to unk
      {"normalization_rule_name", "identity"},
      {"remove_extra_whitespaces", "false"},  // code indentation is meaning
      {"add_dummy_prefix", "false"},          // so the concatenated piece texts are the text
      {"allow_whitespace_only_pieces", "true"},
      {"split_digits", "true"},  // one token per digit: numbers are copied into code digit by digit
      {"user_defined_symbols", symbols},
      {"unk_id", "0"},
      {"bos_id", "1"},
      {"eos_id", "2"},
      {"pad_id", "3"},
      {"max_sentence_length", "65536"},
      {"num_threads", "1"},  // deterministic
      {"minloglevel", "2"},
  };
  sentencepiece::logging::SetMinLogLevel(2);
  CorpusIterator it(corpus);
  std::string proto;
  const auto status = sentencepiece::SentencePieceTrainer::Train(args, &it, &proto);
  if (!status.ok()) throw DataError("tokenizer training failed: " + std::string(status.message()));
  // Written under a temporary name, then renamed: a crash never leaves a half-written model.
  const std::string tmp = model_file + ".tmp" + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(proto.data(), static_cast<std::streamsize>(proto.size()));
    if (!out) throw DataError(tmp + ": cannot write the tokenizer model");
  }
  if (std::rename(tmp.c_str(), model_file.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw DataError(model_file + ": cannot rename the written tokenizer model into place");
  }
}

std::vector<int64_t> Tokenizer::encode(const std::string& text, bool add_special_tokens) const {
  if (hf_) return hf_->encode(text, add_special_tokens);
  std::vector<int> ids;
  const auto status = sp_->Encode(text, &ids);
  if (!status.ok()) throw DataError(path_ + ": encode failed: " + std::string(status.message()));
  std::vector<int64_t> out;
  if (add_special_tokens && bos_ >= 0) out.push_back(bos_);
  out.insert(out.end(), ids.begin(), ids.end());
  return out;
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids) const {
  if (hf_) return hf_->decode(ids);
  std::vector<int> v;
  v.reserve(ids.size());
  for (int64_t id : ids) {
    if (id < 0 || id >= vocab_size()) {
      throw DataError(path_ + ": decode: id " + std::to_string(id) + " outside the vocabulary of " +
                      std::to_string(vocab_size()));
    }
    v.push_back(static_cast<int>(id));
  }
  std::string text;
  const auto status = sp_->Decode(v, &text);
  if (!status.ok()) throw DataError(path_ + ": decode failed: " + std::string(status.message()));
  return text;
}

const std::string& Tokenizer::piece_text(int64_t id) const {
  static const std::string kNone;
  return id >= 0 && id < vocab_size() ? piece_text_[id] : kNone;
}

int64_t Tokenizer::piece_id(const std::string& piece) const {
  if (hf_) return hf_->token_to_id(piece);
  const int id = sp_->PieceToId(piece);
  // PieceToId answers unk for unknown pieces; only the unk piece itself maps there legitimately.
  if (sp_->IsUnknown(id) && sp_->IdToPiece(id) != piece) return -1;
  return id;
}

}  // namespace rlt
