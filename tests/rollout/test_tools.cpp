// The tool protocol (rollout/tools.h): call layouts in both formats, <tool_call> parsing and the message
// a malformed call gets, the reply framing of real published chat templates, and a ReTool rollout in the
// tool_call format with the Qwen tokenizer whose token sequence decodes to exactly what the model's own
// template renders for the same conversation (the template renderer is byte-identical to transformers:
// tests/apps/check_chat_template.py).
#include <gtest/gtest.h>

#include <fstream>
#include <future>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "data/chat_template.h"
#include "data/dataset.h"
#include "data/hf_chat.h"
#include "data/tokenizer.h"
#include "rollout/retool.h"
#include "rollout/tools.h"
#include "tests/common/fake_tool.h"
#include "tests/common/fixtures.h"

namespace rlt {
namespace {

const std::string kFixtures = RLT_FIXTURES_DIR;

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f.good()) << path;
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

HfChatTemplate fixture_template(const std::string& name, const std::string& bos = "", const std::string& eos = "") {
  const std::string path = kFixtures + "/templates/" + name + ".jinja";
  return HfChatTemplate::from_source(read_file(path), bos, eos, path);
}

TEST(ToolProtocol, CallLayoutsInBothFormats) {
  ToolProtocol code;
  const auto trace = tool_use_trace(code, "print(12 * 34)", "408", "Answer: \\boxed{408}");
  ASSERT_EQ(trace.size(), 3u);
  EXPECT_EQ(trace[0].text, "<code>\nprint(12 * 34)\n</code>");
  EXPECT_TRUE(trace[0].trainable);
  EXPECT_EQ(trace[1].text, "<interpreter>\n408\n</interpreter>\n");
  EXPECT_FALSE(trace[1].trainable) << "tool output is never trained on";
  EXPECT_EQ(trace[2].text, "Answer: \\boxed{408}");
  EXPECT_EQ(code.symbols(), (std::vector<std::string>{"<code>", "</code>", "<interpreter>", "</interpreter>"}));

  ToolProtocol call;
  call.format = ToolFormat::kToolCall;
  const std::string code_text = "s = \"a\\tb\"\nprint(s)";
  const std::string text = call.call_text(code_text);
  EXPECT_EQ(
      text,
      "<tool_call>\n{\"name\": \"code_interpreter\", \"arguments\": {\"code\": \"s = \\\"a\\\\tb\\\"\\nprint(s)\"}}"
      "\n</tool_call>");
  // What the call writes parses back to the same code.
  const std::string body = text.substr(11, text.size() - 11 - 12);
  const ParsedToolCall parsed = parse_tool_call(body, "code_interpreter");
  ASSERT_TRUE(parsed.ok) << parsed.error;
  EXPECT_EQ(parsed.code, code_text);
  EXPECT_EQ(call.tool_schema()["function"]["name"], "code_interpreter");
  EXPECT_EQ(call.tool_schema()["function"]["parameters"]["required"][0], "code");
}

TEST(ToolProtocol, MalformedCallsAreAnsweredWithWhatIsWrong) {
  const std::string name = "code_interpreter";
  auto error_of = [&](const std::string& body) {
    const ParsedToolCall p = parse_tool_call(body, name);
    EXPECT_FALSE(p.ok) << body;
    EXPECT_NE(p.error.find("<tool_call>{\"name\": \"code_interpreter\""), std::string::npos)
        << "the message shows the right form: " << p.error;
    return p.error;
  };
  EXPECT_NE(error_of("{\"name\": \"code_interpreter\", \"arguments\": {\"code\": \"x\"}").find("not valid JSON"),
            std::string::npos);
  EXPECT_NE(error_of("[1, 2]").find("must be a JSON object"), std::string::npos);
  EXPECT_NE(error_of("{\"arguments\": {\"code\": \"x\"}}").find("no \"name\""), std::string::npos);
  EXPECT_NE(error_of("{\"name\": \"search\", \"arguments\": {}}").find("no tool named \"search\""), std::string::npos);
  EXPECT_NE(error_of("{\"name\": \"code_interpreter\", \"arguments\": {\"cmd\": \"x\"}}").find("\"code\" string"),
            std::string::npos);
  EXPECT_NE(error_of("{\"name\": \"code_interpreter\", \"arguments\": {\"code\": \" \\n\"}}").find("empty"),
            std::string::npos);
  EXPECT_NE(error_of("{\"name\": \"code_interpreter\", \"arguments\": \"{oops\"}").find("not a JSON object"),
            std::string::npos);
  // Arguments as a JSON-encoded string are accepted, with whitespace around the JSON.
  const ParsedToolCall p = parse_tool_call(
      "\n {\"name\": \"code_interpreter\", \"arguments\": \"{\\\"code\\\": \\\"print(1)\\\"}\"}\n", name);
  ASSERT_TRUE(p.ok) << p.error;
  EXPECT_EQ(p.code, "print(1)");
}

TEST(ToolProtocol, ReplyFramingOfPublishedTemplates) {
  RLT_SKIP_WITHOUT_FIXTURES();
  const auto none = nlohmann::ordered_json::object();
  const TemplateReply q = template_tool_framing(fixture_template("Qwen2.5-Instruct"), none, "code_interpreter");
  EXPECT_EQ(q.open, "<|im_end|>\n<|im_start|>user\n<tool_response>\n");
  EXPECT_EQ(q.close, "\n</tool_response><|im_end|>\n<|im_start|>assistant\n");
  EXPECT_TRUE(q.verbatim);
  // Qwen3 without thinking: the generation prompt after the tool turn carries the empty think block.
  const TemplateReply t =
      template_tool_framing(fixture_template("Qwen3"), {{"enable_thinking", false}}, "code_interpreter");
  EXPECT_EQ(t.open, "<|im_end|>\n<|im_start|>user\n<tool_response>\n");
  EXPECT_EQ(t.close, "\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  // Llama-3.1 writes the content through tojson: not verbatim, so its replies are rendered per call.
  const TemplateReply l = template_tool_framing(
      fixture_template("Llama-3.1-Instruct", "<|begin_of_text|>", "<|eot_id|>"), none, "code_interpreter");
  EXPECT_FALSE(l.verbatim);
  EXPECT_EQ(l.open, "<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n\"");
  // A template without a tool role is refused with the reason.
  auto refusal = [&](const std::string& name) {
    try {
      template_tool_framing(fixture_template(name, "<bos>", "<eos>"), none, "code_interpreter");
    } catch (const DataError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(refusal("Gemma-2-it").find("cannot render a tool turn"), std::string::npos) << "Gemma-2 has no tool role";
}

// A template that hits a renderer limit on the tool turn is refused with that limit, not with the advice for
// templates that lack a tool role; one without a tool role still gets that advice.
TEST(ToolProtocol, AToolTurnOverARenderLimitNamesTheLimit) {
  const auto none = nlohmann::ordered_json::object();
  auto refusal = [&](const std::string& source) {
    try {
      template_tool_framing(HfChatTemplate::from_source(source, "", "", "hostile.jinja"), none, "code_interpreter");
    } catch (const DataError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  const std::string hostile =
      "{% for m in messages %}{% for i in range(10**8) %}x{% endfor %}{{ m['content'] }}{% endfor %}";
  const std::string over = refusal(hostile);
  EXPECT_NE(over.find("range length limit"), std::string::npos) << over;
  EXPECT_NE(over.find("hostile.jinja"), std::string::npos) << over;
  EXPECT_EQ(over.find("chat.template: fixed"), std::string::npos) << over;
  // No tool role: the template raises on it, and the advice stays.
  const std::string no_tool =
      "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
      "{{ m['content'] }}{% endfor %}";
  EXPECT_NE(refusal(no_tool).find("chat.template: fixed"), std::string::npos) << refusal(no_tool);
}

// Proposes its script one token at a time (logit 100); a fed token that is not the proposal is the loop's
// own (the tool turn) and does not advance the script.
class ReplayPolicy : public TokenPolicy {
 public:
  ReplayPolicy(int64_t vocab, std::vector<int64_t> script, int64_t eos)
      : V_(vocab), script_(std::move(script)), eos_(eos) {}
  at::Tensor start(const std::vector<std::vector<int64_t>>& prompts, int64_t repeats) override {
    EXPECT_EQ(prompts.size() * repeats, 1u);
    fed_ = prompts[0];
    return proposal();
  }
  at::Tensor step(const std::vector<int64_t>& rows, const std::vector<int64_t>& tokens) override {
    fed_.push_back(tokens[0]);
    if (pos_ < script_.size() && tokens[0] == script_[pos_]) ++pos_;
    return proposal();
  }
  void release(const std::vector<int64_t>&) override {}
  int64_t vocab_size() const override { return V_; }
  std::vector<int64_t> fed_;

 private:
  at::Tensor proposal() const {
    at::Tensor logits = at::zeros({1, V_});
    logits[0][pos_ < script_.size() ? script_[pos_] : eos_] = 100.0;
    return logits;
  }
  int64_t V_;
  std::vector<int64_t> script_;
  int64_t eos_;
  size_t pos_ = 0;
};

// A published tokenizer with a published template: Qwen2.5's (verbatim tool content) on the Qwen3 tokenizer,
// Llama-3.1's (tool content through tojson, rendered per call) on its own.
struct ModelCase {
  std::string name, tokenizer, chat_template, bos, eos, end_of_turn;
};
std::ostream& operator<<(std::ostream& os, const ModelCase& c) { return os << c.name; }

class ModelToolCall : public ::testing::TestWithParam<ModelCase> {
 protected:
  void SetUp() override {
    RLT_SKIP_WITHOUT_FIXTURES();
    const ModelCase& c = GetParam();
    tok_ = std::make_unique<Tokenizer>(Tokenizer::load(kFixtures + "/tokenizers/" + c.tokenizer));
    chat_ = std::make_shared<HfChatTemplate>(fixture_template(c.chat_template, c.bos, c.eos));
    protocol_.format = ToolFormat::kToolCall;
    use_template_reply(protocol_, chat_, nlohmann::ordered_json::object());
    chat_options_.template_kind = ChatTemplateKind::kModel;
    chat_options_.system = "You are a helpful assistant.";
    chat_options_.tools = "";
  }
  std::vector<int64_t> prompt() const {
    return encode_chat(*tok_, *chat_, chat_options_, {}, kQuestion,
                       nlohmann::ordered_json::array({protocol_.tool_schema()}));
  }
  Trajectory run(const std::vector<std::string>& script_parts, std::vector<std::string>* calls) const {
    std::vector<int64_t> script;
    for (const auto& part : script_parts) {
      const auto ids = tok_->encode(part);
      script.insert(script.end(), ids.begin(), ids.end());
    }
    ReplayPolicy policy(tok_->vocab_size(), script, tok_->piece_id(GetParam().eos));
    SamplingOptions s;
    s.samples_per_prompt = 1;
    s.max_new_tokens = 200;
    RolloutOptions o;
    o.tool_format = ToolFormat::kToolCall;
    o.stop_ids = {tok_->piece_id(GetParam().eos)};
    testing::FakeTool tool;
    tool.outputs["print(6*7)"] = "42\n";
    auto trajs = rollout(policy, *tok_, {prompt()}, s, o, tool.runner(), {}, protocol_);
    *calls = tool.calls;
    return trajs.at(0);
  }
  // The model's own rendering of the conversation, up to the end of the last assistant text.
  std::string rendered(const nlohmann::ordered_json& turns) const {
    nlohmann::ordered_json conv = nlohmann::ordered_json::array();
    conv.push_back({{"role", "system"}, {"content", chat_options_.system}});
    conv.push_back({{"role", "user"}, {"content", kQuestion}});
    for (const auto& t : turns) conv.push_back(t);
    std::string text = chat_->render(conv, nlohmann::ordered_json::array({protocol_.tool_schema()}), false);
    const std::string& end = GetParam().end_of_turn;
    EXPECT_EQ(text.substr(text.size() - end.size()), end);
    return text.substr(0, text.size() - end.size());
  }
  std::string masked_text(const Trajectory& t, uint8_t mask) const {
    std::vector<int64_t> ids;
    for (size_t i = 0; i < t.response_ids.size(); ++i) {
      if (t.loss_mask[i] == mask) ids.push_back(t.response_ids[i]);
    }
    return tok_->decode(ids);
  }

  const std::string kQuestion = "What is 6 * 7?";
  std::unique_ptr<Tokenizer> tok_;
  std::shared_ptr<HfChatTemplate> chat_;
  ToolProtocol protocol_;
  ChatTemplateOptions chat_options_;
};

TEST_P(ModelToolCall, TrajectoryIsTheTemplatesOwnConversation) {
  const std::string call =
      "I will compute it.\n<tool_call>\n{\"name\": \"code_interpreter\", \"arguments\": {\"code\": \"print(6*7)\"}}\n"
      "</tool_call>";
  const std::string answer = "The product is \\boxed{42}";
  std::vector<std::string> calls;
  const Trajectory t = run({call, answer}, &calls);
  EXPECT_EQ(calls, std::vector<std::string>{"print(6*7)"});
  EXPECT_EQ(t.finish, FinishReason::kAnswer);
  EXPECT_EQ(t.tool_calls, 1);
  EXPECT_EQ(t.response_text, call + answer);
  EXPECT_EQ(masked_text(t, 1), call + answer) << "the sampled tokens are the model's text";
  EXPECT_EQ(masked_text(t, 0), protocol_.reply_text("42")) << "the reply is masked out of the loss";
  const std::string want = rendered({{{"role", "assistant"}, {"content", call}},
                                     {{"role", "tool"}, {"content", "42"}},
                                     {{"role", "assistant"}, {"content", answer}}});
  EXPECT_EQ(tok_->decode(t.ids()), want) << "the template's own rendering of the same conversation";
  // A reply framed as an <interpreter> block inside the assistant's text is not what the template writes.
  ToolProtocol fixed;
  fixed.format = ToolFormat::kToolCall;
  const std::string prompt_text = tok_->decode(prompt());
  EXPECT_NE(prompt_text + call + fixed.reply_text("42") + answer, want);
}

TEST_P(ModelToolCall, MalformedJsonIsAnsweredAndTheRunGoesOn) {
  const std::string bad =
      "<tool_call>\n{\"name\": \"code_interpreter\", \"arguments\": {\"code\": \"print(6*7)\"\n</tool_call>";
  const std::string answer = "So \\boxed{42}";
  std::vector<std::string> calls;
  const Trajectory t = run({bad, answer}, &calls);
  EXPECT_TRUE(calls.empty()) << "nothing to run";
  EXPECT_EQ(t.feedback_turns, 1);
  EXPECT_EQ(t.finish, FinishReason::kAnswer) << "the run goes on after the error";
  const std::string reply = masked_text(t, 0);
  EXPECT_EQ(reply.rfind(protocol_.reply_open, 0), 0u) << reply;
  EXPECT_NE(reply.find("Error: the tool call is not valid JSON"), std::string::npos) << reply;
}

INSTANTIATE_TEST_SUITE_P(Published, ModelToolCall,
                         ::testing::Values(ModelCase{"qwen", "qwen3", "Qwen2.5-Instruct", "", "<|im_end|>",
                                                     "<|im_end|>\n"},
                                           ModelCase{"llama", "llama-3.1", "Llama-3.1-Instruct", "<|begin_of_text|>",
                                                     "<|eot_id|>", "<|eot_id|>"}),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace rlt
