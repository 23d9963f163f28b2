// What the head makes of rank 0's /health answers: a listener at its connection cap is
// "busy" (the ring's health unknown), never a health body; a health body whose fields have
// unexpected types is read without throwing. A real listener on loopback gives the answers.
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <nlohmann/json.hpp>
#include <thread>

#include "cli/ring_nodes.h"
#include "cli/ring_ops.h"
#include "core/config.h"

using namespace spark;
using namespace spark::cli;
using namespace std::chrono_literals;

namespace {

// Answers every connection with one fixed HTTP response, then closes it.
struct FixedListener {
  int fd = -1;
  int port = 0;
  std::string reply;
  std::thread th;
  std::atomic<bool> stop{false};
  FixedListener(int status, const std::string& body) {
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    socklen_t n = sizeof a;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n);
    port = ntohs(a.sin_port);
    REQUIRE(::listen(fd, 8) == 0);
    reply = "HTTP/1.1 " + std::to_string(status) +
            " X\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: " +
            std::to_string(body.size()) + "\r\n\r\n" + body;
    th = std::thread([this] {
      while (!stop) {
        int c = ::accept(fd, nullptr, nullptr);
        if (c < 0) return;
        char buf[4096];
        (void)::read(c, buf, sizeof buf);  // the request: one small GET
        (void)::write(c, reply.data(), reply.size());
        ::close(c);
      }
    });
  }
  ~FixedListener() {
    stop = true;
    ::shutdown(fd, SHUT_RDWR);
    ::close(fd);
    th.join();
  }
};

RingConfig ring_on(int port) {
  Environment env;
  std::vector<Diagnostic> d;
  auto cfg = load_config_text(
      "MODEL=demo\nAPI_PORT=" + std::to_string(port) + "\nNODE0_SSH=local\n", "t.env", env, &d);
  REQUIRE(cfg.ok());
  return *cfg;
}

}  // namespace

TEST_CASE("health answers: a 503 of the connection cap is busy, not a health body") {
  // What sparkd's listener writes on a connection over API_MAX_CONNECTIONS_PER_PEER.
  FixedListener l(503, R"({"error":{"message":"too many connections from 127.0.0.1: 128 open, the )"
                       R"x(limit is 128 per address (API_MAX_CONNECTIONS_PER_PEER)","type":)x"
                       R"("service_unavailable_error","param":null,"code":"busy"}})");
  auto cfg = ring_on(l.port);
  auto h = fetch_health(cfg, RingLayout{}, 3000ms);
  REQUIRE_FALSE(h.ok());
  CHECK(h.error().code == Errc::busy);
  CHECK(h.error().message.find("API_MAX_CONNECTIONS_PER_PEER") != std::string::npos);
}

TEST_CASE("health answers: another error body is a network error naming the status") {
  FixedListener l(404, R"({"error":{"message":"no route /health","type":"not_found_error"}})");
  auto h = fetch_health(ring_on(l.port), RingLayout{}, 3000ms);
  REQUIRE_FALSE(h.ok());
  CHECK(h.error().code == Errc::network);
  CHECK(h.error().message.find("answered 404: no route /health") != std::string::npos);
}

TEST_CASE("health answers: fields of unexpected types are dropped, readers never throw") {
  FixedListener l(200, R"({"live": true, "ready": "yes", "state": 5, "slots": null,)"
                       R"( "ranks": [1, {"rank": "x", "alive": true, "state": "ready"}]})");
  auto h = fetch_health(ring_on(l.port), RingLayout{}, 3000ms);
  REQUIRE(h.ok());
  CHECK_NOTHROW((void)(*h)["slots"].value("total", 0));
  CHECK((*h)["slots"].value("total", 0) == 0);
  CHECK_NOTHROW((void)strict_problem(*h));
  CHECK(strict_problem(*h) == "?");  // not ready, state unknown
  REQUIRE((*h)["ranks"].size() == 1);
  CHECK_NOTHROW((void)(*h)["ranks"][0].value("rank", -1));
}
