#pragma once
// The interpreter's values and syntax tree (shared by parse.cc and eval.cc).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "daemon/tokenizer/jinja/jinja.h"

namespace spark::tok::jinja {

struct Value;
struct Object;
struct Args;
using Array = std::vector<Value>;
using Function = std::function<Value(Args&)>;

/// A render-time error (a template's raise_exception, a type error): carries its line
/// (0: the line of the node being evaluated). `limit`: a limit of RenderLimits was passed;
/// `stopped`: RenderLimits::stop ended the render.
struct RenderError : std::runtime_error {
  enum class Why : uint8_t { error, limit, stopped };
  RenderError(std::string msg, int line_, Why why_ = Why::error)
      : std::runtime_error(std::move(msg)), line(line_), why(why_) {}
  int line;
  Why why;
};

/// The budget of the render running on this thread (Template::render sets it).
struct Budget {
  uint64_t steps = 0, max_steps = 0, next_check = 0;
  std::chrono::steady_clock::time_point deadline{};
  int64_t timeout_ms = 0;
  const std::function<bool()>* stop = nullptr;
  int line = 0;  // of the node being evaluated
  /// The lowest stack address a recursion may reach (null: unknown); see check_stack.
  const char* stack_floor = nullptr;
};
extern thread_local Budget* t_budget;
/// Charges `n` steps to this thread's render (none outside a render); throws
/// RenderError(limit) past the step budget or the deadline, RenderError(stopped) when told.
void charge(uint64_t n);
/// Before a macro call or a recursive loop goes one level deeper: throws RenderError(limit)
/// when the thread's stack is nearly used up (a frame's size depends on the build, so a
/// count of levels alone cannot keep every build inside its stack).
void check_stack(int line);
/// Before a string of `bytes` is built: fails past kMaxText, else charges its cost.
void check_text(size_t bytes);
/// Before a list of `n` items is built: fails past kMaxItems, else charges n.
void check_items(size_t n);
/// Depth of containers in a value (0 for scalars).
inline int nest_of(const Value& v);

/// A Python-like value: Undefined, None, bool, int, float, str, list, dict, callable.
/// Lists and dicts are shared (Python reference semantics; the sandbox never mutates them,
/// namespaces excepted).
struct Value {
  enum class Kind : uint8_t {
    undefined,
    none,
    boolean,
    integer,
    floating,
    string,
    array,
    object,
    callable
  };
  Kind kind = Kind::undefined;
  bool b = false;
  uint16_t nest = 0;  // array: how deep containers nest inside it (objects: Object::nest)
  int64_t i = 0;
  double f = 0;
  std::string s;                 // string; for undefined: the name that was missing
  std::shared_ptr<Array> arr;    // array
  std::shared_ptr<Object> obj;   // object
  std::shared_ptr<Function> fn;  // callable

  static Value none() { return make(Kind::none); }
  static Value boolean(bool v) {
    Value x = make(Kind::boolean);
    x.b = v;
    return x;
  }
  static Value integer(int64_t v) {
    Value x = make(Kind::integer);
    x.i = v;
    return x;
  }
  static Value floating(double v) {
    Value x = make(Kind::floating);
    x.f = v;
    return x;
  }
  static Value string(std::string v) {
    Value x = make(Kind::string);
    x.s = std::move(v);
    return x;
  }
  static Value array(Array v = {});
  static Value object();
  static Value callable(Function f) {
    Value x = make(Kind::callable);
    x.fn = std::make_shared<Function>(std::move(f));
    return x;
  }
  static Value undefined(std::string name = {}) {
    Value x;
    x.s = std::move(name);
    return x;
  }
  bool is_undefined() const { return kind == Kind::undefined; }
  bool is_none() const { return kind == Kind::none; }
  bool is_string() const { return kind == Kind::string; }
  bool is_number() const {
    return kind == Kind::integer || kind == Kind::floating || kind == Kind::boolean;
  }
  bool is_array() const { return kind == Kind::array; }
  bool is_object() const { return kind == Kind::object; }

