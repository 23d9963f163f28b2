// The HTTP listener in-process on a free loopback port, talked to with the real client.
#include "daemon/http_server.h"

#include <doctest/doctest.h>

#include <atomic>
#include <boost/asio.hpp>
#include <future>
#include <mutex>
#include <thread>
#include <utility>  // before Asio: Boost 1.74 awaitable.hpp uses std::exchange

#include "core/http_client.h"

using namespace spark;
using namespace spark::daemon;
using namespace std::chrono_literals;

namespace {

HttpCall call_to(const HttpServer& s, const std::string& method, const std::string& target) {
  HttpCall c;
  c.method = method;
  c.port = s.port();
  c.target = target;
  c.timeout = 5000ms;
  return c;
}

Result<HttpReply> get(const HttpServer& s, const std::string& target,
                      std::vector<std::pair<std::string, std::string>> headers = {}) {
  HttpCall c = call_to(s, "GET", target);
  c.headers = std::move(headers);
  return http_call(c);
}

nlohmann::json body_json(const HttpReply& r) {
  return nlohmann::json::parse(r.body);
}

// Writes `bytes` on a fresh connection and reads the whole answer. The connection is
// half-closed after the request unless it asks for "Connection: close" (an async route
// reads a half-close as a client that went away, and drops its answer).
std::string raw_exchange(uint16_t port, const std::string& bytes) {
  boost::asio::io_context io;
  boost::asio::ip::tcp::socket sock(io);
  sock.connect({boost::asio::ip::make_address("127.0.0.1"), port});
  // The server may answer and close before the whole request is written (413, 431): then
  // the write or the half-close fails, and what it answered is still there to read.
  boost::system::error_code ec;
  boost::asio::write(sock, boost::asio::buffer(bytes), ec);
  if (bytes.find("Connection: close") == std::string::npos)
    sock.shutdown(boost::asio::ip::tcp::socket::shutdown_send, ec);
  ec.clear();
  std::string got;
  char buf[4096];
  while (!ec) {
    size_t n = sock.read_some(boost::asio::buffer(buf), ec);
    got.append(buf, n);
  }
  return got;
}

// The JSON body of a raw HTTP answer (after the blank line).
nlohmann::json raw_body(const std::string& reply) {
  auto at = reply.find("\r\n\r\n");
  if (at == std::string::npos) return nullptr;
  return nlohmann::json::parse(reply.substr(at + 4), nullptr, false);
}

bool openai_shaped(const nlohmann::json& j) {
  return j.is_object() && j.contains("error") && j["error"].contains("message") &&
         j["error"]["type"].is_string() && j["error"].contains("param") &&
         j["error"].contains("code");
}

// Waits until the server has no request in flight (each reply is written before the
// count drops, so the client can see its answer a moment before).
int settled_in_flight(const HttpServer& s) {
  for (int i = 0; i < 400 && s.in_flight() != 0; ++i) std::this_thread::sleep_for(5ms);
  return s.in_flight();
}

}  // namespace

TEST_CASE("http: routes answer, unknown routes and wrong methods get JSON errors") {
  ServerOptions o;
  HttpServer s(o);
  s.route("GET", "/ping", [](const Request& r) {
    return Response::json(200, {{"pong", true}, {"q", r.has_query("strict")}});
  });
  s.route("GET", "/missing",
          [](const Request&) -> Response { throw_http(Errc::not_found, "model 'x' not found"); });
  s.route("GET", "/boom", [](const Request&) -> Response { throw std::runtime_error("kaboom"); });
  REQUIRE(s.start().ok());
  REQUIRE(s.port() != 0);

  auto r = get(s, "/ping?strict");
  REQUIRE(r.ok());
  CHECK(r->status == 200);
  CHECK(r->headers["content-type"] == "application/json");
  CHECK(body_json(*r)["pong"] == true);
  CHECK(body_json(*r)["q"] == true);

  r = get(s, "/nope");
  REQUIRE(r.ok());
  CHECK(r->status == 404);
  CHECK(body_json(*r)["error"]["type"] == "not_found_error");
  CHECK(body_json(*r)["error"]["code"] == "not_found");
  CHECK(body_json(*r)["error"]["param"].is_null());
  CHECK(body_json(*r)["error"]["message"].get<std::string>().find("/nope") != std::string::npos);

  r = get(s, "/missing");
  REQUIRE(r.ok());
  CHECK(r->status == 404);
  CHECK(body_json(*r)["error"]["message"] == "model 'x' not found");

  r = get(s, "/boom");
  REQUIRE(r.ok());
  CHECK(r->status == 500);
  CHECK(body_json(*r)["error"]["type"] == "server_error");
  CHECK(body_json(*r)["error"]["code"] == "internal");
  CHECK(body_json(*r)["error"]["message"].get<std::string>().find("kaboom") != std::string::npos);

  r = http_call(call_to(s, "DELETE", "/ping"));
  REQUIRE(r.ok());
  CHECK(r->status == 405);
  CHECK(r->headers["allow"] == "GET");
  CHECK(body_json(*r)["error"]["type"] == "invalid_request_error");
  CHECK(body_json(*r)["error"]["code"] == "usage");
  CHECK(s.shutdown(1000ms) == 0);
}

