// sparkctl start | stop | restart | status | watch | logs end to end: the real sparkctl and
// sparkd binaries, ENGINE=exec running the fault-injection server (spark_fault_server, a test
// fixture) as every rank's engine. Most rings are local (NODE<i>_SSH=local, fabric addresses
// 127.0.0.x); one runs its follower in a network namespace reached over a real sshd, to prove
// the SSH launch path detaches sparkd from the session.
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "core/process.h"
#include "core/strings.h"
#include "daemon/http_client.h"
#include "support/ring.h"
#include "support/spawn.h"
#include "support/tempdir.h"

using namespace spark;
using namespace std::chrono_literals;
using nlohmann::json;

namespace {

// The fault server of rank R listens on 4<R><suffix>; the suffix differs per ring.
int next_suffix() {
  static int n = 0;
  return 100 + (static_cast<int>(::getpid()) * 7 + 37 * n++) % 890;
}

// True when pid runs and is not a zombie.
bool alive(int pid) {
  if (pid <= 0) return false;
  auto st = read_file(fmt::format("/proc/{}/stat", pid));
  if (!st) return false;
  auto p = st->rfind(')');
  return p != std::string::npos && p + 2 < st->size() && (*st)[p + 2] != 'Z';
}

struct Out {
  int rc = -1;
  std::string out, err;
  json j;
  std::string all() const { return fmt::format("rc {}\nstdout:\n{}\nstderr:\n{}", rc, out, err); }
};

struct LocalRing {
  test::TempDir dir{"spark-ringcli"};
  int nodes;
  int suffix = next_suffix();
  int api_port = test::free_port();
  int rdzv_port = test::free_port();
  std::string cfg;
  std::map<std::string, std::string> env;  // overrides for sparkctl (the environment wins)

  explicit LocalRing(int n = 2, const std::string& extra = "") : nodes(n) {
    std::string text = fmt::format(
        "RING_NAME=e2e\nMODEL=demo\nENGINE=exec\n"
        "ENGINE_EXEC='m=healthy; a=0s; if [ -f {dir}/once-$SPARK_RANK ]; then "
        "read m a < {dir}/once-$SPARK_RANK; rm -f {dir}/once-$SPARK_RANK; fi; "
        "exec {fault} --port 4${{SPARK_RANK}}{suf} --mode $m --after $a --watch-pid $SPARKD_PID'\n"
        "ENGINE_HEALTH_URL='http://127.0.0.1:4{{rank}}{suf}/health'\n"
        "ENGINE_API_URL='http://127.0.0.1:4{{rank}}{suf}'\nPROBE_EXPECT=Paris\n"
        "API_PORT={api}\nRDZV_PORT={rdzv}\nSTATE_DIR={dir}/state\n"
        "SPARKD_BIN={sparkd}\nSPARKCTL_BIN={sparkctl}\n"
        "HEARTBEAT_INTERVAL=200ms\nHEARTBEAT_TIMEOUT=1s\nSTALL_TIMEOUT=2s\nJOIN_TIMEOUT=10s\n"
        "SHUTDOWN_GRACE=2s\nSTOP_GRACE=6s\nREADY_TIMEOUT=20s\nMEM_FREE_MIN=1MiB\nMEM_WAIT=2s\n"
        "WATCH_GRACE=0s\nWATCH_FAILURES=3\nWATCH_BACKOFF=0s\nSTART_CHECKS=port.free\n"
        "WATCH_ALERT_CMD='echo \"$SPARK_EVENT $SPARK_REASON\" >> {dir}/alerts'\n",
        fmt::arg("dir", dir.path()), fmt::arg("fault", FAULT_SERVER_BIN), fmt::arg("suf", suffix),
        fmt::arg("api", api_port), fmt::arg("rdzv", rdzv_port), fmt::arg("sparkd", SPARKD_BIN),
        fmt::arg("sparkctl", SPARKCTL_BIN));
    for (int i = 0; i < n; ++i)
      text +=
          fmt::format("NODE{i}_NAME=node{i}\nNODE{i}_SSH=local\nNODE{i}_FABRIC_IP=127.0.0.{ip}\n",
                      fmt::arg("i", i), fmt::arg("ip", i + 1));
    text += extra;
    cfg = dir.write("ring.env", text);
  }
  ~LocalRing() {
    // Whatever a failed test left: stop it the way an operator would.
    run({"stop", "--lock-wait", "5s"}, 60s);
  }

