// Chat templates (see qkv/text/chat_template.hpp): a small Jinja — a lexer for the template's text and tags with
// Hugging Face's whitespace rules (trim_blocks, lstrip_blocks, the '-' markers), a recursive-descent parser with
// Jinja's precedence (conditional < or < and < not < comparisons and `in` < + - < ~ < * / % < unary < postfix, filters
// and `is` tests), and a tree-walking renderer over JSON-like values with Jinja's scoping (a {% for %} body's
// {% set %} stays inside it; namespace() objects are shared).
#include "qkv/text/chat_template.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ctime>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "qkv/core/error.hpp"

namespace qkv::text {

namespace {

constexpr int64_t kMaxSteps = 20'000'000;      // evaluations per render
constexpr size_t kMaxOutput = size_t{16} << 20;  // bytes per render

[[noreturn]] void fail(int line, const std::string& what) {
  throw ValueError("chat template, line " + std::to_string(line) + ": " + what);
}

// ---- values ----

struct Value;
using List = std::vector<Value>;
using Map = std::vector<std::pair<std::string, Value>>;

struct Value {
  enum class Type { Undefined, None, Bool, Int, Float, String, List, Map } type = Type::Undefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::shared_ptr<List> list;
  std::shared_ptr<Map> map;

  static Value none() { Value v; v.type = Type::None; return v; }
  static Value boolean(bool x) { Value v; v.type = Type::Bool; v.b = x; return v; }
  static Value integer(int64_t x) { Value v; v.type = Type::Int; v.i = x; return v; }
  static Value number(double x) { Value v; v.type = Type::Float; v.f = x; return v; }
  static Value string(std::string x) { Value v; v.type = Type::String; v.s = std::move(x); return v; }
  static Value of_list(List l) { Value v; v.type = Type::List; v.list = std::make_shared<List>(std::move(l)); return v; }
  static Value of_map(Map m) { Value v; v.type = Type::Map; v.map = std::make_shared<Map>(std::move(m)); return v; }

