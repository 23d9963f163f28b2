// The fabric self-test's logic without a GPU: sizes, bus bandwidth, the seeded values and
// #wrong of the CPU twins, NCCL debug outputs of real rings (tests/fixtures/nccl-debug/, in
// NCCL's own format) and the verdict. The device sweep itself is in tests/hw/nccl_test.cc.
#include <doctest/doctest.h>

#include <vector>

#include "core/strings.h"
#include "daemon/engine/fabric_test.h"
#include "kernels/fabric_check.h"

using namespace spark;
using namespace spark::engine;

namespace {
std::string fixture(const std::string& name) {
  auto t = read_file(std::string(SPARK_SOURCE_DIR) + "/tests/fixtures/nccl-debug/" + name);
  REQUIRE_MESSAGE(t.has_value(), name);
  return *t;
}

FabricExpect roce_expect(int rank, int gid) {
  FabricExpect e;
  e.rank = rank;
  e.world = 2;
  e.node = rank == 0 ? "spark-a" : "spark-b";
  e.rdma = true;
  e.hcas = {"rocep1s0f0", "rocep1s0f1"};
  e.gid_index = gid;
  return e;
}

FabricReport report_with(const NcclTransportFacts& f, int rank, double busbw) {
  FabricReport r;
  r.rank = rank;
  r.world = 2;
  r.nccl = f;
  for (const char* op : {"all_reduce", "all_gather"}) {
    FabricPoint p;
    p.op = op;
    p.bytes = 256u << 20;
    p.count = p.bytes / 4;
    p.busbw = busbw;
    r.points.push_back(p);
  }
  return r;
}

bool any_has(const std::vector<std::string>& v, const std::string& s) {
  for (const auto& x : v)
    if (x.find(s) != std::string::npos) return true;
  return false;
}
}  // namespace

TEST_CASE("fabric sweep: 8 KB to 256 MB doubling, nccl-tests' bus factors and bandwidth") {
  auto s = fabric_sizes(8 << 10, 256 << 20);
  REQUIRE(s.size() == 16);
  CHECK(s.front() == 8192);
  CHECK(s.back() == 268435456);
  CHECK(fabric_bus_factor("all_reduce", 2) == doctest::Approx(1.0));
  CHECK(fabric_bus_factor("all_reduce", 4) == doctest::Approx(1.5));
  CHECK(fabric_bus_factor("all_gather", 4) == doctest::Approx(0.75));
  CHECK(fabric_bus_factor("all_reduce", 1) == 0);
  FabricPoint p;
  p.op = "all_gather";
  p.bytes = 64u << 20;
  p.time_us = 3000;  // 67.1 MB in 3 ms = 22.37 GB/s algbw
  fabric_bandwidth(p, 2);
  CHECK(p.algbw == doctest::Approx(22.369).epsilon(1e-3));
  CHECK(p.busbw == doctest::Approx(11.185).epsilon(1e-3));
  CHECK(fabric_iters(8192) == 50);
  CHECK(fabric_iters(256u << 20) == 5);
}

TEST_CASE("fabric check twins: seeded small integers, sums exact, #wrong counts corruption") {
  const size_t n = 4096;
  const int world = 4;
  std::vector<std::vector<float>> ranks(world, std::vector<float>(n));
  for (int r = 0; r < world; ++r) kernels::fabric_fill_ref(ranks[r].data(), n, r, 99);
  CHECK(ranks[0] != ranks[1]);  // ranks contribute different values
  std::vector<float> sum(n, 0);
  for (int r = 0; r < world; ++r)
    for (size_t i = 0; i < n; ++i) sum[i] += ranks[r][i];
  CHECK(kernels::fabric_wrong_allreduce_ref(sum.data(), n, world, 99) == 0);
  CHECK(kernels::fabric_wrong_allreduce_ref(sum.data(), n, world, 98) > n / 2);  // seed matters
  sum[7] += 1, sum[4000] = -sum[4000] + 0.5f;
  CHECK(kernels::fabric_wrong_allreduce_ref(sum.data(), n, world, 99) == 2);
  std::vector<float> gathered;
  for (int r = 0; r < world; ++r) gathered.insert(gathered.end(), ranks[r].begin(), ranks[r].end());
  CHECK(kernels::fabric_wrong_allgather_ref(gathered.data(), n, world, 99) == 0);
  std::swap(gathered[0], gathered[n]);  // rank 0's and rank 1's first values swapped
  CHECK(kernels::fabric_wrong_allgather_ref(gathered.data(), n, world, 99) ==
        (ranks[0][0] != ranks[1][0] ? 2u : 0u));
  for (size_t i = 0; i < n; ++i) {
    float v = kernels::fabric_value(99, 3, i);
    REQUIRE(v >= -32);
    REQUIRE(v <= 32);
    REQUIRE(v == static_cast<float>(static_cast<int>(v)));
  }
}

