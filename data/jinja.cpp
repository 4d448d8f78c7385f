// The Jinja subset of jinja.h: a lexer that applies Jinja's whitespace control to the template text, a
// recursive-descent parser for statements and expressions, and a tree-walking renderer over Python-like
// values. Written from the Jinja2 documentation's semantics; tests/apps/check_chat_template.py holds it
// to jinja2 (through transformers) on the published templates, byte for byte.
#include "data/jinja.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <sstream>

#include <pthread.h>

namespace rlt::jinja {

namespace {

// ------------------------------------------------------------------------------------------------ limits

// The limits of the render in progress on this thread and what it has used so far. The value helpers
// (to_str, dump_json, equal, building lists) charge it as well as the renderer.
struct Budget {
  Limits limits;
  int64_t work = 0, iterations = 0;
  int macro_depth = 0;
};
thread_local Budget* tl_budget = nullptr;

// An error raised where the template line is not at hand; the renderer adds the line of its statement.
struct LineLess {
  std::string why;
};

[[noreturn]] void limit_hit(const char* name, const std::string& detail, const char* field) {
  throw LineLess{std::string(name) + " limit: " + detail + " " + std::string(kLimitTag) + field + ")"};
}
// `bytes` more built or scanned.
void charge(int64_t bytes) {
  if (!tl_budget) return;
  tl_budget->work += bytes;
  if (tl_budget->work > tl_budget->limits.max_work) {
    limit_hit("work", "the render built or scanned more than " + std::to_string(tl_budget->limits.max_work) + " bytes",
              "max_work");
  }
}
// A string of `bytes` is about to be, or has just been, built.
void check_string(size_t bytes) {
  if (tl_budget && static_cast<int64_t>(bytes) > tl_budget->limits.max_output) {
    limit_hit("string size",
              "a string of " + std::to_string(bytes) + " bytes, over " + std::to_string(tl_budget->limits.max_output),
              "max_output");
  }
}
// A list or mapping nested `depth` deep.
void check_value_depth(int depth) {
  if (tl_budget && depth > tl_budget->limits.max_nesting) {
    limit_hit("nesting depth",
              "lists and mappings nested over " + std::to_string(tl_budget->limits.max_nesting) + " deep",
              "max_nesting");
  }
}

// The first `p` in `s` at or after `from`, or npos: glibc's memmem (the two-way algorithm) takes time
// linear in both lengths, where std::string::find can take their product.
size_t find_text(const std::string& s, const std::string& p, size_t from = 0) {
  if (from > s.size()) return std::string::npos;
  const void* hit = memmem(s.data() + from, s.size() - from, p.data(), p.size());
  return hit ? static_cast<size_t>(static_cast<const char*>(hit) - s.data()) : std::string::npos;
}

// ------------------------------------------------------------------------------------------------ values

struct Value;
using List = std::vector<Value>;
using Args = std::vector<Value>;
using Kwargs = std::vector<std::pair<std::string, Value>>;
using Fn = std::function<Value(const Args&, const Kwargs&)>;

struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  Value* find(const std::string& k);
  void set(const std::string& k, Value v);
};

struct Value {
  enum Kind { kUndefined, kNone, kBool, kInt, kFloat, kStr, kList, kDict, kFn } kind = kUndefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::shared_ptr<List> list;
  std::shared_ptr<Dict> dict;
  std::shared_ptr<Fn> fn;
  // Lists and mappings nested inside (0 for a scalar), as built; and whether a namespace (the one mutable
  // value) is in it. A namespace may not hold a namespace, so no value is cyclic and a namespace's
  // contents keep the depth they had when set: no value nests deeper than twice max_nesting.
  int depth = 0;
  bool holds_ns = false;

  static Value none() { return with(kNone); }
  static Value boolean(bool x) {
    Value v = with(kBool);
    v.b = x;
    return v;
  }
  static Value integer(int64_t x) {
    Value v = with(kInt);
    v.i = x;
    return v;
  }
  static Value real(double x) {
    Value v = with(kFloat);
    v.f = x;
    return v;
  }
  static Value str(std::string x) {
    Value v = with(kStr);
    v.s = std::move(x);
    return v;
  }
  static Value of_list(List x) {
    Value v = with(kList);
    v.depth = 1;
    for (const auto& item : x) v.take_child(item);
    charge(copy_cost(x));
    v.list = std::make_shared<List>(std::move(x));
    return v;
  }
  static Value of_dict(Dict x);
  // What copying the items costs: each value and its string (lists and mappings inside are shared).
  static int64_t copy_cost(const List& items) {
    int64_t bytes = 0;
    for (const auto& x : items) bytes += static_cast<int64_t>(sizeof(Value) + x.s.size());
    return bytes;
  }
  void take_child(const Value& c) {
    depth = std::max(depth, c.depth + 1);
    holds_ns = holds_ns || c.holds_ns;
    check_value_depth(depth);
  }
  static Value function(Fn x) {
    Value v = with(kFn);
    v.fn = std::make_shared<Fn>(std::move(x));
    return v;
  }
  static Value with(Kind k) {
    Value v;
    v.kind = k;
    return v;
  }
  bool number() const { return kind == kInt || kind == kFloat || kind == kBool; }
  double as_double() const { return kind == kFloat ? f : kind == kBool ? double(b) : double(i); }
};

Value Value::of_dict(Dict x) {
  Value v = with(kDict);
  v.depth = 1;
  for (const auto& item : x.items) {
    v.take_child(item.second);
    charge(static_cast<int64_t>(sizeof(Value) + item.first.size() + item.second.s.size()));
  }
  v.dict = std::make_shared<Dict>(std::move(x));
  return v;
}

Value* Dict::find(const std::string& k) {
  for (auto& [key, v] : items) {
    if (key == k) return &v;
  }
  return nullptr;
}
void Dict::set(const std::string& k, Value v) {
  if (Value* p = find(k))
    *p = std::move(v);
  else
    items.emplace_back(k, std::move(v));
}

const char* kind_name(const Value& v) {
  switch (v.kind) {
    case Value::kUndefined:
      return "undefined";
    case Value::kNone:
      return "none";
    case Value::kBool:
      return "a boolean";
    case Value::kInt:
      return "an integer";
    case Value::kFloat:
      return "a float";
    case Value::kStr:
      return "a string";
    case Value::kList:
      return "a list";
    case Value::kDict:
      return "a mapping";
    case Value::kFn:
      return "a function";
  }
  return "?";
}

// The context's JSON (the conversation) as values; nested deeper than max_nesting is an error.
Value from_json(const nlohmann::ordered_json& j, int depth = 0) {
  if (j.is_structured()) check_value_depth(depth + 1);
  if (j.is_null()) return Value::none();
  if (j.is_boolean()) return Value::boolean(j.get<bool>());
  if (j.is_number_integer() || j.is_number_unsigned()) return Value::integer(j.get<int64_t>());
  if (j.is_number_float()) return Value::real(j.get<double>());
  if (j.is_string()) return Value::str(j.get<std::string>());
  if (j.is_array()) {
    List l;
    for (const auto& x : j) l.push_back(from_json(x, depth + 1));
    return Value::of_list(std::move(l));
  }
  Dict d;
  for (const auto& [k, v] : j.items()) d.items.emplace_back(k, from_json(v, depth + 1));
  return Value::of_dict(std::move(d));
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::kUndefined:
    case Value::kNone:
      return false;
    case Value::kBool:
      return v.b;
    case Value::kInt:
      return v.i != 0;
    case Value::kFloat:
      return v.f != 0;
    case Value::kStr:
      return !v.s.empty();
    case Value::kList:
      return !v.list->empty();
    case Value::kDict:
      return !v.dict->items.empty();
    case Value::kFn:
      return true;
  }
  return false;
}

// Python's repr(float): the shortest text that reads back to the same double, ".0" for integral values,
// exponent form outside [1e-4, 1e16).
std::string py_float(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[40];
  for (int p = 1; p <= 17; ++p) {
    std::snprintf(buf, sizeof(buf), "%.*e", p - 1, x);
    if (std::strtod(buf, nullptr) == x) break;
  }
  // buf: d.ddde[+-]XX -> digits and exponent
  std::string m(buf);
  const size_t e = m.find('e');
  int exp10 = std::stoi(m.substr(e + 1));
  std::string digits;
  bool neg = m[0] == '-';
  for (size_t k = neg ? 1 : 0; k < e; ++k) {
    if (m[k] != '.') digits += m[k];
  }
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  std::string out = neg ? "-" : "";
  if (exp10 < -4 || exp10 >= 16) {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof(eb), "e%c%02d", exp10 < 0 ? '-' : '+', std::abs(exp10));
    return out + eb;
  }
  if (exp10 < 0) return out + "0." + std::string(-exp10 - 1, '0') + digits;
  if (static_cast<int>(digits.size()) <= exp10 + 1)
    return out + digits + std::string(exp10 + 1 - digits.size(), '0') + ".0";
  return out + digits.substr(0, exp10 + 1) + "." + digits.substr(exp10 + 1);
}