  bool truthy() const {
    switch (type) {
      case Type::Undefined: case Type::None: return false;
      case Type::Bool: return b;
      case Type::Int: return i != 0;
      case Type::Float: return f != 0;
      case Type::String: return !s.empty();
      case Type::List: return !list->empty();
      case Type::Map: return !map->empty();
    }
    return false;
  }
  const Value* find(const std::string& key) const {
    if (type != Type::Map) return nullptr;
    for (const auto& [k, v] : *map)
      if (k == key) return &v;
    return nullptr;
  }
  void put(const std::string& key, Value v) {
    for (auto& [k, old] : *map)
      if (k == key) {
        old = std::move(v);
        return;
      }
    map->emplace_back(key, std::move(v));
  }
};

// s with every ASCII letter upper- or lower-cased (the upper/lower filters and string methods).
std::string ascii_case(std::string s, bool upper) {
  for (char& c : s) c = static_cast<char>(upper ? std::toupper(static_cast<unsigned char>(c)) : std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

std::string number_text(double f) {
  if (std::isfinite(f) && f == std::trunc(f) && std::fabs(f) < 1e15) {
    std::ostringstream s;
    s << static_cast<int64_t>(f) << ".0";
    return s.str();
  }
  std::ostringstream s;
  s.precision(17);
  s << f;
  return s.str();
}

// tojson: Python's json.dumps(x, ensure_ascii=False) separators.
std::string to_json(const Value& v) {
  switch (v.type) {
    case Value::Type::Undefined: case Value::Type::None: return "null";
    case Value::Type::Bool: return v.b ? "true" : "false";
    case Value::Type::Int: return std::to_string(v.i);
    case Value::Type::Float: return number_text(v.f);
    case Value::Type::String: return json_string(v.s);
    case Value::Type::List: {
      std::string out = "[";
      for (size_t k = 0; k < v.list->size(); ++k) out += (k ? ", " : "") + to_json((*v.list)[k]);
      return out + "]";
    }
    case Value::Type::Map: {
      std::string out = "{";
      for (size_t k = 0; k < v.map->size(); ++k) out += (k ? ", " : "") + json_string((*v.map)[k].first) + ": " + to_json((*v.map)[k].second);
      return out + "}";
    }
  }
  return "null";
}

// What {{ x }} prints: Python's str() of the value.
std::string to_text(const Value& v) {
  switch (v.type) {
    case Value::Type::Undefined: return "";
    case Value::Type::None: return "None";
    case Value::Type::Bool: return v.b ? "True" : "False";
    case Value::Type::Int: return std::to_string(v.i);
    case Value::Type::Float: return number_text(v.f);
    case Value::Type::String: return v.s;
    default: return to_json(v);
  }
}

bool equal(const Value& a, const Value& b) {
  using T = Value::Type;
  const bool a_num = a.type == T::Int || a.type == T::Float || a.type == T::Bool;
  const bool b_num = b.type == T::Int || b.type == T::Float || b.type == T::Bool;
  if (a_num && b_num) {
    auto n = [](const Value& v) { return v.type == T::Float ? v.f : v.type == T::Bool ? (v.b ? 1.0 : 0.0) : static_cast<double>(v.i); };
    return n(a) == n(b);
  }
  if (a.type != b.type) return (a.type == T::None || a.type == T::Undefined) && (b.type == T::None || b.type == T::Undefined);
  switch (a.type) {
    case T::String: return a.s == b.s;
    case T::List:
      if (a.list->size() != b.list->size()) return false;
      for (size_t k = 0; k < a.list->size(); ++k)
        if (!equal((*a.list)[k], (*b.list)[k])) return false;
      return true;
    case T::Map: return to_json(a) == to_json(b);
    default: return true;
  }
}

// ---- expressions ----

struct Expr {
  enum class Kind { Literal, Name, Attr, Index, Slice, Call, Filter, Test, Not, Neg, Binary, Cond, ListLit, DictLit } kind;
  int line = 0;
  Value literal;
  std::string name;  // Name, Attr, Filter, Test, Binary's operator
  bool negated = false;
  std::vector<std::shared_ptr<Expr>> args;  // operands, then call/filter arguments
  std::vector<std::pair<std::string, std::shared_ptr<Expr>>> kwargs;
};
using ExprPtr = std::shared_ptr<Expr>;

struct Token {
  enum class Type { Name, String, Int, Float, Op, End } type = Type::End;
  std::string text;
  int64_t i = 0;
  double f = 0;
};

std::vector<Token> lex_expression(std::string_view s, int line) {
  std::vector<Token> out;
  size_t k = 0;
  while (k < s.size()) {
    const char c = s[k];
    if (std::isspace(static_cast<unsigned char>(c))) {
      ++k;
      continue;
    }
    Token t;
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t e = k;
      while (e < s.size() && (std::isalnum(static_cast<unsigned char>(s[e])) || s[e] == '_')) ++e;
      t.type = Token::Type::Name;
      t.text = std::string(s.substr(k, e - k));
      k = e;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t e = k;
      while (e < s.size() && std::isdigit(static_cast<unsigned char>(s[e]))) ++e;
      if (e + 1 < s.size() && s[e] == '.' && std::isdigit(static_cast<unsigned char>(s[e + 1]))) {
        ++e;
        while (e < s.size() && std::isdigit(static_cast<unsigned char>(s[e]))) ++e;
        t.type = Token::Type::Float;
        t.f = std::stod(std::string(s.substr(k, e - k)));
      } else {
        t.type = Token::Type::Int;
        const std::string digits(s.substr(k, e - k));
        if (digits.size() > 18) fail(line, "the number " + digits + " is too large");
        t.i = std::stoll(digits);
      }
      k = e;
    } else if (c == '\'' || c == '"') {
      std::string value;
      size_t e = k + 1;
      for (; e < s.size() && s[e] != c; ++e) {
        if (s[e] == '\\' && e + 1 < s.size()) {
          const char n = s[++e];
          value += n == 'n' ? '\n' : n == 't' ? '\t' : n == 'r' ? '\r' : n;
        } else {
          value += s[e];
        }
      }
      if (e >= s.size()) fail(line, "a string is not closed");
      t.type = Token::Type::String;
      t.text = std::move(value);
      k = e + 1;
    } else {
      static const char* two[] = {"==", "!=", "<=", ">=", "//", "**"};
      t.type = Token::Type::Op;
      t.text = std::string(1, c);
      for (const char* op : two)
        if (s.substr(k, 2) == op) t.text = op;
      if (std::string("+-*/%~()[]{},.:|=<>!").find(c) == std::string::npos) fail(line, std::string("unexpected character '") + c + "'");
      k += t.text.size();
    }
    out.push_back(std::move(t));
  }
  out.push_back({});
  return out;
}

class Parser {
 public:
  Parser(std::vector<Token> tokens, int line) : t_(std::move(tokens)), line_(line) {}
  const Token& peek(size_t ahead = 0) const { return t_[std::min(at_ + ahead, t_.size() - 1)]; }
  bool is_op(const char* op, size_t ahead = 0) const { return peek(ahead).type == Token::Type::Op && peek(ahead).text == op; }
  bool is_name(const char* name, size_t ahead = 0) const { return peek(ahead).type == Token::Type::Name && peek(ahead).text == name; }
  bool done() const { return peek().type == Token::Type::End; }
  Token take() { return t_[at_ < t_.size() - 1 ? at_++ : at_]; }
  void expect_op(const char* op) {
    if (!is_op(op)) fail(line_, std::string("expected '") + op + "', found '" + peek().text + "'");
    take();
  }
  std::string expect_name() {
    if (peek().type != Token::Type::Name) fail(line_, "expected a name, found '" + peek().text + "'");
    return take().text;
  }
  void expect_end() {
    if (!done()) fail(line_, "unexpected '" + peek().text + "'");
  }

  ExprPtr expression() {  // a if cond else b
    ExprPtr value = or_expr();
    if (is_name("if")) {
      take();
      ExprPtr cond = or_expr();
      ExprPtr otherwise;
      if (is_name("else")) {
        take();
        otherwise = expression();
      } else {
        otherwise = make(Expr::Kind::Literal);
      }
      ExprPtr e = make(Expr::Kind::Cond);
      e->args = {cond, value, otherwise};
      return e;
    }
    return value;
  }

 private:
  ExprPtr make(Expr::Kind kind) {
    auto e = std::make_shared<Expr>();
    e->kind = kind;
    e->line = line_;
    return e;
  }
  ExprPtr binary(const std::string& op, ExprPtr a, ExprPtr b) {
    ExprPtr e = make(Expr::Kind::Binary);
    e->name = op;
    e->args = {std::move(a), std::move(b)};
    return e;
  }
  ExprPtr or_expr() {
    ExprPtr e = and_expr();
    while (is_name("or")) take(), e = binary("or", e, and_expr());
    return e;
  }
  ExprPtr and_expr() {
    ExprPtr e = not_expr();
    while (is_name("and")) take(), e = binary("and", e, not_expr());
    return e;
  }
  ExprPtr not_expr() {
    if (is_name("not")) {
      take();
      ExprPtr e = make(Expr::Kind::Not);
      e->args = {not_expr()};
      return e;
    }
    return compare();
  }
  ExprPtr compare() {
    ExprPtr e = add();
    for (;;) {
      if (is_op("==") || is_op("!=") || is_op("<") || is_op(">") || is_op("<=") || is_op(">=")) {
        const std::string op = take().text;
        e = binary(op, e, add());
      } else if (is_name("in")) {
        take();
        e = binary("in", e, add());
      } else if (is_name("not") && is_name("in", 1)) {
        take(), take();
        e = binary("not in", e, add());
      } else {
        return e;
      }
    }
  }
  ExprPtr add() {
    ExprPtr e = concat();
    while (is_op("+") || is_op("-")) {
      const std::string op = take().text;
      e = binary(op, e, concat());
    }
    return e;
  }
  ExprPtr concat() {
    ExprPtr e = multiply();
    while (is_op("~")) take(), e = binary("~", e, multiply());
    return e;
  }
  ExprPtr multiply() {
    ExprPtr e = unary();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const std::string op = take().text;
      e = binary(op, e, unary());
    }
    return e;
  }
  ExprPtr unary() {
    if (is_op("-")) {
      take();
      ExprPtr e = make(Expr::Kind::Neg);
      e->args = {unary()};
      return e;
    }
    if (is_op("+")) take();
    return filtered(postfix(primary()));
  }
  // a | f(args) | g ... and a is [not] test(args)
  ExprPtr filtered(ExprPtr e) {
    for (;;) {
      if (is_op("|")) {
        take();
        ExprPtr f = make(Expr::Kind::Filter);
        f->name = expect_name();
        f->args = {e};
        if (is_op("(")) call_arguments(*f);
        e = postfix(f);
      } else if (is_name("is")) {
        take();
        ExprPtr t = make(Expr::Kind::Test);
        if (is_name("not")) take(), t->negated = true;
        t->name = peek().type == Token::Type::Name ? take().text : fail_name();
        t->args = {e};
        if (is_op("(")) call_arguments(*t);
        e = t;
      } else {
        return e;
      }
    }
  }
  [[noreturn]] std::string fail_name() { fail(line_, "expected a test name after 'is'"); }
  void call_arguments(Expr& call) {
    expect_op("(");
    while (!is_op(")")) {
      if (peek().type == Token::Type::Name && is_op("=", 1)) {
        const std::string key = take().text;
        take();
        call.kwargs.emplace_back(key, expression());
      } else {
        call.args.push_back(expression());
      }
      if (!is_op(",")) break;
      take();
    }
    expect_op(")");
  }
  ExprPtr postfix(ExprPtr e) {
    for (;;) {
      if (is_op(".")) {
        take();
        ExprPtr a = make(Expr::Kind::Attr);
        a->name = expect_name();
        a->args = {e};
        e = a;
      } else if (is_op("[")) {
        take();
        ExprPtr parts[3];
        int colons = 0;
        while (!is_op("]")) {
          if (is_op(":")) {
            take();
            if (++colons > 2) fail(line_, "a slice has at most two ':'");
            continue;
          }
          if (parts[colons]) fail(line_, "expected ']' or ':'");
          parts[colons] = expression();
        }
        expect_op("]");
        ExprPtr x = make(colons ? Expr::Kind::Slice : Expr::Kind::Index);
        x->args = {e, parts[0], parts[1], parts[2]};
        if (!colons && !parts[0]) fail(line_, "an empty subscript []");
        e = x;
      } else if (is_op("(")) {
        ExprPtr c = make(Expr::Kind::Call);
        c->args = {e};
        call_arguments(*c);
        e = c;
      } else {
        return e;
      }
    }
  }
  ExprPtr primary() {
    const Token t = take();
    ExprPtr e = make(Expr::Kind::Literal);
    switch (t.type) {
      case Token::Type::String: {
        e->literal = Value::string(t.text);
        while (peek().type == Token::Type::String) e->literal.s += take().text;  // 'a' 'b' is 'ab'
        return e;
      }
      case Token::Type::Int: e->literal = Value::integer(t.i); return e;
      case Token::Type::Float: e->literal = Value::number(t.f); return e;
      case Token::Type::Name:
        if (t.text == "true" || t.text == "True") e->literal = Value::boolean(true);
        else if (t.text == "false" || t.text == "False") e->literal = Value::boolean(false);
        else if (t.text == "none" || t.text == "None") e->literal = Value::none();
        else {
          e->kind = Expr::Kind::Name;
          e->name = t.text;
        }
        return e;
      case Token::Type::Op:
        if (t.text == "(") {
          ExprPtr inner = expression();
          if (is_op(",")) {  // a tuple: a list here
            ExprPtr l = make(Expr::Kind::ListLit);
            l->args = {inner};
            while (is_op(",")) {
              take();
              if (is_op(")")) break;
              l->args.push_back(expression());
            }
            inner = l;
          }
          expect_op(")");
          return inner;
        }
        if (t.text == "[") {
          e->kind = Expr::Kind::ListLit;
          while (!is_op("]")) {
            e->args.push_back(expression());
            if (!is_op(",")) break;
            take();
          }
          expect_op("]");
          return e;
        }
        if (t.text == "{") {
          e->kind = Expr::Kind::DictLit;
          while (!is_op("}")) {
            e->args.push_back(expression());
            expect_op(":");
            e->args.push_back(expression());
            if (!is_op(",")) break;
            take();
          }
          expect_op("}");
          return e;
        }
        break;
      case Token::Type::End: fail(line_, "the expression ends early");
    }
    fail(line_, "unexpected '" + t.text + "'");
  }

  std::vector<Token> t_;
  size_t at_ = 0;
  int line_;
};

// ---- statements ----

}  // namespace

struct ChatTemplate::Node {
  enum class Kind { Block, Text, Output, If, For, Set, Macro } kind = Kind::Block;
  int line = 0;
  std::string text;                                   // Text; Macro's name
  std::vector<std::pair<ExprPtr, std::vector<std::shared_ptr<Node>>>> branches;  // If: (cond or null for else, body)
  ExprPtr expr;                                       // Output, For's iterable, Set's value
  std::vector<std::string> names;                     // For's loop variables; Set's target (name or ns, attr); Macro's parameters
  std::vector<ExprPtr> defaults;                      // Macro: each parameter's default (null: none)
  std::vector<std::shared_ptr<Node>> body, otherwise;  // Block/For/Macro body; For's else
};

namespace {

using Node = ChatTemplate::Node;
using NodePtr = std::shared_ptr<Node>;

struct Segment {
  enum class Kind { Text, Expr, Stmt, Comment } kind;
  std::string text;
  int line = 1;
  bool strip_before = false, strip_after = false;
};

int count_lines(std::string_view s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }

std::vector<Segment> segments(std::string_view src) {
  std::vector<Segment> out;
  size_t k = 0;
  int line = 1;
  while (k < src.size()) {
    size_t open = std::string_view::npos;
    for (size_t p = src.find('{', k); p != std::string_view::npos && p + 1 < src.size(); p = src.find('{', p + 1))
      if (src[p + 1] == '{' || src[p + 1] == '%' || src[p + 1] == '#') {
        open = p;
        break;
      }
    if (open == std::string_view::npos) {
      out.push_back({Segment::Kind::Text, std::string(src.substr(k)), line});
      break;
    }
    if (open > k) {
      out.push_back({Segment::Kind::Text, std::string(src.substr(k, open - k)), line});
      line += count_lines(src.substr(k, open - k));
    }
    const char type = src[open + 1];
    Segment seg{type == '{' ? Segment::Kind::Expr : type == '%' ? Segment::Kind::Stmt : Segment::Kind::Comment, "", line};
    size_t body = open + 2;
    if (body < src.size() && src[body] == '-') seg.strip_before = true, ++body;
    else if (body < src.size() && src[body] == '+') ++body;
    const char close = type == '{' ? '}' : type == '%' ? '%' : '#';
    size_t end = body;
    char quote = 0;
    for (; end + 1 < src.size(); ++end) {
      const char c = src[end];
      if (seg.kind != Segment::Kind::Comment) {
        if (quote) {
          if (c == '\\') ++end;
          else if (c == quote) quote = 0;
          continue;
        }
        if (c == '\'' || c == '"') {
          quote = c;
          continue;
        }
      }
      if (c == close && src[end + 1] == '}') break;
    }
    if (end + 1 >= src.size()) fail(line, std::string("a '{") + type + "' is never closed");
    size_t content_end = end;
    if (content_end > body && src[content_end - 1] == '-') seg.strip_after = true, --content_end;
    seg.text = std::string(src.substr(body, content_end - body));
    line += count_lines(src.substr(open, end + 2 - open));
    out.push_back(std::move(seg));
    k = end + 2;
  }
  // Whitespace: '-' markers strip all whitespace on their side; block and comment tags also take trim_blocks (the
  // newline after the tag) and lstrip_blocks (spaces and tabs from the line's start to the tag), as transformers sets.
  for (size_t s = 0; s < out.size(); ++s) {
    Segment& seg = out[s];
    if (seg.kind == Segment::Kind::Text) continue;
    const bool block = seg.kind != Segment::Kind::Expr;
    if (s > 0 && out[s - 1].kind == Segment::Kind::Text) {
      std::string& prev = out[s - 1].text;
      if (seg.strip_before) {
        prev.erase(prev.find_last_not_of(" \t\r\n") == std::string::npos ? 0 : prev.find_last_not_of(" \t\r\n") + 1);
      } else if (block) {
        const size_t nl = prev.find_last_of('\n');
        const size_t start = nl == std::string::npos ? 0 : nl + 1;
        if (prev.find_first_not_of(" \t", start) == std::string::npos && (nl != std::string::npos || s == 1))
          prev.erase(start);
      }
    }
    if (s + 1 < out.size() && out[s + 1].kind == Segment::Kind::Text) {
      std::string& next = out[s + 1].text;
      if (seg.strip_after) {
        const size_t first = next.find_first_not_of(" \t\r\n");
        next.erase(0, first == std::string::npos ? next.size() : first);
      } else if (block) {
        if (next.rfind("\r\n", 0) == 0) next.erase(0, 2);
        else if (!next.empty() && next[0] == '\n') next.erase(0, 1);
      }
    }
  }
  return out;
}

class TreeBuilder {
 public:
  explicit TreeBuilder(std::vector<Segment> segs) : segs_(std::move(segs)) {}
  NodePtr build() {
    auto root = std::make_shared<Node>();
    std::string end;
    root->body = block({}, &end);
    if (!end.empty()) fail(segs_[at_ - 1].line, "'{% " + end + " %}' without its opening tag");
    return root;
  }

