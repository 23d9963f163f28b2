// Lexer and recursive-descent parser, following Jinja2's grammar and operator precedence
// (or < and < not < comparisons < + - < ~ < * / // % < ** < unary < filters/tests/postfix).
#include <fmt/format.h>

#include <cstdlib>

#include "daemon/tokenizer/jinja/internal.h"

namespace spark::tok::jinja {

namespace {

enum class Tk : uint8_t {
  text,
  var_begin,
  var_end,
  block_begin,
  block_end,
  name,
  str,
  integer,
  floating,
  op,
  eof
};

struct Token {
  Tk t;
  std::string v;
  int line;
};

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}
bool is_name_start(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}
bool is_digit(char c) {
  return c >= '0' && c <= '9';
}

// Python string-literal escapes (unknown ones stay as written, as in Python).
std::string unescape(std::string_view s, int line) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\\' || i + 1 == s.size()) {
      out += s[i];
      continue;
    }
    char c = s[++i];
    switch (c) {
      case 'n':
        out += '\n';
        break;
      case 't':
        out += '\t';
        break;
      case 'r':
        out += '\r';
        break;
      case 'b':
        out += '\b';
        break;
      case 'f':
        out += '\f';
        break;
      case 'v':
        out += '\v';
        break;
      case 'a':
        out += '\a';
        break;
      case '0':
        out += '\0';
        break;
      case '\\':
        out += '\\';
        break;
      case '\'':
        out += '\'';
        break;
      case '"':
        out += '"';
        break;
      case '\n':
        break;
      case 'x':
      case 'u':
      case 'U': {
        size_t n = c == 'x' ? 2 : c == 'u' ? 4 : 8;
        if (i + n >= s.size())
          throw SyntaxError(fmt::format("truncated \\{} escape in a string", c), line);
        std::string hex(s.substr(i + 1, n));
        char* end = nullptr;
        unsigned long cp = std::strtoul(hex.c_str(), &end, 16);
        if (hex.size() != n || *end)
          throw SyntaxError(fmt::format("bad \\{} escape in a string", c), line);
        i += n;
        // UTF-8 encode
        if (cp < 0x80) {
          out += static_cast<char>(cp);
        } else if (cp < 0x800) {
          out += static_cast<char>(0xC0 | (cp >> 6));
          out += static_cast<char>(0x80 | (cp & 0x3F));
        } else if (cp < 0x10000) {
          out += static_cast<char>(0xE0 | (cp >> 12));
          out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
          out += static_cast<char>(0x80 | (cp & 0x3F));
        } else {
          out += static_cast<char>(0xF0 | (cp >> 18));
          out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
          out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
          out += static_cast<char>(0x80 | (cp & 0x3F));
        }
        break;
      }
      default:
        out += '\\';
        out += c;
    }
  }
  return out;
}

