#include "daemon/grammar/json_grammar.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

namespace spark::grammar {

namespace {

enum class Kind : uint8_t {
  any,
  object,
  map,
  array,
  string,
  number,
  integer,
  literals,
  any_of,
  seq
};

struct Prop {
  std::string key;  // with its quotes: "\"name\""
  int node = -1;
  bool required = false;
};

struct NodeDef {
  Kind kind = Kind::any;
  std::vector<Prop> props;        // object
  int item = -1;                  // array item, map value
  std::vector<int> parts;         // any_of alternatives, seq parts in order
  std::vector<std::string> lits;  // literals: the texts one of which is the value
};

// The nodes every grammar has, at fixed indices.
constexpr int kAny = 0, kAnyMap = 1, kAnyArray = 2, kString = 3, kNumber = 4, kInteger = 5,
              kScalars = 6, kBoolean = 7, kNull = 8;

}  // namespace

struct Grammar::Impl {
  std::vector<NodeDef> nodes;
  int root = -1;  // a seq node: the whole output
};

namespace {

std::shared_ptr<Grammar::Impl> base_impl() {
  auto g = std::make_shared<Grammar::Impl>();
  g->nodes.resize(9);
  g->nodes[kAny].kind = Kind::any;
  g->nodes[kAnyMap].kind = Kind::map;
  g->nodes[kAnyMap].item = kAny;
  g->nodes[kAnyArray].kind = Kind::array;
  g->nodes[kAnyArray].item = kAny;
  g->nodes[kString].kind = Kind::string;
  g->nodes[kNumber].kind = Kind::number;
  g->nodes[kInteger].kind = Kind::integer;
  g->nodes[kScalars].kind = Kind::literals;
  g->nodes[kScalars].lits = {"true", "false", "null"};
  g->nodes[kBoolean].kind = Kind::literals;
  g->nodes[kBoolean].lits = {"true", "false"};
  g->nodes[kNull].kind = Kind::literals;
  g->nodes[kNull].lits = {"null"};
  return g;
}

struct CompileError {
  std::string msg;
};

[[noreturn]] void refuse(std::string msg) {
  throw CompileError{std::move(msg)};
}

// JSON Schema to nodes. Keywords that only annotate are ignored; any other keyword not
// handled here is refused, so a schema never promises what the output does not keep.
class Compiler {
 public:
  Compiler(Grammar::Impl& g, const Json& root, std::string root_where)
      : g_(g), root_(root), root_where_(std::move(root_where)) {}

  int compile(const Json& s, const std::string& where) {
    if (s.is_boolean()) {
      if (s.get<bool>()) return kAny;
      refuse(fmt::format("the schema at {} is false: no value is valid", where));
    }
    if (!s.is_object()) refuse(fmt::format("the schema at {} must be an object", where));
    static const std::set<std::string> handled = {
        "type",  "properties", "required", "additionalProperties", "items", "enum",
        "const", "anyOf",      "$defs",    "definitions",          "$ref"};
    static const std::set<std::string> annotations = {
        "title",      "description", "default",   "examples", "$schema", "$id",    "$comment",
        "deprecated", "readOnly",    "writeOnly", "strict",   "name",    "$anchor"};
    for (auto it = s.begin(); it != s.end(); ++it)
      if (!handled.count(it.key()) && !annotations.count(it.key()))
        refuse(
            fmt::format("'{}' at {} is not supported (structured outputs take type, "
                        "properties, required, additionalProperties: false, items, enum, "
                        "const, anyOf, $defs and $ref)",
                        it.key(), where));
    if (s.contains("$ref")) {
      if (!s["$ref"].is_string()) refuse(fmt::format("'$ref' at {} must be a string", where));
      return ref(s["$ref"].get<std::string>(), where);
    }
    if (s.contains("const")) return literals({s["const"]}, where);
    if (s.contains("enum")) {
      const Json& e = s["enum"];
      if (!e.is_array() || e.empty())
        refuse(fmt::format("'enum' at {} must be a non-empty array", where));
      std::vector<Json> vals(e.begin(), e.end());
      return literals(vals, where);
    }
    if (s.contains("anyOf")) {
      const Json& a = s["anyOf"];
      if (!a.is_array() || a.empty())
        refuse(fmt::format("'anyOf' at {} must be a non-empty array of schemas", where));
      NodeDef d;
      d.kind = Kind::any_of;
      for (size_t i = 0; i < a.size(); ++i)
        d.parts.push_back(compile(a[i], fmt::format("{}.anyOf[{}]", where, i)));
      return add(std::move(d));
    }
    if (s.contains("type")) {
      const Json& t = s["type"];
      if (t.is_string()) return typed(s, t.get<std::string>(), where);
      if (!t.is_array() || t.empty())
        refuse(fmt::format("'type' at {} must be a type name or an array of them", where));
      NodeDef d;
      d.kind = Kind::any_of;
      for (const auto& one : t) {
        if (!one.is_string())
          refuse(fmt::format("'type' at {} must be a type name or an array of them", where));
        d.parts.push_back(typed(s, one.get<std::string>(), where));
      }
      return add(std::move(d));
    }
    if (s.contains("properties")) return typed(s, "object", where);
    if (s.contains("items")) return typed(s, "array", where);
    return kAny;
  }

