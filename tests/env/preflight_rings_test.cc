// Preflight on 2-, 3- and 4-node rings carrying one fault class each: the fault caught on
// the right node, HCA and netdev with the right cause, and every fix it suggests applied to
// the captured trees (cluster-file settings, NODE<i>_HCAS swaps, address moves, huge pages,
// page cache) until preflight passes again.
#include <doctest/doctest.h>
#include <fmt/format.h>

#include <set>

#include "env/gpu.h"
#include "env/preflight.h"
#include "env/preflight_tree.h"
#include "env/rank_env.h"
#include "spark/version.h"

using namespace spark;
using namespace spark::env;
using spark::test::RingTree;

namespace {

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

RingConfig config_of(const RingTree& ring) {
  std::vector<Diagnostic> d;
  auto cfg = ring.config(&d);
  std::string why;
  for (const auto& x : d)
    if (x.error) why += x.where + ": " + x.message + "\n";
  REQUIRE_MESSAGE(cfg.ok(), (cfg.ok() ? why : cfg.error().message + "\n" + why));
  for (const auto& x : d) CHECK_MESSAGE(!x.error, x.message);
  return *cfg;
}

RingReport replay(const RingTree& ring) {
  return replay_ring(config_of(ring), ring.roots(), {}, true);
}

std::set<std::string> not_pass(const RingReport& r) {
  std::set<std::string> out;
  for (const auto& c : r.checks)
    if (c.verdict != Verdict::pass)
      out.insert(fmt::format("{} {} {} {}", c.node, c.id, c.subject, verdict_name(c.verdict)));
  return out;
}

// A healthy ring's rows that are not PASS: only the head binds ports.
std::set<std::string> baseline(int n) {
  std::set<std::string> b;
  for (int k = 1; k < n; ++k) b.insert(RingTree::name(k) + " port.free  SKIP");
  return b;
}

std::set<std::string> with(int n, std::set<std::string> extra) {
  auto b = baseline(n);
  b.insert(extra.begin(), extra.end());
  return b;
}

const CheckResult* row(const RingReport& r, const std::string& node, const std::string& id,
                       const std::string& subject) {
  for (const auto& c : r.checks)
    if (c.node == node && c.id == id && c.subject == subject) return &c;
  return nullptr;
}

std::string table(const RingReport& r) {
  return format_report_table(r, false);
}

// The fix replay every class ends with: the fixes as given bring the ring back to healthy.
void fixes_work(RingTree& ring) {
  auto s = spark::test::settle(ring, [&] { return replay(ring); });
  CHECK(s.rounds < 3);
  CHECK(s.applied > 0);
  CHECK_MESSAGE(not_pass(s.report) == baseline(ring.size()),
                (table(s.report) + "\n" + ring.cluster()));
}

int rank_of_node(const RingConfig& cfg, int node) {
  for (const auto& p : cfg.ranks())
    if (p.node == node) return p.rank;
  return -1;
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

TEST_CASE("rings: a healthy ring of 2, 3 and 4 nodes passes, every twin at GID 3") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    RingTree ring(n);
    auto r = replay(ring);
    CHECK_MESSAGE(not_pass(r) == baseline(n), table(r));
    for (const auto& node : r.nodes)
      for (const auto& l : node.links) CHECK(l.gid_index == 3);
    for (const char* id : {"net.addr", "gpu.parity", "net.subnet"}) {
      const auto* c = row(r, RingTree::name(n - 1), id, "");
      REQUIRE_MESSAGE(c, id);
      CHECK(c->verdict == Verdict::pass);
    }
  }
}

// ---- an address that belongs to another node ----