TEST_CASE("http: bodies over the limit get 413, bodies under it arrive whole") {
  ServerOptions o;
  o.body_limit = 1024;
  HttpServer s(o);
  s.route("POST", "/echo", [](const Request& r) {
    return Response::json(200, {{"n", r.body.size()}});
  });
  REQUIRE(s.start().ok());
  HttpCall c = call_to(s, "POST", "/echo");
  c.body = std::string(1000, 'a');
  auto r = http_call(c);
  REQUIRE(r.ok());
  CHECK(r->status == 200);
  CHECK(body_json(*r)["n"] == 1000);
  c.body = std::string(4096, 'a');
  r = http_call(c);
  REQUIRE(r.ok());
  CHECK(r->status == 413);
  CHECK(body_json(*r)["error"]["message"].get<std::string>().find("1024") != std::string::npos);
}

TEST_CASE("http: Expect: 100-continue gets its go-ahead before the body is sent") {
  HttpServer s(ServerOptions{});
  s.route("POST", "/echo", [](const Request& r) {
    return Response::json(200, {{"n", r.body.size()}});
  });
  REQUIRE(s.start().ok());
  boost::asio::io_context io;
  boost::asio::ip::tcp::socket sock(io);
  sock.connect({boost::asio::ip::make_address("127.0.0.1"), s.port()});
  std::string body(5000, 'x');
  std::string head =
      "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
      "Content-Length: " +
      std::to_string(body.size()) + "\r\nExpect: 100-continue\r\n\r\n";
  boost::asio::write(sock, boost::asio::buffer(head));
  // The interim answer must come without the body having been sent.
  std::string got;
  char buf[256];
  sock.non_blocking(true);
  auto end = std::chrono::steady_clock::now() + 2s;
  while (got.find("\r\n\r\n") == std::string::npos && std::chrono::steady_clock::now() < end) {
    boost::system::error_code ec;
    size_t n = sock.read_some(boost::asio::buffer(buf), ec);
    if (!ec)
      got.append(buf, n);
    else
      std::this_thread::sleep_for(5ms);
  }
  CHECK(got.rfind("HTTP/1.1 100 Continue", 0) == 0);
  sock.non_blocking(false);
  boost::asio::write(sock, boost::asio::buffer(body));
  std::string rest;
  boost::system::error_code ec;
  while (rest.find("\"n\":5000") == std::string::npos && !ec) {
    size_t n = sock.read_some(boost::asio::buffer(buf), ec);
    rest.append(buf, n);
  }
  CHECK(rest.find("200 OK") != std::string::npos);
  CHECK(rest.find("\"n\":5000") != std::string::npos);
}

