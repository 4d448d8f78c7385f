// The text framing around a question: system text, tool instructions, user and assistant turns. It is
// configured in YAML (`chat:`) as one template with {system}, {tools} and {question} placeholders, so
// any framing a checkpoint was trained with can be written down without code. Leaves out: multi-message
// conversations (a prompt here is one question).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/fields.h"

namespace rlt {

class Tokenizer;

struct ChatTemplateOptions {
  // The prompt the policy continues. {system}, {tools}, {question} are replaced; other braces stay.
  std::string prompt = "{system}\n{tools}\nUser: {question}\nAssistant: ";
  std::string system = "You solve arithmetic problems exactly.";
  std::string tools =
      "You may run Python: write code between <code> and </code>; its output comes back between "
      "<interpreter> and </interpreter>. End with Answer: \\boxed{...}.";
  // Start the ids with the tokenizer's beginning-of-sequence piece.
  bool add_bos = true;

  template <class V>
  void visit(V&& v) {
    v("prompt", prompt, "prompt template with {system}, {tools}, {question}");
    v("system", system, "system text ({system})");
    v("tools", tools, "tool-use instructions ({tools}); empty for plain generation");
    v("add_bos", add_bos, "start the prompt ids with the tokenizer's BOS");
  }
  void check(const FieldFail& fail) const {
    if (prompt.find("{question}") == std::string::npos) fail("prompt", "must contain {question}");
  }
};

// The prompt text for one question.
std::string render_prompt(const ChatTemplateOptions& options, const std::string& question);
// Its ids: BOS (when add_bos and the tokenizer has one) + encode(render_prompt(...)).
std::vector<int64_t> encode_prompt(const Tokenizer& tokenizer, const ChatTemplateOptions& options,
                                   const std::string& question);

}  // namespace rlt
