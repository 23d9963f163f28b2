// sparkctl start | watch end to end on LOCAL rings (NODE<i>_SSH=local, fabric addresses
// 127.0.0.x): the real sparkctl and sparkd binaries, ENGINE=exec running the fault-injection
// server (spark_fault_server, a test fixture) as every rank's engine. These cover the local
// launch and health paths and start's gates (preflight, memory, lock, --no-wait, the watch's
// grace). The lifecycle scenarios (READY, stop, kill -9, hang, config digest, twenty
// watches, restart cap) run with 2-4 ranks in network namespaces behind real sshds:
// ring_lifecycle_netns_test.cc.
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/process.h"
#include "core/strings.h"
#include "support/netns_ring.h"
#include "support/spawn.h"
#include "support/tempdir.h"

using namespace spark;
using namespace std::chrono_literals;
using nlohmann::json;

namespace {

// The fault server of rank R listens on 2<R><suffix> (20100-23989): below the kernel's
// ephemeral range, so no outgoing connection of another process can hold it when the engine
// binds. The suffix differs per ring.
int next_suffix() {
  static int n = 0;
  return 100 + (static_cast<int>(::getpid()) * 7 + 37 * n++) % 890;
}

using Out = test::CtlRun;

struct LocalRing {
  test::TempDir dir{"spark-ringcli"};
  int nodes;
  int suffix = next_suffix();
  int api_port = test::free_port();
  int rdzv_port = test::free_port();
  std::string cfg;
  std::map<std::string, std::string> env;  // overrides for sparkctl (the environment wins)

  // HEARTBEAT_TIMEOUT is long: no case here tests how fast a lost rank is noticed, and on a
  // loaded machine a heartbeat can come a second late, which would fail a start as fatal.
  explicit LocalRing(int n = 2, const std::string& extra = "") : nodes(n) {
    std::string text = fmt::format(
        "RING_NAME=e2e\nMODEL=demo\nENGINE=exec\n"
        "ENGINE_EXEC='m=healthy; a=0s; if [ -f {dir}/once-$SPARK_RANK ]; then "
        "read m a < {dir}/once-$SPARK_RANK; rm -f {dir}/once-$SPARK_RANK; fi; "
        "exec {fault} --port 2${{SPARK_RANK}}{suf} --mode $m --after $a --watch-pid $SPARKD_PID'\n"
        "ENGINE_HEALTH_URL='http://127.0.0.1:2{{rank}}{suf}/health'\n"
        "ENGINE_API_URL='http://127.0.0.1:2{{rank}}{suf}'\nPROBE_EXPECT=Paris\n"
        "API_PORT={api}\nRDZV_PORT={rdzv}\nSTATE_DIR={dir}/state\n"
        "SPARKD_BIN={sparkd}\nSPARKCTL_BIN={sparkctl}\n"
        "HEARTBEAT_INTERVAL=200ms\nHEARTBEAT_TIMEOUT=10s\nSTALL_TIMEOUT=2s\nJOIN_TIMEOUT=10s\n"
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
    return test::run_ctl(spec);
  }
  Out json_run(std::vector<std::string> args, std::chrono::milliseconds timeout = 90s) const {
    args.insert(args.begin(), "--json");
    return run(args, timeout);
  }

  void fault_once(int rank, const std::string& mode, const std::string& after) const {
    dir.write(fmt::format("once-{}", rank), mode + " " + after + "\n");
  }
  std::string state(const std::string& f) const { return dir / ("state/" + f); }
};

}  // namespace

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

TEST_CASE("e2e sparkctl: a stopped (SIGSTOP) rank shows as stopped and not answering") {
  LocalRing ring(2);
  auto s = ring.json_run({"start"});
  REQUIRE_MESSAGE(s.rc == 0, s.all());
  auto pid = parse_i64(trim(read_file(ring.state("run/sparkd-1.pid")).value_or("")));
  REQUIRE(pid);
  REQUIRE(::kill(static_cast<pid_t>(*pid), SIGSTOP) == 0);
  auto st = ring.json_run({"status"});
  ::kill(static_cast<pid_t>(*pid), SIGCONT);
  INFO(st.all());
  REQUIRE(st.j["ranks"].size() == 2);
  CHECK(st.j["ranks"][1]["state"] == "stopped");
  CHECK(st.j["ranks"][1]["reason"].get<std::string>().find("does not answer") != std::string::npos);
  CHECK(st.j["ranks"][0]["state"] != "stopped");
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
    // --skip-preflight skips no lock: the lock refuses first, and nothing is launched.
    auto sk = ring.run({"start", "--skip-preflight", "--lock-wait", "1s"});
    CHECK_MESSAGE(sk.rc == exit_code(Errc::busy), sk.all());
    CHECK_FALSE(std::filesystem::exists(ring.state("run/sparkd-0.pid")));
    auto w = ring.json_run({"watch"});
    CHECK(w.rc == 0);
    CHECK(w.j["verdict"] == "busy");
    ::close(fd);
  }
}

