// The health history end to end: a 2-rank ring in network namespaces behind real sshd
// (tests/support/netns_ring.h) samples every 200 ms; rank 1's sparkd is killed with SIGKILL
// (as a frozen or powered-off node would vanish); `sparkctl status --history` then shows,
// read over SSH from each node's file, rank 1's samples up to its end and, in rank 0's
// history, the moment rank 1 was lost; --node filters; the table has a sparkline per series.
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <signal.h>

#include <nlohmann/json.hpp>
#include <thread>

#include "core/health_history.h"
#include "core/strings.h"
#include "support/netns_ring.h"
#include "support/ring.h"

using namespace spark;
using namespace std::chrono_literals;
using nlohmann::json;
using test::NetnsRing;

TEST_CASE("e2e netns history: a lost rank is in the survivor's history; status --history") {
  if (auto why = test::ring_unavailable_reason(); !why.empty()) {
    MESSAGE("SKIP: " << why);
    std::printf("SKIP: %s\n", why.c_str());
    return;
  }
  auto made = NetnsRing::create(
      {.ranks = 2,
       .sparkctl_bin = SPARKCTL_BIN,
       .sparkd_bin = SPARKD_BIN,
       .fault_server_bin = FAULT_SERVER_BIN,
       .extra_config = {"HEALTH_SAMPLE_INTERVAL=200ms", "HEALTH_HISTORY_SAMPLES=500"}});
  REQUIRE_MESSAGE(made.ok(), (made.ok() ? "" : made.error().message));
  auto& ring = **made;
  auto s = ring.ctl_json({"start"});
  REQUIRE_MESSAGE(s.rc == 0, s.all(), ring.logs());
  int pid1 = s.j["ranks"][1].value("pid", 0);
  REQUIRE(pid1 > 0);
  // A few samples of the whole ring, then rank 1 vanishes.
  std::this_thread::sleep_for(1s);
  REQUIRE(::kill(pid1, SIGKILL) == 0);
  REQUIRE_MESSAGE(
      ring.wait_health([](const json& h) { return h.value("ranks_alive", 2) < 2; }, 20s),
      ring.logs());
  std::this_thread::sleep_for(600ms);  // the poke's sample and one more

  auto h = ring.ctl_json({"status", "--history", "--since", "10m"});
  REQUIRE_MESSAGE(h.rc == 0, h.all());
  REQUIRE(h.j["ranks"].size() == 2);
  CHECK(h.j["interval_ms"] == 200);
  const auto& r0 = h.j["ranks"][0];
  const auto& r1 = h.j["ranks"][1];
  CHECK(r0["node"] == "node0");
  CHECK(r1["node"] == "node1");
  CHECK(r0["samples"].size() >= 5);
  CHECK(r1["samples"].size() >= 3);  // up to its end, read from node1's disk
  bool whole = false, lost = false;
  for (const auto& x : r0["samples"]) whole = whole || x["ranks_alive"] == 3;
  for (const auto& e : r0["events"])
    lost = lost || e.get<std::string>().find("LOST rank(s) 1") != std::string::npos;
  CHECK(whole);
  CHECK_MESSAGE(lost, r0["events"].dump());
  CHECK(r0["samples"].back()["mem_available"].get<int64_t>() > 0);
  CHECK(!r0["samples"].back()["boot_id"].get<std::string>().empty());
  // rank 1 stopped writing when it died: its last sample is older than rank 0's.
  CHECK(r1["samples"].back()["time_ms"].get<int64_t>() <
        r0["samples"].back()["time_ms"].get<int64_t>());
  // The file on node1's disk holds it all (what survives a power cycle).
  auto file = read_history(ring.state("history/health-rank1.bin"));
  REQUIRE(file.ok());
  CHECK(file->size() == r1["samples"].size());

  auto only = ring.ctl_json({"status", "--history", "--node", "node1"});
  CHECK(only.rc == 0);
  REQUIRE(only.j["ranks"].size() == 1);
  CHECK(only.j["ranks"][0]["rank"] == 1);
  auto bad = ring.ctl({"status", "--history", "--node", "node9"});
  CHECK(bad.rc == exit_code(Errc::usage));
  CHECK(bad.err.find("--node node9") != std::string::npos);

  auto table = ring.ctl({"status", "--history", "--width", "20"});
  CHECK_MESSAGE(table.rc == 0, table.all());
  CHECK(table.out.find("rank 0 on node0: ") != std::string::npos);
  CHECK(table.out.find("MemAvailable") != std::string::npos);
  CHECK(table.out.find("\u2581") != std::string::npos);  // a sparkline
  CHECK(table.out.find("LOST rank(s) 1") != std::string::npos);
  (void)ring.ctl({"stop"});
}
