// Text <-> token ids through a checkpoint's own tokenizer: a Hugging Face tokenizer.json (BPE: Qwen,
// Llama-3, Mistral; data/hf_tokenizer.h) or a sentencepiece .model, and training a small sentencepiece one
// from a corpus (the built-in demo makes its tokenizer on the fly). The rollout needs two things beyond
// encode/decode:
//   * the tool tags (<code>, </code>, <interpreter>, </interpreter>) as single user-defined pieces, so a
//     turn boundary is one sampled token and tool output can be appended as ids without touching the
//     model's own tokens (text is never re-tokenised);
//   * the exact text of each piece (piece_text), so stop strings are found incrementally while sampling.
// Special tokens: encode() turns special-token text ("<|im_start|>") into its id, as a rendered chat
// template needs; decode() keeps them. Leaves out: WordPiece/Unigram tokenizer.json files.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace rlt {

class HfTokenizer;

struct TokenizerTrainOptions {
  int64_t vocab_size = 512;
  // Pieces that always encode as one token when they appear in text (tool tags, "\boxed{", ...).
  std::vector<std::string> user_symbols;
  // "unigram" or "bpe" (sentencepiece's model types).
  std::string model_type = "unigram";
  uint64_t seed = 0;
};

class Tokenizer {
 public:
  // Loads a tokenizer.json (by its name), a sentencepiece .model file, or a folder (from_checkpoint).
  // Throws DataError naming the file when it is missing, corrupt or of an unsupported kind.
  static Tokenizer load(const std::string& path);
  // A checkpoint folder's tokenizer: tokenizer.json first, then tokenizer.model; bos/eos/pad tokens from
  // its tokenizer_config.json (strings or {"content": ...}) when present. A folder with neither tokenizer
  // file is a DataError naming the folder.
  static Tokenizer from_checkpoint(const std::string& dir);
  // Trains on `corpus` (one document per entry, newlines kept) and writes `model_file` atomically.
  // Identity normalisation, whitespace kept as is, byte fallback: every text round-trips exactly, code
  // indentation and newlines included. ids: unk 0, bos 1, eos 2, pad 3.
  static void train(const std::vector<std::string>& corpus, const std::string& model_file,
                    const TokenizerTrainOptions& options);

  // add_special_tokens: the tokenizer's own framing of a sequence (Llama-3's <|begin_of_text|>, a
  // sentencepiece model's BOS), as transformers' tokenizer(text) adds it.
  std::vector<int64_t> encode(const std::string& text, bool add_special_tokens = false) const;
  std::string decode(const std::vector<int64_t>& ids) const;
  // The bytes piece `id` stands for ("\xe2\x96\x81" -> ' ', <0x0A> -> '\n', control pieces -> ""), so the
  // text of a sampled sequence grows by piece_text(id) per token. Equals decode() for models made by
  // train(); models with a dummy prefix differ by the leading space only.
  const std::string& piece_text(int64_t id) const;
  // The id of a piece, or -1 when the vocabulary has no such piece.
  int64_t piece_id(const std::string& piece) const;

  int64_t vocab_size() const { return static_cast<int64_t>(piece_text_.size()); }
  int64_t bos_id() const { return bos_; }
  int64_t eos_id() const { return eos_; }  // -1 when neither the model nor tokenizer_config.json names one
  int64_t pad_id() const { return pad_; }  // -1 when the model defines none
  const std::string& path() const { return path_; }

 private:
  Tokenizer() = default;
  static Tokenizer load_sentencepiece(const std::string& model_file);
  std::shared_ptr<sentencepiece::SentencePieceProcessor> sp_;  // one of these two
  std::shared_ptr<const HfTokenizer> hf_;
  std::vector<std::string> piece_text_;  // (V)
  int64_t bos_ = -1, eos_ = -1, pad_ = -1;
  std::string path_;
};

}  // namespace rlt
