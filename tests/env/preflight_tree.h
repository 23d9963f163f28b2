#pragma once
// Rings of 2-4 captured GB10 nodes for preflight tests, written in the formats `sparkctl
// capture-node` records (/sys/class/infiniband GID tables and attributes, /sys/class/net,
// /proc/meminfo, /proc/sys/net sysctls, facts.json), starting from the healthy pair's
// captured trees; and the fixes preflight suggests, applied to those trees as the commands
// they name would change a live node.
#include <fmt/format.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/strings.h"
#include "env/preflight.h"
#include "support/tempdir.h"

namespace spark::test {

inline std::string preflight_fixture(const std::string& scenario) {
  return std::string(SPARK_SOURCE_DIR) + "/tests/fixtures/preflight/" + scenario;
}

/// Writes a file of a tree (parent directories created), replacing it whole.
inline void put(const std::string& path, const std::string& data) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  write_file_atomic(path, data, nullptr);
}

/// "0000:0000:0000:0000:0000:ffff:0a0a:0201" for 10.10.2.1.
inline std::string gid_of_ipv4(const std::string& ip) {
  auto v = parse_ipv4(ip).value_or(0);
  return fmt::format("0000:0000:0000:0000:0000:ffff:{:02x}{:02x}:{:02x}{:02x}", v >> 24,
                     (v >> 16) & 0xff, (v >> 8) & 0xff, v & 0xff);
}
inline constexpr const char* kZeroGid = "0000:0000:0000:0000:0000:0000:0000:0000";
inline constexpr const char* kV1 = "IB/RoCE v1";
inline constexpr const char* kV2 = "RoCE v2";

/// A ring of `n` healthy GB10 nodes spark-a.. with both twins: node k holds 10.10.2.(k+1) on
/// enp1s0f0np0 (rocep1s0f0) and 10.10.3.(k+1) on enp1s0f1np1 (rocep1s0f1), RoCE v2 at GID 3.
class RingTree {
 public:
  explicit RingTree(int n) : n_(n) {
    namespace fs = std::filesystem;
    for (int k = 0; k < n; ++k) {
      fs::copy(preflight_fixture("healthy-pair") + (k == 0 ? "/node0" : "/node1"), node(k),
               fs::copy_options::recursive);
      if (n % 3 == 0) {
        // Qwen3-32B's 64 heads, 8 KV heads and 25600-wide MLP do not split over 3 ranks (the
        // engine's model.engine check says so); a 3-node ring serves a model of the same
        // kind whose widths do.
        const std::string cfg = node(k) + "/models/qwen3-32b/config.json";
        auto j = nlohmann::json::parse(read_file(cfg).value_or("{}"));
        j["num_attention_heads"] = 48;
        j["num_key_value_heads"] = 12;
        j["intermediate_size"] = 25344;
        put(cfg, j.dump(2));
      }
      auto f = facts(k);
      f["hostname"] = name(k);
      f["addrs"] = nlohmann::json::array();
      facts_set(k, f);
      add_addr(k, "lo", "127.0.0.1", 8);
      add_addr(k, "enP7s7", fmt::format("192.168.1.{}", 20 + k), 24);
      add_addr(k, "enp1s0f0np0", fmt::format("10.10.2.{}", k + 1), 24);
      add_addr(k, "enp1s0f1np1", fmt::format("10.10.3.{}", k + 1), 24);
      for (const char* hca : {"rocep1s0f0", "rocep1s0f1"}) {
        std::string ip = fmt::format("10.10.{}.{}", hca[9] == '0' ? 2 : 3, k + 1);
        std::string ll = fmt::format("fe80:0000:0000:0000:0000:0000:0000:{:02x}{:02x}",
                                     hca[9] == '0' ? 0x0a : 0x0b, k + 1);
        gids(k, hca, {{ll, kV1}, {ll, kV2}, {gid_of_ipv4(ip), kV1}, {gid_of_ipv4(ip), kV2}});
      }
      for (const char* dev : {"all", "enp1s0f0np0", "enp1s0f1np1", "enP7s7"})
        for (const char* key : {"arp_ignore", "arp_announce"}) sysctl(k, dev, key, "0");
    }
    cluster_ = cluster_text();
  }

