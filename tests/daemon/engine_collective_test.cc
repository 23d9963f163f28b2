// Rendezvous store and Gloo collectives over loopback (threads in one process here; the
// two-process TP test is tests/e2e/engine_tp_test.cc).
#include <doctest/doctest.h>

#include <thread>

#include "daemon/engine/gloo_collective.h"
#include "daemon/engine/tcp_store.h"

using namespace spark;
using namespace spark::engine;
using namespace std::chrono_literals;

TEST_CASE("tcp store: set, get, wait with a deadline that names the missing keys") {
  auto srv = TcpStoreServer::start("127.0.0.1", 0);
  REQUIRE_MESSAGE(srv.ok(), (srv.ok() ? std::string() : srv.error().message));
  auto a = TcpStoreClient::connect("127.0.0.1", (*srv)->port(), 2000ms);
  auto b = TcpStoreClient::connect("127.0.0.1", (*srv)->port(), 2000ms);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  REQUIRE((*a)->set("k1", std::string("v\0x", 3)).ok());
  auto v = (*b)->try_get("k1");
  REQUIRE(v.ok());
  REQUIRE(v->has_value());
  CHECK(**v == std::string("v\0x", 3));
  auto none = (*b)->try_get("nope");
  REQUIRE(none.ok());
  CHECK_FALSE(none->has_value());
  auto w = (*b)->wait({"k1", "rank_1"}, 200ms);
  CHECK(w.code() == Errc::timeout);
  CHECK(w.message().find("rank_1") != std::string::npos);
  CHECK(w.message().find("k1") == std::string::npos);
  // Nobody listening: connect gives up at its deadline.
  auto port = (*srv)->port();
  srv->reset();
  auto gone = TcpStoreClient::connect("127.0.0.1", port, 200ms);
  REQUIRE_FALSE(gone.ok());
  CHECK(gone.error().code == Errc::timeout);
}

TEST_CASE("gloo: all_reduce, broadcast and barrier across three ranks over loopback") {
  auto srv = start_rendezvous_store("127.0.0.1", 0);
  REQUIRE(srv.ok());
  const int port = (*srv)->port();
  const int W = 3;
  std::vector<std::string> errors(W);
  std::vector<std::vector<float>> sums(W);
  std::vector<std::vector<uint8_t>> bc(W);
  std::vector<std::thread> ts;
  for (int r = 0; r < W; ++r)
    ts.emplace_back([&, r] {
      GlooOptions o;
      o.rank = r;
      o.world = W;
      o.store_port = port;
      o.timeout_ms = 10000;
      auto g = GlooCollective::connect(o);
      if (!g) {
        errors[static_cast<size_t>(r)] = g.error().message;
        return;
      }
      std::vector<float> x(1000);
      for (size_t i = 0; i < x.size(); ++i)
        x[i] = static_cast<float>(r + 1) * static_cast<float>(i);
      if (auto st = (*g)->all_reduce_sum(x.data(), x.size()); !st.ok())
        errors[static_cast<size_t>(r)] = st.message();
      sums[static_cast<size_t>(r)] = x;
      std::vector<uint8_t> b(17, static_cast<uint8_t>(r == 1 ? 42 : 0));
      if (auto st = (*g)->broadcast(b.data(), b.size(), 1); !st.ok())
        errors[static_cast<size_t>(r)] = st.message();
      bc[static_cast<size_t>(r)] = b;
      if (auto st = (*g)->barrier(); !st.ok()) errors[static_cast<size_t>(r)] = st.message();
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < W; ++r) {
    CAPTURE(r);
    CHECK(errors[static_cast<size_t>(r)] == "");
    REQUIRE(sums[static_cast<size_t>(r)].size() == 1000);
    CHECK(sums[static_cast<size_t>(r)][10] == 60.0f);  // (1+2+3) * 10
    CHECK(bc[static_cast<size_t>(r)] == std::vector<uint8_t>(17, 42));
  }
}

TEST_CASE("gloo: a rank that never joins is a timeout naming the missing key, not a hang") {
  auto srv = start_rendezvous_store("127.0.0.1", 0);
  REQUIRE(srv.ok());
  GlooOptions o;
  o.rank = 0;
  o.world = 2;
  o.store_port = (*srv)->port();
  o.timeout_ms = 500;
  auto g = GlooCollective::connect(o);
  REQUIRE_FALSE(g.ok());
  CHECK(g.error().message.find("not set within") != std::string::npos);
}
