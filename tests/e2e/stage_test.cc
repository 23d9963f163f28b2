// stage-weights end to end: the real sparkctl in network namespaces, targets reached over a
// real sshd, data over veth; kill -9 of either side and resume; a too-small target.
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <sys/mount.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <thread>

#include "core/manifest.h"
#include "core/process.h"
#include "core/strings.h"
#include "support/netns.h"
#include "support/sshd.h"
#include "support/tempdir.h"

using namespace spark;
using namespace spark::test;
using namespace std::chrono_literals;
using json = nlohmann::json;

namespace {

constexpr uint64_t kChunk = 256 * 1024;

std::string random_bytes(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(rng());
  return s;
}

void make_model(const TempDir& d, const std::string& sub) {
  d.write(sub + "/config.json", "{\"model_type\":\"demo\"}");
  d.write(sub + "/model-00001-of-00002.safetensors", random_bytes(6 << 20, 21));
  d.write(sub + "/model-00002-of-00002.safetensors", random_bytes(3 << 20, 22));
  d.write(sub + "/model.safetensors.index.json", "{\"weight_map\":{}}");
  d.write(sub + "/tokenizer/tokenizer.json", random_bytes(100000, 23));
}

// A ring of `nodes` namespaces: node 0 runs sparkctl (local), the others run sshd.
struct Ring {
  std::unique_ptr<NetNs> net;
  std::vector<std::unique_ptr<Sshd>> sshd;
  TempDir dir{"spark-stage-e2e"};
  std::string config;
  int nodes = 0;

  std::string path(int i) const { return dir / fmt::format("node{}/model", i); }

  std::string setup(int n, int links = 1) {
    if (auto why = netns_unavailable_reason(); !why.empty()) return why;
    if (auto why = sshd_unavailable_reason(); !why.empty()) return why;
    nodes = n;
    auto created = NetNs::create({.hosts = n, .links = links});
    REQUIRE_MESSAGE(created.ok(), created.error().message);
    net = std::move(*created);
    std::string known;
    for (int i = 1; i < n; ++i) {
      SshdOptions o{.host = net->ip(i), .netns = net->ns(i)};
      if (i > 1) o.identity = sshd[0]->identity();
      auto s = Sshd::start(o);
      REQUIRE_MESSAGE(s.ok(), s.error().message);
      known += (*s)->known_hosts_line() + "\n";
      sshd.push_back(std::move(*s));
    }
    std::string text = fmt::format(
        "RING_NAME=stage-e2e\nSSH_IDENTITY={}\nSSH_KNOWN_HOSTS={}\nSPARKCTL_BIN={}\n"
        "STAGE_CHUNK_SIZE={}\nSTAGE_STREAMS=3\nSTAGE_TIMEOUT=20s\nDISK_MAX_USE=99\n",
        sshd[0]->identity(), dir.write("known_hosts", known), SPARKCTL_BIN, kChunk);
    for (int i = 0; i < n; ++i) {
      text += fmt::format("NODE{}_NAME=n{}\nNODE{}_FABRIC_IP={}\nNODE{}_MODEL_PATH={}\n", i, i, i,
                          net->ip(i), i, path(i));
      if (links > 1)
        text += fmt::format("NODE{}_NETDEVS={},{}\n", i, net->ifname(0), net->ifname(1));
      text += i == 0 ? "NODE0_SSH=local\n"
                     : fmt::format("NODE{}_SSH={}@{}\n", i,
                                   sshd[static_cast<size_t>(i - 1)]->user(), net->ip(i));
    }
    config = dir.write("ring.env", text);
    make_model(dir, "node0/model");
    return "";
  }

  // Runs sparkctl inside node 0's namespace.
  ProcessResult sparkctl(const std::string& args, const std::string& env = "",
                         std::chrono::milliseconds timeout = 120s) const {
    auto r = net->exec_in(0, fmt::format("{} {} --config {} {}", env, SPARKCTL_BIN, config, args),
                          timeout);
    REQUIRE_MESSAGE(r.ok(), r.error().message);
    return *r;
  }