  /// A committed two-node scenario (tests/fixtures/preflight/<scenario>) as a ring.
  static RingTree scenario(const std::string& name) { return RingTree(name, 0); }

  int size() const { return n_; }
  std::string node(int k) const { return dir_ / fmt::format("node{}", k); }
  std::vector<std::string> roots() const {
    std::vector<std::string> r;
    for (int k = 0; k < n_; ++k) r.push_back(node(k));
    return r;
  }
  static std::string name(int k) { return fmt::format("spark-{}", static_cast<char>('a' + k)); }
  int index_of(const std::string& node_name) const {
    for (int k = 0; k < n_; ++k)
      if (name(k) == node_name) return k;
    return -1;
  }

  std::string& cluster() { return cluster_; }

  /// Replaces (or appends) KEY=VALUE in the cluster file.
  void set_key(const std::string& key, const std::string& value) {
    std::regex line("(^|\n)" + key + "=[^\n]*");
    if (std::regex_search(cluster_, line))
      cluster_ = std::regex_replace(cluster_, line, "$1" + key + "=" + value);
    else
      cluster_ += key + "=" + value + "\n";
  }

  nlohmann::json facts(int k) const {
    return nlohmann::json::parse(read_file(node(k) + "/facts.json").value_or("{}"));
  }
  void facts_set(int k, const nlohmann::json& f) const {
    put(node(k) + "/facts.json", f.dump(1) + "\n");
  }
  void add_addr(int k, const std::string& dev, const std::string& ip, int prefix,
                bool front = false) const {
    auto f = facts(k);
    nlohmann::json a = {{"ifname", dev}, {"family", "inet"}, {"address", ip}, {"prefix", prefix}};
    if (front)
      f["addrs"].insert(f["addrs"].begin(), a);
    else
      f["addrs"].push_back(a);
    facts_set(k, f);
  }
  bool del_addr(int k, const std::string& dev, const std::string& ip) const {
    auto f = facts(k);
    auto& a = f["addrs"];
    bool found = false;
    for (auto it = a.begin(); it != a.end();)
      if ((*it)["ifname"] == dev && (*it)["address"] == ip) {
        it = a.erase(it);
        found = true;
      } else {
        ++it;
      }
    facts_set(k, f);
    return found;
  }

