// sparkctl preflight over real SSH against network-namespace nodes (tests/support/ring.h):
// the head runs its own checks in-process and every other node's through sshd, then pings
// every peer on every twin with don't-fragment packets of MTU-28 bytes.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <set>

#include "core/strings.h"
#include "support/ring.h"

using namespace spark;
using namespace spark::test;
using nlohmann::json;

namespace {

#define SKIP_WITHOUT_RING()                                   \
  if (auto why_ = ring_unavailable_reason(); !why_.empty()) { \
    MESSAGE("SKIP: " << why_);                                \
    return;                                                   \
  }

std::unique_ptr<TestRing> make_ring(int nodes, std::vector<std::string> extra = {}) {
  auto r = TestRing::create({.nodes = nodes,
                             .links = 2,
                             .mtu = 9000,
                             .sparkctl_bin = SPARKCTL_BIN,
                             .extra_config = std::move(extra)});
  REQUIRE_MESSAGE(r.ok(), r.error().message);
  return std::move(*r);
}

json run_json(const TestRing& ring, const std::string& args, int* rc) {
  auto p = ring.sparkctl(args + " --json");
  REQUIRE_MESSAGE(p.ok(), p.error().message);
  *rc = p->exit_status;
  json j = json::parse(p->out, nullptr, false);
  REQUIRE_MESSAGE(!j.is_discarded(), "stdout: " << p->out << "\nstderr: " << p->err);
  return j;
}

// "node id subject VERDICT" rows that are not PASS.
std::set<std::string> not_pass(const json& j) {
  std::set<std::string> out;
  for (const auto& c : j["checks"])
    if (c["verdict"] != "PASS")
      out.insert(fmt::format("{} {} {} {}", c["node"].get<std::string>(),
                             c["id"].get<std::string>(), c["subject"].get<std::string>(),
                             c["verdict"].get<std::string>()));
  return out;
}

int count(const json& j, const std::string& id, const std::string& verdict) {
  int n = 0;
  for (const auto& c : j["checks"])
    if (c["id"] == id && c["verdict"] == verdict) ++n;
  return n;
}

// Rows every namespace node has that are not PASS: no HCAs here, no GPU probe, root's
// default memlock limit, and port.free only on the head.
std::set<std::string> expected_baseline(int nodes) {
  std::set<std::string> s;
  for (int i = 0; i < nodes; ++i) {
    std::string n = fmt::format("ns{}", i);
    for (const char* id : {"rdma.devices", "rdma.port", "rdma.netdev", "rdma.gid"})
      s.insert(fmt::format("{} {}  SKIP", n, id));
    if (i > 0) s.insert(n + " port.free  SKIP");
  }
  return s;
}

// Drops what depends on the machine running the tests: root's memlock limit, whether a
// GPU is present (no GPU: a WARN; a GPU: a PASS per device; gpu.throttle: a SKIP without
// one), and the driver and NCCL versions sw.known_bad can read (none: SKIP).
std::set<std::string> without_machine(std::set<std::string> s) {
  for (auto it = s.begin(); it != s.end();)
    it = it->find(" sys memlock WARN") != std::string::npos ||
                 it->find(" gpu  WARN") != std::string::npos ||
                 ((it->find(" sw.known_bad ") != std::string::npos ||
                   it->find(" gpu.throttle ") != std::string::npos) &&
                  it->find(" SKIP") != std::string::npos)
             ? s.erase(it)
             : std::next(it);
  return s;
}

}  // namespace

TEST_CASE("preflight e2e: a 3-node namespace ring over real SSH passes, with pings on both twins") {
  SKIP_WITHOUT_RING();
  auto ring = make_ring(3);
  int rc = -1;
  auto j = run_json(*ring, "preflight", &rc);
  CHECK(without_machine(not_pass(j)) == expected_baseline(3));
  CHECK(count(j, "ssh.reach", "PASS") == 3);
  CHECK(count(j, "net.path", "PASS") == 3 * 2 * 2);  // every ordered pair, both twins
  CHECK(count(j, "sw.parity", "PASS") == 2);
  CHECK(count(j, "clock", "PASS") == 2);
  CHECK(count(j, "model.files", "PASS") == 3);
  CHECK((rc == 0 || rc == 15));  // 15: warnings only (root's memlock limit, no GPU in CI)
  CHECK(j["exit_code"] == rc);
  // Each node probed its own namespace: its twin addresses are its own.
  REQUIRE(j["nodes"].size() == 3);
  for (int i = 0; i < 3; ++i) {
    CHECK(j["nodes"][i]["links"][0]["ipv4"] == ring->net().ip(i, 0));
    CHECK(j["nodes"][i]["links"][1]["ipv4"] == ring->net().ip(i, 1));
    CHECK(j["nodes"][i]["links"][1]["mtu"] == 9000);
  }
}

