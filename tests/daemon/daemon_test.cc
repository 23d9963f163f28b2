// The Daemon in-process on a free port with a fault-injection engine double, checked through
// its real HTTP API.
#include "daemon/daemon.h"

#include <doctest/doctest.h>
#include <sys/stat.h>

#include <atomic>
#include <boost/asio.hpp>
#include <sstream>
#include <thread>

#include "core/http_client.h"
#include "spark/version.h"
#include "support/tempdir.h"

using namespace spark;
using namespace spark::daemon;
using namespace std::chrono_literals;

namespace {

// Test double for fault injection: the test decides when it is ready, fatal or stuck.
class FaultInjectionBackend final : public Backend {
 public:
  std::atomic<bool> ready{false}, fatal{false};
  std::atomic<int> stuck_ms{0};
  std::atomic<bool> stopped{false};
  const char* name() const override { return "fault-injection"; }
  Status start(BackendContext& ctx) override {
    ctx.progress("loading weights 10%");
    return Status::Ok();
  }
  BackendStatus status() override {
    BackendStatus s;
    s.ready = ready;
    s.fatal = fatal;
    s.reason = fatal ? "engine process exited with status 1" : ready ? "" : "loading weights 10%";
    s.slots_total = 4;
    s.slots_busy = ready ? 1 : 0;
    s.oldest_call = std::chrono::milliseconds(stuck_ms.load());
    s.oldest_call_what = "decode step";
    return s;
  }
  void stop(std::chrono::milliseconds) override { stopped = true; }
};

RingConfig local_ring(const std::string& extra = "") {
  Environment env;
  std::vector<Diagnostic> d;
  auto cfg = load_config_text("MODEL=demo\nNODE0_SSH=local\n" + extra, "t.env", env, &d);
  REQUIRE(cfg.ok());
  return *cfg;
}

DaemonOptions opts_port0() {
  DaemonOptions o;
  o.port = 0;
  o.rank = 0;
  return o;
}

nlohmann::json health(uint16_t port, int* status, const std::string& q = "") {
  HttpCall c;
  c.port = port;
  c.target = "/health" + q;
  auto r = http_call(c);
  REQUIRE(r.ok());
  *status = r->status;
  return nlohmann::json::parse(r->body);
}

template <typename Pred>
bool eventually(Pred p, std::chrono::milliseconds limit = 3000ms) {
  auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (p()) return true;
    std::this_thread::sleep_for(20ms);
  }
  return p();
}

}  // namespace

TEST_CASE("daemon: /health is live before ready, strict says 503 until the engine is ready") {
  auto eng = std::make_unique<FaultInjectionBackend>();
  auto* e = eng.get();
  Daemon d(local_ring(), opts_port0(), std::move(eng));
  REQUIRE(d.start().ok());
  uint16_t port = d.http_port();
  REQUIRE(port != 0);
  int st = 0;
  REQUIRE(eventually([&] { return health(port, &st)["reason"] == "loading weights 10%"; }));
  auto j = health(port, &st);
  CHECK(st == 200);
  CHECK(j["live"] == true);
  CHECK(j["ready"] == false);
  CHECK(j["ok"] == false);
  CHECK(j["state"] == "loading");
  CHECK(j["fatal"] == false);
  CHECK(j["stalled"] == false);
  CHECK(j["slots"]["total"] == 4);
  CHECK(j["world_size"] == 1);
  CHECK(j["ranks_alive"] == 1);
  CHECK(j["engine"] == "fault-injection");
  CHECK(j["model"] == "demo");
  CHECK(j["uptime_s"].get<double>() >= 0);
  health(port, &st, "?strict");
  CHECK(st == 503);
  HttpCall models;
  models.port = port;
  models.target = "/v1/models";
  CHECK(http_call(models)->status == 503);

  e->ready = true;
  REQUIRE(eventually([&] { return health(port, &st)["ready"] == true; }));
  j = health(port, &st, "?strict");
  CHECK(st == 200);
  CHECK(j["ok"] == true);
  CHECK_FALSE(j.contains("reason"));
  CHECK(j["slots"]["busy"] == 1);
  auto m = http_call(models);
  CHECK(m->status == 200);
  CHECK(nlohmann::json::parse(m->body)["data"][0]["id"] == "demo");

  d.request_stop("test", 0);
  CHECK(d.wait() == 0);
  CHECK(e->stopped);
}