 private:
  // Nodes until one of `stops` (a block keyword); its keyword goes to *stop and its parser is left in parser_.
  std::vector<NodePtr> block(const std::vector<std::string>& stops, std::string* stop) {
    std::vector<NodePtr> nodes;
    while (at_ < segs_.size()) {
      const Segment& seg = segs_[at_++];
      if (seg.kind == Segment::Kind::Comment) continue;
      if (seg.kind == Segment::Kind::Text) {
        if (seg.text.empty()) continue;
        auto n = std::make_shared<Node>();
        n->kind = Node::Kind::Text;
        n->text = seg.text;
        nodes.push_back(n);
        continue;
      }
      Parser p(lex_expression(seg.text, seg.line), seg.line);
      if (seg.kind == Segment::Kind::Expr) {
        auto n = std::make_shared<Node>();
        n->kind = Node::Kind::Output;
        n->line = seg.line;
        n->expr = p.expression();
        p.expect_end();
        nodes.push_back(n);
        continue;
      }
      const std::string keyword = p.expect_name();
      if (std::find(stops.begin(), stops.end(), keyword) != stops.end()) {
        *stop = keyword;
        parser_ = std::make_unique<Parser>(std::move(p));
        line_ = seg.line;
        return nodes;
      }
      if (keyword == "if") {
        auto n = std::make_shared<Node>();
        n->kind = Node::Kind::If;
        n->line = seg.line;
        ExprPtr cond = p.expression();
        p.expect_end();
        for (;;) {
          std::string end;
          auto body = block({"elif", "else", "endif"}, &end);
          if (end.empty()) fail(seg.line, "'{% if %}' without '{% endif %}'");
          n->branches.emplace_back(cond, std::move(body));
          if (end == "endif") break;
          if (end == "else") {
            parser_->expect_end();
            cond = nullptr;
            auto rest = block({"endif"}, &end);
            if (end.empty()) fail(seg.line, "'{% if %}' without '{% endif %}'");
            n->branches.emplace_back(nullptr, std::move(rest));
            break;
          }
          cond = parser_->expression();
          parser_->expect_end();
        }
        nodes.push_back(n);
      } else if (keyword == "for") {
        auto n = std::make_shared<Node>();
        n->kind = Node::Kind::For;
        n->line = seg.line;
        n->names.push_back(p.expect_name());
        while (p.is_op(",")) p.take(), n->names.push_back(p.expect_name());
        if (!p.is_name("in")) fail(seg.line, "expected 'in' in '{% for %}'");
        p.take();
        n->expr = p.expression();
        if (p.is_name("if")) fail(seg.line, "'{% for … if … %}' filters are not supported; use an {% if %} inside");
        p.expect_end();
        std::string end;
        n->body = block({"else", "endfor"}, &end);
        if (end.empty()) fail(seg.line, "'{% for %}' without '{% endfor %}'");
        if (end == "else") {
          n->otherwise = block({"endfor"}, &end);
          if (end.empty()) fail(seg.line, "'{% for %}' without '{% endfor %}'");
        }
        nodes.push_back(n);
      } else if (keyword == "set") {
        auto n = std::make_shared<Node>();
        n->kind = Node::Kind::Set;
        n->line = seg.line;
        n->names.push_back(p.expect_name());
        if (p.is_op(".")) p.take(), n->names.push_back(p.expect_name());
        if (!p.is_op("=")) fail(seg.line, "'{% set x %}…{% endset %}' blocks are not supported; use {% set x = … %}");
        p.take();
        n->expr = p.expression();
        p.expect_end();
        nodes.push_back(n);
      } else if (keyword == "macro") {  // {% macro name(a, b=default) %}…{% endmacro %}: called as a function
        auto n = std::make_shared<Node>();
        n->kind = Node::Kind::Macro;
        n->line = seg.line;
        n->text = p.expect_name();
        p.expect_op("(");
        while (!p.is_op(")")) {
          n->names.push_back(p.expect_name());
          ExprPtr fallback;
          if (p.is_op("=")) p.take(), fallback = p.expression();
          n->defaults.push_back(fallback);
          if (!p.is_op(",")) break;
          p.take();
        }
        p.expect_op(")");
        p.expect_end();
        std::string end;
        n->body = block({"endmacro"}, &end);
        if (end.empty()) fail(seg.line, "'{% macro %}' without '{% endmacro %}'");
        nodes.push_back(n);
      } else if (keyword == "generation" || keyword == "endgeneration") {
        // transformers' marker for assistant masks: no output of its own
      } else {
        fail(seg.line, "'{% " + keyword + " %}' is not supported here (qkv renders if, for, set, macro)");
      }
    }
    return nodes;
  }
  std::vector<Segment> segs_;
  size_t at_ = 0;
  std::unique_ptr<Parser> parser_;
  int line_ = 0;
};

// ---- rendering ----

class Renderer {
 public:
  explicit Renderer(Map globals) { scopes_.push_back(std::move(globals)); }
  void run(const std::vector<NodePtr>& nodes) {
    for (const NodePtr& n : nodes) node(*n);
  }
  std::string out;

