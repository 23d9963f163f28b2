#include "daemon/http_server.h"

#include <sys/socket.h>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cerrno>
#include <deque>
#include <mutex>
#include <optional>
#include <sstream>

#include "core/json_text.h"
#include "core/log.h"
#include "daemon/openai/errors.h"

namespace spark::daemon {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

namespace {

constexpr std::string_view kComp = "http";

// Beast's string_view differs between Boost 1.74 (boost::string_view) and 1.83
// (boost::core::string_view); both have data() and size().
template <typename SV>
std::string str(const SV& sv) {
  return std::string(sv.data(), sv.size());
}

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

int hexval(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

std::string url_decode(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size() && hexval(s[i + 1]) >= 0 && hexval(s[i + 2]) >= 0) {
      out += static_cast<char>(hexval(s[i + 1]) * 16 + hexval(s[i + 2]));
      i += 2;
    } else if (s[i] == '+') {
      out += ' ';
    } else {
      out += s[i];
    }
  }
  return out;
}

void split_target(const std::string& target, std::string* path,
                  std::map<std::string, std::string>* query) {
  auto q = target.find('?');
  *path = url_decode(std::string_view(target).substr(0, q));
  if (q == std::string::npos) return;
  std::string_view rest = std::string_view(target).substr(q + 1);
  while (!rest.empty()) {
    auto amp = rest.find('&');
    std::string_view part = rest.substr(0, amp);
    if (!part.empty()) {
      auto eq = part.find('=');
      std::string k = url_decode(part.substr(0, eq));
      std::string v = eq == std::string_view::npos ? "" : url_decode(part.substr(eq + 1));
      (*query)[k] = v;
    }
    if (amp == std::string_view::npos) break;
    rest = rest.substr(amp + 1);
  }
}

const char* reason_phrase(int status) {
  auto r = http::obsolete_reason(static_cast<http::status>(status));
  return r.data();  // static storage, NUL-terminated
}

// Hands replies from other threads to the reactor while it exists; the server closes the
// gate before its io_context goes away, so a late Responder is dropped, never a crash.
struct Gate {
  std::mutex mu;
  bool open = true;
};

}  // namespace

std::string Request::header(const std::string& lower_name) const {
  auto it = headers.find(lower_name);
  return it == headers.end() ? std::string() : it->second;
}

Response Response::json(int status, const nlohmann::json& j) {
  Response r;
  r.status = status;
  r.body = dump_json(j);
  r.body += '\n';
  return r;
}

Response Response::error(const Error& e) {
  return error(e, http_status(e.code));
}

namespace {
// The OpenAI error type that goes with an HTTP status, so that clients written against
// OpenAI read the listener's own errors (401, 404, 405, 413, 431, 503) like the API's.
const char* openai_error_type(int status) {
  switch (status) {
    case 401:
      return "authentication_error";
    case 403:
      return "permission_error";
    case 404:
      return "not_found_error";
    case 429:
      return "rate_limit_error";
    case 503:
      return "service_unavailable_error";
    case 504:
      return "timeout_error";
    default:
      return status >= 500 ? "server_error" : "invalid_request_error";
  }
}
}  // namespace

Response Response::error(const Error& e, int status) {
  openai::ApiError a;
  a.status = status;
  a.message = e.message;
  a.type = openai_error_type(status);
  a.code = std::string(errc_name(e.code));
  Response r;
  r.status = status;
  r.body = dump_json(openai::error_body(a));
  r.body += '\n';
  return r;
}

void throw_http(Errc code, std::string message) {
  throw HttpError(make_error(code, std::move(message)));
}

