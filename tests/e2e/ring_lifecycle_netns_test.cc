// The ring's lifecycle end to end with 2-4 ranks, each rank in its own network namespace
// behind a real sshd, driven by sparkctl in a head namespace outside the ring (the fixture:
// tests/support/netns_ring.h). Every rank's engine is the fault-injection server
// (spark_fault_server, a test fixture) under ENGINE=exec. The scenarios: start -> READY;
// stop -> nothing left in any namespace, watch does nothing; kill -9 of a follower -> fatal
// within seconds -> watch restarts the ring on the third failed check; a hung follower ->
// stalled -> restart; a rank with a different config digest -> start refused naming it;
// twenty concurrent watches -> one restart; restart cap -> GAVE_UP.
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>

#include "core/error.h"
#include "core/strings.h"
#include "support/netns_ring.h"
#include "support/ring.h"
#include "support/spawn.h"

using namespace spark;
using namespace std::chrono_literals;
using nlohmann::json;
using test::NetnsRing;
using test::pid_alive;

namespace {

// The ring, or nullptr after printing why this machine cannot build one (the test skips).
std::unique_ptr<NetnsRing> make_ring(int ranks) {
  if (auto why = test::ring_unavailable_reason(); !why.empty()) {
    MESSAGE("SKIP: " << why);
    std::printf("SKIP: %s\n", why.c_str());
    return nullptr;
  }
  auto r = NetnsRing::create({.ranks = ranks,
                              .sparkctl_bin = SPARKCTL_BIN,
                              .sparkd_bin = SPARKD_BIN,
                              .fault_server_bin = FAULT_SERVER_BIN});
  REQUIRE_MESSAGE(r.ok(), (r.ok() ? "" : r.error().message));
  return std::move(*r);
}

std::vector<int> pids_of(const json& start) {
  std::vector<int> v;
  for (const auto& r : start["ranks"]) v.push_back(r.value("pid", 0));
  return v;
}

bool contains(const std::vector<int>& v, int x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

std::string joined(const std::vector<std::string>& v) {
  return join(v, "\n");
}

// Every rank runs exactly one sparkd, inside its own namespace, and it is `pids[k]` when
// given: a restart left no second copy behind and launched each rank on its own node.
void check_one_sparkd_per_namespace(const NetnsRing& ring, const std::vector<int>& pids = {}) {
  for (int k = 0; k < ring.ranks(); ++k) {
    auto in_ns = ring.sparkd_pids(k);
    CHECK_MESSAGE(in_ns.size() == 1, "rank ", k, " (", ring.rank_ns(k), ") runs ", in_ns.size(),
                  " sparkd processes");
    if (!pids.empty() && !in_ns.empty())
      CHECK_MESSAGE(contains(in_ns, pids[static_cast<size_t>(k)]), "rank ", k, "'s sparkd pid ",
                    pids[static_cast<size_t>(k)], " is not in ", ring.rank_ns(k));
  }
}

int incident_count(const NetnsRing& ring) {
  std::error_code ec;
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(ring.state("incidents"), ec)) {
    (void)e;
    ++n;
  }
  return n;
}

}  // namespace