std::string py_repr_str(const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos, has_double = s.find('"') != std::string::npos;
  const char q = has_single && !has_double ? '"' : '\'';
  std::string out(1, q);
  for (unsigned char c : s) {
    if (c == '\\')
      out += "\\\\";
    else if (c == q)
      out += std::string("\\") + char(q);
    else if (c == '\n')
      out += "\\n";
    else if (c == '\r')
      out += "\\r";
    else if (c == '\t')
      out += "\\t";
    else if (c < 0x20 || c == 0x7f) {
      char b[8];
      std::snprintf(b, sizeof(b), "\\x%02x", c);
      out += b;
    } else
      out += char(c);
  }
  return out + q;
}

std::string to_str(const Value& v, bool repr = false, int depth = 0);

std::string to_str(const Value& v, bool repr, int depth) {
  check_value_depth(depth);
  switch (v.kind) {
    case Value::kUndefined:
      return "";
    case Value::kNone:
      return "None";
    case Value::kBool:
      return v.b ? "True" : "False";
    case Value::kInt:
      return std::to_string(v.i);
    case Value::kFloat:
      return py_float(v.f);
    case Value::kStr:
      return repr ? py_repr_str(v.s) : v.s;
    case Value::kList: {
      std::string out = "[";
      for (size_t k = 0; k < v.list->size(); ++k) {
        out += (k ? ", " : "") + to_str((*v.list)[k], true, depth + 1);
        check_string(out.size());
      }
      charge(static_cast<int64_t>(out.size()));
      return out + "]";
    }
    case Value::kDict: {
      std::string out = "{";
      for (size_t k = 0; k < v.dict->items.size(); ++k) {
        out += (k ? ", " : "") + py_repr_str(v.dict->items[k].first) + ": " +
               to_str(v.dict->items[k].second, true, depth + 1);
        check_string(out.size());
      }
      charge(static_cast<int64_t>(out.size()));
      return out + "}";
    }
    case Value::kFn:
      return "<function>";
  }
  return "";
}

// json.dumps(x, ensure_ascii=False, indent=indent) as transformers' tojson filter calls it.
void dump_json(const Value& v, int indent, int depth, std::string& out) {
  check_value_depth(depth);
  check_string(out.size());
  auto newline = [&](int d) {
    check_string(out.size() + static_cast<size_t>(indent) * d);
    out += '\n';
    out += std::string(static_cast<size_t>(indent) * d, ' ');
  };
  switch (v.kind) {
    case Value::kUndefined:
    case Value::kNone:
      out += "null";
      return;
    case Value::kBool:
      out += v.b ? "true" : "false";
      return;
    case Value::kInt:
      out += std::to_string(v.i);
      return;
    case Value::kFloat:
      out += std::isnan(v.f) ? "NaN" : std::isinf(v.f) ? (v.f > 0 ? "Infinity" : "-Infinity") : py_float(v.f);
      return;
    case Value::kStr: {
      out += '"';
      for (unsigned char c : v.s) {
        switch (c) {
          case '"':
            out += "\\\"";
            break;
          case '\\':
            out += "\\\\";
            break;
          case '\n':
            out += "\\n";
            break;
          case '\r':
            out += "\\r";
            break;
          case '\t':
            out += "\\t";
            break;
          case '\b':
            out += "\\b";
            break;
          case '\f':
            out += "\\f";
            break;
          default:
            if (c < 0x20) {
              char b[8];
              std::snprintf(b, sizeof(b), "\\u%04x", c);
              out += b;
            } else {
              out += char(c);
            }
        }
      }
      out += '"';
      return;
    }
    case Value::kList: {
      if (v.list->empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k) out += indent >= 0 ? "," : ", ";
        if (indent >= 0) newline(depth + 1);
        dump_json((*v.list)[k], indent, depth + 1, out);
      }
      if (indent >= 0) newline(depth);
      out += ']';
      return;
    }
    case Value::kDict: {
      if (v.dict->items.empty()) {
        out += "{}";
        return;
      }
      out += '{';
      for (size_t k = 0; k < v.dict->items.size(); ++k) {
        if (k) out += indent >= 0 ? "," : ", ";
        if (indent >= 0) newline(depth + 1);
        dump_json(Value::str(v.dict->items[k].first), indent, depth + 1, out);
        out += ": ";
        dump_json(v.dict->items[k].second, indent, depth + 1, out);
      }
      if (indent >= 0) newline(depth);
      out += '}';
      return;
    }
    case Value::kFn:
      throw TemplateError("tojson: a function is not JSON serializable");
  }
}

bool equal(const Value& a, const Value& b, int depth = 0) {
  check_value_depth(depth);
  charge(sizeof(Value));
  if (a.number() && b.number()) return a.as_double() == b.as_double();
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::kUndefined:
    case Value::kNone:
      return true;
    case Value::kStr:
      return a.s == b.s;
    case Value::kList:
      if (a.list->size() != b.list->size()) return false;
      for (size_t k = 0; k < a.list->size(); ++k) {
        if (!equal((*a.list)[k], (*b.list)[k], depth + 1)) return false;
      }
      return true;
    case Value::kDict:
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (const auto& [k, v] : a.dict->items) {
        const Value* o = b.dict->find(k);
        if (!o || !equal(v, *o, depth + 1)) return false;
      }
      return true;
    default:
      return a.fn == b.fn;
  }
}

// ------------------------------------------------------------------------------------------------ lexing

struct Tok {
  enum Kind { kName, kStr, kInt, kFloat, kOp, kEnd } kind = kEnd;
  std::string text;
  int64_t i = 0;
  double f = 0;
};

std::vector<Tok> lex_expr(const std::string& src, int line) {
  std::vector<Tok> out;
  size_t p = 0;
  auto fail = [&](const std::string& why) -> void {
    throw TemplateError("template line " + std::to_string(line) + ": " + why);
  };
  while (p < src.size()) {
    const char c = src[p];
    if (std::isspace(static_cast<unsigned char>(c))) {
      ++p;
    } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t e = p;
      while (e < src.size() && (std::isalnum(static_cast<unsigned char>(src[e])) || src[e] == '_')) ++e;
      out.push_back({Tok::kName, src.substr(p, e - p)});
      p = e;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t e = p;
      bool real = false;
      while (e < src.size() &&
             (std::isdigit(static_cast<unsigned char>(src[e])) || src[e] == '_' ||
              (src[e] == '.' && e + 1 < src.size() && std::isdigit(static_cast<unsigned char>(src[e + 1]))))) {
        real = real || src[e] == '.';
        ++e;
      }
      std::string num = src.substr(p, e - p);
      num.erase(std::remove(num.begin(), num.end(), '_'), num.end());
      Tok t{real ? Tok::kFloat : Tok::kInt, num};
      try {
        if (real)
          t.f = std::stod(num);
        else
          t.i = std::stoll(num);
      } catch (const std::out_of_range&) {
        fail("number " + num + " is out of range");
      }
      out.push_back(t);
      p = e;
    } else if (c == '\'' || c == '"') {
      std::string s;
      size_t e = p + 1;
      for (; e < src.size() && src[e] != c; ++e) {
        if (src[e] == '\\' && e + 1 < src.size()) {
          const char n = src[++e];
          s += n == 'n' ? '\n' : n == 't' ? '\t' : n == 'r' ? '\r' : n;
        } else {
          s += src[e];
        }
      }
      if (e >= src.size()) fail("unterminated string");
      out.push_back({Tok::kStr, s});
      p = e + 1;
    } else {
      static const char* kOps[] = {"**", "//", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<",
                                   ">",  "(",  ")",  "[",  "]",  "{",  "}", ",", ".", ":", "|", "="};
      bool found = false;
      for (const char* op : kOps) {
        const size_t n = std::strlen(op);
        if (src.compare(p, n, op) == 0) {
          out.push_back({Tok::kOp, op});
          p += n;
          found = true;
          break;
        }
      }
      if (!found) fail(std::string("unexpected character '") + c + "'");
    }
  }
  out.push_back({Tok::kEnd, ""});
  return out;
}

// ------------------------------------------------------------------------------------------------ AST

struct Expr;
using ExprP = std::shared_ptr<Expr>;
struct Expr {
  enum Kind {
    kLit,
    kVar,
    kAttr,
    kItem,
    kSlice,
    kCall,
    kFilter,
    kTest,
    kNeg,
    kNot,
    kBin,
    kAnd,
    kOr,
    kCond,
    kList,
    kDict
  } kind;
  Value lit;
  std::string name;         // var / attr / filter / test / binary operator
  std::vector<ExprP> args;  // operands, call args, list items, dict keys/values interleaved
  std::vector<std::pair<std::string, ExprP>> kwargs;
  bool negated = false;  // `is not`, `not in`
  int line = 0;
  int depth = 1;  // operators nested in this expression, this one included
};

ExprP make(Expr::Kind k, int line) {
  auto e = std::make_shared<Expr>();
  e->kind = k;
  e->line = line;
  return e;
}

class ExprParser {
 public:
  ExprParser(std::vector<Tok> toks, int line, int max_nesting)
      : t_(std::move(toks)), line_(line), max_nesting_(max_nesting) {}

