// Every fixture scenario under tests/fixtures/preflight/ with the exact verdicts it must get:
// the rows that are not PASS, and nothing else.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <set>

#include "core/config.h"
#include "core/strings.h"
#include "env/preflight.h"
#include "env/rank_env.h"

using namespace spark;
using namespace spark::env;

namespace {

std::string dir(const std::string& scenario) {
  return std::string(SPARK_SOURCE_DIR) + "/tests/fixtures/preflight/" + scenario;
}

RingConfig load(const std::string& scenario) {
  std::vector<Diagnostic> d;
  auto cfg = load_config(dir(scenario) + "/cluster.env", Environment{}, &d);
  REQUIRE_MESSAGE(cfg.ok(), (cfg.ok() ? "" : cfg.error().message));
  return *cfg;
}

RingReport replay(const std::string& scenario, CheckFilter f = {}) {
  auto cfg = load(scenario);
  return replay_ring(cfg, {dir(scenario) + "/node0", dir(scenario) + "/node1"}, f, true);
}

// "node check subject VERDICT" of every row that is not PASS.
std::set<std::string> not_pass(const RingReport& r) {
  std::set<std::string> out;
  for (const auto& c : r.checks)
    if (c.verdict != Verdict::pass)
      out.insert(fmt::format("{} {} {} {}", c.node, c.id, c.subject, verdict_name(c.verdict)));
  return out;
}

const CheckResult& find(const RingReport& r, const std::string& node, const std::string& id,
                        const std::string& subject) {
  for (const auto& c : r.checks)
    if (c.node == node && c.id == id && c.subject == subject) return c;
  FAIL("no row ", node, " ", id, " ", subject);
  static CheckResult none;
  return none;
}

// The rows every GB10 fixture has that are not PASS: only rank 0's node binds ports.
std::set<std::string> baseline() {
  return {"spark-b port.free  SKIP"};
}

std::set<std::string> with(std::set<std::string> extra) {
  auto b = baseline();
  b.insert(extra.begin(), extra.end());
  return b;
}

}  // namespace
namespace doctest {
template <>
struct StringMaker<std::set<std::string>> {
  static String convert(const std::set<std::string>& s) {
    return ("{" + spark::join(std::vector<std::string>(s.begin(), s.end()), " | ") + "}").c_str();
  }
};
}  // namespace doctest
namespace {
void dump(const RingReport& r) {
  MESSAGE(format_report_table(r, false));
}

}  // namespace

TEST_CASE("fixture healthy-pair: everything passes, GID 3 resolved on both twins of both nodes") {
  auto r = replay("healthy-pair");
  CHECK(not_pass(r) == baseline());
  CHECK(r.exit_code() == 0);
  REQUIRE(r.nodes.size() == 2);
  for (const auto& n : r.nodes) {
    REQUIRE(n.links.size() == 2);
    CHECK(n.links[0].gid_index == 3);
    CHECK(n.links[1].gid_index == 3);
  }
  CHECK(find(r, "spark-a", "rdma.gid", "rocep1s0f1:1").message.find("::ffff:10.10.3.1") !=
        std::string::npos);
  CHECK(find(r, "spark-b", "sw.parity", "").verdict == Verdict::pass);
  CHECK(find(r, "spark-a", "gpu", "gpu0").message ==
        "NVIDIA GB10: sm_121, 119.70 GiB, 99 KiB shared memory per block (opt-in), driver "
        "580.95.05 (CUDA 13.0)");
  if (r.exit_code() != 0) dump(r);
}

TEST_CASE("fixture zero-gid: the configured index is all-zero, the fix names the right index") {
  auto r = replay("zero-gid");
  CHECK(not_pass(r) == with({"spark-b rdma.gid rocep1s0f0:1 FAIL"}));
  const auto& c = find(r, "spark-b", "rdma.gid", "rocep1s0f0:1");
  CHECK(c.message.find("GID index 3 is all-zero") != std::string::npos);
  CHECK(c.message.find("at index 5") != std::string::npos);
  CHECK(c.message.find("[all_zero]") != std::string::npos);
  CHECK(
      c.fix.find("set NODE1_HCAS=rocep1s0f0 and NODE1_NETDEVS=enp1s0f0np0 and NODE1_GID_INDEX=5") !=
      std::string::npos);
  // The other twin's standard table holds RoCE v2 at the configured 3.
  CHECK(find(r, "spark-b", "rdma.gid", "rocep1s0f1:1").verdict == Verdict::pass);
  CHECK(r.exit_code() == 1);
}