 private:
  void step(int line) {
    if (++steps_ > kMaxSteps) fail(line, "rendering takes more than " + std::to_string(kMaxSteps) + " steps; the template loops too long");
    if (out.size() > kMaxOutput) fail(line, "the output passed " + std::to_string(kMaxOutput >> 20) + " MiB");
  }
  Value lookup(const std::string& name) const {
    for (auto s = scopes_.rbegin(); s != scopes_.rend(); ++s)
      for (const auto& [k, v] : *s)
        if (k == name) return v;
    return {};
  }
  void assign(const std::string& name, Value v) {
    for (auto& [k, old] : scopes_.back())
      if (k == name) {
        old = std::move(v);
        return;
      }
    scopes_.back().emplace_back(name, std::move(v));
  }
  void node(const Node& n) {
    step(n.line);
    switch (n.kind) {
      case Node::Kind::Block: run(n.body); break;
      case Node::Kind::Text: out += n.text; break;
      case Node::Kind::Output: out += to_text(eval(*n.expr)); break;
      case Node::Kind::If:
        for (const auto& [cond, body] : n.branches)
          if (!cond || eval(*cond).truthy()) {
            run(body);
            break;
          }
        break;
      case Node::Kind::Macro: macros_[n.text] = &n; break;  // defined where it stands, as in Jinja
      case Node::Kind::Set: {
        Value v = eval(*n.expr);
        if (n.names.size() == 1) {
          assign(n.names[0], std::move(v));
        } else {
          Value target = lookup(n.names[0]);
          if (target.type != Value::Type::Map) fail(n.line, "'" + n.names[0] + "' is not a namespace; make it with namespace()");
          target.put(n.names[1], std::move(v));
        }
        break;
      }
      case Node::Kind::For: {
        const Value seq = eval(*n.expr);
        List items;
        if (seq.type == Value::Type::List) items = *seq.list;
        else if (seq.type == Value::Type::Map) for (const auto& [k, v] : *seq.map) items.push_back(Value::string(k));
        else if (seq.type == Value::Type::String) for (char c : seq.s) items.push_back(Value::string(std::string(1, c)));
        else if (seq.type != Value::Type::Undefined && seq.type != Value::Type::None) fail(n.line, "cannot loop over " + to_text(seq));
        if (items.empty()) {
          run(n.otherwise);
          break;
        }
        const int64_t count = static_cast<int64_t>(items.size());
        for (int64_t k = 0; k < count; ++k) {
          Map scope;
          const Value& item = items[static_cast<size_t>(k)];
          if (n.names.size() == 1) {
            scope.emplace_back(n.names[0], item);
          } else {
            if (item.type != Value::Type::List || item.list->size() != n.names.size())
              fail(n.line, "cannot unpack " + to_text(item) + " into " + std::to_string(n.names.size()) + " names");
            for (size_t v = 0; v < n.names.size(); ++v) scope.emplace_back(n.names[v], (*item.list)[v]);
          }
          scope.emplace_back("loop", Value::of_map({{"index0", Value::integer(k)}, {"index", Value::integer(k + 1)},
                                                    {"revindex", Value::integer(count - k)}, {"revindex0", Value::integer(count - k - 1)},
                                                    {"first", Value::boolean(k == 0)}, {"last", Value::boolean(k + 1 == count)},
                                                    {"length", Value::integer(count)},
                                                    {"previtem", k > 0 ? items[static_cast<size_t>(k - 1)] : Value{}},
                                                    {"nextitem", k + 1 < count ? items[static_cast<size_t>(k + 1)] : Value{}}}));
          scopes_.push_back(std::move(scope));
          run(n.body);
          scopes_.pop_back();
        }
        break;
      }
    }
  }

