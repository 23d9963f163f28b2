// Unit tests of the preflight pieces: GID resolution, rank environments,
// the cross-node merge, pings and bandwidth verdicts, live facts, capture and replay.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <sstream>

#include "cli/cli.h"
#include "cli/cmd_preflight.h"
#include "core/strings.h"
#include "env/capture.h"
#include "env/facts.h"
#include "env/meminfo.h"
#include "env/model_files.h"
#include "env/plan.h"
#include "env/preflight.h"
#include "env/rank_env.h"
#include "env/rdma.h"
#include "support/tempdir.h"

using namespace spark;
using namespace spark::env;

namespace {

GidEntry gid(int index, const std::string& raw, const std::string& type) {
  GidEntry e;
  e.index = index;
  e.raw = raw;
  REQUIRE(parse_gid(raw, &e.bytes));
  e.type = type;
  e.ndev = "enp1s0f1np1";
  return e;
}

const std::string kZero = "0000:0000:0000:0000:0000:0000:0000:0000";
const std::string kLL = "fe80:0000:0000:0000:0000:0000:0000:0b02";
std::string v4(const char* hex) {
  return std::string("0000:0000:0000:0000:0000:ffff:") + hex;
}

Hca hca_with(std::vector<GidEntry> gids) {
  Hca h;
  h.name = "rocep1s0f1";
  h.netdevs = {"enp1s0f1np1"};
  RdmaPort p;
  p.port = 1;
  p.gids = std::move(gids);
  h.ports.push_back(p);
  return h;
}

const std::vector<std::pair<std::string, std::string>> kOthers = {{"spark-a", "10.10.2.1"}};

RingConfig ring(const std::string& text) {
  auto cfg = load_config_text(text, "t.env", Environment{}, nullptr);
  REQUIRE_MESSAGE(cfg.ok(), cfg.error().message);
  return *cfg;
}

}  // namespace

TEST_CASE("parse_gid reads sysfs GIDs and rejects malformed ones") {
  std::array<uint8_t, 16> b{};
  CHECK(parse_gid(v4("0a0a:0202"), &b));
  CHECK(b[12] == 10);
  CHECK(b[15] == 2);
  CHECK_FALSE(parse_gid("fe80::1", &b));
  CHECK_FALSE(parse_gid("0000:0000:0000:0000:0000:ffff:0a0a:02zz", &b));
  auto e = gid(3, v4("0a0a:0202"), "RoCE v2");
  CHECK(e.ipv4_mapped());
  CHECK(e.ipv4() == "10.10.2.2");
  CHECK(e.text() == "::ffff:10.10.2.2");
}

TEST_CASE("resolve_roce_gid: the message names the HCA, what it saw and the fix, word for word") {
  auto h = hca_with({gid(0, kLL, "IB/RoCE v1"), gid(1, kLL, "RoCE v2"),
                     gid(2, v4("0a0a:0202"), "IB/RoCE v1"), gid(3, kZero, ""),
                     gid(4, v4("0a0a:0202"), "RoCE v2")});
  auto r = resolve_roce_gid(h, 1, "10.10.2.2", 3, kOthers, "NODE1_GID_INDEX");
  CHECK(r.fault == GidFault::all_zero);
  CHECK(r.message ==
        "rocep1s0f1 port 1: GID index 3 is all-zero; RoCE v2 ::ffff:10.10.2.2 is at index 4");
  CHECK(r.fix == "set NODE1_GID_INDEX=4 or leave it auto");
  CHECK(r.index == 4);
  CHECK(r.usable() == std::nullopt);  // fail closed until the config is fixed
  auto a = resolve_roce_gid(h, 1, "10.10.2.2", std::nullopt, kOthers, "NODE1_GID_INDEX");
  CHECK(a.ok());
  CHECK(a.usable() == 4);
  auto c = resolve_roce_gid(h, 1, "10.10.2.2", 4, kOthers, "NODE1_GID_INDEX");
  CHECK(c.ok());
}