// Splits the source into text and tag tokens, applying whitespace control: `-` strips all
// whitespace on that side; lstrip_blocks removes spaces/tabs before a block or comment tag
// that starts a line; trim_blocks removes the newline right after one. One trailing
// newline of the template is dropped (keep_trailing_newline=False).
std::vector<Token> lex(std::string_view src) {
  if (!src.empty() && src.back() == '\n') src.remove_suffix(1);
  std::vector<Token> toks;
  size_t i = 0;
  int line = 1;
  auto count_lines = [&](size_t from, size_t to) {
    for (size_t k = from; k < to; ++k)
      if (src[k] == '\n') ++line;
  };
  // `tag` is where the tag starts in the source.
  auto strip_prev_text = [&](bool all_ws, size_t tag) {
    if (toks.empty() || toks.back().t != Tk::text) return;
    std::string& t = toks.back().v;
    if (all_ws) {
      while (!t.empty() && is_space(t.back())) t.pop_back();
    } else {  // lstrip_blocks: spaces/tabs back to a newline or the template start
      size_t k = tag;
      while (k > 0 && (src[k - 1] == ' ' || src[k - 1] == '\t')) --k;
      if (k == 0 || src[k - 1] == '\n') t.resize(t.size() - std::min(t.size(), tag - k));
    }
  };
  bool strip_next = false, trim_next = false;
  while (i < src.size()) {
    // Text up to the next tag.
    size_t p = i;
    while (p < src.size()) {
      p = src.find('{', p);
      if (p == std::string_view::npos) {
        p = src.size();
        break;
      }
      if (p + 1 < src.size() && (src[p + 1] == '{' || src[p + 1] == '%' || src[p + 1] == '#'))
        break;
      ++p;
    }
    std::string text(src.substr(i, p - i));
    int text_line = line;
    count_lines(i, p);
    if (strip_next) {
      size_t k = 0;
      while (k < text.size() && is_space(text[k])) ++k;
      text.erase(0, k);
    } else if (trim_next && !text.empty() && text[0] == '\n') {
      text.erase(0, 1);
    }
    strip_next = trim_next = false;
    toks.push_back({Tk::text, std::move(text), text_line});
    i = p;
    if (i >= src.size()) break;
    size_t tag = i;
    char kind = src[i + 1];
    i += 2;
    bool minus = i < src.size() && src[i] == '-';
    bool plus = i < src.size() && src[i] == '+';
    if (kind == '#') {
      size_t e = src.find("#}", i);
      if (e == std::string_view::npos) throw SyntaxError("comment ({#) is never closed", line);
      if (minus)
        strip_prev_text(true, tag);
      else if (!plus)
        strip_prev_text(false, tag);
      bool end_minus = e > i && src[e - 1] == '-';
      count_lines(i, e);
      i = e + 2;
      if (end_minus)
        strip_next = true;
      else
        trim_next = true;
      continue;
    }
    if (minus) strip_prev_text(true, tag);
    if (kind == '%' && !minus && !plus) strip_prev_text(false, tag);
    if (minus || plus) ++i;
    int tag_line = line;
    toks.push_back({kind == '{' ? Tk::var_begin : Tk::block_begin, "", tag_line});
    // Tokens inside the tag until its end (brackets balanced).
    int depth = 0;
    const char* end2 = kind == '{' ? "}}" : "%}";
    bool closed = false;
    while (i < src.size()) {
      char c = src[i];
      if (is_space(c)) {
        if (c == '\n') ++line;
        ++i;
        continue;
      }
      if (depth == 0) {
        if (c == '-' && src.substr(i + 1, 2) == end2) {
          toks.push_back({kind == '{' ? Tk::var_end : Tk::block_end, "", line});
          i += 3;
          strip_next = true;
          closed = true;
          break;
        }
        if (src.substr(i, 2) == end2) {
          toks.push_back({kind == '{' ? Tk::var_end : Tk::block_end, "", line});
          i += 2;
          if (kind == '%') trim_next = true;
          closed = true;
          break;
        }
      }
      if (c == '\'' || c == '"') {
        size_t k = i + 1;
        while (k < src.size() && src[k] != c) {
          if (src[k] == '\\') ++k;
          ++k;
        }
        if (k >= src.size()) throw SyntaxError("string literal is never closed", line);
        std::string_view raw = src.substr(i + 1, k - i - 1);
        toks.push_back({Tk::str, unescape(raw, line), line});
        count_lines(i, k);
        i = k + 1;
        continue;
      }
      if (is_digit(c)) {
        size_t k = i;
        while (k < src.size() && (is_digit(src[k]) || src[k] == '_')) ++k;
        bool fl = false;
        if (k + 1 < src.size() && src[k] == '.' && is_digit(src[k + 1])) {
          fl = true;
          ++k;
          while (k < src.size() && is_digit(src[k])) ++k;
        }
        if (k < src.size() && (src[k] == 'e' || src[k] == 'E')) {
          size_t e = k + 1;
          if (e < src.size() && (src[e] == '+' || src[e] == '-')) ++e;
          if (e < src.size() && is_digit(src[e])) {
            fl = true;
            k = e;
            while (k < src.size() && is_digit(src[k])) ++k;
          }
        }
        std::string num;
        for (size_t q = i; q < k; ++q)
          if (src[q] != '_') num += src[q];
        toks.push_back({fl ? Tk::floating : Tk::integer, num, line});
        i = k;
        continue;
      }
      if (is_name_start(c)) {
        size_t k = i;
        while (k < src.size() && (is_name_start(src[k]) || is_digit(src[k]))) ++k;
        toks.push_back({Tk::name, std::string(src.substr(i, k - i)), line});
        i = k;
        continue;
      }
      static const char* ops2[] = {"**", "//", "==", "!=", "<=", ">="};
      bool matched = false;
      for (const char* o : ops2)
        if (src.substr(i, 2) == o) {
          toks.push_back({Tk::op, o, line});
          i += 2;
          matched = true;
          break;
        }
      if (matched) continue;
      if (std::string_view("+-*/%~<>=()[]{},.:|").find(c) != std::string_view::npos) {
        if (c == '(' || c == '[' || c == '{') ++depth;
        if (c == ')' || c == ']' || c == '}') --depth;
        toks.push_back({Tk::op, std::string(1, c), line});
        ++i;
        continue;
      }
      throw SyntaxError(fmt::format("unexpected character '{}' in a tag", c), line);
    }
    if (!closed)
      throw SyntaxError(fmt::format("tag opened with {}{} is never closed", '{', kind), tag_line);
  }
  toks.push_back({Tk::eof, "", line});
  return toks;
}