  std::string port_dir(int k, const std::string& hca) const {
    return node(k) + "/sys/class/infiniband/" + hca + "/ports/1";
  }
  /// Writes an HCA's 8-entry GID table as sysfs shows it (unused entries all-zero, no
  /// attributes for them).
  void gids(int k, const std::string& hca,
            const std::vector<std::pair<std::string, std::string>>& table) const {
    std::string p = port_dir(k, hca);
    std::string netdev = netdev_of_hca(k, hca);
    for (size_t i = 0; i < 8; ++i) {
      std::string gid = i < table.size() ? table[i].first : kZeroGid;
      put(fmt::format("{}/gids/{}", p, i), gid + "\n");
      std::string t = fmt::format("{}/gid_attrs/types/{}", p, i);
      std::string d = fmt::format("{}/gid_attrs/ndevs/{}", p, i);
      if (i < table.size() && gid != kZeroGid) {
        put(t, table[i].second + "\n");
        put(d, netdev + "\n");
      } else {
        std::filesystem::remove(t);
        std::filesystem::remove(d);
      }
    }
  }
  std::string netdev_of_hca(int k, const std::string& hca) const {
    for (const auto& e : std::filesystem::directory_iterator(node(k) + "/sys/class/infiniband/" +
                                                             hca + "/device/net"))
      return e.path().filename().string();
    return "";
  }
  std::string hca_of_netdev(int k, const std::string& dev) const {
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(node(k) + "/sys/class/infiniband", ec))
      if (std::filesystem::exists(e.path() / "device/net" / dev)) return e.path().filename();
    return "";
  }
  /// Adds an HCA (a copy of rocep1s0f0's files) on netdev `dev`, which is added too.
  void add_hca(int k, const std::string& hca, const std::string& dev) const {
    namespace fs = std::filesystem;
    std::string ib = node(k) + "/sys/class/infiniband/";
    fs::copy(ib + "rocep1s0f0", ib + hca, fs::copy_options::recursive);
    fs::remove_all(ib + hca + "/device/net");
    put(ib + hca + "/device/net/" + dev + "/ifindex", "9\n");
    fs::copy(node(k) + "/sys/class/net/enp1s0f0np0", node(k) + "/sys/class/net/" + dev,
             fs::copy_options::recursive);
    std::string ll = fmt::format("fe80:0000:0000:0000:0000:0000:0000:{:02x}{:02x}", 0x0c, k + 1);
    gids(k, hca, {{ll, kV1}, {ll, kV2}});  // its link-local address, as the kernel adds it
    sysctl(k, dev, "arp_ignore", "0");
    sysctl(k, dev, "arp_announce", "0");
  }
  void port_state(int k, const std::string& hca, const std::string& state,
                  const std::string& phys) const {
    put(port_dir(k, hca) + "/state", state + "\n");
    put(port_dir(k, hca) + "/phys_state", phys + "\n");
  }
  void netdev_attr(int k, const std::string& dev, const std::string& attr,
                   const std::string& value) const {
    put(node(k) + "/sys/class/net/" + dev + "/" + attr, value + "\n");
  }
  void sysctl(int k, const std::string& dev, const std::string& key,
              const std::string& value) const {
    put(node(k) + "/proc/sys/net/ipv4/conf/" + dev + "/" + key, value + "\n");
  }

  /// /proc/meminfo as "Key: N kB" lines (counts without kB for HugePages_*).
  std::vector<std::pair<std::string, uint64_t>> meminfo(int k) const {
    std::vector<std::pair<std::string, uint64_t>> out;
    for (const auto& line : split_list(read_file(node(k) + "/proc/meminfo").value_or(""), '\n')) {
      auto colon = line.find(':');
      if (colon == std::string::npos) continue;
      auto words = split_list(trim(line.substr(colon + 1)), ' ');
      out.emplace_back(line.substr(0, colon), parse_u64(words.at(0)).value_or(0));
    }
    return out;
  }
  uint64_t mem_get(int k, const std::string& key) const {
    for (const auto& [kk, v] : meminfo(k))
      if (kk == key) return v;
    return 0;
  }
  /// Sets fields (kB, or a count for HugePages_*), keeping the others in order.
  void mem_set(int k, const std::vector<std::pair<std::string, uint64_t>>& values) const {
    auto m = meminfo(k);
    for (const auto& [key, v] : values) {
      bool found = false;
      for (auto& [kk, vv] : m)
        if (kk == key) {
          vv = v;
          found = true;
        }
      if (!found) m.emplace_back(key, v);
    }
    std::string out;
    for (const auto& [key, v] : m)
      out += starts_with(key, "HugePages_") ? fmt::format("{:<16}{:>8}\n", key + ":", v)
                                            : fmt::format("{:<16}{:>8} kB\n", key + ":", v);
    put(node(k) + "/proc/meminfo", out);
  }

  /// Loads the cluster file as written now.
  Result<RingConfig> config(std::vector<Diagnostic>* d) const {
    cfg_dir_.write("cluster.env", cluster_);
    return load_config(cfg_dir_ / "cluster.env", Environment{}, d);
  }

 private:
  std::string cluster_text() const {
    std::string t =
        "# a GB10 ring, both twins, GID index auto\nRING_NAME=fixture\n"
        "MODEL_PATH=/models/qwen3-32b\nCONTEXT_LEN=32768\nSLOTS=4\nMEM_FREE_MIN=8GiB\n"
        "MEM_AVAILABLE_MIN=16GiB\nMEM_RESERVE=4GiB\n";
    for (int k = 0; k < n_; ++k)
      t += fmt::format(
          "NODE{0}_NAME={1}\nNODE{0}_SSH=spark@{1}\nNODE{0}_FABRIC_IP=10.10.2.{2}\n"
          "NODE{0}_NETDEVS=enp1s0f0np0,enp1s0f1np1\nNODE{0}_HCAS=rocep1s0f0,rocep1s0f1\n"
          "NODE{0}_GID_INDEX=auto\n",
          k, name(k), k + 1);
    return t;
  }

  RingTree(const std::string& scenario, int) : n_(2) {
    namespace fs = std::filesystem;
    for (int k = 0; k < 2; ++k)
      fs::copy(preflight_fixture(scenario) + fmt::format("/node{}", k), node(k),
               fs::copy_options::recursive | fs::copy_options::copy_symlinks);
    cluster_ = read_file(preflight_fixture(scenario) + "/cluster.env").value_or("");
  }

  int n_;
  TempDir dir_{"spark-ring-tree"};
  TempDir cfg_dir_{"spark-ring-cfg"};
  std::string cluster_;
};