TEST_CASE("fixture head4-worker3: auto resolves 4 on the head and 3 on the worker") {
  auto r = replay("head4-worker3");
  CHECK(not_pass(r) == baseline());
  CHECK(r.nodes[0].links[0].gid_index == 4);
  CHECK(r.nodes[0].links[1].gid_index == 4);
  CHECK(r.nodes[1].links[0].gid_index == 3);
  auto cfg = load("head4-worker3");
  auto e0 = render_rank_env(cfg, 0, r.nodes[0]);
  auto e1 = render_rank_env(cfg, 1, r.nodes[1]);
  REQUIRE(e0.ok());
  REQUIRE(e1.ok());
  CHECK(e0->get("NCCL_IB_GID_INDEX") == "4");
  CHECK(e1->get("NCCL_IB_GID_INDEX") == "3");
  CHECK(e0->get("NCCL_IB_HCA") == "=rocep1s0f0:1,rocep1s0f1:1");
  CHECK(e1->get("NCCL_SOCKET_IFNAME") == "=enp1s0f0np0");
}

TEST_CASE("fixture gid-moved: configured 3, the IPv4 entry moved to 5 after a reboot") {
  auto r = replay("gid-moved");
  CHECK(not_pass(r) ==
        with({"spark-a rdma.gid rocep1s0f0:1 FAIL", "spark-a rdma.gid rocep1s0f1:1 FAIL"}));
  const auto& c = find(r, "spark-a", "rdma.gid", "rocep1s0f0:1");
  CHECK(c.message.find("[moved]") != std::string::npos);
  CHECK(c.message.find("fd00:10:10::1") != std::string::npos);
  CHECK(c.fix == "set NODE0_GID_INDEX=5 or leave it auto");
  CHECK(r.nodes[0].links[0].gid_index == std::nullopt);  // fail closed: no usable index
}

TEST_CASE("fixture roce-v1: the configured index holds the address as RoCE v1 only") {
  auto r = replay("roce-v1");
  CHECK(not_pass(r) == with({"spark-b rdma.gid rocep1s0f0:1 FAIL"}));
  const auto& c = find(r, "spark-b", "rdma.gid", "rocep1s0f0:1");
  CHECK(c.message.find("[roce_v1]") != std::string::npos);
  CHECK(c.message.find("IB/RoCE v1") != std::string::npos);
  CHECK(c.fix.find("RoCE v2") != std::string::npos);
}

TEST_CASE("fixture ipv6-only: no IPv4 on the netdev, only IPv6 GIDs") {
  auto r = replay("ipv6-only");
  CHECK(not_pass(r) ==
        with({"spark-b rdma.gid rocep1s0f0:1 FAIL", "spark-b rdma.netdev rocep1s0f0 FAIL",
              "spark-b rdma.netdev fabric ip FAIL"}));
  const auto& c = find(r, "spark-b", "rdma.gid", "rocep1s0f0:1");
  CHECK(c.message.find("[ipv6_only]") != std::string::npos);
  CHECK(c.fix.find("ip addr add 10.10.2.2/24 dev enp1s0f0np0") != std::string::npos);
}

TEST_CASE("fixture port-down: port DOWN fails rdma.port and net.link, and no GID is offered") {
  auto r = replay("port-down");
  CHECK(not_pass(r) ==
        with({"spark-b rdma.port rocep1s0f1:1 FAIL", "spark-b net.link enp1s0f1np1 FAIL"}));
  CHECK(find(r, "spark-b", "rdma.port", "rocep1s0f1:1").message.find("state 1: DOWN") !=
        std::string::npos);
}

