// A Hugging Face `tokenizer.json` with a BPE model, encoded and decoded as the `tokenizers` library does,
// byte for byte: the byte-level BPE of Qwen2/2.5/3, Llama-3 and tiktoken conversions (NFC, a Split
// pre-tokenizer with the file's own regex, ByteLevel, merges as "a b" strings or ["a", "b"] pairs,
// ignore_merges), and the sentencepiece-style BPE of Mistral/Llama-2 fast tokenizers (Metaspace,
// byte_fallback <0xXX> pieces, fuse_unk, the Replace/ByteFallback/Fuse/Strip decoder). Added tokens are
// matched before anything else, longest first, as the library's added vocabulary does: normalized=false
// ones in the raw text, normalized=true ones in the normalized text between them.
//
// What a file may use:
//   * pre-tokenizers: Split (Regex or String pattern; behavior Removed, Isolated, MergedWithPrevious,
//     MergedWithNext or Contiguous; invert), ByteLevel, Metaspace, Digits (Unicode numerics Nd/Nl/No,
//     "½" and "²" included), Whitespace, WhitespaceSplit, CharDelimiterSplit, Punctuation,
//     BertPreTokenizer, FixedLength, Sequence;
//   * normalizers: NFC, NFD, NFKC, NFKD, Lowercase, Strip, StripAccents, Nmt, ByteLevel, BertNormalizer,
//     Prepend, Replace (String or Regex pattern), Sequence;
//   * decoders: ByteLevel, Metaspace, Replace (String or Regex pattern), ByteFallback, Fuse, Strip,
//     Sequence;
//   * post-processors: TemplateProcessing, BertProcessing, RobertaProcessing, ByteLevel, Sequence;
//     truncation and padding null.
// Anything else, and any field of these the code does not read, stops the load with an error naming it
// and the file: a file is never encoded with a part of it ignored. Fields that only shape offsets
// (trim_offsets) or pair encodings (TemplateProcessing.pair) are accepted, as encode returns neither.
//
// Semantics chosen where the library leaves a choice to the caller:
//   * encode(text) splits special tokens out of the text ("<|im_start|>" becomes its id), which is what
//     a rendered chat template needs; add_special_tokens applies the post-processor (Llama-3's
//     <|begin_of_text|>, Mistral's <s>), like tokenizers' encode(text, add_special_tokens=True);
//   * decode keeps special tokens (skip_special_tokens=False): the rollout decodes what was sampled;
//   * invalid UTF-8 input is encoded by its bytes through the byte-level alphabet (no character is
//     lost); decode turns byte sequences that are not UTF-8 into U+FFFD, as the library's lossy decode
//     does, while token_bytes() gives the exact bytes of one token (a partial UTF-8 sequence included).
// Leaves out (refused by name): WordPiece, Unigram and WordLevel models, BPE dropout,
// continuing_subword_prefix, end_of_word_suffix, the UnicodeScripts pre-tokenizer, the Precompiled
// normalizer, the WordPiece, BPEDecoder and CTC decoders; pair encodings and offsets.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace rlt {

class HfTokenizer {
 public:
  // Parses `path` (a tokenizer.json). Throws DataError naming the file and the unsupported or malformed
  // part.
  static std::shared_ptr<const HfTokenizer> load(const std::string& path);
  ~HfTokenizer();

  std::vector<int64_t> encode(const std::string& text, bool add_special_tokens = false) const;
  // Throws DataError for an id outside the vocabulary.
  std::string decode(const std::vector<int64_t>& ids) const;
  // The exact bytes token `id` contributes to decoded text (decoder applied to it alone, minus the
  // decoder's leading-space strip); "" for an id outside the vocabulary.
  std::string token_bytes(int64_t id) const;
  // The id of a token written as in the vocabulary ("Ġthe", "<|im_end|>"), or -1.
  int64_t token_to_id(const std::string& token) const;
  // One past the largest id (base vocabulary and added tokens).
  int64_t vocab_size() const;

  struct Impl;

 private:
  explicit HfTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace rlt
