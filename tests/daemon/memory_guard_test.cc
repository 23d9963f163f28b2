// The memory guard against a fixture /proc/meminfo the test rewrites.
#include "daemon/memory_guard.h"

#include <doctest/doctest.h>

#include <future>
#include <thread>

#include "daemon/metrics.h"
#include "support/tempdir.h"

using namespace spark;
using namespace spark::daemon;
using namespace std::chrono_literals;

namespace {
struct FakeNode {
  test::TempDir root{"memguard"};
  void set_available(uint64_t mib) {
    root.write("proc/meminfo",
               "MemTotal:       131072000 kB\nMemFree:         1000000 kB\n"
               "MemAvailable:   " +
                   std::to_string(mib * 1024) + " kB\n");
  }
};
constexpr uint64_t MiB = 1ull << 20;
}  // namespace

TEST_CASE("memory guard: requests wait under the wait floor and go when memory returns") {
  FakeNode node;
  node.set_available(8000);
  Metrics m("demo");
  MemoryGuard g({4000 * MiB, 2000 * MiB, 5000ms, node.root.path()}, &m);
  g.sample();
  CHECK(g.available() == 8000 * MiB);
  CHECK(g.admit().ok());
  CHECK(m.value("sparkd_mem_guard_waits_total") == 0);

  node.set_available(3000);
  g.sample();
  CHECK(g.under_wait_floor());
  auto waiting = std::async(std::launch::async, [&] { return g.admit(); });
  CHECK(waiting.wait_for(200ms) == std::future_status::timeout);  // held back
  node.set_available(6000);
  g.sample();
  REQUIRE(waiting.wait_for(2s) == std::future_status::ready);
  CHECK(waiting.get().ok());
  CHECK(m.value("sparkd_mem_guard_waits_total") == 1);
  CHECK(m.value("sparkd_mem_available_bytes") == 6000.0 * MiB);
}

TEST_CASE("memory guard: a request held past the max wait fails with a resource error") {
  FakeNode node;
  node.set_available(1000);
  MemoryGuard g({4000 * MiB, 0, 300ms, node.root.path()}, nullptr);
  g.sample();
  auto t0 = std::chrono::steady_clock::now();
  Status st = g.admit();
  CHECK(std::chrono::steady_clock::now() - t0 >= 300ms);
  REQUIRE_FALSE(st.ok());
  CHECK(st.code() == Errc::resource);
  CHECK(http_status(st.code()) == 429);
  CHECK(st.message().find("MEM_GUARD_WAIT") != std::string::npos);
}

TEST_CASE("memory guard: under the cancel floor the newest request is cancelled, and counted") {
  FakeNode node;
  node.set_available(5000);
  Metrics m("demo");
  MemoryGuard g({4000 * MiB, 2000 * MiB, 1000ms, node.root.path()}, &m);
  std::vector<std::string> cancelled;
  g.set_cancel_hook([&](const std::string& why) {
    cancelled.push_back(why);
    return true;
  });
  g.sample();
  CHECK(cancelled.empty());
  node.set_available(1500);
  g.sample();
  REQUIRE(cancelled.size() == 1);
  CHECK(cancelled[0].find("MEM_GUARD_CANCEL") != std::string::npos);
  CHECK(m.value("sparkd_mem_guard_cancels_total") == 1);
  // A hook with nothing to cancel is not counted.
  g.set_cancel_hook([](const std::string&) { return false; });
  g.sample();
  CHECK(m.value("sparkd_mem_guard_cancels_total") == 1);
}

TEST_CASE("memory guard: floors of 0 turn it off") {
  FakeNode node;
  node.set_available(10);
  MemoryGuard g({0, 0, 100ms, node.root.path()}, nullptr);
  g.sample();
  CHECK_FALSE(g.under_wait_floor());
  CHECK(g.admit().ok());
}