TEST_CASE("daemon: an engine call older than STALL_TIMEOUT reports stalled; a dead engine fatal") {
  auto eng = std::make_unique<FaultInjectionBackend>();
  auto* e = eng.get();
  Daemon d(local_ring(), opts_port0(), std::move(eng));
  DaemonTiming t;
  t.stall_timeout = 500ms;
  t.watchdog_period = 20ms;
  d.set_timing(t);
  REQUIRE(d.start().ok());
  int st = 0;
  e->ready = true;
  REQUIRE(eventually([&] { return health(d.http_port(), &st)["ready"] == true; }));
  e->stuck_ms = 800;
  REQUIRE(eventually([&] { return health(d.http_port(), &st)["stalled"] == true; }));
  auto j = health(d.http_port(), &st, "?strict");
  CHECK(st == 503);
  CHECK(j["state"] == "stalled");
  CHECK(j["reason"].get<std::string>().find("decode step") != std::string::npos);
  e->stuck_ms = 0;  // a call that finishes clears stalled
  REQUIRE(eventually([&] { return health(d.http_port(), &st)["ready"] == true; }));
  e->fatal = true;
  REQUIRE(eventually([&] { return health(d.http_port(), &st)["fatal"] == true; }));
  e->fatal = false;  // fatal is sticky: the ring must be restarted
  std::this_thread::sleep_for(100ms);
  j = health(d.http_port(), &st);
  CHECK(j["fatal"] == true);
  CHECK(j["reason"] == "engine process exited with status 1");
}

TEST_CASE("daemon: the native backend without a model directory is fatal and names MODEL_PATH") {
  Daemon d(local_ring(), opts_port0());
  REQUIRE(d.start().ok());
  int st = 0;
  REQUIRE(eventually([&] { return health(d.http_port(), &st)["state"] != "loading"; }));
  auto j = health(d.http_port(), &st);
  CHECK(j["ready"] == false);
  CHECK(j["engine"] == "native");
  CHECK(j["reason"].get<std::string>().find("MODEL_PATH") != std::string::npos);
}

TEST_CASE("daemon: binding beyond loopback needs an API key file of mode 0600") {
  test::TempDir dir("sparkd-key");
  DaemonOptions o = opts_port0();
  o.bind = "0.0.0.0";
  {
    Daemon d(local_ring(), o);
    Status s = d.start();
    REQUIRE_FALSE(s.ok());
    CHECK(s.code() == Errc::config);
    CHECK(s.message().find("API_KEY_FILE") != std::string::npos);
  }
  std::string key = dir.write("key", "topsecret\n");
  ::chmod(key.c_str(), 0644);
  {
    Daemon d(local_ring("API_KEY_FILE=" + key + "\n"), o);
    Status s = d.start();
    REQUIRE_FALSE(s.ok());
    CHECK(s.code() == Errc::auth);
    CHECK(s.message().find("chmod 600") != std::string::npos);
  }
  {
    // Two lines: no client could ever send that key; refused rather than locking all out.
    std::string two = dir.write("key2", "topsecret\nmore\n");
    ::chmod(two.c_str(), 0600);
    Daemon d(local_ring("API_KEY_FILE=" + two + "\n"), o);
    Status s = d.start();
    REQUIRE_FALSE(s.ok());
    CHECK(s.message().find("more than one line") != std::string::npos);
  }
  ::chmod(key.c_str(), 0600);
  Daemon d(local_ring("API_KEY_FILE=" + key + "\n"), o);
  REQUIRE(d.start().ok());
  HttpCall c;
  c.port = d.http_port();
  c.target = "/v1/models";
  CHECK(http_call(c)->status == 401);
  c.headers = {{"Authorization", "Bearer topsecret"}};
  CHECK(http_call(c)->status == 503);  // authorized; not ready (native engine absent)
  c.target = "/health";
  c.headers.clear();
  CHECK(http_call(c)->status == 200);
  c.target = "/metrics";  // METRICS_AUTH=api_key, the default: like every other path
  CHECK(http_call(c)->status == 401);
  c.headers = {{"Authorization", "Bearer topsecret"}};
  CHECK(http_call(c)->status == 200);
}

