// Preflight on nodes unlike the healthy fixtures: the right cause and the right fix for each
// wrong one, every suggested fix applied and re-checked (config check + preflight), and a
// probe that no file in a tree can crash or hang (FIFOs, /dev/zero, oversize files, symlink
// loops, bytes that are not UTF-8, junk GIDs).
#include <doctest/doctest.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <future>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <thread>

#include "core/config.h"
#include "core/process.h"
#include "core/strings.h"
#include "env/known_bad.h"
#include "env/meminfo.h"
#include "env/preflight.h"
#include "env/preflight_tree.h"
#include "env/rank_env.h"
#include "env/rdma.h"
#include "env/sysroot.h"
#include "support/tempdir.h"

using namespace spark;
using namespace spark::env;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr uint64_t kGiB = 1ull << 30;

std::string fx(const std::string& scenario) {
  return std::string(SPARK_SOURCE_DIR) + "/tests/fixtures/preflight/" + scenario;
}

Result<RingConfig> load_text(const test::TempDir& t, const std::string& text,
                             std::vector<Diagnostic>* d) {
  t.write("cluster.env", text);
  return load_config(t / "cluster.env", Environment{}, d);
}

RingConfig load_ok(const test::TempDir& t, const std::string& text) {
  std::vector<Diagnostic> d;
  auto cfg = load_text(t, text, &d);
  std::string why;
  for (const auto& x : d)
    if (x.error) why += x.where + ": " + x.message + "\n";
  REQUIRE_MESSAGE(cfg.ok(), (cfg.ok() ? why : cfg.error().message + "\n" + why));
  for (const auto& x : d) CHECK_MESSAGE(!x.error, x.message);
  return *cfg;
}

// "node check subject VERDICT" of every row that is not PASS.
std::set<std::string> not_pass(const RingReport& r) {
  std::set<std::string> out;
  for (const auto& c : r.checks)
    if (c.verdict != Verdict::pass)
      out.insert(fmt::format("{} {} {} {}", c.node, c.id, c.subject, verdict_name(c.verdict)));
  return out;
}

std::string table(const RingReport& r) {
  return format_report_table(r, false);
}

const CheckResult* row(const RingReport& r, const std::string& node, const std::string& id,
                       const std::string& subject) {
  for (const auto& c : r.checks)
    if (c.node == node && c.id == id && c.subject == subject) return &c;
  return nullptr;
}

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// A scenario copied to a temporary directory, so a test can plant files or apply a fix.
struct Copy {
  test::TempDir dir{"spark-preflight-inputs"};
  explicit Copy(const std::string& scenario) {
    fs::copy(fx(scenario), dir.path(),
             fs::copy_options::recursive | fs::copy_options::copy_symlinks);
  }
  std::string node(int i) const { return dir / fmt::format("node{}", i); }
  std::string cluster() const { return read_file(dir / "cluster.env").value_or(""); }
};

RingReport replay_dirs(const RingConfig& cfg, const std::string& n0, const std::string& n1) {
  return replay_ring(cfg, {n0, n1}, {}, false);
}

RingReport replay_copy(const Copy& c, const std::string& cluster_text) {
  test::TempDir t("spark-preflight-cfg");
  auto cfg = load_ok(t, cluster_text);
  return replay_dirs(cfg, c.node(0), c.node(1));
}

// Runs `fn` with a deadline, so a probe that blocks fails the test instead of hanging it.
template <typename F>
auto within(std::chrono::seconds limit, F fn) -> std::optional<decltype(fn())> {
  using T = decltype(fn());
  auto p = std::make_shared<std::promise<T>>();
  auto f = p->get_future();
  std::thread([p, fn]() mutable { p->set_value(fn()); }).detach();
  if (f.wait_for(limit) != std::future_status::ready) return std::nullopt;
  return f.get();
}

