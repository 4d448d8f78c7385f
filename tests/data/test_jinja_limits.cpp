// The Jinja engine's limits (data/jinja.h, Limits) on hostile chat templates: each ends within seconds in
// an error that names the limit and the template's file, never a crash or a hang, and a control just
// under each limit renders, so a limit set too low or never checked fails here. The published templates
// still render byte for byte: tests/apps/check_chat_template.py (ctest chat_template_parity_hf).
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "data/dataset.h"
#include "data/hf_chat.h"
#include "data/jinja.h"

namespace rlt {
namespace {

const char* kFile = "hostile/chat_template.jinja";

std::string repeat(const std::string& s, int n) {
  std::string out;
  for (int k = 0; k < n; ++k) out += s;
  return out;
}

// The rendered text, or "ERROR: " + the DataError message; fails the test when it takes over 5 s.
std::string render(const std::string& source) {
  const auto start = std::chrono::steady_clock::now();
  std::string out;
  try {
    const auto t = HfChatTemplate::from_source(source, "<s>", "</s>", kFile);
    out = t.render(nlohmann::ordered_json::array({{{"role", "user"}, {"content", "hi"}}}), nullptr, true);
  } catch (const DataError& e) {
    out = std::string("ERROR: ") + e.what();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 5.0) << source.substr(0, 200);
  return out;
}

// The render stops with an error naming `limit` and the file.
void expect_limit(const std::string& source, const std::string& limit) {
  const std::string got = render(source);
  EXPECT_EQ(got.rfind("ERROR: ", 0), 0u) << "rendered " << got.size() << " bytes: " << got.substr(0, 200);
  EXPECT_NE(got.find(limit + " limit"), std::string::npos) << got;
  EXPECT_NE(got.find(kFile), std::string::npos) << got;
}

TEST(JinjaLimits, RecursionDepth) {
  const std::string runaway = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}";
  expect_limit(runaway, "recursion depth");
  // f(k) is k + 1 calls deep: 100 calls render, 101 do not.
  const std::string countdown = "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{% else %}done{% endif %}{% endmacro %}";
  EXPECT_EQ(render(countdown + "{{ f(99) }}"), "done");
  expect_limit(countdown + "{{ f(100) }}", "recursion depth");
}

TEST(JinjaLimits, ParenthesesNesting) {
  auto parens = [](int n) { return "{{ " + repeat("(", n) + "7" + repeat(")", n) + " }}"; };
  expect_limit(parens(100000), "nesting depth");
  EXPECT_EQ(render(parens(255)), "7");
  expect_limit(parens(256), "nesting depth");
}

TEST(JinjaLimits, OperatorChainNesting) {
  // 1+1+...+1 parses in a loop but renders recursively: its tree depth counts.
  auto sum = [](int n) { return "{{ 1" + repeat("+1", n - 1) + " }}"; };
  expect_limit(sum(100000), "nesting depth");
  EXPECT_EQ(render(sum(256)), "256");
  expect_limit(sum(257), "nesting depth");
}

TEST(JinjaLimits, BlockNesting) {
  auto ifs = [](int n) { return repeat("{% if true %}", n) + "in" + repeat("{% endif %}", n); };
  expect_limit(ifs(50000), "nesting depth");
  EXPECT_EQ(render(ifs(256)), "in");
  expect_limit(ifs(257), "nesting depth");
}

TEST(JinjaLimits, ValueNesting) {
  // A list wrapped in itself, one level per iteration, kept in a namespace.
  auto wrap = [](int n) {
    return "{% set ns = namespace(x=[]) %}{% for i in range(" + std::to_string(n) +
           ") %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x|length }}";
  };
  expect_limit(wrap(100000), "nesting depth");
  EXPECT_EQ(render(wrap(254)), "1");
  expect_limit(wrap(255), "nesting depth");
  // A namespace holding a namespace (a cycle, or a chain deeper than any check) is refused.
  const std::string cyc = render("{% set ns = namespace() %}{% set ns.self = ns %}{{ ns }}");
  EXPECT_NE(cyc.find("a namespace may not hold a namespace"), std::string::npos) << cyc;
}

TEST(JinjaLimits, ConversationNesting) {
  // The conversation is input too: a message nested 100,000 lists deep stops, 250 deep renders.
  const auto t = HfChatTemplate::from_source("{{ messages[0].content }}", "", "", kFile);
  auto nested = [](int n) {
    return nlohmann::ordered_json::parse(R"([{"role": "user", "content": "hi", "x": )" + repeat("[", n) +
                                         repeat("]", n) + "}]");
  };
  EXPECT_EQ(t.render(nested(250), nullptr, false), "hi");
  try {
    t.render(nested(100000), nullptr, false);
    ADD_FAILURE() << "a conversation nested 100,000 deep rendered";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("nesting depth limit"), std::string::npos) << e.what();
  }
}

