// Two real sparkd ranks on loopback, ENGINE=exec running the fault-injection server
// (spark_fault_server, a test fixture) as their engine: READY across the ring, a follower
// killed with SIGKILL -> rank 0 fatal within seconds, a hung follower engine -> stalled, a
// crashing engine -> fatal, SIGTERM -> exit 0 with the engine's process group gone.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "core/http_client.h"
#include "core/strings.h"
#include "daemon/process_group.h"
#include "support/spawn.h"
#include "support/tempdir.h"

using namespace spark;
using namespace std::chrono_literals;

namespace {

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct Ring {
  test::TempDir dir{"sparkd-ring"};
  int api_port = test::free_port();
  int rdzv_port = test::free_port();
  std::string cfg;
  std::vector<std::unique_ptr<test::Child>> ranks;

  explicit Ring(const std::string& extra = "") {
    cfg = dir.write("ring.env",
                    extra +
                        "RING_NAME=e2e\nMODEL=demo\nENGINE=exec\n"
                        "ENGINE_EXEC='" FAULT_SERVER_BIN
                        " --port $FAULT_PORT --mode $FAULT_MODE --after $FAULT_AFTER"
                        " --watch-pid $SPARKD_PID'\n"
                        "ENGINE_HEALTH_URL='http://127.0.0.1:${FAULT_PORT}/health'\n"
                        "HEARTBEAT_INTERVAL=200ms\nHEARTBEAT_TIMEOUT=1s\nSTALL_TIMEOUT=2s\n"
                        "JOIN_TIMEOUT=15s\nSHUTDOWN_GRACE=3s\n"
                        "NODE0_SSH=local\nNODE0_FABRIC_IP=127.0.0.1\nNODE0_GPUS=0,1\n");
  }
  ~Ring() {
    // Leftover engines of ranks killed by the test: their process groups are recorded.
    for (int r = 0; r < static_cast<int>(ranks.size()); ++r) {
      auto pg = read_file(pidfile(r) + ".engine");
      if (pg)
        if (auto p = parse_i64(trim(*pg)); p && *p > 0) ::kill(-static_cast<pid_t>(*p), SIGKILL);
    }
  }
  std::string pidfile(int r) const { return dir / ("run/sparkd-" + std::to_string(r) + ".pid"); }
  std::string logfile(int r) const { return dir / ("logs/sparkd-" + std::to_string(r) + ".log"); }

  void start(int rank, const std::string& mode, const std::string& after = "0s") {
    std::vector<std::string> argv = {SPARKD_BIN,
                                     "--config",
                                     cfg,
                                     "--rank",
                                     std::to_string(rank),
                                     "--rdzv-port",
                                     std::to_string(rdzv_port),
                                     "--pidfile",
                                     pidfile(rank),
                                     "--log-file",
                                     logfile(rank)};
    if (rank == 0) {
      argv.push_back("--port");
      argv.push_back(std::to_string(api_port));
    }
    ranks.push_back(std::make_unique<test::Child>(
        argv,
        std::map<std::string, std::string>{{"FAULT_PORT", std::to_string(test::free_port())},
                                           {"FAULT_MODE", mode},
                                           {"FAULT_AFTER", after}},
        dir / ("out-" + std::to_string(rank) + ".txt")));
  }

  std::optional<nlohmann::json> health() const {
    HttpCall c;
    c.port = static_cast<uint16_t>(api_port);
    c.target = "/health";
    c.timeout = 1000ms;
    auto r = http_call(c);
    if (!r.ok()) return std::nullopt;
    return nlohmann::json::parse(r->body);
  }

  template <typename Pred>
  bool wait_health(Pred p, std::chrono::milliseconds limit) const {
    auto end = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < end) {
      auto h = health();
      if (h && p(*h)) return true;
      std::this_thread::sleep_for(50ms);
    }
    return false;
  }

  std::string logs() const {
    std::string s;
    for (int r = 0; r < static_cast<int>(ranks.size()); ++r)
      s += "--- rank " + std::to_string(r) + "\n" + slurp(logfile(r)) +
           slurp(dir / ("out-" + std::to_string(r) + ".txt"));
    return s;
  }
};

}  // namespace

