// The evaluator: statements, expressions, filters, tests, methods and globals, with Python
// Jinja2's semantics (a missing key is Undefined; using an Undefined in arithmetic or
// attribute access is an error; `set` inside a loop does not leak out of the iteration).
#include <fmt/format.h>
#include <pthread.h>
#include <unicode/locid.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <optional>
#include <unordered_map>

#include "daemon/tokenizer/jinja/internal.h"
#include "daemon/tokenizer/utf8.h"

namespace spark::tok::jinja {

thread_local Budget* t_budget = nullptr;

namespace {
[[noreturn]] void fail_limit(const std::string& msg) {
  throw RenderError(msg, 0, RenderError::Why::limit);
}
}  // namespace

void charge(uint64_t n) {
  Budget* b = t_budget;
  if (!b) return;
  b->steps += n;
  if (b->steps > b->max_steps)
    fail_limit(
        fmt::format("the render passed its budget of {} steps (TEMPLATE_MAX_STEPS)", b->max_steps));
  if (b->steps < b->next_check) return;
  b->next_check = b->steps + 4096;
  if (b->timeout_ms > 0 && std::chrono::steady_clock::now() > b->deadline)
    fail_limit(fmt::format("the render took longer than its limit of {} ms (TEMPLATE_TIMEOUT)",
                           b->timeout_ms));
  if (b->stop && *b->stop && (*b->stop)())
    throw RenderError(
        "the render was stopped: the client closed the connection or sparkd is "
        "stopping",
        0, RenderError::Why::stopped);
}

void check_stack(int line) {
  const Budget* b = t_budget;
  if (!b || !b->stack_floor) return;
  // Stacks grow down on every target we build for.
  if (static_cast<const char*>(__builtin_frame_address(0)) < b->stack_floor)
    throw RenderError("the template recursed too deep for the render's stack", line,
                      RenderError::Why::limit);
}

namespace {
// The lowest address this thread's recursion may reach: a quarter of the stack (at least
// 512 KiB, at most half) stays free for the level being entered and the expressions in it.
// Computed once a thread (for the main thread glibc reads /proc/self/maps).
const char* stack_floor_of_this_thread() {
  thread_local const char* floor = [] {
    pthread_attr_t attr;
    if (pthread_getattr_np(pthread_self(), &attr) != 0) return static_cast<const char*>(nullptr);
    void* addr = nullptr;
    size_t size = 0;
    const bool ok = pthread_attr_getstack(&attr, &addr, &size) == 0 && addr && size;
    pthread_attr_destroy(&attr);
    if (!ok) return static_cast<const char*>(nullptr);
    const size_t keep = std::min(std::max<size_t>(size / 4, size_t{512} << 10), size / 2);
    return static_cast<const char*>(addr) + keep;
  }();
  return floor;
}
}  // namespace

void check_text(size_t bytes) {
  if (bytes > kMaxText)
    fail_limit(fmt::format("a string would pass {} MiB ({} bytes)", kMaxText >> 20, bytes));
  charge(bytes / 32);
}

void check_items(size_t n) {
  if (n > kMaxItems) fail_limit(fmt::format("a list would pass {} items ({})", kMaxItems, n));
  charge(n);
}

namespace {

constexpr size_t kMaxOutput = kMaxText;  // a runaway template fails instead of eating memory
constexpr int kMaxDepth = 256;           // macro recursion
constexpr int64_t kMaxRange = static_cast<int64_t>(kMaxItems);

[[noreturn]] void fail(int line, const std::string& msg) {
  throw RenderError(msg, line);
}

// a*b for sizes, saturating (a size check then fails instead of wrapping around).
size_t mul_sat(size_t a, size_t b) {
  if (a && b > SIZE_MAX / a) return SIZE_MAX;
  return a * b;
}
// What copying these values costs: one step each, and their text.
void charge_copy(const Array& a) {
  uint64_t bytes = 0;
  for (const auto& v : a) bytes += v.s.size();
  charge(a.size() + bytes / 32);
}

std::string kind_name(const Value& v) {
  switch (v.kind) {
    case Value::Kind::undefined:
      return "undefined";
    case Value::Kind::none:
      return "none";
    case Value::Kind::boolean:
      return "bool";
    case Value::Kind::integer:
      return "int";
    case Value::Kind::floating:
      return "float";
    case Value::Kind::string:
      return "string";
    case Value::Kind::array:
      return "list";
    case Value::Kind::object:
      return v.obj->ns ? "namespace" : "dict";
    case Value::Kind::callable:
      return "function";
  }
  return "?";
}

[[noreturn]] void undefined_error(const Value& v, int line) {
  fail(line, v.s.empty() ? "a value is undefined" : fmt::format("'{}' is undefined", v.s));
}

// ---- unicode helpers ----
std::u32string cps(std::string_view s) {
  charge(s.size() / 8);
  std::u32string out;
  for (size_t i = 0; i < s.size();) {
    char32_t c = 0;
    size_t n = utf8_next(s, i, &c);
    if (n == 0) n = 1;
    out += c;
    i += n;
  }
  return out;
}
std::string utf8(std::u32string_view s) {
  std::string out;
  for (char32_t c : s) utf8_append(out, c);
  return out;
}
size_t cp_len(std::string_view s) {
  size_t n = 0;
  for (unsigned char c : s)
    if ((c & 0xC0) != 0x80) ++n;
  return n;
}

// Python's str.isspace() set (what split() and strip() without arguments use).
bool py_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

std::string icu_case(const std::string& s, bool upper) {
  charge(s.size() / 4);
  icu::UnicodeString u = icu::UnicodeString::fromUTF8(s);
  if (upper)
    u.toUpper(icu::Locale::getRoot());
  else
    u.toLower(icu::Locale::getRoot());
  std::string out;
  u.toUTF8String(out);
  return out;
}
std::string cp_case(char32_t c, int mode) {  // 0 lower, 1 upper, 2 title
  std::string one;
  utf8_append(one, c);
  if (mode == 2) {
    icu::UnicodeString u = icu::UnicodeString::fromUTF8(one);
    std::u32string t(1, static_cast<char32_t>(u_totitle(static_cast<UChar32>(c))));
    return utf8(t);
  }
  return icu_case(one, mode == 1);
}
bool cased(char32_t c) {
  return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_CASED);
}

std::string py_title(const std::string& s) {  // str.title()
  charge(s.size());
  std::string out;
  bool prev_cased = false;
  for (char32_t c : cps(s)) {
    out += prev_cased ? cp_case(c, 0) : cp_case(c, 2);
    prev_cased = cased(c);
  }
  return out;
}
std::string py_capitalize(const std::string& s) {
  charge(s.size());
  std::u32string u = cps(s);
  if (u.empty()) return "";
  return cp_case(u[0], 2) + icu_case(utf8(u.substr(1)), false);
}

std::string strip_chars(const std::string& s, const Value* chars, bool left, bool right) {
  std::u32string u = cps(s), set;
  bool ws = !chars || chars->is_none() || chars->is_undefined();
  if (!ws) set = cps(chars->s);
  auto in = [&](char32_t c) { return ws ? py_space(c) : set.find(c) != std::u32string::npos; };
  size_t b = 0, e = u.size();
  if (left)
    while (b < e && in(u[b])) ++b;
  if (right)
    while (e > b && in(u[e - 1])) --e;
  return utf8(std::u32string_view(u).substr(b, e - b));
}

std::vector<std::string> py_split(const std::string& s, const Value* sep, int64_t maxsplit,
                                  bool from_right, int line) {
  std::vector<std::string> out;
  if (!sep || sep->is_none() || sep->is_undefined()) {
    std::u32string u = cps(s);
    if (!from_right) {
      size_t i = 0;
      int64_t splits = 0;
      while (i < u.size()) {
        while (i < u.size() && py_space(u[i])) ++i;
        if (i >= u.size()) break;
        if (maxsplit >= 0 && splits >= maxsplit) {
          size_t e = u.size();
          while (e > i && py_space(u[e - 1])) --e;
          out.push_back(utf8(u.substr(i, e - i)));
          break;
        }
        size_t j = i;
        while (j < u.size() && !py_space(u[j])) ++j;
        out.push_back(utf8(u.substr(i, j - i)));
        if (out.size() > kMaxItems) check_items(out.size());
        ++splits;
        i = j;
      }
    } else {
      size_t i = u.size();
      int64_t splits = 0;
      while (i > 0) {
        while (i > 0 && py_space(u[i - 1])) --i;
        if (i == 0) break;
        if (maxsplit >= 0 && splits >= maxsplit) {
          size_t b = 0;
          while (b < i && py_space(u[b])) ++b;
          out.insert(out.begin(), utf8(u.substr(b, i - b)));
          break;
        }
        size_t j = i;
        while (j > 0 && !py_space(u[j - 1])) --j;
        if (out.size() >= kMaxItems) check_items(out.size() + 1);
        out.insert(out.begin(), utf8(u.substr(j, i - j)));
        ++splits;
        i = j;
      }
    }
    return out;
  }
  if (!sep->is_string()) fail(line, "split(): the separator must be a string");
  const std::string& d = sep->s;
  if (d.empty()) fail(line, "split(): empty separator");
  if (!from_right) {
    size_t i = 0;
    int64_t splits = 0;
    for (;;) {
      size_t p = s.find(d, i);
      if (p == std::string::npos || (maxsplit >= 0 && splits >= maxsplit)) {
        out.push_back(s.substr(i));
        break;
      }
      out.push_back(s.substr(i, p - i));
      if (out.size() > kMaxItems) check_items(out.size());
      i = p + d.size();
      ++splits;
    }
  } else {
    size_t end = s.size();
    int64_t splits = 0;
    for (;;) {
      size_t p = end >= d.size() ? s.rfind(d, end - d.size()) : std::string::npos;
      if (p == std::string::npos || (maxsplit >= 0 && splits >= maxsplit)) {
        out.insert(out.begin(), s.substr(0, end));
        break;
      }
      if (out.size() >= kMaxItems) check_items(out.size() + 1);
      out.insert(out.begin(), s.substr(p + d.size(), end - p - d.size()));
      end = p;
      ++splits;
    }
  }
  charge(out.size());
  return out;
}

std::vector<std::string> py_splitlines(const std::string& s, bool keepends) {
  std::vector<std::string> out;
  std::u32string u = cps(s);
  size_t start = 0;
  for (size_t i = 0; i < u.size(); ++i) {
    char32_t c = u[i];
    bool br = c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D ||
              c == 0x1E || c == 0x85 || c == 0x2028 || c == 0x2029;
    if (!br) continue;
    size_t end = i;
    if (c == '\r' && i + 1 < u.size() && u[i + 1] == '\n') ++i;
    out.push_back(utf8(u.substr(start, (keepends ? i + 1 : end) - start)));
    if (out.size() > kMaxItems) check_items(out.size());
    start = i + 1;
  }
  if (start < u.size()) out.push_back(utf8(u.substr(start)));
  return out;
}

std::string py_replace(const std::string& s, const std::string& a, const std::string& b,
                       int64_t count) {
  std::string out;
  if (a.empty()) {  // Python inserts `b` between characters (and at both ends)
    size_t slots = cp_len(s) + 1;
    if (count >= 0) slots = std::min(slots, static_cast<size_t>(count));
    check_text(s.size() + mul_sat(slots, b.size()));
    std::u32string u = cps(s);
    int64_t n = 0;
    for (size_t i = 0; i <= u.size(); ++i) {
      if (count < 0 || n < count) {
        out += b;
        ++n;
      }
      if (i < u.size()) utf8_append(out, u[i]);
    }
    return out;
  }
  if (b.size() > a.size()) {  // the text grows: check what it grows to first
    size_t hits = 0;
    for (size_t p = s.find(a);
         p != std::string::npos && (count < 0 || hits < static_cast<size_t>(count));
         p = s.find(a, p + a.size()))
      ++hits;
    check_text(s.size() + mul_sat(hits, b.size() - a.size()));
  } else {
    charge(s.size() / 32);
  }
  size_t i = 0;
  int64_t n = 0;
  for (;;) {
    size_t p = s.find(a, i);
    if (p == std::string::npos || (count >= 0 && n >= count)) break;
    out.append(s, i, p - i);
    out += b;
    i = p + a.size();
    ++n;
  }
  out.append(s, i);
  return out;
}

// ---- truthiness, equality, ordering ----
bool truthy(const Value& v) {
  switch (v.kind) {
    case Value::Kind::undefined:
    case Value::Kind::none:
      return false;
    case Value::Kind::boolean:
      return v.b;
    case Value::Kind::integer:
      return v.i != 0;
    case Value::Kind::floating:
      return v.f != 0;
    case Value::Kind::string:
      return !v.s.empty();
    case Value::Kind::array:
      return !v.arr->empty();
    case Value::Kind::object:
      return v.obj->ns || !v.obj->items.empty();
    case Value::Kind::callable:
      return true;
  }
  return false;
}

double num(const Value& v) {
  if (v.kind == Value::Kind::floating) return v.f;
  if (v.kind == Value::Kind::boolean) return v.b ? 1 : 0;
  return static_cast<double>(v.i);
}
bool is_int_like(const Value& v) {
  return v.kind == Value::Kind::integer || v.kind == Value::Kind::boolean;
}
int64_t ival(const Value& v) {
  return v.kind == Value::Kind::boolean ? (v.b ? 1 : 0) : v.i;
}

bool equals(const Value& a, const Value& b) {
  charge(1);
  if (a.is_number() && b.is_number()) {
    if (is_int_like(a) && is_int_like(b)) return ival(a) == ival(b);
    return num(a) == num(b);
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::Kind::undefined:
    case Value::Kind::none:
      return true;
    case Value::Kind::string:
      return a.s == b.s;
    case Value::Kind::array:
      if (a.arr->size() != b.arr->size()) return false;
      for (size_t k = 0; k < a.arr->size(); ++k)
        if (!equals((*a.arr)[k], (*b.arr)[k])) return false;
      return true;
    case Value::Kind::object:
      if (a.obj == b.obj) return true;
      if (a.obj->items.size() != b.obj->items.size()) return false;
      for (const auto& [k, v] : a.obj->items) {
        const Value* o = b.obj->find(k);
        if (!o || !equals(v, *o)) return false;
      }
      return true;
    case Value::Kind::callable:
      return a.fn == b.fn;
    default:
      return false;
  }
}

// <0, 0, >0; TypeError (as Python) for types that do not order.
int compare(const Value& a, const Value& b, int line) {
  charge(1);
  if (a.is_number() && b.is_number()) {
    if (is_int_like(a) && is_int_like(b)) return ival(a) < ival(b) ? -1 : ival(a) > ival(b);
    return num(a) < num(b) ? -1 : num(a) > num(b);
  }
  if (a.is_string() && b.is_string()) return a.s.compare(b.s) < 0 ? -1 : a.s == b.s ? 0 : 1;
  if (a.is_array() && b.is_array()) {
    for (size_t k = 0; k < std::min(a.arr->size(), b.arr->size()); ++k) {
      int c = compare((*a.arr)[k], (*b.arr)[k], line);
      if (c) return c;
    }
    return a.arr->size() < b.arr->size() ? -1 : a.arr->size() > b.arr->size();
  }
  if (a.is_undefined()) undefined_error(a, line);
  if (b.is_undefined()) undefined_error(b, line);
  fail(line, fmt::format("cannot order {} and {}", kind_name(a), kind_name(b)));
}

// Items of an iterable as Python iterates them (dict: keys; string: characters).
Array iterate(const Value& v, int line) {
  switch (v.kind) {
    case Value::Kind::undefined:
      return {};
    case Value::Kind::array:
      charge_copy(*v.arr);
      return *v.arr;
    case Value::Kind::object: {
      check_items(v.obj->items.size());
      Array out;
      for (const auto& kv : v.obj->items) out.push_back(Value::string(kv.first));
      return out;
    }
    case Value::Kind::string: {
      check_items(cp_len(v.s));
      Array out;
      for (char32_t c : cps(v.s)) out.push_back(Value::string(utf8(std::u32string(1, c))));
      return out;
    }
    default:
      fail(line, fmt::format("'{}' object is not iterable", kind_name(v)));
  }
}

int64_t length(const Value& v, int line) {
  switch (v.kind) {
    case Value::Kind::undefined:
      return 0;
    case Value::Kind::string:
      return static_cast<int64_t>(cp_len(v.s));
    case Value::Kind::array:
      return static_cast<int64_t>(v.arr->size());
    case Value::Kind::object:
      return static_cast<int64_t>(v.obj->items.size());
    default:
      fail(line, fmt::format("object of type '{}' has no len()", kind_name(v)));
  }
}

bool contains(const Value& hay, const Value& needle, int line) {
  switch (hay.kind) {
    case Value::Kind::undefined:
      return false;
    case Value::Kind::string:
      if (!needle.is_string())
        fail(line, fmt::format("'in <string>' requires a string, not {}", kind_name(needle)));
      return hay.s.find(needle.s) != std::string::npos;
    case Value::Kind::array:
      for (const auto& x : *hay.arr)
        if (equals(x, needle)) return true;
      return false;
    case Value::Kind::object:
      return needle.is_string() && hay.obj->find(needle.s) != nullptr;
    default:
      fail(line, fmt::format("argument of type '{}' is not iterable", kind_name(hay)));
  }
}

// Argument access by position or keyword, with defaults.
struct ArgReader {
  Args& a;
  std::string fname;
  const Value* get(size_t pos, const char* key) const {
    if (pos < a.pos.size()) return &a.pos[pos];
    for (const auto& [k, v] : a.kw)
      if (k == key) return &v;
    return nullptr;
  }
  Value val(size_t pos, const char* key, Value def = Value::undefined()) const {
    const Value* v = get(pos, key);
    return v ? *v : def;
  }
  std::string str(size_t pos, const char* key, std::string def) const {
    const Value* v = get(pos, key);
    if (!v || v->is_undefined()) return def;
    if (!v->is_string()) fail(a.line, fmt::format("{}(): '{}' must be a string", fname, key));
    return v->s;
  }
  int64_t integer(size_t pos, const char* key, int64_t def) const {
    const Value* v = get(pos, key);
    if (!v || v->is_undefined() || v->is_none()) return def;
    if (!is_int_like(*v)) fail(a.line, fmt::format("{}(): '{}' must be an integer", fname, key));
    return ival(*v);
  }
  bool boolean(size_t pos, const char* key, bool def) const {
    const Value* v = get(pos, key);
    return v && !v->is_undefined() ? truthy(*v) : def;
  }
};

const std::set<std::string, std::less<>> kStringMethods = {
    "strip",    "lstrip",  "rstrip",  "split",   "rsplit",       "splitlines",  "startswith",
    "endswith", "upper",   "lower",   "title",   "capitalize",   "replace",     "find",
    "rfind",    "index",   "count",   "join",    "format",       "isdigit",     "isalpha",
    "isalnum",  "isspace", "islower", "isupper", "removeprefix", "removesuffix"};
const std::set<std::string, std::less<>> kDictMethods = {"get", "items", "keys", "values"};
const std::set<std::string, std::less<>> kListMethods = {"index", "count"};

struct Scope {
  std::shared_ptr<Scope> parent;
  std::unordered_map<std::string, Value> vars;
  const Value* find(const std::string& k) const {
    for (const Scope* s = this; s; s = s->parent.get()) {
      auto it = s->vars.find(k);
      if (it != s->vars.end()) return &it->second;
    }
    return nullptr;
  }
};
using ScopeP = std::shared_ptr<Scope>;

ScopeP child(ScopeP p) {
  auto s = std::make_shared<Scope>();
  s->parent = std::move(p);
  return s;
}

enum class Flow { normal, brk, cont };

class Eval {
 public:
  std::string out_;

