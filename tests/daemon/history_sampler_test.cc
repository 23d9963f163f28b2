// sparkd's health history sampler (daemon/history_sampler.h) over a planted /proc: meminfo,
// PSI and the boot id are parsed into the sample; the thread writes every interval, poke()
// writes at once, stop() writes a last sample; a rank lost shows as an event.
#include "daemon/history_sampler.h"

#include <doctest/doctest.h>

#include <atomic>
#include <thread>

#include "cli/history_view.h"
#include "support/tempdir.h"

using namespace spark;
using namespace std::chrono_literals;

namespace {
void plant_proc(const test::TempDir& d) {
  d.write("proc/meminfo",
          "MemTotal:       130000000 kB\nMemFree:         2000000 kB\n"
          "MemAvailable:   50000000 kB\nCached:          40000000 kB\n");
  d.write("proc/pressure/memory",
          "some avg10=12.50 avg60=3.00 avg300=1.00 total=123\nfull avg10=4.25 avg60=1.00 "
          "avg300=0.50 total=45\n");
  d.write("proc/pressure/cpu", "some avg10=0.75 avg60=0.10 avg300=0.00 total=9\n");
  d.write("proc/pressure/io",
          "some avg10=2.00 avg60=0.00 avg300=0.00 total=1\nfull avg10=1.00 avg60=0 avg300=0 "
          "total=1\n");
  d.write("proc/sys/kernel/random/boot_id", "8c1e2d4f-0000-4a4a-9b9b-0123456789ab\n");
}
}  // namespace

TEST_CASE("history sampler: the node's part of a sample from /proc") {
  test::TempDir d("spark-sampler");
  plant_proc(d);
  daemon::SamplerOptions o;
  o.proc_root = d.path();
  o.rank = 1;
  o.world_size = 2;
  HealthSample s;
  daemon::sample_node(o, &s);
  CHECK(s.mem_available == int64_t{50000000} * 1024);
  CHECK(s.mem_free == int64_t{2000000} * 1024);
  CHECK(s.page_cache == int64_t{40000000} * 1024);
  CHECK(s.psi_mem_some == doctest::Approx(12.5));
  CHECK(s.psi_mem_full == doctest::Approx(4.25));
  CHECK(s.psi_cpu_some == doctest::Approx(0.75));
  CHECK(s.psi_io_some == doctest::Approx(2.0));
  CHECK(s.psi_io_full == doctest::Approx(1.0));
  CHECK(s.boot_id == "8c1e2d4f-0000-4a4a-9b9b-0123456789ab");
  CHECK(s.sm_clock_mhz == -1);  // no GPU asked for
  CHECK(s.rank == 1);
}

TEST_CASE("history sampler: interval, poke on a lost rank, a last sample at stop") {
  test::TempDir d("spark-sampler");
  plant_proc(d);
  daemon::SamplerOptions o;
  o.proc_root = d.path();
  o.path = d / "state/history/health-rank0.bin";
  o.capacity = 100;
  o.interval = 1h;  // only pokes and stop write after the first
  std::atomic<uint32_t> alive{3};
  std::atomic<double> tokens{0};
  daemon::HistorySampler hs(o, [&] {
    daemon::DaemonSample x;
    x.state = 2;
    x.ranks_alive = alive.load();
    x.generated_tokens = tokens.load();
    return x;
  });
  REQUIRE(hs.start().ok());
  for (int k = 0; k < 200 && hs.samples_written() < 1; ++k) std::this_thread::sleep_for(10ms);
  REQUIRE(hs.samples_written() == 1);
  alive = 1;  // rank 1 lost
  tokens = 500;
  hs.poke();
  for (int k = 0; k < 200 && hs.samples_written() < 2; ++k) std::this_thread::sleep_for(10ms);
  REQUIRE(hs.samples_written() == 2);
  hs.stop();
  auto h = read_history(o.path);
  REQUIRE(h.ok());
  REQUIRE(h->size() == 3);
  CHECK((*h)[0].ranks_alive == 3);
  CHECK((*h)[1].ranks_alive == 1);
  CHECK((*h)[1].tokens_per_s > 0);
  auto ev = cli::history_events(*h, 10000);
  bool lost = false;
  for (const auto& e : ev) lost = lost || e.find("LOST rank(s) 1") != std::string::npos;
  CHECK_MESSAGE(lost, "events: ", ev.size());
}
