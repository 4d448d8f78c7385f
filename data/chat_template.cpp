// Placeholder substitution for the chat template; see chat_template.h.
#include "data/chat_template.h"

#include "data/dataset.h"
#include "data/hf_chat.h"
#include "data/tokenizer.h"

namespace rlt {

std::string render_prompt(const ChatTemplateOptions& options, const std::string& question) {
  // One left-to-right pass: text substituted for a placeholder is never scanned again, so a question
  // that itself contains "{system}" stays as written.
  const std::pair<const char*, const std::string*> fills[] = {
      {"{system}", &options.system}, {"{tools}", &options.tools}, {"{question}", &question}};
  const std::string& t = options.prompt;
  std::string out;
  for (size_t i = 0; i < t.size();) {
    bool replaced = false;
    for (const auto& [key, value] : fills) {
      const size_t n = std::char_traits<char>::length(key);
      if (t.compare(i, n, key) == 0) {
        out += *value;
        i += n;
        replaced = true;
        break;
      }
    }
    if (!replaced) out += t[i++];
  }
  return out;
}

std::vector<int64_t> encode_prompt(const Tokenizer& tokenizer, const ChatTemplateOptions& options,
                                   const std::string& question) {
  std::vector<int64_t> ids;
  if (options.add_bos && tokenizer.bos_id() >= 0) ids.push_back(tokenizer.bos_id());
  const auto body = tokenizer.encode(render_prompt(options, question));
  ids.insert(ids.end(), body.begin(), body.end());
  return ids;
}

std::vector<int64_t> encode_chat(const Tokenizer& tokenizer, const HfChatTemplate& chat,
                                 const ChatTemplateOptions& options, const std::vector<ChatMessage>& messages,
                                 const std::string& question, const nlohmann::ordered_json& tools) {
  nlohmann::ordered_json conv = nlohmann::ordered_json::array();
  const bool has_system = !messages.empty() && messages.front().role == "system";
  std::string system = options.system;
  if (!options.tools.empty()) system += (system.empty() ? "" : "\n") + options.tools;
  if (!has_system && !system.empty()) conv.push_back({{"role", "system"}, {"content", system}});
  if (messages.empty()) {
    conv.push_back({{"role", "user"}, {"content", question}});
  } else {
    for (const auto& m : messages) conv.push_back({{"role", m.role}, {"content", m.content}});
  }
  const auto vars = nlohmann::ordered_json::parse(options.template_vars);
  return tokenizer.encode(chat.render(conv, tools, /*add_generation_prompt=*/true, vars));
}

}  // namespace rlt