TEST_CASE("rings: a twin holding another node's twin address fails net.addr with the move") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    RingTree ring(n);
    int k = n - 1;
    std::string mine = fmt::format("10.10.3.{}", k + 1);
    // A netplan file copied from the head: the second twin's address is spark-a's.
    spark::test::apply_fix(ring, RingTree::name(k),
                           fmt::format("`sudo ip addr del {}/24 dev enp1s0f1np1 && sudo ip addr "
                                       "add 10.10.3.1/24 dev enp1s0f1np1`",
                                       mine));
    auto r = replay(ring);
    CHECK_MESSAGE(not_pass(r) == with(n, {RingTree::name(k) + " net.addr 10.10.3.1 FAIL"}),
                  table(r));
    const auto* a = row(r, RingTree::name(k), "net.addr", "10.10.3.1");
    REQUIRE(a);
    CHECK(has(a->message, fmt::format("10.10.3.1 is on {}:enp1s0f1np1 and on spark-a:enp1s0f1np1",
                                      RingTree::name(k))));
    CHECK(has(a->fix, fmt::format("sudo ip addr del 10.10.3.1/24 dev enp1s0f1np1 && sudo ip addr "
                                  "add {}/24 dev enp1s0f1np1",
                                  mine)));
    // Its GID is spark-a's too: never offered to NCCL.
    CHECK_FALSE(r.nodes[static_cast<size_t>(k)].links[1].gid_index.has_value());
    fixes_work(ring);
  }
}

TEST_CASE("rings: a cloned node (the head's addresses on both twins) is named, never resolved") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    RingTree ring(n);
    int k = n - 1;
    std::string node = RingTree::name(k);
    spark::test::apply_fix(
        ring, node,
        fmt::format("`sudo ip addr del 10.10.2.{0}/24 dev enp1s0f0np0 && sudo ip addr add "
                    "10.10.2.1/24 dev enp1s0f0np0` `sudo ip addr del 10.10.3.{0}/24 dev "
                    "enp1s0f1np1 && sudo ip addr add 10.10.3.1/24 dev enp1s0f1np1`",
                    k + 1));
    auto r = replay(ring);
    auto np = not_pass(r);
    CHECK(np.count(node + " net.addr 10.10.2.1 FAIL"));
    CHECK(np.count(node + " net.addr 10.10.3.1 FAIL"));
    CHECK(np.count(node + " rdma.netdev fabric ip FAIL"));
    CHECK(np.count(node + " rdma.gid rocep1s0f0:1 FAIL"));
    // Nothing of spark-a's fails: the clone is the one to change.
    for (const auto& s : np) CHECK_FALSE(starts_with(s, "spark-a "));
    const auto* f = row(r, node, "rdma.netdev", "fabric ip");
    REQUIRE(f);
    CHECK_FALSE(has(f->fix, "assign"));
    CHECK(has(f->fix, "node spark-a's fabric address"));
    CHECK(has(f->fix, fmt::format("sudo ip addr del 10.10.2.1/24 dev enp1s0f0np0 && sudo ip addr "
                                  "add 10.10.2.{}/24 dev enp1s0f0np0",
                                  k + 1)));
    const auto* g = row(r, node, "rdma.gid", "rocep1s0f0:1");
    REQUIRE(g);
    CHECK(has(g->message, "node spark-a's fabric address"));
    for (const auto& l : r.nodes[static_cast<size_t>(k)].links) CHECK_FALSE(l.gid_index);
    auto cfg = config_of(ring);
    CHECK_FALSE(render_rank_env(cfg, rank_of_node(cfg, k), r.nodes[static_cast<size_t>(k)]).ok());
    fixes_work(ring);
  }
}

// ---- the GID of the fabric address, not the first RoCE v2 entry ----