  bool identical(int i) const {
    auto r = run_shell(fmt::format("diff -r {} {}", path(0), path(i)), 30s);
    return r.ok() && r->success();
  }

  // Bytes target i already holds in a form the receiver trusts: final files, and chunks in
  // the resume journals of partial files.
  uint64_t preserved(int i, const Manifest& m) const {
    uint64_t sum = 0;
    for (const auto& f : m.files) {
      std::string p = path(i) + "/" + f.path;
      if (std::filesystem::exists(p)) {
        sum += f.size;
        continue;
      }
      auto j = read_file(p + kJournalSuffix);
      if (!j) continue;
      std::set<uint64_t> seen;
      for (const auto& line : split_list(*j, '\n')) {
        auto sp = split_list(line, ' ');
        auto c = parse_u64(sp[0]);
        if (sp.size() == 2 && c && *c < f.chunks.size() && f.chunks[*c] == sp[1] &&
            seen.insert(*c).second)
          sum += m.chunk_len(f.size, *c);
      }
    }
    return sum;
  }

  // Total size of the resume journals under target i (grows as chunks are verified).
  uint64_t journal_bytes(int i) const {
    uint64_t n = 0;
    std::error_code ec;
    for (std::filesystem::recursive_directory_iterator it(path(i), ec), end; !ec && it != end;
         it.increment(ec))
      if (ends_with(it->path().string(), kJournalSuffix))
        n += std::filesystem::file_size(it->path(), ec);
    return n;
  }

  // Waits (bounded) until no receiver for target i runs any more.
  bool receivers_gone(int i) const {
    for (int k = 0; k < 100; ++k) {
      // "[r]" keeps the pattern from matching the shell that runs pgrep.
      auto r = run_shell(fmt::format("pgrep -f 'stage-[r]ecv.*{}'", path(i)), 5s);
      if (r.ok() && r->exit_status == 1) return true;
      std::this_thread::sleep_for(100ms);
    }
    return false;
  }
};

json parse_json(const ProcessResult& r) {
  auto j = json::parse(r.out, nullptr, false);
  INFO("stdout: " << r.out << "\nstderr: " << r.err);
  REQUIRE(!j.is_discarded());
  return j;
}

std::map<std::string, json> by_node(const json& report) {
  std::map<std::string, json> m;
  INFO(report.dump());
  REQUIRE(report.contains("targets"));
  for (const auto& t : report["targets"]) m[t["node"].get<std::string>()] = t;
  return m;
}

}  // namespace

