// A Jinja2 subset, enough to render the chat templates models publish in tokenizer_config.json exactly as
// transformers' apply_chat_template does (jinja2 with trim_blocks, lstrip_blocks, loop controls, its own
// tojson, raise_exception and strftime_now). Statements: if/elif/else, for (with loop.*, an `if` filter,
// else, break, continue), set (names and namespace attributes), macro, namespace(); expressions with
// Python's operators and literals, slicing ([::-1]), attribute and item access, filters (tojson, trim,
// length, string, list, join, items, selectattr, rejectattr, select, reject, map, first, last, upper, lower,
// default, replace, capitalize, title, int, float, abs, round, unique, sort, reverse, dictsort, indent, wordcount),
// tests (defined, none, string, number, integer, float, mapping, iterable, sequence, boolean, true, false,
// equalto/eq, ne, lt, gt, in, odd, even, divisibleby, callable, lower, upper), and Python's str methods the
// templates call (startswith, strip, split, ...). Values print as Python's str() of them.
// Leaves out: template inheritance and includes, call blocks, filters and tests not listed above (an
// error naming them), autoescaping.
#pragma once

#include <nlohmann/json.hpp>

#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace rlt::jinja {

// A template that does not parse, or an expression that fails while rendering: the message names the
// template line.
class TemplateError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// raise_exception(message) called by the template: `what()` is the template's own message.
class TemplateRaise : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Options {
  bool trim_blocks = true;    // drop the first newline after a block tag
  bool lstrip_blocks = true;  // strip spaces and tabs before a block tag at the start of a line
};

class Template {
 public:
  Template(const std::string& source, const Options& options = {});
  ~Template();
  // Renders with `context`'s keys as variables (an ordered JSON object: key order is kept for tojson).
  std::string render(const nlohmann::ordered_json& context) const;

  struct Node;

 private:
  std::vector<std::shared_ptr<Node>> body_;
};

}  // namespace rlt::jinja