class Parser {
 public:
  explicit Parser(std::vector<Token> toks) : t_(std::move(toks)) {}

  NodeP parse() {
    std::string end;
    NodeP b = body({}, &end);
    if (cur().t != Tk::eof) fail("unexpected tag");
    return b;
  }

 private:
  const Token& cur() const { return t_[p_]; }
  const Token& peek(size_t k = 1) const { return t_[std::min(p_ + k, t_.size() - 1)]; }
  [[noreturn]] void fail(const std::string& m) const { throw SyntaxError(m, cur().line); }
  bool is_op(const char* o) const { return cur().t == Tk::op && cur().v == o; }
  bool is_name(const char* n) const { return cur().t == Tk::name && cur().v == n; }
  void expect_op(const char* o) {
    if (!is_op(o)) fail(fmt::format("expected '{}', got '{}'", o, describe(cur())));
    ++p_;
  }
  void expect_name(const char* n) {
    if (!is_name(n)) fail(fmt::format("expected '{}', got '{}'", n, describe(cur())));
    ++p_;
  }
  std::string ident() {
    if (cur().t != Tk::name) fail(fmt::format("expected a name, got '{}'", describe(cur())));
    return t_[p_++].v;
  }
  void expect_block_end() {
    if (cur().t != Tk::block_end) fail(fmt::format("expected '%}}', got '{}'", describe(cur())));
    ++p_;
  }
  static std::string describe(const Token& t) {
    switch (t.t) {
      case Tk::eof:
        return "end of template";
      case Tk::block_end:
        return "%}";
      case Tk::var_end:
        return "}}";
      case Tk::text:
        return "text";
      default:
        return t.v;
    }
  }
  static NodeP node(Node::T t, int line) {
    auto n = std::make_shared<Node>();
    n->t = t;
    n->line = line;
    return n;
  }

  // Statements until one of `ends` (a block keyword); *end receives which (empty at eof).
  NodeP body(const std::vector<std::string>& ends, std::string* end) {
    Nest guard(*this);
    NodeP b = node(Node::T::body, cur().line);
    for (;;) {
      const Token& tk = cur();
      if (tk.t == Tk::eof) {
        if (!ends.empty())
          fail(fmt::format("end of template while looking for {{% {} %}}", ends.back()));
        end->clear();
        return b;
      }
      if (tk.t == Tk::text) {
        if (!tk.v.empty()) {
          NodeP n = node(Node::T::text, tk.line);
          n->str = tk.v;
          b->kids.push_back(n);
        }
        ++p_;
        continue;
      }
      if (tk.t == Tk::var_begin) {
        ++p_;
        NodeP n = node(Node::T::output, tk.line);
        n->kids.push_back(expr());
        if (cur().t != Tk::var_end) fail(fmt::format("expected '}}}}', got '{}'", describe(cur())));
        ++p_;
        b->kids.push_back(n);
        continue;
      }
      if (tk.t != Tk::block_begin) fail("unexpected token");
      const Token& kw = peek();
      if (kw.t != Tk::name) fail("expected a statement name after {%");
      for (const auto& e : ends)
        if (kw.v == e) {
          p_ += 2;
          *end = e;
          return b;
        }
      ++p_;
      b->kids.push_back(statement());
    }
  }