TEST_CASE("resolve_roce_gid: another node's address, in auto mode and at the configured index") {
  auto h = hca_with({gid(0, kLL, "IB/RoCE v1"), gid(1, kLL, "RoCE v2"),
                     gid(2, v4("0a0a:0201"), "IB/RoCE v1"), gid(3, v4("0a0a:0201"), "RoCE v2")});
  auto a = resolve_roce_gid(h, 1, "10.10.2.2", std::nullopt, kOthers, "NODE1_GID_INDEX");
  CHECK(a.fault == GidFault::other_node);
  CHECK(a.message.find("node spark-a's fabric address") != std::string::npos);
  auto c = resolve_roce_gid(h, 1, "10.10.2.2", 3, kOthers, "NODE1_GID_INDEX");
  CHECK(c.fault == GidFault::other_node);
  CHECK(c.message.find("GID index 3 holds ::ffff:10.10.2.1, node spark-a's fabric address") !=
        std::string::npos);
  CHECK_FALSE(c.fix.empty());
}

TEST_CASE("resolve_roce_gid: an empty table fails closed, a missing port is named") {
  auto h = hca_with({gid(0, kZero, ""), gid(1, kZero, "")});
  auto r = resolve_roce_gid(h, 1, "10.10.2.2", std::nullopt, kOthers, "NODE1_GID_INDEX");
  CHECK(r.fault == GidFault::not_found);
  CHECK(r.usable() == std::nullopt);
  CHECK(r.fix.find("10.10.2.2") != std::string::npos);
  auto p = resolve_roce_gid(h, 2, "10.10.2.2", std::nullopt, kOthers, "NODE1_GID_INDEX");
  CHECK(p.message == "rocep1s0f1 port 2: no such port");
  CHECK(format_gid_table(hca_with({gid(3, v4("0a0a:0202"), "RoCE v2"), gid(4, kZero, "")})) ==
        "hca_id: rocep1s0f1\n  port: 1\n    state: \n    phys_state: \n    link_layer: \n"
        "    GID[  3]: ::ffff:10.10.2.2, RoCE v2, enp1s0f1np1\n");
}