bool constant_time_equal(const std::string& a, const std::string& b) {
  // Walk the longer length every time so neither content nor the position of the first
  // difference shows in the timing.
  size_t n = std::max(a.size(), b.size());
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

struct Route {
  Handler sync;
  AsyncHandler async;
};

struct HttpServer::Impl {
  ServerOptions opts;
  net::io_context ioc{1};
  tcp::acceptor acceptor{ioc};
  std::thread thread;
  std::optional<net::executor_work_guard<net::io_context::executor_type>> work;
  std::map<std::string, std::map<std::string, Route>> routes;  // path -> method -> route
  std::vector<std::weak_ptr<Session>> sessions;                // reactor thread only
  std::shared_ptr<Gate> gate = std::make_shared<Gate>();
  std::atomic<bool> stopping{false};
  bool started = false;
  bool shut = false;
  mutable std::mutex stat_mu;
  std::map<int, uint64_t> by_status;

  void count(int status) {
    std::lock_guard lk(stat_mu);
    ++by_status[status];
  }
};

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket sock, HttpServer* srv)
      : srv_(srv),
        impl_(srv->impl_.get()),
        gate_(impl_->gate),
        exec_(sock.get_executor()),
        stream_(std::in_place, std::move(sock)) {
    beast::error_code ec;
    auto ep = stream_->socket().remote_endpoint(ec);
    if (!ec) {
      peer_addr_ = ep.address().to_string();
      peer_ = peer_addr_ + ":" + std::to_string(ep.port());
    }
  }

  const std::string& peer_addr() const { return peer_addr_; }

  void start() { do_read(); }

  // Reactor thread: close the connection unless a request is being answered.
  void close_if_idle() {
    if (!in_request_) close();
  }
  // Reactor thread: open, and no request being answered (waiting for or reading one).
  bool idle() const { return !in_request_ && !closed_.load(); }

  void close() {
    closed_ = true;
    if (!stream_) return;
    beast::error_code ec;
    stream_->socket().shutdown(tcp::socket::shutdown_both, ec);
    stream_->close();
  }

  // After the reactor stopped: drop the socket so nothing outlives the io_context.
  void release() {
    closed_ = true;
    stream_.reset();
  }

  bool closed() const { return closed_.load(); }

  // Runs `fn` on the reactor if the server still exists.
  template <typename Fn>
  void on_reactor(Fn&& fn) {
    std::lock_guard lk(gate_->mu);
    if (!gate_->open) return;
    net::post(exec_,
              [self = shared_from_this(), fn = std::forward<Fn>(fn)]() mutable { fn(*self); });
  }

  void send(Response r) {
    if (replied_ || !in_request_ || !stream_) return;
    replied_ = true;
    std::string wire;
    try {
      wire = serialize(std::move(r));
    } catch (const std::exception& e) {
      // A header the serializer refuses: answer 500 rather than leave the request open.
      log::error(kComp, "cannot serialize a {} reply: {}", r.status, e.what());
      keep_alive_ = false;
      r.status = 500;
      const std::string body =
          "{\"error\":{\"message\":\"internal error: the reply could not be built\","
          "\"type\":\"server_error\",\"param\":null,\"code\":\"internal\"}}\n";
      wire =
          "HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
          "Connection: close\r\nContent-Length: " +
          std::to_string(body.size()) + "\r\n\r\n" + body;
    }
    impl_->count(r.status);
    finish_after_write_ = true;
    queue(std::move(wire));
  }

  void begin_stream(int status, const std::string& content_type) {
    if (replied_ || !in_request_ || !stream_) return;
    replied_ = true;
    streaming_ = true;
    sse_ = content_type.rfind("text/event-stream", 0) == 0;
    impl_->count(status);
    chunked_ = version_ >= 11;
    bool keep = keep_alive_ && !impl_->stopping.load() && chunked_;
    keep_alive_ = keep;
    std::string h = "HTTP/" + std::to_string(version_ / 10) + "." + std::to_string(version_ % 10) +
                    " " + std::to_string(status) + " " + reason_phrase(status) + "\r\n";
    h += "Server: " + impl_->opts.server_name + "\r\n";
    h += "Content-Type: " + content_type + "\r\n";
    h += "Cache-Control: no-cache\r\n";
    if (chunked_) h += "Transfer-Encoding: chunked\r\n";
    h += keep ? "Connection: keep-alive\r\n" : "Connection: close\r\n";
    h += "\r\n";
    queue(std::move(h));
  }

  void write_chunk(std::string data) {
    if (!streaming_ || stream_ended_ || data.empty() || !stream_) return;
    if (chunked_) {
      char hex[32];
      std::snprintf(hex, sizeof hex, "%zx\r\n", data.size());
      data = std::string(hex) + data + "\r\n";
    }
    queue(std::move(data));
  }

  void end_stream() {
    if (!streaming_ || stream_ended_ || !stream_) return;
    stream_ended_ = true;
    finish_after_write_ = true;
    queue(chunked_ ? std::string("0\r\n\r\n") : std::string());
  }

  // Reactor thread, when the shutdown grace ran out with this request unanswered: its
  // client gets a final error instead of a cut connection: a 503 body, or in an event
  // stream an error event and [DONE]. True when something was queued.
  bool cut_off() {
    if (!in_request_ || !stream_ || closed_) return false;
    const Response err = Response::error(
        make_error(Errc::busy,
                   "sparkd is shutting down and the request did not finish within its "
                   "SHUTDOWN_GRACE; retry when the server is back"),
        503);
    keep_alive_ = false;
    if (!replied_) {
      send(err);
      return true;
    }
    if (streaming_ && !stream_ended_) {
      if (sse_) {
        std::string body = err.body;
        while (!body.empty() && body.back() == '\n') body.pop_back();
        write_chunk("data: " + body + "\n\n");
        write_chunk("data: [DONE]\n\n");
      }
      end_stream();
      return true;
    }
    return false;
  }

 private:
  std::string serialize(Response r) {
    http::response<http::string_body> res{static_cast<http::status>(r.status), version_};
    res.set(http::field::server, impl_->opts.server_name);
    res.set(http::field::content_type, r.content_type);
    for (auto& [k, v] : r.headers) res.set(k, v);
    bool keep = keep_alive_ && !impl_->stopping.load();
    res.keep_alive(keep);
    keep_alive_ = keep;
    res.body() = std::move(r.body);
    res.prepare_payload();
    std::ostringstream os;
    os << res;
    return os.str();
  }

  void do_read() {
    if (!stream_ || impl_->stopping.load()) return close();
    parser_.emplace();
    parser_->body_limit(impl_->opts.body_limit);
    parser_->header_limit(impl_->opts.header_limit);
    stream_->expires_after(impl_->opts.idle_timeout);
    // Headers first: a client that sent "Expect: 100-continue" (curl does for bodies over
    // 1 KiB) waits for our go-ahead before it sends the body.
    http::async_read_header(
        *stream_, buf_, *parser_, [self = shared_from_this()](beast::error_code ec, size_t) {
          if (ec || self->parser_->is_done()) return self->on_read(ec);
          auto& h = self->parser_->get();
          auto expect = str(h[http::field::expect]);
          if (lower(expect) == "100-continue" && h.version() >= 11) {
            auto cont = std::make_shared<std::string>("HTTP/1.1 100 Continue\r\n\r\n");
            return net::async_write(*self->stream_, net::buffer(*cont),
                                    [self, cont](beast::error_code wec, size_t) {
                                      if (wec) return self->close();
                                      self->read_body();
                                    });
          }
          self->read_body();
        });
  }

  void read_body() {
    http::async_read(
        *stream_, buf_, *parser_,
        [self = shared_from_this()](beast::error_code ec, size_t) { self->on_read(ec); });
  }

  void begin_request() {
    in_request_ = true;
    replied_ = false;
    streaming_ = false;
    stream_ended_ = false;
    srv_->in_flight_.fetch_add(1);
  }

  void end_request() {
    if (!in_request_) return;
    in_request_ = false;
    if (api_request_) srv_->api_in_flight_.fetch_sub(1);
    api_request_ = false;
    srv_->in_flight_.fetch_sub(1);
  }

  void on_read(beast::error_code ec) {
    if (ec == http::error::end_of_stream || ec == net::error::operation_aborted ||
        ec == beast::error::timeout || ec == net::error::connection_reset ||
        ec == net::error::eof) {
      return close();
    }
    if (ec) {
      // The request itself is bad: answer once, then close.
      Errc code = Errc::usage;
      std::string msg = "bad HTTP request: " + ec.message();
      int status = 400;
      if (ec == http::error::body_limit) {
        status = 413;
        msg = "request body larger than the limit of " + std::to_string(impl_->opts.body_limit) +
              " bytes";
        code = Errc::resource;
      } else if (ec == http::error::header_limit) {
        status = 431;
        msg = "request headers larger than the limit of " +
              std::to_string(impl_->opts.header_limit) + " bytes";
      }
      version_ = 11;
      keep_alive_ = false;
      begin_request();
      send(Response::error(make_error(code, msg), status));
      return;
    }
    stream_->expires_never();
    auto& msg = parser_->get();
    version_ = msg.version();
    keep_alive_ = msg.keep_alive();
    begin_request();
    Request req;
    try {
      req.method = str(msg.method_string());
      req.target = str(msg.target());
      split_target(req.target, &req.path, &req.query);
      for (auto& f : msg) req.headers[lower(str(f.name_string()))] = str(f.value());
      req.body = std::move(msg.body());
      req.peer = peer_;
    } catch (const std::exception& e) {
      return send(Response::error(make_error(Errc::resource, std::string("cannot take the "
                                                                         "request: ") +
                                                                 e.what()),
                                  503));
    }
    dispatch(req);
  }

  // Every reply, the listener's own 401/404/405/503 included, is built inside one guard:
  // whatever throws becomes a JSON error and the request is answered, so the in-flight
  // count always comes back down.
  void dispatch(const Request& req) {
    try {
      route_request(req);
    } catch (const HttpError& e) {
      send(Response::error(e.error()));
    } catch (const nlohmann::json::exception& e) {
      send(Response::error(make_error(Errc::usage, std::string("bad JSON in request: ") + e.what()),
                           400));
    } catch (const std::exception& e) {
      log::error(kComp, "{} {}: unhandled exception: {}", req.method, req.path, e.what());
      send(Response::error(make_error(Errc::internal, std::string("internal error: ") + e.what())));
    } catch (...) {
      log::error(kComp, "{} {}: unhandled exception", req.method, req.path);
      send(Response::error(make_error(Errc::internal, "internal error")));
    }
  }

  void route_request(const Request& req) {
    const auto& opts = impl_->opts;
    if (!opts.api_key.empty() && !opts.public_paths.count(req.path)) {
      std::string auth = req.header("authorization");
      std::string presented;
      if (auth.size() > 7 && lower(auth.substr(0, 7)) == "bearer ") presented = auth.substr(7);
      if (!constant_time_equal(presented, opts.api_key)) {
        Response r = Response::error(make_error(
            Errc::auth, presented.empty() ? "missing API key: send 'Authorization: Bearer <key>'"
                                          : "invalid API key"));
        r.headers.emplace_back("WWW-Authenticate", "Bearer");
        return send(std::move(r));
      }
    }
    auto pit = impl_->routes.find(req.path);
    // A route ending in "/*" answers every path under it ("/v1/models/*": a model's id,
    // which may hold slashes); the longest such prefix wins.
    if (pit == impl_->routes.end()) {
      size_t best = 0;
      for (auto it = impl_->routes.begin(); it != impl_->routes.end(); ++it) {
        const std::string& p = it->first;
        if (p.size() < 2 || p.compare(p.size() - 2, 2, "/*") != 0) continue;
        std::string_view prefix(p.data(), p.size() - 1);  // keeps the '/'
        if (req.path.size() > prefix.size() && req.path.compare(0, prefix.size(), prefix) == 0 &&
            prefix.size() > best) {
          best = prefix.size();
          pit = it;
        }
      }
    }
    if (pit != impl_->routes.end() && opts.not_ready && !opts.ungated_paths.count(req.path)) {
      std::string why = opts.not_ready();
      if (!why.empty()) {
        Response r = Response::error(make_error(Errc::precondition, "not ready: " + why), 503);
        r.headers.emplace_back("Retry-After", "5");
        return send(std::move(r));
      }
    }
    if (pit == impl_->routes.end()) {
      std::string known;
      for (auto& [p, m] : impl_->routes) known += (known.empty() ? "" : ", ") + p;
      return send(
          Response::error(make_error(Errc::not_found, "no route for " + req.method + " " +
                                                          req.path + " (routes: " + known + ")")));
    }
    auto mit = pit->second.find(req.method);
    if (mit == pit->second.end() && req.method == "HEAD") mit = pit->second.find("GET");
    if (mit == pit->second.end()) {
      std::string allow;
      for (auto& [m, r] : pit->second) allow += (allow.empty() ? "" : ", ") + m;
      Response r =
          Response::error(make_error(Errc::usage, req.method + " not allowed on " + req.path +
                                                      " (allowed: " + allow + ")"),
                          405);
      r.headers.emplace_back("Allow", allow);
      return send(std::move(r));
    }
    const Route& route = mit->second;
    if (!opts.ungated_paths.count(req.path)) {
      api_request_ = true;
      srv_->api_in_flight_.fetch_add(1);
    }
    Responder responder(shared_from_this());
    if (route.sync) {
      send(route.sync(req));
    } else {
      route.async(req, responder);
      watch_peer();
    }
  }

  // While an async route works, notice a client that hangs up (EOF or reset with nothing
  // to read) so closed() turns true and the route can cancel its work. Data from the peer
  // (a pipelined request) is left unread for the next do_read.
  void watch_peer() {
    if (!stream_ || replied_ || closed_) return;
    stream_->socket().async_wait(
        tcp::socket::wait_read, [self = shared_from_this()](beast::error_code ec) {
          if (ec || !self->stream_ || !self->in_request_ || self->replied_) return;
          char c;
          ssize_t n =
              ::recv(self->stream_->socket().native_handle(), &c, 1, MSG_PEEK | MSG_DONTWAIT);
          if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) self->close();
        });
  }

  void queue(std::string data) {
    if (!data.empty()) outq_.push_back(std::move(data));
    if (outq_.empty() && finish_after_write_ && !writing_) return on_written();
    do_write();
  }

  void do_write() {
    if (writing_ || outq_.empty() || !stream_) return;
    writing_ = true;
    stream_->expires_after(impl_->opts.write_timeout);
    net::async_write(*stream_, net::buffer(outq_.front()),
                     [self = shared_from_this()](beast::error_code ec, size_t) {
                       self->writing_ = false;
                       if (ec) {
                         self->outq_.clear();
                         self->end_request();
                         return self->close();
                       }
                       self->outq_.pop_front();
                       if (!self->outq_.empty()) return self->do_write();
                       if (self->finish_after_write_) self->on_written();
                     });
  }

  void on_written() {
    finish_after_write_ = false;
    end_request();
    if (keep_alive_ && !impl_->stopping.load()) return do_read();
    close();
  }

  HttpServer* srv_;
  HttpServer::Impl* impl_;
  std::shared_ptr<Gate> gate_;
  net::any_io_executor exec_;
  std::optional<beast::tcp_stream> stream_;
  beast::flat_buffer buf_;
  std::optional<http::request_parser<http::string_body>> parser_;
  std::string peer_, peer_addr_;
  unsigned version_ = 11;
  bool keep_alive_ = false;
  bool in_request_ = false;
  bool api_request_ = false;
  bool replied_ = false;
  bool streaming_ = false;
  bool sse_ = false;  // the stream is Server-Sent Events
  bool stream_ended_ = false;
  bool chunked_ = true;
  bool writing_ = false;
  bool finish_after_write_ = false;
  std::deque<std::string> outq_;
  std::atomic<bool> closed_{false};
};

