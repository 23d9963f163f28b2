// The exec backend running the real fault-injection server (tests/support/fault_server_main.cc)
// as its external engine: readiness from its health URL, crash -> fatal, hang -> stalled,
// fatal health -> fatal, stop kills the whole process group.
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <thread>

#include "core/strings.h"
#include "daemon/backend.h"
#include "daemon/process_group.h"
#include "support/spawn.h"
#include "support/tempdir.h"

using namespace spark;
using namespace spark::daemon;
using namespace std::chrono_literals;

namespace {

struct ExecFixture {
  test::TempDir dir{"sparkd-exec"};
  int port = test::free_port();
  std::unique_ptr<Backend> eng;
  BackendContext ctx;
  RingConfig cfg;

  std::string bin = test::find_fixture_binary(FAULT_SERVER_BIN);

  explicit ExecFixture(const std::string& args, const std::string& url_suffix = "/health") {
    if (bin.empty()) {
      MESSAGE("SKIP: spark_fault_server not found at " FAULT_SERVER_BIN " nor beside the test");
      std::puts("SKIP: spark_fault_server (test fixture) not found");
    }
    Environment env;
    env.vars["ENGINE_EXEC"] = bin + " --port ${FAULT_PORT} " + args;
    env.vars["ENGINE_HEALTH_URL"] = "http://127.0.0.1:${FAULT_PORT}" + url_suffix;
    std::vector<Diagnostic> d;
    auto c = load_config_text("ENGINE=exec\nSLOTS=3\nNODE0_SSH=local\n", "t.env", env, &d);
    REQUIRE(c.ok());
    cfg = *c;
    eng = make_backend(cfg, 0);
    ctx.cfg = &cfg;
    ctx.log_dir = dir.path();
    ctx.pidfile = dir / "sparkd.pid";
    ctx.env = {{"FAULT_PORT", std::to_string(port)}, {"SPARK_RANK", "0"}};
    ctx.stall_timeout = 600ms;
  }
  ~ExecFixture() {
    if (eng) eng->stop(1000ms);
  }
};

template <typename Pred>
bool eventually(Pred p, std::chrono::milliseconds limit = 8000ms) {
  auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (p()) return true;
    std::this_thread::sleep_for(20ms);
  }
  return p();
}

}  // namespace

TEST_CASE("exec engine: ready from the engine's health URL; stop kills the process group") {
  ExecFixture f("--mode slow-start --after 1500ms");
  if (f.bin.empty()) return;
  CHECK(std::string(f.eng->name()) == "exec");
  REQUIRE(f.eng->start(f.ctx).ok());
  REQUIRE(eventually([&] { return f.eng->status().reason.find("503") != std::string::npos; }));
  CHECK_FALSE(f.eng->status().ready);
  CHECK(f.eng->status().slots_total == 3);
  REQUIRE(eventually([&] { return f.eng->status().ready; }));
  auto pg = read_file(f.ctx.pidfile + ".engine");
  REQUIRE(pg.has_value());
  pid_t pgid = static_cast<pid_t>(*parse_i64(trim(*pg)));
  CHECK(group_alive(pgid));
  f.eng->stop(2000ms);
  CHECK_FALSE(group_alive(pgid));
  CHECK_FALSE(read_file(f.ctx.pidfile + ".engine").has_value());
  auto log = read_file(f.dir / "engine-rank0.log");
  REQUIRE(log.has_value());
  CHECK(log->find("mode slow-start") != std::string::npos);
  CHECK(log->find("SIGTERM") != std::string::npos);
}

TEST_CASE("exec engine: a crashing engine is fatal with its exit status and last log lines") {
  ExecFixture f("--mode crash --after 300ms");
  if (f.bin.empty()) return;
  REQUIRE(f.eng->start(f.ctx).ok());
  REQUIRE(eventually([&] { return f.eng->status().fatal; }));
  auto s = f.eng->status();
  CHECK(s.reason.find("exited with status 3") != std::string::npos);
  CHECK(s.reason.find("crashing as asked") != std::string::npos);
}