  static int64_t as_int(const Value& v, int line, const char* what) {
    if (v.type == Value::Type::Int) return v.i;
    if (v.type == Value::Type::Bool) return v.b;
    if (v.type == Value::Type::Float && v.f == std::trunc(v.f)) return static_cast<int64_t>(v.f);
    fail(line, std::string(what) + " must be a whole number, not " + to_text(v));
  }
  static double as_number(const Value& v) {
    return v.type == Value::Type::Float ? v.f : v.type == Value::Type::Bool ? (v.b ? 1 : 0) : static_cast<double>(v.i);
  }

  Value eval(const Expr& e) {
    step(e.line);
    switch (e.kind) {
      case Expr::Kind::Literal: return e.literal;
      case Expr::Kind::Name: return lookup(e.name);
      case Expr::Kind::Attr: {
        const Value obj = eval(*e.args[0]);
        if (obj.type == Value::Type::Map)
          if (const Value* v = obj.find(e.name)) return *v;
        return {};
      }
      case Expr::Kind::Index: {
        const Value obj = eval(*e.args[0]), key = eval(*e.args[1]);
        if (obj.type == Value::Type::Map) {
          const Value* v = obj.find(to_text(key));
          return v ? *v : Value{};
        }
        if (obj.type == Value::Type::List || obj.type == Value::Type::String) {
          const int64_t size = obj.type == Value::Type::List ? static_cast<int64_t>(obj.list->size()) : static_cast<int64_t>(obj.s.size());
          int64_t k = as_int(key, e.line, "an index");
          if (k < 0) k += size;
          if (k < 0 || k >= size) return {};
          return obj.type == Value::Type::List ? (*obj.list)[static_cast<size_t>(k)] : Value::string(std::string(1, obj.s[static_cast<size_t>(k)]));
        }
        return {};
      }
      case Expr::Kind::Slice: {
        const Value obj = eval(*e.args[0]);
        const int64_t size = obj.type == Value::Type::List ? static_cast<int64_t>(obj.list->size())
                             : obj.type == Value::Type::String ? static_cast<int64_t>(obj.s.size()) : -1;
        if (size < 0) fail(e.line, "cannot slice " + to_text(obj));
        const int64_t stride = e.args[3] ? as_int(eval(*e.args[3]), e.line, "a slice step") : 1;
        if (stride == 0) fail(e.line, "a slice step of 0");
        auto bound = [&](const ExprPtr& x, int64_t fallback) {
          if (!x) return fallback;
          int64_t v = as_int(eval(*x), e.line, "a slice bound");
          if (v < 0) v += size;
          return stride > 0 ? std::clamp<int64_t>(v, 0, size) : std::clamp<int64_t>(v, -1, size - 1);
        };
        const int64_t begin = bound(e.args[1], stride > 0 ? 0 : size - 1), end = bound(e.args[2], stride > 0 ? size : -1);
        List items;
        std::string text;
        for (int64_t k = begin; stride > 0 ? k < end : k > end; k += stride) {
          if (obj.type == Value::Type::List) items.push_back((*obj.list)[static_cast<size_t>(k)]);
          else text += obj.s[static_cast<size_t>(k)];
        }
        return obj.type == Value::Type::List ? Value::of_list(std::move(items)) : Value::string(std::move(text));
      }
      case Expr::Kind::Call: return call(e);
      case Expr::Kind::Filter: return filter(e);
      case Expr::Kind::Test: return Value::boolean(test(e) != e.negated);
      case Expr::Kind::Not: return Value::boolean(!eval(*e.args[0]).truthy());
      case Expr::Kind::Neg: {
        const Value v = eval(*e.args[0]);
        return v.type == Value::Type::Float ? Value::number(-v.f) : Value::integer(-as_int(v, e.line, "'-'"));
      }
      case Expr::Kind::Cond: return eval(*e.args[0]).truthy() ? eval(*e.args[1]) : eval(*e.args[2]);
      case Expr::Kind::ListLit: {
        List items;
        for (const auto& a : e.args) items.push_back(eval(*a));
        return Value::of_list(std::move(items));
      }
      case Expr::Kind::DictLit: {
        Map m;
        for (size_t k = 0; k + 1 < e.args.size(); k += 2) m.emplace_back(to_text(eval(*e.args[k])), eval(*e.args[k + 1]));
        return Value::of_map(std::move(m));
      }
      case Expr::Kind::Binary: return binary(e);
    }
    return {};
  }