TEST_CASE("fixture hca-other-netdev: the HCA maps to the other twin's netdev") {
  auto r = replay("hca-other-netdev");
  CHECK(not_pass(r) ==
        with({"spark-b rdma.netdev rocep1s0f0 FAIL", "spark-b rdma.netdev rocep1s0f1 FAIL"}));
  const auto& c = find(r, "spark-b", "rdma.netdev", "rocep1s0f0");
  CHECK(c.message == "rocep1s0f0 maps to enp1s0f1np1, not the configured enp1s0f0np0");
}

TEST_CASE("fixture mtu1500: warns on the node and fails MTU parity across the ring") {
  auto r = replay("mtu1500");
  CHECK(not_pass(r) ==
        with({"spark-b net.link enp1s0f0np0 WARN", "spark-b net.link enp1s0f1np1 WARN",
              "ring net.link twin 0 FAIL", "ring net.link twin 1 FAIL"}));
  CHECK(find(r, "spark-b", "net.link", "enp1s0f0np0").fix.find("mtu 9000") != std::string::npos);
}

TEST_CASE("fixture low-mem: low MemAvailable with the model in the page cache says evict") {
  auto r = replay("low-mem");
  CHECK(not_pass(r) == with({"spark-a mem  FAIL", "spark-a mem.plan  FAIL"}));
  const auto& m = find(r, "spark-a", "mem", "");
  CHECK(m.message.find("MemAvailable 3.00 GiB < MEM_AVAILABLE_MIN 16.00 GiB") != std::string::npos);
  CHECK(m.fix.find("sparkctl evict") != std::string::npos);
  CHECK(m.fix.find("62.00 GiB") != std::string::npos);
  CHECK(find(r, "spark-a", "mem.plan", "").fix.find("the weights share alone does not fit") !=
        std::string::npos);
}

TEST_CASE("fixture disk90: the model filesystem at 90% fails disk") {
  auto r = replay("disk90");
  CHECK(not_pass(r) == with({"spark-b disk /models/qwen3-32b FAIL"}));
  CHECK(find(r, "spark-b", "disk", "/models/qwen3-32b").message.find("90% used") !=
        std::string::npos);
}

TEST_CASE("fixture no-dev-infiniband: no uverbs device fails rdma.devices") {
  auto r = replay("no-dev-infiniband");
  CHECK(not_pass(r) == with({"spark-b rdma.devices /dev/infiniband FAIL"}));
  CHECK(find(r, "spark-b", "rdma.devices", "/dev/infiniband").message.find("No device found") !=
        std::string::npos);
}

TEST_CASE("fixture nccl-mismatch: sw.parity names the node and the field") {
  auto r = replay("nccl-mismatch");
  CHECK(not_pass(r) == with({"spark-b sw.parity  FAIL"}));
  const auto& c = find(r, "spark-b", "sw.parity", "");
  CHECK(c.message.find("nccl_version 2.21.5 here, 2.23.4 on spark-a") != std::string::npos);
  CHECK(c.message.find("nccl_path") != std::string::npos);
}

TEST_CASE("--only and --skip select checks by ID and by group") {
  CheckFilter only;
  only.only = {"rdma"};
  auto r = replay("zero-gid", only);
  for (const auto& c : r.checks) CHECK(starts_with(c.id, "rdma."));
  CheckFilter skip;
  skip.skip = {"rdma.gid"};
  auto r2 = replay("zero-gid", skip);
  CHECK(not_pass(r2) == baseline());
  CHECK(validate_check_ids({"rdma.gid", "mem"}).ok());
  auto bad = validate_check_ids({"rdma.gdi"});
  CHECK(!bad.ok());
  CHECK(bad.message().find("did you mean rdma.gid") != std::string::npos);
}

TEST_CASE("node reports survive JSON (the head parses what nodes print)") {
  auto r = replay("head4-worker3");
  auto j = report_to_json(r.nodes[0]);
  auto back = report_from_json(nlohmann::json::parse(j.dump()));
  REQUIRE(back.ok());
  CHECK(back->links[0].gid_index == 4);
  CHECK(back->checks.size() == r.nodes[0].checks.size());
  CHECK(back->identity == r.nodes[0].identity);
  CHECK(!report_from_json(nlohmann::json::parse(R"({"schema":2})")).ok());
}