TEST_CASE("stage-weights e2e: 4 namespaces over sshd, identical copies, verify-only, evict") {
  Ring ring;
  if (auto why = ring.setup(4); !why.empty()) {
    MESSAGE("SKIP: " << why);
    return;
  }
  auto r = ring.sparkctl("--json stage-weights");
  REQUIRE_MESSAGE(r.exit_status == 0, std::string(r.out + r.err));
  auto j = parse_json(r);
  CHECK(j["ok"].get<bool>());
  auto m = read_manifest(ring.path(0));
  REQUIRE(m.ok());
  CHECK(j["bytes_read"].get<uint64_t>() == m->total_bytes());  // the source is read once
  for (int i = 1; i < 4; ++i) {
    CHECK(ring.identical(i));
    auto t = by_node(j)[fmt::format("n{}", i)];
    CHECK(t["bytes_sent"].get<uint64_t>() == m->total_bytes());
    CHECK(verify_manifest(ring.path(i), *m, true).ok);
  }
  // Every node agrees with the source's digest.
  auto v = ring.sparkctl("--json stage-weights --verify-only --deep");
  CHECK(v.exit_status == 0);
  CHECK(parse_json(v)["ok"].get<bool>());
  // Staging again sends nothing.
  auto again = parse_json(ring.sparkctl("--json stage-weights"));
  for (const auto& [node, t] : by_node(again)) CHECK(t["bytes_sent"].get<uint64_t>() == 0);
  // Evict on every node (over SSH): nothing of the model stays resident.
  (void)run_shell(
      fmt::format("cat {}/*.safetensors {}/*.safetensors >/dev/null", ring.path(0), ring.path(2)),
      30s);
  auto e = ring.sparkctl("--json evict");
  INFO(e.out << e.err);
  CHECK(e.exit_status == 0);
  auto ej = parse_json(e);
  REQUIRE(ej["nodes"].size() == 4);
  for (const auto& n : ej["nodes"]) {
    CHECK(n["ok"].get<bool>());
    CHECK(n["bytes_after"].get<uint64_t>() == 0);
    CHECK(n.contains("mem_free_after"));
  }
  // A source other than this machine: n1 sends to n3 (stage-send runs on n1 over SSH).
  std::filesystem::remove_all(ring.path(3));
  auto from = ring.sparkctl("--json stage-weights --from n1 --to n3");
  INFO(from.out << from.err);
  CHECK(from.exit_status == 0);
  auto fj = parse_json(from);
  CHECK(fj["ok"].get<bool>());
  CHECK(by_node(fj)["n3"]["bytes_sent"].get<uint64_t>() == m->total_bytes());
  CHECK(ring.identical(3));
  // Chain mode over the namespaces: n0 feeds n1, n1 forwards to n2, n2 to n3.
  std::filesystem::remove_all(ring.path(2));
  std::filesystem::remove_all(ring.path(3));
  auto ch = ring.sparkctl("--json stage-weights --chain");
  INFO(ch.out << ch.err);
  CHECK(ch.exit_status == 0);
  auto cj = by_node(parse_json(ch));
  // n1 already had the model: it only relays (the source's link still carries one copy).
  CHECK(cj["n1"]["bytes_sent"].get<uint64_t>() == m->total_bytes());
  CHECK(cj["n1"]["skip_files"].get<uint64_t>() == m->files.size());
  CHECK(cj["n2"]["bytes_sent"].get<uint64_t>() == m->total_bytes());  // forwarded by n1
  CHECK(cj["n3"]["bytes_sent"].get<uint64_t>() == m->total_bytes());  // forwarded by n2
  CHECK(ring.identical(2));
  CHECK(ring.identical(3));
  // A damaged target is caught by --verify-only and named.
  {
    std::string p = ring.path(3) + "/model-00002-of-00002.safetensors";
    auto f = read_file(p);
    REQUIRE(f.has_value());
    (*f)[1000] = static_cast<char>((*f)[1000] ^ 1);
    std::string why;
    REQUIRE(write_file_atomic(p, *f, &why));
    auto bad = ring.sparkctl("--json stage-weights --verify-only --deep");
    CHECK(bad.exit_status == exit_code(Errc::integrity));
    auto bj = parse_json(bad);
    CHECK(!bj["ok"].get<bool>());
  }
}