void Responder::send(Response r) const {
  s_->on_reactor([r = std::move(r)](Session& s) mutable { s.send(std::move(r)); });
}
void Responder::begin_stream(int status, std::string content_type) const {
  s_->on_reactor(
      [status, ct = std::move(content_type)](Session& s) { s.begin_stream(status, ct); });
}
void Responder::write(std::string chunk) const {
  s_->on_reactor([c = std::move(chunk)](Session& s) mutable { s.write_chunk(std::move(c)); });
}
void Responder::end_stream() const {
  s_->on_reactor([](Session& s) { s.end_stream(); });
}
bool Responder::closed() const {
  return s_->closed();
}

HttpServer::HttpServer(ServerOptions opts) : impl_(std::make_unique<Impl>()) {
  impl_->opts = std::move(opts);
}

HttpServer::~HttpServer() {
  shutdown(std::chrono::milliseconds(0));
  {
    std::lock_guard lk(impl_->gate->mu);
    impl_->gate->open = false;
  }
  for (auto& w : impl_->sessions)
    if (auto s = w.lock()) s->release();
}

void HttpServer::route(const std::string& method, const std::string& path, Handler h) {
  impl_->routes[path][method] = Route{std::move(h), nullptr};
}

void HttpServer::route_async(const std::string& method, const std::string& path, AsyncHandler h) {
  impl_->routes[path][method] = Route{nullptr, std::move(h)};
}

