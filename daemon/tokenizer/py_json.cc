#include "daemon/tokenizer/py_json.h"

#include <fmt/format.h>

#include <cmath>

namespace spark::tok {

namespace {
void dump(const Json& j, int indent, int depth, std::string& out) {
  auto newline = [&](int d) {
    out += '\n';
    out.append(static_cast<size_t>(indent * d), ' ');
  };
  switch (j.type()) {
    case Json::value_t::object: {
      if (j.empty()) {
        out += "{}";
        return;
      }
      out += '{';
      bool first = true;
      for (const auto& [k, v] : j.items()) {
        if (!first) out += indent < 0 ? ", " : ",";
        first = false;
        if (indent >= 0) newline(depth + 1);
        out += Json(k).dump(-1, ' ', false, Json::error_handler_t::replace);
        out += ": ";
        dump(v, indent, depth + 1, out);
      }
      if (indent >= 0) newline(depth);
      out += '}';
      return;
    }
    case Json::value_t::array: {
      if (j.empty()) {
        out += "[]";
        return;
      }
      out += '[';
      bool first = true;
      for (const auto& v : j) {
        if (!first) out += indent < 0 ? ", " : ",";
        first = false;
        if (indent >= 0) newline(depth + 1);
        dump(v, indent, depth + 1, out);
      }
      if (indent >= 0) newline(depth);
      out += ']';
      return;
    }
    case Json::value_t::number_float: {
      double d = j.get<double>();
      if (std::isnan(d)) {
        out += "NaN";
      } else if (std::isinf(d)) {
        out += d > 0 ? "Infinity" : "-Infinity";
      } else {
        // Python repr: shortest round-trip digits, always with a '.' or an exponent.
        std::string s = fmt::format("{}", d);
        if (s.find_first_of(".eE") == std::string::npos) s += ".0";
        out += s;
      }
      return;
    }
    default:
      out += j.dump(-1, ' ', false, Json::error_handler_t::replace);
  }
}
}  // namespace

std::string py_dumps(const Json& j, int indent) {
  std::string out;
  dump(j, indent, 0, out);
  return out;
}

}  // namespace spark::tok