TEST_CASE(
    "stage-weights e2e: kill -9 of the sender, then of a receiver; resume sends only what is "
    "missing") {
  Ring ring;
  if (auto why = ring.setup(3); !why.empty()) {
    MESSAGE("SKIP: " << why);
    return;
  }
  std::mt19937 rng(static_cast<unsigned>(::getpid()));
  ManifestOptions mo;
  mo.chunk_size = kChunk;
  auto m = build_manifest(ring.path(0), mo);
  REQUIRE(m.ok());
  REQUIRE(write_manifest(ring.path(0), *m).ok());

  // 1. The sender dies at a random point once data flows (fault injection slows it down).
  auto delay = std::uniform_int_distribution<int>(0, 400)(rng);
  auto killer = std::thread([&] {
    for (int k = 0; k < 200; ++k) {  // bounded: 20 s
      auto r = run_shell(fmt::format("ls {}/*{} 2>/dev/null", ring.path(1), kJournalSuffix), 5s);
      if (r.ok() && r->success()) break;
      std::this_thread::sleep_for(100ms);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(delay));
    (void)run_shell("pkill -9 -f 'sparkct[l] --config " + ring.config + " --json stage-weights'",
                    5s);
  });
  auto first = ring.sparkctl("--json stage-weights", "SPARK_STAGE_FAULT_DELAY_MS=60");
  killer.join();
  CHECK(first.exit_status != 0);  // killed
  for (int i = 1; i < 3; ++i) REQUIRE(ring.receivers_gone(i));
  std::map<std::string, uint64_t> expect;
  for (int i = 1; i < 3; ++i)
    expect[fmt::format("n{}", i)] = m->total_bytes() - ring.preserved(i, *m);
  MESSAGE("sender killed after " << delay << " ms; still to send: n1 " << expect["n1"] << ", n2 "
                                 << expect["n2"] << " of " << m->total_bytes());
  // Nothing half-written under a final name.
  for (int i = 1; i < 3; ++i)
    for (const auto& f : m->files) {
      std::string p = ring.path(i) + "/" + f.path;
      if (std::filesystem::exists(p)) CHECK(std::filesystem::file_size(p) == f.size);
    }

  // 2. Resume, and kill -9 one receiver at a random point of that run.
  auto delay2 = std::uniform_int_distribution<int>(0, 200)(rng);
  const uint64_t j0 = ring.journal_bytes(1);
  auto killer2 = std::thread([&] {
    for (int k = 0; k < 400 && ring.journal_bytes(1) == j0; ++k)  // bounded: 20 s
      std::this_thread::sleep_for(50ms);
    std::this_thread::sleep_for(std::chrono::milliseconds(delay2));
    (void)run_shell(fmt::format("pkill -9 -f 'stage-[r]ecv.*{}'", ring.path(1)), 5s);
  });
  auto second = ring.sparkctl("--json stage-weights", "SPARK_STAGE_FAULT_DELAY_MS=100");
  killer2.join();
  auto sj = parse_json(second);
  auto st = by_node(sj);
  bool n1_finished = st["n1"]["ok"].get<bool>();  // it may have finished before the kill
  if (!n1_finished) {
    CHECK(second.exit_status != 0);
    CHECK(st["n1"]["error"].get<std::string>().find("n1") != std::string::npos);  // names the node
  }
  CHECK(st["n2"]["ok"].get<bool>());                              // the other target is unaffected
  CHECK(st["n2"]["bytes_sent"].get<uint64_t>() == expect["n2"]);  // verified chunks not resent
  CHECK(ring.identical(2));
  REQUIRE(ring.receivers_gone(1));
  uint64_t still = m->total_bytes() - ring.preserved(1, *m);

  // 3. A clean resume completes, sending exactly what n1 had not verified.
  auto third = ring.sparkctl("--json stage-weights");
  INFO(third.err);
  CHECK(third.exit_status == 0);
  auto tj = by_node(parse_json(third));
  CHECK(tj["n1"]["bytes_sent"].get<uint64_t>() == still);
  CHECK(tj["n2"]["bytes_sent"].get<uint64_t>() == 0);
  for (int i = 1; i < 3; ++i) {
    CHECK(ring.identical(i));
    CHECK(verify_manifest(ring.path(i), *m, true).ok);
  }
}