TEST_CASE("daemon: METRICS_AUTH=none leaves /metrics open, as vLLM does, and nothing else") {
  test::TempDir dir("daemon-metrics-auth");
  std::string key = dir.write("key", "topsecret\n");
  ::chmod(key.c_str(), 0600);
  Daemon d(local_ring("API_KEY_FILE=" + key + "\nMETRICS_AUTH=none\n"), opts_port0());
  REQUIRE(d.start().ok());
  HttpCall c;
  c.port = d.http_port();
  c.target = "/metrics";
  auto r = http_call(c);
  REQUIRE(r.ok());
  CHECK(r->status == 200);
  CHECK(r->body.find("sparkd_up 1") != std::string::npos);
  c.target = "/v1/models";
  CHECK(http_call(c)->status == 401);
}

TEST_CASE("daemon: a rank outside the ring is a usage error naming the ring size") {
  DaemonOptions o = opts_port0();
  o.rank = 3;
  Daemon d(local_ring(), o);
  Status s = d.start();
  REQUIRE_FALSE(s.ok());
  CHECK(s.code() == Errc::usage);
  CHECK(s.message().find("1 rank") != std::string::npos);
}

TEST_CASE("daemon: command line") {
  std::ostringstream out, err;
  const char* a1[] = {"sparkd", "--config", "x.env",    "--rank",  "2", "--port",
                      "0",      "--bind",   "10.0.0.1", "--grace", "3s"};
  auto r = parse_daemon_args(11, a1, out, err);
  REQUIRE(std::holds_alternative<DaemonOptions>(r));
  auto o = std::get<DaemonOptions>(r);
  CHECK(o.config_path == "x.env");
  CHECK(o.rank == 2);
  CHECK(o.port == uint16_t{0});
  CHECK(o.bind == std::string("10.0.0.1"));
  CHECK(o.shutdown_grace == std::chrono::milliseconds(3000));
  const char* a2[] = {"sparkd", "--port", "70000"};
  CHECK(std::get<int>(parse_daemon_args(3, a2, out, err)) == exit_code(Errc::usage));
  const char* a3[] = {"sparkd", "--bogus"};
  CHECK(std::get<int>(parse_daemon_args(2, a3, out, err)) == exit_code(Errc::usage));
  const char* a4[] = {"sparkd", "--help"};
  CHECK(std::get<int>(parse_daemon_args(2, a4, out, err)) == 0);
  CHECK(out.str().find("--config") != std::string::npos);
}

namespace {
RingConfig two_rank_ring(const std::string& extra = "") {
  return local_ring("NODE0_GPUS=0,1\n" + extra);
}
struct Rank {
  FaultInjectionBackend* engine = nullptr;
  std::unique_ptr<Daemon> d;
};
Rank start_rank(const RingConfig& cfg, int rank, uint16_t rdzv_port, bool start = true) {
  auto eng = std::make_unique<FaultInjectionBackend>();
  Rank r;
  r.engine = eng.get();
  DaemonOptions o = opts_port0();
  o.rank = rank;
  o.rdzv_port = rdzv_port;
  r.d = std::make_unique<Daemon>(cfg, o, std::move(eng));
  DaemonTiming t;
  t.heartbeat_interval = 100ms;
  t.heartbeat_timeout = 800ms;
  t.join_timeout = 3000ms;
  t.watchdog_period = 20ms;
  r.d->set_timing(t);
  if (start) REQUIRE(r.d->start().ok());
  return r;
}
uint16_t any_free_port() {
  boost::asio::io_context io;
  boost::asio::ip::tcp::acceptor a(io, {boost::asio::ip::make_address("127.0.0.1"), 0});
  return a.local_endpoint().port();
}
}  // namespace

