// A model's own chat template: the Jinja `chat_template` of its tokenizer_config.json (or its
// chat_template.jinja file, which newer transformers write instead), rendered as transformers'
// apply_chat_template(messages, tools=..., add_generation_prompt=..., tokenize=False, **kwargs) renders it,
// with the tokenizer's bos_token and eos_token as variables. Leaves out: named template sets other than
// "default" (tool_use templates are picked by name in transformers; say which with `name`).
#pragma once

#include <nlohmann/json.hpp>

#include <memory>
#include <string>

#include "data/jinja.h"

namespace rlt {

class HfChatTemplate {
 public:
  // Reads DIR/chat_template.jinja if present, else tokenizer_config.json's chat_template (a string, or a
  // list of {"name", "template"} of which `name` is used). Throws DataError naming the file when there is
  // no template or it does not parse.
  static HfChatTemplate from_folder(const std::string& dir, const std::string& name = "default");
  // From template text and the two special tokens (tests, and callers with their own template).
  static HfChatTemplate from_source(const std::string& source, const std::string& bos_token,
                                    const std::string& eos_token, const std::string& where = "template");

  // messages: a JSON list of {"role", "content", ...}; tools: a list of JSON schemas, or null; extra: more
  // template variables (e.g. {"enable_thinking": false}). Throws jinja::TemplateRaise with the template's
  // own message when it refuses the conversation, DataError for other rendering errors (a template that
  // passes one of jinja::Limits included: the message names the limit and the file).
  std::string render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                     bool add_generation_prompt,
                     const nlohmann::ordered_json& extra = nlohmann::ordered_json::object()) const;

  const std::string& source() const { return source_; }

 private:
  std::string source_, bos_, eos_, where_;
  std::shared_ptr<jinja::Template> template_;
};

}  // namespace rlt