// Applies every `set KEY=VALUE [and KEY=VALUE]` of a fix to a cluster file's text: replaces
// the key's line, or appends one. Returns how many settings it applied.
int apply_set_fixes(std::string* cluster, const std::string& fix) {
  static const std::regex set_re(
      R"(set ([A-Z][A-Z0-9_]*=[^\s;()`]*)((?: and [A-Z][A-Z0-9_]*=[^\s;()`]*)*))");
  int n = 0;
  for (std::sregex_iterator it(fix.begin(), fix.end(), set_re), end; it != end; ++it) {
    std::string all = (*it)[1].str() + (*it)[2].str();
    for (auto& kv : split_list(std::regex_replace(all, std::regex(" and "), " "), ' ')) {
      while (!kv.empty() && (kv.back() == ',' || kv.back() == '.')) kv.pop_back();
      auto eq = kv.find('=');
      std::string key = kv.substr(0, eq);
      std::regex line("(^|\n)" + key + "=[^\n]*");
      if (std::regex_search(*cluster, line))
        *cluster = std::regex_replace(*cluster, line, "$1" + kv);
      else
        *cluster += kv + "\n";
      ++n;
    }
  }
  return n;
}

// The ring as the fixtures' baseline has it: only rank 0's node binds ports.
const std::set<std::string> kBaseline = {"spark-b port.free  SKIP"};

}  // namespace

// ---- the probe that no file can break ----

TEST_CASE("reads: a FIFO in the tree is refused at once, named, and the report comes out") {
  Copy c("healthy-pair");
  fs::remove(c.node(1) + "/proc/meminfo");
  REQUIRE(::mkfifo((c.node(1) + "/proc/meminfo").c_str(), 0644) == 0);
  fs::remove(c.node(1) + "/sys/class/net/enp1s0f0np0/mtu");
  REQUIRE(::mkfifo((c.node(1) + "/sys/class/net/enp1s0f0np0/mtu").c_str(), 0644) == 0);
  auto text = c.cluster();
  auto r = within(std::chrono::seconds(20), [&] { return replay_copy(c, text); });
  REQUIRE_MESSAGE(r.has_value(), "preflight blocked on a FIFO");
  const auto* mem = row(*r, "spark-b", "mem", "");
  REQUIRE(mem);
  CHECK(mem->verdict == Verdict::fail);
  const auto* rd = row(*r, "spark-b", "sys.read", "/proc/meminfo");
  REQUIRE_MESSAGE(rd, table(*r));
  CHECK(rd->verdict == Verdict::fail);
  CHECK(has(rd->message, "a FIFO, not a regular file"));
  CHECK(has(rd->message, c.node(1) + "/proc/meminfo"));
  CHECK(row(*r, "spark-b", "sys.read", "/sys/class/net/enp1s0f0np0/mtu"));
  CHECK(row(*r, "spark-a", "sys.read", "")->verdict == Verdict::pass);
}

TEST_CASE("reads: /dev/zero as meminfo and an oversize file are refused, not read forever") {
  Copy c("healthy-pair");
  fs::remove(c.node(1) + "/proc/meminfo");
  fs::create_symlink("/dev/zero", c.node(1) + "/proc/meminfo");
  // A regular file far over the cap (sparse: no disk used).
  std::string big = c.node(1) + "/sys/kernel/mm/transparent_hugepage/enabled";
  REQUIRE(::truncate(big.c_str(), 1ll << 30) == 0);
  auto text = c.cluster();
  auto r = within(std::chrono::seconds(20), [&] { return replay_copy(c, text); });
  REQUIRE_MESSAGE(r.has_value(), "preflight read an endless file");
  const auto* z = row(*r, "spark-b", "sys.read", "/proc/meminfo");
  REQUIRE_MESSAGE(z, table(*r));
  CHECK(has(z->message, "a character device, not a regular file"));
  const auto* b = row(*r, "spark-b", "sys.read", "/sys/kernel/mm/transparent_hugepage/enabled");
  REQUIRE(b);
  CHECK(has(b->message, fmt::format("larger than {} bytes", kSysfsReadCap)));
  CHECK(row(*r, "spark-b", "mem", "")->verdict == Verdict::fail);
}