TEST_CASE(
    "stage-weights e2e: a journaled chunk changed after a receiver kill is sent again; the "
    "file never takes its final name while it differs") {
  Ring ring;
  if (auto why = ring.setup(2); !why.empty()) {
    MESSAGE("SKIP: " << why);
    return;
  }
  ManifestOptions mo;
  mo.chunk_size = kChunk;
  auto m = build_manifest(ring.path(0), mo);
  REQUIRE(m.ok());
  REQUIRE(write_manifest(ring.path(0), *m).ok());
  // Journaled chunk lines (index -> hash matching the manifest) of a file on target 1.
  auto journaled = [&](const ManifestEntry& f) {
    std::set<uint64_t> idx;
    auto j = read_file(ring.path(1) + "/" + f.path + kJournalSuffix);
    if (!j) return idx;
    for (const auto& line : split_list(*j, '\n')) {
      auto sp = split_list(line, ' ');
      auto c = parse_u64(sp[0]);
      if (sp.size() == 2 && c && *c < f.chunks.size() && f.chunks[*c] == sp[1]) idx.insert(*c);
    }
    return idx;
  };

  // 1. The receiver is killed (-9) once a weight file has journaled chunks (the sender is
  // slowed by fault injection so that the file is far from complete then).
  const ManifestEntry* big = nullptr;
  for (const auto& f : m->files)
    if (f.path == "model-00001-of-00002.safetensors") big = &f;
  REQUIRE(big);
  REQUIRE(big->chunks.size() >= 16);
  auto killer = std::thread([&] {
    for (int k = 0; k < 1000 && journaled(*big).size() < 2; ++k)  // bounded: 20 s
      std::this_thread::sleep_for(20ms);
    (void)run_shell(fmt::format("pkill -9 -f 'stage-[r]ecv.*{}'", ring.path(1)), 5s);
  });
  auto first = ring.sparkctl("--json stage-weights", "SPARK_STAGE_FAULT_DELAY_MS=200");
  killer.join();
  CHECK(first.exit_status != 0);
  REQUIRE(ring.receivers_gone(1));
  const std::string final_path = ring.path(1) + "/" + big->path;
  const std::string partial = final_path + kPartialSuffix, journal = final_path + kJournalSuffix;
  REQUIRE_FALSE(std::filesystem::exists(final_path));
  auto done = journaled(*big);
  REQUIRE_MESSAGE(done.size() >= 2, "the kill left no journaled chunk of " << big->path);

  // 2. A byte of an already journaled chunk changes on disk (in place, as a disk error or
  // a hand would change it).
  const uint64_t bad = *done.begin();
  {
    std::fstream io(partial, std::ios::in | std::ios::out | std::ios::binary);
    REQUIRE(io.good());
    io.seekg(static_cast<std::streamoff>(bad * kChunk + 100));
    char c = 0;
    io.read(&c, 1);
    c = static_cast<char>(c ^ 0x5a);
    io.seekp(static_cast<std::streamoff>(bad * kChunk + 100));
    io.write(&c, 1);
    REQUIRE(io.good());
  }
  auto damaged_partial = read_file(partial), damaged_journal = read_file(journal);
  REQUIRE(damaged_partial);
  REQUIRE(damaged_journal);

  // 3. With the resume's first hash switched off by fault injection (the journal trusted as
  // written), the damaged chunk is not sent again, and the hash just before the final
  // rename is what stands between it and the final name: the file fails, it is not named.
  auto trusted = ring.sparkctl("--json stage-weights", "SPARK_STAGE_FAULT_TRUST_JOURNAL=1");
  CHECK(trusted.exit_status != 0);
  {
    auto t = by_node(parse_json(trusted))["n1"];
    INFO(t.dump());
    CHECK_FALSE(t["ok"].get<bool>());
    CHECK(t.value("resume_mismatch_chunks", uint64_t{99}) == 0);  // the double took effect
    CHECK(t.value("error", std::string()).find(fmt::format("chunk {} of {}", bad, partial)) !=
          std::string::npos);
    CHECK(t.value("error", std::string()).find("no longer matches the manifest") !=
          std::string::npos);
  }
  REQUIRE(ring.receivers_gone(1));
  CHECK_FALSE(std::filesystem::exists(final_path));

  // 4. The same damaged partial and journal, resumed for real: the damaged chunk is hashed
  // again, found wrong and sent again with what was never received; the final file matches
  // the manifest.
  REQUIRE(write_file_atomic(partial, *damaged_partial, nullptr));
  REQUIRE(write_file_atomic(journal, *damaged_journal, nullptr));
  const uint64_t expect = m->total_bytes() - ring.preserved(1, *m) + m->chunk_len(big->size, bad);
  auto resumed = ring.sparkctl("--json stage-weights");
  INFO(resumed.out << resumed.err);
  CHECK(resumed.exit_status == 0);
  auto t = by_node(parse_json(resumed))["n1"];
  CHECK(t["ok"].get<bool>());
  CHECK(t["resume_mismatch_chunks"].get<uint64_t>() == 1);
  CHECK(t["bytes_sent"].get<uint64_t>() == expect);  // the damaged chunk and the missing ones
  CHECK(ring.identical(1));
  auto v =
      run_shell(fmt::format("{} --json manifest {} --verify", SPARKCTL_BIN, ring.path(1)), 60s);
  REQUIRE(v.ok());
  INFO(v->out << v->err);
  CHECK(v->exit_status == 0);
  CHECK(json::parse(v->out, nullptr, false).value("ok", false));
  CHECK_FALSE(std::filesystem::exists(partial));
  CHECK_FALSE(std::filesystem::exists(journal));
}

