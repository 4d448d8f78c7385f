// The text framing around a question: system text, tool instructions, user and assistant turns. Two
// kinds (`chat.template`): the model's own Jinja chat template from its checkpoint folder (data/hf_chat.h,
// what instruct models were trained with), or a fixed string with {system}, {tools} and {question}
// placeholders (the built-in demo, and base models without a template).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/fields.h"

namespace rlt {

class Tokenizer;
class HfChatTemplate;
struct ChatMessage;

// Which framing renders a prompt.
enum class ChatTemplateKind { kFixed, kModel };
inline const EnumNames<ChatTemplateKind>& enum_names(ChatTemplateKind) {
  static const EnumNames<ChatTemplateKind> names{{"fixed", ChatTemplateKind::kFixed},
                                                 {"model", ChatTemplateKind::kModel}};
  return names;
}

struct ChatTemplateOptions {
  ChatTemplateKind template_kind = ChatTemplateKind::kFixed;
  std::string template_vars = "{}";
  std::string prompt = "{system}\n{tools}\nUser: {question}\nAssistant: ";
  std::string system = "You solve arithmetic problems exactly.";
  std::string tools =
      "You may run Python: write code between <code> and </code>; its output comes back between "
      "<interpreter> and </interpreter>. End with Answer: \\boxed{...}.";
  bool add_bos = true;

  template <class V>
  void visit(V&& v) {
    v("template", template_kind,
      "fixed (the prompt string below) | model (model.path's own chat template, from tokenizer_config.json)");
    v("template_vars", template_vars,
      "model template: extra variables as a JSON object, e.g. {\"enable_thinking\": false} (Qwen3)");
    v("prompt", prompt,
      "fixed template: {system}, {tools}, {question} are replaced, other braces kept; needs {question}");
    v("system", system, "system text ({system})");
    v("tools", tools, "tool-use instructions ({tools}); empty for plain generation");
    v("add_bos", add_bos,
      "fixed template: start the prompt ids with the tokenizer's BOS (a model template writes its own)");
  }
  void check(const FieldFail& fail) const {
    if (prompt.find("{question}") == std::string::npos) fail("prompt", "must contain {question}");
    if (!nlohmann::json::accept(template_vars) || !nlohmann::json::parse(template_vars).is_object()) {
      fail("template_vars", "must be a JSON object, got '" + template_vars + "'");
    }
  }
};

// The prompt text for one question.
std::string render_prompt(const ChatTemplateOptions& options, const std::string& question);
// Its ids: BOS (when add_bos and the tokenizer has one) + encode(render_prompt(...)).
std::vector<int64_t> encode_prompt(const Tokenizer& tokenizer, const ChatTemplateOptions& options,
                                   const std::string& question);

// A prompt through the model's own template: the conversation (`messages`, or one user turn holding
// `question` when empty), with options.system + options.tools as a system turn when it has none and they
// are not empty, the generation prompt appended, options.template_vars as extra variables, `tools` (a list
// of JSON schemas, or null) as the template's tools; encoded with special-token text as special tokens
// (the template writes BOS itself where the model wants one).
std::vector<int64_t> encode_chat(const Tokenizer& tokenizer, const HfChatTemplate& chat,
                                 const ChatTemplateOptions& options, const std::vector<ChatMessage>& messages,
                                 const std::string& question,
                                 const nlohmann::ordered_json& tools = nlohmann::ordered_json());

}  // namespace rlt