TEST_CASE("reads: a read that blocks in the kernel is abandoned at its deadline") {
  test::TempDir t("spark-read-deadline");
  std::string fifo = t / "fault_inject_blocking";
  REQUIRE(::mkfifo(fifo.c_str(), 0644) == 0);
  // fault_inject: a blocking open of a FIFO with no writer stands in for a wedged driver.
  auto opened = std::make_shared<std::atomic<bool>>(false);
  auto r = call_with_deadline(
      [fifo, opened]() -> Result<std::string> {
        int fd = ::open(fifo.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd >= 0) ::close(fd);
        *opened = true;
        return std::string("opened");
      },
      std::chrono::milliseconds(200));
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code == Errc::timeout);
  CHECK(has(r.error().message, "no answer within 200 ms"));
  // The call came back while the open was still blocked (no writer has opened the FIFO
  // yet): the deadline ended the wait, not the read.
  CHECK_FALSE(opened->load());
  // Let the abandoned reader finish (a writer end opens the FIFO for it).
  int w = ::open(fifo.c_str(), O_WRONLY | O_CLOEXEC);
  if (w >= 0) ::close(w);
  // The bounded reader itself never opens a FIFO, so it never needs the deadline for one.
  auto f = read_file_bounded(fifo, 1024, std::chrono::milliseconds(5000));
  REQUIRE_FALSE(f.ok());
  CHECK(has(f.error().message, "a FIFO"));
}

TEST_CASE("reads: a symlink loop inside the tree is named, without a 'did you mean' itself") {
  Copy c("healthy-pair");
  std::string hca = c.node(1) + "/sys/class/infiniband/rocep1s0f1";
  fs::remove_all(hca);
  fs::create_symlink("rocep1s0f1", hca);  // points at itself: ELOOP
  auto r = replay_copy(c, c.cluster());
  const auto* d = row(r, "spark-b", "rdma.devices", "rocep1s0f1");
  REQUIRE_MESSAGE(d, table(r));
  CHECK(d->verdict == Verdict::fail);
  CHECK(has(d->message, "symlink loop (ELOOP)"));
  CHECK(has(d->message, "/sys/class/infiniband/rocep1s0f1"));
  CHECK_FALSE(has(d->fix, "did you mean"));
  const auto* rd = row(r, "spark-b", "sys.read", "/sys/class/infiniband/rocep1s0f1");
  REQUIRE(rd);
  CHECK(has(rd->message, "ELOOP"));
}

TEST_CASE("reads: bytes that are not UTF-8 are escaped where they are shown") {
  CHECK(escape_invalid_utf8("up") == "up");
  CHECK(escape_invalid_utf8("LinkUp\xff\xfe") == "LinkUp\\xFF\\xFE");
  CHECK(escape_invalid_utf8("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80") ==
        "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");
  CHECK(escape_invalid_utf8("\xc0\xaf") == "\\xC0\\xAF");           // overlong
  CHECK(escape_invalid_utf8("\xed\xa0\x80") == "\\xED\\xA0\\x80");  // surrogate
  CHECK(escape_invalid_utf8("\xe2\x82") == "\\xE2\\x82");           // cut short
  std::vector<std::string> dirs;
  auto cfg_r = [&] {
    std::vector<Diagnostic> d;
    return load_config(fx("bad-utf8") + "/cluster.env", Environment{}, &d);
  }();
  REQUIRE(cfg_r.ok());
  auto r = replay_ring(*cfg_r, {fx("bad-utf8") + "/node0", fx("bad-utf8") + "/node1"}, {}, true);
  CHECK(not_pass(r) == kBaseline);
  CHECK(has(row(r, "spark-b", "rdma.port", "rocep1s0f0:1")->message, "5: LinkUp\\xFF\\xFE"));
  CHECK(has(row(r, "spark-b", "sys", "thp")->message, "madvise\\xC3("));
  // The whole report, raw tables included, renders as JSON.
  CHECK_NOTHROW((void)ring_report_to_json(r, true).dump());
}

// ---- the right cause and the right fix ----

TEST_CASE("gid-other-twin: the entry is this node's other twin's address, not a RoCE v1 problem") {
  for (const char* gid : {"3", "auto"}) {
    CAPTURE(gid);
    Copy c("gid-other-twin");
    std::string text = std::regex_replace(c.cluster(), std::regex("NODE1_GID_INDEX=3"),
                                          std::string("NODE1_GID_INDEX=") + gid);
    auto r = replay_copy(c, text);
    std::set<std::string> want = kBaseline;
    want.insert("spark-b rdma.gid rocep1s0f0:1 FAIL");
    CHECK(not_pass(r) == want);
    const auto* g = row(r, "spark-b", "rdma.gid", "rocep1s0f0:1");
    REQUIRE(g);
    CHECK(has(g->message, "[other_twin]"));
    CHECK(has(g->message, "::ffff:10.10.3.2"));
    CHECK(has(g->message, "this node's other twin enp1s0f1np1 (rocep1s0f1)"));
    CHECK_FALSE(has(g->message, "node spark-a"));
    CHECK_FALSE(has(g->fix, "enable RoCE v2"));
    CHECK(has(g->fix, "10.10.2.2 on enp1s0f0np0, 10.10.3.2 on enp1s0f1np1"));
    CHECK(has(g->fix, "cross-cabled"));
    // Applying the fix as it says (the address back on its own netdev, so the table holds
    // this port's RoCE v2 entry again) makes preflight pass.
    std::string gids = c.node(1) + "/sys/class/infiniband/rocep1s0f0/ports/1/gids/3";
    write_file_atomic(gids, "0000:0000:0000:0000:0000:ffff:0a0a:0202\n", nullptr);
    CHECK(not_pass(replay_copy(c, text)) == kBaseline);
  }
}

