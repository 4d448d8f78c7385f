// generation_config.json's stop ids: a list (Qwen instruct: <|im_end|> and <|endoftext|>), a single id,
// none, and the malformed files that must be errors naming the file.
#include <gtest/gtest.h>

#include <fstream>

#include "model/config.h"
#include "tests/common/tmpdir.h"

namespace rlt {
namespace {

using rlt::testing::TempDir;

void write(const std::filesystem::path& dir, const std::string& text) {
  std::ofstream(dir / "generation_config.json") << text;
}

TEST(GenerationConfig, EveryEosIdOfAListOrASingleId) {
  TempDir tmp("genconfig");
  // Qwen2.5-Instruct's generation_config.json lists both ids; a reader that kept only the first would
  // let a model that ends with <|endoftext|> run on to the length limit.
  write(tmp.path(), R"({"bos_token_id": 151643, "eos_token_id": [151645, 151643], "do_sample": true})");
  EXPECT_EQ(generation_eos_ids(tmp.path().string()), (std::vector<int64_t>{151645, 151643}));
  write(tmp.path(), R"({"eos_token_id": 128009})");
  EXPECT_EQ(generation_eos_ids(tmp.path().string()), (std::vector<int64_t>{128009}));
  write(tmp.path(), R"({"temperature": 0.7})");
  EXPECT_TRUE(generation_eos_ids(tmp.path().string()).empty()) << "no eos_token_id: none";
  std::filesystem::remove(tmp.path() / "generation_config.json");
  EXPECT_TRUE(generation_eos_ids(tmp.path().string()).empty()) << "no file: none";
}

TEST(GenerationConfig, MalformedFilesNameTheFile) {
  TempDir tmp("genconfig_bad");
  for (const char* text : {R"({"eos_token_id": "</s>"})", R"({"eos_token_id": [2, -1]})", "{not json", "[1, 2]"}) {
    write(tmp.path(), text);
    try {
      generation_eos_ids(tmp.path().string());
      ADD_FAILURE() << "accepted " << text;
    } catch (const ModelConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("generation_config.json"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace rlt