  ExprP expression() { return conditional(); }
  bool at_end() const { return t_[p_].kind == Tok::kEnd; }
  const Tok& peek(size_t k = 0) const { return t_[std::min(p_ + k, t_.size() - 1)]; }
  bool accept_op(const char* op) {
    if (peek().kind == Tok::kOp && peek().text == op) {
      ++p_;
      return true;
    }
    return false;
  }
  bool accept_name(const char* n) {
    if (peek().kind == Tok::kName && peek().text == n) {
      ++p_;
      return true;
    }
    return false;
  }
  void expect_op(const char* op) {
    if (!accept_op(op)) fail(std::string("expected '") + op + "', got '" + peek().text + "'");
  }
  std::string name() {
    if (peek().kind != Tok::kName) fail("expected a name, got '" + peek().text + "'");
    return t_[p_++].text;
  }
  [[noreturn]] void fail(const std::string& why) const {
    throw TemplateError("template line " + std::to_string(line_) + ": " + why);
  }
  // The parser's own recursion (brackets, `not`, unary minus, conditionals) and the depth of the tree it
  // builds (left-assoc chains such as 1+1+...+1 are built in a loop but evaluated recursively): both
  // stay within max_nesting.
  struct Deeper {
    ExprParser& p;
    explicit Deeper(ExprParser& parser) : p(parser) {
      if (++p.nesting_ > p.max_nesting_) p.too_deep();
    }
    ~Deeper() { --p.nesting_; }
  };
  [[noreturn]] void too_deep() const {
    fail("nesting depth limit: an expression nested over " + std::to_string(max_nesting_) + " deep " +
         std::string(kLimitTag) + "max_nesting)");
  }
  ExprP fin(ExprP e) const {
    for (const auto& a : e->args) {
      if (a) e->depth = std::max(e->depth, a->depth + 1);
    }
    for (const auto& kv : e->kwargs) e->depth = std::max(e->depth, kv.second->depth + 1);
    if (e->depth > max_nesting_) too_deep();
    return e;
  }
  void expect_end() {
    if (!at_end()) fail("unexpected '" + peek().text + "'");
  }

  ExprP conditional() {
    Deeper guard(*this);
    ExprP e = or_expr();
    if (accept_name("if")) {
      ExprP c = make(Expr::kCond, line_);
      ExprP test = or_expr();
      ExprP other = accept_name("else") ? conditional() : nullptr;
      c->args = {test, e, other};
      return fin(c);
    }
    return e;
  }
  ExprP or_expr() {
    ExprP e = and_expr();
    while (accept_name("or")) {
      ExprP o = make(Expr::kOr, line_);
      o->args = {e, and_expr()};
      e = fin(o);
    }
    return e;
  }
  ExprP and_expr() {
    ExprP e = not_expr();
    while (accept_name("and")) {
      ExprP o = make(Expr::kAnd, line_);
      o->args = {e, not_expr()};
      e = fin(o);
    }
    return e;
  }
  ExprP not_expr() {
    if (accept_name("not")) {
      Deeper guard(*this);
      ExprP n = make(Expr::kNot, line_);
      n->args = {not_expr()};
      return fin(n);
    }
    return compare();
  }
  ExprP compare() {
    ExprP e = concat();
    for (;;) {
      std::string op;
      bool neg = false;
      if (peek().kind == Tok::kOp && (peek().text == "==" || peek().text == "!=" || peek().text == "<" ||
                                      peek().text == ">" || peek().text == "<=" || peek().text == ">=")) {
        op = t_[p_++].text;
      } else if (accept_name("in")) {
        op = "in";
      } else if (peek().kind == Tok::kName && peek().text == "not" && peek(1).kind == Tok::kName &&
                 peek(1).text == "in") {
        p_ += 2;
        op = "in";
        neg = true;
      } else {
        return e;
      }
      ExprP b = make(Expr::kBin, line_);
      b->name = op;
      b->negated = neg;
      b->args = {e, concat()};
      e = fin(b);
    }
  }
  ExprP binary_left(ExprP (ExprParser::*next)(), std::initializer_list<const char*> ops) {
    ExprP e = (this->*next)();
    for (;;) {
      const char* hit = nullptr;
      for (const char* op : ops) {
        if (peek().kind == Tok::kOp && peek().text == op) hit = op;
      }
      if (!hit) return e;
      ++p_;
      ExprP b = make(Expr::kBin, line_);
      b->name = hit;
      b->args = {e, (this->*next)()};
      e = fin(b);
    }
  }
  ExprP concat() { return binary_left(&ExprParser::sum, {"~"}); }
  ExprP sum() { return binary_left(&ExprParser::product, {"+", "-"}); }
  ExprP product() { return binary_left(&ExprParser::power, {"*", "/", "//", "%"}); }
  ExprP power() { return binary_left(&ExprParser::unary, {"**"}); }
  ExprP unary() {
    if (accept_op("-")) {
      Deeper guard(*this);
      ExprP n = make(Expr::kNeg, line_);
      n->args = {unary()};
      return fin(n);
    }
    if (accept_op("+")) {
      Deeper guard(*this);
      return unary();
    }
    return filtered(postfix(primary()));
  }
  void call_args(ExprP& e) {
    if (accept_op(")")) return;
    for (;;) {
      if (peek().kind == Tok::kName && peek(1).kind == Tok::kOp && peek(1).text == "=") {
        const std::string k = name();
        expect_op("=");
        e->kwargs.emplace_back(k, expression());
      } else {
        e->args.push_back(expression());
      }
      if (accept_op(")")) return;
      expect_op(",");
    }
  }
  ExprP filtered(ExprP e) {
    for (;;) {
      if (accept_op("|")) {
        ExprP f = make(Expr::kFilter, line_);
        f->name = name();
        f->args.push_back(e);
        if (accept_op("(")) call_args(f);
        e = postfix(fin(f));
      } else if (accept_name("is")) {
        ExprP t = make(Expr::kTest, line_);
        t->negated = accept_name("not");
        t->name = name();
        t->args.push_back(e);
        if (accept_op("(")) {
          call_args(t);
        } else if (peek().kind == Tok::kStr || peek().kind == Tok::kInt || peek().kind == Tok::kFloat ||
                   (peek().kind == Tok::kName && peek().text != "and" && peek().text != "or" && peek().text != "else" &&
                    peek().text != "if" && peek().text != "is" && peek().text != "in" && peek().text != "not")) {
          t->args.push_back(primary());  // `is divisibleby 3`, `is equalto x`
        }
        e = fin(t);
      } else {
        return e;
      }
    }
  }
  ExprP postfix(ExprP e) {
    for (;;) {
      if (accept_op(".")) {
        ExprP a = make(Expr::kAttr, line_);
        a->name = peek().kind == Tok::kInt ? std::to_string(t_[p_++].i) : name();
        a->args = {e};
        e = fin(a);
      } else if (accept_op("[")) {
        ExprP lo, hi, step;
        bool slice = false;
        if (!(peek().kind == Tok::kOp && peek().text == ":")) lo = expression();
        if (accept_op(":")) {
          slice = true;
          if (!(peek().kind == Tok::kOp && (peek().text == ":" || peek().text == "]"))) hi = expression();
          if (accept_op(":") && !(peek().kind == Tok::kOp && peek().text == "]")) step = expression();
        }
        expect_op("]");
        ExprP s = make(slice ? Expr::kSlice : Expr::kItem, line_);
        s->args = {e, lo, hi, step};
        e = fin(s);
      } else if (accept_op("(")) {
        ExprP c = make(Expr::kCall, line_);
        c->args.push_back(e);
        call_args(c);
        e = fin(c);
      } else {
        return e;
      }
    }
  }
  ExprP primary() {
    const Tok& t = peek();
    if (t.kind == Tok::kStr) {
      ++p_;
      std::string s = t.text;
      while (peek().kind == Tok::kStr) s += t_[p_++].text;  // adjacent literals concatenate
      ExprP l = make(Expr::kLit, line_);
      l->lit = Value::str(s);
      return l;
    }
    if (t.kind == Tok::kInt || t.kind == Tok::kFloat) {
      ++p_;
      ExprP l = make(Expr::kLit, line_);
      l->lit = t.kind == Tok::kInt ? Value::integer(t.i) : Value::real(t.f);
      return l;
    }
    if (t.kind == Tok::kName) {
      ++p_;
      ExprP l = make(Expr::kLit, line_);
      if (t.text == "true" || t.text == "True")
        l->lit = Value::boolean(true);
      else if (t.text == "false" || t.text == "False")
        l->lit = Value::boolean(false);
      else if (t.text == "none" || t.text == "None")
        l->lit = Value::none();
      else {
        l->kind = Expr::kVar;
        l->name = t.text;
      }
      return l;
    }
    if (accept_op("(")) {
      ExprP e = expression();
      if (accept_op(",")) {  // a tuple: a list here
        ExprP l = make(Expr::kList, line_);
        l->args.push_back(e);
        while (!accept_op(")")) {
          l->args.push_back(expression());
          if (!accept_op(",")) {
            expect_op(")");
            break;
          }
        }
        return fin(l);
      }
      expect_op(")");
      return e;
    }
    if (accept_op("[")) {
      ExprP l = make(Expr::kList, line_);
      while (!accept_op("]")) {
        l->args.push_back(expression());
        if (!accept_op(",")) {
          expect_op("]");
          break;
        }
      }
      return fin(l);
    }
    if (accept_op("{")) {
      ExprP d = make(Expr::kDict, line_);
      while (!accept_op("}")) {
        d->args.push_back(expression());
        expect_op(":");
        d->args.push_back(expression());
        if (!accept_op(",")) {
          expect_op("}");
          break;
        }
      }
      return fin(d);
    }
    fail("unexpected '" + t.text + "'");
  }