  Value binary(const Expr& e) {
    const std::string& op = e.name;
    if (op == "and") {
      Value a = eval(*e.args[0]);
      return a.truthy() ? eval(*e.args[1]) : a;
    }
    if (op == "or") {
      Value a = eval(*e.args[0]);
      return a.truthy() ? a : eval(*e.args[1]);
    }
    const Value a = eval(*e.args[0]), b = eval(*e.args[1]);
    using T = Value::Type;
    if (op == "==") return Value::boolean(equal(a, b));
    if (op == "!=") return Value::boolean(!equal(a, b));
    if (op == "~") return Value::string(to_text(a) + to_text(b));
    if (op == "in" || op == "not in") {
      bool found = false;
      if (b.type == T::String) found = b.s.find(to_text(a)) != std::string::npos;
      else if (b.type == T::List) found = std::any_of(b.list->begin(), b.list->end(), [&](const Value& x) { return equal(a, x); });
      else if (b.type == T::Map) found = b.find(to_text(a)) != nullptr;
      else if (b.type != T::Undefined && b.type != T::None) fail(e.line, "'in' needs a string, list or mapping on its right");
      return Value::boolean(found != (op == "not in"));
    }
    if (op == "+" && a.type == T::String && b.type == T::String) return Value::string(a.s + b.s);
    if (op == "+" && a.type == T::List && b.type == T::List) {
      List l = *a.list;
      l.insert(l.end(), b.list->begin(), b.list->end());
      return Value::of_list(std::move(l));
    }
    if (op == "+" && (a.type == T::String || b.type == T::String))
      fail(e.line, "cannot add " + to_text(a) + " and " + to_text(b) + " (a string and a non-string); use '~'");
    const bool numbers = (a.type == T::Int || a.type == T::Float || a.type == T::Bool) && (b.type == T::Int || b.type == T::Float || b.type == T::Bool);
    if (op == "<" || op == ">" || op == "<=" || op == ">=") {
      int order;
      if (numbers) order = as_number(a) < as_number(b) ? -1 : as_number(a) > as_number(b) ? 1 : 0;
      else if (a.type == T::String && b.type == T::String) order = a.s.compare(b.s) < 0 ? -1 : a.s.compare(b.s) > 0 ? 1 : 0;
      else fail(e.line, "cannot compare " + to_text(a) + " and " + to_text(b));
      return Value::boolean(op == "<" ? order < 0 : op == ">" ? order > 0 : op == "<=" ? order <= 0 : order >= 0);
    }
    if (op == "*" && a.type == T::String && b.type == T::Int) {
      if (b.i > 100000) fail(e.line, "a string repeated " + std::to_string(b.i) + " times");
      std::string s;
      for (int64_t k = 0; k < b.i; ++k) s += a.s;
      return Value::string(std::move(s));
    }
    if (!numbers) fail(e.line, "cannot apply '" + op + "' to " + to_text(a) + " and " + to_text(b));
    if (a.type == T::Float || b.type == T::Float || op == "/") {
      const double x = as_number(a), y = as_number(b);
      if ((op == "/" || op == "//" || op == "%") && y == 0) fail(e.line, "division by zero");
      if (op == "+") return Value::number(x + y);
      if (op == "-") return Value::number(x - y);
      if (op == "*") return Value::number(x * y);
      if (op == "/") return Value::number(x / y);
      if (op == "//") return Value::number(std::floor(x / y));
      return Value::number(x - y * std::floor(x / y));
    }
    const int64_t x = as_int(a, e.line, "an operand"), y = as_int(b, e.line, "an operand");
    int64_t r = 0;
    if (op == "+" && !__builtin_add_overflow(x, y, &r)) return Value::integer(r);
    if (op == "-" && !__builtin_sub_overflow(x, y, &r)) return Value::integer(r);
    if (op == "*" && !__builtin_mul_overflow(x, y, &r)) return Value::integer(r);
    if (op == "//" || op == "%") {
      if (y == 0) fail(e.line, "division by zero");
      if (x == INT64_MIN && y == -1) fail(e.line, "integer overflow");
      const int64_t q = x / y - ((x % y != 0) && ((x < 0) != (y < 0)));  // Python's floor division
      return Value::integer(op == "//" ? q : x - q * y);
    }
    fail(e.line, "integer overflow in '" + op + "'");
  }

  // The functions a template may call: transformers' globals and the macros defined so far
  bool is_function(const Expr& e) const {
    if (e.kind != Expr::Kind::Name) return false;
    const std::string& n = e.name;
    return n == "raise_exception" || n == "namespace" || n == "range" || n == "strftime_now" || macros_.count(n) > 0;
  }