TEST_CASE("gid-junk: an unparseable GID file is named with its path, pinned or auto") {
  for (const char* gid : {"3", "auto"}) {
    CAPTURE(gid);
    Copy c("gid-junk");
    std::string text = std::regex_replace(c.cluster(), std::regex("NODE1_GID_INDEX=3"),
                                          std::string("NODE1_GID_INDEX=") + gid);
    auto r = replay_copy(c, text);
    const auto* g = row(r, "spark-b", "rdma.gid", "rocep1s0f0:1");
    REQUIRE(g);
    CHECK(g->verdict == Verdict::fail);
    CHECK(has(g->message, "[unparseable]"));
    CHECK(has(g->message,
              "/sys/class/infiniband/rocep1s0f0/ports/1/gids/3 holds 'fe80:zzzz:not a gid'"));
    CHECK_FALSE(has(g->message, "all-zero"));
    CHECK_FALSE(has(g->fix, "enable RoCE v2"));
    CHECK_FALSE(r.nodes[1].links[0].gid_index.has_value());
  }
}

TEST_CASE("hca-shared-netdev: two HCAs on one netdev, and a fix the config check accepts") {
  Copy c("hca-shared-netdev");
  auto r = replay_copy(c, c.cluster());
  std::set<std::string> want = kBaseline;
  want.insert(
      {"spark-b rdma.netdev rocep1s0f1 FAIL", "spark-b rdma.netdev shared enp1s0f0np0 FAIL"});
  CHECK(not_pass(r) == want);
  const auto* s = row(r, "spark-b", "rdma.netdev", "shared enp1s0f0np0");
  REQUIRE(s);
  CHECK(has(s->message, "rocep1s0f0 and rocep1s0f1 both map to netdev enp1s0f0np0"));
  // The old fix ("list NETDEVS in the order of HCAS") would have been NETDEVS=x,x.
  for (const auto& ch : r.checks) CHECK_FALSE(has(ch.fix, "enp1s0f0np0,enp1s0f0np0"));
  // That list is refused by the config check.
  test::TempDir t("spark-shared");
  std::vector<Diagnostic> d;
  auto bad = load_text(t,
                       std::regex_replace(c.cluster(), std::regex("NODE1_NETDEVS=[^\n]*"),
                                          "NODE1_NETDEVS=enp1s0f0np0,enp1s0f0np0"),
                       &d);
  CHECK_FALSE(bad.ok());
  bool named = false;
  for (const auto& x : d) named = named || has(x.message, "NODE1_NETDEVS lists enp1s0f0np0 twice");
  CHECK(named);
}

TEST_CASE("every suggested fix is accepted by config check, applied, and clears its rows") {
  // Each scenario: apply every fix of every FAIL and WARN row as it says (`set KEY=VALUE`
  // in the cluster file, NODE<i>_HCAS swaps, `ip addr del/add` moves with the GID entries
  // they drop and add, vm.nr_hugepages, sync, evict, drop_caches: see preflight_tree.h),
  // re-run config check (a refused value fails here) and preflight, and again while fixes
  // still change something. It must settle within three rounds with no FAIL left:
  // no fix the tool would refuse, no fix that only moves the failure (or brings one back).
  // The rings of every fault class replay their fixes in preflight_rings_test.cc.
  for (const char* scenario : {"hca-other-netdev", "hca-shared-netdev", "zero-gid", "gid-moved",
                               "head4-worker3", "uma-page-cache", "low-mem", "ipv6-only"}) {
    CAPTURE(scenario);
    auto ring = spark::test::RingTree::scenario(scenario);
    test::TempDir t("spark-fix-replay");
    auto replay = [&] {
      auto cfg = load_ok(t, ring.cluster());
      return replay_dirs(cfg, ring.node(0), ring.node(1));
    };
    auto settled = spark::test::settle(ring, replay);
    CHECK(settled.rounds < 3);
    std::string why = table(settled.report) + "\n" + ring.cluster();
    // What is left is a warning whose fix is a person's (the idle twin's "line the tables
    // up first"), never a failure.
    for (const auto& ch : settled.report.checks) CHECK_MESSAGE(ch.verdict != Verdict::fail, why);
    if (std::string(scenario) != "head4-worker3") CHECK(settled.applied > 0);
  }
}