TEST_CASE(
    "e2e sparkctl: a rank whose sparkd exits before writing its pidfile fails the launch at once, "
    "naming it") {
  LocalRing ring(2);
  // FAULT INJECTION: a wrapper that makes rank 1's sparkd exit at once (as a bad config or a
  // missing library would), before any pidfile exists, after more output than the report
  // keeps (~600 characters).
  std::string wrapper = ring.dir.write(
      "sparkd-wrapper.sh",
      fmt::format("#!/bin/sh\ncase \" $* \" in *\" --rank 1 \"*) "
                  "for i in $(seq 100); do printf 'noise ' >&2; done; echo >&2; "
                  "echo 'sparkd: injected start failure' >&2; exit 3;; esac\nexec {} \"$@\"\n",
                  SPARKD_BIN));
  ::chmod(wrapper.c_str(), 0755);
  ring.env["SPARKD_BIN"] = wrapper;
  auto s = ring.json_run({"start"});
  CHECK_MESSAGE(s.rc == exit_code(Errc::remote), s.all());
  std::string msg = s.j.is_object() ? s.j.value(json::json_pointer("/error/message"), "") : "";
  CHECK_MESSAGE(msg.find("rank 1 did not start") != std::string::npos, msg);
  CHECK_MESSAGE(msg.find("injected start failure") != std::string::npos, msg);
  // The cut output starts at a whole word and says it was cut.
  CHECK_MESSAGE(msg.find("pidfile: ... noise noise") != std::string::npos, msg);
  bool teardown = false;
  for (const auto& st : s.j["steps"])
    if (st["step"] == "teardown") teardown = st["ok"] == true;
  // The launch noticed the exit when it happened: it did not wait out its bound for a
  // pidfile that would never come (the report says how the wait ended).
  CHECK_MESSAGE(msg.find("it exited before writing its pidfile") != std::string::npos, msg);
  CHECK_MESSAGE(msg.find("10 s") == std::string::npos, msg);
  CHECK(teardown);
  CHECK_FALSE(std::filesystem::exists(ring.state("run/sparkd-0.pid")));
}

TEST_CASE("e2e sparkctl: watch --quiet prints only changes; a watch with no ring says so") {
  LocalRing ring(2);
  // No ring started in this STATE_DIR: an error on stderr and a non-zero exit, even quiet,
  // so that a cron job watching another user's state does not pass silently.
  auto none = ring.run({"watch", "--quiet"});
  CHECK_MESSAGE(none.rc == exit_code(Errc::not_found), none.all());
  CHECK_MESSAGE(none.err.find("no started ring") != std::string::npos, none.all());
  CHECK_MESSAGE(none.err.find(ring.dir / "state") != std::string::npos, none.all());
  CHECK(none.out.empty());
  auto s = ring.run({"start"});
  REQUIRE_MESSAGE(s.rc == 0, s.all());
  // A healthy ring is silent from the first check on: the start already said READY.
  auto first = ring.run({"watch", "--quiet"});
  CHECK_MESSAGE(first.rc == 0, first.all());
  CHECK_MESSAGE(first.out.empty(), first.all());
  auto second = ring.run({"watch", "--quiet"});
  CHECK_MESSAGE(second.rc == 0, second.all());
  CHECK_MESSAGE(second.out.empty(), second.all());
  CHECK(second.err.empty());
  // Without --quiet a healthy check still says so (an operator at a terminal).
  auto loud = ring.run({"watch"});
  CHECK_MESSAGE(loud.out.find("watch: healthy") != std::string::npos, loud.all());
  ring.run({"stop"});
}