TEST(JinjaLimits, StackHeldAcrossMacros) {
  // 100 macro calls, each inside 250 blocks: every count is under its limit, the product is not.
  const std::string deep = "{% macro f(n) %}" + repeat("{% for i in [1] %}", 250) +
                           "{% if n < 100 %}{{ f(n + 1) }}{% endif %}" + repeat("{% endfor %}", 250) +
                           "{% endmacro %}{{ f(1) }}";
  expect_limit(deep, "nesting depth");
  const std::string shallow = "{% macro f(n) %}" + repeat("{% for i in [1] %}", 20) +
                              "{% if n < 100 %}{{ f(n + 1) }}{% else %}deep{% endif %}" + repeat("{% endfor %}", 20) +
                              "{% endmacro %}{{ f(1) }}";
  EXPECT_EQ(render(shallow), "deep");
}

TEST(JinjaLimits, RangeLength) {
  expect_limit("{% for i in range(10**8) %}{% endfor %}", "range length");
  EXPECT_EQ(render("{{ range(100000)|length }}"), "100000");
  expect_limit("{{ range(100001)|length }}", "range length");
  expect_limit("{{ range(-5, 99996, 1)|length }}", "range length");
  EXPECT_EQ(render("{{ range(-5, 99995, 1)|length }}"), "100000");
  EXPECT_EQ(render("{{ range(10, 0, -3)|list }}"), "[10, 7, 4, 1]");
  EXPECT_NE(render("{{ range(10, 0, 0) }}").find("step must not be zero"), std::string::npos);
}

TEST(JinjaLimits, LoopIterations) {
  auto loops = [](int outer, int inner) {
    return "{% set ns = namespace(n=0) %}{% for i in range(" + std::to_string(outer) + ") %}{% for j in range(" +
           std::to_string(inner) + ") %}{% set ns.n = ns.n + 1 %}{% endfor %}{% endfor %}{{ ns.n }}";
  };
  expect_limit(loops(100000, 100000), "loop iteration");
  // 999 + 999 * 1000 = 999,999 iterations render; 1000 + 1000 * 1000 do not.
  EXPECT_EQ(render(loops(999, 1000)), "999000");
  expect_limit(loops(1000, 1000), "loop iteration");
}

TEST(JinjaLimits, StringRepetition) {
  expect_limit("{{ 'x' * 10**10 }}", "string size");
  EXPECT_EQ(render("{{ ('x' * 16777216)|length }}"), "16777216");
  expect_limit("{{ ('x' * 16777217)|length }}", "string size");
  expect_limit("{{ ('ab' * 8388609)|length }}", "string size");
}

TEST(JinjaLimits, StringGrowth) {
  // ~ and join each stop at 16 MiB, whatever the parts.
  expect_limit("{% set s = 'x' * 9000000 %}{{ (s ~ s)|length }}", "string size");
  EXPECT_EQ(render("{% set s = 'x' * 8388608 %}{{ (s ~ s)|length }}"), "16777216");
  expect_limit("{% set s = 'x' * 1000000 %}{{ range(18)|map('string')|join(s)|length }}", "string size");
  EXPECT_EQ(render("{% set s = 'x' * 1000000 %}{{ range(17)|map('string')|join(s)|length }}"), "16000024");
}

