#pragma once
// JSON text for the wire and for files. nlohmann's dump() throws on a string that is not
// UTF-8, and strings reach our replies from places the parser never checked (a request's
// path, an error message that quotes the input, a file name): every reply is built with
// this, so such bytes become U+FFFD instead of an exception.
#include <nlohmann/json.hpp>
#include <string>

namespace spark {

/// j as JSON text; invalid UTF-8 in any string becomes U+FFFD. indent < 0: one line.
template <typename J>
std::string dump_json(const J& j, int indent = -1) {
  return j.dump(indent, ' ', false, J::error_handler_t::replace);
}

}  // namespace spark