TEST_CASE("e2e sparkctl: start shows its phases with times; a second start says the ring runs") {
  LocalRing ring(2);
  ring.fault_once(0, "slow-start", "3s");  // rank 0's engine loads for 3 s: a load phase
  auto s = ring.run({"start"});
  REQUIRE_MESSAGE(s.rc == 0, s.all());
  // Each step on its own line as it ended: name, ok, seconds; rank 0's phases among them.
  auto step = [&](const std::string& name) {
    for (const auto& line : split_list(s.out, '\n'))
      if (starts_with(line, name + " ") && line.find(" ok ") != std::string::npos &&
          line.find(" s  ") != std::string::npos)
        return true;
    return false;
  };
  for (const char* name : {"ssh", "preflight", "launch", "load", "ready"})
    CHECK_MESSAGE(step(name), name << " missing in:\n" << s.out);
  CHECK(s.out.find("READY: model demo on 2 rank(s)") != std::string::npos);
  auto j = ring.json_run({"status"});
  REQUIRE(j.rc == 0);

  auto again = ring.run({"start"});
  CHECK(again.rc == exit_code(Errc::busy));
  CHECK_MESSAGE(again.err.find("start refused: the ring already runs") != std::string::npos,
                again.all());
  CHECK(again.err.find("sparkctl restart") != std::string::npos);
  CHECK(again.err.find("torn down") == std::string::npos);
  CHECK(ring.json_run({"status"}).rc == 0);  // still serving, untouched

  // preflight on the running ring: the ports are held by its own sparkd, which is no failure.
  auto pf = ring.run({"preflight", "--only", "port.free"});
  CHECK_MESSAGE(pf.rc == 0, pf.all());
  CHECK(pf.out.find("held by this ring's own sparkd") != std::string::npos);
}

TEST_CASE("e2e sparkctl: preflight sw.sparkd checks that each node can start its sparkd") {
  LocalRing ring(1);
  auto pf = ring.json_run({"preflight", "--only", "sw.sparkd"});
  CHECK_MESSAGE(pf.rc == 0, pf.all());
  auto verdict = [](const Out& o) -> std::string {
    for (const auto& c : o.j.value("checks", json::array()))
      if (c.value("id", "") == "sw.sparkd")
        return c.value("verdict", "") + ": " + c.value("message", "");
    return "none";
  };
  CHECK(verdict(pf).rfind("PASS: ", 0) == 0);
  // A sparkd of another version, one that cannot start (a missing library), none at all.
  std::string old = ring.dir.write("old-sparkd", "#!/bin/sh\necho 'sparkd 0.0.9'\n");
  std::string broken = ring.dir.write(
      "broken-sparkd",
      "#!/bin/sh\necho 'sparkd: error while loading shared libraries: libboost_x.so' >&2\n"
      "exit 127\n");
  ::chmod(old.c_str(), 0755);
  ::chmod(broken.c_str(), 0755);
  ring.env["SPARKD_BIN"] = old;
  auto o = ring.json_run({"preflight", "--only", "sw.sparkd"});
  CHECK(o.rc == 1);  // a check failed
  CHECK_MESSAGE(verdict(o).find("is 'sparkd 0.0.9', this sparkctl is") != std::string::npos,
                o.all());
  ring.env["SPARKD_BIN"] = broken;
  auto b = ring.json_run({"preflight", "--only", "sw.sparkd"});
  CHECK(b.rc == 1);  // a check failed
  // The library is named, with the loader's own words after it.
  CHECK_MESSAGE(verdict(b).find("cannot be started: the library libboost_x.so is missing (exit "
                                "127: sparkd: error while loading") != std::string::npos,
                b.all());
  ring.env["SPARKD_BIN"] = ring.dir / "no-such-sparkd";
  auto n = ring.json_run({"preflight", "--only", "sw.sparkd"});
  CHECK(n.rc == 1);  // a check failed
  CHECK_MESSAGE(verdict(n).find("FAIL: no sparkd found") != std::string::npos, n.all());
}