TEST_CASE(
    "e2e netns ring (4 ranks): start -> READY over SSH, status, logs; stop leaves nothing in any "
    "namespace and watch does nothing") {
  auto ring = make_ring(4);
  if (!ring) return;
  auto s = ring->ctl_json({"start"});
  REQUIRE_MESSAGE(s.rc == 0, s.all(), ring->logs());
  CHECK(s.j["ready"] == true);
  CHECK(s.j["endpoint"] == fmt::format("http://127.0.0.1:{}", NetnsRing::kApiPort));
  auto pids = pids_of(s.j);
  REQUIRE(pids.size() == 4);
  for (int p : pids) CHECK(pid_alive(p));
  check_one_sparkd_per_namespace(*ring, pids);
  // The launch's SSH session is gone; a follower's sparkd leads its own session (setsid), so
  // closing the session did not take it along.
  auto stat = read_file(fmt::format("/proc/{}/stat", pids[3])).value_or("");
  auto fields = split_list(stat.substr(stat.rfind(')') + 2), ' ');
  REQUIRE(fields.size() > 4);
  CHECK(fields[3] == std::to_string(pids[3]));  // session id == its pid

  auto h = ring->health();
  REQUIRE(h);
  CHECK((*h)["ready"] == true);
  CHECK((*h)["ranks_alive"] == 4);
  CHECK((*h)["ranks"][3]["node"] == "node3");
  // READY came after a real completion from rank 0's engine (the daemon's probe).
  CHECK((*h)["probe"]["status"] == "passed");
  // The preflight step ran over SSH (fail-closed) and the memory gate passed.
  bool preflight = false, memory = false;
  for (const auto& st : s.j["steps"]) {
    if (st["step"] == "preflight")
      preflight =
          st["ok"] == true && st["detail"].get<std::string>().find("SKIPPED") == std::string::npos;
    if (st["step"] == "memory") memory = st["ok"] == true;
  }
  CHECK(preflight);
  CHECK(memory);

  // status reads rank 0's /health on node 0 over SSH (sparkctl health-get there).
  auto st = ring->ctl_json({"status"});
  CHECK_MESSAGE(st.rc == 0, st.all());
  CHECK(st.j["ready"] == true);
  CHECK(st.j["answered"] == true);
  REQUIRE(st.j["ranks"].size() == 4);
  for (int k = 0; k < 4; ++k) {
    CHECK(st.j["ranks"][k]["state"] == "ready");
    CHECK(st.j["ranks"][k]["alive"] == true);
    CHECK(st.j["ranks"][k]["pid"] == pids[static_cast<size_t>(k)]);
  }
  CHECK(st.j["nodes"][2]["mem_free"].get<int64_t>() > 0);
  CHECK(st.j["disabled"].is_null());
  auto table = ring->ctl({"status"});
  CHECK(table.rc == 0);
  CHECK(table.out.find("READY: yes") != std::string::npos);

  auto lg = ring->ctl({"logs", "--rank", "3", "-n", "200"});
  CHECK_MESSAGE(lg.rc == 0, lg.all());
  CHECK(lg.out.find("joined the ring") != std::string::npos);
  auto follow = ring->ctl({"logs", "--rank", "0", "-f", "--for", "1s", "-n", "5"});
  CHECK_MESSAGE(follow.rc == 0, follow.all());
  CHECK_FALSE(follow.out.empty());

  // A second start on a running ring is refused, naming what runs.
  auto again = ring->ctl({"start"});
  CHECK(again.rc == exit_code(Errc::busy));
  CHECK_MESSAGE(again.err.find("already runs") != std::string::npos, again.all());
  check_one_sparkd_per_namespace(*ring, pids);

  auto stop = ring->ctl_json({"stop"});
  REQUIRE_MESSAGE(stop.rc == 0, stop.all());
  CHECK(stop.j["clean"] == true);
  for (int k = 0; k < 4; ++k) CHECK(stop.j["ranks"][k]["how"] == "sigterm");
  for (int p : pids) CHECK_MESSAGE(!pid_alive(p), "sparkd pid ", p, " still runs");
  auto left = ring->leftovers();
  CHECK_MESSAGE(left.empty(), joined(left));
  CHECK(std::filesystem::exists(ring->state("DISABLED")));

  // watch sees the DISABLED marker and does nothing: nothing starts in any namespace.
  auto w = ring->ctl_json({"watch"});
  CHECK_MESSAGE(w.rc == 0, w.all());
  CHECK(w.j["verdict"] == "disabled");
  left = ring->leftovers();
  CHECK_MESSAGE(left.empty(), joined(left));
  auto down = ring->ctl_json({"status"});
  CHECK(down.rc == exit_code(Errc::precondition));
  CHECK(down.j["ready"] == false);
  for (int k = 0; k < 4; ++k) CHECK(down.j["ranks"][k]["state"] == "down");
  CHECK_FALSE(down.j["disabled"].is_null());

  // restart leaves no marker and brings all four ranks back.
  auto rs = ring->ctl_json({"restart"});
  REQUIRE_MESSAGE(rs.rc == 0, rs.all(), ring->logs());
  CHECK_FALSE(std::filesystem::exists(ring->state("DISABLED")));
  check_one_sparkd_per_namespace(*ring, pids_of(rs.j));

  // In text, restart shows what its stop half did before the start half's steps.
  auto rt = ring->ctl({"restart"});
  REQUIRE_MESSAGE(rt.rc == 0, rt.all(), ring->logs());
  const std::regex step_re(R"(^\S+\s+(ok|FAIL)\s+[0-9.]+ s  )");
  int line_no = 0, stop_line = -1, first_step = -1;
  std::istringstream lines(rt.out);
  for (std::string l; std::getline(lines, l); ++line_no) {
    if (stop_line < 0 && l.find("nothing of the ring is left on any node") != std::string::npos)
      stop_line = line_no;
    if (first_step < 0 && std::regex_search(l, step_re)) first_step = line_no;
  }
  CHECK_MESSAGE(stop_line >= 0, rt.out);
  CHECK_MESSAGE(first_step >= 0, rt.out);
  CHECK_MESSAGE(stop_line < first_step, rt.out);
  CHECK_MESSAGE(rt.out.find("READY:") != std::string::npos, rt.out);
}