namespace {
// Applies mem's fix to a captured node as the message says: `sparkctl evict` frees the
// model's resident pages; drop_caches frees the other files' clean cache.
void apply_mem_fix(const std::string& node_dir, const std::string& fix) {
  auto mi_text = read_file(node_dir + "/proc/meminfo").value_or("");
  std::map<std::string, uint64_t> kb;
  std::vector<std::string> order;
  for (const auto& line : split_list(mi_text, '\n')) {
    auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string k = line.substr(0, colon);
    kb[k] = parse_u64(split_list(trim(line.substr(colon + 1)), ' ')[0]).value_or(0);
    order.push_back(k);
  }
  auto facts = json::parse(read_file(node_dir + "/facts.json").value_or("{}"));
  uint64_t model = facts["page_cache"]["resident_bytes"].get<uint64_t>() / 1024;
  if (has(fix, "sparkctl evict")) {
    kb["Cached"] -= model;
    kb["MemFree"] += model;
    facts["page_cache"]["resident_bytes"] = 0;
    model = 0;
  }
  if (has(fix, "drop_caches")) {
    uint64_t other = kb["Cached"] - model;
    kb["Cached"] -= other;
    kb["MemFree"] += other;
  }
  kb["MemAvailable"] = std::max(kb["MemAvailable"], kb["MemFree"]);
  std::string out;
  for (const auto& k : order) out += fmt::format("{}: {} kB\n", k, kb[k]);
  write_file_atomic(node_dir + "/proc/meminfo", out, nullptr);
  write_file_atomic(node_dir + "/facts.json", facts.dump(1), nullptr);
}
}  // namespace

TEST_CASE("uma-page-cache: the page cache is attributed and the fix clears the shortfall") {
  Copy c("uma-page-cache");
  auto r = replay_copy(c, c.cluster());
  const auto* m = row(r, "spark-a", "mem", "");
  REQUIRE(m);
  CHECK(m->verdict == Verdict::fail);
  CHECK(has(m->message, "MemFree 3.00 GiB < MEM_FREE_MIN 8.00 GiB; short by 5.00 GiB"));
  CHECK(
      has(m->message, "page cache 49.00 GiB (2.00 GiB the model's files, 47.00 GiB other files)"));
  CHECK(has(m->message,
            "on unified memory the GPU sees MemFree 3.00 GiB (not MemAvailable 50.00 GiB)"));
  CHECK(has(m->fix, "sparkctl evict"));
  CHECK(has(m->fix, "sudo sh -c 'sync; echo 1 > /proc/sys/vm/drop_caches'"));
  CHECK(has(m->fix, "needs root"));

  SUBCASE("evicting the model's 2 GiB alone cannot clear a 5 GiB shortfall") {
    apply_mem_fix(c.node(0), "sparkctl evict");
    auto again = replay_copy(c, c.cluster());
    CHECK(row(again, "spark-a", "mem", "")->verdict == Verdict::fail);
  }
  SUBCASE("the fix as given clears it") {
    apply_mem_fix(c.node(0), m->fix);
    auto again = replay_copy(c, c.cluster());
    CHECK_MESSAGE(row(again, "spark-a", "mem", "")->verdict == Verdict::pass, table(again));
  }
  SUBCASE("with the default limits it is a warning, not a pass") {
    std::string text =
        std::regex_replace(c.cluster(), std::regex("MEM_(FREE|AVAILABLE)_MIN=[^\n]*\n"), "");
    auto d = replay_copy(c, text);
    const auto* w = row(d, "spark-a", "mem", "");
    REQUIRE(w);
    CHECK(w->verdict == Verdict::warn);
    CHECK(has(w->message, "49.00 GiB of page cache holds memory the GPU cannot use"));
    CHECK(has(w->fix, "drop_caches"));
    apply_mem_fix(c.node(0), w->fix);
    CHECK(row(replay_copy(c, text), "spark-a", "mem", "")->verdict == Verdict::pass);
  }
}