TEST_CASE("rings: link-local and foreign addresses never give the GID; env renders the same") {
  for (int n : {2, 3, 4}) {
    for (const char* pinned : {"auto", "3"}) {
      CAPTURE(n);
      CAPTURE(pinned);
      RingTree ring(n);
      int k = n - 1;
      std::string node = RingTree::name(k);
      // avahi's 169.254/16 address first on both twins, a foreign address before the fabric
      // one; the tables list them in that order, so the fabric address is at 7.
      const char* devs[] = {"enp1s0f0np0", "enp1s0f1np1"};
      const char* hcas[] = {"rocep1s0f0", "rocep1s0f1"};
      for (int t = 0; t < 2; ++t) {
        std::string ll = fmt::format("169.254.{}.{}", 10 + t, 30 + k);
        std::string foreign = fmt::format("172.16.{}.200", 4 + t);
        std::string fab = fmt::format("10.10.{}.{}", 2 + t, k + 1);
        ring.del_addr(k, devs[t], fab);
        ring.add_addr(k, devs[t], ll, 16);
        ring.add_addr(k, devs[t], foreign, 24);
        ring.add_addr(k, devs[t], fab, 24);
        std::string v6 = fmt::format("fe80:0000:0000:0000:0000:0000:0000:{:04x}", 0xa00 + k);
        using spark::test::gid_of_ipv4;
        ring.gids(k, hcas[t],
                  {{v6, spark::test::kV1},
                   {v6, spark::test::kV2},
                   {gid_of_ipv4(ll), spark::test::kV1},
                   {gid_of_ipv4(ll), spark::test::kV2},
                   {gid_of_ipv4(foreign), spark::test::kV1},
                   {gid_of_ipv4(foreign), spark::test::kV2},
                   {gid_of_ipv4(fab), spark::test::kV1},
                   {gid_of_ipv4(fab), spark::test::kV2}});
      }
      ring.set_key(fmt::format("NODE{}_GID_INDEX", k), pinned);
      auto r = replay(ring);
      if (std::string(pinned) == "auto") {
        CHECK_MESSAGE(not_pass(r) == baseline(n), table(r));
      } else {
        CHECK_MESSAGE(not_pass(r) == with(n, {node + " rdma.gid rocep1s0f0:1 FAIL",
                                              node + " rdma.gid rocep1s0f1:1 FAIL"}),
                      table(r));
        REQUIRE(row(r, node, "rdma.gid", "rocep1s0f1:1"));
        CHECK(row(r, node, "rdma.gid", "rocep1s0f1:1")->fix ==
              fmt::format("set NODE{}_GID_INDEX=7 or leave it auto", k));
        fixes_work(ring);
        r = replay(ring);
      }
      const auto& rep = r.nodes[static_cast<size_t>(k)];
      CHECK(rep.links[0].ipv4 == fmt::format("10.10.2.{}", k + 1));
      CHECK(rep.links[1].ipv4 == fmt::format("10.10.3.{}", k + 1));
      CHECK(rep.links[0].gid_index == 7);
      CHECK(rep.links[1].gid_index == 7);
      auto cfg = config_of(ring);
      auto env = render_rank_env(cfg, rank_of_node(cfg, k), rep);
      REQUIRE_MESSAGE(env.ok(), env.error().message);
      CHECK(env->get("NCCL_IB_GID_INDEX") == "7");
      CHECK(env->get("NCCL_SOCKET_IFNAME") == "=enp1s0f0np0");
    }
  }
}

// ---- both twins in one subnet ----

TEST_CASE("rings: both twins in one subnet fail net.subnet, or warn with the ARP sysctls set") {
  for (int n : {2, 3, 4}) {
    for (bool sysctls : {false, true}) {
      CAPTURE(n);
      CAPTURE(sysctls);
      RingTree ring(n);
      std::set<std::string> want;
      for (int k = 0; k < n; ++k) {
        spark::test::apply_fix(
            ring, RingTree::name(k),
            fmt::format("`sudo ip addr del 10.10.3.{}/24 dev enp1s0f1np1 && sudo ip addr add "
                        "10.10.2.{}/24 dev enp1s0f1np1`",
                        k + 1, 101 + k));
        if (sysctls)
          for (const char* dev : {"enp1s0f0np0", "enp1s0f1np1"}) {
            ring.sysctl(k, dev, "arp_ignore", "1");
            ring.sysctl(k, dev, "arp_announce", "2");
          }
        want.insert(fmt::format("{} net.subnet enp1s0f1np1 {}", RingTree::name(k),
                                sysctls ? "WARN" : "FAIL"));
      }
      auto r = replay(ring);
      CHECK_MESSAGE(not_pass(r) == with(n, want), table(r));
      const auto* s = row(r, RingTree::name(n - 1), "net.subnet", "enp1s0f1np1");
      REQUIRE(s);
      CHECK(has(s->message, fmt::format("enp1s0f0np0 (10.10.2.{}) and enp1s0f1np1 (10.10.2.{}) "
                                        "are in one subnet",
                                        n, 100 + n)));
      CHECK(has(s->message, sysctls ? "arp_ignore=1 arp_announce=2" : "arp_ignore=0"));
      CHECK(has(s->fix, "one subnet per twin"));
      CHECK(has(s->fix, fmt::format("sudo ip addr del 10.10.2.{}/24 dev enp1s0f1np1 && sudo ip "
                                    "addr add 10.10.3.{}/24 dev enp1s0f1np1",
                                    100 + n, n)));
      fixes_work(ring);
    }
  }
}

