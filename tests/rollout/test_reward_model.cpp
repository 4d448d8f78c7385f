// The reward model (rollout/reward_model.h) against transformers' AutoModelForSequenceClassification on tiny
// random checkpoints that transformers saves (tests/rollout/reward_model_reference.py): packed scores at
// every token budget, left- and right-padded batches, and whole conversations through Qwen3's published
// tokenizer and chat template. Each check has a wrong twin it must reject: the score read at the last pad
// instead of the last real token, a conversation scored one token short.
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "rollout/reward_model.h"
#include "tests/common/files.h"
#include "tests/common/fixtures.h"
#include "tests/common/tmpdir.h"

namespace rlt {
namespace {

namespace fs = std::filesystem;
using testing::read_json;
using json = nlohmann::json;

// The references: made by the ctest fixture make_reward_model_references (tests/CMakeLists.txt).
fs::path references() { return RLT_REWARD_MODEL_REFS; }

at::Tensor long_tensor(const json& rows) {
  std::vector<int64_t> flat;
  for (const auto& r : rows)
    for (int64_t v : r) flat.push_back(v);
  return at::tensor(flat, at::kLong).view({static_cast<int64_t>(rows.size()), -1});
}

double max_error(const std::vector<double>& got, const json& want) {
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i].get<double>()));
  return got.size() == want.size() ? worst : INFINITY;
}

std::vector<double> to_vector(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kDouble).contiguous();
  return {c.data_ptr<double>(), c.data_ptr<double>() + c.numel()};
}

// n ids drawn uniformly from [0, V) by ATen's global generator.
std::vector<int64_t> random_tokens(int64_t V, int64_t n) {
  const at::Tensor t = at::randint(V, {n}, at::kLong);
  return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + n);
}

// A reference conversation's prompt: its messages but the last (the response).
std::vector<ChatMessage> prompt_of(const json& messages) {
  std::vector<ChatMessage> prompt;
  for (size_t m = 0; m + 1 < messages.size(); ++m) prompt.push_back({messages[m]["role"], messages[m]["content"]});
  return prompt;
}

class TinyRewardModel : public ::testing::TestWithParam<const char*> {};

TEST_P(TinyRewardModel, PackedScoresMatchTransformersAtEveryTokenBudget) {
  const fs::path dir = references() / GetParam();
  const json ref = read_json(dir / "reference.json");
  std::vector<std::vector<int64_t>> sequences;
  for (const auto& s : ref["sequences"]) sequences.push_back(s.get<std::vector<int64_t>>());
  // 1: each sequence alone; 12: the longest alone, the others two or three to a forward; 1000: all in one.
  for (int64_t budget : {1, 12, 13, 1000}) {
    const RewardModel rm(Transformer::load(dir.string(), at::kFloat, at::kCPU), budget);
    const std::vector<double> got = rm.score(sequences);
    EXPECT_LT(max_error(got, ref["single"]), 1e-5) << GetParam() << " budget " << budget;
  }
}