 private:
  int add(NodeDef d) {
    g_.nodes.push_back(std::move(d));
    return static_cast<int>(g_.nodes.size() - 1);
  }

  int literals(const std::vector<Json>& vals, const std::string& where) {
    NodeDef d;
    d.kind = Kind::literals;
    for (const auto& v : vals) {
      std::string text;
      try {
        text = v.dump(-1, ' ', false, Json::error_handler_t::strict);
      } catch (const std::exception&) {
        refuse(fmt::format("an 'enum' or 'const' value at {} is not valid UTF-8", where));
      }
      if (std::find(d.lits.begin(), d.lits.end(), text) == d.lits.end())
        d.lits.push_back(std::move(text));
    }
    return add(std::move(d));
  }

  int typed(const Json& s, const std::string& type, const std::string& where) {
    if (type == "string") return kString;
    if (type == "number") return kNumber;
    if (type == "integer") return kInteger;
    if (type == "boolean") return kBoolean;
    if (type == "null") return kNull;
    if (type == "array") {
      if (!s.contains("items")) return kAnyArray;
      if (s["items"].is_array())
        refuse(fmt::format("'items' at {} as an array (a tuple) is not supported", where));
      NodeDef d;
      d.kind = Kind::array;
      d.item = compile(s["items"], where + ".items");
      return add(std::move(d));
    }
    if (type != "object")
      refuse(fmt::format("'type' '{}' at {} is not a JSON Schema type", type, where));
    const Json* add_props =
        s.contains("additionalProperties") ? &s["additionalProperties"] : nullptr;
    const bool closed = add_props && add_props->is_boolean() && !add_props->get<bool>();
    if (!s.contains("properties")) {
      if (s.contains("required") && s["required"].is_array() && !s["required"].empty())
        refuse(
            fmt::format("'required' at {} names properties but there is no 'properties'", where));
      if (closed) {  // {} alone
        NodeDef d;
        d.kind = Kind::object;
        return add(std::move(d));
      }
      if (!add_props || (add_props->is_boolean() && add_props->get<bool>())) return kAnyMap;
      NodeDef d;
      d.kind = Kind::map;
      d.item = compile(*add_props, where + ".additionalProperties");
      return add(std::move(d));
    }
    if (add_props && !closed)
      refuse(
          fmt::format("'additionalProperties' other than false at {} beside 'properties' is "
                      "not supported",
                      where));
    const Json& props = s["properties"];
    if (!props.is_object()) refuse(fmt::format("'properties' at {} must be an object", where));
    std::set<std::string> required;
    if (s.contains("required")) {
      const Json& r = s["required"];
      if (!r.is_array()) refuse(fmt::format("'required' at {} must be an array", where));
      for (const auto& n : r) {
        if (!n.is_string()) refuse(fmt::format("'required' at {} must hold property names", where));
        if (!props.contains(n.get<std::string>()))
          refuse(fmt::format("'required' at {} names '{}', which is not in 'properties'", where,
                             n.get<std::string>()));
        required.insert(n.get<std::string>());
      }
    }
    NodeDef d;
    d.kind = Kind::object;
    for (auto it = props.begin(); it != props.end(); ++it) {
      Prop p;
      p.key = Json(it.key()).dump(-1, ' ', false, Json::error_handler_t::replace);
      p.required = required.count(it.key()) > 0;
      p.node = compile(it.value(), fmt::format("{}.properties.{}", where, it.key()));
      d.props.push_back(std::move(p));
    }
    return add(std::move(d));
  }

  int ref(const std::string& r, const std::string& where) {
    auto found = refs_.find(r);
    if (found != refs_.end()) return found->second;
    if (r.empty() || r[0] != '#')
      refuse(
          fmt::format("'$ref' '{}' at {} is not supported: only references inside the "
                      "schema (#/$defs/...) are",
                      r, where));
    const Json* target = nullptr;
    try {
      target = &root_.at(Json::json_pointer(r.substr(1)));
    } catch (const std::exception&) {
      refuse(fmt::format("'$ref' '{}' at {} does not resolve", r, where));
    }
    NodeDef d;
    d.kind = Kind::any_of;  // an indirection of one part, so references may recurse
    const int id = add(std::move(d));
    refs_[r] = id;
    const int t = compile(*target, root_where_ + r.substr(1));
    g_.nodes[static_cast<size_t>(id)].parts = {t};
    return id;
  }