TEST_CASE("http: async routes answer from another thread; streams are chunked") {
  HttpServer s(ServerOptions{});
  std::vector<std::thread> workers;
  s.route_async("GET", "/later", [&](const Request&, Responder rsp) {
    workers.emplace_back([rsp] {
      std::this_thread::sleep_for(50ms);
      rsp.send(Response::json(200, {{"later", true}}));
    });
  });
  s.route_async("GET", "/stream", [&](const Request&, Responder rsp) {
    workers.emplace_back([rsp] {
      rsp.begin_stream(200, "text/event-stream");
      for (int i = 0; i < 3; ++i) rsp.write("data: " + std::to_string(i) + "\n\n");
      rsp.end_stream();
    });
  });
  REQUIRE(s.start().ok());
  auto r = get(s, "/later");
  REQUIRE(r.ok());
  CHECK(r->status == 200);
  CHECK(body_json(*r)["later"] == true);
  r = get(s, "/stream");
  REQUIRE(r.ok());
  CHECK(r->status == 200);
  CHECK(r->headers["transfer-encoding"] == "chunked");
  CHECK(r->body == "data: 0\n\ndata: 1\n\ndata: 2\n\n");
  for (auto& w : workers) w.join();
}

TEST_CASE("http: API key is required except on public paths, compared exactly") {
  ServerOptions o;
  o.api_key = "s3cret-key";
  HttpServer s(o);
  s.route("GET", "/health", [](const Request&) { return Response::json(200, {{"ok", true}}); });
  s.route("GET", "/v1/models", [](const Request&) { return Response::json(200, {{"data", 1}}); });
  REQUIRE(s.start().ok());
  CHECK(get(s, "/health")->status == 200);
  auto r = get(s, "/v1/models");
  CHECK(r->status == 401);
  CHECK(r->headers["www-authenticate"] == "Bearer");
  CHECK(get(s, "/v1/models", {{"Authorization", "Bearer s3cret-kex"}})->status == 401);
  CHECK(get(s, "/v1/models", {{"Authorization", "Bearer s3cret-key-longer"}})->status == 401);
  CHECK(get(s, "/v1/models", {{"Authorization", "Basic s3cret-key"}})->status == 401);
  CHECK(get(s, "/v1/models", {{"Authorization", "Bearer s3cret-key"}})->status == 200);
  CHECK(constant_time_equal("abc", "abc"));
  CHECK_FALSE(constant_time_equal("abc", "abd"));
  CHECK_FALSE(constant_time_equal("abc", "ab"));
  CHECK_FALSE(constant_time_equal("", "a"));
}

TEST_CASE("http: the readiness gate answers 503 loading on API paths, never on /health") {
  std::atomic<bool> ready{false};
  ServerOptions o;
  o.not_ready = [&]() -> std::string { return ready ? "" : "loading: weights 40%"; };
  HttpServer s(o);
  s.route("GET", "/health", [](const Request&) { return Response::json(200, {{"live", true}}); });
  s.route("GET", "/v1/models", [](const Request&) { return Response::json(200, {{"data", 1}}); });
  REQUIRE(s.start().ok());
  auto r = get(s, "/v1/models");
  CHECK(r->status == 503);
  CHECK(r->headers["retry-after"] == "5");
  CHECK(body_json(*r)["error"]["message"].get<std::string>().find("weights 40%") !=
        std::string::npos);
  CHECK(get(s, "/health")->status == 200);
  ready = true;
  CHECK(get(s, "/v1/models")->status == 200);
}

TEST_CASE("http: shutdown lets a request in flight finish, and cuts it off after the grace") {
  HttpServer s(ServerOptions{});
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::vector<std::thread> workers;
  s.route_async("GET", "/slow", [&](const Request&, Responder rsp) {
    workers.emplace_back([rsp, released] {
      released.wait_for(3s);
      rsp.send(Response::json(200, {{"done", true}}));
    });
  });
  REQUIRE(s.start().ok());
  auto client = std::async(std::launch::async, [&] { return get(s, "/slow"); });
  for (int i = 0; i < 200 && s.in_flight() == 0; ++i) std::this_thread::sleep_for(5ms);
  REQUIRE(s.in_flight() == 1);
  CHECK(s.api_in_flight() == 1);
  std::thread unblock([&] {
    std::this_thread::sleep_for(150ms);
    release.set_value();
  });
  auto t0 = std::chrono::steady_clock::now();
  CHECK(s.shutdown(3000ms) == 0);  // finished inside the grace
  CHECK(std::chrono::steady_clock::now() - t0 >= 100ms);
  auto r = client.get();
  REQUIRE(r.ok());
  CHECK(r->status == 200);
  CHECK(r->headers["connection"] == "close");
  // The listener is closed now.
  CHECK_FALSE(get(s, "/slow").ok());
  unblock.join();
  for (auto& w : workers) w.join();
}