TEST_CASE("rank env: pins from the node's facts; fails closed without a usable GID") {
  auto cfg = ring(
      "NODE0_SSH=local\nNODE0_FABRIC_IP=127.0.0.1\nNODE1_SSH=b\nNODE1_FABRIC_IP=10.10.2.2\n"
      "NODE1_NETDEVS=enp1s0f0np0,enp1s0f1np1\nNODE1_HCAS=rocep1s0f0,rocep1s0f1\nNODE1_GPUS=0,1\n");
  NodeReport n1;
  n1.node = "node1";
  n1.index = 1;
  n1.links = {{"rocep1s0f0", "enp1s0f0np0", "10.10.2.2", 9000, "up", 200000, 3, "4: ACTIVE"},
              {"rocep1s0f1", "enp1s0f1np1", "10.10.3.2", 9000, "up", 200000, 3, "4: ACTIVE"}};
  auto e = render_rank_env(cfg, 2, n1);
  REQUIRE_MESSAGE(e.ok(), e.error().message);
  CHECK(e->get("RANK") == "2");
  CHECK(e->get("WORLD_SIZE") == "3");
  CHECK(e->get("LOCAL_RANK") == "1");
  CHECK(e->get("CUDA_VISIBLE_DEVICES") == "1");
  CHECK(e->get("NCCL_IB_HCA") == "=rocep1s0f0:1,rocep1s0f1:1");
  CHECK(e->get("NCCL_IB_GID_INDEX") == "3");
  CHECK(e->get("NCCL_SOCKET_IFNAME") == "=enp1s0f0np0");
  CHECK(e->get("GLOO_SOCKET_IFNAME") == "enp1s0f0np0");
  CHECK(e->get("MASTER_ADDR") == "127.0.0.1");
  CHECK(e->get("NCCL_NVLS_ENABLE") == "0");  // off unless the cluster file turns it on
  CHECK(e->to_shell().find("export NCCL_IB_GID_INDEX='3'\n") != std::string::npos);

  n1.links[1].gid_index = std::nullopt;
  auto missing = render_rank_env(cfg, 1, n1);
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.error().code == Errc::precondition);
  CHECK(missing.error().message.find("node1 rocep1s0f1: no usable RoCE v2 GID index") !=
        std::string::npos);
  n1.links[1].gid_index = 4;
  auto differ = render_rank_env(cfg, 1, n1);
  REQUIRE_FALSE(differ.ok());
  CHECK(differ.error().message.find("one value per process") != std::string::npos);

  NodeReport n0;
  n0.node = "node0";
  auto local = render_rank_env(cfg, 0, n0);
  REQUIRE(local.ok());
  CHECK(local->get("NCCL_SOCKET_IFNAME") == "=lo");
  CHECK(local->get("NCCL_IB_DISABLE") == "1");
  CHECK(local->get("NCCL_NVLS_ENABLE") == "0");
  CHECK(render_rank_env(cfg, 3, n0).error().code == Errc::usage);

  // NVLS_ENABLE turns NVLink multicast on where it can exist (several GPUs, not a GB10).
  auto nvls = ring(
      "NVLS_ENABLE=true\nNODE0_SSH=local\nNODE0_FABRIC_IP=127.0.0.1\nNODE1_SSH=b\n"
      "NODE1_FABRIC_IP=10.10.2.2\nNODE1_NETDEVS=enp1s0f0np0,enp1s0f1np1\n"
      "NODE1_HCAS=rocep1s0f0,rocep1s0f1\nNODE1_GPUS=0,1\n");
  n1.links[1].gid_index = 3;
  auto on = render_rank_env(nvls, 1, n1);
  REQUIRE_MESSAGE(on.ok(), on.error().message);
  CHECK(on->get("NCCL_NVLS_ENABLE") == "1");
  CHECK(render_rank_env(nvls, 0, n0)->get("NCCL_NVLS_ENABLE") == "0");  // one GPU
  n1.gpu_name = "NVIDIA GB10";
  CHECK(render_rank_env(nvls, 1, n1)->get("NCCL_NVLS_ENABLE") == "0");
}

TEST_CASE("merge_reports: unreachable nodes, clock skew outside the request window") {
  auto cfg = ring(
      "NODE0_SSH=local\nNODE1_SSH=b\nNODE1_FABRIC_IP=10.0.0.2\nNODE2_SSH=c\nNODE2_FABRIC_IP=10.0.0."
      "3\n");
  std::vector<NodeOutcome> o(3);
  for (int i = 0; i < 3; ++i) {
    o[i].node = fmt::format("node{}", i);
    o[i].index = i;
    o[i].sent_ms = 1000000;
    o[i].recv_ms = 1000300;
  }
  o[0].report =
      NodeReport{"node0", 0, "", {}, {{"nccl_version", "22304"}}, {}, 1000100, "", "", {}, {}};
  o[1].report =
      NodeReport{"node1", 1, "", {}, {{"nccl_version", "22304"}}, {}, 1005300, "", "", {}, {}};
  o[2].error = make_error(Errc::auth, "node2: host key of 10.0.0.3 is unknown");
  auto r = merge_reports(cfg, o, {});
  std::map<std::string, std::string> v;
  for (const auto& c : r.checks)
    v[c.node + " " + c.id] = std::string(verdict_name(c.verdict)) + " " + c.message;
  CHECK(v["node2 ssh.reach"] == "FAIL node2: host key of 10.0.0.3 is unknown");
  CHECK(v["node1 clock"] == "WARN clock is +5.0 s off the head's");
  CHECK(v["node1 sw.parity"].rfind("PASS", 0) == 0);
  CHECK(r.exit_code() == 1);
  o[1].report->clock_ms = 1000200;
  o.pop_back();
  auto ok = merge_reports(cfg, o, {});
  CHECK(ok.exit_code() == 0);
  o[1].report->identity["nccl_version"] = "22105";
  auto bad = merge_reports(cfg, o, {});
  bool named = false;
  for (const auto& c : bad.checks)
    if (c.id == "sw.parity" && c.node == "node1" && c.verdict == Verdict::fail)
      named = c.message == "nccl_version 22105 here, 22304 on node0";
  CHECK(named);
}

