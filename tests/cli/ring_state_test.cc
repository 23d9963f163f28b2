// The ring's head-side state: the ring lock (a second holder is refused naming the first,
// after waiting), markers and the watch/launch records (round trip; a corrupt file reads as
// no record), and the strict health rule watch and start share.
#include "cli/ring_state.h"

#include <doctest/doctest.h>
#include <unistd.h>

#include <chrono>
#include <thread>

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
