// How the policy calls the interpreter and how the interpreter's reply comes back: one ToolProtocol
// shared by the rollout (rollout/retool.h), the demo tokenizer's single-piece tags and the warm-up traces,
// so all three agree.
//
// Two call formats (`rollout.tool_format`):
//   code       <code>\n...\n</code>, or a ```python fenced block (the demo's, and ReTool's paper format);
//   tool_call  <tool_call>{"name": "code_interpreter", "arguments": {"code": "..."}}</tool_call>, the
//              function-calling format Qwen2.5/Qwen3 templates teach (slime's ReTool recipe).
// Two reply framings, chosen by the prompt's chat template:
//   fixed template  <interpreter>\n{output}\n</interpreter>\n inside the assistant's text;
//   model template  the template's own tool turn: what it writes between an assistant message and a
//                   tool message's content, and after that content up to the next generation prompt
//                   (Qwen: <|im_end|>\n<|im_start|>user\n<tool_response>\n ... \n</tool_response>
//                   <|im_end|>\n<|im_start|>assistant\n). The assistant's end-of-turn token is part of
//                   the framing: the policy's turn ends at </tool_call> (or </code>).
// The framing and the output are tokenised on their own and appended with loss_mask = 0; the policy's
// own text is never re-tokenised.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/fields.h"

namespace rlt {

class HfChatTemplate;

enum class ToolFormat { kCode, kToolCall };
inline const EnumNames<ToolFormat>& enum_names(ToolFormat) {
  static const EnumNames<ToolFormat> names{{"code", ToolFormat::kCode}, {"tool_call", ToolFormat::kToolCall}};
  return names;
}

struct ToolProtocol {
  ToolFormat format = ToolFormat::kCode;
  // code format.
  std::string code_open = "<code>";
  std::string code_close = "</code>";
  // tool_call format: the tags around the call's JSON, and the one tool offered.
  std::string call_open = "<tool_call>";
  std::string call_close = "</tool_call>";
  std::string tool_name = "code_interpreter";
  // The reply: reply_open + output + reply_close. The fixed framing's tags are also single pieces of the
  // demo tokenizer (symbols()).
  std::string output_open = "<interpreter>";
  std::string output_close = "</interpreter>";
  std::string reply_open = "<interpreter>\n";
  std::string reply_close = "\n</interpreter>\n";
  // Set when the chat template transforms a tool message's content (Llama-3.1 writes it through tojson):
  // the whole reply is then the template rendered for each call, and reply_open / reply_close are unused.
  std::function<std::string(const std::string& output)> render_reply;

  // How the policy writes a call running `code` (the warm-up traces use it).
  std::string call_text(const std::string& code) const;
  // The tool turn around `output`.
  std::string reply_text(const std::string& output) const {
    return render_reply ? render_reply(output) : reply_open + output + reply_close;
  }
  // The tags a demo tokenizer keeps as single pieces.
  std::vector<std::string> symbols() const;
  // The JSON schema of the tool, for a chat template's `tools` (tool_call format).
  nlohmann::ordered_json tool_schema() const;
};

// The reply framing of a model's chat template: the text after an assistant message's content up to a
// tool message's content (open), and after the tool content through the next generation prompt (close).
// Rendered with placeholder contents; `vars` are the template's extra variables (chat.template_vars).
// verbatim: the template inserts the content as it is, so open + output + close is its tool turn for any
// output (false for a template that JSON-quotes it, as Llama-3.1's does). Throws DataError when the
// template refuses a tool turn (its own raise_exception message; Gemma-2 has no tool role).
struct TemplateReply {
  std::string open, close;
  bool verbatim = true;
};
TemplateReply template_tool_framing(const HfChatTemplate& chat, const nlohmann::ordered_json& vars,
                                    const std::string& tool_name);

// Makes p's reply the template's own tool turn: the framing's tokens around the output's when the template
// inserts it verbatim, else the template rendered for each call (render_reply). Throws as above.
void use_template_reply(ToolProtocol& p, std::shared_ptr<const HfChatTemplate> chat,
                        const nlohmann::ordered_json& vars);

// A <tool_call> body (the text between the tags): {"name": tool_name, "arguments": {"code": "..."}}, the
// arguments also as a JSON-encoded string. Returns the code, or an error message written for the model
// (bad JSON with the parser's reason, another tool's name, no "code" string); never throws.
struct ParsedToolCall {
  bool ok = false;
  std::string code;   // when ok
  std::string error;  // when not
};
ParsedToolCall parse_tool_call(const std::string& body, const std::string& tool_name);

// One piece of a worked trace: written by the model (trainable, loss_mask = 1) or produced by the tool
// (not trainable, loss_mask = 0).
struct TraceSegment {
  std::string text;
  bool trainable = true;
};

// A worked tool-use solution laid out exactly as a rollout would produce it: the call running `code`
// (trainable; the turn ends at the close tag), the reply around `output` (not trainable), then
// `answer_text` (trainable). The caller appends EOS after the last segment.
std::vector<TraceSegment> tool_use_trace(const ToolProtocol& protocol, const std::string& code,
                                         const std::string& output, const std::string& answer_text);

}  // namespace rlt