TEST(JinjaLimits, OutputSize) {
  const std::string mib = "{% for i in range(16) %}{{ 'x' * 1048576 }}{% endfor %}";
  EXPECT_EQ(render(mib).size(), 16u << 20);
  expect_limit(mib + "y", "output size");
  expect_limit("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "output size");
}

TEST(JinjaLimits, Work) {
  // A string grown one piece per iteration costs its length each time: quadratic, stopped by the total.
  expect_limit(
      "{% set ns = namespace(s='') %}{% for i in range(1000) %}{% for j in range(1000) %}"
      "{% set ns.s = ns.s ~ 'abcdefghijklmnopqrstuvwxyz' %}{% endfor %}{% endfor %}",
      "work");
  // So is a search of a long list in a loop.
  expect_limit("{% set r = range(100000) %}{% for i in range(100000) %}{% if -1 in r %}{% endif %}{% endfor %}",
               "work");
  // And a search whose pattern nearly matches everywhere (linear time, charged by length).
  expect_limit(
      "{% set h = 'a' * 16000000 %}{% set n = 'a' * 8000000 ~ 'b' %}"
      "{% for i in range(100) %}{{ n in h }}{{ h.split(n)|length }}{% endfor %}",
      "work");
  EXPECT_EQ(render("{{ 'a</think>b</think>c'.split('</think>') }}{{ 'aaa'.replace('aa', 'b') }}"), "['a', 'b', 'c']ba");
  // Copying a list copies its strings: a loop over a list of long strings, a macro call with a long
  // global string (the call copies the globals), and a mapping's values() each cost their bytes.
  expect_limit(
      "{% set b = 'x' * 1000000 %}{% set l = [b, b, b, b, b, b, b, b, b, b, b, b, b, b, b, b] %}"
      "{% for i in range(100000) %}{% for x in l %}{% endfor %}{% endfor %}",
      "work");
  expect_limit(
      "{% set b = 'x' * 1000000 %}{% macro f() %}{% endmacro %}{% for i in range(100000) %}{{ f() }}{% endfor %}",
      "work");
  expect_limit("{% set d = {'a': 'x' * 1000000} %}{% for i in range(100000) %}{% set v = d.values() %}{% endfor %}",
               "work");
  // Each 'x' * 10**7 costs 10**7 bytes: 107 of them stay under 2**30, 108 do not.
  auto strings = [](int n) {
    return "{% for i in range(" + std::to_string(n) + ") %}{% set s = 'x' * 10000000 %}{% endfor %}done";
  };
  EXPECT_EQ(render(strings(107)), "done");
  expect_limit(strings(108), "work");
}

TEST(JinjaLimits, NoCrashOnArithmetic) {
  EXPECT_NE(render("{{ 99999999999999999999999 }}").find("out of range"), std::string::npos);
  EXPECT_NE(render("{{ 9223372036854775807 + 1 }}").find("integer overflow"), std::string::npos);
  EXPECT_NE(render("{{ 10 ** 100 }}").find("integer overflow"), std::string::npos);
  EXPECT_EQ(render("{{ (-9223372036854775807 - 1) % -1 }}"), "0");
  EXPECT_EQ(render("{{ [1, 2, 3][::9223372036854775807] }}"), "[1]");
  EXPECT_EQ(render("{{ 2 ** 10 }}"), "1024");
}

// A limit is an Options field: a caller may set its own.
TEST(JinjaLimits, LimitsAreOptions) {
  jinja::Options o;
  o.limits.max_range = 10;
  const jinja::Template t("{{ range(11)|length }}", o);
  try {
    t.render(nlohmann::ordered_json::object());
    ADD_FAILURE() << "range(11) rendered with max_range 10";
  } catch (const jinja::TemplateError& e) {
    EXPECT_NE(std::string(e.what()).find("range length limit"), std::string::npos) << e.what();
  }
  EXPECT_EQ(jinja::Template("{{ range(10)|length }}", o).render(nlohmann::ordered_json::object()), "10");
}

}  // namespace
}  // namespace rlt