TEST_CASE("plan_pings and path/bandwidth verdicts") {
  std::vector<NodeReport> reps(2);
  reps[0].node = "a";
  reps[0].links = {{"", "fab0", "10.0.0.1", 9000, "up", 0, {}, ""},
                   {"", "fab1", "10.0.1.1", 9000, "up", 0, {}, ""}};
  reps[1].node = "b";
  reps[1].index = 1;
  reps[1].links = {{"", "fab0", "10.0.0.2", 9000, "up", 0, {}, ""},
                   {"", "fab1", "", 9000, "up", 0, {}, ""}};
  auto p = plan_pings(reps);
  REQUIRE(p.size() == 2);  // twin 1 of b has no address: nothing to ping there
  CHECK(p[0].command == "ping -n -q -M do -c 1 -W 1 -s 8972 -I 10.0.0.1 10.0.0.2");
  CHECK(p[1].node_index == 1);
  PingResult bad = p[0].probe;
  bad.detail = "1 packets transmitted, 0 received, 100% packet loss";
  auto pc = path_checks({bad});
  CHECK(pc[0].verdict == Verdict::fail);
  CHECK(pc[0].subject == "fab0->b");
  CHECK(pc[0].fix.find("MTU is 9000") != std::string::npos);
  auto bw = bandwidth_checks({{"a", "b", "fab0", 13.0, 200000, ""},
                              {"a", "b", "fab1", 109.0, 200000, ""},
                              {"a", "b", "fab0", 60.0, 200000, ""},
                              {"a", "b", "fab0", 0, 0, "connect: refused"}});
  CHECK(bw[0].verdict == Verdict::fail);
  CHECK(bw[0].message == "13.0 Gb/s of 200 Gb/s line rate to b");
  CHECK(bw[1].verdict == Verdict::pass);
  CHECK(bw[2].verdict == Verdict::warn);
  CHECK(bw[3].verdict == Verdict::fail);
}