  NodeP statement() {
    int line = cur().line;
    std::string kw = ident();
    if (kw == "if") return if_stmt(line);
    if (kw == "for") return for_stmt(line);
    if (kw == "set") return set_stmt(line);
    if (kw == "macro") return macro_stmt(line);
    if (kw == "call") return call_stmt(line);
    if (kw == "filter") return filter_stmt(line);
    if (kw == "break" || kw == "continue") {
      expect_block_end();
      return node(kw == "break" ? Node::T::break_ : Node::T::continue_, line);
    }
    if (kw == "generation") {  // transformers' assistant-mask marker: renders its body
      expect_block_end();
      std::string end;
      NodeP b = body({"endgeneration"}, &end);
      expect_block_end();
      return b;
    }
    if (kw == "raw") {
      expect_block_end();
      fail("{% raw %} is not supported");
    }
    throw SyntaxError(fmt::format("unknown statement {{% {} %}}", kw), line);
  }

  NodeP if_stmt(int line) {
    NodeP n = node(Node::T::if_, line);
    n->kids.push_back(expr());
    expect_block_end();
    for (;;) {
      std::string end;
      n->kids.push_back(body({"elif", "else", "endif"}, &end));
      if (end == "endif") break;
      if (end == "elif") {
        n->kids.push_back(expr());
        expect_block_end();
        continue;
      }
      expect_block_end();  // else
      n->kids.push_back(nullptr);
      n->kids.push_back(body({"endif"}, &end));
      break;
    }
    expect_block_end();
    return n;
  }

  std::vector<std::string> targets() {
    std::vector<std::string> names;
    bool paren = is_op("(");
    if (paren) ++p_;
    names.push_back(ident());
    while (is_op(",")) {
      ++p_;
      names.push_back(ident());
    }
    if (paren) expect_op(")");
    return names;
  }

  NodeP for_stmt(int line) {
    NodeP n = node(Node::T::for_, line);
    n->names = targets();
    expect_name("in");
    NodeP iter = or_expr(false);  // no ternary: `if` here is the loop filter
    NodeP filter;
    if (is_name("if")) {
      ++p_;
      filter = expr();
    }
    if (is_name("recursive")) {
      ++p_;
      n->flag = true;
    }
    expect_block_end();
    std::string end;
    NodeP b = body({"else", "endfor"}, &end);
    NodeP else_b;
    if (end == "else") {
      expect_block_end();
      else_b = body({"endfor"}, &end);
    }
    expect_block_end();
    n->kids = {iter, b, else_b, filter};
    return n;
  }

  NodeP set_stmt(int line) {
    std::string first = ident();
    if (is_op(".")) {  // namespace attribute
      ++p_;
      NodeP n = node(Node::T::set, line);
      n->str = first;
      n->attr = ident();
      expect_op("=");
      n->kids.push_back(expr_tuple());
      expect_block_end();
      return n;
    }
    std::vector<std::string> names{first};
    while (is_op(",")) {
      ++p_;
      names.push_back(ident());
    }
    if (is_op("=")) {
      ++p_;
      NodeP n = node(Node::T::set, line);
      n->names = names;
      n->kids.push_back(expr_tuple());
      expect_block_end();
      return n;
    }
    if (names.size() != 1) fail("a block {% set %} takes one name");
    NodeP n = node(Node::T::set_block, line);
    n->names = names;
    NodeP filt;
    if (is_op("|")) filt = filter_chain(nullptr);
    expect_block_end();
    std::string end;
    n->kids.push_back(body({"endset"}, &end));
    n->kids.push_back(filt);
    expect_block_end();
    return n;
  }