TEST_CASE("low-mem: when the model's cache covers the shortfall, evict alone is the fix") {
  Copy c("low-mem");
  auto r = replay_copy(c, c.cluster());
  const auto* m = row(r, "spark-a", "mem", "");
  REQUIRE(m);
  CHECK(has(m->fix, "sparkctl evict"));
  CHECK_FALSE(has(m->fix, "drop_caches"));
  apply_mem_fix(c.node(0), m->fix);
  // The shortfall is gone; on unified memory the other files' 49 GiB still warn, with the
  // fix for that.
  auto again = replay_copy(c, c.cluster());
  const auto* w = row(again, "spark-a", "mem", "");
  REQUIRE(w);
  CHECK(w->verdict == Verdict::warn);
  CHECK(has(w->fix, "drop_caches"));
  apply_mem_fix(c.node(0), w->fix);
  CHECK(row(replay_copy(c, c.cluster()), "spark-a", "mem", "")->verdict == Verdict::pass);
}

TEST_CASE("port-down: env --rank refuses a DOWN twin, and its fix renders") {
  Copy c("port-down");
  test::TempDir t("spark-down");
  auto cfg = load_ok(t, c.cluster());
  auto rep = run_node_checks(cfg, 1, Sysroot(c.node(1)), {}, false);
  REQUIRE(rep.links.size() == 2);
  CHECK(rep.links[1].port_state == "1: DOWN");
  CHECK(rep.links[1].gid_index.has_value());  // the table is still there: not enough
  auto e = render_rank_env(cfg, 1, rep);
  REQUIRE_FALSE(e.ok());
  CHECK(e.error().code == Errc::precondition);
  CHECK(has(e.error().message, "spark-b rocep1s0f1: port 1 is 1: DOWN"));
  CHECK(has(e.error().message, "NCCL_IB_HCA"));
  // The fix it names (the other twin alone) is accepted and renders.
  std::string text = c.cluster();
  REQUIRE(apply_set_fixes(&text, e.error().message) == 2);
  auto cfg2 = load_ok(t, text);
  auto rep2 = run_node_checks(cfg2, 1, Sysroot(c.node(1)), {}, false);
  auto e2 = render_rank_env(cfg2, 1, rep2);
  REQUIRE_MESSAGE(e2.ok(), e2.error().message);
  CHECK(e2->get("NCCL_IB_HCA") == "=rocep1s0f0:1");
}

// ---- known-bad versions (sw.known_bad, kho folded in) ----

TEST_CASE("sw.known_bad: kernel 7.0 without kho=off fails with the NCCL symptom, 6.x warns") {
  auto run = [](const std::string& s) {
    std::vector<Diagnostic> d;
    auto cfg = load_config(fx(s) + "/cluster.env", Environment{}, &d);
    REQUIRE(cfg.ok());
    return replay_ring(*cfg, {fx(s) + "/node0", fx(s) + "/node1"}, {}, false);
  };
  auto r7 = run("kho-missing-7");
  auto want = kBaseline;
  want.insert("spark-b sw.known_bad kernel FAIL");
  CHECK(not_pass(r7) == want);
  const auto* k = row(r7, "spark-b", "sw.known_bad", "kernel");
  REQUIRE(k);
  CHECK(has(k->message, "kernel 7.0.0-1019-nvidia without kho=off"));
  CHECK(has(k->message, "ENOMEM in ibv_reg_mr"));
  CHECK(has(k->message, "kernel-7.0-kho; source: https://"));
  CHECK(has(k->fix, "kho=off"));
  auto r6 = run("kho-missing-6");
  want = kBaseline;
  want.insert("spark-b sw.known_bad kernel WARN");
  CHECK(not_pass(r6) == want);
  // The healthy pair has kho=off: the entry is defused, and says so.
  auto ok = run("healthy-pair");
  CHECK(has(row(ok, "spark-a", "sw.known_bad", "kernel")->message,
            "kho=off is on the kernel command line"));
}