  void exec(const Node& n, const ScopeP& sc, std::string& out, Flow& flow) {
    if (t_budget) t_budget->line = n.line;
    charge(1);
    switch (n.t) {
      case Node::T::body:
        for (const auto& k : n.kids) {
          exec(*k, sc, out, flow);
          if (flow != Flow::normal) return;
        }
        return;
      case Node::T::text:
        emit(out, n.str, n.line);
        return;
      case Node::T::output:
        emit(out, to_str(eval(*n.kids[0], sc)), n.line);
        return;
      case Node::T::if_:
        for (size_t k = 0; k + 1 < n.kids.size(); k += 2) {
          if (!n.kids[k] || truthy(eval(*n.kids[k], sc))) {
            exec(*n.kids[k + 1], sc, out, flow);
            return;
          }
        }
        return;
      case Node::T::for_:
        exec_for(n, sc, out, flow, nullptr, 0);
        return;
      case Node::T::set: {
        Value v = eval(*n.kids[0], sc);
        if (!n.str.empty()) {  // ns.attr = v
          const Value* ns = sc->find(n.str);
          if (!ns || !ns->is_object() || !ns->obj->ns)
            fail(n.line,
                 fmt::format("cannot assign attribute on non-namespace object '{}'", n.str));
          // A namespace is the one mutable value: holding a namespace or a function (which
          // holds its scope) could make a cycle that nothing frees.
          if (holds_ref(v, 0))
            fail(n.line,
                 fmt::format("cannot store a namespace or a function in namespace '{}'", n.str));
          ns->obj->set(n.attr, std::move(v));
          return;
        }
        assign(n.names, v, *sc, n.line);
        return;
      }
      case Node::T::set_block: {
        std::string body;
        Flow f = Flow::normal;
        exec(*n.kids[0], sc, body, f);
        Value v = Value::string(std::move(body));
        if (n.kids[1]) v = apply_filter_chain(*n.kids[1], v, sc);
        sc->vars[n.names[0]] = std::move(v);
        return;
      }
      case Node::T::macro:
        sc->vars[n.str] = make_macro(n, sc);
        return;
      case Node::T::call_block: {
        const Node& call = *n.kids[0];
        auto caller_node = std::make_shared<Node>(n);  // params/defaults/body of the caller
        caller_node->t = Node::T::macro;
        caller_node->str = "caller";
        caller_node->kids = {n.kids[1]};
        Value caller = make_macro(*caller_node, sc, caller_node);
        Value callee = eval(*call.kids[0], sc);
        Args a = eval_args(call, sc);
        a.kw.emplace_back("caller", caller);
        emit(out, to_str(invoke(callee, a, call.line)), n.line);
        return;
      }
      case Node::T::filter_block: {
        std::string body;
        Flow f = Flow::normal;
        exec(*n.kids[1], sc, body, f);
        emit(out, to_str(apply_filter_chain(*n.kids[0], Value::string(std::move(body)), sc)),
             n.line);
        return;
      }
      case Node::T::break_:
        flow = Flow::brk;
        return;
      case Node::T::continue_:
        flow = Flow::cont;
        return;
      default:
        fail(n.line, "internal: expression node in a statement position");
    }
  }