  Out run(const std::vector<std::string>& args, std::chrono::milliseconds timeout = 90s) const {
    ProcessSpec spec;
    spec.argv = {SPARKCTL_BIN, "--config", cfg};
    for (const auto& a : args) spec.argv.push_back(a);
    spec.env = env;
    spec.timeout = timeout;
    Out o;
    auto r = run_process(spec);
    if (!r) {
      o.err = r.error().message;
      return o;
    }
    o.rc = r->timed_out ? -2 : r->exit_status;
    o.out = r->out;
    o.err = r->err;
    o.j = json::parse(o.out, nullptr, false);
    return o;
  }
  Out json_run(std::vector<std::string> args, std::chrono::milliseconds timeout = 90s) const {
    args.insert(args.begin(), "--json");
    return run(args, timeout);
  }

  void fault_once(int rank, const std::string& mode, const std::string& after) const {
    dir.write(fmt::format("once-{}", rank), mode + " " + after + "\n");
  }
  std::string state(const std::string& f) const { return dir / ("state/" + f); }
  std::string alerts() const { return read_file(dir / "alerts").value_or(""); }
  json watch_record() const {
    return json::parse(read_file(state("watch.json")).value_or("{}"), nullptr, false);
  }

  std::optional<json> health() const {
    daemon::HttpCall c;
    c.port = static_cast<uint16_t>(api_port);
    c.target = "/health";
    c.timeout = 1000ms;
    auto r = daemon::http_call(c);
    if (!r) return std::nullopt;
    return json::parse(r->body, nullptr, false);
  }
  template <typename Pred>
  bool wait_health(Pred p, std::chrono::milliseconds limit) const {
    auto end = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < end) {
      auto h = health();
      if (h && h->is_object() && p(*h)) return true;
      std::this_thread::sleep_for(100ms);
    }
    return false;
  }
  std::vector<int> pids(const json& start) const {
    std::vector<int> v;
    for (const auto& r : start["ranks"]) v.push_back(r.value("pid", 0));
    return v;
  }
  std::string logs() const {
    std::string s;
    for (int r = 0; r < nodes; ++r)
      s += fmt::format("--- rank {} log\n{}{}", r,
                       read_file(dir / fmt::format("state/logs/sparkd-{}.log", r)).value_or(""),
                       read_file(dir / fmt::format("state/logs/sparkd-{}.out", r)).value_or(""));
    return s;
  }
};

// Nothing of the ring runs: the launched sparkd pids are gone, no pidfile is left, and no
// fault server answers on the engine ports.
void check_nothing_left(const LocalRing& ring, const std::vector<int>& pids) {
  for (int p : pids) CHECK_MESSAGE(!alive(p), "sparkd pid ", p, " still runs");
  for (int r = 0; r < ring.nodes; ++r) {
    CHECK_FALSE(std::filesystem::exists(ring.state(fmt::format("run/sparkd-{}.pid", r))));
    daemon::HttpCall c;
    c.port = static_cast<uint16_t>(std::stoi(fmt::format("4{}{}", r, ring.suffix)));
    c.target = "/health";
    c.timeout = 500ms;
    CHECK_MESSAGE(!daemon::http_call(c).ok(), "rank ", r, "'s engine still answers");
  }
}

}  // namespace