// A step's batch: three prompts (20, 17 and 40 tokens) with four answers each (1 to 8 tokens), one
// sequence alone, and two that share only 10 first tokens (under kMinSharedTokens: not shared). Scores
// with shared prefixes equal each sequence scored alone, at budgets that split groups between forwards
// (their prefix then runs in each) and that hold everything. The comparison tells two answers' scores
// apart: the batch with two answers swapped differs from the sequences' own scores at those places.
TEST_P(TinyRewardModel, SharedPrefixesScoreAsEachSequenceAlone) {
  const fs::path dir = references() / GetParam();
  RewardModel rm(Transformer::load(dir.string(), at::kFloat, at::kCPU), 4096);
  at::manual_seed(3);
  const int64_t V = rm.model().config().vocab_size;
  auto random_ids = [&](int64_t n) { return random_tokens(V, n); };
  std::vector<std::vector<int64_t>> sequences;
  for (const int64_t prompt : {20, 17, 40}) {
    const std::vector<int64_t> p = random_ids(prompt);
    for (int64_t a = 0; a < 4; ++a) {
      std::vector<int64_t> seq = p;
      for (int64_t id : random_ids(1 + 2 * a + prompt % 2)) seq.push_back(id);
      sequences.push_back(seq);
    }
  }
  sequences.push_back(random_ids(11));
  std::vector<int64_t> near = random_ids(10);
  for (int k = 0; k < 2; ++k) {
    std::vector<int64_t> seq = near;
    for (int64_t id : random_ids(8)) seq.push_back(id);
    sequences.push_back(seq);
  }
  std::vector<double> alone;
  for (const auto& seq : sequences) alone.push_back(rm.score({seq})[0]);
  auto worst = [&](const std::vector<double>& got) {
    double w = 0;
    for (size_t i = 0; i < got.size(); ++i) w = std::max(w, std::abs(got[i] - alone[i]));
    return w;
  };
  // 30: a prompt and one to three of its answers a forward; 64: groups split after their first answers.
  for (const int64_t budget : {1, 30, 64, 4096}) {
    RewardModel packed(Transformer(rm.model()), budget);
    EXPECT_LT(worst(packed.score(sequences)), 1e-5) << GetParam() << " budget " << budget;
    packed.set_share_prefixes(false);
    EXPECT_LT(worst(packed.score(sequences)), 1e-5) << GetParam() << " budget " << budget << ", unshared";
  }
  std::vector<std::vector<int64_t>> swapped = sequences;
  std::swap(swapped[1], swapped[2]);
  EXPECT_GT(worst(rm.score(swapped)), 1e-3) << "two answers' scores swapped";
}

// Prompts that begin with one 20-token header (a chat template's, an instruction) and go on for 30 tokens
// of their own, four answers of 5 tokens each, as a step lists them, then a last prompt's single answer:
// each prompt's 50 tokens run once for its answers (the header is not what they share), so the forwards
// run 3 x (50 + 4 x 5) + 55 tokens. Scores as each sequence alone. The twin: grouping every sequence over
// the header alone runs 20 + 13 x 35 tokens, which the count rejects. A budget holding one prompt and two
// answers splits each group in two: its prefix runs twice. So does a forward's keys, past kKeysPerToken x
// the budget.
TEST_P(TinyRewardModel, AnswersShareTheirPromptNotThePromptsCommonHeader) {
  const fs::path dir = references() / GetParam();
  at::manual_seed(4);
  const Transformer model = Transformer::load(dir.string(), at::kFloat, at::kCPU);
  const int64_t V = model.config().vocab_size;
  auto random_ids = [&](int64_t n) { return random_tokens(V, n); };
  const std::vector<int64_t> header = random_ids(20);
  std::vector<std::vector<int64_t>> sequences;
  for (int p = 0; p < 4; ++p) {
    std::vector<int64_t> prompt = header;
    for (int64_t id : random_ids(30)) prompt.push_back(id);
    for (int a = 0; a < (p < 3 ? 4 : 1); ++a) {
      std::vector<int64_t> seq = prompt;
      seq.push_back(a + 1);  // answers differ from their first token on
      for (int64_t id : random_ids(4)) seq.push_back(id);
      sequences.push_back(seq);
    }
  }
  const RewardModel rm(Transformer(model), 4096);
  std::vector<double> alone;
  for (const auto& seq : sequences) alone.push_back(rm.score({seq})[0]);
  int64_t forwarded = 0;
  const std::vector<double> got = rm.score(sequences, &forwarded);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], alone[i], 1e-5) << GetParam() << " sequence " << i;
  EXPECT_EQ(forwarded, 3 * (50 + 4 * 5) + 55);
  EXPECT_NE(forwarded, 20 + 13 * 35) << "every sequence grouped over the header";
  const RewardModel split(Transformer(model), 50 + 2 * 5);
  const std::vector<double> split_got = split.score(sequences, &forwarded);
  EXPECT_EQ(forwarded, 3 * 2 * (50 + 2 * 5) + 55);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(split_got[i], alone[i], 1e-5) << "split, sequence " << i;
  // Forty 2-token answers to one 40-token prompt under a budget of 200: their ids fit one forward (120),
  // their keys (40 + 40 x 42) pass kKeysPerToken x 200 = 1,600, so 37 answers go in a first forward with
  // the prompt and 3 in a second with it again.
  const std::vector<int64_t> prompt = random_ids(40);
  std::vector<std::vector<int64_t>> many;
  for (int a = 0; a < 40; ++a) {
    std::vector<int64_t> seq = prompt;
    seq.push_back(a + 1);
    seq.push_back(random_ids(1)[0]);
    many.push_back(seq);
  }
  ASSERT_EQ(RewardModel::kKeysPerToken, 8);
  const RewardModel keyed(Transformer(model), 200);
  const std::vector<double> many_got = keyed.score(many, &forwarded);
  EXPECT_EQ(forwarded, (40 + 37 * 2) + (40 + 3 * 2));
  for (size_t i = 0; i < many.size(); i += 13) EXPECT_NEAR(many_got[i], keyed.score({many[i]})[0], 1e-5) << i;
}

