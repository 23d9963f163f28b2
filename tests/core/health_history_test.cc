// The health history file (core/health_history.h): ring order and wrap-around, a torn last
// record, a writer that restarts, a file of another capacity, and a writer killed with
// SIGKILL mid-stream (every sample whose write returned is there).
#include "core/health_history.h"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>

#include "support/tempdir.h"

using namespace spark;

namespace {
HealthSample sample(int64_t t) {
  HealthSample s;
  s.time_ms = t;
  s.boot_id = "0123abcd-4567-89ab-cdef-0123456789ab";
  s.rank = 1;
  s.world_size = 2;
  s.mem_available = t * 1000;
  s.psi_mem_some = 1.5;
  s.sm_clock_mhz = 1980;
  s.throttle_reasons = 0x4;
  s.ranks_alive = 3;
  s.state = 2;
  s.reason = "a reason";
  return s;
}
}  // namespace

TEST_CASE("health history: samples round-trip, wrap around the ring, and come back in order") {
  test::TempDir dir("spark-hist");
  std::string path = dir / "h/rank1.bin";
  {
    HistoryWriter w;
    REQUIRE(w.open(path, 5).ok());
    for (int k = 1; k <= 12; ++k) {
      auto s = sample(k);
      REQUIRE(w.append(s).ok());
      CHECK(s.seq == static_cast<uint64_t>(k));
    }
  }
  CHECK(std::filesystem::file_size(path) == 6 * kHistoryRecordSize);  // bounded
  auto h = read_history(path);
  REQUIRE(h.ok());
  REQUIRE(h->size() == 5);
  CHECK(h->front().seq == 8);
  CHECK(h->back().seq == 12);
  CHECK(h->back().time_ms == 12);
  CHECK(h->back().boot_id == "0123abcd-4567-89ab-cdef-0123456789ab");
  CHECK(h->back().mem_available == 12000);
  CHECK(h->back().psi_mem_some == doctest::Approx(1.5));
  CHECK(h->back().throttle_reasons == 0x4);
  CHECK(h->back().reason == "a reason");
  CHECK(h->back().mem_free == -1);  // unknown stays unknown

  // A restarted writer goes on after the newest sample.
  {
    HistoryWriter w;
    REQUIRE(w.open(path, 5).ok());
    CHECK(w.last_seq() == 12);
    auto s = sample(13);
    REQUIRE(w.append(s).ok());
    CHECK(s.seq == 13);
  }
  h = read_history(path);
  REQUIRE(h.ok());
  CHECK(h->back().seq == 13);
  CHECK(h->front().seq == 9);

  // A torn write (power cut mid-record) spoils only that record.
  {
    int fd = ::open(path.c_str(), O_WRONLY);
    REQUIRE(fd >= 0);
    off_t slot13 = static_cast<off_t>((1 + (13 - 1) % 5) * kHistoryRecordSize);
    char junk[40] = {};
    REQUIRE(::pwrite(fd, junk, sizeof junk, slot13 + 100) == sizeof junk);
    ::close(fd);
  }
  h = read_history(path);
  REQUIRE(h.ok());
  REQUIRE(h->size() == 4);
  CHECK(h->back().seq == 12);
  // ... and the writer goes on after the last good one.
  {
    HistoryWriter w;
    REQUIRE(w.open(path, 5).ok());
    CHECK(w.last_seq() == 12);
  }
}

TEST_CASE("health history: another capacity or a foreign file is kept aside, not overwritten") {
  test::TempDir dir("spark-hist");
  std::string path = dir / "rank0.bin";
  {
    HistoryWriter w;
    REQUIRE(w.open(path, 4).ok());
    auto s = sample(1);
    REQUIRE(w.append(s).ok());
  }
  {
    HistoryWriter w;
    REQUIRE(w.open(path, 8).ok());
    CHECK(w.last_seq() == 0);
  }
  CHECK(std::filesystem::exists(path + ".old"));
  CHECK(read_history(path + ".old")->size() == 1);
  dir.write("foreign.bin", std::string(600, 'x'));
  auto bad = read_history(dir / "foreign.bin");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.error().code == Errc::integrity);
  auto none = read_history(dir / "absent.bin");
  REQUIRE_FALSE(none.ok());
  CHECK(none.error().code == Errc::not_found);
}

TEST_CASE("health history: a writer killed with SIGKILL loses nothing it reported written") {
  test::TempDir dir("spark-hist");
  std::string path = dir / "rank0.bin";
  int pipefd[2];
  REQUIRE(::pipe(pipefd) == 0);
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::close(pipefd[0]);
    HistoryWriter w;
    if (!w.open(path, 64).ok()) ::_exit(2);
    for (int k = 1;; ++k) {
      auto s = sample(k);
      if (!w.append(s).ok()) ::_exit(3);
      uint64_t seq = s.seq;
      if (::write(pipefd[1], &seq, sizeof seq) != sizeof seq) ::_exit(4);
    }
  }
  ::close(pipefd[1]);
  uint64_t acked = 0, seq = 0;
  while (acked < 100 && ::read(pipefd[0], &seq, sizeof seq) == sizeof seq) acked = seq;
  ::kill(pid, SIGKILL);
  int st = 0;
  ::waitpid(pid, &st, 0);
  while (::read(pipefd[0], &seq, sizeof seq) == sizeof seq) acked = seq;
  ::close(pipefd[0]);
  auto h = read_history(path);
  REQUIRE(h.ok());
  REQUIRE(!h->empty());
  CHECK(h->back().seq >= acked);  // every acknowledged sample is on disk
  for (size_t k = 1; k < h->size(); ++k) CHECK((*h)[k].seq == (*h)[k - 1].seq + 1);
}