  bool test(const Expr& e) {
    using T = Value::Type;
    const std::string& t = e.name;
    if ((t == "defined" || t == "undefined") && is_function(*e.args[0]) && lookup(e.args[0]->name).type == T::Undefined)
      return t == "defined";
    const Value v = eval(*e.args[0]);
    if (t == "defined") return v.type != T::Undefined;
    if (t == "undefined") return v.type == T::Undefined;
    if (t == "none") return v.type == T::None;
    if (t == "string") return v.type == T::String;
    if (t == "number") return v.type == T::Int || v.type == T::Float;
    if (t == "integer") return v.type == T::Int;
    if (t == "boolean") return v.type == T::Bool;
    if (t == "mapping") return v.type == T::Map;
    if (t == "sequence") return v.type == T::List || v.type == T::String;
    if (t == "iterable") return v.type == T::List || v.type == T::String || v.type == T::Map;
    if (t == "true") return v.type == T::Bool && v.b;
    if (t == "false") return v.type == T::Bool && !v.b;
    if (t == "odd" || t == "even") return (as_int(v, e.line, "odd/even") % 2 != 0) == (t == "odd");
    if (t == "equalto" || t == "eq") return e.args.size() > 1 && equal(v, eval(*e.args[1]));
    fail(e.line, "the test 'is " + t + "' is not supported");
  }

  static std::string strip(const std::string& s, const std::string& chars, bool left, bool right) {
    size_t b = 0, end = s.size();
    if (left) while (b < end && chars.find(s[b]) != std::string::npos) ++b;
    if (right) while (end > b && chars.find(s[end - 1]) != std::string::npos) --end;
    return s.substr(b, end - b);
  }

  Value filter(const Expr& e) {
    const Value v = eval(*e.args[0]);
    const std::string& f = e.name;
    using T = Value::Type;
    auto arg = [&](size_t k) { return k + 1 < e.args.size() ? eval(*e.args[k + 1]) : Value{}; };
    if (f == "trim") return Value::string(strip(to_text(v), " \t\r\n\f\v", true, true));
    if (f == "length" || f == "count") {
      if (v.type == T::List) return Value::integer(static_cast<int64_t>(v.list->size()));
      if (v.type == T::Map) return Value::integer(static_cast<int64_t>(v.map->size()));
      return Value::integer(static_cast<int64_t>(to_text(v).size()));
    }
    if (f == "tojson") return Value::string(to_json(v));
    if (f == "string") return Value::string(to_text(v));
    if (f == "upper" || f == "lower") return Value::string(ascii_case(to_text(v), f == "upper"));
    if (f == "first" || f == "last") {
      if (v.type != T::List || v.list->empty()) return {};
      return f == "first" ? v.list->front() : v.list->back();
    }
    if (f == "join") {
      if (v.type != T::List) return Value::string(to_text(v));
      const std::string sep = e.args.size() > 1 ? to_text(arg(0)) : "";
      std::string s;
      for (size_t k = 0; k < v.list->size(); ++k) s += (k ? sep : "") + to_text((*v.list)[k]);
      return Value::string(s);
    }
    if (f == "default" || f == "d") return v.type == T::Undefined ? arg(0) : v;
    if (f == "items") {
      List l;
      if (v.type == T::Map) for (const auto& [k, x] : *v.map) l.push_back(Value::of_list({Value::string(k), x}));
      return Value::of_list(std::move(l));
    }
    if (f == "list") return v.type == T::List ? v : Value::of_list({});
    if (f == "int") return Value::integer(v.type == T::Float ? static_cast<int64_t>(v.f) : v.type == T::Int ? v.i : 0);
    fail(e.line, "the filter '| " + f + "' is not supported");
  }

  // A macro's body rendered on its own output with its parameters bound (positional, then by name, then defaults) over
  // the template's globals — not the caller's variables, as in Jinja — returned as a string
  Value call_macro(const Node& macro, const Expr& e, std::vector<Value> args) {
    if (args.size() > macro.names.size())
      fail(e.line, "the macro '" + macro.text + "' takes " + std::to_string(macro.names.size()) + " arguments, not " +
                       std::to_string(args.size()));
    if (++depth_ > 200) fail(e.line, "macros call each other more than 200 deep");
    Map scope;
    for (size_t k = 0; k < macro.names.size(); ++k) {
      Value v;
      bool given = k < args.size();
      if (given) v = std::move(args[k]);
      for (const auto& [key, x] : e.kwargs)
        if (key == macro.names[k]) v = eval(*x), given = true;
      if (!given && macro.defaults[k]) v = eval(*macro.defaults[k]);
      scope.emplace_back(macro.names[k], std::move(v));
    }
    for (const auto& [key, x] : e.kwargs)
      if (std::find(macro.names.begin(), macro.names.end(), key) == macro.names.end())
        fail(e.line, "the macro '" + macro.text + "' has no parameter '" + key + "'");
    std::vector<Map> caller = {scopes_.front(), std::move(scope)};
    std::swap(caller, scopes_);
    std::string rendered;
    std::swap(rendered, out);
    try {
      run(macro.body);
    } catch (...) {
      std::swap(caller, scopes_);
      std::swap(rendered, out);
      --depth_;
      throw;
    }
    std::swap(caller, scopes_);
    std::swap(rendered, out);
    --depth_;
    return Value::string(std::move(rendered));
  }

