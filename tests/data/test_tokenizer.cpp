// Tokenizer: training, exact round trips (code, whitespace, non-ASCII), tool tags as single pieces,
// piece texts that concatenate to the decoded text, load errors; the chat template.
#include "data/tokenizer.h"

#include <gtest/gtest.h>

#include <fstream>

#include "data/chat_template.h"
#include "data/dataset.h"
#include "tests/common/tiny_tokenizer.h"
#include "tests/common/tmpdir.h"

namespace rlt {
namespace {

using testing::kToolTags;
using testing::tool_corpus;

class TokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir("tokenizer");
    path_ = (dir_->path() / "tok.model").string();
    TokenizerTrainOptions o;
    o.vocab_size = 400;
    o.user_symbols = kToolTags;
    Tokenizer::train(tool_corpus(), path_, o);
  }
  static void TearDownTestSuite() { delete dir_; }
  static testing::TempDir* dir_;
  static std::string path_;
};
testing::TempDir* TokenizerTest::dir_ = nullptr;
std::string TokenizerTest::path_;

TEST_F(TokenizerTest, RoundTripIsExact) {
  const Tokenizer t = Tokenizer::load(path_);
  const std::vector<std::string> texts = {
      "What is 123 * 456?",
      "<code>\nfor i in range(3):\n    print(i)\n</code>\n",
      "  leading and trailing spaces  ",
      "tabs\tand\n\nblank lines\n",
      "caf\xc3\xa9 \xe6\xbc\xa2\xe5\xad\x97 \xf0\x9f\x99\x82",  // café 漢字 🙂: not in the corpus, byte fallback
      "\\boxed{\\frac{1}{2}}",
      "",
  };
  for (const auto& text : texts) {
    const auto ids = t.encode(text);
    EXPECT_EQ(t.decode(ids), text) << "text: " << text;
    std::string pieces;
    for (int64_t id : ids) {
      ASSERT_GE(id, 0);
      ASSERT_LT(id, t.vocab_size());
      pieces += t.piece_text(id);
    }
    EXPECT_EQ(pieces, text) << "piece texts must concatenate to the text";
  }
}

TEST_F(TokenizerTest, ToolTagsAreSinglePiecesAndDigitsSplit) {
  const Tokenizer t = Tokenizer::load(path_);
  for (const auto& tag : kToolTags) {
    const int64_t id = t.piece_id(tag);
    ASSERT_GE(id, 0) << tag;
    EXPECT_EQ(t.encode(tag), std::vector<int64_t>{id}) << tag;
    EXPECT_EQ(t.piece_text(id), tag);
  }
  const auto with_tags = t.encode("x<code>y</code>");
  EXPECT_NE(std::find(with_tags.begin(), with_tags.end(), t.piece_id("<code>")), with_tags.end());
  EXPECT_EQ(t.encode("90817").size(), 5u) << "one token per digit";
  EXPECT_EQ(t.piece_id("no such piece"), -1);
}

TEST_F(TokenizerTest, SpecialIds) {
  const Tokenizer t = Tokenizer::load(path_);
  EXPECT_EQ(t.bos_id(), 1);
  EXPECT_EQ(t.eos_id(), 2);
  EXPECT_EQ(t.pad_id(), 3);
  EXPECT_EQ(t.piece_text(t.eos_id()), "") << "control pieces have no text";
  EXPECT_EQ(t.decode({t.bos_id(), t.encode("a")[0], t.eos_id()}), "a");
  EXPECT_LE(t.vocab_size(), 400);
  EXPECT_GT(t.vocab_size(), 256 + 4) << "byte fallback pieces + specials + learned pieces";
  EXPECT_THROW(t.decode({t.vocab_size()}), DataError);
}

TEST_F(TokenizerTest, TrainingIsDeterministic) {
  const std::string other = (dir_->path() / "again.model").string();
  TokenizerTrainOptions o;
  o.vocab_size = 400;
  o.user_symbols = kToolTags;
  Tokenizer::train(tool_corpus(), other, o);
  const Tokenizer a = Tokenizer::load(path_), b = Tokenizer::load(other);
  ASSERT_EQ(a.vocab_size(), b.vocab_size());
  for (int64_t id = 0; id < a.vocab_size(); ++id) ASSERT_EQ(a.piece_text(id), b.piece_text(id)) << id;
}