  Grammar::Impl& g_;
  const Json& root_;
  std::string root_where_;
  std::map<std::string, int> refs_;
};

int literal_node(Grammar::Impl& g, std::string text) {
  NodeDef d;
  d.kind = Kind::literals;
  d.lits = {std::move(text)};
  g.nodes.push_back(std::move(d));
  return static_cast<int>(g.nodes.size() - 1);
}

int seq_node(Grammar::Impl& g, std::vector<int> parts) {
  NodeDef d;
  d.kind = Kind::seq;
  d.parts = std::move(parts);
  g.nodes.push_back(std::move(d));
  return static_cast<int>(g.nodes.size() - 1);
}

// ---- the automaton ----

// Where the output is inside one node. For an object a is the property (the last one
// written, or the one whose key is being written), b the position in its key; for a
// string a is the UTF-8 continuation bytes still due and b the range the next must lie in
// (lo << 8 | hi), or after \u the digits read and the surrogate mode; for a number a counts
// the digits of the current part; for literals a is the literal and b the position; for a
// seq a is the next part.
struct Frame {
  int32_t node = 0;
  int32_t a = 0;
  int32_t b = 0;
  uint8_t st = 0;
  uint8_t ws = 0;  // whitespace bytes since the last other byte
  auto key() const { return std::tie(node, a, b, st, ws); }
  bool operator==(const Frame& o) const { return key() == o.key(); }
  bool operator<(const Frame& o) const { return key() < o.key(); }
};
using Stack = std::vector<Frame>;

enum : uint8_t {
  // object
  O_OPEN,
  O_NEXT,
  O_KEY,
  O_COLON,
  O_VAL,
  O_AFTER,
  // map (any keys)
  M_OPEN,
  M_NEXT,
  M_KEYDONE,
  M_VAL,
  M_AFTER,
  // array
  A_OPEN,
  A_NEXT,
  A_AFTER,
  // string
  S_BODY,
  S_ESC,
  S_HEX,
  S_LOW_BS,
  S_LOW_U,
  // number
  N_MINUS,
  N_ZERO,
  N_INT,
  N_DOT,
  N_FRAC,
  N_E,
  N_ESIGN,
  N_EXP,
};

// \u escape modes (Frame::b while in S_HEX).
enum : int32_t { U_PLAIN = 0, U_AFTER_D = 1, U_HIGH = 2, U_LOW = 3 };

bool is_ws(uint8_t c) {
  return c == ' ' || c == '\n' || c == '\t' || c == '\r';
}
bool is_digit(uint8_t c) {
  return c >= '0' && c <= '9';
}
int hex_value(uint8_t c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}
// A byte a string takes as it is, with no state: printable ASCII but the quote and backslash.
bool plain_ascii(uint8_t c) {
  return c >= 0x20 && c < 0x7f && c != '"' && c != '\\';
}

// Text a string takes whole from a state with no escape or character pending: complete,
// well-formed UTF-8 (the automaton's lead-byte ranges) without a quote, backslash or
// control character.
bool plain_text(std::string_view t) {
  for (size_t i = 0; i < t.size();) {
    const auto c = static_cast<uint8_t>(t[i]);
    if (c < 0x80) {
      if (!plain_ascii(c)) return false;
      ++i;
      continue;
    }
    int n = 0;
    uint8_t lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF)
      n = 1;
    else if (c == 0xE0)
      n = 2, lo = 0xA0;
    else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF)
      n = 2;
    else if (c == 0xED)
      n = 2, hi = 0x9F;
    else if (c == 0xF0)
      n = 3, lo = 0x90;
    else if (c >= 0xF1 && c <= 0xF3)
      n = 3;
    else if (c == 0xF4)
      n = 3, hi = 0x8F;
    else
      return false;
    if (i + static_cast<size_t>(n) >= t.size()) return false;  // a character cut short
    for (int k = 1; k <= n; ++k) {
      const auto d = static_cast<uint8_t>(t[i + static_cast<size_t>(k)]);
      if (d < (k == 1 ? lo : 0x80) || d > (k == 1 ? hi : 0xBF)) return false;
    }
    i += static_cast<size_t>(n) + 1;
  }
  return true;
}

bool number_final(uint8_t st) {
  return st == N_ZERO || st == N_INT || st == N_FRAC || st == N_EXP;
}

class Automaton {
 public:
  Automaton(const Grammar::Impl& g, std::vector<Stack>* out) : g_(g), out_(out) {}

