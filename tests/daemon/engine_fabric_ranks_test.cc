// Every rank's fabric self-test report reaches rank 0 (for /health's fabric_ranks and
// `sparkctl status`) through the ring's store; a rank that never publishes, or publishes
// junk, is left out within the timeout instead of blocking rank 0.
#include <doctest/doctest.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <thread>

#include "daemon/engine/runtime.h"

using namespace spark;
using namespace spark::engine;
using namespace std::chrono_literals;

namespace {
// The ring's store reduced to a map with blocking gets (the daemon's rendezvous behaves so).
struct MapStore {
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::string, std::string> kv;
  std::shared_ptr<RendezvousStore> store() {
    return std::make_shared<FunctionStore>(
        [this](const std::string& k, const std::string& v) {
          std::lock_guard lk(mu);
          kv[k] = v;
          cv.notify_all();
          return Status::Ok();
        },
        [this](const std::string& k, std::chrono::milliseconds t) -> Result<std::string> {
          std::unique_lock lk(mu);
          if (!cv.wait_for(lk, t, [&] { return kv.count(k) > 0; }))
            return make_error(Errc::timeout, k + " not set");
          return kv[k];
        });
  }
};

FabricReport report(int rank, int world) {
  FabricReport r;
  r.rank = rank;
  r.world = world;
  r.node = "node-" + std::to_string(rank);
  r.decode_latency_us_8k = 10.0 + rank;
  if (rank == 1) r.failures.push_back("rank 1: 3 wrong values");
  return r;
}
}  // namespace

TEST_CASE(
    "fabric reports: rank 0 collects every rank's, in rank order; a missing one is left "
    "out") {
  MapStore m;
  auto store = m.store();
  std::vector<FabricReport> got1, got2;
  std::thread t2([&] {
    std::this_thread::sleep_for(50ms);  // publishes after rank 0 started waiting
    got2 = exchange_fabric_reports(*store, report(2, 3), 2, 3, 2000ms);
  });
  std::thread t1([&] { got1 = exchange_fabric_reports(*store, report(1, 3), 1, 3, 2000ms); });
  auto all = exchange_fabric_reports(*store, report(0, 3), 0, 3, 2000ms);
  t1.join();
  t2.join();
  CHECK(got1.empty());
  CHECK(got2.empty());
  REQUIRE(all.size() == 3);
  for (int r = 0; r < 3; ++r) {
    CHECK(all[static_cast<size_t>(r)].rank == r);
    CHECK(all[static_cast<size_t>(r)].node == "node-" + std::to_string(r));
  }
  CHECK_FALSE(all[1].passed());  // a failed rank's figures travel too
  CHECK(all[2].decode_latency_us_8k == 12.0);

  MapStore m2;
  auto s2 = m2.store();
  REQUIRE(s2->set("engine.fabric.rank2", "not json").ok());
  auto partial = exchange_fabric_reports(*s2, report(0, 3), 0, 3, 200ms);  // rank 1 silent
  REQUIRE(partial.size() == 1);
  CHECK(partial[0].rank == 0);
}