TEST_CASE("live facts: addresses, a busy port, memlock, and page-cache residency by mincore") {
  test::TempDir dir("spark-facts");
  std::string data(8 << 20, 'x');
  dir.write("model/shard.safetensors", data);
  // Bind a port so it is busy.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0);
  REQUIRE(::listen(fd, 1) == 0);
  socklen_t len = sizeof sa;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  int busy = ntohs(sa.sin_port);
  // A stand-in sparkd whose --version we can predict (the real one may not be built here).
  std::string fake_sparkd =
      dir.write("bin/sparkd", "#!/bin/sh\necho \"sparkd 9.9.9 ($1)\"\necho second line\n");
  std::filesystem::permissions(fake_sparkd, std::filesystem::perms::owner_all);
  FactsRequest req{dir / "model", {{"127.0.0.1", busy}}, fake_sparkd, "", false, {}};
  auto f = collect_live_facts(Sysroot("/"), req);
  ::close(fd);
  CHECK(f.netdev_of("127.0.0.1") == "lo");
  REQUIRE(f.ports.size() == 1);
  CHECK_FALSE(f.ports[0].free);
  CHECK(f.ports[0].error.find("in use") != std::string::npos);
  // Who holds it: this process (not a sparkd, so no ring of its own).
  CHECK(f.ports[0].holder_pid == ::getpid());
  CHECK(f.ports[0].holder_cmdline.find("spark_unit_tests") != std::string::npos);
  CHECK(f.ports[0].holder_ring.empty());
  CHECK(f.sparkd_bin == fake_sparkd);
  CHECK(f.sparkd_error.empty());
  REQUIRE(f.model_fs);
  CHECK(f.model_fs->total > 0);
  CHECK(f.memlock_soft > 0);
  CHECK(f.sparkd_version == "sparkd 9.9.9 (--version)");  // the first line of `sparkd --version`
  REQUIRE(f.residency);
  CHECK(f.residency->total_bytes == data.size());
  CHECK(f.residency->resident_bytes == data.size());  // just written: all in the page cache
  // Drop it from the cache and look again.
  int mfd = ::open((dir / "model/shard.safetensors").c_str(), O_RDONLY);
  ::fdatasync(mfd);
  ::posix_fadvise(mfd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(mfd);
  auto after = page_cache_residency(dir / "model");
  if (after.resident_bytes == after.total_bytes)
    MESSAGE("SKIP: this filesystem keeps the pages (tmpfs?)");
  else
    CHECK(after.resident_bytes < data.size() / 2);
  // And through JSON, as a captured tree carries them.
  auto back = facts_from_json(facts_to_json(f));
  REQUIRE(back.ok());
  CHECK(back->memlock_soft == f.memlock_soft);
  CHECK(back->addrs.size() == f.addrs.size());
  CHECK(back->residency->resident_bytes == f.residency->resident_bytes);
  CHECK(back->ports.at(0).holder_pid == f.ports[0].holder_pid);
  CHECK(back->sparkd_bin == f.sparkd_bin);
}

TEST_CASE("the config sent to nodes resolves to the same digest there") {
  auto cfg = ring(
      "ENGINE=exec\nENGINE_EXEC=\"python -c "
      "'print(\\\"$HOME\\\")'\"\nNODE0_SSH=local\nNODE1_SSH=u@b:2222\n"
      "NODE1_FABRIC_IP=10.0.0.2\nNODE1_GID_INDEX=3\n");
  auto text = cli::config_wire_text(cfg);
  auto back = load_config_text(text, "<stdin>", Environment{}, nullptr);
  REQUIRE_MESSAGE(back.ok(), back.error().message);
  CHECK(back->digest() == cfg.digest());
  CHECK(back->get("ENGINE_EXEC") == cfg.get("ENGINE_EXEC"));
  CHECK(back->nodes[1].gid_index == 3);
  CHECK(back->nodes[1].ssh_port == 2222);
}

TEST_CASE("capture-node captures exactly what the probes read: the replay gives the same report") {
  std::string fx = std::string(SPARK_SOURCE_DIR) + "/tests/fixtures/preflight/zero-gid";
  auto cfg = load_config(fx + "/cluster.env", Environment{}, nullptr);
  REQUIRE(cfg.ok());
  test::TempDir out("spark-capture");
  // Through the command, from the fixture as if it were the live node, into a .tar.gz.
  std::ostringstream so, se;
  std::string archive = out / "spark-b.tar.gz";
  std::vector<std::string> argv = {
      "sparkctl", "--config", fx + "/cluster.env", "capture-node", archive,
      "--node",   "1",        "--sysroot",         fx + "/node1"};
  std::vector<const char*> cargv;
  for (const auto& a : argv) cargv.push_back(a.c_str());
  int rc = cli::run(static_cast<int>(cargv.size()), cargv.data(), so, se, Environment{});
  REQUIRE_MESSAGE(rc == 0, se.str());
  CHECK(std::filesystem::exists(archive));
  // Replay the archive and compare with the fixture, row by row.
  std::ostringstream ro, re;
  std::vector<std::string> rargv = {
      "sparkctl", "--config", fx + "/cluster.env", "preflight", "--local",
      "--node",   "1",        "--sysroot",         archive,     "--json"};
  std::vector<const char*> crargv;
  for (const auto& a : rargv) crargv.push_back(a.c_str());
  rc = cli::run(static_cast<int>(crargv.size()), crargv.data(), ro, re, Environment{});
  CHECK(rc == 1);
  auto replayed = report_from_json(nlohmann::json::parse(ro.str()));
  REQUIRE(replayed.ok());
  auto direct = run_node_checks(*cfg, 1, Sysroot(fx + "/node1"), {}, false);
  REQUIRE(replayed->checks.size() == direct.checks.size());
  for (size_t i = 0; i < direct.checks.size(); ++i) {
    CHECK(replayed->checks[i].id == direct.checks[i].id);
    CHECK(replayed->checks[i].verdict == direct.checks[i].verdict);
    CHECK(replayed->checks[i].message == direct.checks[i].message);
  }
  CHECK(replayed->identity == direct.identity);
}

TEST_CASE("Sysroot records reads, listings and sizes for capture") {
  std::string fx = std::string(SPARK_SOURCE_DIR) + "/tests/fixtures/preflight/healthy-pair/node0";
  Sysroot r(fx + "/");
  CHECK_FALSE(r.live());
  CHECK(r.read_line("/sys/class/net/enp1s0f0np0/mtu") == "9000");
  r.record(true);
  (void)r.read("/proc/cmdline");
  (void)r.list("/dev/infiniband");
  (void)r.file_size("/models/qwen3-32b/config.json");
  CHECK(r.recorded_files() == std::set<std::string>{"/proc/cmdline"});
  CHECK(r.recorded_dirs() == std::set<std::string>{"/dev/infiniband"});
  CHECK(r.recorded_sized() == std::set<std::string>{"/models/qwen3-32b/config.json"});
  CHECK(Sysroot("/").live());
  CHECK(Sysroot("/").path("models/m") == "models/m");  // live: relative to the cwd
  CHECK(Sysroot("/").path("/sys/class/net") == "/sys/class/net");
  CHECK(r.path("sys/class/net") == fx + "/sys/class/net");
}

TEST_CASE("fuzz corpus: every fuzz_node_report seed parses or is refused, never crashes") {
  int n = 0, reports = 0, facts = 0;
  for (const auto& e : std::filesystem::directory_iterator(SPARK_SOURCE_DIR
                                                           "/tests/fuzz/corpus/fuzz_node_report")) {
    auto data = read_file(e.path().string());
    REQUIRE(data.has_value());
    INFO(e.path().filename().string());
    std::array<uint8_t, 16> g{};
    (void)parse_gid(*data, &g);
    (void)parse_meminfo(*data);
    auto j = nlohmann::json::parse(*data, nullptr, false);
    if (!j.is_discarded()) {
      reports += report_from_json(j).ok();
      facts += facts_from_json(j).ok();
    }
    ++n;
  }
  CHECK(n >= 4);
  CHECK(reports >= 1);  // the seed node report
  CHECK(facts >= 1);    // the seed facts.json
}

TEST_CASE("model.files: a shard of the wrong size or missing is named against the manifest") {
  std::string fx = std::string(SPARK_SOURCE_DIR) + "/tests/fixtures/preflight/healthy-pair";
  auto cfg = load_config(fx + "/cluster.env", Environment{}, nullptr);
  REQUIRE(cfg.ok());
  test::TempDir tmp("spark-model");
  std::filesystem::copy(fx + "/node1", tmp.path(), std::filesystem::copy_options::recursive);
  std::string m = tmp / "models/qwen3-32b";
  tmp.write("models/qwen3-32b/model-00002-of-00004.safetensors", "short");
  std::filesystem::remove(m + "/model-00004-of-00004.safetensors");
  CheckFilter only;
  only.only = {"model.files", "sw.parity"};
  auto rep = run_node_checks(*cfg, 1, Sysroot(tmp.path()), only, false);
  REQUIRE(rep.checks.size() == 1);
  CHECK(rep.checks[0].verdict == Verdict::fail);
  CHECK(rep.checks[0].message.find(
            "model-00002-of-00004.safetensors is 5 bytes, the manifest says 16") !=
        std::string::npos);
  CHECK(rep.checks[0].message.find("model-00004-of-00004.safetensors is missing") !=
        std::string::npos);
  CHECK(rep.checks[0].fix == "run `sparkctl stage-weights --to spark-b`");
  // The manifest digest is its content digest, the same on both fixture nodes.
  auto other = run_node_checks(*cfg, 0, Sysroot(fx + "/node0"), only, false);
  CHECK(rep.identity.at("manifest_digest") == other.identity.at("manifest_digest"));
  CHECK(rep.identity.at("manifest_digest").size() == 32);
}

TEST_CASE("rdma.devices warns when an ACTIVE twin is left out of NODE<i>_HCAS") {
  std::string fx = std::string(SPARK_SOURCE_DIR) + "/tests/fixtures/preflight/healthy-pair";
  auto text = read_file(fx + "/cluster.env");
  REQUIRE(text);
  std::string one = *text;
  for (auto [from, to] : {std::pair<std::string, std::string>{
                              "NODE1_NETDEVS=enp1s0f0np0,enp1s0f1np1", "NODE1_NETDEVS=enp1s0f0np0"},
                          {"NODE1_HCAS=rocep1s0f0,rocep1s0f1", "NODE1_HCAS=rocep1s0f0"}})
    one.replace(one.find(from), from.size(), to);
  auto cfg = load_config_text(one, "one-twin.env", Environment{}, nullptr);
  REQUIRE(cfg.ok());
  CheckFilter only;
  only.only = {"rdma.devices"};
  auto rep = run_node_checks(*cfg, 1, Sysroot(fx + "/node1"), only, false);
  bool warned = false;
  for (const auto& c : rep.checks)
    if (c.subject == "twins") {
      warned = c.verdict == Verdict::warn;
      CHECK(c.message ==
            "rocep1s0f1 is ACTIVE but not in NODE1_HCAS: NCCL uses only the configured HCAs");
    }
  CHECK(warned);
}

TEST_CASE("mem.plan plans GLM-5.3-Flash with vLLM's records: the plan sparkctl plan prints") {
  namespace fs = std::filesystem;
  const std::string src = std::string(SPARK_SOURCE_DIR) + "/tests/fixtures/";
  test::TempDir d("memplan");
  fs::copy(src + "preflight/healthy-pair", d.path(), fs::copy_options::recursive);
  for (const char* n : {"node0", "node1"})
    fs::copy_file(src + "models/plan/glm-5.3-flash/config.json",
                  d / (std::string(n) + "/models/qwen3-32b/config.json"),
                  fs::copy_options::overwrite_existing);
  auto text = read_file(d / "cluster.env");
  REQUIRE(text);
  d.write("cluster.env", *text + "KV_LAYOUT=vllm\nKV_DTYPE=fp8\nCONTEXT_LEN=500000\nSLOTS=1\n");
  std::vector<Diagnostic> diags;
  auto cfg = load_config(d / "cluster.env", Environment{}, &diags);
  REQUIRE_MESSAGE(cfg.ok(), (cfg.ok() ? std::string() : cfg.error().message));
  CheckFilter only;
  only.only = {"mem.plan"};
  auto r = replay_ring(*cfg, {d / "node0", d / "node1"}, only, true);
  const CheckResult* row = nullptr;
  for (const auto& c : r.checks)
    if (c.node == "spark-a" && c.id == "mem.plan") row = &c;
  REQUIRE(row);
  // The same plan, computed here from the same files and keys.
  auto in = plan_input(read_model_files(Sysroot(d / "node0"), "/models/qwen3-32b"), &*cfg);
  REQUIRE(in.ok());
  in->gpus_per_node = 1;
  in->capacity_per_rank = 1;  // not compared
  auto want = plan::plan_row(*in, 2);
  CHECK(want.kv_per_rank ==
        11ull * 656 * 500000 + 11ull * 132 * (500000 / 16) + want.state_per_rank);
  CHECK(row->message.find("(vllm KV)") != std::string::npos);
  CHECK(row->message.find(fmt::format("KV {} (500000 tokens x 1 slots, {} of it fixed state)",
                                      format_size(want.kv_per_rank),
                                      format_size(want.state_per_rank))) != std::string::npos);
}