TEST_CASE("nccl debug: RoCE over both twins, per peer, with HCA and GID index") {
  auto f = parse_nccl_debug(fixture("roce-both-twins.rank0.log"), 0);
  CHECK(f.version == "2.28.9+cuda13.0");
  CHECK(f.network == "IB");
  CHECK(f.ib_devices == std::vector<std::string>{"rocep1s0f0:1", "rocep1s0f1:1"});
  CHECK(f.ib_link == "RoCE");
  REQUIRE(f.gid_index.has_value());
  CHECK(*f.gid_index == 4);
  REQUIRE(f.peers.size() == 2);  // peer 1 over NET/IB/0 and NET/IB/1
  CHECK(f.peers[0].peer == 1);
  CHECK(f.peers[0].transport == "NET/IB");
  CHECK(f.peers[0].hca == "rocep1s0f0");
  CHECK(f.peers[1].hca == "rocep1s0f1");
  CHECK(f.warnings.empty());
  auto r = report_with(f, 0, 22.5);
  auto e = roce_expect(0, 4);
  e.min_busbw = 21.875;
  judge_fabric(r, e);
  CHECK_MESSAGE(r.passed(), join(r.failures, "; "));
  CHECK(r.summary().find("1 via NET/IB") != std::string::npos);
}

TEST_CASE("nccl debug: a fall-back to sockets where RDMA was configured fails") {
  auto f = parse_nccl_debug(fixture("socket-fallback.rank1.log"), 1);
  CHECK(f.ib_no_device);
  CHECK(f.network == "Socket");
  CHECK(f.socket_ifs == std::vector<std::string>{"enp1s0f0np0:10.10.1.2"});
  REQUIRE(f.peers.size() == 1);
  CHECK(f.peers[0].peer == 0);
  CHECK(f.peers[0].transport == "NET/Socket");
  auto r = report_with(f, 1, 30);
  judge_fabric(r, roce_expect(1, 3));
  CHECK_FALSE(r.passed());
  // NCCL 2.28 says it differently (seen on the H200 machine, which has no HCA).
  auto f228 = parse_nccl_debug(
      "vm:663:667 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so\n"
      "vm:663:667 [0] NCCL INFO Failed to initialize NET plugin IB\n"
      "vm:663:667 [0] NCCL INFO NET/Socket : Using [0]lo:127.0.0.1<0>\n"
      "vm:663:667 [0] NCCL INFO Using network Socket\n",
      0);
  CHECK(f228.ib_no_device);
  CHECK(f228.socket_ifs == std::vector<std::string>{"lo:127.0.0.1"});
  CHECK(any_has(r.failures, "rank 1 (spark-b): NCCL found no RDMA device"));
  CHECK(any_has(r.failures, "/dev/infiniband/uverbs"));
  // Without RDMA configured, sockets are what was asked for.
  FabricExpect plain;
  plain.rank = 1;
  plain.world = 2;
  auto ok = report_with(f, 1, 30);
  judge_fabric(ok, plain);
  CHECK(ok.passed());
}

TEST_CASE("nccl debug: NET/Socket channels alone (IB found but not used) are a fall-back") {
  auto text = fixture("socket-fallback.rank1.log");
  // The same ring where NCCL found the HCAs but still chose sockets (e.g. NCCL_NET=Socket).
  auto pos = text.find("NET/IB : No device found.");
  text.replace(pos, 25,
               "NET/IB : Using [0]rocep1s0f0:1/RoCE [1]rocep1s0f1:1/RoCE [RO]; OOB "
               "enp1s0f0np0:10.10.1.2<0>");
  auto f = parse_nccl_debug(text, 1);
  CHECK_FALSE(f.ib_no_device);
  auto r = report_with(f, 1, 30);
  judge_fabric(r, roce_expect(1, 3));
  CHECK(any_has(r.failures, "NCCL fell back to sockets (NET/Socket)"));
}