TEST_CASE("daemon ring: rank 0 is ready only when every rank joined and is ready") {
  uint16_t rp = any_free_port();
  auto cfg = two_rank_ring();
  Rank r0 = start_rank(cfg, 0, rp);
  CHECK(r0.d->rdzv_port() == rp);
  int st = 0;
  REQUIRE(eventually([&] {
    return health(r0.d->http_port(), &st)["reason"].get<std::string>().find("join") !=
           std::string::npos;
  }));
  Rank r1 = start_rank(cfg, 1, rp);
  CHECK(r1.d->http_port() == 0);  // followers serve no HTTP
  r0.engine->ready = true;
  REQUIRE(eventually([&] {
    return health(r0.d->http_port(), &st)["reason"].get<std::string>().find("rank 1") !=
           std::string::npos;
  }));
  CHECK(health(r0.d->http_port(), &st)["ready"] == false);  // rank 1 still loading
  r1.engine->ready = true;
  REQUIRE(eventually([&] { return health(r0.d->http_port(), &st, "?strict")["ready"] == true; }));
  CHECK(st == 200);
  auto j = health(r0.d->http_port(), &st);
  CHECK(j["ranks_alive"] == 2);
  CHECK(j["ranks"][1]["state"] == "ready");
  CHECK(j["ranks"][1]["joined"] == true);

  // A follower that goes away makes rank 0 fatal, because its heartbeat connection closed
  // (the cause is checked, not the time: a loaded machine may be slow to notice).
  r1.d->request_stop("test kills rank 1", 0);
  r1.d->wait();
  REQUIRE(eventually([&] { return health(r0.d->http_port(), &st)["fatal"] == true; }, 5000ms));
  j = health(r0.d->http_port(), &st, "?strict");
  CHECK(st == 503);
  CHECK(j["reason"].get<std::string>().find("rank 1 (node node0) lost") != std::string::npos);
  CHECK(j["reason"].get<std::string>().find("heartbeat connection closed") != std::string::npos);
  CHECK(j["ranks_alive"] == 1);
}

TEST_CASE("daemon ring: rank 0 exports every rank's MemAvailable, from the follower's heartbeat") {
  // Each rank reads its own node's /proc/meminfo (here: a fixture per rank).
  test::TempDir dir("daemon-rank-mem");
  auto meminfo = [&](const std::string& root, uint64_t avail_kb) {
    dir.write(root + "/proc/meminfo",
              "MemTotal:       134217728 kB\nMemFree:        1000 kB\n"
              "MemAvailable:   " +
                  std::to_string(avail_kb) + " kB\n");
    return dir / root;
  };
  uint16_t rp = any_free_port();
  auto cfg = two_rank_ring();
  auto start = [&](int rank, const std::string& root) {
    auto eng = std::make_unique<FaultInjectionBackend>();
    Rank r;
    r.engine = eng.get();
    DaemonOptions o = opts_port0();
    o.rank = rank;
    o.rdzv_port = rp;
    o.proc_root = root;
    r.d = std::make_unique<Daemon>(cfg, o, std::move(eng));
    DaemonTiming t;
    t.heartbeat_interval = 100ms;
    t.heartbeat_timeout = 800ms;
    t.join_timeout = 3000ms;
    t.watchdog_period = 20ms;
    r.d->set_timing(t);
    REQUIRE(r.d->start().ok());
    return r;
  };
  Rank r0 = start(0, meminfo("r0", 64ull << 20));  // 64 GiB
  Rank r1 = start(1, meminfo("r1", 3ull << 20));   // 3 GiB: the node an alert must name
  HttpCall c;
  c.port = r0.d->http_port();
  c.target = "/metrics";
  std::string m;
  REQUIRE(eventually([&] {
    auto r = http_call(c);
    m = r.ok() ? r->body : "";
    return m.find("sparkd_rank_mem_available_bytes{rank=\"1\",node=\"node0\"} 3221225472\n") !=
           std::string::npos;
  }));
  INFO(m);
  CHECK(m.find("sparkd_rank_mem_available_bytes{rank=\"0\",node=\"node0\"} 68719476736\n") !=
        std::string::npos);
  CHECK(m.find("sparkd_rank_alive{rank=\"1\",node=\"node0\"} 1\n") != std::string::npos);
  CHECK(m.find("sparkd_rank_heartbeat_age_seconds{rank=\"1\",node=\"node0\"} ") !=
        std::string::npos);
  int st = 0;
  CHECK(health(r0.d->http_port(), &st)["ranks"][1]["mem_available_bytes"] == 3221225472ull);
}