boost::asio::io_context& HttpServer::io() {
  return impl_->ioc;
}

std::map<int, uint64_t> HttpServer::responses_by_status() const {
  std::lock_guard lk(impl_->stat_mu);
  return impl_->by_status;
}

namespace {
void do_accept(HttpServer* srv, HttpServer::Impl* impl);
}

Status HttpServer::start() {
  auto& I = *impl_;
  beast::error_code ec;
  auto addr = net::ip::make_address(I.opts.bind, ec);
  if (ec)
    return make_error(Errc::config, "bad bind address '" + I.opts.bind + "': " + ec.message());
  tcp::endpoint ep(addr, I.opts.port);
  std::string where = I.opts.bind + ":" + std::to_string(I.opts.port);
  I.acceptor.open(ep.protocol(), ec);
  if (!ec) I.acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) I.acceptor.bind(ep, ec);
  if (ec) {
    return make_error(Errc::network,
                      "cannot listen on " + where + ": " + ec.message() +
                          " (is another sparkd running? choose another port with --port)");
  }
  I.acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec) return make_error(Errc::network, "cannot listen on " + where + ": " + ec.message());
  port_ = I.acceptor.local_endpoint().port();
  I.work.emplace(I.ioc.get_executor());
  do_accept(this, impl_.get());
  I.started = true;
  I.thread = std::thread([this] {
    for (;;) {
      try {
        impl_->ioc.run();
        break;
      } catch (const std::exception& e) {
        log::error(kComp, "reactor: unhandled exception: {}", e.what());
      }
    }
  });
  log::info(kComp, "listening on {}:{}", I.opts.bind, port_);
  return Status::Ok();
}