TEST_P(TinyRewardModel, PaddedBatchesReadTheLastRealToken) {
  const fs::path dir = references() / GetParam();
  const json ref = read_json(dir / "reference.json");
  const RewardModel rm(Transformer::load(dir.string(), at::kFloat, at::kCPU), 1024);
  for (const char* side : {"left", "right"}) {
    const at::Tensor ids = long_tensor(ref[side]["ids"]), mask = long_tensor(ref[side]["mask"]);
    EXPECT_LT(max_error(to_vector(rm.score_padded(ids, mask)), ref[side]["scores"]), 1e-5) << GetParam() << " " << side;
    // Twin: the score read at each row's last pad (a full row: its first token), as a pooling that
    // looked for the pad id's last occurrence would.
    at::NoGradGuard no_grad;
    const at::Tensor positions = (mask.cumsum(1) - 1).clamp_min(0);
    const at::Tensor hidden = rm.model().forward(ids, positions, mask);
    const at::Tensor index = at::arange(ids.size(1), at::kLong).unsqueeze(0);
    const at::Tensor last_pad = (index * (mask == 0).to(at::kLong)).argmax(1);
    const at::Tensor twin = rm.model().score(hidden.index({at::arange(ids.size(0)), last_pad})).select(1, 0);
    EXPECT_GT(max_error(to_vector(twin), ref[side]["scores"]), 1e-3) << GetParam() << " " << side;
  }
}

INSTANTIATE_TEST_SUITE_P(Families, TinyRewardModel, ::testing::Values("qwen2", "llama"));

TEST(LastRealTokens, LeftAndRightPaddingAndAFullRow) {
  const at::Tensor mask = at::tensor({0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1}, at::kLong).view({3, 4});
  const at::Tensor got = last_real_tokens(mask);
  EXPECT_EQ(got[0].item<int64_t>(), 3);
  EXPECT_EQ(got[1].item<int64_t>(), 1);
  EXPECT_EQ(got[2].item<int64_t>(), 3);
}