TEST_CASE("exec engine: a hung health endpoint ages into a stalled call") {
  ExecFixture f("--mode hang --after 200ms");
  if (f.bin.empty()) return;
  REQUIRE(f.eng->start(f.ctx).ok());
  REQUIRE(eventually([&] { return f.eng->status().oldest_call > 600ms; }));
  auto s = f.eng->status();
  CHECK_FALSE(s.fatal);
  CHECK(s.oldest_call_what.find("/health") != std::string::npos);
  // A hung engine does not hold up the stop: once it returns, the process is gone and
  // nothing listens on its port any more.
  f.eng->stop(500ms);
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(f.port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  CHECK(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0);
  CHECK(errno == ECONNREFUSED);
  ::close(fd);
}

TEST_CASE("exec engine: an engine whose health says fatal is fatal") {
  ExecFixture f("--mode fatal-health --after 200ms");
  if (f.bin.empty()) return;
  REQUIRE(f.eng->start(f.ctx).ok());
  REQUIRE(eventually([&] { return f.eng->status().fatal; }));
  CHECK(f.eng->status().reason.find("injected fault") != std::string::npos);
}

TEST_CASE("exec engine: an engine that ignores SIGTERM is killed after the grace") {
  ExecFixture f("--mode healthy --ignore-term");
  if (f.bin.empty()) return;
  REQUIRE(f.eng->start(f.ctx).ok());
  REQUIRE(eventually([&] { return f.eng->status().ready; }));
  pid_t pgid = static_cast<pid_t>(*parse_i64(trim(*read_file(f.ctx.pidfile + ".engine"))));
  auto t0 = std::chrono::steady_clock::now();
  f.eng->stop(300ms);
  CHECK(std::chrono::steady_clock::now() - t0 >= 300ms);
  CHECK_FALSE(group_alive(pgid));
}

TEST_CASE("exec engine: an engine command that does not exist is fatal, not ready") {
  ExecFixture f("");
  if (f.bin.empty()) return;
  Environment env;
  env.vars["ENGINE_EXEC"] = "/nonexistent/engine --serve";
  std::vector<Diagnostic> d;
  auto c = load_config_text("ENGINE=exec\nNODE0_SSH=local\n", "t.env", env, &d);
  REQUIRE(c.ok());
  f.cfg = *c;
  f.eng = make_backend(f.cfg, 0);
  REQUIRE(f.eng->start(f.ctx).ok());
  REQUIRE(eventually([&] { return f.eng->status().fatal; }));
  CHECK_FALSE(f.eng->status().ready);
  CHECK(f.eng->status().reason.find("exited with status 127") != std::string::npos);
}

TEST_CASE("exec engine: the probe is a real completion from ENGINE_API_URL") {
  ExecFixture f("--mode healthy --completion ' Paris, of course.'");
  if (f.bin.empty()) return;
  f.cfg.settings["ENGINE_API_URL"].value = "http://127.0.0.1:${FAULT_PORT}/";
  f.eng = make_backend(f.cfg, 0);
  REQUIRE(f.eng->start(f.ctx).ok());
  REQUIRE(eventually([&] { return f.eng->status().ready; }));
  auto t = f.eng->probe("The capital of France is", 5000ms);
  REQUIRE(t.ok());
  CHECK(*t == " Paris, of course.");
}

TEST_CASE("exec engine: without ENGINE_API_URL the probe is unsupported, not faked") {
  ExecFixture f("--mode healthy");
  if (f.bin.empty()) return;
  REQUIRE(f.eng->start(f.ctx).ok());
  auto t = f.eng->probe("x", 1000ms);
  REQUIRE_FALSE(t.ok());
  CHECK(t.error().code == Errc::unsupported);
  CHECK(t.error().message.find("ENGINE_API_URL") != std::string::npos);
}

TEST_CASE("exec engine: ENGINE_HEALTH_RANKS=0 leaves followers to process liveness") {
  ExecFixture f("--mode healthy");
  if (f.bin.empty()) return;
  f.cfg.settings["ENGINE_HEALTH_RANKS"].value = "0";
  f.cfg.settings["ENGINE_HEALTH_URL"].value = "http://127.0.0.1:1/never";
  f.eng = make_backend(f.cfg, 1);  // a follower: never polls the (unreachable) URL
  REQUIRE(f.eng->start(f.ctx).ok());
  REQUIRE(eventually([&] { return f.eng->status().ready; }, 2000ms));
  ExecFixture g("--mode healthy");  // rank 0 still polls the URL, and is not ready
  g.cfg = f.cfg;
  g.eng = make_backend(g.cfg, 0);
  REQUIRE(g.eng->start(g.ctx).ok());
  std::this_thread::sleep_for(500ms);
  CHECK_FALSE(g.eng->status().ready);
  CHECK(g.eng->status().reason.find("/never") != std::string::npos);
}

TEST_CASE("process group: a group whose members are all exited (zombies) is not alive") {
  test::TempDir dir("pgroup");
  auto pid = spawn_shell_group("sleep 30", {}, dir / "log");
  REQUIRE(pid.ok());
  REQUIRE(eventually([&] { return group_alive(*pid); }, 2000ms));
  ::kill(-*pid, SIGTERM);
  int st = 0;
  ::waitpid(*pid, &st, 0);  // the leader; `sleep` is left to init, which may reap it late
  CHECK(eventually([&] { return !group_alive(*pid); }, 500ms));
}

TEST_CASE("process group helpers") {
  CHECK(expand_vars("http://h:${P}/x/{rank}", {{"P", "81"}}, 2) == "http://h:81/x/2");
  CHECK(expand_vars("${NOPE_NOT_SET_XYZ}a", {}, 0) == "a");
  CHECK(expand_vars("http://h:{8100+rank}/health", {}, 3) == "http://h:8103/health");
  CHECK(expand_vars("{x+rank}{12", {}, 3) == "{x+rank}{12");
  CHECK(describe_wait_status(3 << 8) == "exited with status 3");
  CHECK(describe_wait_status(SIGKILL).find("SIGKILL") != std::string::npos);
}
