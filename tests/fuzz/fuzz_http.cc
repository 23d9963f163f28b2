// libFuzzer target for sparkd's HTTP request path: method, target, headers and body reach a
// real HttpServer over loopback (the Beast parser, the Bearer check, the readiness gate,
// routing, sync and async handlers, the error replies). Input layout: raw bytes sent as
// they are; or, after a leading 0x00, "METHOD\nTARGET\nHeader: v\n...\n\nBODY" assembled into
// a well-formed request so that most inputs get past the parser. Checks, besides "no
// crash": whatever comes back starts with a status line, every error is OpenAI-shaped JSON,
// and the in-flight count returns to zero after every input.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <thread>

#include "core/log.h"
#include "core/strings.h"
#include "daemon/http_server.h"

using namespace spark;
using namespace spark::daemon;

namespace {

void require(bool ok) {
  if (!ok) std::abort();  // an invariant broke: libFuzzer reports it with the input
}

HttpServer& server() {
  static HttpServer* s = [] {
    log::set_level(log::Level::off);
    ServerOptions o;
    o.api_key = "fuzz-key";
    o.body_limit = 64 << 10;
    o.header_limit = 8 << 10;
    o.idle_timeout = std::chrono::milliseconds(500);
    o.not_ready = [] { return std::string(); };
    auto* srv = new HttpServer(o);
    srv->route("GET", "/health", [](const Request& r) {
      return Response::json(200, {{"ok", true}, {"q", r.query.size()}});
    });
    srv->route("POST", "/v1/echo", [](const Request& r) {
      return Response::json(
          200, {{"body", r.body}, {"path", r.path}, {"agent", r.header("user-agent")}});
    });
    srv->route("GET", "/v1/throw",
               [](const Request& r) -> Response { throw std::runtime_error("x" + r.target); });
    srv->route_async("POST", "/v1/chat/completions", [](const Request& r, Responder rsp) {
      std::thread([rsp, b = r.body] {
        auto j = nlohmann::json::parse(b, nullptr, false);
        if (j.is_discarded())
          rsp.send(Response::error(make_error(Errc::usage, "bad JSON: " + b.substr(0, 40))));
        else
          rsp.send(Response::json(200, j));
      }).detach();
    });
    if (!srv->start().ok()) std::abort();
    return srv;
  }();
  return *s;
}

std::string assemble(std::string_view in) {
  auto nl = [&](std::string_view& s) {
    auto p = s.find('\n');
    std::string_view line = s.substr(0, p);
    s = p == std::string_view::npos ? std::string_view() : s.substr(p + 1);
    return line;
  };
  std::string_view method = nl(in), target = nl(in);
  std::string headers;
  bool key = false;
  while (!in.empty()) {
    std::string_view h = nl(in);
    if (h.empty()) break;
    if (h == "K") {
      key = true;
      continue;
    }
    headers.append(h).append("\r\n");
  }
  std::string out;
  out.append(method.empty() ? "GET" : method).append(" ");
  out.append(target.empty() ? "/" : target).append(" HTTP/1.1\r\nHost: f\r\n");
  if (key) out += "Authorization: Bearer fuzz-key\r\n";
  out += headers;
  out += "Content-Length: " + std::to_string(in.size()) + "\r\n\r\n";
  out.append(in);
  return out;
}

// A connection to the server. Thousands of short connections a minute on a loaded machine
// can run the loopback's ephemeral ports or the listen backlog out for a moment, so a failed
// connect is retried for up to 5 s; a server that stays unreachable, or a process out of
// descriptors, is a failure, reported with errno.
int connect_to(uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  int err = 0;
  for (int attempt = 0; attempt < 250; ++attempt) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      std::fprintf(stderr, "fuzz_http: socket: %s\n", std::strerror(errno));
      std::abort();
    }
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) return fd;
    err = errno;
    ::close(fd);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::fprintf(stderr, "fuzz_http: connect to 127.0.0.1:%u for 5 s: %s\n", port,
               std::strerror(err));
  std::abort();
}

std::string exchange(uint16_t port, const std::string& bytes) {
  int fd = connect_to(port);
  timeval tv{2, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  for (size_t off = 0; off < bytes.size();) {
    ssize_t n = ::send(fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
    if (n <= 0) break;  // the server may answer (413, 431, 400) and close early
    off += static_cast<size_t>(n);
  }
  // An async route would read a half-close as a client that left; this one asks to close.
  if (bytes.find("/v1/chat/completions") == std::string::npos) ::shutdown(fd, SHUT_WR);
  std::string got;
  char buf[8192];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;)
    got.append(buf, static_cast<size_t>(n));
  ::close(fd);
  return got;
}

// Every answer in `got` (pipelined requests give several) starts with a status line; the
// first one's body, when it is an error, has OpenAI's shape.
void check_reply(const std::string& got) {
  if (got.empty()) return;  // an incomplete request that the server closed, or a timeout
  require(starts_with(got, "HTTP/1."));
  int status = std::atoi(got.substr(9, 3).c_str());
  require(status >= 100 && status < 600);
  auto head_end = got.find("\r\n\r\n");
  require(head_end != std::string::npos);
  if (status < 400) return;
  auto len_at = got.find("Content-Length: ");
  if (len_at == std::string::npos || len_at > head_end) return;
  size_t len = std::strtoul(got.c_str() + len_at + 16, nullptr, 10);
  auto j = nlohmann::json::parse(got.substr(head_end + 4, len), nullptr, false);
  require(j.is_object() && j.contains("error") && j["error"]["message"].is_string() &&
          j["error"]["type"].is_string() && j["error"].contains("param") &&
          j["error"].contains("code"));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  HttpServer& s = server();
  std::string_view in(reinterpret_cast<const char*>(data), size);
  std::string bytes = !in.empty() && in[0] == '\0' ? assemble(in.substr(1)) : std::string(in);
  if (bytes.empty()) return 0;
  if (bytes.find("/v1/chat/completions") != std::string::npos)
    bytes.insert(bytes.find("\r\n") == std::string::npos ? bytes.size() : bytes.find("\r\n") + 2,
                 "Connection: close\r\n");
  check_reply(exchange(s.port(), bytes));
  // No input leaves a request counted: the reply (or the closed connection) ends it.
  for (int i = 0; i < 300 && s.in_flight() != 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  require(s.in_flight() == 0);
  require(s.api_in_flight() == 0);
  return 0;
}
