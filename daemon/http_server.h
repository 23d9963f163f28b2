#pragma once
// sparkd's HTTP listener on Boost.Beast. One reactor thread accepts connections and reads
// requests; a route answers at once (health, metrics) or later, from any thread, through a
// Responder (engine work never runs on the reactor). One wrapper turns exceptions and
// Errors into JSON error bodies with http_status(Errc); unknown routes answer 404 JSON.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/error.h"

namespace boost::asio {
class io_context;
}

namespace spark::daemon {

/// One parsed HTTP request.
struct Request {
  std::string method;                          // "GET"
  std::string target;                          // "/health?strict"
  std::string path;                            // "/health"
  std::map<std::string, std::string> query;    // "strict" -> ""
  std::map<std::string, std::string> headers;  // lower-case names
  std::string body;
  std::string peer;  // "127.0.0.1:53211"

  /// Value of a header (name in lower case), "" when absent.
  std::string header(const std::string& lower_name) const;
  /// True when the query string names `key` (with or without a value).
  bool has_query(const std::string& key) const { return query.count(key) != 0; }
};

/// One complete HTTP response.
struct Response {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;

  /// A JSON response.
  static Response json(int status, const nlohmann::json& j);
  /// The OpenAI-shaped JSON error body for an Error: {"error":{"message","type","param",
  /// "code"}} (type from the status, code the Errc name), status from http_status(e.code).
  static Response error(const Error& e);
  /// Same with an explicit status (405, 413, 431, 503 where the kind's default differs).
  static Response error(const Error& e, int status);
};

/// An Error thrown out of a route handler; the route wrapper turns it into Response::error.
class HttpError : public std::runtime_error {
 public:
  explicit HttpError(Error e) : std::runtime_error(e.message), error_(std::move(e)) {}
  const Error& error() const { return error_; }

 private:
  Error error_;
};

/// Throws HttpError(make_error(code, message)).
[[noreturn]] void throw_http(Errc code, std::string message);

class Session;

/// The reply side of one request; copyable, usable from any thread. Either send() once, or
/// begin_stream(), write() any number of times, end_stream() (chunked transfer encoding).
class Responder {
 public:
  explicit Responder(std::shared_ptr<Session> s) : s_(std::move(s)) {}
  void send(Response r) const;
  void begin_stream(int status, std::string content_type) const;
  void write(std::string chunk) const;
  void end_stream() const;
  /// True once the connection failed or closed (a streaming producer may stop early).
  bool closed() const;

 private:
  std::shared_ptr<Session> s_;
};

using Handler = std::function<Response(const Request&)>;
using AsyncHandler = std::function<void(const Request&, Responder)>;

/// Listener settings.
struct ServerOptions {
  std::string bind = "127.0.0.1";
  uint16_t port = 0;                              // 0: any free port
  uint64_t body_limit = 8ull << 20;               // bytes; larger bodies get 413
  uint32_t header_limit = 64u << 10;              // bytes; larger headers get 431
  std::chrono::milliseconds idle_timeout{60000};  // keep-alive read timeout
  std::chrono::milliseconds write_timeout{60000};
  /// Open connections at most, in all and from one client address (0: no limit); a
  /// connection over either limit is answered 503 and closed before anything is read.
  size_t max_connections = 512;
  size_t max_connections_per_peer = 128;
  std::string api_key;                               // non-empty: Bearer required
  std::set<std::string> public_paths = {"/health"};  // answered without the key
  std::string server_name = "sparkd";
  /// Readiness gate: when it returns a non-empty reason, every path not in ungated_paths
  /// answers 503 {"error":{"message":"loading: <reason>"}} with Retry-After.
  std::function<std::string()> not_ready;
  std::set<std::string> ungated_paths = {"/health", "/metrics"};
};

/// The HTTP server. Routes are added before start().
class HttpServer {
 public:
  explicit HttpServer(ServerOptions opts);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  /// A route answered on the reactor thread; must be quick and must not block. A path
  /// ending in "/*" answers every path under it that no exact route answers.
  void route(const std::string& method, const std::string& path, Handler h);
  /// A route answered later through the Responder (engine work).
  void route_async(const std::string& method, const std::string& path, AsyncHandler h);

  /// Binds, listens and starts the reactor thread. Errc::network naming address:port when
  /// the port cannot be bound.
  Status start();
  /// The bound port (after start()).
  uint16_t port() const { return port_; }
  /// Stops accepting, lets requests in flight finish for up to `grace`, then closes every
  /// connection and joins the reactor thread. Idempotent. Returns the number of requests
  /// that were cut off when the grace ran out.
  int shutdown(std::chrono::milliseconds grace);

  /// Requests read and not yet answered (all paths; shutdown waits for these).
  int in_flight() const { return in_flight_.load(); }
  /// Requests in flight on gated (API) paths: what /health reports.
  int api_in_flight() const { return api_in_flight_.load(); }
  /// Answered requests by status code (for metrics).
  std::map<int, uint64_t> responses_by_status() const;
  /// The reactor, for timers that belong to it (signal_set, watchdogs). Never block on it.
  boost::asio::io_context& io();

  // Internal (used by Session).
  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
  uint16_t port_ = 0;
  std::atomic<int> in_flight_{0};
  std::atomic<int> api_in_flight_{0};
  friend class Session;
};

/// Constant-time comparison of two secrets (time depends on the lengths only).
bool constant_time_equal(const std::string& a, const std::string& b);

}  // namespace spark::daemon