// ---- GPUs that differ ----

TEST_CASE(
    "rings: a node with another GPU fails gpu.parity (and gpu where the build has no "
    "kernels for it)") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    RingTree ring(n);
    int k = n - 1;
    std::string node = RingTree::name(k);
    auto f = ring.facts(k);
    auto& d = f["gpu"]["devices"][0];
    d["name"] = "NVIDIA H100 80GB HBM3";
    d["compute_capability"] = "9.0";
    d["integrated"] = false;
    d["total_memory_bytes"] = 85520809984ull;
    ring.facts_set(k, f);
    auto r = replay(ring);
    const auto* p = row(r, node, "gpu.parity", "");
    REQUIRE_MESSAGE(p, table(r));
    CHECK(p->verdict == Verdict::fail);
    CHECK(has(p->message, fmt::format("{}'s GPU is NVIDIA H100 80GB HBM3 (sm_90)", node)));
    CHECK_MESSAGE(has(p->message, "NVIDIA GB10 (sm_121)"), p->message);
    for (int o = 0; o < k; ++o) {
      const auto* c = row(r, RingTree::name(o), "gpu.parity", "");
      REQUIRE(c);
      CHECK(c->verdict == Verdict::pass);
    }
    const auto* g = row(r, node, "gpu", "gpu0");
    REQUIRE(g);
    auto covered = cuda_archs_cover(kCudaArchitectures, 9, 0);
    if (covered && !*covered) {
      CHECK(g->verdict == Verdict::fail);
      CHECK(has(g->message, fmt::format("kernels for {} only", kCudaArchitectures)));
      CHECK(has(g->message, "sm_90"));
    }
    CHECK(r.exit_code() == 1);
  }
}

TEST_CASE("rings: a node with a GPU older than sm_80 fails gpu, naming it and DEVICE=cpu") {
  RingTree ring(2);
  auto f = ring.facts(1);
  auto& d = f["gpu"]["devices"][0];
  d["name"] = "Tesla T4";
  d["compute_capability"] = "7.5";
  d["integrated"] = false;
  ring.facts_set(1, f);
  auto r = replay(ring);
  const auto* g = row(r, RingTree::name(1), "gpu", "gpu0");
  REQUIRE_MESSAGE(g, table(r));
  CHECK(g->verdict == Verdict::fail);
  CHECK_MESSAGE(has(g->message, "Tesla T4: sm_75"), g->message);
  CHECK(has(g->message, "older than sm_80"));
  CHECK(has(g->fix, "DEVICE=cpu"));
  const auto* h = row(r, RingTree::name(0), "gpu", "gpu0");
  REQUIRE(h);
  CHECK(h->message.find("older than sm_80") == std::string::npos);
  CHECK(r.exit_code() == 1);
}

