// rank 0's connection cap against a live one-node ring on the CPU (the real sparkctl and
// sparkd, the native engine on the demo model): idle unauthenticated connections from
// 127.0.0.1 past API_MAX_CONNECTIONS_PER_PEER never make the ring read as unhealthy, and
// when the cap is full of requests being answered, watch says `capped` (no failure counted,
// no restart) and `status --json` answers with the ring's state unknown, never a crash.
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <thread>

#include "core/process.h"
#include "core/strings.h"
#include "support/netns_ring.h"
#include "support/spawn.h"
#include "support/tempdir.h"

using namespace spark;
using namespace std::chrono_literals;
using nlohmann::json;

namespace {

// A TCP connection from `src` (a loopback address) to 127.0.0.1:port; -1 on failure.
int connect_from(const char* src, int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in s{};
  s.sin_family = AF_INET;
  ::inet_pton(AF_INET, src, &s.sin_addr);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval tv{10, 0};  // every read below is bounded
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&s), sizeof s) != 0 ||
      ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// GET /health from `src`: the status line and the JSON body (null when none came).
std::pair<std::string, json> health_from(const char* src, int port) {
  int fd = connect_from(src, port);
  if (fd < 0) return {"connect failed", json()};
  const std::string req = "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  (void)::send(fd, req.data(), req.size(), MSG_NOSIGNAL);
  std::string got;
  char buf[4096];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;)
    got.append(buf, static_cast<size_t>(n));
  ::close(fd);
  auto eol = got.find("\r\n"), body = got.find("\r\n\r\n");
  if (eol == std::string::npos || body == std::string::npos) return {got, json()};
  return {got.substr(0, eol), json::parse(got.substr(body + 4), nullptr, false)};
}

// True once the peer closed `fd` without a word (a read returns end of file at once).
bool closed_by_peer(int fd) {
  char c;
  return ::recv(fd, &c, 1, MSG_DONTWAIT | MSG_PEEK) == 0;
}
// True once the peer answered or closed `fd` (a read would not wait).
bool settled(int fd) {
  char c;
  return ::recv(fd, &c, 1, MSG_DONTWAIT | MSG_PEEK) >= 0;
}

struct NativeRing {
  test::TempDir dir{"spark-ringcap"};
  int api_port = test::free_port();
  std::string cfg, error;

  NativeRing() {
    auto [st, out] = test::run_capture({SPARKCTL_BIN, "demo-model", dir / "model"}, {},
                                       std::chrono::seconds(60));
    if (st != 0) {
      error = "sparkctl demo-model failed: " + out;
      return;
    }
    // One-message chats render for ever (no step budget, no deadline): a request that stays
    // in flight until its client goes. The load's probes have more messages.
    dir.write("model/chat_template.jinja",
              "{% for m in messages %}{{ m.content }}{% endfor %}{% if messages | length == 1 %}"
              "{% for i in range(1000000) %}{% for j in range(1000000) %}{% endfor %}{% endfor %}"
              "{% endif %}");
    cfg = dir.write(
        "ring.env",
        fmt::format("RING_NAME=cap\nMODEL=demo\nMODEL_PATH={dir}/model\nSLOTS=2\nCONTEXT_LEN=1024\n"
                    "PROBE_PROMPT=a\nTEMPLATE_MAX_STEPS=9000000000000000000\nTEMPLATE_TIMEOUT=0\n"
                    "API_BIND=127.0.0.1\nAPI_PORT={api}\nRDZV_PORT={rdzv}\nSTATE_DIR={dir}/state\n"
                    "SPARKD_BIN={sparkd}\nSPARKCTL_BIN={sparkctl}\nREADY_TIMEOUT=60s\n"
                    "MEM_FREE_MIN=1MiB\nMEM_AVAILABLE_MIN=1MiB\nMEM_RESERVE=0\nMEM_WAIT=2s\n"
                    "START_CHECKS=port.free\nSHUTDOWN_GRACE=2s\nSTOP_GRACE=10s\n"
                    // One failed check restarts: a capped check counted as a failure would show.
                    "WATCH_GRACE=0s\nWATCH_FAILURES=1\nWATCH_BACKOFF=0s\n"
                    "NODE0_NAME=node0\nNODE0_SSH=local\nNODE0_FABRIC_IP=127.0.0.1\n",
                    fmt::arg("dir", dir.path()), fmt::arg("api", api_port),
                    fmt::arg("rdzv", test::free_port()), fmt::arg("sparkd", SPARKD_BIN),
                    fmt::arg("sparkctl", SPARKCTL_BIN)));
  }
  ~NativeRing() {
    if (!cfg.empty()) run({"stop", "--lock-wait", "5s"}, 60s);
  }
  test::CtlRun run(const std::vector<std::string>& args,
                   std::chrono::milliseconds timeout = 120s) const {
    ProcessSpec spec;
    spec.argv = {SPARKCTL_BIN, "--config", cfg};
    for (const auto& a : args) spec.argv.push_back(a);
    spec.timeout = timeout;
    return test::run_ctl(spec);
  }
  test::CtlRun json_run(std::vector<std::string> args) const {
    args.insert(args.begin(), "--json");
    return run(args);
  }
  int64_t pid() const {
    return parse_i64(trim(read_file(dir / "state/run/sparkd-0.pid").value_or(""))).value_or(-1);
  }
};