  // True when `v` is or holds a namespace or a callable.
  static bool holds_ref(const Value& v, int depth) {
    charge(1);
    if (depth > 4 * kMaxNest) return true;
    if (v.kind == Value::Kind::callable) return true;
    if (v.is_array()) {
      for (const auto& x : *v.arr)
        if (holds_ref(x, depth + 1)) return true;
    } else if (v.is_object()) {
      if (v.obj->ns) return true;
      for (const auto& kv : v.obj->items)
        if (holds_ref(kv.second, depth + 1)) return true;
    }
    return false;
  }

  void emit(std::string& out, const std::string& s, int line) {
    if (out.size() + s.size() > kMaxOutput)
      throw RenderError(fmt::format("the rendered text passed {} MiB", kMaxOutput >> 20), line,
                        RenderError::Why::limit);
    charge(s.size() / 32);
    out += s;
  }

  void assign(const std::vector<std::string>& names, const Value& v, Scope& sc, int line) {
    if (names.size() == 1) {
      sc.vars[names[0]] = v;
      return;
    }
    Array items = iterate(v, line);
    if (items.size() != names.size())
      fail(line, fmt::format("cannot unpack {} values into {} names", items.size(), names.size()));
    for (size_t k = 0; k < names.size(); ++k) sc.vars[names[k]] = items[k];
  }

  void exec_for(const Node& n, const ScopeP& sc, std::string& out, Flow& flow, const Value* given,
                int depth) {
    Value seq = given ? *given : eval(*n.kids[0], sc);
    if (seq.is_none()) fail(n.line, "'NoneType' object is not iterable");
    Array all = iterate(seq, n.line);
    Array items;
    if (n.kids[3]) {
      for (const auto& it : all) {
        ScopeP f = child(sc);
        assign(n.names, it, *f, n.line);
        if (truthy(eval(*n.kids[3], f))) items.push_back(it);
      }
    } else {
      items = std::move(all);
    }
    if (items.empty()) {
      if (n.kids[2]) exec(*n.kids[2], sc, out, flow);
      return;
    }
    const int64_t len = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < len; ++i) {
      charge(16);
      ScopeP it = child(sc);
      Value loop = Value::object();
      auto& o = *loop.obj;
      o.set("index", Value::integer(i + 1));
      o.set("index0", Value::integer(i));
      o.set("revindex", Value::integer(len - i));
      o.set("revindex0", Value::integer(len - i - 1));
      o.set("first", Value::boolean(i == 0));
      o.set("last", Value::boolean(i == len - 1));
      o.set("length", Value::integer(len));
      o.set("depth", Value::integer(depth + 1));
      o.set("depth0", Value::integer(depth));
      o.set("previtem", i > 0 ? items[static_cast<size_t>(i - 1)] : Value::undefined("previtem"));
      o.set("nextitem",
            i + 1 < len ? items[static_cast<size_t>(i + 1)] : Value::undefined("nextitem"));
      o.set("cycle", Value::callable([i](Args& a) {
              if (a.pos.empty()) fail(a.line, "loop.cycle() needs at least one value");
              return a.pos[static_cast<size_t>(i) % a.pos.size()];
            }));
      if (n.flag) {
        const Node* np = &n;
        ScopeP outer = sc;
        o.set("__call__", Value::callable([this, np, outer, depth](Args& a) {
                if (a.pos.size() != 1) fail(a.line, "loop() takes one iterable");
                if (depth + 1 >= kMaxDepth)
                  fail(a.line, fmt::format("recursive loop deeper than {}", kMaxDepth));
                check_stack(a.line);
                std::string sub;
                Flow f = Flow::normal;
                exec_for(*np, outer, sub, f, &a.pos[0], depth + 1);
                return Value::string(std::move(sub));
              }));
      }
      it->vars["loop"] = loop;
      assign(n.names, items[static_cast<size_t>(i)], *it, n.line);
      Flow f = Flow::normal;
      exec(*n.kids[1], it, out, f);
      if (f == Flow::brk) break;
    }
    (void)flow;
  }

  Value make_macro(const Node& n, const ScopeP& defining, std::shared_ptr<Node> keep = nullptr) {
    const Node* np = &n;
    // The defining scope usually holds the macro itself: a weak reference avoids the cycle.
    std::weak_ptr<Scope> weak = defining;
    return Value::callable([this, np, weak, keep](Args& a) {
      ScopeP home = weak.lock();
      if (!home) fail(a.line, fmt::format("macro '{}' called outside its scope", np->str));
      if (depth_ + 1 > kMaxDepth)
        fail(a.line, fmt::format("macro '{}' recursed deeper than {}", np->str, kMaxDepth));
      check_stack(a.line);
      ++depth_;
      ScopeP s = child(home);
      const auto& params = np->names;
      if (a.pos.size() > params.size())
        fail(a.line, fmt::format("macro '{}' takes {} arguments, got {}", np->str, params.size(),
                                 a.pos.size()));
      std::set<std::string> bound;
      for (size_t k = 0; k < a.pos.size(); ++k) {
        s->vars[params[k]] = a.pos[k];
        bound.insert(params[k]);
      }
      for (const auto& [k, v] : a.kw) {
        if (k == "caller") {
          s->vars["caller"] = v;
          continue;
        }
        if (std::find(params.begin(), params.end(), k) == params.end())
          fail(a.line, fmt::format("macro '{}' has no parameter '{}'", np->str, k));
        s->vars[k] = v;
        bound.insert(k);
      }
      for (const auto& p : params) {
        if (bound.count(p)) continue;
        s->vars[p] = Value::undefined(p);
        for (const auto& [k, d] : np->kw)
          if (k == p) s->vars[p] = eval(*d, s);
      }
      std::string body;
      Flow f = Flow::normal;
      exec(*np->kids[0], s, body, f);
      --depth_;
      return Value::string(std::move(body));
    });
  }