TEST_CASE("the build's CUDA architectures: what each form of the list covers") {
  CHECK(cuda_archs_cover("121a", 12, 1) == true);
  CHECK(cuda_archs_cover("121a", 12, 0) == false);
  CHECK(cuda_archs_cover("121a", 9, 0) == false);
  CHECK(cuda_archs_cover("90-real,121a", 9, 0) == true);
  CHECK(cuda_archs_cover("80-real", 8, 6) == true);  // a later minor runs the SASS
  CHECK(cuda_archs_cover("86-real", 8, 0) == false);
  CHECK(cuda_archs_cover("80-virtual", 12, 1) == true);  // PTX, JIT-compiled
  CHECK(cuda_archs_cover("90a", 12, 1) == false);
  CHECK(cuda_archs_cover("100f", 10, 3) == true);
  CHECK(cuda_archs_cover("90;121a", 12, 1) == true);
  CHECK_FALSE(cuda_archs_cover("native", 12, 1).has_value());
  CHECK_FALSE(cuda_archs_cover("", 12, 1).has_value());
}

// ---- the wrong function pinned ----

TEST_CASE("rings: the pinned port has no link and another function of the adapter is live") {
  for (int n : {2, 3, 4}) {
    for (int t : {0, 1}) {
      CAPTURE(n);
      CAPTURE(t);
      RingTree ring(n);
      int k = n - 1;
      std::string node = RingTree::name(k);
      std::string dead = fmt::format("rocep1s0f{}", t), dead_nd = fmt::format("enp1s0f{0}np{0}", t);
      std::string live = fmt::format("roceP2p1s0f{}", t),
                  live_nd = fmt::format("enP2p1s0f{0}np{0}", t);
      std::string ip = fmt::format("10.10.{}.{}", 2 + t, k + 1);
      ring.add_hca(k, live, live_nd);
      ring.port_state(k, dead, "1: DOWN", "3: Disabled");
      ring.netdev_attr(k, dead_nd, "operstate", "down");
      spark::test::apply_fix(ring, node,
                             fmt::format("`sudo ip addr del {0}/24 dev {1} && sudo ip addr add "
                                         "{0}/24 dev {2}`",
                                         ip, dead_nd, live_nd));
      auto r = replay(ring);
      const auto* p = row(r, node, "rdma.port", dead + ":1");
      REQUIRE_MESSAGE(p, table(r));
      CHECK(p->verdict == Verdict::fail);
      CHECK(has(p->message,
                fmt::format("{} (the same adapter) is ACTIVE with {} on {}", live, ip, live_nd)));
      CHECK(has(p->message, "the pin names the wrong port"));
      std::vector<std::string> h = {"rocep1s0f0", "rocep1s0f1"}, d = {"enp1s0f0np0", "enp1s0f1np1"};
      h[static_cast<size_t>(t)] = live;
      d[static_cast<size_t>(t)] = live_nd;
      std::string want = fmt::format("set NODE{0}_HCAS={1} and NODE{0}_NETDEVS={2}", k,
                                     join(h, ","), join(d, ","));
      CHECK(has(p->fix, want));
      // No row of this node offers a fix that keeps the dead port or moves addresses
      // between twins.
      for (const auto& c : r.checks) {
        if (c.node != node || c.verdict == Verdict::pass || c.verdict == Verdict::skip) continue;
        CAPTURE(c.message);
        CHECK_FALSE(has(c.fix, "ip link set " + dead_nd));
        CHECK_FALSE(has(c.fix, "ip addr"));
        CHECK_FALSE(has(c.fix, dead + ","));
        CHECK_FALSE(has(c.fix, "," + dead));
      }
      fixes_work(ring);
    }
  }
}

// ---- hugepages and dirty pages on unified memory ----

