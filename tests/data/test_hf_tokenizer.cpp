// The trainer's Tokenizer on real checkpoint tokenizer folders: special tokens from tokenizer_config.json,
// piece_text as the exact bytes each sampled token adds (the rollout's stop-string search reads it), and
// the errors a wrong folder gets. Encode/decode parity with HF tokenizers is tests/data/check_hf_tokenizer.py.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "data/dataset.h"
#include "data/tokenizer.h"
#include "tests/common/fixtures.h"
#include "tests/common/tmpdir.h"

namespace rlt {
namespace {

const std::string kFixtures = RLT_FIXTURES_DIR;

TEST(HfTokenizer, QwenFolderTakesItsSpecialTokensFromTheConfig) {
  RLT_SKIP_WITHOUT_FIXTURES();
  const Tokenizer t = Tokenizer::from_checkpoint(kFixtures + "/tokenizers/qwen3");
  EXPECT_EQ(t.vocab_size(), 151669);
  EXPECT_EQ(t.eos_id(), 151645) << "<|im_end|>, tokenizer_config.json's eos_token";
  EXPECT_EQ(t.piece_id("<|im_end|>"), 151645);
  EXPECT_EQ(t.bos_id(), -1) << "bos_token: null";
  EXPECT_EQ(t.pad_id(), 151643) << "<|endoftext|>";
  // Special-token text in a rendered template becomes the token, not its characters.
  EXPECT_EQ(t.encode("<|im_start|>user"), (std::vector<int64_t>{151644, 872}));
}

TEST(HfTokenizer, LlamaFolderAddsBeginOfTextOnlyWhenAsked) {
  RLT_SKIP_WITHOUT_FIXTURES();
  const Tokenizer t = Tokenizer::from_checkpoint(kFixtures + "/tokenizers/llama-3.1");
  EXPECT_EQ(t.bos_id(), 128000);
  EXPECT_EQ(t.eos_id(), 128009) << "<|eot_id|> (Llama-3.1-Instruct's tokenizer_config.json)";
  // The published ids of "Hello 世界 123" (fixtures README).
  EXPECT_EQ(t.encode("Hello 世界 123", /*add_special_tokens=*/true),
            (std::vector<int64_t>{128000, 9906, 127365, 220, 4513}));
  EXPECT_EQ(t.encode("Hello 世界 123"), (std::vector<int64_t>{9906, 127365, 220, 4513}));
}

TEST(HfTokenizer, PieceTextsAreTheBytesEachTokenAdds) {
  RLT_SKIP_WITHOUT_FIXTURES();
  for (const char* fam : {"qwen3", "llama-3.1", "mistral-7b-v0.3"}) {
    const Tokenizer t = Tokenizer::from_checkpoint(kFixtures + "/tokenizers/" + fam);
    // An emoji split across byte-level tokens, CJK, spaces and a newline: the concatenated piece texts are
    // the text (Mistral's Metaspace prefixes one space to the first piece, as its decoder then strips).
    const std::string text = "Robot 🤖 says 你好\n  done";
    std::string joined;
    for (int64_t id : t.encode(text)) joined += t.piece_text(id);
    const std::string want = std::string(fam) == "mistral-7b-v0.3" ? " " + text : text;
    EXPECT_EQ(joined, want) << fam;
    EXPECT_EQ(t.decode(t.encode(text)), text) << fam;
  }
  // A byte-level token's text is its bytes, not its alphabet spelling ("Ġthe" is " the").
  const Tokenizer q = Tokenizer::from_checkpoint(kFixtures + "/tokenizers/qwen3");
  const int64_t the = q.piece_id("\xc4\xa0the");  // "Ġthe"
  ASSERT_GE(the, 0);
  EXPECT_EQ(q.piece_text(the), " the");
}

TEST(HfTokenizer, WrongFoldersAndFilesNameThemselves) {
  rlt::testing::TempDir tmp("hf_tok");
  auto expect_error = [](const std::string& path, const std::string& fragment) {
    try {
      Tokenizer::load(path);
      ADD_FAILURE() << "accepted " << path;
    } catch (const DataError& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  expect_error(tmp.path().string(), "neither tokenizer.json nor tokenizer.model");
  std::ofstream(tmp.path() / "tokenizer.json") << R"({"model": {"type": "WordPiece", "vocab": {}}})";
  expect_error(tmp.path().string(), "WordPiece");
  std::ofstream(tmp.path() / "tokenizer.json") << "{broken";
  expect_error((tmp.path() / "tokenizer.json").string(), "not valid JSON");
}

// A tokenizer.json in the form tiktoken converters write: Split keeps the regex's matches (behavior
// Removed, invert true) and drops the text between them. Ids as HF tokenizers gives them; read without
// invert, the same file keeps only " " and "!" (ids 3, 4).
constexpr const char* kTiktokenStyle = R"({
  "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
  "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": " ?\\p{L}+|\\p{N}"}, "behavior": "Removed", "invert": true},
    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]},
  "post_processor": null,
  "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
  "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": {"h": 0, "i": 1, "7": 2, "\u0120": 3, "!": 4, "hi": 5, "\u0120hi": 6, "\u0120h": 7},
            "merges": ["h i", "\u0120 hi"]}})";