  Args eval_args(const Node& n, const ScopeP& sc, size_t first = 1) {
    Args a;
    a.line = n.line;
    for (size_t k = first; k < n.kids.size(); ++k) a.pos.push_back(eval(*n.kids[k], sc));
    for (const auto& [k, e] : n.kw) a.kw.emplace_back(k, eval(*e, sc));
    return a;
  }

  Value invoke(const Value& f, Args& a, int line) {
    if (f.kind == Value::Kind::callable) return (*f.fn)(a);
    if (f.is_object())
      if (const Value* c = f.obj->find("__call__"); c && c->kind == Value::Kind::callable)
        return (*c->fn)(a);
    if (f.is_undefined()) undefined_error(f, line);
    fail(line, fmt::format("'{}' object is not callable", kind_name(f)));
  }

  // ---- expressions ----
  Value eval(const Node& n, const ScopeP& sc) {
    if (t_budget) t_budget->line = n.line;
    charge(1);
    switch (n.t) {
      case Node::T::literal:
        return n.lit;
      case Node::T::name: {
        if (const Value* v = sc->find(n.str)) return *v;
        return Value::undefined(n.str);
      }
      case Node::T::list:
      case Node::T::tuple: {
        Array a;
        for (const auto& k : n.kids) a.push_back(eval(*k, sc));
        return Value::array(std::move(a));
      }
      case Node::T::dict: {
        Value o = Value::object();
        for (size_t k = 0; k + 1 < n.kids.size(); k += 2) {
          Value key = eval(*n.kids[k], sc);
          o.obj->set(key.is_string() ? key.s : to_str(key), eval(*n.kids[k + 1], sc));
        }
        return o;
      }
      case Node::T::getattr:
        return getattr(eval(*n.kids[0], sc), n.str, n.line);
      case Node::T::getitem:
        return getitem(eval(*n.kids[0], sc), eval(*n.kids[1], sc), n.line);
      case Node::T::slice:
        return slice(n, sc);
      case Node::T::call: {
        Value f = eval(*n.kids[0], sc);
        Args a = eval_args(n, sc);
        return invoke(f, a, n.line);
      }
      case Node::T::filter: {
        Value v = n.kids[0] ? eval(*n.kids[0], sc) : Value::undefined();
        Args a = eval_args(n, sc);
        return filter(n.str, v, a, sc);
      }
      case Node::T::test: {
        Value v = eval(*n.kids[0], sc);
        Args a = eval_args(n, sc);
        bool r = test(n.str, v, a);
        return Value::boolean(n.flag ? !r : r);
      }
      case Node::T::not_:
        return Value::boolean(!truthy(eval(*n.kids[0], sc)));
      case Node::T::neg:
      case Node::T::pos: {
        Value v = eval(*n.kids[0], sc);
        if (!v.is_number()) {
          if (v.is_undefined()) undefined_error(v, n.line);
          fail(n.line, fmt::format("bad operand type for unary {}: '{}'",
                                   n.t == Node::T::neg ? '-' : '+', kind_name(v)));
        }
        if (n.t == Node::T::pos) return v;
        if (is_int_like(v)) return Value::integer(-ival(v));
        return Value::floating(-v.f);
      }
      case Node::T::and_: {
        Value l = eval(*n.kids[0], sc);
        return truthy(l) ? eval(*n.kids[1], sc) : l;
      }
      case Node::T::or_: {
        Value l = eval(*n.kids[0], sc);
        return truthy(l) ? l : eval(*n.kids[1], sc);
      }
      case Node::T::cond:
        if (truthy(eval(*n.kids[1], sc))) return eval(*n.kids[0], sc);
        return n.kids[2] ? eval(*n.kids[2], sc) : Value::undefined();
      case Node::T::binop:
        return binop(n.str, eval(*n.kids[0], sc), eval(*n.kids[1], sc), n.line);
      default:
        fail(n.line, "internal: statement node in an expression position");
    }
  }

  Value binop(const std::string& op, const Value& a, const Value& b, int line) {
    if (op == "~") {
      std::string l = to_str(a), r = to_str(b);
      check_text(l.size() + r.size());
      return Value::string(l + r);
    }
    if (op == "==") return Value::boolean(equals(a, b));
    if (op == "!=") return Value::boolean(!equals(a, b));
    if (op == "in") return Value::boolean(contains(b, a, line));
    if (op == "notin") return Value::boolean(!contains(b, a, line));
    if (op == "<") return Value::boolean(compare(a, b, line) < 0);
    if (op == ">") return Value::boolean(compare(a, b, line) > 0);
    if (op == "<=") return Value::boolean(compare(a, b, line) <= 0);
    if (op == ">=") return Value::boolean(compare(a, b, line) >= 0);
    if (a.is_undefined()) undefined_error(a, line);
    if (b.is_undefined()) undefined_error(b, line);
    auto type_error = [&]() -> Value {
      fail(line, fmt::format("unsupported operand types for {}: '{}' and '{}'", op, kind_name(a),
                             kind_name(b)));
    };
    if (op == "+") {
      if (a.is_string() && b.is_string()) {
        check_text(a.s.size() + b.s.size());
        return Value::string(a.s + b.s);
      }
      if (a.is_array() && b.is_array()) {
        check_items(a.arr->size() + b.arr->size());
        charge_copy(*a.arr);
        charge_copy(*b.arr);
        Array r = *a.arr;
        r.insert(r.end(), b.arr->begin(), b.arr->end());
        return Value::array(std::move(r));
      }
    }
    if (op == "*") {
      const Value* seq = a.is_string() || a.is_array()   ? &a
                         : b.is_string() || b.is_array() ? &b
                                                         : nullptr;
      const Value* cnt = seq == &a ? &b : &a;
      if (seq && is_int_like(*cnt)) {
        int64_t k = std::max<int64_t>(0, ival(*cnt));
        if (seq->is_string()) {
          check_text(mul_sat(static_cast<size_t>(k), seq->s.size()));
          std::string r;
          for (int64_t q = 0; q < k; ++q) r += seq->s;
          return Value::string(std::move(r));
        }
        check_items(mul_sat(static_cast<size_t>(k), seq->arr->size()));
        for (int64_t q = 0; q < k; ++q) charge_copy(*seq->arr);
        Array r;
        for (int64_t q = 0; q < k; ++q) r.insert(r.end(), seq->arr->begin(), seq->arr->end());
        return Value::array(std::move(r));
      }
    }
    if (op == "%" && a.is_string()) return Value::string(percent_format(a.s, b, line));
    if (!a.is_number() || !b.is_number()) return type_error();
    bool ints = is_int_like(a) && is_int_like(b);
    if (op == "+")
      return ints ? Value::integer(ival(a) + ival(b)) : Value::floating(num(a) + num(b));
    if (op == "-")
      return ints ? Value::integer(ival(a) - ival(b)) : Value::floating(num(a) - num(b));
    if (op == "*")
      return ints ? Value::integer(ival(a) * ival(b)) : Value::floating(num(a) * num(b));
    if (op == "/") {
      if (num(b) == 0) fail(line, "division by zero");
      return Value::floating(num(a) / num(b));
    }
    if (op == "//" || op == "%") {
      if (num(b) == 0) fail(line, "integer division or modulo by zero");
      if (ints) {
        int64_t x = ival(a), y = ival(b);
        int64_t q = x / y, r = x % y;
        if (r != 0 && ((r < 0) != (y < 0))) {
          --q;
          r += y;
        }
        return op == "//" ? Value::integer(q) : Value::integer(r);
      }
      double q = std::floor(num(a) / num(b));
      return op == "//" ? Value::floating(q) : Value::floating(num(a) - q * num(b));
    }
    if (op == "**") {
      if (ints && ival(b) >= 0) {
        int64_t r = 1;
        for (int64_t q = 0; q < ival(b) && q < 64; ++q) r *= ival(a);
        return Value::integer(r);
      }
      return Value::floating(std::pow(num(a), num(b)));
    }
    return type_error();
  }

  // "%s" % x, "%d" % x, "%(name)s" is not supported.
  std::string percent_format(const std::string& f, const Value& args, int line) {
    Array vals = args.is_array() ? *args.arr : Array{args};
    size_t next = 0;
    std::string out;
    for (size_t i = 0; i < f.size(); ++i) {
      if (f[i] != '%') {
        out += f[i];
        continue;
      }
      if (++i >= f.size()) fail(line, "incomplete format");
      char c = f[i];
      if (c == '%') {
        out += '%';
        continue;
      }
      if (next >= vals.size()) fail(line, "not enough arguments for format string");
      const Value& v = vals[next++];
      if (out.size() > kMaxOutput) check_text(out.size());
      charge(1);
      if (c == 's')
        out += to_str(v);
      else if (c == 'r')
        out += v.is_string() ? to_json(v, -1, ", ", ": ", false) : to_str(v);
      else if (c == 'd' || c == 'i')
        out += v.is_number() ? std::to_string(static_cast<int64_t>(num(v))) : to_str(v);
      else
        fail(line, fmt::format("format '%{}' is not supported", c));
    }
    return out;
  }

