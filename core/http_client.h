#pragma once
// A small blocking HTTP/1.1 client with one overall deadline, for sparkd's own calls (the
// exec backend's health URL) and for tests and sparkctl. Every call names host:port in its
// errors.
#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/error.h"

namespace spark {

/// A response: status, lower-case header names, body.
struct HttpReply {
  int status = 0;
  std::map<std::string, std::string> headers;
  std::string body;
};

/// One request (`host` is an address or name; the connection closes afterwards).
struct HttpCall {
  std::string method = "GET";
  std::string host = "127.0.0.1";
  uint16_t port = 80;
  std::string target = "/";
  std::string body;
  std::string content_type = "application/json";
  std::vector<std::pair<std::string, std::string>> headers;
  std::chrono::milliseconds timeout{5000};
};

/// Sends the request and reads the whole response. Errc::timeout when the deadline passes,
/// Errc::network when the peer cannot be reached or the reply is not HTTP.
Result<HttpReply> http_call(const HttpCall& call);

/// Parts of an http:// URL.
struct Url {
  std::string host;
  uint16_t port = 80;
  std::string target = "/";
};
/// Parses "http://host[:port][/path]" (https is refused with a clear message).
Result<Url> parse_url(const std::string& url);

/// GET of a URL with a deadline.
Result<HttpReply> http_get(const std::string& url, std::chrono::milliseconds timeout);

}  // namespace spark