TEST_CASE("nccl debug: a wrong GID index is named, with NCCL's own warning") {
  auto f = parse_nccl_debug(fixture("wrong-gid.rank1.log"), 1);
  REQUIRE(f.gid_index.has_value());
  CHECK(*f.gid_index == 0);
  REQUIRE(f.warnings.size() == 1);
  CHECK(f.warnings[0].find("Call to ibv_modify_qp failed with 61") == 0);
  auto r = report_with(f, 1, 22);
  judge_fabric(r, roce_expect(1, 3));
  CHECK(any_has(r.failures, "NCCL used RoCE GID index 0 but preflight resolved 3"));
  CHECK(any_has(r.failures, "NCCL warned: Call to ibv_modify_qp"));
}

TEST_CASE("nccl debug: one twin only, and bandwidth under the floor") {
  auto text = fixture("roce-both-twins.rank0.log");
  auto pos = text.find(" [1]rocep1s0f1:1/RoCE");
  text.erase(pos, 21);
  auto f = parse_nccl_debug(text, 0);
  CHECK(f.ib_devices == std::vector<std::string>{"rocep1s0f0:1"});
  auto r = report_with(f, 0, 12.1);
  auto e = roce_expect(0, 4);
  e.min_busbw = 21.875;
  judge_fabric(r, e);
  CHECK(any_has(r.failures, "NCCL uses rocep1s0f0 but not rocep1s0f1"));
  CHECK(any_has(r.failures,
                "all_reduce bus bandwidth 12.10 GB/s at 256 MB is under "
                "FABRIC_MIN_BUSBW=21.875"));
  CHECK(any_has(r.failures, "all_gather bus bandwidth"));
}

TEST_CASE("nccl debug: peers in one host over P2P and SHM; wrong values fail the test") {
  auto f = parse_nccl_debug(fixture("one-host-4gpu.rank0.log"), 0);
  REQUIRE(f.peers.size() == 3);
  CHECK(f.peers[0].peer == 1);
  CHECK(f.peers[0].transport == "P2P");
  CHECK(f.peers[0].detail == "P2P/CUMEM/read");
  CHECK(f.peers[1].peer == 2);
  CHECK(f.peers[1].transport == "SHM");
  CHECK(f.peers[2].peer == 3);
  FabricExpect e;
  e.world = 4;
  auto r = report_with(f, 0, 300);
  r.world = 4;
  judge_fabric(r, e);
  CHECK(r.passed());
  r.points[1].wrong = 17;
  judge_fabric(r, e);
  CHECK(any_has(r.failures, "all_gather of 256 MB: 17 of 67108864 values wrong"));
}

TEST_CASE("fabric report: JSON round trip and the nccl-tests-style table") {
  auto f = parse_nccl_debug(fixture("roce-both-twins.rank0.log"), 0);
  auto r = report_with(f, 0, 22.5);
  r.node = "spark-a";
  r.decode_latency_us_8k = 31.5;
  r.failures.push_back("x");
  auto back = fabric_report_from_json(to_json(r));
  REQUIRE(back.ok());
  CHECK(back->nccl.peers.size() == 2);
  CHECK(back->nccl.gid_index.value_or(-1) == 4);
  CHECK(back->decode_latency_us_8k == 31.5);
  CHECK_FALSE(back->passed());
  std::string t = render_fabric_table({*back});
  CHECK(t.find("# rank 0 of 2 (spark-a): FAILED") == 0);
  CHECK(t.find("#   peer 1 via NET/IB/1 (rocep1s0f1)") != std::string::npos);
  CHECK(t.find("#wrong") != std::string::npos);
  for (const auto& line : split_list(t, '\n'))
    if (line[0] != '#') CHECK(line.find("all_") != std::string::npos);  // data lines only
  CHECK(fabric_report_from_json(nlohmann::json::object()).error().code == Errc::integrity);
}

TEST_CASE("fabric expectation comes from the NCCL_* the rank was given") {
  setenv("NCCL_IB_HCA", "=rocep1s0f0:1,rocep1s0f1:1", 1);
  setenv("NCCL_IB_DISABLE", "0", 1);
  setenv("NCCL_IB_GID_INDEX", "3", 1);
  auto e = fabric_expect_from_env(1, 2, "spark-b", 20);
  CHECK(e.rdma);
  CHECK(e.hcas == std::vector<std::string>{"rocep1s0f0", "rocep1s0f1"});
  CHECK(e.gid_index.value_or(-1) == 3);
  setenv("NCCL_IB_DISABLE", "1", 1);
  CHECK_FALSE(fabric_expect_from_env(1, 2, "spark-b", 20).rdma);
  unsetenv("NCCL_IB_HCA");
  unsetenv("NCCL_IB_DISABLE");
  unsetenv("NCCL_IB_GID_INDEX");
  CHECK_FALSE(fabric_expect_from_env(1, 2, "spark-b", 20).rdma);
}