TEST_CASE("preflight e2e: MTU 1500 on one twin of one node fails MTU parity and the DF ping") {
  SKIP_WITHOUT_RING();
  auto ring = make_ring(3);
  REQUIRE(ring->net().set_mtu(2, 1, 1500).ok());
  int rc = -1;
  auto j = run_json(*ring, "preflight", &rc);
  CHECK(rc == 1);
  auto np = not_pass(j);
  CHECK(np.count("ns2 net.link fab1 WARN") == 1);
  CHECK(np.count("ring net.link twin 1 FAIL") == 1);
  // 8972-byte DF pings into ns2 on twin 1 cannot pass; ns2's own are 1472 bytes and pass.
  CHECK(np.count("ns0 net.path fab1->ns2 FAIL") == 1);
  CHECK(np.count("ns1 net.path fab1->ns2 FAIL") == 1);
  CHECK(np.count("ns0 net.path fab0->ns2 FAIL") == 0);
  CHECK(count(j, "net.path", "FAIL") == 2);
}

TEST_CASE(
    "preflight e2e: a node with an unknown host key fails ssh.reach, the others still report") {
  SKIP_WITHOUT_RING();
  auto ring = make_ring(3);
  // Forget ns2's host key.
  auto kh = read_file(ring->known_hosts()).value_or("");
  std::string kept;
  for (const auto& line : split_list(kh, '\n'))
    if (line.find(ring->net().ip(2)) == std::string::npos) kept += line + "\n";
  REQUIRE(write_file_atomic(ring->known_hosts(), kept, nullptr));
  int rc = -1;
  auto j = run_json(*ring, "preflight --skip net.path", &rc);
  CHECK(rc == 1);
  bool found = false;
  for (const auto& c : j["checks"])
    if (c["node"] == "ns2" && c["id"] == "ssh.reach") {
      found = true;
      CHECK(c["verdict"] == "FAIL");
      CHECK(c["fix"].get<std::string>().find("known_hosts") != std::string::npos);
    }
  CHECK(found);
  CHECK(count(j, "ssh.reach", "PASS") == 2);
  CHECK(j["nodes"].size() == 2);
}

TEST_CASE("preflight e2e: --bandwidth measures every twin between neighbours") {
  SKIP_WITHOUT_RING();
  auto ring = make_ring(2);
  int rc = -1;
  auto j =
      run_json(*ring, "preflight --only net.bandwidth,ssh.reach --bandwidth --bw-seconds 0.3", &rc);
  CHECK_MESSAGE(count(j, "net.bandwidth", "FAIL") == 0, j.dump(1));
  int rows = 0;
  for (const auto& c : j["checks"])
    if (c["id"] == "net.bandwidth") {
      ++rows;
      CHECK(c["message"].get<std::string>().find("Gb/s") != std::string::npos);
    }
  CHECK(rows == 2);  // ns0 -> ns1 on fab0 and fab1
}

TEST_CASE("preflight e2e: env --rank renders a remote node's pins from its own facts") {
  SKIP_WITHOUT_RING();
  auto ring = make_ring(2);
  auto p = ring->sparkctl("env --rank 1");
  REQUIRE(p.ok());
  CHECK_MESSAGE(p->exit_status == 0, p->err);
  CHECK(p->out.find("NCCL_SOCKET_IFNAME==fab0\n") != std::string::npos);
  CHECK(p->out.find("MASTER_ADDR=" + ring->net().ip(0) + "\n") != std::string::npos);
  CHECK(p->out.find("NCCL_IB_DISABLE=1\n") != std::string::npos);
  CHECK(p->out.find("RANK=1\n") != std::string::npos);
}