TEST_CASE("http: a request that never finishes is answered 503 when the grace runs out") {
  HttpServer s(ServerOptions{});
  std::vector<Responder> parked;
  std::mutex mu;
  s.route_async("GET", "/hang", [&](const Request&, Responder rsp) {
    std::lock_guard lk(mu);
    parked.push_back(rsp);
  });
  REQUIRE(s.start().ok());
  auto client = std::async(std::launch::async, [&] { return get(s, "/hang"); });
  for (int i = 0; i < 200 && s.in_flight() == 0; ++i) std::this_thread::sleep_for(5ms);
  CHECK(s.shutdown(200ms) == 1);
  // It was answered 503 at the end of the grace (not left without a reply).
  auto r = client.get();
  REQUIRE(r.ok());
  CHECK(r->status == 503);
  // A late reply from the engine after shutdown is dropped, not a crash.
  for (auto& p : parked) p.send(Response::json(200, {}));
}

TEST_CASE("http: a port in use is a clear network error") {
  HttpServer a(ServerOptions{});
  REQUIRE(a.start().ok());
  ServerOptions o;
  o.port = a.port();
  HttpServer b(o);
  Status st = b.start();
  REQUIRE_FALSE(st.ok());
  CHECK(st.code() == Errc::network);
  CHECK(st.message().find(std::to_string(a.port())) != std::string::npos);
}

TEST_CASE("http: no request leaves the in-flight count wrong; every error is OpenAI-shaped") {
  for (bool keyed : {false, true}) {
    for (bool gated : {false, true}) {
      CAPTURE(keyed);
      CAPTURE(gated);
      ServerOptions o;
      if (keyed) o.api_key = "k";
      if (gated) o.not_ready = [] { return std::string("loading: \xff\xfe weights"); };
      o.body_limit = 4096;
      o.header_limit = 2048;
      HttpServer s(o);
      std::vector<std::thread> workers;
      std::mutex mu;
      s.route("GET", "/health", [](const Request&) { return Response::json(200, {{"ok", 1}}); });
      s.route("POST", "/v1/echo", [](const Request& r) {
        return Response::json(200, {{"body", r.body}, {"path", r.path}});  // any bytes
      });
      s.route("GET", "/v1/throw",
              [](const Request& r) -> Response { throw std::runtime_error("bad " + r.path); });
      s.route_async("GET", "/v1/async-throw", [](const Request&, Responder) {
        throw HttpError(make_error(Errc::usage, "refused \xc3\x28"));
      });
      s.route_async("POST", "/v1/later", [&](const Request& r, Responder rsp) {
        std::lock_guard lk(mu);
        workers.emplace_back([rsp, b = r.body] { rsp.send(Response::json(200, {{"echo", b}})); });
      });
      REQUIRE(s.start().ok());
      const std::string auth = keyed ? "Authorization: Bearer k\r\n" : "";
      const std::vector<std::pair<std::string, std::string>> cases = {
          {"404 invalid UTF-8 path", "GET /%ff HTTP/1.1\r\nHost: x\r\n" + auth + "\r\n"},
          {"404 raw byte path", "GET /\xff\xfe HTTP/1.1\r\nHost: x\r\n" + auth + "\r\n"},
          {"405", "DELETE /v1/echo HTTP/1.1\r\nHost: x\r\n" + auth + "\r\n"},
          {"405 bad method", "G\xffT /v1/echo HTTP/1.1\r\nHost: x\r\n\r\n"},
          {"413", "POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Length: 9999\r\n\r\n"},
          {"431", "GET /v1/echo HTTP/1.1\r\nX: " + std::string(4000, 'a') + "\r\n\r\n"},
          {"400 garbage", "\x01\x02\x03 nonsense\r\n\r\n"},
          {"echo bad UTF-8 body", "POST /v1/echo%ff HTTP/1.1\r\nHost: x\r\n" + auth +
                                      "Content-Length: 3\r\n\r\n\xff\xc3\x28"},
          {"throw", "GET /v1/throw%ff HTTP/1.1\r\nHost: x\r\n" + auth + "\r\n"},
          {"async throw", "GET /v1/async-throw HTTP/1.1\r\nHost: x\r\n" + auth + "\r\n"},
          {"async", "POST /v1/later HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + auth +
                        "Content-Length: 2\r\n\r\n\xfe\xff"},
          {"401 bad key", "GET /v1/throw HTTP/1.1\r\nAuthorization: Bearer \xff\r\n\r\n"},
          {"pipelined",
           "GET /%ff HTTP/1.1\r\nHost: x\r\n" + auth + "\r\nGET /%fe HTTP/1.1\r\n" + auth + "\r\n"},
          {"truncated", "POST /v1/echo HTTP/1.1\r\nContent-Length: 50\r\n\r\nabc"},
      };
      for (const auto& c : cases) {
        const auto& name = c.first;
        const auto& bytes = c.second;
        CAPTURE(name);
        std::string reply = raw_exchange(s.port(), bytes);
        if (name == "pipelined") {
          CHECK(reply.rfind("HTTP/1.1 404", 0) == 0);
          CHECK(reply.find("HTTP/1.1 404", 1) != std::string::npos);  // both answered
        } else if (name != "truncated") {
          REQUIRE(reply.rfind("HTTP/1.1 ", 0) == 0);
          int status = std::stoi(reply.substr(9, 3));
          if (status != 200)
            CHECK(openai_shaped(raw_body(reply)));
          else
            CHECK(raw_body(reply).is_object());
        }
        CHECK(settled_in_flight(s) == 0);
        CHECK(s.api_in_flight() == 0);
      }
      CHECK(s.in_flight() == 0);  // nothing left for the grace to wait on
      CHECK(s.shutdown(5000ms) == 0);
      std::lock_guard lk(mu);
      for (auto& w : workers) w.join();
    }
  }
}