TEST(RewardModel, ConversationsThroughItsOwnTemplateMatchTransformers) {
  RLT_SKIP_WITHOUT_FIXTURES();
  const fs::path dir = references() / "qwen3_chat";
  const json ref = read_json(dir / "reference.json");
  const RewardModel rm = RewardModel::load(dir.string(), at::kFloat, at::kCPU, 4096);
  std::vector<std::vector<int64_t>> sequences;
  for (size_t c = 0; c < ref["conversations"].size(); ++c) {
    const json& messages = ref["conversations"][c];
    const std::vector<int64_t> ids = rm.encode(prompt_of(messages), "", messages.back()["content"]);
    EXPECT_EQ(ids, ref["ids"][c].get<std::vector<int64_t>>()) << "conversation " << c;
    sequences.push_back(ids);
  }
  EXPECT_LT(max_error(rm.score(sequences), ref["scores"]), 1e-5);
  // A one-turn prompt given as its question: the same ids as the messages.
  EXPECT_EQ(rm.encode({}, ref["conversations"][0][0]["content"], ref["conversations"][0][1]["content"]),
            ref["ids"][0].get<std::vector<int64_t>>());
  // Twin: each conversation one token short (its template's closing newline dropped).
  for (auto& s : sequences) s.pop_back();
  EXPECT_GT(max_error(rm.score(sequences), ref["scores"]), 1e-3);
}

// ATen's thread count, restored when the scope ends however it ends (a failed ASSERT returns early).
struct ThreadsKept {
  ThreadsKept() : threads(at::get_num_threads()) {}
  ~ThreadsKept() { at::set_num_threads(threads); }
  const int threads;
};

// The reference's conversations as a step's texts: each prompt `answers` times in a row (answers to one
// prompt, which share it), its responses told apart by r + a exclamation marks, over `repeats` repeats r.
struct Batch {
  Batch(const json& ref, int repeats, int answers) {
    for (int repeat = 0; repeat < repeats; ++repeat) {
      for (const json& messages : ref["conversations"]) {
        for (int answer = 0; answer < answers; ++answer) {
          prompts.push_back(prompt_of(messages));
          responses.push_back(messages.back()["content"].get<std::string>() + std::string(repeat + answer, '!'));
        }
      }
    }
  }
  // In order, or last to first.
  std::vector<RewardModel::Text> texts(bool reversed) const {
    std::vector<RewardModel::Text> out;
    for (size_t k = 0; k < prompts.size(); ++k) {
      const size_t i = reversed ? prompts.size() - 1 - k : k;
      out.push_back({prompts[i], question, responses[i]});
    }
    return out;
  }
  std::vector<std::vector<ChatMessage>> prompts;
  std::vector<std::string> responses;
  const std::string question;  // none: the prompts are messages
};

// A batch encoded on several threads: each text's ids in its own place, as one by one. The twin: a batch
// whose texts are the same but in another order gives other ids in each place.
TEST(RewardModel, ABatchEncodedOnThreadsIsEachTextsEncoding) {
  RLT_SKIP_WITHOUT_FIXTURES();
  const fs::path dir = references() / "qwen3_chat";
  const json ref = read_json(dir / "reference.json");
  const RewardModel rm = RewardModel::load(dir.string(), at::kFloat, at::kCPU, 4096);
  const Batch batch(ref, /*repeats=*/8, /*answers=*/1);
  const std::vector<RewardModel::Text> texts = batch.texts(false), reversed = batch.texts(true);
  const std::vector<std::vector<ChatMessage>>& prompts = batch.prompts;
  const std::vector<std::string>& responses = batch.responses;
  const std::string& none = batch.question;
  std::vector<std::vector<int64_t>> got, got_reversed;
  {
    const ThreadsKept kept;
    at::set_num_threads(4);
    got = rm.encode(texts), got_reversed = rm.encode(reversed);
  }
  ASSERT_EQ(got.size(), texts.size());
  for (size_t i = 0; i < texts.size(); ++i) {
    EXPECT_EQ(got[i], rm.encode(prompts[i], none, responses[i])) << "text " << i;
    EXPECT_NE(got_reversed[i], got[i]) << "text " << i;
  }
}