 private:
  std::vector<Tok> t_;
  size_t p_ = 0;
  int line_;
  int max_nesting_;
  int nesting_ = 0;
};

}  // namespace

// ------------------------------------------------------------------------------------------------ statements

struct Template::Node {
  enum Kind { kText, kOut, kIf, kFor, kSet, kMacro, kBreak, kContinue } kind;
  std::string text;                                        // kText
  ExprP expr;                                              // kOut, kSet value, kFor iterable
  std::vector<ExprP> conds;                                // kIf: one per branch (nullptr = else)
  std::vector<std::vector<std::shared_ptr<Node>>> bodies;  // kIf branches; kFor {body, else}; kMacro {body}
  std::vector<std::string> targets;                        // kFor loop variables; kSet target (name, or ns + attr)
  ExprP filter;                                            // kFor `if`
  std::vector<std::pair<std::string, ExprP>> params;       // kMacro
  int line = 0;
};

namespace {

using NodeP = std::shared_ptr<Template::Node>;

struct RawTag {
  bool block;  // {% %} (true) or {{ }} (false); text otherwise
  bool is_text;
  std::string content;
  int line;
};

// Template text -> text pieces and tags, with -, trim_blocks and lstrip_blocks applied.
std::vector<RawTag> split_tags(const std::string& src, const Options& opt) {
  std::vector<RawTag> out;
  size_t p = 0;
  int line = 1;
  bool strip_next = false, trim_newline = false;
  auto count_lines = [](const std::string& s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); };
  while (p <= src.size()) {
    size_t open = src.find('{', p);
    while (open != std::string::npos && open + 1 < src.size() && src[open + 1] != '{' && src[open + 1] != '%' &&
           src[open + 1] != '#') {
      open = src.find('{', open + 1);
    }
    if (open + 1 >= src.size()) open = std::string::npos;
    std::string text = src.substr(p, open == std::string::npos ? std::string::npos : open - p);
    if (strip_next) {
      size_t k = 0;
      while (k < text.size() && std::isspace(static_cast<unsigned char>(text[k]))) ++k;
      text.erase(0, k);
    } else if (trim_newline) {
      if (text.compare(0, 1, "\n") == 0)
        text.erase(0, 1);
      else if (text.compare(0, 2, "\r\n") == 0)
        text.erase(0, 2);
    }
    strip_next = trim_newline = false;
    if (open == std::string::npos) {
      if (!text.empty()) out.push_back({false, true, text, line});
      break;
    }
    const char kind = src[open + 1];
    const bool minus_left = open + 2 < src.size() && src[open + 2] == '-';
    const bool plus_left = open + 2 < src.size() && src[open + 2] == '+';
    if (minus_left) {
      while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
    } else if (opt.lstrip_blocks && !plus_left && (kind == '%' || kind == '#')) {
      // Only when the tag starts its line: nothing but spaces and tabs between the line start and it.
      size_t back = open;
      while (back > 0 && (src[back - 1] == ' ' || src[back - 1] == '\t')) --back;
      if (back == 0 || src[back - 1] == '\n') text.erase(text.size() - std::min(text.size(), open - back));
    }
    if (!text.empty()) out.push_back({false, true, text, line});
    line += count_lines(src.substr(p, open - p));
    const char* close = kind == '{' ? "}}" : kind == '%' ? "%}" : "#}";
    // The tag ends at the first close sequence outside a string literal ({{- "}}" }} is one tag).
    size_t end = std::string::npos;
    if (kind == '#') {
      end = src.find(close, open + 2);
    } else {
      char quote = 0;
      for (size_t k = open + 2; k + 1 < src.size(); ++k) {
        if (quote) {
          if (src[k] == '\\')
            ++k;
          else if (src[k] == quote)
            quote = 0;
        } else if (src[k] == '\'' || src[k] == '"') {
          quote = src[k];
        } else if (src.compare(k, 2, close) == 0) {
          end = k;
          break;
        }
      }
    }
    if (end == std::string::npos) {
      throw TemplateError("template line " + std::to_string(line) + ": unclosed tag");
    }
    const bool minus_right = end > 0 && src[end - 1] == '-';
    std::string inner = src.substr(open + 2 + (minus_left || plus_left ? 1 : 0),
                                   end - (open + 2 + (minus_left || plus_left ? 1 : 0)) - (minus_right ? 1 : 0));
    if (kind != '#') out.push_back({kind == '%', false, inner, line});
    line += count_lines(src.substr(open, end + 2 - open));
    p = end + 2;
    strip_next = minus_right;
    trim_newline = !minus_right && opt.trim_blocks && kind != '{';
    if (p == src.size()) break;
  }
  return out;
}

class StmtParser {
 public:
  StmtParser(std::vector<RawTag> tags, int max_nesting) : tags_(std::move(tags)), max_nesting_(max_nesting) {}

  // Parses nodes until one of `ends` (a block keyword) is met; returns that keyword ("" at the end).
  std::string parse(std::vector<NodeP>& out, std::initializer_list<const char*> ends, ExprParser** end_tag = nullptr) {
    struct Deeper {  // one level per open block: bounds this recursion and the renderer's
      int& n;
      ~Deeper() { --n; }
    } guard{++nesting_};
    if (nesting_ > max_nesting_ + 1) {
      fail(k_ < tags_.size() ? tags_[k_ - 1].line : 0, "nesting depth limit: blocks nested over " +
                                                           std::to_string(max_nesting_) + " deep " +
                                                           std::string(kLimitTag) + "max_nesting)");
    }
    while (k_ < tags_.size()) {
      const RawTag& t = tags_[k_++];
      if (t.is_text) {
        auto n = std::make_shared<Template::Node>();
        n->kind = Template::Node::kText;
        n->text = t.content;
        n->line = t.line;
        out.push_back(n);
        continue;
      }
      auto ep = std::make_unique<ExprParser>(lex_expr(t.content, t.line), t.line, max_nesting_);
      if (!t.block) {
        auto n = std::make_shared<Template::Node>();
        n->kind = Template::Node::kOut;
        n->line = t.line;
        n->expr = ep->expression();
        ep->expect_end();
        out.push_back(n);
        continue;
      }
      const std::string kw = ep->name();
      for (const char* e : ends) {
        if (kw == e) {
          last_ = std::move(ep);
          if (end_tag) *end_tag = last_.get();
          return kw;
        }
      }
      auto n = std::make_shared<Template::Node>();
      n->line = t.line;
      if (kw == "if") {
        n->kind = Template::Node::kIf;
        ExprP cond = ep->expression();
        ep->expect_end();
        for (;;) {
          n->conds.push_back(cond);
          n->bodies.emplace_back();
          ExprParser* tag = nullptr;
          const std::string e = parse(n->bodies.back(), {"elif", "else", "endif"}, &tag);
          if (e == "elif") {
            cond = tag->expression();
            tag->expect_end();
          } else if (e == "else") {
            n->conds.push_back(nullptr);
            n->bodies.emplace_back();
            parse(n->bodies.back(), {"endif"});
            break;
          } else if (e == "endif") {
            break;
          } else {
            fail(t.line, "if without endif");
          }
        }
      } else if (kw == "for") {
        n->kind = Template::Node::kFor;
        n->targets.push_back(ep->name());
        while (ep->accept_op(",")) n->targets.push_back(ep->name());
        if (!ep->accept_name("in")) ep->fail("expected 'in'");
        n->expr = ep->or_expr();
        if (ep->accept_name("if")) n->filter = ep->expression();
        ep->accept_name("recursive");
        ep->expect_end();
        n->bodies.resize(2);
        const std::string e = parse(n->bodies[0], {"else", "endfor"});
        if (e == "else")
          parse(n->bodies[1], {"endfor"});
        else if (e.empty())
          fail(t.line, "for without endfor");
      } else if (kw == "set") {
        n->kind = Template::Node::kSet;
        n->targets.push_back(ep->name());
        if (ep->accept_op(".")) n->targets.push_back(ep->name());
        ep->expect_op("=");
        n->expr = ep->expression();
        ep->expect_end();
      } else if (kw == "macro") {
        n->kind = Template::Node::kMacro;
        n->targets.push_back(ep->name());
        ep->expect_op("(");
        while (!ep->accept_op(")")) {
          const std::string pname = ep->name();
          ExprP dflt = ep->accept_op("=") ? ep->expression() : nullptr;
          n->params.emplace_back(pname, dflt);
          if (!ep->accept_op(",")) {
            ep->expect_op(")");
            break;
          }
        }
        n->bodies.resize(1);
        if (parse(n->bodies[0], {"endmacro"}).empty()) fail(t.line, "macro without endmacro");
      } else if (kw == "break" || kw == "continue") {
        n->kind = kw == "break" ? Template::Node::kBreak : Template::Node::kContinue;
      } else {
        fail(t.line, "unsupported statement '" + kw + "'");
      }
      out.push_back(n);
    }
    return "";
  }
  [[noreturn]] static void fail(int line, const std::string& why) {
    throw TemplateError("template line " + std::to_string(line) + ": " + why);
  }

 private:
  std::vector<RawTag> tags_;
  size_t k_ = 0;
  std::unique_ptr<ExprParser> last_;
  int max_nesting_;
  int nesting_ = 0;
};

// ------------------------------------------------------------------------------------------------ render

struct LoopBreak {};
struct LoopContinue {};

