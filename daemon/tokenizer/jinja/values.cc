// Value conversions: request JSON in, Python str()/repr() and transformers' tojson out.
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>

#include "daemon/tokenizer/jinja/internal.h"

namespace spark::tok::jinja {

namespace {

// Python's repr(float): shortest round-trip digits; exponent form below 1e-4 and from 1e16.
std::string py_float(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  if (d == 0) return std::signbit(d) ? "-0.0" : "0.0";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string sci(buf, r.ptr);  // d.ddde[+-]XX
  size_t e = sci.find('e');
  std::string mant = sci.substr(0, e);
  int exp = std::stoi(sci.substr(e + 1));
  bool neg = mant[0] == '-';
  if (neg) mant.erase(0, 1);
  std::string digits;
  for (char c : mant)
    if (c != '.') digits += c;
  std::string out;
  if (exp < -4 || exp >= 16) {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    out += fmt::format("e{}{:02d}", exp < 0 ? '-' : '+', std::abs(exp));
  } else if (exp < 0) {
    out = "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
  } else {
    size_t int_len = static_cast<size_t>(exp) + 1;
    if (digits.size() <= int_len) {
      out = digits + std::string(int_len - digits.size(), '0') + ".0";
    } else {
      out = digits.substr(0, int_len) + "." + digits.substr(int_len);
    }
  }
  return neg ? "-" + out : out;
}

void py_repr_str(const std::string& s, std::string& out) {
  bool has_sq = s.find('\'') != std::string::npos, has_dq = s.find('"') != std::string::npos;
  char q = has_sq && !has_dq ? '"' : '\'';
  out += q;
  for (unsigned char c : s) {
    if (c == static_cast<unsigned char>(q) || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      out += fmt::format("\\x{:02x}", c);
    } else {
      out += static_cast<char>(c);
    }
  }
  out += q;
}

// Every value printed costs a step; the text may not pass kMaxText.
void grew(const std::string& out, int depth) {
  charge(1);
  if (out.size() > kMaxText) check_text(out.size());
  if (depth > 4 * kMaxNest)
    throw RenderError(fmt::format("values nest deeper than {} levels", 4 * kMaxNest), 0,
                      RenderError::Why::limit);
}

void repr(const Value& v, std::string& out, int depth = 0) {
  grew(out, depth);
  switch (v.kind) {
    case Value::Kind::string:
      charge(v.s.size() / 32);
      py_repr_str(v.s, out);
      return;
    case Value::Kind::array: {
      out += '[';
      for (size_t k = 0; k < v.arr->size(); ++k) {
        if (k) out += ", ";
        repr((*v.arr)[k], out, depth + 1);
      }
      out += ']';
      return;
    }
    case Value::Kind::object: {
      if (v.obj->ns) out += "<Namespace ";
      out += '{';
      bool first = true;
      for (const auto& [k, x] : v.obj->items) {
        if (!first) out += ", ";
        first = false;
        py_repr_str(k, out);
        out += ": ";
        repr(x, out, depth + 1);
      }
      out += '}';
      if (v.obj->ns) out += '>';
      return;
    }
    default:
      out += to_str(v);
  }
}

void json_str(const std::string& s, std::string& out) {
  out += '"';
  for (unsigned char c : s) {
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
        if (c < 0x20)
          out += fmt::format("\\u{:04x}", c);
        else
          out += static_cast<char>(c);
    }
  }
  out += '"';
}

void json_dump(const Value& v, int indent, const std::string& isep, const std::string& ksep,
               bool sort_keys, int depth, std::string& out) {
  grew(out, depth);
  auto newline = [&](int d) {
    if (out.size() + static_cast<size_t>(indent) * static_cast<size_t>(d) > kMaxText)
      check_text(out.size() + static_cast<size_t>(indent) * static_cast<size_t>(d));
    out += '\n';
    out.append(static_cast<size_t>(indent * d), ' ');
  };
  switch (v.kind) {
    case Value::Kind::undefined:
    case Value::Kind::none:
      out += "null";
      return;
    case Value::Kind::boolean:
      out += v.b ? "true" : "false";
      return;
    case Value::Kind::integer:
      out += std::to_string(v.i);
      return;
    case Value::Kind::floating:
      if (std::isnan(v.f))
        out += "NaN";
      else if (std::isinf(v.f))
        out += v.f > 0 ? "Infinity" : "-Infinity";
      else
        out += py_float(v.f);
      return;
    case Value::Kind::string:
      charge(v.s.size() / 32);
      json_str(v.s, out);
      return;
    case Value::Kind::array: {
      if (v.arr->empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t k = 0; k < v.arr->size(); ++k) {
        if (k) out += isep;
        if (indent >= 0) newline(depth + 1);
        json_dump((*v.arr)[k], indent, isep, ksep, sort_keys, depth + 1, out);
      }
      if (indent >= 0) newline(depth);
      out += ']';
      return;
    }
    case Value::Kind::object: {
      if (v.obj->items.empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& kv : v.obj->items) items.push_back(&kv);
      if (sort_keys)
        std::stable_sort(items.begin(), items.end(),
                         [](auto* a, auto* b) { return a->first < b->first; });
      out += '{';
      bool first = true;
      for (const auto* kv : items) {
        if (!first) out += isep;
        first = false;
        if (indent >= 0) newline(depth + 1);
        json_str(kv->first, out);
        out += ksep;
        json_dump(kv->second, indent, isep, ksep, sort_keys, depth + 1, out);
      }
      if (indent >= 0) newline(depth);
      out += '}';
      return;
    }
    case Value::Kind::callable:
      throw RenderError("tojson: a function is not JSON serializable", 0);
  }
}

}  // namespace