TEST_CASE(
    "e2e sparkctl: start -> READY, status, logs; stop leaves nothing and watch does nothing") {
  LocalRing ring(2);
  auto s = ring.json_run({"start"});
  REQUIRE_MESSAGE(s.rc == 0, s.all(), ring.logs());
  CHECK(s.j["ready"] == true);
  CHECK(s.j["endpoint"] == fmt::format("http://127.0.0.1:{}", ring.api_port));
  auto pids = ring.pids(s.j);
  REQUIRE(pids.size() == 2);
  for (int p : pids) CHECK(alive(p));
  auto h = ring.health();
  REQUIRE(h);
  CHECK((*h)["ready"] == true);
  CHECK((*h)["ranks_alive"] == 2);
  // READY came after a real completion from rank 0's engine (the daemon's probe).
  CHECK((*h)["probe"]["status"] == "passed");
  // The preflight step ran (fail-closed) and the memory gate passed.
  bool preflight = false, memory = false;
  for (const auto& st : s.j["steps"]) {
    if (st["step"] == "preflight")
      preflight =
          st["ok"] == true && st["detail"].get<std::string>().find("SKIPPED") == std::string::npos;
    if (st["step"] == "memory") memory = st["ok"] == true;
  }
  CHECK(preflight);
  CHECK(memory);

  auto st = ring.json_run({"status"});
  CHECK_MESSAGE(st.rc == 0, st.all());
  CHECK(st.j["ready"] == true);
  REQUIRE(st.j["ranks"].size() == 2);
  CHECK(st.j["ranks"][1]["state"] == "ready");
  CHECK(st.j["ranks"][1]["pid"] == pids[1]);
  CHECK(st.j["ranks"][1]["alive"] == true);
  CHECK(st.j["nodes"][0]["mem_free"].get<int64_t>() > 0);
  CHECK(st.j["disabled"].is_null());
  auto table = ring.run({"status"});
  CHECK(table.rc == 0);
  CHECK(table.out.find("READY: yes") != std::string::npos);

  auto lg = ring.run({"logs", "--rank", "1", "-n", "200"});
  CHECK_MESSAGE(lg.rc == 0, lg.all());
  CHECK(lg.out.find("joined the ring") != std::string::npos);
  auto follow = ring.run({"logs", "--rank", "0", "-f", "--for", "1s", "-n", "5"});
  CHECK_MESSAGE(follow.rc == 0, follow.all());
  CHECK_FALSE(follow.out.empty());

  // What the head runs on node 0 when node 0 is another machine.
  auto hg = ring.run({"health-get", "--port", std::to_string(ring.api_port)});
  CHECK_MESSAGE(hg.rc == 0, hg.all());
  CHECK(hg.j["status"] == 200);
  CHECK(json::parse(hg.j.value("body", "{}"), nullptr, false)["ready"] == true);

  // A second start on a running ring is refused, naming what runs.
  auto again = ring.run({"start"});
  CHECK(again.rc == exit_code(Errc::busy));
  CHECK(again.err.find("already runs") != std::string::npos);

  auto stop = ring.json_run({"stop"});
  REQUIRE_MESSAGE(stop.rc == 0, stop.all());
  CHECK(stop.j["clean"] == true);
  CHECK(stop.j["ranks"][0]["how"] == "sigterm");
  check_nothing_left(ring, pids);
  CHECK(std::filesystem::exists(ring.state("DISABLED")));

  auto w = ring.json_run({"watch"});
  CHECK_MESSAGE(w.rc == 0, w.all());
  CHECK(w.j["verdict"] == "disabled");
  auto down = ring.json_run({"status"});
  CHECK(down.rc == exit_code(Errc::precondition));
  CHECK(down.j["ready"] == false);
  CHECK(down.j["ranks"][0]["state"] == "down");
  CHECK_FALSE(down.j["disabled"].is_null());

  // restart leaves no marker and brings the ring back.
  auto rs = ring.json_run({"restart"});
  REQUIRE_MESSAGE(rs.rc == 0, rs.all(), ring.logs());
  CHECK_FALSE(std::filesystem::exists(ring.state("DISABLED")));
  CHECK(ring.json_run({"status"}).rc == 0);
}

