// A ring runs one TCP store: the engine's Gloo mesh meets through the daemon's rendezvous
// (rank 0's RendezvousServer, real loopback TCP) instead of a store of its own. Two ranks as
// threads; tests/e2e/ starts the real sparkd processes.
// clang-format off
#include <utility>  // before Asio: Boost 1.74 awaitable.hpp uses std::exchange
// clang-format on
#include <doctest/doctest.h>

#include <boost/asio.hpp>
#include <functional>
#include <mutex>
#include <set>
#include <thread>

#include "daemon/engine/random_checkpoint.h"
#include "daemon/engine/runtime.h"
#include "daemon/rendezvous.h"
#include "spark/version.h"
#include "support/tempdir.h"

using namespace spark;
using namespace std::chrono_literals;

namespace {
daemon::RankIdentity ident(int rank) {
  daemon::RankIdentity id;
  id.rank = rank;
  id.world_size = 2;
  id.node = rank ? "b" : "a";
  id.host = "host-" + id.node;
  id.pid = 1000 + rank;
  id.version = kVersion;
  id.config_digest = "cfg";
  return id;
}
}  // namespace

TEST_CASE("runtime: Gloo meets through the daemon's rendezvous; no second store is started") {
  boost::asio::io_context io;
  auto work = boost::asio::make_work_guard(io);
  daemon::RendezvousServer server(io, ident(0), {"a", "b"}, 5000ms);
  REQUIRE(server.listen("127.0.0.1", 0).ok());
  std::thread reactor([&] { io.run(); });
  struct Stop {  // also when a REQUIRE below fails: no joinable thread left behind
    std::function<void()> f;
    ~Stop() { f(); }
  } stop{[&] {
    server.close();
    work.reset();
    io.stop();
    if (reactor.joinable()) reactor.join();
  }};

  test::TempDir dir;
  auto cfg = engine::small_config(engine::Family::llama);
  REQUIRE(engine::write_random_checkpoint(dir.path(), {cfg, engine::DType::f32, 1, 1}).ok());

  std::mutex mu;
  std::set<std::string> keys;
  auto start = [&](int rank) -> Result<std::unique_ptr<engine::Runtime>> {
    auto client = std::make_shared<daemon::RendezvousClient>("127.0.0.1", server.port(),
                                                             "rank " + std::to_string(rank));
    SPARK_TRY(client->connect(2000ms));
    SPARK_TRY(client->join(ident(rank), 5000ms));
    engine::RuntimeOptions o;
    o.model_dir = dir.path();
    o.rank = rank;
    o.world = 2;
    o.timeout_ms = 20000;
    o.warmup = true;  // a real completion through both ranks
    // No share function and no store port: only the ring's store can connect them.
    o.store = std::make_shared<engine::FunctionStore>(
        [&, client](const std::string& k, const std::string& v) {
          {
            std::lock_guard lk(mu);
            keys.insert(k);
          }
          return client->set(k, v);
        },
        [client](const std::string& k, std::chrono::milliseconds t) { return client->get(k, t); });
    return engine::Runtime::start(o);  // the runtime keeps the store (and the client)
  };
  Result<std::unique_ptr<engine::Runtime>> r1 = Error{};
  std::thread t1([&] { r1 = start(1); });
  auto r0 = start(0);
  t1.join();
  REQUIRE_MESSAGE(r0.ok(), (r0.ok() ? std::string() : r0.error().message));
  REQUIRE_MESSAGE(r1.ok(), (r1.ok() ? std::string() : r1.error().message));
  CHECK((*r0)->status().ready);
  CHECK((*r1)->status().ready);
  {
    std::lock_guard lk(mu);
    CHECK(keys.size() >= 2);  // each rank published its mesh address through the rendezvous
    for (const auto& k : keys) CHECK(k.rfind("sparkd/", 0) == 0);
  }
  (*r0)->stop();
  (*r1)->stop();
  r0 = Error{};
  r1 = Error{};
}