  Value call(const Expr& e) {
    const Expr& callee = *e.args[0];
    std::vector<Value> args;
    for (size_t k = 1; k < e.args.size(); ++k) args.push_back(eval(*e.args[k]));
    if (callee.kind == Expr::Kind::Name) {
      if (callee.name == "raise_exception") throw ValueError("chat template: " + (args.empty() ? std::string("an error") : to_text(args[0])));
      if (callee.name == "namespace") {
        Map m;
        for (const auto& [k, x] : e.kwargs) m.emplace_back(k, eval(*x));
        return Value::of_map(std::move(m));
      }
      if (callee.name == "range") {
        int64_t begin = 0, end = 0, by = 1;
        if (args.size() == 1) end = as_int(args[0], e.line, "range");
        else if (args.size() >= 2) begin = as_int(args[0], e.line, "range"), end = as_int(args[1], e.line, "range");
        if (args.size() == 3) by = as_int(args[2], e.line, "range");
        if (by == 0) fail(e.line, "range() with a step of 0");
        List l;
        for (int64_t k = begin; by > 0 ? k < end : k > end; k += by) {
          if (l.size() > 1'000'000) fail(e.line, "range() of more than a million numbers");
          l.push_back(Value::integer(k));
        }
        return Value::of_list(std::move(l));
      }
      if (const auto m = macros_.find(callee.name); m != macros_.end()) return call_macro(*m->second, e, std::move(args));
      if (callee.name == "strftime_now") {  // transformers': datetime.now().strftime(format), local time
        if (args.empty() || args[0].type != Value::Type::String) fail(e.line, "strftime_now() takes a format string");
        const std::time_t now = std::time(nullptr);
        std::tm local{};
        localtime_r(&now, &local);
        char text[256];
        const size_t n = std::strftime(text, sizeof text, args[0].s.c_str(), &local);
        return Value::string(std::string(text, n));
      }
      fail(e.line, "the function '" + callee.name + "' is not defined");
    }
    if (callee.kind != Expr::Kind::Attr) fail(e.line, "only functions and methods can be called");
    const Value obj = eval(*callee.args[0]);
    const std::string& m = callee.name;
    using T = Value::Type;
    if (obj.type == T::String) {
      const std::string& s = obj.s;
      auto text_arg = [&](size_t k) { return k < args.size() ? to_text(args[k]) : std::string(); };
      if (m == "startswith") return Value::boolean(s.rfind(text_arg(0), 0) == 0);
      if (m == "endswith") {
        const std::string x = text_arg(0);
        return Value::boolean(s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0);
      }
      const std::string space = " \t\r\n\f\v";
      if (m == "strip") return Value::string(strip(s, args.empty() || args[0].type == T::None ? space : text_arg(0), true, true));
      if (m == "lstrip") return Value::string(strip(s, args.empty() || args[0].type == T::None ? space : text_arg(0), true, false));
      if (m == "rstrip") return Value::string(strip(s, args.empty() || args[0].type == T::None ? space : text_arg(0), false, true));
      if (m == "upper" || m == "lower") return Value::string(ascii_case(s, m == "upper"));
      if (m == "replace") {
        std::string r = s, from = text_arg(0), to = text_arg(1);
        if (!from.empty())
          for (size_t at = 0; (at = r.find(from, at)) != std::string::npos; at += to.size()) r.replace(at, from.size(), to);
        return Value::string(r);
      }
      if (m == "split") {
        List parts;
        if (args.empty() || args[0].type == T::None) {
          std::istringstream in(s);
          for (std::string w; in >> w;) parts.push_back(Value::string(w));
        } else {
          const std::string sep = text_arg(0);
          if (sep.empty()) fail(e.line, "split() with an empty separator");
          size_t at = 0;
          for (size_t hit; (hit = s.find(sep, at)) != std::string::npos; at = hit + sep.size()) parts.push_back(Value::string(s.substr(at, hit - at)));
          parts.push_back(Value::string(s.substr(at)));
        }
        return Value::of_list(std::move(parts));
      }
      if (m == "title" || m == "capitalize") {
        std::string r = s;
        bool start = true;
        for (char& c : r) {
          const bool letter = std::isalpha(static_cast<unsigned char>(c));
          c = static_cast<char>(start && letter ? std::toupper(static_cast<unsigned char>(c)) : (m == "capitalize" || !start) ? std::tolower(static_cast<unsigned char>(c)) : c);
          if (m == "title") start = !letter;
          else start = false;
        }
        return Value::string(r);
      }
    }
    if (obj.type == T::Map) {
      if (m == "items") {
        List l;
        for (const auto& [k, x] : *obj.map) l.push_back(Value::of_list({Value::string(k), x}));
        return Value::of_list(std::move(l));
      }
      if (m == "keys" || m == "values") {
        List l;
        for (const auto& [k, x] : *obj.map) l.push_back(m == "keys" ? Value::string(k) : x);
        return Value::of_list(std::move(l));
      }
      if (m == "get") {
        const Value* v = args.empty() ? nullptr : obj.find(to_text(args[0]));
        return v ? *v : args.size() > 1 ? args[1] : Value::none();
      }
    }
    fail(e.line, "the method '." + m + "()' is not supported on " + (obj.type == T::Undefined ? std::string("an undefined value") : to_text(obj)));
  }

  std::vector<Map> scopes_;
  std::map<std::string, const Node*> macros_;  // by name, as {% macro %} defines them
  int depth_ = 0;                               // macro calls in progress
  int64_t steps_ = 0;
};

// A JSON value (a message's extra fields) as a template value, objects keeping their order (tojson prints it).
Value from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::json::value_t::null: return Value::none();
    case nlohmann::json::value_t::boolean: return Value::boolean(j.get<bool>());
    case nlohmann::json::value_t::number_integer: return Value::integer(j.get<int64_t>());
    case nlohmann::json::value_t::number_unsigned:
      return j.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX) ? Value::integer(j.get<int64_t>())
                                                                  : Value::number(j.get<double>());
    case nlohmann::json::value_t::number_float: return Value::number(j.get<double>());
    case nlohmann::json::value_t::string: return Value::string(j.get<std::string>());
    case nlohmann::json::value_t::array: {
      List list;
      for (const auto& v : j) list.push_back(from_json(v));
      return Value::of_list(std::move(list));
    }
    case nlohmann::json::value_t::object: {
      Map map;
      for (const auto& [k, v] : j.items()) map.emplace_back(k, from_json(v));
      return Value::of_map(std::move(map));
    }
    default: return Value();
  }
}

}  // namespace

ChatTemplate::ChatTemplate() = default;
ChatTemplate::~ChatTemplate() = default;
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;

ChatTemplate ChatTemplate::parse(std::string_view source) {
  ChatTemplate t;
  t.root_ = TreeBuilder(segments(source)).build();
  return t;
}

std::string ChatTemplate::render(const std::vector<ChatMessage>& messages, const ChatOptions& options) const {
  if (!root_) throw ValueError("chat template: none loaded; the model's tokenizer_config.json has no chat_template");
  List list;
  for (const ChatMessage& m : messages) {
    Value message = Value::of_map({{"role", Value::string(m.role)}, {"content", Value::string(m.content)}});
    if (!m.fields.empty()) {
      nlohmann::ordered_json fields;
      try {
        fields = nlohmann::ordered_json::parse(m.fields);
      } catch (const nlohmann::json::exception& e) {
        throw ValueError("chat message " + std::to_string(list.size() + 1) + ": its fields are not JSON (" + e.what() + ")");
      }
      if (!fields.is_object())
        throw ValueError("chat message " + std::to_string(list.size() + 1) + ": its fields must be a JSON object");
      for (const auto& [key, value] : fields.items()) message.put(key, from_json(value));
    }
    list.push_back(std::move(message));
  }
  Map globals = {{"messages", Value::of_list(std::move(list))},
                 {"add_generation_prompt", Value::boolean(options.add_generation_prompt)},
                 {"bos_token", Value::string(options.bos_token)},
                 {"eos_token", Value::string(options.eos_token)}};
  if (!options.enable_thinking) globals.emplace_back("enable_thinking", Value::boolean(false));
  Renderer r(std::move(globals));
  r.run(root_->body);
  return r.out;
}

}  // namespace qkv::text