TEST_CASE(
    "e2e netns ring (3 ranks): kill -9 of a follower -> fatal within seconds -> watch restarts "
    "the ring on the third failed check") {
  auto ring = make_ring(3);
  if (!ring) return;
  auto s = ring->ctl_json({"start"});
  REQUIRE_MESSAGE(s.rc == 0, s.all(), ring->logs());
  auto pids = pids_of(s.j);
  REQUIRE(pids.size() == 3);
  REQUIRE(::kill(pids[2], SIGKILL) == 0);
  REQUIRE_MESSAGE(ring->wait_health([](const json& h) { return h["fatal"] == true; }, 5s),
                  ring->logs());
  auto h = ring->health().value_or(json::object());
  CHECK_MESSAGE(h.value("reason", "").find("rank 2") != std::string::npos, h.dump());
  // What made it fatal: rank 0 declared the killed rank lost (its closed heartbeat connection
  // or HEARTBEAT_TIMEOUT of silence, whichever came first).
  CHECK_MESSAGE(h.value("reason", "").find("rank 2 (node node2) lost: ") != std::string::npos,
                h.dump());

  auto w1 = ring->ctl_json({"watch"});
  CHECK_MESSAGE(w1.j["verdict"] == "unhealthy", w1.all());
  CHECK(w1.j["failures"] == 1);
  CHECK(w1.j["reason"].get<std::string>().find("rank 2") != std::string::npos);
  auto w2 = ring->ctl_json({"watch"});
  CHECK_MESSAGE(w2.j["verdict"] == "unhealthy", w2.all());
  CHECK(w2.j["failures"] == 2);
  CHECK(pid_alive(pids[0]));  // not restarted yet
  CHECK(pid_alive(pids[1]));
  auto w3 = ring->ctl_json({"watch"});
  REQUIRE_MESSAGE(w3.j["verdict"] == "restarted", w3.all(), ring->logs());
  CHECK(w3.rc == 0);
  for (int p : pids) CHECK_MESSAGE(!pid_alive(p), "old sparkd pid ", p, " still runs");
  // The tail of every rank's log was saved (over SSH) before the restart.
  std::string inc = w3.j["incident_dir"];
  for (int k = 0; k < 3; ++k) CHECK(std::filesystem::exists(inc + fmt::format("/rank{}.log", k)));
  CHECK(read_file(inc + "/rank0.log").value_or("").find("rank 2") != std::string::npos);
  CHECK(ring->alerts().find("healed") != std::string::npos);
  auto st = ring->ctl_json({"status"});
  CHECK_MESSAGE(st.rc == 0, st.all());
  auto now = pids_of(st.j);
  REQUIRE(now.size() == 3);
  for (int k = 0; k < 3; ++k) CHECK(now[static_cast<size_t>(k)] != pids[static_cast<size_t>(k)]);
  check_one_sparkd_per_namespace(*ring, now);
  CHECK(st.j["restarts_in_window"] == 1);
  CHECK(st.j["watch"]["last_verdict"] == "restarted");
  auto w4 = ring->ctl_json({"watch"});
  CHECK_MESSAGE(w4.j["verdict"] == "healthy", w4.all());
  CHECK(w4.j["failures"] == 0);
}