class Renderer {
 public:
  explicit Renderer(const nlohmann::ordered_json& ctx) {
    set_stack_floor();
    scopes_.emplace_back();
    for (const auto& [k, v] : ctx.items()) scopes_.back().set(k, from_json(v));
    install_globals();
  }

  void run(const std::vector<NodeP>& body, std::string& out) {
    for (const auto& n : body) {
      check_stack(n->line);
      try {
        node(*n, out);
      } catch (const LineLess& e) {
        fail(n->line, e.why);
      }
      if (static_cast<int64_t>(out.size()) > limits().max_output) {
        fail(n->line, "output size limit: the text passes " + std::to_string(limits().max_output) + " bytes " +
                          std::string(kLimitTag) + "max_output)");
      }
    }
  }

 private:
  std::vector<Dict> scopes_;
  // The renderer recurses once per open block, operator and macro call. Each is bounded (max_nesting,
  // max_recursion), but together (100 macro calls deep, each 256 blocks and 256 operators deep) they
  // need more stack than a thread has, so the depth is also held to the thread's stack: all of it but
  // 1 MiB (half of it when the stack is under 2 MiB), which to_str and tojson's 2 * max_nesting levels
  // fit in.
  const char* stack_floor_ = nullptr;

  void set_stack_floor() {
    const char* here = static_cast<const char*>(__builtin_frame_address(0));
    size_t left = size_t(4) << 20;  // when the thread's stack cannot be read
    pthread_attr_t attr;
    if (pthread_getattr_np(pthread_self(), &attr) == 0) {
      void* lowest = nullptr;
      size_t size = 0;
      if (pthread_attr_getstack(&attr, &lowest, &size) == 0 && here > static_cast<const char*>(lowest)) {
        left = static_cast<size_t>(here - static_cast<const char*>(lowest));
      }
      pthread_attr_destroy(&attr);
    }
    const size_t usable = left > (size_t(2) << 20) ? left - (size_t(1) << 20) : left / 2;
    stack_floor_ = here - usable;
  }
  void check_stack(int line) const {
    if (static_cast<const char*>(__builtin_frame_address(0)) < stack_floor_) {
      fail(line,
           "nesting depth limit: blocks, expressions and macro calls nested deeper than this thread's stack "
           "holds " +
               std::string(kLimitTag) + "max_nesting, max_recursion)");
    }
  }

  static const Limits& limits() { return tl_budget->limits; }

  [[noreturn]] static void fail(int line, const std::string& why) {
    throw TemplateError("template line " + std::to_string(line) + ": " + why);
  }

