// chat_template: renders a conversation with a model's own chat template, as transformers'
// apply_chat_template(..., tokenize=False) does. Reads only DIR's tokenizer_config.json (chat_template,
// bos_token, eos_token) or chat_template.jinja, so a bare tokenizer folder is enough:
//   build/bin/chat_template --model DIR --messages chat.json [--tools tools.json] [--add-generation-prompt]
//                           [--var enable_thinking=false]
// Prints the rendered text exactly (no newline added). A template that refuses the conversation
// (raise_exception) exits with code 2 and its message; so does bad input, naming the file, and a template
// that passes one of the engine's limits (data/jinja.h, Limits), naming the limit and the file.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <fstream>
#include <iostream>

#include "data/dataset.h"
#include "data/hf_chat.h"

namespace {

nlohmann::ordered_json read_json_file(const std::string& path, const char* flag) {
  std::ifstream f(path);
  if (!f) throw rlt::DataError(std::string(flag) + " " + path + ": cannot open");
  try {
    return nlohmann::ordered_json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    throw rlt::DataError(std::string(flag) + " " + path + ": not valid JSON: " + e.what());
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"chat_template: render a conversation with a model's own chat template"};
  std::string model, messages_path, tools_path;
  std::vector<std::string> vars;
  bool add_generation_prompt = false, no_lstrip = false, no_trim = false;
  app.add_option("--model", model, "folder with tokenizer_config.json (or chat_template.jinja)")->required();
  app.add_option("--messages", messages_path, "JSON list of {role, content, ...}")->required();
  app.add_option("--tools", tools_path, "JSON list of tool schemas");
  app.add_flag("--add-generation-prompt", add_generation_prompt, "end with the assistant turn's opening");
  app.add_option("--var", vars, "extra template variable NAME=JSON, e.g. enable_thinking=false (repeatable)");
  // Debug switches for the parity test: each must make a template's output differ from transformers'.
  app.add_flag("--debug-no-lstrip-blocks", no_lstrip, "render without lstrip_blocks (a wrong renderer)")->group("");
  app.add_flag("--debug-no-trim-blocks", no_trim, "render without trim_blocks (a wrong renderer)")->group("");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return e.get_exit_code() == 0 ? app.exit(e) : (app.exit(e), 2);
  }
  try {
    nlohmann::ordered_json messages = read_json_file(messages_path, "--messages");
    if (messages.is_object() && messages.contains("messages")) messages = messages["messages"];
    if (!messages.is_array())
      throw rlt::DataError("--messages " + messages_path + ": expected a JSON list of messages");
    nlohmann::ordered_json tools =
        tools_path.empty() ? nlohmann::ordered_json() : read_json_file(tools_path, "--tools");
    nlohmann::ordered_json extra = nlohmann::ordered_json::object();
    for (const auto& v : vars) {
      const auto eq = v.find('=');
      if (eq == std::string::npos) throw rlt::DataError("--var " + v + ": expected NAME=JSON");
      try {
        extra[v.substr(0, eq)] = nlohmann::ordered_json::parse(v.substr(eq + 1));
      } catch (const nlohmann::json::exception&) {
        extra[v.substr(0, eq)] = v.substr(eq + 1);  // a bare word is a string
      }
    }
    rlt::HfChatTemplate t = rlt::HfChatTemplate::from_folder(model);
    if (no_lstrip || no_trim) {
      rlt::jinja::Options o;
      o.lstrip_blocks = !no_lstrip;
      o.trim_blocks = !no_trim;
      const rlt::jinja::Template wrong(t.source(), o);
      nlohmann::ordered_json ctx = {{"messages", messages},
                                    {"tools", tools},
                                    {"documents", nullptr},
                                    {"add_generation_prompt", add_generation_prompt}};
      for (const auto& [k, v] : extra.items()) ctx[k] = v;
      std::cout << wrong.render(ctx);
      return 0;
    }
    std::cout << t.render(messages, tools, add_generation_prompt, extra);
  } catch (const rlt::jinja::TemplateRaise& e) {
    std::cerr << "chat_template: the template refuses this conversation: " << e.what() << "\n";
    return 2;
  } catch (const rlt::DataError& e) {
    std::cerr << "chat_template: " << e.what() << "\n";
    return 2;
  } catch (const rlt::jinja::TemplateError& e) {  // the debug renderers: the folder's template
    std::cerr << "chat_template: " << model << ": " << e.what() << "\n";
    return 2;
  }
  return 0;
}