  void feed(Stack s, uint8_t c) {
    if (s.empty()) return;
    Frame& f = s.back();
    const NodeDef& d = g_.nodes[static_cast<size_t>(f.node)];
    const bool ws = is_ws(c);
    auto take_ws = [&] {
      if (f.ws < kMaxWhitespace) {
        ++f.ws;
        emit(std::move(s));
      }
    };
    auto set = [&](uint8_t st) {
      f.st = st;
      f.ws = 0;
    };
    auto pop = [&] {
      s.pop_back();
      emit(std::move(s));
    };
    switch (d.kind) {
      case Kind::object:
        switch (f.st) {
          case O_OPEN:
          case O_NEXT:
            if (ws) return take_ws();
            if (c == '}' && f.st == O_OPEN && !required_after(d, f.a)) return pop();
            if (c == '"')
              for (int j = f.a + 1; j < static_cast<int>(d.props.size()); ++j) {
                Stack t = s;
                t.back().a = j;
                t.back().b = 1;
                t.back().st = O_KEY;
                t.back().ws = 0;
                emit(std::move(t));
                if (d.props[static_cast<size_t>(j)].required) break;
              }
            return;
          case O_KEY: {
            const std::string& k = d.props[static_cast<size_t>(f.a)].key;
            if (static_cast<uint8_t>(k[static_cast<size_t>(f.b)]) != c) return;
            if (++f.b == static_cast<int32_t>(k.size())) set(O_COLON);
            return emit(std::move(s));
          }
          case O_COLON:
            if (ws) return take_ws();
            if (c == ':') set(O_VAL), emit(std::move(s));
            return;
          case O_VAL: {
            if (ws) return take_ws();
            const int child = d.props[static_cast<size_t>(f.a)].node;
            set(O_AFTER);
            return enter(std::move(s), child, c, 0);
          }
          case O_AFTER:
            if (ws) return take_ws();
            if (c == ',' && f.a + 1 < static_cast<int>(d.props.size())) {
              set(O_NEXT);
              return emit(std::move(s));
            }
            if (c == '}' && !required_after(d, f.a)) return pop();
            return;
        }
        return;
      case Kind::map:
        switch (f.st) {
          case M_OPEN:
          case M_NEXT:
            if (ws) return take_ws();
            if (c == '}' && f.st == M_OPEN) return pop();
            if (c == '"') {
              set(M_KEYDONE);
              s.push_back(Frame{kString, 0, 0, S_BODY, 0});
              emit(std::move(s));
            }
            return;
          case M_KEYDONE:
            if (ws) return take_ws();
            if (c == ':') set(M_VAL), emit(std::move(s));
            return;
          case M_VAL: {
            if (ws) return take_ws();
            set(M_AFTER);
            return enter(std::move(s), d.item, c, 0);
          }
          case M_AFTER:
            if (ws) return take_ws();
            if (c == ',') set(M_NEXT), emit(std::move(s));
            if (c == '}') pop();
            return;
        }
        return;
      case Kind::array:
        switch (f.st) {
          case A_OPEN:
          case A_NEXT:
            if (ws) return take_ws();
            if (c == ']' && f.st == A_OPEN) return pop();
            set(A_AFTER);
            return enter(std::move(s), d.item, c, 0);
          case A_AFTER:
            if (ws) return take_ws();
            if (c == ',') set(A_NEXT), emit(std::move(s));
            if (c == ']') pop();
            return;
        }
        return;
      case Kind::string:
        return string_byte(std::move(s), c);
      case Kind::number:
      case Kind::integer:
        return number_byte(std::move(s), c, d.kind == Kind::integer);
      case Kind::literals: {
        const std::string& lit = d.lits[static_cast<size_t>(f.a)];
        if (static_cast<uint8_t>(lit[static_cast<size_t>(f.b)]) != c) return;
        if (++f.b == static_cast<int32_t>(lit.size())) return pop();
        return emit(std::move(s));
      }
      case Kind::seq: {
        if (f.a == static_cast<int32_t>(d.parts.size())) {  // done: the byte is the parent's
          s.pop_back();
          return feed(std::move(s), c);
        }
        const int part = d.parts[static_cast<size_t>(f.a)];
        ++f.a;
        return enter(std::move(s), part, c, 0);
      }
      case Kind::any:
      case Kind::any_of:
        return;  // never a frame
    }
  }