  Value lookup(const std::string& name) {
    for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
      if (Value* v = it->find(name)) return *v;
    }
    return Value();
  }

  void install_globals() {
    Dict& g = scopes_.front();
    if (!g.find("raise_exception")) {
      g.set("raise_exception", Value::function([](const Args& a, const Kwargs&) -> Value {
              throw TemplateRaise(a.empty() ? std::string() : to_str(a[0]));
            }));
    }
    if (!g.find("strftime_now")) {
      g.set("strftime_now", Value::function([](const Args& a, const Kwargs&) {
              const std::time_t now = std::time(nullptr);
              std::tm tm{};
              localtime_r(&now, &tm);
              char buf[256];
              const std::string fmt = a.empty() ? std::string() : to_str(a[0]);
              const size_t n = std::strftime(buf, sizeof(buf), fmt.c_str(), &tm);
              return Value::str(std::string(buf, n));
            }));
    }
    g.set("namespace", Value::function([](const Args& a, const Kwargs& kw) {
            Dict d;
            if (!a.empty() && a[0].kind == Value::kDict) d = *a[0].dict;
            for (const auto& [k, v] : kw) d.set(k, v);
            for (const auto& [k, v] : d.items) no_namespace_inside(k, v);
            Value ns = Value::of_dict(std::move(d));
            ns.holds_ns = true;
            return ns;
          }));
    g.set("range", Value::function([](const Args& a, const Kwargs&) {
            int64_t lo = 0, hi = 0, st = 1;
            if (a.size() == 1) hi = a[0].i;
            if (a.size() >= 2) lo = a[0].i, hi = a[1].i;
            if (a.size() >= 3) st = a[2].i;
            if (st == 0) throw LineLess{"range() step must not be zero"};
            // Its length, in floating point so that no bound overflows.
            const double n = std::max(0.0, std::ceil((double(hi) - double(lo)) / double(st)));
            if (n > double(limits().max_range)) {
              char items[32];
              std::snprintf(items, sizeof(items), "%.0f", n);
              limit_hit("range length",
                        "range(" + std::to_string(lo) + ", " + std::to_string(hi) + ", " + std::to_string(st) +
                            ") has " + items + " items, over " + std::to_string(limits().max_range),
                        "max_range");
            }
            List l;
            for (int64_t k = 0; k < static_cast<int64_t>(n); ++k) l.push_back(Value::integer(lo + k * st));
            return Value::of_list(std::move(l));
          }));
  }

  // A namespace's attribute may hold anything but a namespace (see Value::holds_ns).
  static void no_namespace_inside(const std::string& name, const Value& v) {
    if (v.holds_ns) throw LineLess{"namespace attribute '" + name + "': a namespace may not hold a namespace"};
    if (v.depth + 1 > limits().max_nesting) check_value_depth(v.depth + 1);
  }

  void node(const Template::Node& n, std::string& out) {
    switch (n.kind) {
      case Template::Node::kText:
        out += n.text;
        return;
      case Template::Node::kOut:
        out += to_str(eval(*n.expr));
        return;
      case Template::Node::kIf:
        for (size_t b = 0; b < n.conds.size(); ++b) {
          if (!n.conds[b] || truthy(eval(*n.conds[b]))) {
            run(n.bodies[b], out);
            return;
          }
        }
        return;
      case Template::Node::kSet: {
        Value v = eval(*n.expr);
        if (n.targets.size() == 2) {
          Value ns = lookup(n.targets[0]);
          if (ns.kind != Value::kDict) fail(n.line, "set " + n.targets[0] + "." + n.targets[1] + ": not a namespace");
          no_namespace_inside(n.targets[1], v);
          ns.dict->set(n.targets[1], std::move(v));
        } else {
          scopes_.back().set(n.targets[0], std::move(v));
        }
        return;
      }
      case Template::Node::kMacro: {
        const Template::Node* def = &n;
        scopes_.back().set(
            n.targets[0], Value::function([this, def](const Args& a, const Kwargs& kw) {
              struct Deeper {
                int& n;
                ~Deeper() { --n; }
              } guard{++tl_budget->macro_depth};
              if (tl_budget->macro_depth > limits().max_recursion) {
                limit_hit(
                    "recursion depth",
                    "macro " + def->targets[0] + " called " + std::to_string(limits().max_recursion + 1) + " deep",
                    "max_recursion");
              }
              Dict params;
              for (size_t k = 0; k < def->params.size(); ++k) {
                Value v = k < a.size() ? a[k] : def->params[k].second ? eval(*def->params[k].second) : Value();
                for (const auto& [name, val] : kw) {
                  if (name == def->params[k].first) v = val;
                }
                params.set(def->params[k].first, v);
              }
              std::vector<Dict> saved;
              saved.swap(scopes_);
              for (const auto& g : saved.front().items) charge(static_cast<int64_t>(sizeof(Value) + g.second.s.size()));
              scopes_.push_back(saved.front());
              scopes_.push_back(std::move(params));
              std::string body;
              try {
                run(def->bodies[0], body);
              } catch (...) {
                saved.front() = scopes_.front();
                scopes_.swap(saved);
                throw;
              }
              saved.front() = scopes_.front();
              scopes_.swap(saved);
              return Value::str(body);
            }));
        return;
      }
      case Template::Node::kFor:
        return for_loop(n, out);
      case Template::Node::kBreak:
        throw LoopBreak{};
      case Template::Node::kContinue:
        throw LoopContinue{};
    }
  }

  static List iterate(const Value& v, int line) {
    if (v.kind == Value::kList) {
      charge(Value::copy_cost(*v.list));
      return *v.list;
    }
    if (v.kind == Value::kDict) charge(static_cast<int64_t>(v.dict->items.size() * sizeof(Value)));
    if (v.kind == Value::kStr) charge(static_cast<int64_t>(v.s.size() * sizeof(Value)));
    if (v.kind == Value::kDict) {
      List keys;
      for (const auto& [k, x] : v.dict->items) keys.push_back(Value::str(k));
      return keys;
    }
    if (v.kind == Value::kStr) {
      List chars;
      for (size_t i = 0; i < v.s.size();) {
        const auto c = static_cast<unsigned char>(v.s[i]);
        const size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : 4;
        chars.push_back(Value::str(v.s.substr(i, n)));
        i += n;
      }
      return chars;
    }
    if (v.kind == Value::kUndefined || v.kind == Value::kNone) {
      if (v.kind == Value::kNone) fail(line, "'NoneType' object is not iterable");
      return {};
    }
    fail(line, std::string("cannot iterate over ") + kind_name(v));
  }

  void bind(const std::vector<std::string>& targets, const Value& item, Dict& scope, int line) {
    if (targets.size() == 1) {
      scope.set(targets[0], item);
      return;
    }
    const List parts = iterate(item, line);
    if (parts.size() != targets.size()) fail(line, "cannot unpack into " + std::to_string(targets.size()) + " names");
    for (size_t k = 0; k < targets.size(); ++k) scope.set(targets[k], parts[k]);
  }

  void count_iteration() {
    if (++tl_budget->iterations > limits().max_iterations) {
      limit_hit("loop iteration", "loops ran over " + std::to_string(limits().max_iterations) + " iterations",
                "max_iterations");
    }
  }

  void for_loop(const Template::Node& n, std::string& out) {
    List items = iterate(eval(*n.expr), n.line);
    if (n.filter) {
      List kept;
      for (const auto& it : items) {
        count_iteration();
        scopes_.emplace_back();
        bind(n.targets, it, scopes_.back(), n.line);
        const bool keep = truthy(eval(*n.filter));
        scopes_.pop_back();
        if (keep) kept.push_back(it);
      }
      items.swap(kept);
    }
    const int64_t N = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < N; ++k) {
      if (!n.filter) count_iteration();
      Dict loop;
      loop.set("index", Value::integer(k + 1));
      loop.set("index0", Value::integer(k));
      loop.set("revindex", Value::integer(N - k));
      loop.set("revindex0", Value::integer(N - k - 1));
      loop.set("first", Value::boolean(k == 0));
      loop.set("last", Value::boolean(k == N - 1));
      loop.set("length", Value::integer(N));
      loop.set("previtem", k > 0 ? items[k - 1] : Value());
      loop.set("nextitem", k + 1 < N ? items[k + 1] : Value());
      scopes_.emplace_back();
      // Not of_dict: max_iterations pays for the mapping itself; the items' strings are charged.
      Value loop_value = Value::with(Value::kDict);
      loop_value.depth = 1;
      for (const auto& entry : loop.items) {
        loop_value.take_child(entry.second);
        charge(static_cast<int64_t>(entry.second.s.size()));
      }
      loop_value.dict = std::make_shared<Dict>(std::move(loop));
      scopes_.back().set("loop", std::move(loop_value));
      bind(n.targets, items[k], scopes_.back(), n.line);
      bool stop = false;
      try {
        run(n.bodies[0], out);
      } catch (const LoopBreak&) {
        stop = true;
      } catch (const LoopContinue&) {
      }
      scopes_.pop_back();
      if (stop) break;
    }
    if (N == 0) run(n.bodies[1], out);
  }

  // ---- expressions

  // Every string an expression yields is charged to max_work: reading a variable or an attribute copies
  // it, so a loop that re-reads a long string costs its length each time.
  Value eval(const Expr& e) {
    check_stack(e.line);
    Value v = eval_node(e);
    if (v.kind == Value::kStr) charge(static_cast<int64_t>(v.s.size()));
    return v;
  }

  Value eval_node(const Expr& e) {
    switch (e.kind) {
      case Expr::kLit:
        return e.lit;
      case Expr::kVar:
        return lookup(e.name);
      case Expr::kAttr:
        return attribute(eval(*e.args[0]), e.name, e.line);
      case Expr::kItem:
        return item(eval(*e.args[0]), eval(*e.args[1]), e.line);
      case Expr::kSlice:
        return slice(e);
      case Expr::kCall:
        return call(e);
      case Expr::kFilter:
        return filter(e);
      case Expr::kTest:
        return Value::boolean(test(e) != e.negated);
      case Expr::kNeg: {
        const Value v = eval(*e.args[0]);
        if (v.kind == Value::kInt) return Value::integer(-v.i);
        if (v.number()) return Value::real(-v.as_double());
        fail(e.line, std::string("cannot negate ") + kind_name(v));
      }
      case Expr::kNot:
        return Value::boolean(!truthy(eval(*e.args[0])));
      case Expr::kAnd: {
        Value a = eval(*e.args[0]);
        return truthy(a) ? eval(*e.args[1]) : a;
      }
      case Expr::kOr: {
        Value a = eval(*e.args[0]);
        return truthy(a) ? a : eval(*e.args[1]);
      }
      case Expr::kCond:
        if (truthy(eval(*e.args[0]))) return eval(*e.args[1]);
        return e.args[2] ? eval(*e.args[2]) : Value();
      case Expr::kList: {
        List l;
        for (const auto& x : e.args) l.push_back(eval(*x));
        return Value::of_list(std::move(l));
      }
      case Expr::kDict: {
        Dict d;
        for (size_t k = 0; k + 1 < e.args.size(); k += 2) d.set(to_str(eval(*e.args[k])), eval(*e.args[k + 1]));
        return Value::of_dict(std::move(d));
      }
      case Expr::kBin:
        return binary(e);
    }
    return Value();
  }

  Value binary(const Expr& e) {
    const Value a = eval(*e.args[0]), b = eval(*e.args[1]);
    const std::string& op = e.name;
    if (op == "==") return Value::boolean(equal(a, b));
    if (op == "!=") return Value::boolean(!equal(a, b));
    if (op == "in") return Value::boolean(contains(b, a, e.line) != e.negated);
    if (op == "~") return built(to_str(a) + to_str(b));
    if (op == "<" || op == ">" || op == "<=" || op == ">=") {
      int c = 0;
      if (a.number() && b.number())
        c = a.as_double() < b.as_double() ? -1 : a.as_double() > b.as_double() ? 1 : 0;
      else if (a.kind == Value::kStr && b.kind == Value::kStr)
        c = a.s < b.s ? -1 : a.s > b.s ? 1 : 0;
      else
        fail(e.line, std::string("cannot compare ") + kind_name(a) + " with " + kind_name(b));
      return Value::boolean(op == "<" ? c < 0 : op == ">" ? c > 0 : op == "<=" ? c <= 0 : c >= 0);
    }
    if (op == "+") {
      if (a.kind == Value::kStr && b.kind == Value::kStr) return built(a.s + b.s);
      if (a.kind == Value::kList && b.kind == Value::kList) {
        List l = *a.list;
        l.insert(l.end(), b.list->begin(), b.list->end());
        return Value::of_list(std::move(l));
      }
    }
    if (op == "*" && a.kind == Value::kStr && b.kind == Value::kInt) {
      const double bytes = double(a.s.size()) * double(std::max<int64_t>(b.i, 0));
      if (bytes > double(limits().max_output)) {
        char n[32];
        std::snprintf(n, sizeof(n), "%.0f", bytes);
        fail(e.line, "string size limit: repeating " + std::to_string(a.s.size()) + " bytes " + std::to_string(b.i) +
                         " times makes " + n + " bytes, over " + std::to_string(limits().max_output) + " " +
                         std::string(kLimitTag) + "max_output)");
      }
      std::string s;
      s.reserve(static_cast<size_t>(bytes));
      if (b.i > 0) s = a.s;
      while (!s.empty() && s.size() * 2 <= static_cast<size_t>(bytes)) s.append(s.data(), s.size());  // doubles
      s.append(s.data(), static_cast<size_t>(bytes) - s.size());
      return built(std::move(s));
    }
    if (!a.number() || !b.number()) {
      fail(e.line, "unsupported operand types for " + op + ": " + kind_name(a) + " and " + kind_name(b));
    }
    const bool ints = a.kind != Value::kFloat && b.kind != Value::kFloat;
    const double x = a.as_double(), y = b.as_double();
    if (op == "/") {
      if (y == 0) fail(e.line, "division by zero");
      return Value::real(x / y);
    }
    if (ints) {
      const int64_t p = a.kind == Value::kBool ? a.b : a.i, q = b.kind == Value::kBool ? b.b : b.i;
      int64_t r = 0;
      auto overflow = [&]() {
        fail(e.line, "integer overflow in " + std::to_string(p) + " " + op + " " + std::to_string(q));
      };
      if (op == "+") return __builtin_add_overflow(p, q, &r) ? overflow(), Value() : Value::integer(r);
      if (op == "-") return __builtin_sub_overflow(p, q, &r) ? overflow(), Value() : Value::integer(r);
      if (op == "*") return __builtin_mul_overflow(p, q, &r) ? overflow(), Value() : Value::integer(r);
      if ((op == "//" || op == "%") && q == 0) fail(e.line, "integer division or modulo by zero");
      if (op == "//") return Value::integer(static_cast<int64_t>(std::floor(double(p) / double(q))));
      if (op == "%") return Value::integer(q == -1 ? 0 : ((p % q) + q) % q);
      if (op == "**") {
        const double x = std::pow(double(p), double(q));
        if (!(std::fabs(x) < 9.2e18)) overflow();
        return q < 0 ? Value::real(x) : Value::integer(static_cast<int64_t>(x));
      }
    }
    if (op == "+") return Value::real(x + y);
    if (op == "-") return Value::real(x - y);
    if (op == "*") return Value::real(x * y);
    if (op == "//") return Value::real(std::floor(x / y));
    if (op == "%") return Value::real(x - std::floor(x / y) * y);
    if (op == "**") return Value::real(std::pow(x, y));
    fail(e.line, "unknown operator " + op);
  }

  // A string built by the template, within max_output (eval charges it to max_work).
  static Value built(std::string s) {
    check_string(s.size());
    return Value::str(std::move(s));
  }

  static bool contains(const Value& hay, const Value& needle, int line) {
    if (hay.kind == Value::kStr) {
      if (needle.kind != Value::kStr) fail(line, "'in <string>' requires a string on the left");
      charge(static_cast<int64_t>(hay.s.size() + needle.s.size()));
      return find_text(hay.s, needle.s) != std::string::npos;
    }
    if (hay.kind == Value::kList) {
      for (const auto& x : *hay.list) {
        if (equal(x, needle)) return true;
      }
      return false;
    }
    if (hay.kind == Value::kDict) return needle.kind == Value::kStr && hay.dict->find(needle.s) != nullptr;
    if (hay.kind == Value::kUndefined) return false;
    fail(line, std::string("'in' needs a string, list or mapping, got ") + kind_name(hay));
  }

  static int64_t norm_index(int64_t i, int64_t n) { return i < 0 ? i + n : i; }

  Value item(const Value& obj, const Value& key, int line) {
    if (obj.kind == Value::kDict) {
      if (key.kind != Value::kStr) return Value();
      Value* v = obj.dict->find(key.s);
      return v ? *v : Value();
    }
    if ((obj.kind == Value::kList || obj.kind == Value::kStr) && key.kind == Value::kInt) {
      const int64_t n = obj.kind == Value::kList ? obj.list->size() : obj.s.size();
      const int64_t i = norm_index(key.i, n);
      if (i < 0 || i >= n) return Value();
      return obj.kind == Value::kList ? (*obj.list)[i] : Value::str(obj.s.substr(i, 1));
    }
    if (obj.kind == Value::kStr || obj.kind == Value::kList) {
      if (key.kind == Value::kStr) return attribute(obj, key.s, line);
    }
    return Value();
  }

  Value slice(const Expr& e) {
    const Value obj = eval(*e.args[0]);
    auto num = [&](const ExprP& x, bool& given) -> int64_t {
      given = x != nullptr;
      if (!x) return 0;
      const Value v = eval(*x);
      if (v.kind == Value::kNone) {
        given = false;
        return 0;
      }
      if (v.kind != Value::kInt) fail(e.line, "slice indices must be integers");
      return v.i;
    };
    bool has_lo, has_hi, has_step;
    int64_t lo = num(e.args[1], has_lo), hi = num(e.args[2], has_hi), step = num(e.args[3], has_step);
    if (!has_step) step = 1;
    if (step == 0) fail(e.line, "slice step cannot be zero");
    List src;
    if (obj.kind == Value::kList)
      src = iterate(obj, e.line);
    else if (obj.kind == Value::kStr)
      src = iterate(obj, e.line);
    else
      fail(e.line, std::string("cannot slice ") + kind_name(obj));
    const int64_t n = src.size();
    auto clamp = [&](int64_t i, bool given, int64_t dflt) {
      if (!given) return dflt;
      if (i < 0) i += n;
      if (step > 0) return std::max<int64_t>(0, std::min(i, n));
      return std::max<int64_t>(-1, std::min(i, n - 1));
    };
    lo = clamp(lo, has_lo, step > 0 ? 0 : n - 1);
    hi = clamp(hi, has_hi, step > 0 ? n : -1);
    List out;
    for (int64_t i = lo; step > 0 ? i < hi : i > hi;) {
      out.push_back(src[i]);
      if (__builtin_add_overflow(i, step, &i)) break;
    }
    if (obj.kind == Value::kStr) {
      std::string s;
      for (const auto& c : out) s += c.s;
      return Value::str(s);
    }
    return Value::of_list(std::move(out));
  }

  Value call(const Expr& e) {
    const Value fn = eval(*e.args[0]);
    if (fn.kind != Value::kFn) fail(e.line, std::string("cannot call ") + kind_name(fn));
    Args a;
    for (size_t k = 1; k < e.args.size(); ++k) a.push_back(eval(*e.args[k]));
    Kwargs kw;
    for (const auto& [k, v] : e.kwargs) kw.emplace_back(k, eval(*v));
    return (*fn.fn)(a, kw);
  }

  // Python str methods and mapping methods, bound to their object.
  Value attribute(const Value& obj, const std::string& name, int line) {
    Value method = attribute_of(obj, name, line);
    if (method.kind == Value::kFn && obj.kind == Value::kDict) method.holds_ns = obj.holds_ns;  // bound to obj
    return method;
  }
  Value attribute_of(const Value& obj, const std::string& name, int line) {
    if (obj.kind == Value::kDict) {
      if (Value* v = obj.dict->find(name)) return *v;
      auto d = obj.dict;
      if (name == "items") {
        return Value::function([d](const Args&, const Kwargs&) {
          List l;
          for (const auto& [k, v] : d->items) l.push_back(Value::of_list({Value::str(k), v}));
          return Value::of_list(std::move(l));
        });
      }
      if (name == "keys" || name == "values") {
        const bool keys = name == "keys";
        return Value::function([d, keys](const Args&, const Kwargs&) {
          List l;
          for (const auto& [k, v] : d->items) l.push_back(keys ? Value::str(k) : v);
          return Value::of_list(std::move(l));
        });
      }
      if (name == "get") {
        return Value::function([d](const Args& a, const Kwargs&) {
          if (!a.empty() && a[0].kind == Value::kStr) {
            if (Value* v = d->find(a[0].s)) return *v;
          }
          return a.size() > 1 ? a[1] : Value::none();
        });
      }
      return Value();
    }
    if (obj.kind == Value::kStr) return string_method(obj.s, name, line);
    return Value();
  }

  static std::string strip_chars(const std::string& s, const std::string& chars, bool left, bool right) {
    auto in = [&](char c) {
      return chars.empty() ? std::isspace(static_cast<unsigned char>(c)) != 0 : chars.find(c) != std::string::npos;
    };
    size_t b = 0, e = s.size();
    if (left) {
      while (b < e && in(s[b])) ++b;
    }
    if (right) {
      while (e > b && in(s[e - 1])) --e;
    }
    return s.substr(b, e - b);
  }

  Value string_method(const std::string& s, const std::string& name, int line) {
    auto arg_str = [](const Args& a, size_t k) {
      return k < a.size() && a[k].kind == Value::kStr ? a[k].s : std::string();
    };
    if (name == "startswith" || name == "endswith") {
      const bool start = name == "startswith";
      return Value::function([s, start, arg_str](const Args& a, const Kwargs&) {
        const std::string p = arg_str(a, 0);
        const bool hit = start ? s.compare(0, p.size(), p) == 0
                               : s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
        return Value::boolean(hit);
      });
    }
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      const bool l = name != "rstrip", r = name != "lstrip";
      return Value::function(
          [s, l, r, arg_str](const Args& a, const Kwargs&) { return Value::str(strip_chars(s, arg_str(a, 0), l, r)); });
    }
    if (name == "split" || name == "rsplit") {
      return Value::function([s, arg_str](const Args& a, const Kwargs&) {
        List parts;
        const std::string sep = arg_str(a, 0);
        charge(static_cast<int64_t>(s.size() + sep.size()));
        if (sep.empty()) {  // split on runs of whitespace
          std::istringstream in(s);
          std::string w;
          while (in >> w) parts.push_back(Value::str(w));
        } else {
          size_t b = 0;
          for (size_t e; (e = find_text(s, sep, b)) != std::string::npos; b = e + sep.size()) {
            parts.push_back(Value::str(s.substr(b, e - b)));
          }
          parts.push_back(Value::str(s.substr(b)));
        }
        return Value::of_list(std::move(parts));
      });
    }
    if (name == "replace") {
      return Value::function([s, arg_str](const Args& a, const Kwargs&) {
        const std::string from = arg_str(a, 0), to = arg_str(a, 1);
        if (from.empty()) return Value::str(s);
        charge(static_cast<int64_t>(s.size() + from.size()));
        std::string out;
        size_t b = 0;
        for (size_t e; (e = find_text(s, from, b)) != std::string::npos; b = e + from.size()) {
          out += s.substr(b, e - b) + to;
          check_string(out.size());
        }
        return built(out + s.substr(b));
      });
    }
    if (name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
      return Value::function([s, name](const Args&, const Kwargs&) { return Value::str(change_case(s, name)); });
    }
    if (name == "format") {
      return Value::function([s](const Args& a, const Kwargs&) {
        std::string out;
        size_t k = 0;
        for (size_t i = 0; i < s.size(); ++i) {
          if (s[i] == '{' && i + 1 < s.size() && s[i + 1] == '}') {
            out += k < a.size() ? to_str(a[k++]) : "";
            check_string(out.size());
            ++i;
          } else {
            out += s[i];
          }
        }
        return built(std::move(out));
      });
    }
    return Value();  // like jinja2: an attribute a str lacks is undefined (calling it is the error)
  }

  static std::string change_case(const std::string& s, const std::string& how) {
    std::string out = s;
    bool word_start = true;
    for (size_t i = 0; i < out.size(); ++i) {
      const unsigned char c = out[i];
      if (how == "upper")
        out[i] = std::toupper(c);
      else if (how == "lower")
        out[i] = std::tolower(c);
      else if (how == "capitalize")
        out[i] = i == 0 ? std::toupper(c) : std::tolower(c);
      else {  // title
        out[i] = word_start ? std::toupper(c) : std::tolower(c);
        word_start = !std::isalpha(c);
      }
    }
    return out;
  }

  bool apply_test(const std::string& name, const Value& v, const Args& a, int line) {
    if (name == "defined") return v.kind != Value::kUndefined;
    if (name == "undefined") return v.kind == Value::kUndefined;
    if (name == "none") return v.kind == Value::kNone;
    if (name == "string") return v.kind == Value::kStr;
    if (name == "number") return v.kind == Value::kInt || v.kind == Value::kFloat;
    if (name == "integer") return v.kind == Value::kInt;
    if (name == "float") return v.kind == Value::kFloat;
    if (name == "boolean") return v.kind == Value::kBool;
    if (name == "true") return v.kind == Value::kBool && v.b;
    if (name == "false") return v.kind == Value::kBool && !v.b;
    if (name == "mapping") return v.kind == Value::kDict;
    if (name == "iterable") return v.kind == Value::kList || v.kind == Value::kDict || v.kind == Value::kStr;
    if (name == "sequence") return v.kind == Value::kList || v.kind == Value::kDict || v.kind == Value::kStr;
    if (name == "callable") return v.kind == Value::kFn;
    if (name == "lower") return v.kind == Value::kStr && change_case(v.s, "lower") == v.s;
    if (name == "upper") return v.kind == Value::kStr && change_case(v.s, "upper") == v.s;
    if (name == "odd" || name == "even") return v.kind == Value::kInt && (v.i % 2 != 0) == (name == "odd");
    if (a.empty()) fail(line, "test '" + name + "' needs an argument");
    if (name == "equalto" || name == "eq" || name == "==" || name == "sameas") return equal(v, a[0]);
    if (name == "ne" || name == "!=") return !equal(v, a[0]);
    if (name == "in") return contains(a[0], v, line);
    if (name == "divisibleby") return v.kind == Value::kInt && a[0].kind == Value::kInt && a[0].i && v.i % a[0].i == 0;
    if (name == "lt" || name == "gt" || name == "le" || name == "ge") {
      if (!v.number() || !a[0].number()) fail(line, "test '" + name + "' compares numbers");
      const double x = v.as_double(), y = a[0].as_double();
      return name == "lt" ? x < y : name == "gt" ? x > y : name == "le" ? x <= y : x >= y;
    }
    fail(line, "test '" + name + "' is not supported");
  }

  bool test(const Expr& e) {
    const Value v = eval(*e.args[0]);
    Args a;
    for (size_t k = 1; k < e.args.size(); ++k) a.push_back(eval(*e.args[k]));
    return apply_test(e.name, v, a, e.line);
  }

  Value filter(const Expr& e) {
    const Value v = eval(*e.args[0]);
    Args a;
    for (size_t k = 1; k < e.args.size(); ++k) a.push_back(eval(*e.args[k]));
    Kwargs kw;
    for (const auto& [k, x] : e.kwargs) kw.emplace_back(k, eval(*x));
    auto kwarg = [&](const char* k) -> const Value* {
      for (const auto& [n, x] : kw) {
        if (n == k) return &x;
      }
      return nullptr;
    };
    const std::string& f = e.name;
    if (f == "tojson") {
      int64_t indent = -1;
      if (const Value* i = kwarg("indent"); i && i->kind == Value::kInt) indent = i->i;
      if (!a.empty() && a[0].kind == Value::kInt) indent = a[0].i;
      check_string(static_cast<size_t>(std::max<int64_t>(indent, 0)));
      std::string out;
      dump_json(v, static_cast<int>(indent), 0, out);
      return built(std::move(out));
    }
    if (f == "trim") return Value::str(strip_chars(to_str(v), a.empty() ? "" : to_str(a[0]), true, true));
    if (f == "length" || f == "count") {
      if (v.kind == Value::kStr) {
        int64_t n = 0;
        for (unsigned char c : v.s) n += (c & 0xC0) != 0x80;
        return Value::integer(n);
      }
      if (v.kind == Value::kList) return Value::integer(v.list->size());
      if (v.kind == Value::kDict) return Value::integer(v.dict->items.size());
      if (v.kind == Value::kUndefined) return Value::integer(0);
      fail(e.line, std::string("length of ") + kind_name(v));
    }
    if (f == "string") return built(to_str(v));
    if (f == "list") return Value::of_list(iterate(v, e.line));
    if (f == "first" || f == "last") {
      const List l = iterate(v, e.line);
      if (l.empty()) return Value();
      return f == "first" ? l.front() : l.back();
    }
    if (f == "join") {
      const std::string sep = a.empty() ? "" : to_str(a[0]);
      std::string out;
      const List l = iterate(v, e.line);
      for (size_t k = 0; k < l.size(); ++k) {
        out += (k ? sep : "") + to_str(l[k]);
        check_string(out.size());
      }
      return built(std::move(out));
    }
    if (f == "items") {
      if (v.kind != Value::kDict) fail(e.line, "items of " + std::string(kind_name(v)));
      return (*attribute(v, "items", e.line).fn)({}, {});
    }
    if (f == "upper" || f == "lower" || f == "capitalize" || f == "title") return Value::str(change_case(to_str(v), f));
    if (f == "default" || f == "d") {
      const bool boolean = a.size() > 1 && truthy(a[1]);
      if (v.kind == Value::kUndefined || (boolean && !truthy(v))) return a.empty() ? Value::str("") : a[0];
      return v;
    }
    if (f == "replace") {
      return (*string_method(to_str(v), "replace", e.line).fn)(a, {});
    }
    if (f == "int")
      return Value::integer(v.kind == Value::kStr ? std::strtoll(v.s.c_str(), nullptr, 10) : int64_t(v.as_double()));
    if (f == "float") return Value::real(v.kind == Value::kStr ? std::strtod(v.s.c_str(), nullptr) : v.as_double());
    if (f == "abs")
      return v.kind == Value::kInt ? Value::integer(std::llabs(v.i)) : Value::real(std::fabs(v.as_double()));
    if (f == "reverse") {
      if (v.kind == Value::kStr) return Value::str(std::string(v.s.rbegin(), v.s.rend()));
      List l = iterate(v, e.line);
      std::reverse(l.begin(), l.end());
      return Value::of_list(std::move(l));
    }
    if (f == "select" || f == "reject" || f == "selectattr" || f == "rejectattr") {
      const bool by_attr = f == "selectattr" || f == "rejectattr", keep_when = f == "select" || f == "selectattr";
      List out;
      for (const auto& x : iterate(v, e.line)) {
        const Value subject = by_attr ? (a.empty() ? Value() : attribute(x, to_str(a[0]), e.line)) : x;
        const size_t t0 = by_attr ? 1 : 0;
        bool ok;
        if (a.size() <= t0) {
          ok = truthy(subject);
        } else {
          Args targs(a.begin() + t0 + 1, a.end());
          ok = apply_test(to_str(a[t0]), subject, targs, e.line);
        }
        if (ok == keep_when) out.push_back(x);
      }
      return Value::of_list(std::move(out));
    }
    if (f == "map") {
      List out;
      const Value* attr = kwarg("attribute");
      for (const auto& x : iterate(v, e.line)) {
        if (attr)
          out.push_back(attribute(x, to_str(*attr), e.line));
        else if (!a.empty()) {
          Expr fe;
          fe.kind = Expr::kFilter;
          fe.name = to_str(a[0]);
          fe.line = e.line;
          auto lit = make(Expr::kLit, e.line);
          lit->lit = x;
          fe.args.push_back(lit);
          out.push_back(filter(fe));
        }
      }
      return Value::of_list(std::move(out));
    }
    if (f == "unique") {
      List out;
      for (const auto& x : iterate(v, e.line)) {  // equal() charges each comparison
        if (std::none_of(out.begin(), out.end(), [&](const Value& y) { return equal(x, y); })) out.push_back(x);
      }
      return Value::of_list(std::move(out));
    }
    if (f == "indent") {
      const int64_t width = a.empty() ? 4 : std::max<int64_t>(a[0].i, 0);
      check_string(static_cast<size_t>(width));
      const std::string pad(static_cast<size_t>(width), ' ');
      std::string s = to_str(v), out;
      for (size_t i = 0; i < s.size(); ++i) {
        out += s[i];
        if (s[i] == '\n' && i + 1 < s.size() && s[i + 1] != '\n') {
          out += pad;
          check_string(out.size());
        }
      }
      return built(std::move(out));
    }
    fail(e.line, "filter '" + f + "' is not supported");
  }
};

}  // namespace