  Value getattr(const Value& v, const std::string& name, int line) {
    switch (v.kind) {
      case Value::Kind::undefined:
        undefined_error(v, line);
      case Value::Kind::object: {
        if (!v.obj->ns && kDictMethods.count(name)) return method(v, name);
        if (const Value* x = v.obj->find(name)) return *x;
        return Value::undefined(name);
      }
      case Value::Kind::string:
        if (kStringMethods.count(name)) return method(v, name);
        return Value::undefined(name);
      case Value::Kind::array:
        if (kListMethods.count(name)) return method(v, name);
        return Value::undefined(name);
      default:
        return Value::undefined(name);
    }
  }

  Value getitem(const Value& v, const Value& key, int line) {
    switch (v.kind) {
      case Value::Kind::undefined:
        undefined_error(v, line);
      case Value::Kind::object:
        if (key.is_string()) {
          if (const Value* x = v.obj->find(key.s)) return *x;
          if (!v.obj->ns && kDictMethods.count(key.s)) return method(v, key.s);
          return Value::undefined(key.s);
        }
        return Value::undefined(to_str(key));
      case Value::Kind::array: {
        if (!is_int_like(key)) return Value::undefined();
        int64_t k = ival(key), n = static_cast<int64_t>(v.arr->size());
        if (k < 0) k += n;
        if (k < 0 || k >= n) return Value::undefined(fmt::format("[{}]", ival(key)));
        return (*v.arr)[static_cast<size_t>(k)];
      }
      case Value::Kind::string: {
        if (key.is_string()) return getattr(v, key.s, line);
        if (!is_int_like(key)) return Value::undefined();
        std::u32string u = cps(v.s);
        int64_t k = ival(key), n = static_cast<int64_t>(u.size());
        if (k < 0) k += n;
        if (k < 0 || k >= n) return Value::undefined();
        return Value::string(utf8(u.substr(static_cast<size_t>(k), 1)));
      }
      default:
        return Value::undefined();
    }
  }

  Value slice(const Node& n, const ScopeP& sc) {
    Value v = eval(*n.kids[0], sc);
    auto opt = [&](const NodeP& k) -> std::optional<int64_t> {
      if (!k) return std::nullopt;
      Value x = eval(*k, sc);
      if (x.is_none()) return std::nullopt;
      if (!is_int_like(x)) fail(n.line, "slice indices must be integers or None");
      return ival(x);
    };
    auto start = opt(n.kids[1]), stop = opt(n.kids[2]), step_o = opt(n.kids[3]);
    int64_t step = step_o.value_or(1);
    if (step == 0) fail(n.line, "slice step cannot be zero");
    auto pick = [&](int64_t len, std::vector<int64_t>& idx) {
      uint64_t astep = step > 0 ? static_cast<uint64_t>(step) : 0 - static_cast<uint64_t>(step);
      charge(static_cast<uint64_t>(len) / astep + 1);
      auto norm = [&](std::optional<int64_t> x, int64_t def, int64_t lo, int64_t hi) {
        if (!x) return def;
        int64_t y = *x < 0 ? *x + len : *x;
        return std::clamp(y, lo, hi);
      };
      if (step > 0) {
        int64_t b = norm(start, 0, 0, len), e = norm(stop, len, 0, len);
        for (int64_t k = b; k < e; k += step) idx.push_back(k);
      } else {
        int64_t b = norm(start, len - 1, -1, len - 1), e = norm(stop, -1, -1, len - 1);
        for (int64_t k = b; k > e; k += step) idx.push_back(k);
      }
    };
    std::vector<int64_t> idx;
    if (v.is_array()) {
      pick(static_cast<int64_t>(v.arr->size()), idx);
      Array r;
      for (int64_t k : idx) r.push_back((*v.arr)[static_cast<size_t>(k)]);
      return Value::array(std::move(r));
    }
    if (v.is_string()) {
      std::u32string u = cps(v.s), r;
      pick(static_cast<int64_t>(u.size()), idx);
      for (int64_t k : idx) r += u[static_cast<size_t>(k)];
      return Value::string(utf8(r));
    }
    if (v.is_undefined()) undefined_error(v, n.line);
    fail(n.line, fmt::format("'{}' object is not subscriptable", kind_name(v)));
  }

  // A bound method of a string, dict or list.
  Value method(const Value& self, const std::string& name) {
    return Value::callable([this, self, name](Args& a) { return call_method(self, name, a); });
  }

  Value call_method(const Value& self, const std::string& name, Args& a) {
    ArgReader r{a, name};
    int line = a.line;
    if (self.is_object()) {
      if (name == "get") {
        Value k = r.val(0, "key");
        if (k.is_string())
          if (const Value* x = self.obj->find(k.s)) return *x;
        return r.val(1, "default", Value::none());
      }
      check_items(self.obj->items.size());
      Array out;
      for (const auto& [k, v] : self.obj->items) {
        if (name == "items")
          out.push_back(Value::array({Value::string(k), v}));
        else if (name == "keys")
          out.push_back(Value::string(k));
        else
          out.push_back(v);
      }
      return Value::array(std::move(out));
    }
    if (self.is_array()) {
      Value x = r.val(0, "value");
      int64_t n = 0, first = -1;
      for (size_t k = 0; k < self.arr->size(); ++k)
        if (equals((*self.arr)[k], x)) {
          if (first < 0) first = static_cast<int64_t>(k);
          ++n;
        }
      if (name == "count") return Value::integer(n);
      if (first < 0) fail(line, "list.index(x): x not in list");
      return Value::integer(first);
    }
    const std::string& s = self.s;
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      const Value* c = r.get(0, "chars");
      return Value::string(strip_chars(s, c, name != "rstrip", name != "lstrip"));
    }
    if (name == "split" || name == "rsplit") {
      const Value* sep = r.get(0, "sep");
      Array out;
      for (auto& p : py_split(s, sep, r.integer(1, "maxsplit", -1), name == "rsplit", line))
        out.push_back(Value::string(std::move(p)));
      return Value::array(std::move(out));
    }
    if (name == "splitlines") {
      Array out;
      for (auto& p : py_splitlines(s, r.boolean(0, "keepends", false)))
        out.push_back(Value::string(std::move(p)));
      return Value::array(std::move(out));
    }
    if (name == "startswith" || name == "endswith") {
      Value p = r.val(0, "prefix");
      Array opts = p.is_array() ? *p.arr : Array{p};
      for (const auto& o : opts) {
        if (!o.is_string()) fail(line, fmt::format("{}(): the argument must be a string", name));
        if (name == "startswith" ? s.starts_with(o.s) : s.ends_with(o.s))
          return Value::boolean(true);
      }
      return Value::boolean(false);
    }
    if (name == "upper" || name == "lower") return Value::string(icu_case(s, name == "upper"));
    if (name == "title") return Value::string(py_title(s));
    if (name == "capitalize") return Value::string(py_capitalize(s));
    if (name == "replace")
      return Value::string(
          py_replace(s, r.str(0, "old", ""), r.str(1, "new", ""), r.integer(2, "count", -1)));
    if (name == "find" || name == "rfind" || name == "index" || name == "count") {
      std::string sub = r.str(0, "sub", "");
      if (name == "count") {
        if (sub.empty()) return Value::integer(static_cast<int64_t>(cp_len(s)) + 1);
        int64_t n = 0;
        for (size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++n;
        return Value::integer(n);
      }
      size_t p = name == "rfind" ? s.rfind(sub) : s.find(sub);
      if (p == std::string::npos) {
        if (name == "index") fail(line, "substring not found");
        return Value::integer(-1);
      }
      return Value::integer(static_cast<int64_t>(cp_len(s.substr(0, p))));
    }
    if (name == "join") {
      std::string out;
      bool first = true;
      for (const auto& x : iterate(r.val(0, "iterable"), line)) {
        if (!x.is_string()) fail(line, "str.join(): items must be strings");
        check_text(out.size() + s.size() + x.s.size() > kMaxOutput
                       ? out.size() + s.size() + x.s.size()
                       : (s.size() + x.s.size()));
        if (!first) out += s;
        first = false;
        out += x.s;
      }
      return Value::string(std::move(out));
    }
    if (name == "format") return Value::string(str_format(s, a));
    if (name == "removeprefix") {
      std::string p = r.str(0, "prefix", "");
      return Value::string(s.starts_with(p) ? s.substr(p.size()) : s);
    }
    if (name == "removesuffix") {
      std::string p = r.str(0, "suffix", "");
      return Value::string(!p.empty() && s.ends_with(p) ? s.substr(0, s.size() - p.size()) : s);
    }
    // is* predicates
    std::u32string u = cps(s);
    if (u.empty()) return Value::boolean(false);
    bool ok = true, any_cased = false;
    for (char32_t c : u) {
      UChar32 x = static_cast<UChar32>(c);
      if (name == "isdigit") ok = ok && u_isdigit(x);
      if (name == "isalpha") ok = ok && u_isalpha(x);
      if (name == "isalnum") ok = ok && (u_isalpha(x) || u_isdigit(x));
      if (name == "isspace") ok = ok && py_space(c);
      if (name == "islower" || name == "isupper") {
        if (cased(c)) {
          any_cased = true;
          ok = ok && (name == "islower" ? u_islower(x) : u_isupper(x));
        }
      }
    }
    if (name == "islower" || name == "isupper") ok = ok && any_cased;
    return Value::boolean(ok);
  }