 private:
  static Value make(Kind k) {
    Value x;
    x.kind = k;
    return x;
  }
};

/// An insertion-ordered dict (Python 3.7+ order); `ns` marks a namespace() object, the
/// only mutable one.
struct Object {
  std::vector<std::pair<std::string, Value>> items;
  bool ns = false;
  uint16_t nest = 1;
  const Value* find(std::string_view k) const {
    for (const auto& [key, v] : items)
      if (key == k) return &v;
    return nullptr;
  }
  void set(const std::string& k, Value v) {
    int d = 1 + nest_of(v);
    if (d > kMaxNest)
      throw RenderError(fmt::format("values nest deeper than {} levels", kMaxNest), 0,
                        RenderError::Why::limit);
    if (d > nest) nest = static_cast<uint16_t>(d);
    for (auto& [key, old] : items)
      if (key == k) {
        old = std::move(v);
        return;
      }
    items.emplace_back(k, std::move(v));
  }
};

inline int nest_of(const Value& v) {
  if (v.kind == Value::Kind::array) return v.nest;
  if (v.kind == Value::Kind::object) return v.obj->nest;
  return 0;
}

inline Value Value::array(Array v) {
  int d = 1;
  for (const auto& e : v) d = std::max(d, 1 + nest_of(e));
  if (d > kMaxNest)
    throw RenderError(fmt::format("values nest deeper than {} levels", kMaxNest), 0,
                      RenderError::Why::limit);
  Value x = make(Kind::array);
  x.nest = static_cast<uint16_t>(d);
  x.arr = std::make_shared<Array>(std::move(v));
  return x;
}
inline Value Value::object() {
  Value x = make(Kind::object);
  x.obj = std::make_shared<Object>();
  return x;
}

/// Call arguments: positional, then keyword (in call order).
struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
  int line = 0;
};

using NodeP = std::shared_ptr<Node>;

struct Node {
  enum class T : uint8_t {
    // expressions
    literal,  // lit
    name,     // str
    list,     // kids
    tuple,    // kids
    dict,     // kids: key0, value0, key1, value1, ...
    getattr,  // kids[0].str
    getitem,  // kids[0][kids[1]]
    slice,    // kids[0][kids[1]:kids[2]:kids[3]] (null kids allowed)
    call,     // kids[0](kids[1..], kw)
    filter,   // kids[0] | str(kids[1..], kw); kids[0] null inside a filter block
    test,     // kids[0] is [not] str(kids[1..]); flag = negated
    not_,     // not kids[0]
    neg,      // -kids[0]
    pos,      // +kids[0]
    binop,    // kids[0] str kids[1]: + - * / // % ** ~ == != < > <= >= in notin
    and_,     // kids[0] and kids[1]
    or_,      // kids[0] or kids[1]
    cond,     // kids[0] if kids[1] else kids[2] (kids[2] may be null)
    // statements
    body,        // kids
    text,        // str
    output,      // {{ kids[0] }}
    if_,         // kids: cond0, body0, cond1, body1, ... (else: null cond)
    for_,        // names = targets; kids: iter, body, else (null), filter (null); flag = recursive
    set,         // names = targets (or str = namespace, attr); kids[0] = value
    set_block,   // names[0] = target; kids[0] = body; kids[1] = filter (null)
    macro,       // str = name; names = params; kw = defaults; kids[0] = body
    call_block,  // kids[0] = call expression, kids[1] = body; names = caller params; kw = defaults
    filter_block,  // kids[0] = filter chain (innermost operand null), kids[1] = body
    break_,
    continue_,
  } t;
  int line = 0;
  bool flag = false;
  std::string str, attr;
  Value lit;
  std::vector<NodeP> kids;
  std::vector<std::string> names;
  std::vector<std::pair<std::string, NodeP>> kw;
};

/// Parses the whole template (syntax only).
NodeP parse_template(std::string_view source, const std::string& name);

/// A syntax error at a line (caught by Template::parse).
struct SyntaxError : std::runtime_error {
  SyntaxError(std::string msg, int line_) : std::runtime_error(std::move(msg)), line(line_) {}
  int line;
};

/// Names the interpreter implements (checked against the tree at load).
const std::set<std::string, std::less<>>& known_filters();
const std::set<std::string, std::less<>>& known_tests();
const std::set<std::string, std::less<>>& known_methods();
const std::set<std::string, std::less<>>& known_globals();

/// Python str() of a value (what {{ }} prints).
std::string to_str(const Value& v);
/// transformers' tojson: json.dumps(v, ensure_ascii=False, indent, separators, sort_keys).
std::string to_json(const Value& v, int indent, const std::string& item_sep,
                    const std::string& key_sep, bool sort_keys);
/// Deep conversion of request JSON into values (RenderError past 512 levels of nesting).
Value from_json(const Json& j, int depth = 0);

}  // namespace spark::tok::jinja