std::string to_str(const Value& v) {
  switch (v.kind) {
    case Value::Kind::undefined:
      return "";
    case Value::Kind::none:
      return "None";
    case Value::Kind::boolean:
      return v.b ? "True" : "False";
    case Value::Kind::integer:
      return std::to_string(v.i);
    case Value::Kind::floating:
      return py_float(v.f);
    case Value::Kind::string:
      return v.s;
    case Value::Kind::array:
    case Value::Kind::object: {
      std::string out;
      repr(v, out);
      return out;
    }
    case Value::Kind::callable:
      return "<function>";
  }
  return "";
}

std::string to_json(const Value& v, int indent, const std::string& item_sep,
                    const std::string& key_sep, bool sort_keys) {
  std::string out;
  json_dump(v, indent, item_sep, key_sep, sort_keys, 0, out);
  return out;
}

Value from_json(const Json& j, int depth) {
  if (depth > 512) throw RenderError("the template's input nests deeper than 512 levels", 0);
  switch (j.type()) {
    case Json::value_t::null:
      return Value::none();
    case Json::value_t::boolean:
      return Value::boolean(j.get<bool>());
    case Json::value_t::number_integer:
      return Value::integer(j.get<int64_t>());
    case Json::value_t::number_unsigned: {
      uint64_t u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) return Value::floating(static_cast<double>(u));
      return Value::integer(static_cast<int64_t>(u));
    }
    case Json::value_t::number_float:
      return Value::floating(j.get<double>());
    case Json::value_t::string:
      return Value::string(j.get<std::string>());
    case Json::value_t::array: {
      Array a;
      a.reserve(j.size());
      for (const auto& x : j) a.push_back(from_json(x, depth + 1));
      return Value::array(std::move(a));
    }
    case Json::value_t::object: {
      Value o = Value::object();
      for (const auto& [k, x] : j.items()) o.obj->items.emplace_back(k, from_json(x, depth + 1));
      return o;
    }
    default:
      return Value::none();
  }
}

}  // namespace spark::tok::jinja