// The demo's choice (model.tokenizer_type): on the same small corpus and size, BPE spends its pieces on
// the corpus's words, so a question takes fewer tokens, where the unigram model (the fixture's) prunes
// itself to characters and keeps fewer pieces than asked for. Both round-trip exactly, keep the tool tags
// whole and split digits; a model_type the trainer ignored would train the unigram twin. (run.cpp maps
// model.tokenizer_type onto TokenizerTrainOptions::model_type; the demo's figures rest on it.)
TEST_F(TokenizerTest, BpeSpendsItsPiecesOnTheCorpusWords) {
  const std::string bpe_path = (dir_->path() / "bpe.model").string();
  TokenizerTrainOptions o;
  o.vocab_size = 400;
  o.user_symbols = kToolTags;
  o.model_type = "bpe";
  Tokenizer::train(tool_corpus(), bpe_path, o);
  const Tokenizer bpe = Tokenizer::load(bpe_path), unigram = Tokenizer::load(path_);
  EXPECT_EQ(bpe.vocab_size(), 400) << "BPE fills the size it is given";
  EXPECT_LT(unigram.vocab_size(), 400) << "the twin: the unigram model keeps fewer on this corpus";
  const std::string question = "User: What is 123 * 456?\nAssistant: ";
  const size_t b = bpe.encode(question).size(), u = unigram.encode(question).size();
  EXPECT_LT(3 * b, 2 * u) << "BPE " << b << " tokens, unigram " << u << ": the words should be whole pieces";
  for (const auto& text : {question, std::string("Answer: \\boxed{56088}"), std::string("caf\xc3\xa9 \t x")}) {
    EXPECT_EQ(bpe.decode(bpe.encode(text)), text);
  }
  EXPECT_EQ(bpe.encode("90817").size(), 5u) << "one token per digit";
  for (const auto& tag : kToolTags) EXPECT_EQ(bpe.encode(tag).size(), 1u) << tag;
}

TEST_F(TokenizerTest, BadInputsNameTheProblem) {
  try {
    Tokenizer::load((dir_->path() / "missing.model").string());
    FAIL() << "no error for a missing file";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("missing.model"), std::string::npos) << e.what();
  }
  const std::string junk = (dir_->path() / "junk.model").string();
  std::ofstream(junk) << "this is not a protobuf \x01\x02\x03";
  try {
    Tokenizer::load(junk);
    FAIL() << "no error for a corrupt file";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("junk.model"), std::string::npos) << e.what();
  }
  TokenizerTrainOptions o;
  EXPECT_THROW(Tokenizer::train({}, junk, o), DataError);
  o.user_symbols = {"a,b"};
  EXPECT_THROW(Tokenizer::train(tool_corpus(), junk, o), DataError);
}

TEST_F(TokenizerTest, ChatTemplate) {
  const Tokenizer t = Tokenizer::load(path_);
  ChatTemplateOptions c;
  c.prompt = "{system}|{tools}|Q: {question} {other}|A:";
  c.system = "S";
  c.tools = "T \\boxed{}";
  EXPECT_EQ(render_prompt(c, "2+{system}?"), "S|T \\boxed{}|Q: 2+{system}? {other}|A:")
      << "substituted text is not scanned again; unknown braces stay";
  const auto ids = encode_prompt(t, c, "1+1");
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids[0], t.bos_id());
  EXPECT_EQ(t.decode(ids), render_prompt(c, "1+1"));
  c.add_bos = false;
  EXPECT_EQ(encode_prompt(t, c, "1+1"), t.encode(render_prompt(c, "1+1")));
  std::vector<std::string> errors;
  c.prompt = "no placeholder";
  c.check([&](const std::string& key, const std::string& why) { errors.push_back(key); });
  EXPECT_EQ(errors, std::vector<std::string>{"prompt"});
}

}  // namespace
}  // namespace rlt