// Texts scored while they are encoded (score_texts, as a step scores them): the scores of encoding them all
// first, in several forwards (a budget of 64 tokens) and on one thread or four; the first ones those of
// transformers. The twin: the texts in reverse order give other scores in each place.
TEST(RewardModel, TextsScoredWhileEncodedScoreAsEncodedFirst) {
  RLT_SKIP_WITHOUT_FIXTURES();
  const fs::path dir = references() / "qwen3_chat";
  const json ref = read_json(dir / "reference.json");
  const RewardModel rm = RewardModel::load(dir.string(), at::kFloat, at::kCPU, 64);
  const Batch batch(ref, /*repeats=*/4, /*answers=*/3);
  const std::vector<RewardModel::Text> texts = batch.texts(false), reversed = batch.texts(true);
  const ThreadsKept kept;
  for (const int n : {1, 4}) {
    at::set_num_threads(n);
    int64_t first = 0, overlapped = 0;
    const std::vector<double> want = rm.score(rm.encode(texts), &first);
    const std::vector<double> got = rm.score_texts(texts, &overlapped);
    const std::vector<double> got_reversed = rm.score_texts(reversed);
    ASSERT_EQ(got.size(), texts.size());
    EXPECT_EQ(overlapped, first) << n << " threads";
    for (size_t i = 0; i < texts.size(); ++i) {
      EXPECT_EQ(got[i], want[i]) << n << " threads, text " << i;
      EXPECT_GT(std::abs(got_reversed[i] - got[i]), 1e-6) << n << " threads, text " << i;
    }
    for (size_t c = 0; c < ref["conversations"].size(); ++c)  // repeat 0, answer 0: the conversation itself
      EXPECT_NEAR(got[3 * c], ref["scores"][c].get<double>(), 1e-5) << "conversation " << c;
  }
  EXPECT_TRUE(rm.score_texts({}).empty());
}

// A copy of the qwen2 folder with config.json edited by `edit`.
fs::path edited(const fs::path& to, const std::function<void(json&)>& edit) {
  fs::create_directories(to);
  fs::copy(references() / "qwen2", to, fs::copy_options::overwrite_existing | fs::copy_options::recursive);
  json c = read_json(to / "config.json");
  edit(c);
  std::ofstream(to / "config.json") << c.dump(2);
  return to;
}

TEST(RewardModel, RefusesAFolderThatIsNotAOneLabelScoreHead) {
  const rlt::testing::TempDir tmp("reward_model_refusals");
  auto refused = [&](const fs::path& dir, const std::string& field) {
    try {
      reward_model_config(dir.string());
      ADD_FAILURE() << dir << ": accepted";
    } catch (const RewardModelError& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  refused(edited(tmp.path() / "two", [](json& c) { c["id2label"] = {{"0", "bad"}, {"1", "good"}}; }), "id2label");
  refused(edited(tmp.path() / "lm", [](json& c) { c["architectures"] = {"Qwen2ForCausalLM"}; }), "architectures");
  refused(edited(tmp.path() / "none", [](json& c) { c.erase("architectures"); }), "architectures");
  refused(tmp.path() / "missing", "config.json");
  EXPECT_NO_THROW(reward_model_config((references() / "qwen2").string()));
  // The folder as a run reads it: without a tokenizer and a chat template it is refused too, naming them.
  try {
    check_reward_model_folder((references() / "qwen2").string());
    ADD_FAILURE() << "a folder without a tokenizer: accepted";
  } catch (const RewardModelError& e) {
    EXPECT_NE(std::string(e.what()).find("tokenizer"), std::string::npos) << e.what();
  }
  // A token-classification folder is a critic's, not a reward model.
  refused(edited(tmp.path() / "token", [](json& c) { c["architectures"] = {"Qwen2ForTokenClassification"}; }),
          "architectures");
  // An id outside the vocabulary, and an empty sequence, name the sequence.
  const RewardModel rm(Transformer::load((references() / "qwen2").string(), at::kFloat, at::kCPU), 64);
  EXPECT_THROW(rm.score({{1, 2}, {1, 97}}), std::invalid_argument);
  EXPECT_THROW(rm.score({{1, 2}, {}}), std::invalid_argument);
}

}  // namespace
}  // namespace rlt