struct Fds {
  std::vector<int> v;
  ~Fds() { clear(); }
  void clear() {
    for (int fd : v) ::close(fd);
    v.clear();
  }
};

}  // namespace

TEST_CASE(
    "e2e ring cap: idle connections past the cap leave a CPU ring healthy; a cap full of "
    "requests is 'capped' to watch, unknown to status, and nothing restarts") {
  NativeRing ring;
  REQUIRE_MESSAGE(ring.error.empty(), ring.error);
  auto s = ring.run({"start"});
  REQUIRE_MESSAGE(s.rc == 0, s.all());
  const int64_t pid = ring.pid();
  REQUIRE(pid > 0);
  const size_t cap = 128;  // API_MAX_CONNECTIONS_PER_PEER's default

  // 1. 130 idle unauthenticated connections from 127.0.0.1 (no request sent on any).
  {
    Fds idle;
    for (size_t k = 0; k < cap + 2; ++k) {
      int fd = connect_from("127.0.0.1", ring.api_port);
      REQUIRE(fd >= 0);
      idle.v.push_back(fd);
    }
    // sparkd has taken them all in: two connections over the cap were dealt with (bounded
    // wait): each made the oldest idle one give its place, closed without a word.
    size_t done = 0;
    for (int i = 0; i < 500 && done < 2; ++i) {
      done = 0;
      for (int fd : idle.v) done += settled(fd) ? 1 : 0;
      if (done < 2) std::this_thread::sleep_for(20ms);
    }
    REQUIRE(done == 2);
    CHECK(closed_by_peer(idle.v[0]));
    CHECK(closed_by_peer(idle.v[1]));
    // The cap is full of idle connections from this address: the watch's /health still
    // gets in, and the ring is healthy.
    auto w = ring.json_run({"watch"});
    INFO(w.all());
    CHECK(w.rc == 0);
    CHECK(w.j.value("verdict", "") == "healthy");
    auto st = ring.json_run({"status"});
    INFO(st.all());
    CHECK(st.rc == 0);
    CHECK(st.j.value("state", "") == "ready");
    CHECK(ring.pid() == pid);
  }

  // 2. The cap full of requests being answered: 128 chats whose renders never end (two
  // rendering, the others queued for a lane), on connections held open.
  Fds busy;
  json one = {{"model", "demo"}, {"messages", json::array({{{"role", "user"}, {"content", "x"}}})}};
  const std::string body = one.dump();
  const std::string http =
      "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
      "Content-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  for (size_t k = 0; k < cap; ++k) {
    int fd = connect_from("127.0.0.1", ring.api_port);
    REQUIRE(fd >= 0);
    busy.v.push_back(fd);
    REQUIRE(::send(fd, http.data(), http.size(), MSG_NOSIGNAL) ==
            static_cast<ssize_t>(http.size()));
  }
  // All of them in flight, seen from another address (its own per-address count).
  int inflight = 0;
  for (int i = 0; i < 500 && inflight < static_cast<int>(cap); ++i) {
    auto [line, h] = health_from("127.0.0.2", ring.api_port);
    inflight = h.is_object() ? h.value("requests_in_flight", 0) : 0;
    if (inflight < static_cast<int>(cap)) std::this_thread::sleep_for(20ms);
  }
  REQUIRE(inflight == static_cast<int>(cap));
  // A /health from 127.0.0.1 now meets the cap: 503, and not a health body.
  auto [line, capped] = health_from("127.0.0.1", ring.api_port);
  INFO(line << " " << capped.dump());
  CHECK(line.find(" 503 ") != std::string::npos);
  CHECK_FALSE(capped.contains("live"));
  {
    // status first: it reads the cap's answer before anything could restart the ring.
    auto st = ring.json_run({"status"});
    INFO(st.all());
    CHECK(st.rc != exit_code(Errc::internal));
    CHECK(st.rc == exit_code(Errc::precondition));  // not known to be ready
    CHECK(st.j.value("state", "") == "unknown");
    auto text = ring.run({"status"});
    INFO(text.all());
    CHECK(text.rc == exit_code(Errc::precondition));
    CHECK(text.err.find("internal") == std::string::npos);
    auto w = ring.json_run({"watch"});
    INFO(w.all());
    CHECK(w.rc == 0);
    CHECK(w.j.value("verdict", "") == "capped");
    CHECK(w.j.value("failures", -1) == 0);
    CHECK(w.j.value("reason", "").find("connection cap") != std::string::npos);
    CHECK(ring.pid() == pid);  // not restarted
  }

  // 3. The clients go: their renders stop, the ring is healthy, never restarted.
  busy.clear();
  for (int i = 0; i < 500 && inflight != 0; ++i) {
    auto [l, h] = health_from("127.0.0.2", ring.api_port);
    inflight = h.is_object() ? h.value("requests_in_flight", -1) : -1;
    if (inflight != 0) std::this_thread::sleep_for(20ms);
  }
  CHECK(inflight == 0);
  auto w = ring.json_run({"watch"});
  INFO(w.all());
  CHECK(w.j.value("verdict", "") == "healthy");
  CHECK(ring.pid() == pid);
}