  // str.format with {} / {0} / {name} fields (no format specs beyond none).
  std::string str_format(const std::string& f, const Args& a) {
    std::string out;
    size_t auto_idx = 0;
    for (size_t i = 0; i < f.size(); ++i) {
      char c = f[i];
      if (c == '{' && i + 1 < f.size() && f[i + 1] == '{') {
        out += '{';
        ++i;
        continue;
      }
      if (c == '}' && i + 1 < f.size() && f[i + 1] == '}') {
        out += '}';
        ++i;
        continue;
      }
      if (c != '{') {
        out += c;
        continue;
      }
      size_t e = f.find('}', i);
      if (e == std::string::npos) fail(a.line, "format(): '{' is never closed");
      std::string field = f.substr(i + 1, e - i - 1);
      i = e;
      if (field.find(':') != std::string::npos || field.find('!') != std::string::npos)
        fail(a.line, "format(): format specs are not supported");
      const Value* v = nullptr;
      if (field.empty()) {
        if (auto_idx < a.pos.size()) v = &a.pos[auto_idx++];
      } else if (std::all_of(field.begin(), field.end(), ::isdigit)) {
        size_t k = std::stoul(field);
        if (k < a.pos.size()) v = &a.pos[k];
      } else {
        for (const auto& [k, x] : a.kw)
          if (k == field) v = &x;
      }
      if (!v) fail(a.line, fmt::format("format(): no argument for {{{}}}", field));
      std::string piece = to_str(*v);
      check_text(piece.size());
      if (out.size() + piece.size() > kMaxOutput) check_text(out.size() + piece.size());
      out += piece;
    }
    return out;
  }

  Value apply_filter_chain(const Node& chain, Value v, const ScopeP& sc) {
    // The chain's innermost operand is null: rebuild the application order.
    std::vector<const Node*> order;
    for (const Node* p = &chain; p && p->t == Node::T::filter; p = p->kids[0].get())
      order.push_back(p);
    for (auto it = order.rbegin(); it != order.rend(); ++it) {
      Args a = eval_args(**it, sc);
      v = filter((*it)->str, v, a, sc);
    }
    return v;
  }