  // The value of node n begins with byte c (s: the parent, already past the value).
  void enter(Stack s, int n, uint8_t c, int depth) {
    if (depth > 64) return;  // references that only lead to each other: no value
    const NodeDef& d = g_.nodes[static_cast<size_t>(n)];
    switch (d.kind) {
      case Kind::any:
        if (c == '{') return enter(std::move(s), kAnyMap, c, depth + 1);
        if (c == '[') return enter(std::move(s), kAnyArray, c, depth + 1);
        if (c == '"') return enter(std::move(s), kString, c, depth + 1);
        if (c == '-' || is_digit(c)) return enter(std::move(s), kNumber, c, depth + 1);
        return enter(std::move(s), kScalars, c, depth + 1);
      case Kind::object:
        if (c == '{') s.push_back(Frame{n, -1, 0, O_OPEN, 0}), emit(std::move(s));
        return;
      case Kind::map:
        if (c == '{') s.push_back(Frame{n, 0, 0, M_OPEN, 0}), emit(std::move(s));
        return;
      case Kind::array:
        if (c == '[') s.push_back(Frame{n, 0, 0, A_OPEN, 0}), emit(std::move(s));
        return;
      case Kind::string:
        if (c == '"') s.push_back(Frame{n, 0, 0, S_BODY, 0}), emit(std::move(s));
        return;
      case Kind::number:
      case Kind::integer:
        if (c == '-') s.push_back(Frame{n, 0, 0, N_MINUS, 0}), emit(std::move(s));
        if (c == '0') s.push_back(Frame{n, 1, 0, N_ZERO, 0}), emit(std::move(s));
        if (c >= '1' && c <= '9') s.push_back(Frame{n, 1, 0, N_INT, 0}), emit(std::move(s));
        return;
      case Kind::literals:
        for (size_t i = 0; i < d.lits.size(); ++i) {
          if (static_cast<uint8_t>(d.lits[i][0]) != c) continue;
          Stack t = s;
          if (d.lits[i].size() > 1) t.push_back(Frame{n, static_cast<int32_t>(i), 1, 0, 0});
          emit(std::move(t));
        }
        return;
      case Kind::any_of:
        for (int p : d.parts) enter(s, p, c, depth + 1);
        return;
      case Kind::seq:
        if (d.parts.empty()) return;
        s.push_back(Frame{n, 1, 0, 0, 0});
        return enter(std::move(s), d.parts[0], c, depth + 1);
    }
  }

 private:
  void emit(Stack s) { out_->push_back(std::move(s)); }

  static bool required_after(const NodeDef& d, int a) {
    for (size_t j = static_cast<size_t>(a + 1); j < d.props.size(); ++j)
      if (d.props[j].required) return true;
    return false;
  }

  void string_byte(Stack s, uint8_t c) {
    Frame& f = s.back();
    switch (f.st) {
      case S_BODY:
        if (f.a > 0) {  // a UTF-8 continuation byte, in the range the lead byte allows
          if (c < (f.b >> 8) || c > (f.b & 0xff)) return;
          --f.a;
          f.b = 0x80BF;
          return emit(std::move(s));
        }
        if (c == '"') {
          s.pop_back();
          return emit(std::move(s));
        }
        if (c == '\\') {
          f.st = S_ESC;
          return emit(std::move(s));
        }
        if (c < 0x20) return;
        if (c < 0x80) return emit(std::move(s));
        // Lead bytes of well-formed UTF-8 (no overlong forms, surrogates or > U+10FFFF).
        if (c >= 0xC2 && c <= 0xDF)
          f.a = 1, f.b = 0x80BF;
        else if (c == 0xE0)
          f.a = 2, f.b = 0xA0BF;
        else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF)
          f.a = 2, f.b = 0x80BF;
        else if (c == 0xED)
          f.a = 2, f.b = 0x809F;
        else if (c == 0xF0)
          f.a = 3, f.b = 0x90BF;
        else if (c >= 0xF1 && c <= 0xF3)
          f.a = 3, f.b = 0x80BF;
        else if (c == 0xF4)
          f.a = 3, f.b = 0x808F;
        else
          return;
        return emit(std::move(s));
      case S_ESC:
        if (c == 'u') {
          f.st = S_HEX, f.a = 0, f.b = U_PLAIN;
          return emit(std::move(s));
        }
        if (c == '"' || c == '\\' || c == '/' || c == 'b' || c == 'f' || c == 'n' || c == 'r' ||
            c == 't') {
          f.st = S_BODY, f.a = 0, f.b = 0;
          return emit(std::move(s));
        }
        return;
      case S_LOW_BS:
        if (c == '\\') f.st = S_LOW_U, emit(std::move(s));
        return;
      case S_LOW_U:
        if (c == 'u') f.st = S_HEX, f.a = 0, f.b = U_LOW, emit(std::move(s));
        return;
      case S_HEX: {
        // \uD800-\uDBFF must be followed by \uDC00-\uDFFF, and those come only after one.
        const int h = hex_value(c);
        if (h < 0) return;
        if (f.a == 0) {
          if (f.b == U_LOW && h != 0xD) return;
          if (f.b == U_PLAIN && h == 0xD) f.b = U_AFTER_D;
        } else if (f.a == 1) {
          if (f.b == U_LOW && h < 0xC) return;
          if (f.b == U_AFTER_D) {
            if (h >= 0xC) return;
            f.b = h >= 8 ? U_HIGH : U_PLAIN;
          }
        }
        if (++f.a == 4) {
          f.st = f.b == U_HIGH ? S_LOW_BS : S_BODY;
          f.a = 0, f.b = 0;
        }
        return emit(std::move(s));
      }
      default:
        return;
    }
  }

  void number_byte(Stack s, uint8_t c, bool integer) {
    Frame& f = s.back();
    if (number_final(f.st)) {  // the number may end here: the byte is the parent's
      Stack t(s.begin(), s.end() - 1);
      feed(std::move(t), c);
    }
    const bool digit = is_digit(c);
    const bool exp = !integer && (c == 'e' || c == 'E');
    switch (f.st) {
      case N_MINUS:
        if (c == '0')
          f.st = N_ZERO, f.a = 1, emit(std::move(s));
        else if (digit)
          f.st = N_INT, f.a = 1, emit(std::move(s));
        return;
      case N_ZERO:
      case N_INT:
        if (digit && f.st == N_INT && f.a < kMaxDigits) {
          ++f.a;
          return emit(std::move(s));
        }
        if (c == '.' && !integer)
          f.st = N_DOT, f.a = 0, emit(std::move(s));
        else if (exp)
          f.st = N_E, f.a = 0, emit(std::move(s));
        return;
      case N_DOT:
        if (digit) f.st = N_FRAC, f.a = 1, emit(std::move(s));
        return;
      case N_FRAC:
        if (digit && f.a < kMaxDigits) {
          ++f.a;
          return emit(std::move(s));
        }
        if (exp) f.st = N_E, f.a = 0, emit(std::move(s));
        return;
      case N_E:
        if (c == '+' || c == '-')
          f.st = N_ESIGN, emit(std::move(s));
        else if (digit)
          f.st = N_EXP, f.a = 1, emit(std::move(s));
        return;
      case N_ESIGN:
        if (digit) f.st = N_EXP, f.a = 1, emit(std::move(s));
        return;
      case N_EXP:
        if (digit && f.a < 2) ++f.a, emit(std::move(s));  // up to 1e99: a double's range
        return;
      default:
        return;
    }
  }

  const Grammar::Impl& g_;
  std::vector<Stack>* out_;
};