TEST_CASE("e2e ring: two ranks become READY; SIGKILL of the follower makes rank 0 fatal") {
  Ring ring("ENGINE_API_URL='http://127.0.0.1:${FAULT_PORT}'\nPROBE_EXPECT=Paris\n");
  ring.start(0, "healthy");
  ring.start(1, "slow-start", "1s");
  REQUIRE_MESSAGE(ring.wait_health([](auto& j) { return j["ready"] == true; }, 20s), ring.logs());
  auto h = *ring.health();
  CHECK(h["ranks_alive"] == 2);
  CHECK(h["world_size"] == 2);
  CHECK(h["engine"] == "exec");
  CHECK(h["ranks"][1]["state"] == "ready");
  CHECK(h["probe"]["status"] == "passed");
  CHECK(h["probe"]["text"] == " Paris.");

  ring.ranks[1]->signal(SIGKILL);
  REQUIRE_MESSAGE(ring.wait_health([](auto& j) { return j["fatal"] == true; }, 5s), ring.logs());
  h = *ring.health();
  CHECK(h["reason"].get<std::string>().find("rank 1") != std::string::npos);
  // What made it fatal: rank 0 declared the killed rank lost (its closed heartbeat connection
  // or HEARTBEAT_TIMEOUT of silence, whichever came first).
  CHECK(h["reason"].get<std::string>().find(" lost: ") != std::string::npos);
  CHECK(h["ranks_alive"] == 1);
  CHECK(h["ranks"][1]["alive"] == false);

  ring.ranks[0]->signal(SIGTERM);
  auto st = ring.ranks[0]->wait_for(10s);
  REQUIRE(st.has_value());
  CHECK(WIFEXITED(*st));
  CHECK(WEXITSTATUS(*st) == 0);
  CHECK_FALSE(std::filesystem::exists(ring.pidfile(0) + ".engine"));
}

TEST_CASE("e2e ring: a follower whose engine hangs makes rank 0 report stalled") {
  Ring ring;
  ring.start(0, "healthy");
  ring.start(1, "hang", "2s");
  REQUIRE_MESSAGE(ring.wait_health([](auto& j) { return j["ready"] == true; }, 20s), ring.logs());
  REQUIRE_MESSAGE(ring.wait_health([](auto& j) { return j["stalled"] == true; }, 15s), ring.logs());
  auto h = *ring.health();
  CHECK(h["reason"].get<std::string>().find("rank 1") != std::string::npos);
  CHECK(h["reason"].get<std::string>().find("stalled") != std::string::npos);
  for (auto& r : ring.ranks) r->signal(SIGTERM);
  for (auto& r : ring.ranks) {
    auto st = r->wait_for(10s);
    REQUIRE(st.has_value());
    CHECK(WEXITSTATUS(*st) == 0);
  }
}

TEST_CASE("e2e ring: an engine that crashes on rank 0 makes the ring fatal with its exit status") {
  Ring ring;
  ring.start(0, "crash", "1500ms");
  ring.start(1, "healthy");
  REQUIRE_MESSAGE(ring.wait_health([](auto& j) { return j["fatal"] == true; }, 20s), ring.logs());
  auto h = *ring.health();
  CHECK(h["reason"].get<std::string>().find("exited with status 3") != std::string::npos);
}

TEST_CASE("e2e ring: a probe completion without the expected text keeps the ring not ready") {
  Ring ring("ENGINE_API_URL='http://127.0.0.1:${FAULT_PORT}'\nPROBE_EXPECT=London\n");
  ring.start(0, "healthy");
  ring.start(1, "healthy");
  REQUIRE_MESSAGE(ring.wait_health(
                      [](auto& j) {
                        return j.value("reason", "").find("PROBE_EXPECT 'London'") !=
                               std::string::npos;
                      },
                      20s),
                  ring.logs());
  auto h = *ring.health();
  CHECK(h["ready"] == false);
  CHECK(h["fatal"] == false);
  CHECK(h["probe"]["status"] == "failed");
  CHECK(h["probe"]["text"] == " Paris.");
}
