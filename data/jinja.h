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
// error naming them), autoescaping, and a namespace stored in a namespace (an error: it could make a
// value that holds itself).
// A template is untrusted input (it comes with a downloaded model folder): parsing and rendering are
// bounded by Limits, like jinja2's SandboxedEnvironment, so no template crashes the process or runs
// without end. Hitting a limit throws TemplateError naming it.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
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

// Each is far above what the published chat templates use (the fixtures' templates nest blocks at most 6
// deep, define no macros and loop over the messages and the tools), and low enough that a hostile
// template stops within seconds and a few hundred MiB on one CPU core (tests/data/test_jinja_limits.cpp).
struct Limits {
  int64_t max_range = 100000;  // items in one range(): jinja2's sandbox MAX_RANGE
  // Bytes of the rendered text; also of any one string the template builds (~, +, *, join, replace,
  // format, tojson, indent): a large prompt is a few hundred KiB, a 16 MiB one no model takes.
  int64_t max_output = 16 << 20;
  int max_recursion = 100;  // macro calls in progress at once (a recursive macro)
  // Nested blocks ({% if %}, {% for %}, {% macro %}) and nested brackets or operators in one expression
  // (both checked by the parser), and nested lists and mappings the template builds or prints. Bounds the
  // parser's recursion; the renderer's, blocks and macro calls together, is also held to the thread's
  // stack (an error naming this limit).
  int max_nesting = 256;
  int64_t max_iterations = 1000000;  // for-loop iterations in one render, all loops together
  // Bytes handled in one render: every string an expression yields (a read copies it), list items copied
  // or searched (sizeof(Value) bytes each), strings searched (in, split, replace). What a loop
  // that grows a string or a list, or re-reads or searches a long one, costs in total; such a loop stops
  // within seconds.
  int64_t max_work = int64_t(1) << 30;
};

// Every error for a passed limit names its field as "(jinja::Limits::<field>", so a caller that handles a
// hostile template apart from one that merely fails (rollout/tools.cpp) asks names_a_limit().
inline constexpr std::string_view kLimitTag = "(jinja::Limits::";
inline bool names_a_limit(std::string_view message) { return message.find(kLimitTag) != std::string_view::npos; }

struct Options {
  bool trim_blocks = true;    // drop the first newline after a block tag
  bool lstrip_blocks = true;  // strip spaces and tabs before a block tag at the start of a line
  Limits limits;
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
  Limits limits_;
};

}  // namespace rlt::jinja
