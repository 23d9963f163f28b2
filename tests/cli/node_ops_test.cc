// The typed node operations behind start/stop/status (cli/node_ops.h), run on this machine as
// the node: real processes, real pidfiles. The sparkd they launch is a shell-script double
// (sparkd_double.sh, written by the test) that writes its pidfile like sparkd and can be told
// to fail at once or to ignore SIGTERM.
#include "cli/node_ops.h"

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <thread>

#include "core/process.h"
#include "core/strings.h"
#include "support/tempdir.h"

using namespace spark;
using namespace spark::cli;
using namespace std::chrono_literals;

namespace {

// Two ranks on one local node, state and logs under `dir`.
RingConfig ring_in(const test::TempDir& dir) {
  auto cfg =
      load_config_text("NODE0_SSH=local\nNODE0_GPUS=0,1\nSTATE_DIR=" + dir.path() + "/state\n",
                       "ring.env", Environment{}, nullptr);
  REQUIRE_MESSAGE(cfg.ok(), (cfg.ok() ? "" : cfg.error().message));
  return *cfg;
}

// A stand-in for sparkd: writes its pid to --pidfile, then waits for SIGTERM (removing the
// pidfile, as sparkd does). MODE=fail prints a reason and exits at once; MODE=stubborn
// ignores SIGTERM. It ends by itself after a minute, so a failed test leaves nothing behind.
std::string write_double(const test::TempDir& dir) {
  auto path = dir.write("sparkd_double.sh", R"(#!/bin/sh
pf=
while [ $# -gt 0 ]; do [ "$1" = --pidfile ] && pf=$2; shift; done
if [ "$MODE" = fail ]; then echo "sparkd: bad cluster file: MODEL_PATH is missing"; exit 3; fi
if [ "$MODE" = stubborn ]; then trap '' TERM; else trap 'rm -f "$pf"; exit 0' TERM; fi
[ "$MODE" = silent ] || echo $$ > "$pf"
i=0; while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done  # gone within a minute even if a test fails
)");
  ::chmod(path.c_str(), 0755);
  return path;
}

}  // namespace

TEST_CASE("node probe: a rank runs only when its pidfile names its sparkd") {
  test::TempDir dir;
  auto cfg = ring_in(dir);
  auto d = node_dirs(cfg);
  std::filesystem::create_directories(d.state + "/run");
  // Rank 0: a live process whose command line is rank 0's sparkd. Rank 1: a live pid that is
  // not a sparkd (a recycled pid in a stale pidfile).
  ProcessSpec spec = shell_spec("sleep 30");
  spec.argv.push_back(pidfile_path(d, 0));  // $0 of the shell: its command line names it
  auto child = ChildProcess::start(spec, "");
  REQUIRE(child.ok());
  REQUIRE(write_file_atomic(pidfile_path(d, 0), std::to_string(child->pid()) + "\n", nullptr));
  REQUIRE(write_file_atomic(pidfile_path(d, 1), std::to_string(::getpid()), nullptr));
  auto p = probe_here(cfg, 0);
  REQUIRE(p.ranks.size() == 2);
  CHECK(p.ranks[0].pid == child->pid());
  CHECK(p.ranks[0].alive);
  CHECK(p.ranks[0].uptime_s >= 0);
  CHECK(p.ranks[1].pid == ::getpid());
  CHECK_FALSE(p.ranks[1].alive);
  CHECK(p.mem_total > 0);
  CHECK(p.mem_available > 0);
  // The reply survives its JSON form.
  auto back = probe_from_json(to_json(p));
  CHECK(back.ranks[0].alive);
  CHECK(back.ranks[0].pid == child->pid());
  CHECK(back.mem_total == p.mem_total);
  child->stop(100ms);
}

TEST_CASE("node launch and stop: detached ranks with pidfiles, then nothing left") {
  test::TempDir dir;
  auto cfg = ring_in(dir);
  auto d = node_dirs(cfg);
  const std::string bin = write_double(dir);
  auto up = launch_here(cfg, 0, "RING_NAME=t\n", bin, {{1, {{"SPARK_TEST_VAR", "x y"}}}});
  REQUIRE(up.size() == 2);
  for (const auto& lr : up) {
    CHECK_MESSAGE(lr.error.empty(), lr.error);
    CHECK(lr.pid > 0);
  }
  CHECK(read_file(d.state + "/run/ring-node0.env") == "RING_NAME=t\n");
  auto env1 = read_file(fmt::format("/proc/{}/environ", up[1].pid));
  REQUIRE(env1.has_value());
  CHECK(env1->find("SPARK_TEST_VAR=x y") != std::string::npos);
  auto p = probe_here(cfg, 0);
  CHECK(p.ranks[0].alive);
  CHECK(p.ranks[1].alive);

  // A second launch refuses to start a rank that already runs.
  auto again = launch_here(cfg, 0, "RING_NAME=t\n", bin, {});
  CHECK(again[0].error.find("already runs") != std::string::npos);

  auto down = stop_here(cfg, 0, 5000ms);
  REQUIRE(down.size() == 2);
  for (const auto& sr : down) {
    CHECK(sr.how == "sigterm");
    CHECK(sr.left.empty());
  }
  CHECK_FALSE(std::filesystem::exists(pidfile_path(d, 0)));
  p = probe_here(cfg, 0);
  CHECK_FALSE(p.ranks[0].alive);
  CHECK_FALSE(p.ranks[1].alive);
}

TEST_CASE("node launch: a sparkd that exits at once is reported with its last words") {
  test::TempDir dir;
  auto cfg = ring_in(dir);
  const std::string bin = write_double(dir);
  auto up = launch_here(cfg, 0, "", bin, {{0, {{"MODE", "fail"}}}, {1, {{"MODE", "fail"}}}});
  REQUIRE(up.size() == 2);
  CHECK(up[0].pid == 0);
  CHECK(up[0].error.find("did not start") != std::string::npos);
  CHECK(up[0].error.find("MODEL_PATH is missing") != std::string::npos);
  // Noticed when it exited, not at the wait's bound.
  CHECK_MESSAGE(up[0].error.find("exited before writing its pidfile") != std::string::npos,
                up[0].error);
}

TEST_CASE("node launch: a sparkd that runs without writing its pidfile is stopped and named") {
  test::TempDir dir;
  auto cfg = ring_in(dir);
  const std::string bin = write_double(dir);
  auto up = launch_here(cfg, 0, "", bin, {{0, {{"MODE", "silent"}}}, {1, {{"MODE", "silent"}}}});
  REQUIRE(up.size() == 2);
  for (const auto& lr : up) {
    CHECK(lr.pid == 0);
    CHECK_MESSAGE(lr.error.find("wrote no pidfile") != std::string::npos, lr.error);
    CHECK_MESSAGE(lr.error.find("was stopped") != std::string::npos, lr.error);
  }
  // Nothing of it is left running: the probe finds no rank and no process has its mark.
  auto p = probe_here(cfg, 0);
  CHECK_FALSE(p.ranks[0].alive);
  CHECK_FALSE(p.ranks[1].alive);
  auto ps = run_shell("pgrep -f '" + dir.path() + "/[s]parkd_double'", 5000ms);
  REQUIRE(ps);
  CHECK_MESSAGE(ps->out.empty(), ps->out);
}

TEST_CASE("node stop: SIGKILL after the grace, and strays of this node's cluster file") {
  test::TempDir dir;
  auto cfg = ring_in(dir);
  auto d = node_dirs(cfg);
  const std::string bin = write_double(dir);
  auto up = launch_here(cfg, 0, "", bin, {{0, {{"MODE", "stubborn"}}}});
  REQUIRE(up[0].error.empty());
  REQUIRE(up[1].error.empty());
  // A sparkd of this node that no pidfile names (its pidfile was lost).
  ProcessSpec stray = shell_spec("sleep 30");
  stray.argv.push_back(d.state + "/run/ring-node0.env");
  auto s = spawn_detached(stray, dir / "stray.out");
  REQUIRE(s.ok());
  auto down = stop_here(cfg, 0, 300ms);
  CHECK(down[0].how == "sigkill");  // ignored SIGTERM
  CHECK(down[1].how == "sigterm");
  CHECK(down[0].left.empty());
  CHECK(down[1].left.empty());
  // The stray is gone too (reaped by init, so its /proc entry disappears).
  bool gone = false;
  for (int i = 0; i < 50 && !gone; ++i) {
    gone = !std::filesystem::exists(fmt::format("/proc/{}", *s));
    if (!gone) {
      auto st = read_file(fmt::format("/proc/{}/stat", *s));
      gone = st && st->find(") Z") != std::string::npos;
    }
    if (!gone) std::this_thread::sleep_for(20ms);
  }
  CHECK(gone);
}