TEST_CASE("rings: memory reserved as huge pages is named, with vm.nr_hugepages as the fix") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    RingTree ring(n);
    int k = n - 1;
    std::string node = RingTree::name(k);
    ring.mem_set(k, {{"MemFree", 4ull << 20},
                     {"MemAvailable", 12ull << 20},
                     {"HugePages_Total", 49152},
                     {"HugePages_Free", 49152},
                     {"Hugepagesize", 2048},
                     {"Hugetlb", 96ull << 20}});
    auto r = replay(ring);
    const auto* m = row(r, node, "mem", "");
    REQUIRE(m);
    CHECK(m->verdict == Verdict::fail);
    CHECK(has(m->message, "96.00 GiB reserved as huge pages (HugePages_Total 49152 x 2.00 MiB"));
    CHECK(has(m->fix, "sudo sysctl -w vm.nr_hugepages=0"));
    CHECK_FALSE(has(m->fix, "held by processes"));
    CHECK_FALSE(has(m->fix, "drop_caches"));
    fixes_work(ring);
  }
}

TEST_CASE(
    "rings: dirty pages on unified memory with too little free for the plan fail, with "
    "the page-cache fix") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    RingTree ring(n);
    int k = n - 1;
    std::string node = RingTree::name(k);
    ring.mem_set(k, {{"MemFree", 10ull << 20},
                     {"MemAvailable", 100ull << 20},
                     {"Cached", 88ull << 20},
                     {"Dirty", 30ull << 20}});
    auto r = replay(ring);
    const auto* m = row(r, node, "mem", "");
    REQUIRE(m);
    CHECK(m->verdict == Verdict::fail);
    CHECK(has(m->message, "30.00 GiB not yet written back, and MemFree 10.00 GiB < the"));
    CHECK(has(m->message, "freeze the node"));
    CHECK(starts_with(m->fix, "run `sync`, then "));
    CHECK(has(m->fix, "drop_caches"));
    fixes_work(ring);
  }
}

// ---- the fabric address on the LAN port, or the LAN address pinned ----

TEST_CASE("rings: the fabric address on the LAN port moves to the fabric port") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    RingTree ring(n);
    int k = n - 1;
    std::string node = RingTree::name(k), ip = fmt::format("10.10.2.{}", k + 1);
    spark::test::apply_fix(
        ring, node,
        fmt::format("`sudo ip addr del {0}/24 dev enp1s0f0np0 && sudo ip addr add {0}/24 dev "
                    "enP7s7`",
                    ip));
    auto r = replay(ring);
    const auto* f = row(r, node, "rdma.netdev", "fabric ip");
    REQUIRE_MESSAGE(f, table(r));
    CHECK(has(f->message, "it is on enP7s7"));
    CHECK(has(f->fix, fmt::format("sudo ip addr del {0}/24 dev enP7s7 && sudo ip addr add {0}/24 "
                                  "dev enp1s0f0np0",
                                  ip)));
    fixes_work(ring);
  }
}

TEST_CASE("rings: the LAN address pinned as the fabric address: set the one on the fabric port") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    RingTree ring(n);
    int k = n - 1;
    std::string node = RingTree::name(k);
    ring.set_key(fmt::format("NODE{}_FABRIC_IP", k), fmt::format("192.168.1.{}", 20 + k));
    auto r = replay(ring);
    const auto* f = row(r, node, "rdma.netdev", "fabric ip");
    REQUIRE_MESSAGE(f, table(r));
    CHECK(f->verdict == Verdict::fail);
    CHECK(has(f->fix, fmt::format("set NODE{}_FABRIC_IP=10.10.2.{} (the address enp1s0f0np0 "
                                  "holds",
                                  k, k + 1)));
    fixes_work(ring);
  }
}

TEST_CASE(
    "rings: a node with only config.json: mem.plan on estimated weights warns, never "
    "passes") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    RingTree ring(n);
    int k = n - 1;
    std::string model = ring.node(k) + "/models/qwen3-32b";
    for (const auto& e : std::filesystem::directory_iterator(model))
      if (e.path().filename() != "config.json") std::filesystem::remove(e.path());
    auto cfg = nlohmann::json::parse(read_file(model + "/config.json").value());
    cfg["vocab_size"] = 151936;
    cfg["intermediate_size"] = 25600;
    // A family the native engine does not run, so no shard plan counts the weights either.
    cfg["architectures"] = {"Phi3ForCausalLM"};
    cfg["model_type"] = "phi3";
    spark::test::put(model + "/config.json", cfg.dump());
    auto r = replay(ring);
    const auto* p = row(r, RingTree::name(k), "mem.plan", "");
    REQUIRE_MESSAGE(p, table(r));
    CHECK_MESSAGE(p->verdict == Verdict::warn, p->message);
    CHECK(has(p->message, "weights ESTIMATED from config.json"));
    CHECK(has(p->message, "would fit if the estimate holds"));
    CHECK(has(p->fix, "sparkctl stage-weights"));
    // The other nodes counted their files.
    CHECK(row(r, "spark-a", "mem.plan", "")->verdict == Verdict::pass);
  }
}