TEST(HfTokenizer, SplitWithInvertKeepsTheMatches) {
  rlt::testing::TempDir tmp("hf_tok_invert");
  const std::string path = (tmp.path() / "tokenizer.json").string();
  std::ofstream(path) << kTiktokenStyle;
  const Tokenizer t = Tokenizer::load(path);
  EXPECT_EQ(t.encode("hi 7!"), (std::vector<int64_t>{5, 2}));
  EXPECT_EQ(t.encode("hi hi!!7"), (std::vector<int64_t>{5, 6, 2}));
  EXPECT_EQ(t.decode({5, 6, 2}), "hi hi7");
}

// Digits then ByteLevel, with merges that join "½" and "²": HF counts every Unicode numeric as a digit, so
// individual_digits keeps them apart; ASCII-only digits would leave " ½²" to the ByteLevel regex and
// merge it (ids 1, 7). Ids as HF tokenizers gives them.
constexpr const char* kDigits = R"({
  "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
  "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
    {"type": "Digits", "individual_digits": true},
    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true}]},
  "post_processor": null,
  "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
  "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": {"x": 0, "\u0120": 1, "\u00c2": 2, "\u00bd": 3, "\u00b2": 4, "\u00c2\u00bd": 5,
                      "\u00c2\u00b2": 6, "\u00c2\u00bd\u00c2\u00b2": 7, "1": 8, "2": 9, "12": 10},
            "merges": ["\u00c2 \u00bd", "\u00c2 \u00b2", "\u00c2\u00bd \u00c2\u00b2", "1 2"]}})";

TEST(HfTokenizer, DigitsCountEveryUnicodeNumeric) {
  rlt::testing::TempDir tmp("hf_tok_digits");
  const std::string path = (tmp.path() / "tokenizer.json").string();
  std::ofstream(path) << kDigits;
  EXPECT_EQ(Tokenizer::load(path).encode("x \u00bd\u00b2 12"), (std::vector<int64_t>{0, 1, 5, 6, 1, 8, 9}));
  std::string contiguous = kDigits;
  contiguous.replace(contiguous.find("\"individual_digits\": true"), 25, "\"individual_digits\": false");
  std::ofstream(path) << contiguous;
  EXPECT_EQ(Tokenizer::load(path).encode("x \u00bd\u00b2 12"), (std::vector<int64_t>{0, 1, 7, 1, 10}));
}

TEST(HfTokenizer, AFieldTheCodeDoesNotReadIsRefusedByName) {
  rlt::testing::TempDir tmp("hf_tok_fields");
  const std::string path = (tmp.path() / "tokenizer.json").string();
  auto expect_refused = [&](const std::string& from, const std::string& to, const std::string& fragment) {
    std::string text = kTiktokenStyle;
    const size_t at = text.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    text.replace(at, from.size(), to);
    std::ofstream(path) << text;
    try {
      Tokenizer::load(path);
      ADD_FAILURE() << "accepted a file with " << to;
    } catch (const DataError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(fragment), std::string::npos) << what;
      EXPECT_NE(what.find(path), std::string::npos) << what;
    }
  };
  expect_refused(R"("invert": true)", R"("invert": true, "colour": "red")", "field 'colour'");
  expect_refused(R"("fuse_unk": false)", R"("fuse_unk": false, "max_input_chars_per_word": 100)",
                 "field 'max_input_chars_per_word'");
  expect_refused(R"("behavior": "Removed")", R"("behavior": "Dropped")", "behavior 'Dropped'");
  expect_refused(R"("normalizer": null)", R"("normalizer": {"type": "Precompiled", "precompiled_charsmap": ""})",
                 "normalizer 'Precompiled'");
  expect_refused(R"("truncation": null)", R"("truncation": {"max_length": 8})", "truncation");
  expect_refused(R"("version": "1.0")", R"("version": "1.0", "extra": 1)", "field 'extra'");
}

}  // namespace
}  // namespace rlt
