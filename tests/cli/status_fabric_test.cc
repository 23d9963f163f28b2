// `sparkctl status`'s fabric lines: every rank's self-test from rank 0's /health
// (fabric_ranks), not rank 0's alone; a daemon that sends only `fabric` still gets its line.
#include <doctest/doctest.h>

#include "cli/ring_ops.h"
#include "core/strings.h"
#include "env/fabric_report.h"

using namespace spark;

namespace {
env::FabricReport report(const std::string& log, int rank, double busbw) {
  auto t = read_file(std::string(SPARK_SOURCE_DIR) + "/tests/fixtures/nccl-debug/" + log);
  REQUIRE(t.has_value());
  env::FabricReport r;
  r.rank = rank;
  r.world = 2;
  r.nccl = env::parse_nccl_debug(*t, rank);
  for (const char* op : {"all_reduce", "all_gather"}) {
    env::FabricPoint p;
    p.op = op;
    p.bytes = 256u << 20;
    p.count = p.bytes / 4;
    p.busbw = busbw;
    r.points.push_back(p);
  }
  r.decode_latency_us_8k = 30 + rank;
  return r;
}
}  // namespace

TEST_CASE("status: one fabric line per rank from /health's fabric_ranks") {
  auto r0 = report("roce-both-twins.rank0.log", 0, 22.5);
  auto r1 = report("socket-fallback.rank1.log", 1, 1.5);
  r1.failures.push_back("fell back to sockets");
  nlohmann::json health = {{"fabric", env::to_json(r0)},
                           {"fabric_ranks", {env::to_json(r0), env::to_json(r1)}}};
  const std::string text = cli::fabric_status_lines(health);
  INFO(text);
  const auto lines = split_list(text, '\n');
  REQUIRE(lines.size() == 2);
  CHECK(lines[0].find("fabric rank 0: passed; busbw at 256 MiB: all-reduce 22.5 GB/s") == 0);
  CHECK(lines[0].find("NET/IB") != std::string::npos);
  CHECK(lines[1].find("fabric rank 1: FAILED; busbw at 256 MiB: all-reduce 1.5 GB/s") == 0);
  CHECK(lines[1].find("8 KB all-reduce 31.0 us") != std::string::npos);
  // Rank 0's report alone (no fabric_ranks): one line, as before.
  nlohmann::json old = {{"fabric", env::to_json(r0)}};
  CHECK(cli::fabric_status_lines(old).find("fabric: passed") == 0);
  CHECK(cli::fabric_status_lines(nlohmann::json::object()).empty());
}