  void params(Node& n) {
    expect_op("(");
    while (!is_op(")")) {
      std::string p = ident();
      n.names.push_back(p);
      if (is_op("=")) {
        ++p_;
        n.kw.emplace_back(p, expr());
      }
      if (!is_op(",")) break;
      ++p_;
    }
    expect_op(")");
  }

  NodeP macro_stmt(int line) {
    NodeP n = node(Node::T::macro, line);
    n->str = ident();
    params(*n);
    expect_block_end();
    std::string end;
    n->kids.push_back(body({"endmacro"}, &end));
    expect_block_end();
    return n;
  }

  NodeP call_stmt(int line) {
    NodeP n = node(Node::T::call_block, line);
    if (is_op("(")) params(*n);
    NodeP c = expr();
    if (c->t != Node::T::call) fail("{% call %} needs a macro call");
    expect_block_end();
    std::string end;
    NodeP b = body({"endcall"}, &end);
    expect_block_end();
    n->kids = {c, b};
    return n;
  }

  NodeP filter_stmt(int line) {
    NodeP n = node(Node::T::filter_block, line);
    NodeP chain = filter_names(nullptr);
    expect_block_end();
    std::string end;
    NodeP b = body({"endfilter"}, &end);
    expect_block_end();
    n->kids = {chain, b};
    return n;
  }

  // ---- expressions ----
  NodeP expr_tuple() {  // `a, b` without parentheses (set targets' values)
    NodeP first = expr();
    if (!is_op(",")) return first;
    NodeP t = node(Node::T::tuple, first->line);
    t->kids.push_back(first);
    while (is_op(",")) {
      ++p_;
      t->kids.push_back(expr());
    }
    return t;
  }

  NodeP expr() {
    Nest guard(*this);
    return or_expr(true);
  }

  NodeP or_expr(bool ternary) {
    NodeP l = and_expr();
    while (is_name("or")) {
      int line = cur().line;
      ++p_;
      NodeP n = node(Node::T::or_, line);
      n->kids = {l, and_expr()};
      l = n;
    }
    if (ternary && is_name("if")) {
      int line = cur().line;
      ++p_;
      NodeP n = node(Node::T::cond, line);
      NodeP test = or_expr(false);
      NodeP other;
      if (is_name("else")) {
        ++p_;
        other = expr();
      }
      n->kids = {l, test, other};
      return n;
    }
    return l;
  }

  NodeP and_expr() {
    NodeP l = not_expr();
    while (is_name("and")) {
      int line = cur().line;
      ++p_;
      NodeP n = node(Node::T::and_, line);
      n->kids = {l, not_expr()};
      l = n;
    }
    return l;
  }

  NodeP not_expr() {
    if (is_name("not")) {
      int line = cur().line;
      ++p_;
      NodeP n = node(Node::T::not_, line);
      n->kids.push_back(not_expr());
      return n;
    }
    return compare();
  }

  NodeP compare() {
    NodeP l = math1();
    for (;;) {
      int line = cur().line;
      std::string op;
      if (cur().t == Tk::op && (cur().v == "==" || cur().v == "!=" || cur().v == "<" ||
                                cur().v == ">" || cur().v == "<=" || cur().v == ">=")) {
        op = cur().v;
        ++p_;
      } else if (is_name("in")) {
        op = "in";
        ++p_;
      } else if (is_name("not") && peek().t == Tk::name && peek().v == "in") {
        op = "notin";
        p_ += 2;
      } else {
        return l;
      }
      NodeP n = node(Node::T::binop, line);
      n->str = op;
      n->kids = {l, math1()};
      l = n;
    }
  }

  NodeP binary(NodeP l, const std::string& op, NodeP r, int line) {
    NodeP n = node(Node::T::binop, line);
    n->str = op;
    n->kids = {std::move(l), std::move(r)};
    return n;
  }

  NodeP math1() {
    NodeP l = concat();
    while (is_op("+") || is_op("-")) {
      std::string op = cur().v;
      int line = cur().line;
      ++p_;
      l = binary(l, op, concat(), line);
    }
    return l;
  }

