// The tool protocol; see tools.h.
#include "rollout/tools.h"

#include <exception>

#include "data/dataset.h"  // DataError
#include "data/hf_chat.h"

namespace rlt {

std::string ToolProtocol::call_text(const std::string& code) const {
  if (format == ToolFormat::kCode) return code_open + "\n" + code + "\n" + code_close;
  // As Qwen's templates write an assistant's tool call: the JSON on its own line, ", " and ": " separators.
  const nlohmann::json name = tool_name, body = code;
  return call_open + "\n{\"name\": " + name.dump() + ", \"arguments\": {\"code\": " + body.dump() + "}}\n" + call_close;
}

std::vector<std::string> ToolProtocol::symbols() const {
  std::vector<std::string> out;
  if (format == ToolFormat::kCode) {
    out = {code_open, code_close};
  } else {
    out = {call_open, call_close};
  }
  for (const std::string& s : {output_open, output_close}) {
    if (!s.empty()) out.push_back(s);
  }
  return out;
}

nlohmann::ordered_json ToolProtocol::tool_schema() const {
  nlohmann::ordered_json code = {{"type", "string"}, {"description", "The Python code to run."}};
  nlohmann::ordered_json params = {
      {"type", "object"}, {"properties", {{"code", code}}}, {"required", nlohmann::ordered_json::array({"code"})}};
  nlohmann::ordered_json fn = {
      {"name", tool_name},
      {"description", "Runs Python code in a sandbox and returns what it prints (or the error)."},
      {"parameters", params}};
  return {{"type", "function"}, {"function", fn}};
}

namespace {

// Placeholder contents no template writes itself.
const std::string kQuestion = "RLT_QUESTION_7f3a", kAssistant = "RLT_ASSISTANT_7f3a", kTool = "RLT_TOOL_7f3a";

// The template's rendering of [user, assistant, tool(content)] with the generation prompt.
std::string render_tool_turn(const HfChatTemplate& chat, const nlohmann::ordered_json& vars,
                             const std::string& tool_name, const std::string& tool_content) {
  nlohmann::ordered_json conv = nlohmann::ordered_json::array();
  conv.push_back({{"role", "user"}, {"content", kQuestion}});
  conv.push_back({{"role", "assistant"}, {"content", kAssistant}});
  conv.push_back({{"role", "tool"}, {"name", tool_name}, {"content", tool_content}});
  try {
    return chat.render(conv, nullptr, /*add_generation_prompt=*/true, vars);
  } catch (const std::exception& e) {
    // A template that hits one of the renderer's limits is hostile or broken, not merely without a tool
    // role: fixed-template advice would mislead, so its error is passed on as it is.
    const std::string why = e.what();
    if (jinja::names_a_limit(why)) throw DataError("the chat template's tool turn: " + why);
    throw DataError("the chat template cannot render a tool turn (" + why +
                    "); use chat.template: fixed, whose replies are <interpreter> blocks");
  }
}

}  // namespace

TemplateReply template_tool_framing(const HfChatTemplate& chat, const nlohmann::ordered_json& vars,
                                    const std::string& tool_name) {
  // The probe: quotes, a backslash and a newline come out changed through tojson or an escape filter.
  const std::string kProbe = "a \"quoted\" line\\\nand another";
  const std::string text = render_tool_turn(chat, vars, tool_name, kTool);
  const size_t a = text.find(kAssistant), t = text.find(kTool);
  if (a == std::string::npos || t == std::string::npos || t < a || text.find(kTool, t + 1) != std::string::npos) {
    throw DataError(
        "the chat template does not write an assistant message followed by a tool message's content "
        "once; use chat.template: fixed");
  }
  TemplateReply r;
  r.open = text.substr(a + kAssistant.size(), t - a - kAssistant.size());
  r.close = text.substr(t + kTool.size());
  r.verbatim = render_tool_turn(chat, vars, tool_name, kProbe) == text.substr(0, t) + kProbe + r.close;
  return r;
}

void use_template_reply(ToolProtocol& p, std::shared_ptr<const HfChatTemplate> chat,
                        const nlohmann::ordered_json& vars) {
  const TemplateReply r = template_tool_framing(*chat, vars, p.tool_name);
  p.reply_open = r.open;
  p.reply_close = r.close;
  p.render_reply = nullptr;
  if (!r.verbatim) {
    // Everything after the assistant's content in the template's rendering of this very output.
    p.render_reply = [chat, vars, name = p.tool_name](const std::string& output) {
      const std::string text = render_tool_turn(*chat, vars, name, output);
      return text.substr(text.find(kAssistant) + kAssistant.size());
    };
  }
  // The fixed framing's tags mean nothing here: the model does not write the template's tool turn.
  p.output_open.clear();
  p.output_close.clear();
}

ParsedToolCall parse_tool_call(const std::string& body, const std::string& tool_name) {
  ParsedToolCall out;
  const std::string usage =
      "Write <tool_call>{\"name\": \"" + tool_name + "\", \"arguments\": {\"code\": \"...\"}}</tool_call>.";
  auto fail = [&](const std::string& why) {
    out.error = "Error: " + why + " " + usage;
    return out;
  };
  nlohmann::json call;
  try {
    call = nlohmann::json::parse(body);
  } catch (const nlohmann::json::parse_error& e) {
    std::string what = e.what();
    const size_t cut = what.find("] ");  // drop nlohmann's "[json.exception.parse_error.101] " prefix
    if (cut != std::string::npos) what = what.substr(cut + 2);
    return fail("the tool call is not valid JSON (" + what + ").");
  }
  if (!call.is_object()) return fail("the tool call must be a JSON object.");
  if (!call.contains("name") || !call["name"].is_string()) return fail("the tool call has no \"name\".");
  if (call["name"].get<std::string>() != tool_name) {
    return fail("there is no tool named \"" + call["name"].get<std::string>() + "\"; the only tool is \"" + tool_name +
                "\".");
  }
  nlohmann::json args = call.contains("arguments") ? call["arguments"] : nlohmann::json();
  if (args.is_string()) {  // arguments written as a JSON-encoded string, as some models do
    try {
      args = nlohmann::json::parse(args.get<std::string>());
    } catch (const nlohmann::json::parse_error&) {
      return fail("\"arguments\" is a string that is not a JSON object.");
    }
  }
  if (!args.is_object() || !args.contains("code") || !args["code"].is_string()) {
    return fail("\"arguments\" must be an object with a \"code\" string.");
  }
  out.code = args["code"].get<std::string>();
  if (out.code.find_first_not_of(" \t\r\n") == std::string::npos) return fail("the code is empty.");
  out.ok = true;
  return out;
}

std::vector<TraceSegment> tool_use_trace(const ToolProtocol& protocol, const std::string& code,
                                         const std::string& output, const std::string& answer_text) {
  return {{protocol.call_text(code), true}, {protocol.reply_text(output), false}, {answer_text, true}};
}

}  // namespace rlt