TEST_CASE(
    "e2e sparkctl: kill -9 of a follower -> fatal within seconds -> watch restarts on the third "
    "failed check") {
  LocalRing ring(2);
  auto s = ring.json_run({"start"});
  REQUIRE_MESSAGE(s.rc == 0, s.all(), ring.logs());
  auto pids = ring.pids(s.j);
  REQUIRE(::kill(pids[1], SIGKILL) == 0);
  auto t0 = std::chrono::steady_clock::now();
  REQUIRE(ring.wait_health([](const json& h) { return h["fatal"] == true; }, 5s));
  CHECK(std::chrono::steady_clock::now() - t0 < 4s);

  auto w1 = ring.json_run({"watch"});
  CHECK_MESSAGE(w1.j["verdict"] == "unhealthy", w1.all());
  CHECK(w1.j["failures"] == 1);
  CHECK(w1.j["reason"].get<std::string>().find("rank 1") != std::string::npos);
  auto w2 = ring.json_run({"watch"});
  CHECK(w2.j["verdict"] == "unhealthy");
  CHECK(w2.j["failures"] == 2);
  CHECK(alive(pids[0]));  // not restarted yet
  auto w3 = ring.json_run({"watch"});
  REQUIRE_MESSAGE(w3.j["verdict"] == "restarted", w3.all(), ring.logs());
  CHECK(w3.rc == 0);
  CHECK_FALSE(alive(pids[0]));
  // The tail of every rank's log was saved before the restart.
  std::string inc = w3.j["incident_dir"];
  CHECK(std::filesystem::exists(inc + "/rank0.log"));
  CHECK(std::filesystem::exists(inc + "/rank1.log"));
  CHECK(read_file(inc + "/rank0.log").value_or("").find("rank 1") != std::string::npos);
  CHECK(ring.alerts().find("healed") != std::string::npos);
  auto st = ring.json_run({"status"});
  CHECK(st.rc == 0);
  CHECK(st.j["ranks"][1]["pid"] != pids[1]);
  CHECK(st.j["restarts_in_window"] == 1);
  CHECK(st.j["watch"]["last_verdict"] == "restarted");
  auto w4 = ring.json_run({"watch"});
  CHECK(w4.j["verdict"] == "healthy");
  CHECK(w4.j["failures"] == 0);
}

TEST_CASE("e2e sparkctl: a hung follower engine -> stalled -> watch restarts the ring") {
  LocalRing ring(2);
  ring.env["WATCH_FAILURES"] = "1";
  ring.fault_once(1, "hang", "3s");
  auto s = ring.json_run({"start"});
  REQUIRE_MESSAGE(s.rc == 0, s.all(), ring.logs());
  REQUIRE_MESSAGE(ring.wait_health([](const json& h) { return h["stalled"] == true; }, 15s),
                  ring.logs());
  auto st = ring.json_run({"status"});
  CHECK(st.rc != 0);
  CHECK(st.j["state"] == "stalled");
  auto w = ring.json_run({"watch"});
  REQUIRE_MESSAGE(w.j["verdict"] == "restarted", w.all(), ring.logs());
  CHECK(w.j["reason"].get<std::string>().find("stalled") != std::string::npos);
  CHECK(ring.health().value_or(json())["ready"] == true);
}

TEST_CASE(
    "e2e sparkctl: a rank with a different config digest is refused at start, naming it; nothing "
    "is left") {
  LocalRing ring(2);
  // A node whose environment overrides a key (FAULT INJECTION: a wrapper around sparkd that
  // changes SLOTS for rank 1 only).
  std::string wrapper = ring.dir.write(
      "sparkd-wrapper.sh",
      fmt::format("#!/bin/sh\ncase \" $* \" in *\" --rank 1 \"*) export SLOTS=99;; esac\n"
                  "exec {} \"$@\"\n",
                  SPARKD_BIN));
  ::chmod(wrapper.c_str(), 0755);
  ring.env["SPARKD_BIN"] = wrapper;
  ring.env["START_RETRIES"] = "1";  // the whole start is tried again, and fails again
  auto s = ring.json_run({"start"});
  CHECK_MESSAGE(s.rc == exit_code(Errc::remote), s.all());
  CHECK(s.j["attempts"] == 2);
  std::string msg = s.j["error"]["message"];
  CHECK_MESSAGE(msg.find("rank 1") != std::string::npos, msg);
  CHECK_MESSAGE(msg.find("config_digest") != std::string::npos, msg);
  bool teardown = false;
  for (const auto& st : s.j["steps"])
    if (st["step"] == "teardown") teardown = st["ok"] == true;
  CHECK(teardown);
  check_nothing_left(ring, ring.pids(s.j));
}