TEST_CASE("sw.known_bad: without RDMA kho does not matter") {
  test::TempDir t("spark-kb-nordma");
  auto text = read_file(fx("kho-missing-7") + "/cluster.env").value_or("");
  text = std::regex_replace(text, std::regex("NODE1_(HCAS|NETDEVS)=[^\n]*\n"), "");
  auto cfg = load_ok(t, text);
  auto rep = run_node_checks(cfg, 1, Sysroot(fx("kho-missing-7") + "/node1"), {}, false);
  bool seen = false;
  for (const auto& c : rep.checks)
    if (c.id == "sw.known_bad" && c.subject == "kernel") {
      seen = true;
      CHECK(c.verdict == Verdict::pass);
      CHECK(has(c.message, "kernel-7.0-kho applies only with RDMA"));
    }
  CHECK(seen);
}

TEST_CASE("known-bad list: the built-in copy is the repository's file, and it is valid") {
  auto file = read_file(std::string(SPARK_SOURCE_DIR) + "/env/known_bad.json");
  REQUIRE(file);
  auto parsed = parse_known_bad(*file, "file");
  REQUIRE_MESSAGE(parsed.ok(), parsed.error().message);
  const auto& built = builtin_known_bad();
  CHECK(built.origin == "built-in");
  REQUIRE(built.entries.size() == parsed->entries.size());
  for (size_t i = 0; i < built.entries.size(); ++i) {
    CHECK(built.entries[i].id == parsed->entries[i].id);
    CHECK(built.entries[i].versions == parsed->entries[i].versions);
    CHECK_FALSE(built.entries[i].sources.empty());
  }
}

TEST_CASE("known-bad list: versions compare field by field, bad entries are named") {
  CHECK(*version_matches("7.0.0-1019-nvidia", ">=7.0"));
  CHECK_FALSE(*version_matches("6.17.0-1032-nvidia", ">=7.0"));
  CHECK(*version_matches("6.17.13", "<7.0"));
  CHECK(*version_matches("2.19.3", ">=2.19,<2.19.4"));
  CHECK_FALSE(*version_matches("2.19.4", ">=2.19,<2.19.4"));
  CHECK(*version_matches("28.39.1002", "=28.39.1002"));
  CHECK(*version_matches("580.95.05", "*"));
  CHECK_FALSE(*version_matches("unknown", "*"));
  CHECK_FALSE(version_matches("1.0", "~1.0").ok());
  CHECK_FALSE(version_matches("1.0", ">=1.x").ok());
  auto entry = [](const std::string& fields) {
    return fmt::format(R"({{"schema":1,"entries":[{{{}}}]}})", fields);
  };
  std::string good =
      R"("id":"x","component":"nccl","versions":"<2.20","verdict":"WARN","symptom":"s","fix":"f","sources":["u"])";
  CHECK(parse_known_bad(entry(good), "t").ok());
  auto err = [&](const std::string& fields) {
    auto r = parse_known_bad(entry(fields), "t.json");
    return r.ok() ? std::string() : r.error().message;
  };
  CHECK(has(err(std::regex_replace(good, std::regex("\"nccl\""), "\"bios\"")), "component 'bios'"));
  CHECK(has(err(std::regex_replace(good, std::regex("<2.20"), "newer")), "versions:"));
  CHECK(has(err(std::regex_replace(good, std::regex(R"(\["u"\])"), "[]")), "at least one source"));
  CHECK(has(err(std::regex_replace(good, std::regex("WARN"), "INFO")), "FAIL or WARN"));
  CHECK(err(good).empty());
  CHECK(has(err(std::regex_replace(good, std::regex(R"("fix":"f",)"), "")), "\"fix\" is required"));
  CHECK(has(err(std::regex_replace(good, std::regex(R"("id":"x",)"), "")), "entry 1"));
  auto dup =
      parse_known_bad(fmt::format(R"({{"schema":1,"entries":[{{{}}},{{{}}}]}})", good, good), "t");
  REQUIRE_FALSE(dup.ok());
  CHECK(has(dup.error().message, "entry 2 (x): id 'x' is used twice"));
}