// ---- sparkd cannot start: a library is missing ----

TEST_CASE("rings: sparkd missing a library names it and the package that provides it") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    RingTree ring(n);
    int k = n - 1;
    auto f = ring.facts(k);
    f["sparkd_bin"] = "/usr/bin/sparkd";
    f["sparkd_error"] =
        "exited with status 127: /usr/bin/sparkd: error while loading shared libraries: "
        "libnccl.so.2: cannot open shared object file: No such file or directory";
    ring.facts_set(k, f);
    auto r = replay(ring);
    const auto* s = row(r, RingTree::name(k), "sw.sparkd", "/usr/bin/sparkd");
    REQUIRE_MESSAGE(s, table(r));
    CHECK(s->verdict == Verdict::fail);
    CHECK(has(s->message, "the library libnccl.so.2 is missing"));
    CHECK(has(s->fix, "libnccl2"));
    CHECK(has(s->fix, "DGX OS"));
  }
}

// ---- input robustness ----

TEST_CASE("rings: an empty GID file is unreadable data, never an all-zero or RoCE v1 entry") {
  for (int n : {2, 3, 4}) {
    for (const char* pinned : {"auto", "3"}) {
      CAPTURE(n);
      CAPTURE(pinned);
      RingTree ring(n);
      int k = n - 1;
      spark::test::put(ring.port_dir(k, "rocep1s0f0") + "/gids/3", "");
      ring.set_key(fmt::format("NODE{}_GID_INDEX", k), pinned);
      auto r = replay(ring);
      const auto* g = row(r, RingTree::name(k), "rdma.gid", "rocep1s0f0:1");
      REQUIRE(g);
      CHECK(g->verdict == Verdict::fail);
      CHECK(has(g->message, "[unparseable]"));
      CHECK(has(g->message, "/sys/class/infiniband/rocep1s0f0/ports/1/gids/3 is empty"));
      CHECK_FALSE(has(g->message, "[roce_v1]"));
      CHECK_FALSE(has(g->message, "all-zero"));
      CHECK_FALSE(has(g->fix, "enable RoCE v2"));
    }
  }
}

TEST_CASE("rings: control bytes from a node are escaped in the table, as in JSON") {
  RingTree ring(3);
  ring.port_state(2, "rocep1s0f0", "4: ACTIVE", "\x1b[2J5: Link\rUp");
  auto r = replay(ring);
  const auto* p = row(r, "spark-c", "rdma.port", "rocep1s0f0:1");
  REQUIRE(p);
  CHECK(p->verdict == Verdict::fail);
  auto t = format_report_table(r, true);
  CHECK(has(t, "\\x1B[2J5: Link\\x0DUp"));
  CHECK_FALSE(has(t, "\x1b"));
  CHECK_FALSE(has(t, "\r"));
  CHECK_NOTHROW((void)ring_report_to_json(r, true).dump());
}

TEST_CASE("rings: a captured tree without meminfo says recapture, not 'is /proc mounted?'") {
  RingTree ring(2);
  std::filesystem::remove(ring.node(1) + "/proc/meminfo");
  auto r = replay(ring);
  const auto* m = row(r, "spark-b", "mem", "");
  REQUIRE(m);
  CHECK(m->verdict == Verdict::fail);
  CHECK_FALSE(has(m->fix, "mounted"));
  CHECK(has(m->fix, "sparkctl capture-node"));
}