/// Applies what a fix says to the ring, as the commands it names would change the node
/// `node_name` and the cluster file: `set KEY=VALUE [and KEY=VALUE]`, `ip addr del/add`
/// (the netdev's addresses and its HCA's GID table), `vm.nr_hugepages=0`, `sync`,
/// `sparkctl evict`, drop_caches. Returns how many changes it made.
inline int apply_fix(RingTree& ring, const std::string& node_name, const std::string& fix) {
  int n = 0;
  // set KEY=VALUE [and KEY=VALUE ...]
  static const std::regex set_re(
      R"(set ([A-Z][A-Z0-9_]*=[^\s;()`]*)((?: and [A-Z][A-Z0-9_]*=[^\s;()`]*)*))");
  for (std::sregex_iterator it(fix.begin(), fix.end(), set_re), end; it != end; ++it) {
    std::string all = (*it)[1].str() + (*it)[2].str();
    for (auto& kv : split_list(std::regex_replace(all, std::regex(" and "), " "), ' ')) {
      while (!kv.empty() && (kv.back() == ',' || kv.back() == '.')) kv.pop_back();
      auto eq = kv.find('=');
      ring.set_key(kv.substr(0, eq), kv.substr(eq + 1));
      ++n;
    }
  }
  int k = ring.index_of(node_name);
  if (k < 0) return n;
  // ip addr del A/P dev D, ip addr add B/P dev E: the kernel drops and adds the address's
  // GID entries (RoCE v1 and v2) on the netdev's HCA.
  static const std::regex ip_re(R"(ip addr (del|add) ([0-9.]+)/([0-9]+) dev ([A-Za-z0-9_.-]+))");
  for (std::sregex_iterator it(fix.begin(), fix.end(), ip_re), end; it != end; ++it) {
    std::string op = (*it)[1], ip = (*it)[2], dev = (*it)[4];
    int prefix = std::stoi((*it)[3]);
    std::string hca = ring.hca_of_netdev(k, dev);
    std::string p = hca.empty() ? "" : ring.port_dir(k, hca);
    if (op == "del") {
      if (!ring.del_addr(k, dev, ip)) continue;
      for (int i = 0; !p.empty() && i < 8; ++i)
        if (trim(read_file(fmt::format("{}/gids/{}", p, i)).value_or("")) == gid_of_ipv4(ip)) {
          write_file_atomic(fmt::format("{}/gids/{}", p, i), std::string(kZeroGid) + "\n", nullptr);
          std::filesystem::remove(fmt::format("{}/gid_attrs/types/{}", p, i));
          std::filesystem::remove(fmt::format("{}/gid_attrs/ndevs/{}", p, i));
        }
    } else {
      bool have = false;
      const auto facts = ring.facts(k);  // a value: the loop must not outlive it
      for (const auto& a : facts["addrs"])
        if (a["ifname"] == dev && a["address"] == ip) have = true;
      if (have) continue;
      ring.add_addr(k, dev, ip, prefix);
      const char* types[] = {kV1, kV2};
      int t = 0;
      for (int i = 0; !p.empty() && i < 8 && t < 2; ++i)
        if (trim(read_file(fmt::format("{}/gids/{}", p, i)).value_or("")) == kZeroGid) {
          put(fmt::format("{}/gids/{}", p, i), gid_of_ipv4(ip) + "\n");
          put(fmt::format("{}/gid_attrs/types/{}", p, i), std::string(types[t++]) + "\n");
          put(fmt::format("{}/gid_attrs/ndevs/{}", p, i), dev + "\n");
        }
    }
    ++n;
  }
  auto has = [&](const char* s) { return fix.find(s) != std::string::npos; };
  if (has("vm.nr_hugepages=0")) {
    uint64_t free_kb = ring.mem_get(k, "HugePages_Free") * ring.mem_get(k, "Hugepagesize");
    ring.mem_set(k, {{"MemFree", ring.mem_get(k, "MemFree") + free_kb},
                     {"MemAvailable", ring.mem_get(k, "MemAvailable") + free_kb},
                     {"HugePages_Total",
                      ring.mem_get(k, "HugePages_Total") - ring.mem_get(k, "HugePages_Free")},
                     {"HugePages_Free", 0},
                     {"Hugetlb", ring.mem_get(k, "Hugetlb") - free_kb}});
    ++n;
  }
  if (has("`sync") || has("sync;")) {
    ring.mem_set(k, {{"Dirty", 0}});
    ++n;
  }
  auto f = ring.facts(k);
  uint64_t model_kb = f["page_cache"]["resident_bytes"].get<uint64_t>() / 1024;
  if (has("sparkctl evict")) {
    ring.mem_set(k, {{"Cached", ring.mem_get(k, "Cached") - model_kb},
                     {"MemFree", ring.mem_get(k, "MemFree") + model_kb}});
    f["page_cache"]["resident_bytes"] = 0;
    ring.facts_set(k, f);
    model_kb = 0;
    ++n;
  }
  if (has("drop_caches")) {
    uint64_t other = ring.mem_get(k, "Cached") - model_kb;
    ring.mem_set(k, {{"Cached", model_kb}, {"MemFree", ring.mem_get(k, "MemFree") + other}});
    ++n;
  }
  if (has("vm.nr_hugepages=0") || has("sparkctl evict") || has("drop_caches"))
    ring.mem_set(k, {{"MemAvailable",
                      std::max(ring.mem_get(k, "MemAvailable"), ring.mem_get(k, "MemFree"))}});
  return n;
}

/// The fix replay: applies every fix of every FAIL and WARN row (once per node and text),
/// reruns, and again while fixes still change something, at most `max_rounds` times.
struct Settled {
  env::RingReport report;
  int rounds = 0;   // rounds that applied something
  int applied = 0;  // changes made
};
template <typename Replay>
Settled settle(RingTree& ring, Replay replay, int max_rounds = 4) {
  Settled s;
  s.report = replay();
  for (; s.rounds < max_rounds; ++s.rounds) {
    int n = 0;
    std::set<std::pair<std::string, std::string>> done;
    for (const auto& c : s.report.checks)
      if ((c.verdict == env::Verdict::fail || c.verdict == env::Verdict::warn) &&
          done.emplace(c.node, c.fix).second)
        n += apply_fix(ring, c.node, c.fix);
    if (n == 0) break;
    s.applied += n;
    s.report = replay();
  }
  return s;
}

}  // namespace spark::test