  NodeP concat() {
    NodeP l = math2();
    while (is_op("~")) {
      int line = cur().line;
      ++p_;
      l = binary(l, "~", math2(), line);
    }
    return l;
  }

  NodeP math2() {
    NodeP l = pow_expr();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      std::string op = cur().v;
      int line = cur().line;
      ++p_;
      l = binary(l, op, pow_expr(), line);
    }
    return l;
  }

  NodeP pow_expr() {
    NodeP l = unary(true);
    while (is_op("**")) {
      int line = cur().line;
      ++p_;
      l = binary(l, "**", unary(true), line);
    }
    return l;
  }

  NodeP unary(bool with_filter) {
    Nest guard(*this);
    NodeP n;
    int line = cur().line;
    if (is_op("-") || is_op("+")) {
      bool neg = cur().v == "-";
      ++p_;
      n = node(neg ? Node::T::neg : Node::T::pos, line);
      n->kids.push_back(unary(false));
    } else {
      n = postfix(primary());
    }
    if (with_filter) n = filter_expr(n);
    return n;
  }

  NodeP primary() {
    const Token& tk = cur();
    int line = tk.line;
    NodeP n;
    switch (tk.t) {
      case Tk::name: {
        ++p_;
        if (tk.v == "true" || tk.v == "True") {
          n = node(Node::T::literal, line);
          n->lit = Value::boolean(true);
        } else if (tk.v == "false" || tk.v == "False") {
          n = node(Node::T::literal, line);
          n->lit = Value::boolean(false);
        } else if (tk.v == "none" || tk.v == "None") {
          n = node(Node::T::literal, line);
          n->lit = Value::none();
        } else {
          n = node(Node::T::name, line);
          n->str = tk.v;
        }
        return n;
      }
      case Tk::str: {
        std::string s;
        while (cur().t == Tk::str) s += t_[p_++].v;  // adjacent literals concatenate
        n = node(Node::T::literal, line);
        n->lit = Value::string(std::move(s));
        return n;
      }
      case Tk::integer:
        ++p_;
        n = node(Node::T::literal, line);
        n->lit = Value::integer(std::strtoll(tk.v.c_str(), nullptr, 10));
        return n;
      case Tk::floating:
        ++p_;
        n = node(Node::T::literal, line);
        n->lit = Value::floating(std::strtod(tk.v.c_str(), nullptr));
        return n;
      case Tk::op:
        if (tk.v == "(") {
          ++p_;
          if (is_op(")")) {
            ++p_;
            return node(Node::T::tuple, line);
          }
          NodeP first = expr();
          if (is_op(")")) {
            ++p_;
            return first;
          }
          n = node(Node::T::tuple, line);
          n->kids.push_back(first);
          while (is_op(",")) {
            ++p_;
            if (is_op(")")) break;
            n->kids.push_back(expr());
          }
          expect_op(")");
          return n;
        }
        if (tk.v == "[") {
          ++p_;
          n = node(Node::T::list, line);
          while (!is_op("]")) {
            n->kids.push_back(expr());
            if (!is_op(",")) break;
            ++p_;
          }
          expect_op("]");
          return n;
        }
        if (tk.v == "{") {
          ++p_;
          n = node(Node::T::dict, line);
          while (!is_op("}")) {
            n->kids.push_back(expr());
            expect_op(":");
            n->kids.push_back(expr());
            if (!is_op(",")) break;
            ++p_;
          }
          expect_op("}");
          return n;
        }
        break;
      default:
        break;
    }
    fail(fmt::format("unexpected '{}' in an expression", describe(tk)));
  }

  void call_args(Node& n) {
    expect_op("(");
    while (!is_op(")")) {
      if (cur().t == Tk::name && peek().t == Tk::op && peek().v == "=") {
        std::string k = ident();
        ++p_;
        n.kw.emplace_back(k, expr());
      } else {
        if (is_op("*") || is_op("**")) fail("*args and **kwargs in calls are not supported");
        n.kids.push_back(expr());
      }
      if (!is_op(",")) break;
      ++p_;
    }
    expect_op(")");
  }

  NodeP postfix(NodeP n) {
    for (;;) {
      int line = cur().line;
      if (is_op(".")) {
        ++p_;
        NodeP g = node(Node::T::getattr, line);
        if (cur().t == Tk::integer) {  // foo.0 == foo[0]
          g->t = Node::T::getitem;
          NodeP idx = node(Node::T::literal, line);
          idx->lit = Value::integer(std::strtoll(t_[p_++].v.c_str(), nullptr, 10));
          g->kids = {n, idx};
        } else {
          g->str = ident();
          g->kids = {n};
        }
        n = g;
      } else if (is_op("[")) {
        ++p_;
        NodeP a, b, c;
        bool is_slice = false;
        if (!is_op(":")) a = expr();
        if (is_op(":")) {
          is_slice = true;
          ++p_;
          if (!is_op("]") && !is_op(":")) b = expr();
          if (is_op(":")) {
            ++p_;
            if (!is_op("]")) c = expr();
          }
        }
        expect_op("]");
        NodeP g = node(is_slice ? Node::T::slice : Node::T::getitem, line);
        g->kids = {n, a};
        if (is_slice) g->kids = {n, a, b, c};
        n = g;
      } else if (is_op("(")) {
        NodeP c = node(Node::T::call, line);
        c->kids.push_back(n);
        call_args(*c);
        n = c;
      } else {
        return n;
      }
    }
  }

  // One or more `name(args)` separated by '|', applied to `operand` in order.
  NodeP filter_names(NodeP operand) {
    NodeP n = std::move(operand);
    for (;;) {
      int line = cur().line;
      NodeP f = node(Node::T::filter, line);
      f->str = ident();
      while (is_op(".")) {  // dotted filter names (none are known; rejected at check)
        ++p_;
        f->str += "." + ident();
      }
      f->kids.push_back(n);
      if (is_op("(")) call_args(*f);
      n = f;
      if (!is_op("|")) return n;
      ++p_;
    }
  }

  NodeP filter_chain(NodeP operand) {
    expect_op("|");
    return filter_names(std::move(operand));
  }

  NodeP filter_expr(NodeP n) {
    for (;;) {
      if (is_op("|")) {
        ++p_;
        n = filter_names(n);
        // filter_names consumed a chain; postfix calls after it apply to the result
      } else if (is_name("is")) {
        int line = cur().line;
        ++p_;
        NodeP t = node(Node::T::test, line);
        if (is_name("not")) {
          ++p_;
          t->flag = true;
        }
        t->str = ident();
        t->kids.push_back(n);
        if (is_op("(")) {
          call_args(*t);
        } else if ((cur().t == Tk::name || cur().t == Tk::str || cur().t == Tk::integer ||
                    cur().t == Tk::floating || is_op("[") || is_op("{")) &&
                   !is_name("else") && !is_name("or") && !is_name("and") && !is_name("if") &&
                   !is_name("is") && !is_name("in") && !is_name("not")) {
          t->kids.push_back(postfix(primary()));
        }
        n = t;
      } else if (is_op("(")) {
        NodeP c = node(Node::T::call, cur().line);
        c->kids.push_back(n);
        call_args(*c);
        n = c;
      } else {
        return n;
      }
    }
  }

  // Nesting depth of blocks and expressions: a hostile template cannot exhaust the stack.
  struct Nest {
    explicit Nest(Parser& p) : p_(p) {
      if (++p_.depth_ > kMaxNesting)
        p_.fail(fmt::format("nested deeper than {} levels", kMaxNesting));
    }
    ~Nest() { --p_.depth_; }
    Parser& p_;
  };
  static constexpr int kMaxNesting = 200;

  std::vector<Token> t_;
  size_t p_ = 0;
  int depth_ = 0;
};

}  // namespace

NodeP parse_template(std::string_view source, const std::string& /*name*/) {
  Parser p(lex(source));
  return p.parse();
}

}  // namespace spark::tok::jinja