// Every frame from the top down may end without another byte: the value is complete.
bool stack_complete(const Grammar::Impl& g, const Stack& s) {
  for (auto it = s.rbegin(); it != s.rend(); ++it) {
    const NodeDef& d = g.nodes[static_cast<size_t>(it->node)];
    if ((d.kind == Kind::number || d.kind == Kind::integer) && number_final(it->st)) continue;
    if (d.kind == Kind::seq && it->a == static_cast<int32_t>(d.parts.size())) continue;
    return false;
  }
  return true;
}

std::vector<Stack> advance(const Grammar::Impl& g, const std::vector<Stack>& in, uint8_t c) {
  std::vector<Stack> out;
  Automaton a(g, &out);
  for (const auto& s : in) a.feed(s, c);
  if (out.size() > 1) {
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
  }
  return out;
}

}  // namespace

// ---- Grammar ----

Result<std::shared_ptr<const Grammar>> Grammar::from_schema(const Json& schema,
                                                            const std::string& where) {
  auto g = base_impl();
  try {
    Compiler comp(*g, schema, where);
    const int v = comp.compile(schema, where);
    g->root = seq_node(*g, {v});
  } catch (const CompileError& e) {
    return make_error(Errc::usage, e.msg);
  }
  return std::shared_ptr<const Grammar>(std::make_shared<Grammar>(g));
}

std::shared_ptr<const Grammar> Grammar::any_object() {
  auto g = base_impl();
  g->root = seq_node(*g, {kAnyMap});
  return std::make_shared<Grammar>(g);
}

Result<std::shared_ptr<const Grammar>> Grammar::one_of(const std::vector<Wrapped>& alternatives) {
  if (alternatives.empty()) return make_error(Errc::usage, "no alternatives to choose from");
  auto g = base_impl();
  try {
    NodeDef any;
    any.kind = Kind::any_of;
    for (const auto& w : alternatives) {
      Compiler comp(*g, w.schema, w.where);
      std::vector<int> parts;
      if (!w.before.empty()) parts.push_back(literal_node(*g, w.before));
      parts.push_back(comp.compile(w.schema, w.where));
      if (!w.after.empty()) parts.push_back(literal_node(*g, w.after));
      any.parts.push_back(seq_node(*g, std::move(parts)));
    }
    g->nodes.push_back(std::move(any));
    g->root = seq_node(*g, {static_cast<int>(g->nodes.size() - 1)});
  } catch (const CompileError& e) {
    return make_error(Errc::usage, e.msg);
  }
  return std::shared_ptr<const Grammar>(std::make_shared<Grammar>(g));
}

// ---- TokenTrie ----

TokenTrie::TokenTrie(const std::vector<std::string>& bytes, std::vector<int32_t> end_ids)
    : vocab_(static_cast<int>(bytes.size())), bytes_(bytes) {
  for (int32_t id : end_ids)
    if (id >= 0 && id < vocab_) end_ids_.push_back(id);
  for (size_t i = 0; i < bytes_.size(); ++i)
    if (!bytes_[i].empty() &&
        std::find(end_ids_.begin(), end_ids_.end(), static_cast<int32_t>(i)) == end_ids_.end())
      sorted_.push_back(static_cast<int32_t>(i));
  std::stable_sort(sorted_.begin(), sorted_.end(), [&](int32_t x, int32_t y) {
    return bytes_[static_cast<size_t>(x)] < bytes_[static_cast<size_t>(y)];
  });
  nodes_.emplace_back();
  build(0, static_cast<int32_t>(sorted_.size()), 0);
}