TEST_CASE(
    "e2e netns ring (2 ranks): a hung follower engine -> stalled -> watch restarts the ring") {
  auto ring = make_ring(2);
  if (!ring) return;
  ring->env["WATCH_FAILURES"] = "1";
  // Rank 1's engine stops answering /health 4 s after it started: after READY (under a
  // second after the engines start here), with room for a loaded machine.
  ring->fault_once(1, "hang", "4s");
  auto s = ring->ctl_json({"start"});
  REQUIRE_MESSAGE(s.rc == 0, s.all(), ring->logs());
  auto pids = pids_of(s.j);
  REQUIRE_MESSAGE(ring->wait_health([](const json& h) { return h["stalled"] == true; }, 15s),
                  ring->logs());
  auto h = ring->health().value_or(json::object());
  CHECK_MESSAGE(h.value("reason", "").find("rank 1") != std::string::npos, h.dump());
  auto st = ring->ctl_json({"status"});
  CHECK(st.rc != 0);
  CHECK(st.j["state"] == "stalled");
  auto w = ring->ctl_json({"watch"});
  REQUIRE_MESSAGE(w.j["verdict"] == "restarted", w.all(), ring->logs());
  CHECK(w.j["reason"].get<std::string>().find("stalled") != std::string::npos);
  for (int p : pids) CHECK_MESSAGE(!pid_alive(p), "old sparkd pid ", p, " still runs");
  CHECK(ring->health().value_or(json::object())["ready"] == true);
  auto st2 = ring->ctl_json({"status"});
  CHECK_MESSAGE(st2.rc == 0, st2.all());
  check_one_sparkd_per_namespace(*ring, pids_of(st2.j));
}

TEST_CASE(
    "e2e netns ring (3 ranks): a rank with a different config digest is refused at start, "
    "naming it; nothing is left in any namespace") {
  auto ring = make_ring(3);
  if (!ring) return;
  // A node whose environment overrides a key (FAULT INJECTION: a wrapper around sparkd that
  // changes SLOTS for rank 2 only).
  std::string wrapper = ring->dir().write(
      "sparkd-wrapper.sh",
      fmt::format("#!/bin/sh\ncase \" $* \" in *\" --rank 2 \"*) export SLOTS=99;; esac\n"
                  "exec {} \"$@\"\n",
                  SPARKD_BIN));
  ::chmod(wrapper.c_str(), 0755);
  ring->env["SPARKD_BIN"] = wrapper;
  ring->env["START_RETRIES"] = "1";  // the whole start is tried again, and fails again
  auto s = ring->ctl_json({"start"});
  CHECK_MESSAGE(s.rc == exit_code(Errc::remote), s.all());
  CHECK(s.j["attempts"] == 2);
  std::string msg =
      s.j.is_object() ? s.j.value(json::json_pointer("/error/message"), std::string()) : "";
  CHECK_MESSAGE(msg.find("rank 2") != std::string::npos, msg);
  CHECK_MESSAGE(msg.find("node2") != std::string::npos, msg);
  CHECK_MESSAGE(msg.find("config_digest") != std::string::npos, msg);
  // Only rank 2 differs: no other rank is blamed.
  CHECK_MESSAGE(msg.find("rank 1") == std::string::npos, msg);
  bool teardown = false;
  for (const auto& st : s.j["steps"])
    if (st["step"] == "teardown") teardown = st["ok"] == true;
  CHECK(teardown);
  for (int p : pids_of(s.j)) CHECK_MESSAGE(!pid_alive(p), "sparkd pid ", p, " still runs");
  auto left = ring->leftovers();
  CHECK_MESSAGE(left.empty(), joined(left));
}