  // Dotted attribute path ("a.b") as Jinja's make_attrgetter does (item lookup, then attr).
  Value attr_path(const Value& v, const std::string& path, int line) {
    Value cur = v;
    size_t i = 0;
    while (i <= path.size()) {
      size_t d = path.find('.', i);
      std::string part = path.substr(i, d == std::string::npos ? std::string::npos : d - i);
      bool digits = !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit);
      if (cur.is_undefined()) return cur;
      cur = digits ? getitem(cur, Value::integer(std::stoll(part)), line)
                   : getitem(cur, Value::string(part), line);
      if (d == std::string::npos) break;
      i = d + 1;
    }
    return cur;
  }

  Value filter(const std::string& name, const Value& v, Args& a, const ScopeP& sc) {
    ArgReader r{a, name};
    int line = a.line;
    auto need_str = [&]() -> const std::string& {
      if (v.is_undefined()) undefined_error(v, line);
      if (!v.is_string())
        fail(line, fmt::format("filter '{}' expects a string, got {}", name, kind_name(v)));
      return v.s;
    };
    if (name == "tojson") {
      int indent = -1;
      if (const Value* x = r.get(0, "indent"); x && !x->is_none() && !x->is_undefined())
        indent = static_cast<int>(std::clamp<int64_t>(ival(*x), -1, int64_t{1} << 28));
      std::string isep = indent >= 0 ? "," : ", ", ksep = ": ";
      if (const Value* s = r.get(99, "separators"); s && s->is_array() && s->arr->size() == 2) {
        isep = to_str((*s->arr)[0]);
        ksep = to_str((*s->arr)[1]);
      }
      return Value::string(to_json(v, indent, isep, ksep, r.boolean(99, "sort_keys", false)));
    }
    if (name == "length" || name == "count") return Value::integer(length(v, line));
    if (name == "string") return Value::string(to_str(v));
    if (name == "safe" || name == "e" || name == "escape" || name == "forceescape") {
      if (name == "safe") return v.is_string() ? v : Value::string(to_str(v));
      std::string s = to_str(v), out;
      size_t grown = s.size();
      for (char c : s)
        grown += c == '&' || c == '"' || c == '\'' ? 4 : c == '<' || c == '>' ? 3 : 0;
      check_text(grown);
      for (char c : s) {
        switch (c) {
          case '&':
            out += "&amp;";
            break;
          case '<':
            out += "&lt;";
            break;
          case '>':
            out += "&gt;";
            break;
          case '"':
            out += "&#34;";
            break;
          case '\'':
            out += "&#39;";
            break;
          default:
            out += c;
        }
      }
      return Value::string(std::move(out));
    }
    if (name == "trim") {
      const Value* c = r.get(0, "chars");
      return Value::string(strip_chars(to_str(v), c, true, true));
    }
    if (name == "upper" || name == "lower")
      return Value::string(icu_case(to_str(v), name == "upper"));
    if (name == "capitalize") return Value::string(py_capitalize(to_str(v)));
    if (name == "title") {  // Jinja: capitalize each word split on [-\s({\[<]+
      std::u32string u = cps(to_str(v));
      std::string out;
      bool start = true;
      for (char32_t c : u) {
        bool sep = c == '-' || py_space(c) || c == '(' || c == '{' || c == '[' || c == '<';
        if (sep) {
          utf8_append(out, c);
          start = true;
        } else {
          out += cp_case(c, start ? 1 : 0);
          start = false;
        }
      }
      return Value::string(std::move(out));
    }
    if (name == "replace") {
      std::string s = to_str(v);
      return Value::string(py_replace(s, to_str(r.val(0, "old")), to_str(r.val(1, "new")),
                                      r.integer(2, "count", -1)));
    }
    if (name == "default" || name == "d") {
      bool boolean = r.boolean(1, "boolean", false);
      if (v.is_undefined() || (boolean && !truthy(v)))
        return r.val(0, "default_value", Value::string(""));
      return v;
    }
    if (name == "join") {
      std::string sep = to_str(r.val(0, "d", Value::string(""))), out;
      Value attr = r.val(1, "attribute");
      bool first = true;
      for (const auto& x : iterate(v, line)) {
        std::string piece = to_str(attr.is_undefined() ? x : attr_path(x, to_str(attr), line));
        check_text(out.size() + sep.size() + piece.size() > kMaxOutput
                       ? out.size() + sep.size() + piece.size()
                       : (sep.size() + piece.size()));
        if (!first) out += sep;
        first = false;
        out += piece;
      }
      return Value::string(std::move(out));
    }
    if (name == "first" || name == "last") {
      Array items = iterate(v, line);
      if (items.empty()) return Value::undefined(name);
      return name == "first" ? items.front() : items.back();
    }
    if (name == "list") return Value::array(iterate(v, line));
    if (name == "reverse") {
      if (v.is_string()) {
        std::u32string u = cps(v.s);
        std::reverse(u.begin(), u.end());
        return Value::string(utf8(u));
      }
      Array items = iterate(v, line);
      std::reverse(items.begin(), items.end());
      return Value::array(std::move(items));
    }
    if (name == "unique") {
      Array out;
      for (const auto& x : iterate(v, line)) {
        bool seen = false;
        for (const auto& y : out) seen = seen || equals(x, y);
        if (!seen) out.push_back(x);
      }
      return Value::array(std::move(out));
    }
    if (name == "sort") {
      Array items = iterate(v, line);
      bool rev = r.boolean(0, "reverse", false);
      bool cs = r.boolean(1, "case_sensitive", false);
      Value attr = r.val(2, "attribute");
      auto key = [&](const Value& x) {
        Value k = attr.is_undefined() ? x : attr_path(x, to_str(attr), line);
        if (!cs && k.is_string()) k.s = icu_case(k.s, false);
        return k;
      };
      std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
        int c = compare(key(x), key(y), line);
        return rev ? c > 0 : c < 0;
      });
      return Value::array(std::move(items));
    }
    if (name == "dictsort") {
      if (!v.is_object()) fail(line, "dictsort expects a dict");
      bool cs = r.boolean(0, "case_sensitive", false);
      std::string by = r.str(1, "by", "key");
      bool rev = r.boolean(2, "reverse", false);
      Array items;
      for (const auto& [k, x] : v.obj->items) items.push_back(Value::array({Value::string(k), x}));
      size_t pos = by == "value" ? 1 : 0;
      std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
        Value kx = (*x.arr)[pos], ky = (*y.arr)[pos];
        if (!cs && kx.is_string()) kx.s = icu_case(kx.s, false);
        if (!cs && ky.is_string()) ky.s = icu_case(ky.s, false);
        int c = compare(kx, ky, line);
        return rev ? c > 0 : c < 0;
      });
      return Value::array(std::move(items));
    }
    if (name == "items") {
      if (v.is_undefined()) return Value::array();
      if (!v.is_object()) fail(line, "filter 'items' expects a dict");
      Args none;
      none.line = line;
      return call_method(v, "items", none);
    }
    if (name == "selectattr" || name == "rejectattr" || name == "select" || name == "reject") {
      bool attr_mode = name == "selectattr" || name == "rejectattr";
      bool want = name == "selectattr" || name == "select";
      std::string attr = attr_mode ? to_str(r.val(0, "attr")) : "";
      size_t tpos = attr_mode ? 1 : 0;
      Value tname = tpos < a.pos.size() ? a.pos[tpos] : Value::undefined();
      Args targs;
      targs.line = line;
      for (size_t k = tpos + 1; k < a.pos.size(); ++k) targs.pos.push_back(a.pos[k]);
      Array out;
      for (const auto& x : iterate(v, line)) {
        Value probe = attr_mode ? attr_path(x, attr, line) : x;
        bool ok = tname.is_undefined() ? truthy(probe) : test(to_str(tname), probe, targs);
        if (ok == want) out.push_back(x);
      }
      return Value::array(std::move(out));
    }
    if (name == "map") {
      Array out;
      const Value* attr = nullptr;
      for (const auto& [k, x] : a.kw)
        if (k == "attribute") attr = &x;
      if (attr) {
        Value def = r.val(99, "default");
        for (const auto& x : iterate(v, line)) {
          Value y = attr_path(x, to_str(*attr), line);
          out.push_back(y.is_undefined() && !def.is_undefined() ? def : y);
        }
        return Value::array(std::move(out));
      }
      if (a.pos.empty()) fail(line, "map() needs a filter name or attribute=");
      std::string fname = to_str(a.pos[0]);
      Args fargs;
      fargs.line = line;
      fargs.pos.assign(a.pos.begin() + 1, a.pos.end());
      for (const auto& x : iterate(v, line)) {
        Args copy = fargs;
        out.push_back(filter(fname, x, copy, sc));
      }
      return Value::array(std::move(out));
    }
    if (name == "indent") {
      std::string s = to_str(v);
      Value w = r.val(0, "width", Value::integer(4));
      if (!w.is_string() && !is_int_like(w))
        fail(line, "indent(): 'width' must be an integer or a string");
      size_t wn = w.is_string() ? w.s.size() : static_cast<size_t>(std::max<int64_t>(0, ival(w)));
      check_text(wn);
      std::string ind = w.is_string() ? w.s : std::string(wn, ' ');
      bool first = r.boolean(1, "first", false), blank = r.boolean(2, "blank", false);
      s += "\n";
      std::vector<std::string> lines = py_splitlines(s, false);
      check_text(s.size() + mul_sat(lines.size() + 1, ind.size()));
      std::string rv;
      if (blank) {
        for (size_t k = 0; k < lines.size(); ++k) rv += (k ? "\n" + ind : "") + lines[k];
      } else {
        rv = lines.empty() ? "" : lines[0];
        for (size_t k = 1; k < lines.size(); ++k)
          rv += "\n" + (lines[k].empty() ? lines[k] : ind + lines[k]);
      }
      if (first) rv = ind + rv;
      return Value::string(std::move(rv));
    }
    if (name == "int") {
      int64_t def = r.integer(0, "default", 0);
      if (is_int_like(v)) return Value::integer(ival(v));
      if (v.kind == Value::Kind::floating) return Value::integer(static_cast<int64_t>(v.f));
      if (v.is_string()) {
        std::string s = strip_chars(v.s, nullptr, true, true);
        char* end = nullptr;
        long long x = std::strtoll(s.c_str(), &end, 10);
        if (!s.empty() && *end == 0) return Value::integer(x);
        double d = std::strtod(s.c_str(), &end);
        if (!s.empty() && *end == 0) return Value::integer(static_cast<int64_t>(d));
      }
      return Value::integer(def);
    }
    if (name == "float") {
      Value def = r.val(0, "default", Value::floating(0));
      if (v.is_number()) return Value::floating(num(v));
      if (v.is_string()) {
        std::string s = strip_chars(v.s, nullptr, true, true);
        char* end = nullptr;
        double d = std::strtod(s.c_str(), &end);
        if (!s.empty() && *end == 0) return Value::floating(d);
      }
      return def;
    }
    if (name == "abs") {
      if (!v.is_number()) fail(line, "abs() expects a number");
      return is_int_like(v) ? Value::integer(std::llabs(ival(v))) : Value::floating(std::fabs(v.f));
    }
    if (name == "round") {
      int64_t prec = r.integer(0, "precision", 0);
      std::string method = r.str(1, "method", "common");
      double m = std::pow(10.0, static_cast<double>(prec)), x = num(v) * m;
      x = method == "floor" ? std::floor(x) : method == "ceil" ? std::ceil(x) : std::round(x);
      return Value::floating(x / m);
    }
    if (name == "sum") {
      Value attr = r.val(0, "attribute");
      Value acc = r.val(1, "start", Value::integer(0));
      for (const auto& x : iterate(v, line))
        acc = binop("+", acc, attr.is_undefined() ? x : attr_path(x, to_str(attr), line), line);
      return acc;
    }
    if (name == "min" || name == "max") {
      Array items = iterate(v, line);
      if (items.empty()) return Value::undefined(name);
      Value best = items[0];
      for (const auto& x : items) {
        int c = compare(x, best, line);
        if (name == "min" ? c < 0 : c > 0) best = x;
      }
      return best;
    }
    if (name == "wordcount")
      return Value::integer(
          static_cast<int64_t>(py_split(to_str(v), nullptr, -1, false, line).size()));
    if (name == "attr") return getattr(v, to_str(r.val(0, "name")), line);
    if (name == "bool") return Value::boolean(truthy(v));
    if (name == "format")
      return Value::string(percent_format(need_str(), Value::array(a.pos), line));
    if (name == "center") {
      std::string s = to_str(v);
      int64_t w = r.integer(0, "width", 80), n = static_cast<int64_t>(cp_len(s));
      if (w <= n) return Value::string(s);
      check_text(s.size() + static_cast<size_t>(w - n));
      int64_t left = (w - n) / 2 + ((w - n) % 2 && w % 2 ? 1 : 0);
      return Value::string(std::string(static_cast<size_t>(left), ' ') + s +
                           std::string(static_cast<size_t>(w - n - left), ' '));
    }
    fail(line, fmt::format("filter '{}' is not supported", name));
  }

  bool test(const std::string& name, const Value& v, Args& a) {
    int line = a.line;
    auto arg = [&]() -> const Value& {
      if (a.pos.empty()) fail(line, fmt::format("test '{}' needs an argument", name));
      return a.pos[0];
    };
    if (name == "defined") return !v.is_undefined();
    if (name == "undefined") return v.is_undefined();
    if (name == "none") return v.is_none();
    if (name == "boolean") return v.kind == Value::Kind::boolean;
    if (name == "true") return v.kind == Value::Kind::boolean && v.b;
    if (name == "false") return v.kind == Value::Kind::boolean && !v.b;
    if (name == "integer") return v.kind == Value::Kind::integer;
    if (name == "float") return v.kind == Value::Kind::floating;
    if (name == "number") return v.is_number();
    if (name == "string") return v.is_string();
    if (name == "mapping") return v.is_object();
    if (name == "iterable")
      return v.is_string() || v.is_array() || v.is_object() || v.is_undefined();
    if (name == "sequence") return v.is_string() || v.is_array() || v.is_object();
    if (name == "callable") return v.kind == Value::Kind::callable;
    if (name == "equalto" || name == "eq" || name == "==") return equals(v, arg());
    if (name == "ne" || name == "!=") return !equals(v, arg());
    if (name == "lt" || name == "lessthan" || name == "<") return compare(v, arg(), line) < 0;
    if (name == "le" || name == "<=") return compare(v, arg(), line) <= 0;
    if (name == "gt" || name == "greaterthan" || name == ">") return compare(v, arg(), line) > 0;
    if (name == "ge" || name == ">=") return compare(v, arg(), line) >= 0;
    if (name == "in") return contains(arg(), v, line);
    if (name == "sameas") {
      const Value& o = arg();
      if (v.kind != o.kind) return false;
      if (v.is_object()) return v.obj == o.obj;
      if (v.is_array()) return v.arr == o.arr;
      return equals(v, o);
    }
    if (name == "odd" || name == "even" || name == "divisibleby") {
      if (!is_int_like(v)) fail(line, fmt::format("test '{}' expects an integer", name));
      int64_t x = ival(v);
      if (name == "odd") return x % 2 != 0;
      if (name == "even") return x % 2 == 0;
      int64_t d = ival(arg());
      if (d == 0) fail(line, "divisibleby(0)");
      return x % d == 0;
    }
    if (name == "lower" || name == "upper") {
      if (!v.is_string()) return false;
      return icu_case(v.s, name == "upper") == v.s;
    }
    fail(line, fmt::format("test '{}' is not supported", name));
  }

  int depth_ = 0;
};

Value global_namespace(Args& a) {
  Value o = Value::object();
  o.obj->ns = true;
  for (const auto& p : a.pos) {
    if (!p.is_object()) fail(a.line, "namespace() takes a dict or keyword arguments");
    for (const auto& kv : p.obj->items) o.obj->set(kv.first, kv.second);
  }
  for (const auto& [k, v] : a.kw) o.obj->set(k, v);
  return o;
}

}  // namespace

