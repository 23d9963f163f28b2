// Two real sparkd ranks, each in its own network namespace joined by a veth "fabric":
// rendezvous crosses the link to rank 0's fabric address; pulling the link (no FIN, no RST:
// silence) makes rank 0 declare the follower lost after HEARTBEAT_TIMEOUT, and the follower,
// which lost rank 0, exits by itself.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "core/http_client.h"
#include "support/netns.h"
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
}  // namespace

TEST_CASE("e2e netns ring: rendezvous over the fabric; a pulled link is a lost follower") {
  std::string why = test::netns_unavailable_reason();
  if (!why.empty()) {
    MESSAGE("SKIP: " << why);
    std::printf("SKIP: network namespaces unavailable: %s\n", why.c_str());
    return;
  }
  auto net = test::NetNs::create({});
  REQUIRE_MESSAGE(net.ok(), (net.ok() ? "" : net.error().message));
  test::TempDir dir("sparkd-netns");
  const int api_port = 18080, rdzv_port = 29551, engine_port = 18081;
  std::string cfg =
      dir.write("ring.env",
                "RING_NAME=netns\nMODEL=demo\nENGINE=exec\n"
                "ENGINE_EXEC='" FAULT_SERVER_BIN " --port " +
                    std::to_string(engine_port) +
                    " --mode healthy --watch-pid $SPARKD_PID'\n"
                    "ENGINE_HEALTH_URL=http://127.0.0.1:" +
                    std::to_string(engine_port) +
                    "/health\n"
                    "API_PORT=" +
                    std::to_string(api_port) + "\nRDZV_PORT=" + std::to_string(rdzv_port) +
                    "\nHEARTBEAT_INTERVAL=200ms\nHEARTBEAT_TIMEOUT=1500ms\nJOIN_TIMEOUT=20s\n"
                    "NODE0_NAME=a\nNODE0_SSH=local\nNODE0_FABRIC_IP=" +
                    (*net)->ip(0) +
                    "\nNODE1_NAME=b\nNODE1_SSH=host-b\nNODE1_FABRIC_IP=" + (*net)->ip(1) + "\n");
  auto start = [&](int rank) {
    return std::make_unique<test::Child>(
        std::vector<std::string>{"/usr/bin/env", "ip", "netns", "exec", (*net)->ns(rank),
                                 SPARKD_BIN, "--config", cfg, "--rank", std::to_string(rank),
                                 "--log-file", dir / ("sparkd-" + std::to_string(rank) + ".log")},
        std::map<std::string, std::string>{}, dir / ("out-" + std::to_string(rank) + ".txt"));
  };
  auto logs = [&] {
    return slurp(dir / "sparkd-0.log") + slurp(dir / "out-0.txt") + slurp(dir / "sparkd-1.log") +
           slurp(dir / "out-1.txt");
  };
  // /health of rank 0, asked from inside its namespace (it binds loopback there).
  auto health = [&]() -> std::optional<nlohmann::json> {
    std::optional<nlohmann::json> out;
    (void)(*net)->run_in(0, [&] {
      HttpCall c;
      c.port = api_port;
      c.target = "/health";
      c.timeout = 1000ms;
      auto r = http_call(c);
      if (r.ok()) out = nlohmann::json::parse(r->body);
    });
    return out;
  };
  auto wait_for = [&](auto pred, std::chrono::milliseconds limit) {
    auto end = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < end) {
      if (auto h = health(); h && pred(*h)) return true;
      std::this_thread::sleep_for(100ms);
    }
    return false;
  };

  auto r1 = start(1);  // the follower first: it waits for rank 0's store
  std::this_thread::sleep_for(300ms);
  auto r0 = start(0);
  REQUIRE_MESSAGE(wait_for([](auto& j) { return j["ready"] == true; }, 20s), logs());
  auto h = *health();
  CHECK(h["ranks_alive"] == 2);
  CHECK(h["ranks"][1]["node"] == "b");

  // Pull the cable on b's side: packets vanish, nothing is closed.
  auto down = (*net)->exec_in(1, "ip link set " + (*net)->ifname(0) + " down");
  REQUIRE(down.ok());
  REQUIRE(down->success());
  auto t0 = std::chrono::steady_clock::now();
  REQUIRE_MESSAGE(wait_for([](auto& j) { return j["fatal"] == true; }, 8s), logs());
  auto took = std::chrono::steady_clock::now() - t0;
  CHECK(took >= 1000ms);  // silence, not a closed connection: the timeout decides
  h = *health();
  CHECK(h["reason"].get<std::string>().find("rank 1 (node b) lost: no heartbeat") !=
        std::string::npos);
  // The follower lost rank 0 and exits by itself, non-zero.
  auto st = r1->wait_for(10s);
  REQUIRE_MESSAGE(st.has_value(), logs());
  CHECK(WIFEXITED(*st));
  CHECK(WEXITSTATUS(*st) == 6);  // exit_code(Errc::network)
  CHECK(slurp(dir / "sparkd-1.log").find("lost rank 0") != std::string::npos);

  r0->signal(SIGTERM);
  auto st0 = r0->wait_for(10s);
  REQUIRE(st0.has_value());
  CHECK(WEXITSTATUS(*st0) == 0);
}
