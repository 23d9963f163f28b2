// A follower's timed-out wait names the rank that did not arrive: a worker waiting for rank
// 0's broadcast (the step plan) names rank 0, and every failed Gloo operation adds what the
// daemon's heartbeats know of missing ranks (GlooOptions::missing_ranks).
#include <doctest/doctest.h>

#include <thread>

#include "daemon/engine/gloo_collective.h"
#include "daemon/engine/tcp_store.h"
#include "support/gloo.h"

using namespace spark;
using namespace spark::engine;

TEST_CASE(
    "gloo: a follower whose broadcast from rank 0 times out names rank 0 and the "
    "heartbeats' missing ranks") {
  auto srv = start_rendezvous_store("127.0.0.1", 0);
  REQUIRE(srv.ok());
  const int port = (*srv)->port();
  std::shared_ptr<GlooCollective> g0;
  std::thread t0([&] {
    GlooOptions o = test::loopback_gloo(0, 2, port, 10000);
    auto g = GlooCollective::connect(o);
    if (g) g0 = *g;
  });
  GlooOptions o = test::loopback_gloo(1, 2, port, 400);
  o.rendezvous_timeout_ms = 10000;
  o.missing_ranks = [] { return std::string("rank 0 (spark-a): heartbeat silent 6.0 s"); };
  auto g1 = GlooCollective::connect(o);
  t0.join();
  REQUIRE_MESSAGE(g1.ok(), (g1.ok() ? std::string() : g1.error().message));
  REQUIRE(g0);
  // Rank 0 is alive but never sends the plan: rank 1's wait ends at its deadline.
  int64_t plan = 0;
  Status st = (*g1)->broadcast(&plan, sizeof(plan), 0);
  REQUIRE_FALSE(st.ok());
  INFO(st.message());
  CHECK(st.code() == Errc::network);
  CHECK(st.message().find("rank 1 of 2") != std::string::npos);
  CHECK(st.message().find("rank 0 did not arrive") != std::string::npos);
  CHECK(st.message().find("rank 0 (spark-a): heartbeat silent") != std::string::npos);
}