TEST_CASE(
    "e2e sparkctl: twenty concurrent watches on an unhealthy ring cause exactly one restart") {
  LocalRing ring(2);
  ring.env["WATCH_FAILURES"] = "1";
  auto s = ring.json_run({"start"});
  REQUIRE_MESSAGE(s.rc == 0, s.all(), ring.logs());
  auto pids = ring.pids(s.j);
  REQUIRE(::kill(pids[1], SIGKILL) == 0);
  REQUIRE(ring.wait_health([](const json& h) { return h["fatal"] == true; }, 5s));
  std::vector<std::unique_ptr<test::Child>> watches;
  for (int i = 0; i < 20; ++i)
    watches.push_back(std::make_unique<test::Child>(
        std::vector<std::string>{SPARKCTL_BIN, "--config", ring.cfg, "--json", "watch"}, ring.env,
        ring.dir / fmt::format("watch-{}.json", i)));
  int restarted = 0, busy = 0;
  for (int i = 0; i < 20; ++i) {
    auto st = watches[static_cast<size_t>(i)]->wait_for(90s);
    REQUIRE(st.has_value());
    auto j = json::parse(read_file(ring.dir / fmt::format("watch-{}.json", i)).value_or(""),
                         nullptr, false);
    REQUIRE(j.is_object());
    if (j["verdict"] == "restarted") ++restarted;
    if (j["verdict"] == "busy") ++busy;
  }
  CHECK(restarted == 1);
  CHECK(busy >= 1);
  CHECK(ring.watch_record()["restarts_ms"].size() == 1);
  CHECK(ring.json_run({"status"}).rc == 0);
}

TEST_CASE(
    "e2e sparkctl: the restart cap writes GAVE_UP, alerts, and stops restarting until a manual "
    "start") {
  LocalRing ring(2);
  ring.env["WATCH_FAILURES"] = "1";
  ring.env["WATCH_MAX_RESTARTS"] = "1";
  auto s = ring.json_run({"start"});
  REQUIRE_MESSAGE(s.rc == 0, s.all(), ring.logs());
  ::kill(ring.pids(s.j)[1], SIGKILL);
  REQUIRE(ring.wait_health([](const json& h) { return h["fatal"] == true; }, 5s));
  auto w1 = ring.json_run({"watch"});
  REQUIRE_MESSAGE(w1.j["verdict"] == "restarted", w1.all());
  auto st = ring.json_run({"status"});
  int rank0 = st.j["ranks"][0]["pid"];
  ::kill(st.j["ranks"][1]["pid"].get<int>(), SIGKILL);
  REQUIRE(ring.wait_health([](const json& h) { return h["fatal"] == true; }, 5s));
  // Under the cap but inside the backoff after the last restart: counted, not restarted.
  ring.env["WATCH_MAX_RESTARTS"] = "3";
  ring.env["WATCH_BACKOFF"] = "1h";
  auto wb = ring.json_run({"watch"});
  CHECK_MESSAGE(wb.j["verdict"] == "backoff", wb.all());
  CHECK(wb.j["reason"].get<std::string>().find("next restart allowed in") != std::string::npos);
  CHECK(alive(rank0));
  ring.env["WATCH_MAX_RESTARTS"] = "1";
  ring.env["WATCH_BACKOFF"] = "0s";
  auto w2 = ring.json_run({"watch"});
  CHECK_MESSAGE(w2.j["verdict"] == "gave_up", w2.all());
  CHECK(w2.rc == exit_code(Errc::precondition));
  CHECK(std::filesystem::exists(ring.state("GAVE_UP")));
  CHECK(ring.alerts().find("gave_up") != std::string::npos);
  auto w3 = ring.json_run({"watch"});
  CHECK(w3.j["verdict"] == "gave_up");
  CHECK(alive(rank0));  // no restart happened
  auto stt = ring.json_run({"status"});
  CHECK_FALSE(stt.j["gave_up"].is_null());
  // A manual restart clears GAVE_UP and the window.
  auto rs = ring.json_run({"restart"});
  REQUIRE_MESSAGE(rs.rc == 0, rs.all());
  CHECK_FALSE(std::filesystem::exists(ring.state("GAVE_UP")));
  CHECK(ring.watch_record()["restarts_ms"].empty());
}