Template::Template(const std::string& source, const Options& options) : limits_(options.limits) {
  StmtParser p(split_tags(source, options), limits_.max_nesting);
  const std::string end = p.parse(body_, {"endif", "endfor", "endmacro", "elif", "else"});
  if (!end.empty()) throw TemplateError("template: unexpected '" + end + "' with no open block");
}

Template::~Template() = default;

std::string Template::render(const nlohmann::ordered_json& context) const {
  Budget budget{limits_};
  struct Install {  // this render's budget on this thread, the caller's back after
    Budget* saved = tl_budget;
    explicit Install(Budget* b) { tl_budget = b; }
    ~Install() { tl_budget = saved; }
  } install(&budget);
  std::string out;
  try {
    Renderer r(context);
    r.run(body_, out);
  } catch (const LoopBreak&) {
    throw TemplateError("template: break outside a loop");
  } catch (const LoopContinue&) {
    throw TemplateError("template: continue outside a loop");
  } catch (const LineLess& e) {
    throw TemplateError("template: " + e.why);
  } catch (const std::length_error& e) {  // a size the checks above let through: an error, never an abort
    throw TemplateError(std::string("template: ") + e.what());
  } catch (const std::bad_alloc&) {
    throw TemplateError("template: out of memory");
  }
  return out;
}

}  // namespace rlt::jinja