// Accepting is a free function over Impl so the session type stays private to this file.
namespace {

// Why a new connection from `addr` is over a limit ("" when it is not). Sessions that
// ended have been pruned from impl.sessions.
std::string over_connection_limit(const HttpServer::Impl& impl, const std::string& addr) {
  const auto& o = impl.opts;
  size_t total = 0, from_peer = 0;
  for (const auto& w : impl.sessions) {
    auto s = w.lock();
    if (!s || s->closed()) continue;
    ++total;
    if (s->peer_addr() == addr) ++from_peer;
  }
  if (o.max_connections > 0 && total >= o.max_connections)
    return "too many connections: " + std::to_string(total) + " open, the limit is " +
           std::to_string(o.max_connections) + " (API_MAX_CONNECTIONS)";
  if (o.max_connections_per_peer > 0 && from_peer >= o.max_connections_per_peer)
    return "too many connections from " + addr + ": " + std::to_string(from_peer) +
           " open, the limit is " + std::to_string(o.max_connections_per_peer) +
           " per address (API_MAX_CONNECTIONS_PER_PEER)";
  return "";
}

// Makes room for a connection from `addr` that is over a cap by closing the oldest idle
// connection (open, no request being answered) that counts against that cap: one from
// `addr` for the per-address cap, any for the total. Idle connections, however many, then
// never keep a request (the watchdog's /health first of all) out. False when every
// connection that counts is answering a request.
bool evict_idle(HttpServer::Impl& impl, const std::string& addr, bool same_peer) {
  for (const auto& w : impl.sessions) {  // oldest first
    auto s = w.lock();
    if (!s || !s->idle() || (same_peer && s->peer_addr() != addr)) continue;
    log::info(kComp, "closing an idle connection from {} to make room for a new one",
              s->peer_addr());
    s->close();
    return true;
  }
  return false;
}

// Answers 503 on a connection over a limit without reading from it, then closes it.
void refuse_connection(tcp::socket sock, const std::string& why) {
  log::warn(kComp, "refusing a connection: {}", why);
  auto r = Response::error(make_error(Errc::busy, why), 503);
  auto wire = std::make_shared<std::string>(
      "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
      "Retry-After: 1\r\nConnection: close\r\nContent-Length: " +
      std::to_string(r.body.size()) + "\r\n\r\n" + r.body);
  auto sp = std::make_shared<tcp::socket>(std::move(sock));
  net::async_write(*sp, net::buffer(*wire), [sp, wire](beast::error_code, size_t) {
    beast::error_code ec;
    sp->shutdown(tcp::socket::shutdown_both, ec);
    sp->close(ec);
  });
}

void do_accept(HttpServer* srv, HttpServer::Impl* impl) {
  impl->acceptor.async_accept(
      net::make_strand(impl->ioc), [srv, impl](beast::error_code ec, tcp::socket sock) {
        if (ec == net::error::operation_aborted || !impl->acceptor.is_open()) return;
        if (!ec && !impl->stopping.load()) {
          auto& v = impl->sessions;
          v.erase(std::remove_if(v.begin(), v.end(), [](auto& w) { return w.expired(); }), v.end());
          beast::error_code pec;
          auto ep = sock.remote_endpoint(pec);
          std::string addr = pec ? std::string() : ep.address().to_string();
          std::string why = over_connection_limit(*impl, addr);
          // Over a cap: the oldest idle connection that counts against it gives its place.
          for (int tries = 0; !why.empty() && tries < 2; ++tries) {
            bool per_peer = why.find("API_MAX_CONNECTIONS_PER_PEER") != std::string::npos;
            if (!evict_idle(*impl, addr, per_peer)) break;
            why = over_connection_limit(*impl, addr);
          }
          if (!why.empty()) {
            refuse_connection(std::move(sock), why);
          } else {
            auto s = std::make_shared<Session>(std::move(sock), srv);
            v.push_back(s);
            s->start();
          }
        } else if (ec) {
          log::warn(kComp, "accept failed: {}", ec.message());
        }
        do_accept(srv, impl);
      });
}
}  // namespace