TEST_CASE("e2e sparkctl: start --no-wait and the watch's start-up grace while loading") {
  LocalRing ring(2);
  ring.fault_once(0, "slow-start", "30s");  // rank 0's engine loads for 30 s
  auto s = ring.json_run({"start", "--no-wait"});
  REQUIRE_MESSAGE(s.rc == 0, s.all());
  CHECK(s.j["ready"] == false);
  ring.env["WATCH_GRACE"] = "10m";
  auto w = ring.json_run({"watch"});
  CHECK_MESSAGE(w.j["verdict"] == "grace", w.all());
  CHECK(w.j["failures"] == 0);
  ring.env["WATCH_GRACE"] = "0s";
  auto w2 = ring.json_run({"watch"});
  CHECK_MESSAGE(w2.j["verdict"] == "unhealthy", w2.all());
  CHECK(w2.j["failures"] == 1);
  auto st = ring.json_run({"status"});
  CHECK(st.rc == exit_code(Errc::precondition));
  CHECK(st.j["state"] == "loading");
}

TEST_CASE(
    "e2e sparkctl: start is fail-closed on preflight and on memory, and waits for the ring lock") {
  LocalRing ring(2);
  SUBCASE("a preflight failure (the API port is taken) refuses the start") {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(ring.api_port));
    REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    REQUIRE(::listen(fd, 4) == 0);
    auto s = ring.run({"start"});
    ::close(fd);
    CHECK(s.rc == exit_code(Errc::precondition));
    CHECK_MESSAGE(s.err.find("port.free") != std::string::npos, s.all());
    CHECK_FALSE(std::filesystem::exists(ring.state("run/sparkd-0.pid")));
    // --skip-preflight warns loudly.
    auto sk = ring.run({"start", "--skip-preflight"});
    CHECK(sk.err.find("WITHOUT preflight") != std::string::npos);
  }
  SUBCASE("MemFree under MEM_FREE_MIN fails after MEM_WAIT naming the node") {
    ring.env["MEM_FREE_MIN"] = "1000TiB";
    ring.env["MEM_WAIT"] = "1s";
    auto s = ring.run({"start"});
    CHECK(s.rc == exit_code(Errc::resource));
    CHECK_MESSAGE(s.err.find("node1: MemFree") != std::string::npos, s.all());
    CHECK_FALSE(std::filesystem::exists(ring.state("run/sparkd-0.pid")));
  }
  SUBCASE("a held ring lock: start waits --lock-wait then names the holder; watch exits at once") {
    std::filesystem::create_directories(ring.state(""));
    int fd = ::open(ring.state("ring.lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    REQUIRE(fd >= 0);
    REQUIRE(::flock(fd, LOCK_EX) == 0);
    std::string holder = fmt::format("pid {} (test holder)", ::getpid());
    REQUIRE(::write(fd, holder.data(), holder.size()) == static_cast<ssize_t>(holder.size()));
    auto t0 = std::chrono::steady_clock::now();
    auto s = ring.run({"start", "--lock-wait", "1s"});
    auto took = std::chrono::steady_clock::now() - t0;
    CHECK(s.rc == exit_code(Errc::busy));
    CHECK_MESSAGE(s.err.find(holder) != std::string::npos, s.all());
    CHECK(took >= 1s);
    ring.run({"start", "--skip-preflight"});  // would start: the lock refuses first
    auto w = ring.json_run({"watch"});
    CHECK(w.rc == 0);
    CHECK(w.j["verdict"] == "busy");
    ::close(fd);
  }
}

TEST_CASE(
    "e2e sparkctl: start over SSH into a network namespace detaches sparkd from the session") {
  if (auto why = test::ring_unavailable_reason(); !why.empty()) {
    MESSAGE("SKIP: " << why);
    return;
  }
  test::TempDir dir{"spark-ringssh"};
  int suffix = next_suffix();
  auto ring = test::TestRing::create(
      {.nodes = 2,
       .links = 1,
       .mtu = 1500,
       .sparkctl_bin = SPARKCTL_BIN,
       .extra_config = {
           "ENGINE=exec",
           fmt::format("ENGINE_EXEC='exec {} --port 4${{SPARK_RANK}}{} --mode healthy --watch-pid "
                       "$SPARKD_PID'",
                       FAULT_SERVER_BIN, suffix),
           fmt::format("ENGINE_HEALTH_URL='http://127.0.0.1:4{{rank}}{}/health'", suffix),
           fmt::format("ENGINE_API_URL='http://127.0.0.1:4{{rank}}{}'", suffix),
           "PROBE_EXPECT=Paris", fmt::format("STATE_DIR={}/state", dir.path()),
           fmt::format("SPARKD_BIN={}", SPARKD_BIN), "HEARTBEAT_INTERVAL=200ms",
           "HEARTBEAT_TIMEOUT=2s", "JOIN_TIMEOUT=15s", "SHUTDOWN_GRACE=2s", "STOP_GRACE=6s",
           "READY_TIMEOUT=30s", "MEM_FREE_MIN=1MiB", "MEM_WAIT=2s",
           "START_CHECKS=ssh.reach,port.free,model.files", "MTU_MIN=1500"}});
  REQUIRE_MESSAGE(ring.ok(), ring.error().message);
  auto& r = **ring;
  auto s = r.sparkctl("--json start", 120s);
  REQUIRE(s);
  std::string context =
      s->out + "\n" + s->err + "\n" + read_file(dir / "state/logs/sparkd-1.log").value_or("");
  INFO(context);
  REQUIRE(s->exit_status == 0);
  auto j = json::parse(s->out);
  CHECK(j["ready"] == true);
  int pid1 = j["ranks"][1]["pid"];
  // The launch's SSH session is gone; rank 1's sparkd leads its own session (setsid), so
  // closing the session did not take it along, and it still runs.
  CHECK(alive(pid1));
  auto stat = read_file(fmt::format("/proc/{}/stat", pid1)).value_or("");
  auto fields = split_list(stat.substr(stat.rfind(')') + 2), ' ');
  REQUIRE(fields.size() > 4);
  CHECK(fields[3] == std::to_string(pid1));  // session id == its pid
  auto st = r.sparkctl("--json status", 60s);
  REQUIRE(st);
  CHECK_MESSAGE(st->exit_status == 0, st->out, st->err);
  auto sj = json::parse(st->out, nullptr, false);
  CHECK(sj["ranks"][1]["alive"] == true);
  CHECK(sj["ranks"][1]["state"] == "ready");
  auto lg = r.sparkctl("logs --rank 1 -n 100", 60s);
  REQUIRE(lg);
  CHECK(lg->out.find("joined the ring") != std::string::npos);
  auto stop = r.sparkctl("--json stop", 60s);
  REQUIRE(stop);
  CHECK_MESSAGE(stop->exit_status == 0, stop->out, stop->err);
  CHECK_FALSE(alive(pid1));
  CHECK_FALSE(alive(j["ranks"][0]["pid"].get<int>()));
}

TEST_CASE("e2e sparkctl: a head outside the ring drives two SSH nodes (health through node 0)") {
  if (auto why = test::ring_unavailable_reason(); !why.empty()) {
    MESSAGE("SKIP: " << why);
    return;
  }
  // Three namespaces: the head (sparkctl) in host 0, ranks 0 and 1 behind sshd in hosts 1, 2.
  auto ring =
      test::TestRing::create({.nodes = 3, .links = 1, .mtu = 1500, .sparkctl_bin = SPARKCTL_BIN});
  REQUIRE_MESSAGE(ring.ok(), ring.error().message);
  auto& r = **ring;
  test::TempDir dir{"spark-ringhead"};
  int suffix = next_suffix();
  std::string cfg = fmt::format(
      "RING_NAME=remote\nMODEL=demo\nENGINE=exec\n"
      "ENGINE_EXEC='exec {fault} --port 4${{SPARK_RANK}}{suf} --mode healthy --watch-pid "
      "$SPARKD_PID'\n"
      "ENGINE_HEALTH_URL='http://127.0.0.1:4{{rank}}{suf}/health'\n"
      "ENGINE_API_URL='http://127.0.0.1:4{{rank}}{suf}'\nPROBE_EXPECT=Paris\n"
      "STATE_DIR={dir}/state\nSPARKD_BIN={sparkd}\nSPARKCTL_BIN={sparkctl}\n"
      "SSH_IDENTITY={id}\nSSH_KNOWN_HOSTS={kh}\nSSH_TIMEOUT=5s\n"
      "HEARTBEAT_INTERVAL=200ms\nHEARTBEAT_TIMEOUT=2s\nJOIN_TIMEOUT=15s\nSHUTDOWN_GRACE=2s\n"
      "STOP_GRACE=6s\nREADY_TIMEOUT=30s\nMEM_FREE_MIN=1MiB\nMEM_WAIT=2s\nWATCH_GRACE=0s\n"
      "WATCH_FAILURES=1\nWATCH_BACKOFF=0s\nSTART_CHECKS=ssh.reach,port.free\n",
      fmt::arg("fault", FAULT_SERVER_BIN), fmt::arg("suf", suffix), fmt::arg("dir", dir.path()),
      fmt::arg("sparkd", SPARKD_BIN), fmt::arg("sparkctl", SPARKCTL_BIN),
      fmt::arg("id", r.sshd(1).identity()), fmt::arg("kh", r.known_hosts()));
  for (int n = 0; n < 2; ++n)
    cfg += fmt::format(
        "NODE{n}_NAME=ns{h}\nNODE{n}_SSH={u}@{ip}:22\nNODE{n}_FABRIC_IP={ip}\nNODE{n}_NETDEVS={dev}"
        "\n",
        fmt::arg("n", n), fmt::arg("h", n + 1), fmt::arg("u", r.sshd(n + 1).user()),
        fmt::arg("ip", r.net().ip(n + 1)), fmt::arg("dev", r.net().ifname(0)));
  std::string path = dir.write("ring.env", cfg);
  auto ctl = [&](const std::string& args) {
    auto p = r.net().exec_in(0, fmt::format("{} --config {} {}", SPARKCTL_BIN, path, args), 120s);
    REQUIRE(p);
    return *p;
  };
  auto s = ctl("--json start");
  std::string context =
      s.out + "\n" + s.err + "\n" + read_file(dir / "state/logs/sparkd-0.log").value_or("");
  INFO(context);
  REQUIRE(s.exit_status == 0);
  auto j = json::parse(s.out);
  CHECK(j["ready"] == true);
  int pid0 = j["ranks"][0]["pid"], pid1 = j["ranks"][1]["pid"];
  // status reads rank 0's /health on node 0 over SSH (sparkctl health-get there).
  auto st = ctl("--json status");
  CHECK_MESSAGE(st.exit_status == 0, st.out, st.err);
  auto sj = json::parse(st.out, nullptr, false);
  CHECK(sj["answered"] == true);
  CHECK(sj["ranks"][0]["state"] == "ready");
  CHECK(sj["ranks"][1]["state"] == "ready");
  // A dead follower on a remote node: watch sees it and restarts the ring over SSH.
  REQUIRE(::kill(pid1, SIGKILL) == 0);
  auto w = ctl("--json watch");
  auto wj = json::parse(w.out, nullptr, false);
  CHECK_MESSAGE(wj["verdict"] == "restarted", w.out, w.err);
  CHECK_FALSE(alive(pid0));
  auto stop = ctl("--json stop");
  CHECK_MESSAGE(stop.exit_status == 0, stop.out, stop.err);
  auto after = ctl("--json status");
  auto aj = json::parse(after.out, nullptr, false);
  CHECK(aj["ranks"][0]["alive"] == false);
  CHECK(aj["ranks"][1]["alive"] == false);
}
