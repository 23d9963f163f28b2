// The ring's head-side state: the ring lock (a second holder is refused naming the first,
// after waiting), markers and the watch/launch records (round trip; a corrupt file reads as
// no record), and the strict health rule watch and start share.
#include "cli/ring_state.h"

#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <sstream>
#include <thread>
#include <utility>

#include "cli/cli.h"
#include "cli/engine_pin.h"
#include "cli/ring_ops.h"
#include "core/strings.h"
#include "support/tempdir.h"

using namespace spark;
using namespace spark::cli;
using namespace std::chrono_literals;

TEST_CASE("ring lock: a second holder waits, then is refused naming the first; released on drop") {
  test::TempDir dir("ring-lock");
  std::string state = dir / "state";
  auto first = RingLock::acquire(state, "start", 0);
  REQUIRE(first.ok());
  auto t0 = std::chrono::steady_clock::now();
  auto second = RingLock::acquire(state, "stop", 300);
  CHECK(std::chrono::steady_clock::now() - t0 >= 300ms);
  REQUIRE_FALSE(second.ok());
  CHECK(second.error().code == Errc::busy);
  CHECK(second.error().message.find("pid " + std::to_string(::getpid())) != std::string::npos);
  CHECK(second.error().message.find("(start: ") != std::string::npos);
  // A waiter gets it once the holder lets go.
  std::thread release([&] {
    std::this_thread::sleep_for(200ms);
    first = RingLock();
  });
  auto third = RingLock::acquire(state, "watch", 3000);
  release.join();
  CHECK(third.ok());
}

TEST_CASE("ring markers and records round-trip; a corrupt record reads as none") {
  test::TempDir dir("ring-state");
  std::string state = dir / "state";
  CHECK_FALSE(read_marker(state, Marker::disabled));
  REQUIRE(set_marker(state, Marker::disabled, "sparkctl stop").ok());
  auto m = read_marker(state, Marker::disabled);
  REQUIRE(m);
  CHECK((*m)["reason"] == "sparkctl stop");
  CHECK((*m)["at_ms"].get<int64_t>() > 0);
  clear_marker(state, Marker::disabled);
  CHECK_FALSE(read_marker(state, Marker::disabled));

  WatchRecord w;
  w.failures = 2;
  w.restarts_ms = {1, 2, 3};
  w.last_verdict = "unhealthy";
  REQUIRE(write_watch_record(state, w).ok());
  auto back = read_watch_record(state);
  CHECK(back.failures == 2);
  CHECK(back.restarts_ms.size() == 3);
  CHECK(back.last_verdict == "unhealthy");

  RingRecord r;
  r.started = true;
  r.launched_ms = 42;
  r.pids = {10, 11};
  REQUIRE(write_ring_record(state, r).ok());
  auto rr = read_ring_record(state);
  CHECK(rr.started);
  CHECK(rr.launched_ms == 42);
  CHECK(rr.pids == std::vector<int>{10, 11});

  std::string why;
  REQUIRE(write_file_atomic(state + "/watch.json", "{not json", &why));
  CHECK(read_watch_record(state).failures == 0);
}

TEST_CASE("strict health: ready and every rank alive, else the reason") {
  nlohmann::json h = {{"ready", true},
                      {"state", "ready"},
                      {"fatal", false},
                      {"stalled", false},
                      {"ranks", {{{"rank", 0}, {"alive", true}}, {{"rank", 1}, {"alive", true}}}}};
  CHECK(strict_problem(h).empty());
  h["ranks"][1]["alive"] = false;
  h["ranks"][1]["node"] = "b";
  CHECK(strict_problem(h) == "rank 1 (node b) is not alive");
  h["ranks"][1]["alive"] = true;
  h["ready"] = false;
  h["state"] = "loading";
  h["reason"] = "waiting for rank 1";
  CHECK(strict_problem(h) == "loading: waiting for rank 1");
  h["stalled"] = true;
  h["reason"] = "engine call";
  CHECK(strict_problem(h).find("stalled") == 0);
  h["fatal"] = true;
  CHECK(strict_problem(h).find("fatal") == 0);
}