TEST_CASE("KNOWN_BAD_FILE adds driver and firmware entries, each row naming its source") {
  test::TempDir t("spark-kb-extra");
  t.write("extra.json", R"({"schema":1,"entries":[
    {"id":"drv-test","component":"driver","versions":">=580.95,<580.96","verdict":"FAIL",
     "symptom":"hangs at init","fix":"install 580.96","sources":["https://example.org/drv"]},
    {"id":"fw-test","component":"firmware","versions":"=28.45.4028","verdict":"WARN",
     "symptom":"link flaps","fix":"mlxfwmanager -u","sources":["https://example.org/fw"]}]})");
  auto text = read_file(fx("healthy-pair") + "/cluster.env").value_or("");
  text += "KNOWN_BAD_FILE=" + (t / "extra.json") + "\n";
  auto cfg = load_ok(t, text);
  auto r = replay_dirs(cfg, fx("healthy-pair") + "/node0", fx("healthy-pair") + "/node1");
  const auto* d = row(r, "spark-a", "sw.known_bad", "driver");
  REQUIRE(d);
  CHECK(d->verdict == Verdict::fail);
  CHECK(has(d->message, "driver 580.95.05 is known bad (driver >=580.95,<580.96): hangs at init"));
  CHECK(has(d->message, "source: https://example.org/drv"));
  CHECK(d->fix == "install 580.96");
  const auto* f = row(r, "spark-b", "sw.known_bad", "firmware rocep1s0f1");
  REQUIRE(f);
  CHECK(f->verdict == Verdict::warn);
  // A broken extra file is one FAIL row naming it, not a crash.
  t.write("extra.json", "{\"schema\":1,\"entries\":[{\"id\":3}]}");
  auto r2 = replay_dirs(cfg, fx("healthy-pair") + "/node0", fx("healthy-pair") + "/node1");
  const auto* b = row(r2, "spark-a", "sw.known_bad", "");
  REQUIRE(b);
  CHECK(has(b->message, t / "extra.json"));
}

TEST_CASE("the sparkctl binary carries the known-bad list (run from another directory)") {
  ProcessSpec ps;
  ps.argv = {std::string(SPARK_BINARY_DIR) + "/cli/sparkctl",
             "--config",
             fx("kho-missing-7") + "/cluster.env",
             "--json",
             "preflight",
             "--only",
             "sw.known_bad",
             "--sysroot",
             fx("kho-missing-7") + "/node0",
             "--sysroot",
             fx("kho-missing-7") + "/node1"};
  ps.cwd = "/";
  ps.timeout = std::chrono::milliseconds(30000);
  auto r = run_process(ps);
  REQUIRE(r.ok());
  CHECK(r->exit_status == 1);
  auto j = json::parse(r->out, nullptr, false);
  REQUIRE(j.is_object());
  bool found = false;
  for (const auto& c : j["checks"])
    if (c["node"] == "spark-b" && c["subject"] == "kernel") {
      found = true;
      CHECK(c["verdict"] == "FAIL");
      CHECK(has(c["message"].get<std::string>(), "ENOMEM in ibv_reg_mr"));
    }
  CHECK(found);
}

TEST_CASE("fuzz corpus: every fuzz_node_report seed goes through the parsers it targets") {
  int n = 0;
  for (const auto& e : fs::directory_iterator(std::string(SPARK_SOURCE_DIR) +
                                              "/tests/fuzz/corpus/fuzz_node_report")) {
    auto data = read_file(e.path().string());
    REQUIRE(data.has_value());
    INFO(e.path().filename().string());
    std::string esc = escape_invalid_utf8(*data);
    CHECK_NOTHROW((void)json(esc).dump());
    CHECK(escape_invalid_utf8(esc) == esc);
    (void)parse_meminfo(*data);
    std::array<uint8_t, 16> g{};
    (void)parse_gid(*data, &g);
    if (auto nl = data->find('\n'); nl != std::string::npos)
      (void)version_matches(data->substr(0, nl), data->substr(nl + 1));
    (void)parse_known_bad(*data, "corpus");
    ++n;
  }
  CHECK(n >= 9);
  auto kb = read_file(std::string(SPARK_SOURCE_DIR) +
                      "/tests/fuzz/corpus/fuzz_node_report/known-bad.json");
  REQUIRE(kb);
  CHECK(parse_known_bad(*kb, "seed").ok());
  CHECK(*version_matches("7.0.0-1019-nvidia", ">=7.0,<7.1,=7.0.0,*"));
}