TEST_CASE("stage-weights e2e: a target filesystem too small fails before anything is sent") {
  if (::geteuid() != 0) {
    MESSAGE("SKIP: mounting a small tmpfs needs root");
    return;
  }
  Ring ring;
  // Mounted before the nodes' sshd start, so their mount namespaces see it too.
  std::filesystem::create_directories(ring.path(2));
  REQUIRE(::mount("tmpfs", ring.path(2).c_str(), "tmpfs", 0, "size=16m") == 0);
  struct Unmount {
    std::string p;
    ~Unmount() { ::umount2(p.c_str(), MNT_DETACH); }
  } unmount{ring.path(2)};
  if (auto why = ring.setup(3); !why.empty()) {
    MESSAGE("SKIP: " << why);
    return;
  }
  // 10 MiB of 16 taken: the 9 MiB model does not fit.
  std::string filler = ring.path(2) + "/filler.bin";
  REQUIRE(write_file_atomic(filler, std::string(10 << 20, 'f'), nullptr));
  auto r = ring.sparkctl("--json stage-weights");
  CHECK(r.exit_status == exit_code(Errc::resource));
  auto j = parse_json(r);
  REQUIRE(j.contains("error"));
  auto msg = j["error"]["message"].get<std::string>();
  CHECK(msg.find("n2") != std::string::npos);
  CHECK(msg.find("nothing was sent") != std::string::npos);
  // Neither the small target nor the healthy one received anything.
  auto listing = [](const std::string& d) {
    std::vector<std::string> v;
    std::error_code ec;
    for (auto& e : std::filesystem::recursive_directory_iterator(d, ec))
      v.push_back(e.path().filename());
    return v;
  };
  CHECK(listing(ring.path(2)) == std::vector<std::string>{"filler.bin"});
  CHECK(listing(ring.path(1)).empty());
  CHECK(ring.receivers_gone(1));
  CHECK(ring.receivers_gone(2));

  // The DISK_MAX_USE mark: 9 MiB fits in 16 MiB but ends above 50%: refused as well.
  REQUIRE(::unlink(filler.c_str()) == 0);
  auto mark = ring.sparkctl("--json stage-weights", "DISK_MAX_USE=50");
  CHECK(mark.exit_status == exit_code(Errc::resource));
  auto mj = parse_json(mark);
  REQUIRE(mj.contains("error"));
  CHECK(mj["error"]["message"].get<std::string>().find("DISK_MAX_USE=50%") != std::string::npos);
  CHECK(listing(ring.path(2)).empty());
  // With the configured mark (99%) it goes through, tmpfs target included (buffered writes).
  auto ok = ring.sparkctl("--json stage-weights");
  CHECK(ok.exit_status == 0);
  CHECK(ring.identical(2));
}

TEST_CASE("stage-weights e2e: with two netdevs per node the streams use both twins") {
  Ring ring;
  if (auto why = ring.setup(2, 2); !why.empty()) {
    MESSAGE("SKIP: " << why);
    return;
  }
  auto rx = [&](int link) {
    auto r = ring.net->exec_in(
        1, "cat /sys/class/net/" + ring.net->ifname(link) + "/statistics/rx_bytes");
    REQUIRE(r.ok());
    return parse_u64(std::string(trim(r->out))).value_or(0);
  };
  uint64_t before0 = rx(0), before1 = rx(1);
  auto r = ring.sparkctl("--json stage-weights");
  REQUIRE_MESSAGE(r.exit_status == 0, std::string(r.out + r.err));
  CHECK(ring.identical(1));
  uint64_t got0 = rx(0) - before0, got1 = rx(1) - before1;
  MESSAGE("twin 0 received " << got0 << " bytes, twin 1 " << got1);
  CHECK(got0 > (512u << 10));  // 3 streams over 2 addresses: both carry model data
  CHECK(got1 > (512u << 10));
}