TEST_CASE(
    "http: at a connection cap the oldest idle connection gives its place; busy ones get 503") {
  ServerOptions o;
  o.max_connections_per_peer = 2;
  o.max_connections = 3;
  HttpServer s(o);
  s.route("GET", "/ping", [](const Request&) { return Response::json(200, {{"pong", true}}); });
  std::mutex mu;
  std::vector<Responder> held;  // requests kept unanswered: their connections are busy
  s.route_async("GET", "/hold", [&](const Request&, Responder rsp) {
    std::lock_guard lk(mu);
    held.push_back(rsp);
  });
  REQUIRE(s.start().ok());
  boost::asio::io_context io;
  using tcp = boost::asio::ip::tcp;
  auto open_from = [&](const char* ip) {
    auto sock = std::make_unique<tcp::socket>(io);
    sock->open(tcp::v4());
    sock->bind({boost::asio::ip::make_address(ip), 0});
    sock->connect({boost::asio::ip::make_address("127.0.0.1"), s.port()});
    return sock;
  };
  auto closed_by_server = [](tcp::socket& sock) {
    timeval tv{30, 0};  // bounded: a connection left open fails the check instead of hanging
    ::setsockopt(sock.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char c;
    boost::system::error_code ec;
    sock.read_some(boost::asio::buffer(&c, 1), ec);  // blocks until data or close
    return ec == boost::asio::error::eof || ec == boost::asio::error::connection_reset;
  };
  auto held_count = [&] {
    std::lock_guard lk(mu);
    return held.size();
  };
  // Two idle connections from one address (what 128 idle clients do to a real sparkd): the
  // next request from that address is answered, and the oldest idle one is closed for it.
  auto a = open_from("127.0.0.1");
  auto b = open_from("127.0.0.1");
  std::this_thread::sleep_for(100ms);  // accepted before the next arrives
  std::string reply = raw_exchange(s.port(), "GET /ping HTTP/1.1\r\nHost: x\r\n\r\n");
  CHECK(reply.rfind("HTTP/1.1 200", 0) == 0);
  CHECK(closed_by_server(*a));
  // Two connections of that address answering requests are never closed for another: the
  // next one is answered 503 (OpenAI's shape, naming the cap) and closed.
  auto c = open_from("127.0.0.1");
  auto d = open_from("127.0.0.1");
  for (auto* sock : {c.get(), d.get()})
    boost::asio::write(*sock,
                       boost::asio::buffer(std::string("GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")));
  for (int i = 0; i < 500 && held_count() < 2; ++i) std::this_thread::sleep_for(10ms);
  REQUIRE(held_count() == 2);
  reply = raw_exchange(s.port(), "GET /ping HTTP/1.1\r\nHost: x\r\n\r\n");
  REQUIRE(reply.rfind("HTTP/1.1 503", 0) == 0);
  auto j = raw_body(reply);
  CHECK(openai_shaped(j));
  CHECK(j["error"]["message"].get<std::string>().find("API_MAX_CONNECTIONS_PER_PEER") !=
        std::string::npos);
  CHECK(reply.find("Retry-After: 1") != std::string::npos);
  // Another address counts on its own, up to the total (3: the two busy ones and b, which
  // is idle and gives its place).
  {
    auto other = open_from("127.0.0.2");
    boost::asio::write(*other, boost::asio::buffer(std::string("GET /ping HTTP/1.1\r\nHost: x\r\n"
                                                               "Connection: close\r\n\r\n")));
    std::string got;
    char buf[1024];
    boost::system::error_code ec;
    while (!ec) got.append(buf, other->read_some(boost::asio::buffer(buf), ec));
    CHECK(got.rfind("HTTP/1.1 200", 0) == 0);
  }
  CHECK(closed_by_server(*b));
  {
    std::lock_guard lk(mu);
    for (auto& h : held) h.send(Response::json(200, {{"held", true}}));
  }
  CHECK(s.shutdown(1000ms) == 0);
}

TEST_CASE("http: requests still running when the shutdown grace ends get a final error") {
  HttpServer s(ServerOptions{});
  std::mutex mu;
  std::vector<Responder> held;
  std::atomic<int> arrived{0};
  s.route_async("GET", "/never", [&](const Request&, Responder rsp) {
    std::lock_guard lk(mu);
    held.push_back(rsp);
    ++arrived;
  });
  s.route_async("GET", "/stream-never", [&](const Request&, Responder rsp) {
    rsp.begin_stream(200, "text/event-stream");
    rsp.write("data: {\"n\":1}\n\n");
    std::lock_guard lk(mu);
    held.push_back(rsp);
    ++arrived;
  });
  REQUIRE(s.start().ok());
  auto fetch = [&](const std::string& path) {
    return std::async(std::launch::async, [&s, path] {
      return raw_exchange(s.port(),
                          "GET " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    });
  };
  auto plain = fetch("/never");
  auto stream = fetch("/stream-never");
  for (int i = 0; i < 500 && arrived < 2; ++i) std::this_thread::sleep_for(10ms);
  REQUIRE(arrived == 2);
  CHECK(s.shutdown(100ms) == 2);
  std::string p = plain.get(), st = stream.get();
  // The plain request: a 503 in OpenAI's shape that says why.
  REQUIRE(p.rfind("HTTP/1.1 503", 0) == 0);
  auto j = raw_body(p);
  CHECK(openai_shaped(j));
  CHECK(j["error"]["message"].get<std::string>().find("SHUTDOWN_GRACE") != std::string::npos);
  // The stream: what it had, then an error event, [DONE] and the end of the chunked body.
  CHECK(st.rfind("HTTP/1.1 200", 0) == 0);
  size_t first = st.find("data: {\"n\":1}");
  size_t err = st.find("data: {\"error\":");
  size_t done = st.find("data: [DONE]");
  REQUIRE(first != std::string::npos);
  REQUIRE(err != std::string::npos);
  REQUIRE(done != std::string::npos);
  CHECK(first < err);
  CHECK(err < done);
  CHECK(st.find("SHUTDOWN_GRACE", err) < done);
  CHECK(st.find("\r\n0\r\n\r\n", done) != std::string::npos);
  std::lock_guard lk(mu);
  held.clear();
}

TEST_CASE("http client: parse_url") {
  auto u = parse_url("http://10.0.0.2:8001/health?x=1");
  REQUIRE(u.ok());
  CHECK(u->host == "10.0.0.2");
  CHECK(u->port == 8001);
  CHECK(u->target == "/health?x=1");
  CHECK(parse_url("http://h")->target == "/");
  CHECK(parse_url("http://h")->port == 80);
  CHECK(parse_url("https://h").error().code == Errc::unsupported);
  CHECK_FALSE(parse_url("http://h:99999/").ok());
  CHECK_FALSE(parse_url("ftp://h/").ok());
}