int32_t TokenTrie::build(int32_t lo, int32_t hi, size_t depth) {
  // Fills the node whose prefix (depth bytes) the sorted ids [lo, hi) share; the node is
  // the last one added before its children. Returns its index.
  const auto idx = static_cast<int32_t>(nodes_.size() - 1);
  auto at = [&](int32_t i) -> const std::string& {
    return bytes_[static_cast<size_t>(sorted_[static_cast<size_t>(i)])];
  };
  int32_t own = lo;
  while (own < hi && at(own).size() == depth) ++own;
  std::vector<std::tuple<uint8_t, int32_t, int32_t>> groups;
  for (int32_t i = own; i < hi;) {
    const auto b = static_cast<uint8_t>(at(i)[depth]);
    int32_t j = i;
    while (j < hi && static_cast<uint8_t>(at(j)[depth]) == b) ++j;
    groups.emplace_back(b, i, j);
    i = j;
  }
  nodes_[static_cast<size_t>(idx)].lo = lo;
  nodes_[static_cast<size_t>(idx)].own = own;
  nodes_[static_cast<size_t>(idx)].hi = hi;
  bool text = depth > 0;
  for (int32_t i = lo; text && i < hi; ++i)
    text = plain_text(std::string_view(at(i)).substr(depth - 1));
  nodes_[static_cast<size_t>(idx)].text = text;
  std::vector<int32_t> kids;
  for (const auto& [b, glo, ghi] : groups) {
    nodes_.emplace_back();
    nodes_.back().byte = b;
    kids.push_back(build(glo, ghi, depth + 1));
  }
  // Children are not contiguous when built depth first: their list is kept apart.
  child_lists_.push_back(std::move(kids));
  nodes_[static_cast<size_t>(idx)].kids = static_cast<int32_t>(child_lists_.size() - 1);
  return idx;
}

// ---- Matcher ----

struct Matcher::State {
  std::vector<Stack> stacks;
  bool gated = false;
  std::string tail;  // before the gate: the output's last bytes, to find the gate in
  // Constraint::opening: while `opening` is true the output may still become the opening
  // (open_at of its bytes written); `grammar` whether it may still be the grammar's.
  bool opening = false, grammar = true;
  size_t open_at = 0;
};

namespace {
Stack root_stack(const Grammar& g) {
  return Stack{Frame{g.impl().root, 0, 0, 0, 0}};
}
// Whether bytes `b` may follow `open_at` bytes of `opening` (within it, or completing it).
bool opening_takes(const std::string& opening, size_t open_at, std::string_view b) {
  const std::string_view rest = std::string_view(opening).substr(open_at);
  return !b.empty() && (rest.substr(0, b.size()) == b.substr(0, rest.size()));
}
}  // namespace

Matcher::Matcher(Constraint c) : c_(std::move(c)), st_(std::make_unique<State>()) {
  st_->stacks.push_back(root_stack(*c_.grammar));
  st_->opening = !c_.gate.empty() && !c_.opening.empty();
  st_->gated = !c_.gate.empty() && c_.opening.empty();
}

bool Matcher::gated() const {
  return st_->gated;
}
Matcher::~Matcher() = default;
Matcher::Matcher(Matcher&&) noexcept = default;
Matcher& Matcher::operator=(Matcher&&) noexcept = default;

bool Matcher::can_end() const {
  if (st_->gated || !st_->grammar) return false;
  for (const auto& s : st_->stacks)
    if (stack_complete(c_.grammar->impl(), s)) return true;
  return false;
}

bool Matcher::must_end() const {
  if (!can_end()) return false;
  for (int c = 0; c < 256; ++c)
    if (!advance(c_.grammar->impl(), st_->stacks, static_cast<uint8_t>(c)).empty()) return false;
  return true;
}