TEST_CASE(
    "e2e netns ring (3 ranks): twenty concurrent watches on an unhealthy ring cause exactly one "
    "restart") {
  auto ring = make_ring(3);
  if (!ring) return;
  ring->env["WATCH_FAILURES"] = "1";
  auto s = ring->ctl_json({"start"});
  REQUIRE_MESSAGE(s.rc == 0, s.all(), ring->logs());
  auto pids = pids_of(s.j);
  REQUIRE(::kill(pids[1], SIGKILL) == 0);
  REQUIRE(ring->wait_health([](const json& h) { return h["fatal"] == true; }, 5s));
  std::vector<std::unique_ptr<test::Child>> watches;
  for (int i = 0; i < 20; ++i)
    watches.push_back(std::make_unique<test::Child>(ring->sparkctl_argv({"--json", "watch"}),
                                                    ring->env,
                                                    ring->dir() / fmt::format("watch-{}.json", i)));
  int restarted = 0, busy = 0;
  std::string verdicts;
  for (int i = 0; i < 20; ++i) {
    auto st = watches[static_cast<size_t>(i)]->wait_for(120s);
    REQUIRE_MESSAGE(st.has_value(), "watch ", i, " did not finish within 120 s");
    std::string out = read_file(ring->dir() / fmt::format("watch-{}.json", i)).value_or("");
    auto j = json::parse(out, nullptr, false);
    REQUIRE_MESSAGE(j.is_object(), "watch ", i, ": ", out);
    verdicts += j.value("verdict", "?") + " ";
    if (j["verdict"] == "restarted") ++restarted;
    if (j["verdict"] == "busy") ++busy;
  }
  CHECK_MESSAGE(restarted == 1, verdicts);
  CHECK_MESSAGE(busy >= 1, verdicts);
  CHECK(ring->watch_record()["restarts_ms"].size() == 1);
  CHECK(incident_count(*ring) == 1);
  auto st = ring->ctl_json({"status"});
  CHECK_MESSAGE(st.rc == 0, st.all());
  check_one_sparkd_per_namespace(*ring, pids_of(st.j));
}

TEST_CASE(
    "e2e netns ring (2 ranks): the restart cap writes GAVE_UP, alerts, and stops restarting "
    "until a manual start") {
  auto ring = make_ring(2);
  if (!ring) return;
  ring->env["WATCH_FAILURES"] = "1";
  ring->env["WATCH_MAX_RESTARTS"] = "1";
  auto s = ring->ctl_json({"start"});
  REQUIRE_MESSAGE(s.rc == 0, s.all(), ring->logs());
  ::kill(pids_of(s.j)[1], SIGKILL);
  REQUIRE(ring->wait_health([](const json& h) { return h["fatal"] == true; }, 5s));
  auto w1 = ring->ctl_json({"watch"});
  REQUIRE_MESSAGE(w1.j["verdict"] == "restarted", w1.all());
  auto st = ring->ctl_json({"status"});
  int rank0 = st.j["ranks"][0]["pid"];
  ::kill(st.j["ranks"][1]["pid"].get<int>(), SIGKILL);
  REQUIRE(ring->wait_health([](const json& h) { return h["fatal"] == true; }, 5s));
  // Under the cap but inside the backoff after the last restart: counted, not restarted.
  ring->env["WATCH_MAX_RESTARTS"] = "3";
  ring->env["WATCH_BACKOFF"] = "1h";
  auto wb = ring->ctl_json({"watch"});
  CHECK_MESSAGE(wb.j["verdict"] == "backoff", wb.all());
  CHECK(wb.j["reason"].get<std::string>().find("next restart allowed in") != std::string::npos);
  CHECK(pid_alive(rank0));
  ring->env["WATCH_MAX_RESTARTS"] = "1";
  ring->env["WATCH_BACKOFF"] = "0s";
  auto w2 = ring->ctl_json({"watch"});
  CHECK_MESSAGE(w2.j["verdict"] == "gave_up", w2.all());
  CHECK(w2.rc == exit_code(Errc::precondition));
  CHECK(std::filesystem::exists(ring->state("GAVE_UP")));
  CHECK(ring->alerts().find("gave_up") != std::string::npos);
  auto w3 = ring->ctl_json({"watch"});
  CHECK(w3.j["verdict"] == "gave_up");
  CHECK(pid_alive(rank0));  // no restart happened
  CHECK(incident_count(*ring) == 1);
  auto stt = ring->ctl_json({"status"});
  CHECK_FALSE(stt.j["gave_up"].is_null());
  // A manual restart clears GAVE_UP and the window.
  auto rs = ring->ctl_json({"restart"});
  REQUIRE_MESSAGE(rs.rc == 0, rs.all());
  CHECK_FALSE(std::filesystem::exists(ring->state("GAVE_UP")));
  CHECK(ring->watch_record()["restarts_ms"].empty());
  check_one_sparkd_per_namespace(*ring, pids_of(rs.j));
}