TEST_CASE(
    "ring state written by root into a user's state directory stays the user's: lock, markers, "
    "records, incidents, engine sets") {
  if (::geteuid() != 0) {
    MESSAGE("skipped: needs root (what root's watch timer writes into a user's ring state)");
    return;
  }
  test::TempDir dir("ring-owner");
  // A ring a user (nobody here) started, and one root started.
  const std::string user = dir / "user", root = dir / "root";
  REQUIRE(make_dirs(user).value() == 0);
  REQUIRE(make_dirs(root).value() == 0);
  const uid_t nobody = 65534;
  const gid_t nogroup = 65534;
  REQUIRE(::chown(user.c_str(), nobody, nogroup) == 0);
  auto owner = [](const std::string& p) {
    struct stat st {};
    REQUIRE_MESSAGE(::stat(p.c_str(), &st) == 0, p);
    return std::pair<uid_t, gid_t>(st.st_uid, st.st_gid);
  };
  const std::pair<uid_t, gid_t> users{nobody, nogroup};
  {
    auto lock = RingLock::acquire(user, "watch", 0);
    REQUIRE(lock.ok());
    CHECK(owner(user + "/ring.lock") == users);
  }
  REQUIRE(set_marker(user, Marker::gave_up, "three restarts in the window").ok());
  CHECK(owner(marker_path(user, Marker::gave_up)) == users);
  WatchRecord w;
  w.failures = 2;
  REQUIRE(write_watch_record(user, w).ok());
  CHECK(owner(user + "/watch.json") == users);
  REQUIRE(write_watch_record(user, w).ok());  // a rewrite stays the user's too
  CHECK(owner(user + "/watch.json") == users);
  RingRecord r;
  r.started = true;
  REQUIRE(write_ring_record(user, r).ok());
  CHECK(owner(user + "/ring.json") == users);
  REQUIRE(make_dirs(user + "/incidents/20261201-120000").value() == 0);
  CHECK(owner(user + "/incidents") == users);
  CHECK(owner(user + "/incidents/20261201-120000") == users);
  EngineSet s;
  s.engine = "native";
  REQUIRE(write_engine_set(user, "last_good", s).ok());
  CHECK(owner(user + "/engine") == users);
  CHECK(owner(user + "/engine/last_good.json") == users);
  // Root's own ring stays root's.
  REQUIRE(set_marker(root, Marker::disabled, "stop").ok());
  CHECK(owner(marker_path(root, Marker::disabled)).first == 0);
  REQUIRE(write_watch_record(root, w).ok());
  CHECK(owner(root + "/watch.json").first == 0);
}

TEST_CASE("watch --quiet: a ring stopped on purpose is said once, then silent until it changes") {
  test::TempDir d("watch-quiet");
  std::string state = d / "state";
  REQUIRE(make_dirs(state).value() == 0);
  std::string file = d.write("ring.env", "NODE0_SSH=local\nSTATE_DIR=" + state + "\n");
  auto watch = [&] {
    std::ostringstream out, err;
    std::vector<const char*> argv = {"sparkctl", "--config", file.c_str(), "watch", "--quiet"};
    int rc = cli::run(static_cast<int>(argv.size()), argv.data(), out, err, Environment{});
    return std::pair{rc, out.str()};
  };
  REQUIRE(set_marker(state, Marker::disabled, "sparkctl stop").ok());
  auto [rc1, first] = watch();
  CHECK(rc1 == 0);
  CHECK(first.find("watch: disabled: DISABLED marker set") != std::string::npos);
  // The verdict was saved: the next minutes say nothing (cron mails only output).
  for (int i = 0; i < 3; ++i) {
    auto [rc, again] = watch();
    CHECK(rc == 0);
    CHECK(again.empty());
  }
  CHECK(read_watch_record(state).last_verdict == "disabled");
}