bool Matcher::accept_bytes(std::string_view bytes) {
  if (ended_) return false;
  if (st_->opening) {  // the grammar's start, or the optional free part's opening
    State next = *st_;
    if (st_->grammar) {
      std::vector<Stack> cur = st_->stacks;
      for (char ch : bytes) {
        cur = advance(c_.grammar->impl(), cur, static_cast<uint8_t>(ch));
        if (cur.empty()) break;
      }
      next.grammar = !cur.empty();
      if (next.grammar) next.stacks = std::move(cur);
    }
    next.opening = opening_takes(c_.opening, st_->open_at, bytes);
    if (!next.opening && !next.grammar) return false;
    if (next.opening) {
      const size_t rest = c_.opening.size() - st_->open_at;
      if (bytes.size() >= rest) {  // the opening is complete: free until the gate
        // (the grammar cannot begin as the opening does and go on alike: its branch ends)
        const State saved = *st_;
        st_->opening = false;
        st_->grammar = true;
        st_->gated = true;
        st_->stacks = {root_stack(*c_.grammar)};
        st_->open_at = 0;
        st_->tail.clear();
        if (accept_bytes(bytes.substr(rest))) return true;
        *st_ = saved;
        return false;
      }
      next.open_at += bytes.size();
    }
    *st_ = std::move(next);
    return true;
  }
  if (st_->gated) {  // free: any bytes; the grammar starts after the gate's last one
    const State saved = *st_;
    std::string& t = st_->tail;
    const std::string& g = c_.gate;
    for (size_t i = 0; i < bytes.size(); ++i) {
      t.push_back(bytes[i]);
      if (t.size() > g.size()) t.erase(0, t.size() - g.size());
      if (t == g) {
        st_->gated = false;
        t.clear();
        if (accept_bytes(bytes.substr(i + 1))) return true;
        *st_ = saved;  // the token's bytes after the gate do not suit the grammar
        return false;
      }
    }
    return true;
  }
  std::vector<Stack> cur = st_->stacks;
  for (char ch : bytes) {
    cur = advance(c_.grammar->impl(), cur, static_cast<uint8_t>(ch));
    if (cur.empty()) return false;
  }
  st_->stacks = std::move(cur);
  return true;
}

bool Matcher::accept(int32_t token) {
  if (ended_ || token < 0 || token >= c_.trie->vocab()) return false;
  const auto& ends = c_.trie->end_ids();
  if (std::find(ends.begin(), ends.end(), token) != ends.end()) {
    if (!can_end()) return false;
    ended_ = true;
    return true;
  }
  if (st_->gated && std::find(c_.stops.begin(), c_.stops.end(), token) != c_.stops.end())
    return false;
  const std::string& b = c_.trie->bytes(token);
  // Before the gate a token with no bytes (a special one the trie leaves out) is free too.
  if (b.empty()) return st_->gated;
  return accept_bytes(b);
}

namespace {
struct MaskWalk {
  const Grammar::Impl& g;
  const TokenTrie& t;
  uint32_t* words;
  int count = 0;

  void set_range(int32_t lo, int32_t hi) {
    for (int32_t i = lo; i < hi; ++i) {
      const int32_t id = t.sorted()[static_cast<size_t>(i)];
      words[id >> 5] |= 1u << (id & 31);
      ++count;
    }
  }

  static bool in_plain_string(const Grammar::Impl& g, const std::vector<Stack>& S) {
    for (const auto& s : S) {
      const Frame& f = s.back();
      if (g.nodes[static_cast<size_t>(f.node)].kind == Kind::string && f.st == S_BODY && f.a == 0)
        return true;
    }
    return false;
  }

  void walk(int32_t node, const std::vector<Stack>& S) {
    const bool plain = in_plain_string(g, S);
    for (int32_t k : t.children(node)) {
      const TokenTrie::Node& n = t.nodes()[static_cast<size_t>(k)];
      if (plain && n.text) {  // every token below is text the string takes whole
        set_range(n.lo, n.hi);
        continue;
      }
      std::vector<Stack> next = advance(g, S, n.byte);
      if (next.empty()) continue;
      set_range(n.lo, n.own);
      if (n.own < n.hi) walk(k, next);
    }
  }
};
}  // namespace

int Matcher::fill_mask(uint32_t* words) const {
  const size_t nw = (static_cast<size_t>(c_.trie->vocab()) + 31) / 32;
  std::fill(words, words + nw, 0u);
  if (st_->gated && !ended_) {  // before the gate: every id but the end ids
    const int V = c_.trie->vocab();
    for (int id = 0; id < V; ++id) words[id >> 5] |= 1u << (id & 31);
    int count = V;
    for (const auto* ids : {&c_.trie->end_ids(), &c_.stops})
      for (int32_t id : *ids)
        if (id >= 0 && id < V && (words[id >> 5] >> (id & 31) & 1u)) {
          words[id >> 5] &= ~(1u << (id & 31));
          --count;
        }
    return count;
  }
  MaskWalk w{c_.grammar->impl(), *c_.trie, words};
  if (!ended_ && st_->grammar) w.walk(0, st_->stacks);
  if (!ended_ && st_->opening) {  // and the ids that go on with the free part's opening
    const int V = c_.trie->vocab();
    for (int id = 0; id < V; ++id)
      if (!(words[id >> 5] >> (id & 31) & 1u) &&
          opening_takes(c_.opening, st_->open_at, c_.trie->bytes(id))) {
        words[id >> 5] |= 1u << (id & 31);
        ++w.count;
      }
  }
  if (ended_ || w.count == 0 || can_end())
    for (int32_t id : c_.trie->end_ids()) {
      words[id >> 5] |= 1u << (id & 31);
      ++w.count;
    }
  return w.count;
}

}  // namespace spark::grammar