TEST_CASE("daemon ring: a follower stalled is reported stalled by rank 0") {
  uint16_t rp = any_free_port();
  auto cfg = two_rank_ring();
  Rank r0 = start_rank(cfg, 0, rp);
  Rank r1 = start_rank(cfg, 1, rp);
  DaemonTiming t;
  r0.engine->ready = true;
  r1.engine->ready = true;
  int st = 0;
  REQUIRE(eventually([&] { return health(r0.d->http_port(), &st)["ready"] == true; }));
  r1.engine->stuck_ms = 120000;  // older than the default STALL_TIMEOUT (60 s)
  REQUIRE(eventually([&] { return health(r0.d->http_port(), &st)["stalled"] == true; }));
  auto j = health(r0.d->http_port(), &st);
  CHECK(j["reason"].get<std::string>().find("rank 1 (node node0) is stalled") != std::string::npos);
}

TEST_CASE("daemon ring: a follower with a different config digest is refused and exits") {
  uint16_t rp = any_free_port();
  Rank r0 = start_rank(two_rank_ring(), 0, rp);
  Rank r1 = start_rank(two_rank_ring("SLOTS=5\n"), 1, rp);
  int rc = r1.d->wait();  // the follower gives up by itself
  CHECK(rc == exit_code(Errc::integrity));
  int st = 0;
  REQUIRE(eventually([&] { return health(r0.d->http_port(), &st)["fatal"] == true; }));
  auto j = health(r0.d->http_port(), &st);
  CHECK(j["reason"].get<std::string>().find("rank 1") != std::string::npos);
  CHECK(j["reason"].get<std::string>().find("config_digest") != std::string::npos);
}

TEST_CASE("daemon ring: a follower without rank 0 gives up naming the address") {
  uint16_t rp = any_free_port();
  Rank r1 = start_rank(two_rank_ring(), 1, rp);
  int rc = r1.d->wait();
  CHECK(rc == exit_code(Errc::timeout));
}

TEST_CASE("daemon: /version, /ping and /v1/models/{id} as vLLM serves them") {
  test::TempDir dir("daemon-vllm-paths");
  std::string key = dir.write("key", "topsecret\n");
  ::chmod(key.c_str(), 0600);
  auto eng = std::make_unique<FaultInjectionBackend>();
  auto* e = eng.get();
  Daemon d(local_ring("API_KEY_FILE=" + key + "\n"), opts_port0(), std::move(eng));
  REQUIRE(d.start().ok());
  HttpCall c;
  c.port = d.http_port();
  // /version and /ping answer without the key, before readiness too.
  c.target = "/version";
  auto v = http_call(c);
  REQUIRE(v.ok());
  CHECK(v->status == 200);
  CHECK(nlohmann::json::parse(v->body)["version"] == kVersion);
  c.target = "/ping";
  for (const char* method : {"GET", "POST"}) {
    c.method = method;
    CHECK(http_call(c)->status == 503);  // loading
  }
  e->ready = true;
  int st = 0;
  REQUIRE(eventually([&] { return health(d.http_port(), &st)["ready"] == true; }));
  for (const char* method : {"GET", "POST"}) {
    c.method = method;
    auto p = http_call(c);
    CHECK(p->status == 200);
    CHECK(p->body.empty());
  }
  // A model by id: the served one, or 404 naming it; behind the key like /v1/models.
  c.method = "GET";
  c.target = "/v1/models/demo";
  CHECK(http_call(c)->status == 401);
  c.headers = {{"Authorization", "Bearer topsecret"}};
  auto m = http_call(c);
  REQUIRE(m.ok());
  CHECK(m->status == 200);
  auto j = nlohmann::json::parse(m->body);
  CHECK(j["id"] == "demo");
  CHECK(j["object"] == "model");
  c.target = "/v1/models/org/other";
  auto n = http_call(c);
  CHECK(n->status == 404);
  CHECK(nlohmann::json::parse(n->body)["error"]["message"] ==
        "The model `org/other` does not exist.");
  d.request_stop("test", 0);
  CHECK(d.wait() == 0);
}