const std::set<std::string, std::less<>>& known_filters() {
  static const std::set<std::string, std::less<>> s = {
      "tojson",      "length", "count",    "string",    "safe",       "e",          "escape",
      "forceescape", "trim",   "upper",    "lower",     "capitalize", "title",      "replace",
      "default",     "d",      "join",     "first",     "last",       "list",       "reverse",
      "unique",      "sort",   "dictsort", "items",     "selectattr", "rejectattr", "select",
      "reject",      "map",    "indent",   "int",       "float",      "abs",        "round",
      "sum",         "min",    "max",      "wordcount", "attr",       "bool",       "format",
      "center"};
  return s;
}
const std::set<std::string, std::less<>>& known_tests() {
  static const std::set<std::string, std::less<>> s = {
      "defined", "undefined",   "none",    "boolean",  "true",     "false",    "integer", "float",
      "number",  "string",      "mapping", "iterable", "sequence", "callable", "equalto", "eq",
      "==",      "ne",          "!=",      "lt",       "lessthan", "<",        "le",      "<=",
      "gt",      "greaterthan", ">",       "ge",       ">=",       "in",       "sameas",  "odd",
      "even",    "divisibleby", "lower",   "upper"};
  return s;
}
const std::set<std::string, std::less<>>& known_methods() {
  static const std::set<std::string, std::less<>> s = [] {
    std::set<std::string, std::less<>> all(kStringMethods.begin(), kStringMethods.end());
    all.insert(kDictMethods.begin(), kDictMethods.end());
    all.insert(kListMethods.begin(), kListMethods.end());
    all.insert("cycle");  // loop.cycle
    return all;
  }();
  return s;
}
const std::set<std::string, std::less<>>& known_globals() {
  static const std::set<std::string, std::less<>> s = {"range", "namespace", "dict",
                                                       "raise_exception", "strftime_now"};
  return s;
}

// ---- Template ----

namespace {

struct Checker {
  std::string name;
  std::set<std::string> callables;  // macros, call-block callers, loop, assigned names
  void collect(const Node& n) {
    if (n.t == Node::T::macro) callables.insert(n.str);
    if (n.t == Node::T::macro || n.t == Node::T::call_block)
      for (const auto& p : n.names) callables.insert(p);
    if (n.t == Node::T::set || n.t == Node::T::set_block || n.t == Node::T::for_)
      for (const auto& p : n.names) callables.insert(p);
    for (const auto& k : n.kids)
      if (k) collect(*k);
    for (const auto& kv : n.kw)
      if (kv.second) collect(*kv.second);
  }
  [[noreturn]] void unsupported(const Node& n, const std::string& what) const {
    throw SyntaxError("unsupported:" + what, n.line);
  }
  void check_literal_name(const Node& n, size_t idx, bool is_filter) const {
    if (idx >= n.kids.size() || !n.kids[idx] || n.kids[idx]->t != Node::T::literal ||
        !n.kids[idx]->lit.is_string())
      return;
    const std::string& nm = n.kids[idx]->lit.s;
    if (is_filter ? !known_filters().count(nm) : !known_tests().count(nm))
      unsupported(n,
                  fmt::format("{} '{}' (named in {})", is_filter ? "filter" : "test", nm, n.str));
  }
  void check(const Node& n) const {
    switch (n.t) {
      case Node::T::filter:
        if (!known_filters().count(n.str)) unsupported(n, fmt::format("filter '{}'", n.str));
        if (n.str == "map" && n.kw.empty()) check_literal_name(n, 1, true);
        if (n.str == "select" || n.str == "reject") check_literal_name(n, 1, false);
        if (n.str == "selectattr" || n.str == "rejectattr") check_literal_name(n, 2, false);
        break;
      case Node::T::test:
        if (!known_tests().count(n.str)) unsupported(n, fmt::format("test '{}'", n.str));
        break;
      case Node::T::call: {
        const Node& f = *n.kids[0];
        if (f.t == Node::T::getattr) {
          if (!known_methods().count(f.str)) unsupported(n, fmt::format("method '{}()'", f.str));
        } else if (f.t == Node::T::name) {
          if (!known_globals().count(f.str) && !callables.count(f.str) && f.str != "caller" &&
              f.str != "loop")
            unsupported(n, fmt::format("function '{}()'", f.str));
        }
        break;
      }
      default:
        break;
    }
    for (const auto& k : n.kids)
      if (k) check(*k);
    for (const auto& kv : n.kw)
      if (kv.second) check(*kv.second);
  }
};

}  // namespace

Result<Template> Template::parse(std::string_view source, std::string name) {
  Template t;
  t.name_ = std::move(name);
  try {
    NodeP root = parse_template(source, t.name_);
    Checker c;
    c.collect(*root);
    c.check(*root);
    t.root_ = root;
  } catch (const SyntaxError& e) {
    std::string msg = e.what();
    if (msg.starts_with("unsupported:"))
      return make_error(Errc::unsupported,
                        fmt::format("{} line {}: {} is not supported by sparkd's template "
                                    "engine; set CHAT_FORMAT to a built-in format",
                                    t.name_, e.line, msg.substr(12)));
    return make_error(Errc::config, fmt::format("{} line {}: {}", t.name_, e.line, msg));
  }
  return t;
}

Result<std::string> Template::render(const Json& context, const RenderLimits& limits) const {
  Eval ev;
  Budget budget;
  budget.max_steps = limits.max_steps;
  budget.timeout_ms = limits.timeout.count();
  budget.deadline = std::chrono::steady_clock::now() + limits.timeout;
  budget.stop = limits.stop ? &limits.stop : nullptr;
  budget.stack_floor = stack_floor_of_this_thread();
  struct Scoped {
    Budget* prev;
    explicit Scoped(Budget* b) : prev(t_budget) { t_budget = b; }
    ~Scoped() { t_budget = prev; }
  } scoped(&budget);
  auto globals = std::make_shared<Scope>();
  globals->vars["namespace"] = Value::callable(global_namespace);
  globals->vars["dict"] = Value::callable([](Args& a) {
    Value o = Value::object();
    for (const auto& [k, v] : a.kw) o.obj->set(k, v);
    return o;
  });
  globals->vars["range"] = Value::callable([](Args& a) {
    std::vector<int64_t> p;
    for (const auto& x : a.pos) {
      if (!is_int_like(x)) fail(a.line, "range() takes integers");
      p.push_back(ival(x));
    }
    if (p.empty() || p.size() > 3) fail(a.line, "range() takes 1 to 3 arguments");
    int64_t start = p.size() > 1 ? p[0] : 0, stop = p.size() > 1 ? p[1] : p[0];
    int64_t step = p.size() > 2 ? p[2] : 1;
    if (step == 0) fail(a.line, "range() step must not be zero");
    int64_t n = step > 0 ? (stop - start + step - 1) / step : (start - stop - step - 1) / -step;
    if (n > kMaxRange)
      throw RenderError(fmt::format("range() longer than {}", kMaxRange), a.line,
                        RenderError::Why::limit);
    check_items(static_cast<size_t>(std::max<int64_t>(n, 0)));
    Array out;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
      if (static_cast<int64_t>(out.size()) >= kMaxRange)
        fail(a.line, fmt::format("range() longer than {}", kMaxRange));
      out.push_back(Value::integer(i));
    }
    return Value::array(std::move(out));
  });
  globals->vars["raise_exception"] = Value::callable([](Args& a) -> Value {
    fail(a.line, a.pos.empty() ? "raise_exception()" : to_str(a.pos[0]));
  });
  globals->vars["strftime_now"] = Value::callable([](Args& a) {
    if (a.pos.empty() || !a.pos[0].is_string()) fail(a.line, "strftime_now() takes a format");
    std::time_t now = std::time(nullptr);
    std::tm tm{};
    localtime_r(&now, &tm);
    char buf[256];
    // The format comes from the template, as transformers' strftime_now takes it.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wformat-nonliteral"
    size_t n = std::strftime(buf, sizeof buf, a.pos[0].s.c_str(), &tm);
#pragma GCC diagnostic pop
    return Value::string(std::string(buf, n));
  });
  ScopeP top = child(globals);
  std::string out;
  try {
    if (context.is_object())
      for (const auto& [k, v] : context.items()) globals->vars[k] = from_json(v);
    Flow f = Flow::normal;
    ev.exec(*root_, top, out, f);
  } catch (const RenderError& e) {
    int line = e.line ? e.line : budget.line;
    Errc code = e.why == RenderError::Why::limit     ? Errc::unsupported
                : e.why == RenderError::Why::stopped ? Errc::busy
                                                     : Errc::usage;
    return make_error(code, fmt::format("{} line {}: {}", name_, line, e.what()));
  } catch (const std::bad_alloc&) {
    // Every value was within the render's limits when it was built: the machine itself
    // had no memory left for it. The request is refused; the daemon goes on.
    return make_error(Errc::unsupported,
                      fmt::format("{} line {}: the render ran out of memory (an allocation "
                                  "failed within the render's limits of {} MiB per string and "
                                  "{} items per list); send a shorter conversation or set "
                                  "CHAT_FORMAT to a built-in format",
                                  name_, budget.line, kMaxText >> 20, kMaxItems));
  } catch (const std::length_error&) {
    return make_error(Errc::unsupported,
                      fmt::format("{} line {}: a value grew past what memory can hold (the "
                                  "render's limits are {} MiB per string and {} items per list)",
                                  name_, budget.line, kMaxText >> 20, kMaxItems));
  }
  return out;
}

}  // namespace spark::tok::jinja