int HttpServer::shutdown(std::chrono::milliseconds grace) {
  auto& I = *impl_;
  if (!I.started || I.shut) return 0;
  I.shut = true;
  I.stopping = true;
  net::post(I.ioc, [&I] {
    beast::error_code ec;
    I.acceptor.close(ec);
    for (auto& w : I.sessions)
      if (auto s = w.lock()) s->close_if_idle();
  });
  auto deadline = std::chrono::steady_clock::now() + grace;
  while (in_flight_.load() > 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  int cut = in_flight_.load();
  if (cut > 0) {
    log::warn(kComp,
              "shutdown grace ran out with {} request(s) in flight; answering them 503 and "
              "closing them",
              cut);
    // A final error for each (503, or an SSE error event and [DONE]), written within a
    // second; what is still unwritten then is cut with its connection.
    net::post(I.ioc, [&I] {
      for (auto& w : I.sessions)
        if (auto s = w.lock()) s->cut_off();
    });
    auto flush = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    while (in_flight_.load() > 0 && std::chrono::steady_clock::now() < flush)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  net::post(I.ioc, [&I] {
    for (auto& w : I.sessions)
      if (auto s = w.lock()) s->close();
    I.work.reset();
    I.ioc.stop();
  });
  if (I.thread.joinable()) I.thread.join();
  log::info(kComp, "listener closed");
  return cut;
}

}  // namespace spark::daemon
