// The node checks of preflight: everything one node can find out about itself.
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <set>

#include "core/install_layout.h"
#include "core/strings.h"
#include "env/engine_fit.h"
#include "env/facts.h"
#include "env/gpu.h"
#include "env/gpu_throttle.h"
#include "env/known_bad.h"
#include "env/meminfo.h"
#include "env/model_files.h"
#include "env/net.h"
#include "env/plan.h"
#include "env/preflight.h"
#include "env/rdma.h"
#include "spark/version.h"

namespace spark::env {

using nlohmann::json;

namespace {

constexpr uint64_t kGiB = 1ull << 30;
// Page cache on unified memory above which `mem` warns: the floor operators keep free.
constexpr uint64_t kUmaCacheWarn = 8 * kGiB;

struct NodeRun {
  const RingConfig& cfg;
  const NodeConfig& node;
  const Sysroot& root;
  const CheckFilter& filter;
  NodeReport& rep;

  void add(const char* id, std::string subject, Verdict v, std::string msg, std::string fix = {}) {
    rep.checks.push_back({node.name, id, std::move(subject), v, std::move(msg), std::move(fix)});
  }
  std::string key(const char* field) const { return fmt::format("NODE{}_{}", node.index, field); }
};

// The node whose configured fabric address `ip` is, other than `n` ("" when none).
std::string fabric_owner(const RingConfig& cfg, const NodeConfig& n, const std::string& ip) {
  for (const auto& o : cfg.nodes)
    if (o.index != n.index && o.fabric_ip == ip) return o.name;
  return "";
}

// The address a twin serves the fabric with, of those its netdev holds: the configured fabric
// address; else one in the subnet of another node's fabric address; else (a second twin) one
// with the fabric address's host number, else outside the first twin's subnet. Never a
// link-local 169.254/16 address and never another node's fabric address. "" when none is.
std::string twin_address(const RingConfig& cfg, const NodeConfig& n, const NodeFacts& facts,
                         const std::string& netdev, const std::string& first) {
  std::vector<const IfAddr*> c;
  for (const auto& a : facts.addrs)
    if (a.ifname == netdev && a.family == "inet" && !ipv4_link_local(a.address) &&
        fabric_owner(cfg, n, a.address).empty())
      c.push_back(&a);
  for (const auto* a : c)
    if (a->address == n.fabric_ip) return a->address;
  for (const auto* a : c)
    for (const auto& o : cfg.nodes)
      if (o.index != n.index && ipv4_same_subnet(a->address, o.fabric_ip, a->prefix))
        return a->address;
  auto fab = parse_ipv4(n.fabric_ip);
  for (const auto* a : c)
    if (auto v = parse_ipv4(a->address); v && fab && (*v & 0xff) == (*fab & 0xff))
      return a->address;
  for (const auto* a : c)
    if (first.empty() || !ipv4_same_subnet(a->address, first, a->prefix)) return a->address;
  return c.empty() ? "" : c[0]->address;
}

int prefix_of(const NodeFacts& facts, const std::string& netdev, const std::string& ip) {
  for (const auto& a : facts.addrs)
    if (a.family == "inet" && a.address == ip && (netdev.empty() || a.ifname == netdev))
      return a.prefix;
  return 24;
}

bool is_gb10(const Sysroot& root) {
  auto product = root.read_line("/sys/class/dmi/id/product_name").value_or("");
  return product.find("DGX Spark") != std::string::npos ||
         product.find("GB10") != std::string::npos;
}

// The adapter part of an HCA name: its functions differ in fN ("rocep1s0f1" -> "rocep1s0"),
// and the GB10's second PCIe link names the same ports with a domain ("roceP2p1s0f1").
std::string adapter_of(const std::string& hca) {
  std::string h = hca;
  if (starts_with(h, "roceP")) {
    size_t e = 5;
    while (e < h.size() && std::isdigit(static_cast<unsigned char>(h[e]))) ++e;
    h = "roce" + h.substr(e);
  }
  auto f = h.find_last_of('f');
  if (f == std::string::npos || f + 1 >= h.size() ||
      h.find_first_not_of("0123456789", f + 1) != std::string::npos)
    return h;
  return h.substr(0, f);
}

// A pinned HCA whose port is not ACTIVE while another function (of the same adapter
// first) is ACTIVE with the address the pinned twin should carry: the pin names the wrong
// port. Returns the fix that pins the live ports instead, "" when there is none.
std::string wrong_pin_fix(NodeRun& r, const NodeFacts& facts,
                          const std::vector<std::optional<Hca>>& hcas, std::string* detail,
                          std::vector<size_t>* dead_twins) {
  const auto& n = r.node;
  if (n.hcas.size() != n.netdevs.size()) return "";
  auto hcas_v = n.hcas, nd_v = n.netdevs;
  std::vector<std::string> used;  // netdevs of the live pinned twins
  for (size_t i = 0; i < hcas.size(); ++i)
    if (hcas[i] && hcas[i]->port(1) && hcas[i]->port(1)->state_code == 4)
      used.insert(used.end(), hcas[i]->netdevs.begin(), hcas[i]->netdevs.end());
  std::vector<std::string> parts;
  for (size_t i = 0; i < n.hcas.size(); ++i) {
    const RdmaPort* p = hcas[i] ? hcas[i]->port(1) : nullptr;
    if (!hcas[i] || !p || p->state_code == 4) continue;
    // The address this twin should carry: the fabric address when no live twin holds it,
    // else an address in a subnet no live twin's address is in.
    bool fabric_live = false;
    for (const auto& d : used)
      if (facts.netdev_of(n.fabric_ip) == d) fabric_live = true;
    std::string best, best_nd, best_ip;
    int best_score = -1;
    for (const auto& name : list_hcas(r.root)) {
      if (std::find(hcas_v.begin(), hcas_v.end(), name) != hcas_v.end()) continue;
      auto h = read_hca(r.root, name);
      const RdmaPort* q = h ? h->port(1) : nullptr;
      if (!q || q->state_code != 4 || q->link_layer != "Ethernet" || h->netdevs.size() != 1 ||
          std::find(used.begin(), used.end(), h->netdevs[0]) != used.end())
        continue;
      std::string ip;
      for (const auto& a : facts.addrs) {
        if (a.ifname != h->netdevs[0] || a.family != "inet" || ipv4_link_local(a.address) ||
            !fabric_owner(r.cfg, n, a.address).empty())
          continue;
        bool ok = fabric_live ? a.address != n.fabric_ip : a.address == n.fabric_ip;
        for (const auto& d : used)
          for (const auto& b : facts.addrs)
            if (b.ifname == d && b.family == "inet" &&
                ipv4_same_subnet(a.address, b.address, std::min(a.prefix, b.prefix)))
              ok = false;  // would give this twin the other twin's subnet
        if (ok) {
          ip = a.address;
          break;
        }
      }
      if (ip.empty()) continue;
      int score = adapter_of(name) == adapter_of(n.hcas[i]) ? 1 : 0;
      if (score > best_score) {
        best_score = score;
        best = name;
        best_nd = h->netdevs[0];
        best_ip = ip;
      }
    }
    if (best.empty()) continue;
    parts.push_back(fmt::format("{} port 1 is {}, but {}{} is ACTIVE with {} on {}", n.hcas[i],
                                p->state.empty() ? "not ACTIVE" : p->state, best,
                                best_score ? " (the same adapter)" : "", best_ip, best_nd));
    hcas_v[i] = best;
    nd_v[i] = best_nd;
    used.push_back(best_nd);
    dead_twins->push_back(i);
  }
  if (parts.empty()) return "";
  *detail = join(parts, "; ") + ": the pin names the wrong port";
  return fmt::format("pin the live ports: set {}={} and {}={}", r.key("HCAS"), join(hcas_v, ","),
                     r.key("NETDEVS"), join(nd_v, ","));
}

// Rows about a twin that the wrong pin explains get its fix (a fix that keeps the dead port
// would not bring the ring up).
void apply_wrong_pin(NodeRun& r, const NodeFacts& facts,
                     const std::vector<std::optional<Hca>>& hcas) {
  std::string detail;
  std::vector<size_t> dead;
  std::string fix = wrong_pin_fix(r, facts, hcas, &detail, &dead);
  if (fix.empty()) return;
  std::set<std::string> subjects = {"fabric ip", "twins"};
  for (size_t i : dead) {
    subjects.insert(r.node.hcas[i]);
    subjects.insert(r.node.hcas[i] + ":1");
    subjects.insert(r.node.netdevs[i]);
  }
  for (auto& c : r.rep.checks) {
    if (c.node != r.node.name || c.verdict == Verdict::pass || c.verdict == Verdict::skip ||
        !subjects.count(c.subject))
      continue;
    if (c.id == "rdma.port") c.message += "; " + detail;
    c.fix = fix;
  }
}

// The fix for HCAs that map to other netdevs than configured: the netdevs the HCAs really
// have, in the order of NODE<i>_HCAS, when that is a list the config check accepts.
std::string netdev_fix(NodeRun& r, const std::vector<std::optional<Hca>>& hcas) {
  std::vector<std::string> real;
  for (const auto& h : hcas) {
    if (!h || h->netdevs.size() != 1) return "see the other rdma.netdev rows";
    if (std::find(real.begin(), real.end(), h->netdevs[0]) != real.end())
      return "see the rdma.netdev 'shared' row";
    real.push_back(h->netdevs[0]);
  }
  return fmt::format("set {}={} (the netdev of each of {}, in order)", r.key("NETDEVS"),
                     join(real, ","), r.key("HCAS"));
}

// Two HCAs on one netdev: keep the first of those that share it, and every other HCA with a
// netdev of its own.
std::string shared_netdev_fix(NodeRun& r, const std::vector<std::optional<Hca>>& hcas,
                              const std::vector<std::string>& names) {
  std::vector<std::string> keep_h, keep_d;
  bool kept_shared = false;
  for (const auto& h : hcas) {
    if (!h || h->netdevs.empty()) continue;
    bool shared = std::find(names.begin(), names.end(), h->name) != names.end();
    if (shared && kept_shared) continue;
    if (std::find(keep_d.begin(), keep_d.end(), h->netdevs[0]) != keep_d.end()) continue;
    kept_shared = kept_shared || shared;
    keep_h.push_back(h->name);
    keep_d.push_back(h->netdevs[0]);
  }
  return fmt::format(
      "use one HCA per netdev: set {}={} and {}={}; to use {} as well, give it its own netdev "
      "(check the port's mode and bonding: /sys/class/infiniband/{}/device/net should list "
      "one netdev)",
      r.key("HCAS"), join(keep_h, ","), r.key("NETDEVS"), join(keep_d, ","), names.back(),
      names.back());
}

void check_rdma(NodeRun& r, const NodeFacts& facts, std::vector<std::optional<Hca>>& hcas) {
  const auto& n = r.node;
  bool want_devices = r.filter.enabled("rdma.devices");
  if (n.hcas.empty()) {
    for (const char* id : {"rdma.devices", "rdma.port", "rdma.netdev", "rdma.gid"})
      if (r.filter.enabled(id))
        r.add(id, "", Verdict::skip,
              fmt::format("no HCAs configured ({}): NCCL will use TCP sockets", r.key("HCAS")));
    return;
  }
  auto present = list_hcas(r.root);
  for (const auto& name : n.hcas) {
    hcas.push_back(read_hca(r.root, name));
    if (!want_devices) continue;
    if (hcas.back()) {
      r.add("rdma.devices", name, Verdict::pass, fmt::format("{} present", name));
    } else if (auto why = r.root.problem("/sys/class/infiniband/" + name)) {
      // Listed but unreadable (a symlink loop in a captured tree): not "did you mean".
      r.add("rdma.devices", name, Verdict::fail,
            fmt::format("/sys/class/infiniband/{} cannot be read: {}", name, *why),
            "recapture the node (`sparkctl capture-node`): a live sysfs has no symlink loops");
    } else {
      auto hint = did_you_mean(name, present);
      r.add("rdma.devices", name, Verdict::fail,
            fmt::format("no RDMA device {} under /sys/class/infiniband (present: {})", name,
                        present.empty() ? "none" : join(present, ", ")),
            present.empty()
                ? "load the HCA driver (mlx5_core, mlx5_ib) and rdma-core, then rerun"
                : fmt::format("fix {}{}", r.key("HCAS"),
                              hint.empty() ? "" : fmt::format(" (did you mean {}?)", hint)));
    }
  }
  if (want_devices) {
    std::vector<std::string> uverbs;
    for (const auto& e : r.root.list("/dev/infiniband"))
      if (starts_with(e, "uverbs")) uverbs.push_back(e);
    if (uverbs.empty()) {
      r.add("rdma.devices", "/dev/infiniband", Verdict::fail,
            r.root.exists("/dev/infiniband")
                ? "no /dev/infiniband/uverbs*: NCCL will say `NET/IB : No "
                  "device found` and fall back to sockets"
                : "no /dev/infiniband: NCCL will say `NET/IB : No device "
                  "found` and fall back to sockets (prefill ~2.7x slower)",
            "load ib_uverbs (`modprobe ib_uverbs`); in a container pass --device=/dev/infiniband "
            "and --ulimit memlock=-1");
    } else {
      std::vector<std::string> denied;
      for (const auto& [name, rw] : facts.uverbs)
        if (!rw) denied.push_back(name);
      if (!denied.empty())
        r.add("rdma.devices", "/dev/infiniband", Verdict::fail,
              fmt::format("/dev/infiniband/{} not readable and writable by {}", join(denied, ", "),
                          facts.user.empty() ? "the serving user" : facts.user),
              "give the serving user access (the rdma group, or a udev rule MODE=\"0666\" for "
              "uverbs)");
      else
        r.add("rdma.devices", "/dev/infiniband", Verdict::pass,
              fmt::format("{} usable", join(uverbs, ", ")));
    }
  }

  for (size_t i = 0; i < n.hcas.size(); ++i) {
    const auto& h = hcas[i];
    if (!h) continue;
    std::string subject = h->name + ":1";
    const RdmaPort* p = h->port(1);
    if (p && i < r.rep.links.size()) r.rep.links[i].port_state = p->state;
    std::string netdev = i < n.netdevs.size() ? n.netdevs[i] : std::string();
    if (r.filter.enabled("rdma.port")) {
      if (!p) {
        r.add("rdma.port", subject, Verdict::fail, fmt::format("{} has no port 1", h->name),
              "check the HCA firmware and driver");
      } else {
        std::vector<std::string> bad;
        if (p->state_code != 4)
          bad.push_back(fmt::format("state {}", p->state.empty() ? "unknown" : p->state));
        if (p->phys_state_code != 5)
          bad.push_back(
              fmt::format("physical state {}", p->phys_state.empty() ? "unknown" : p->phys_state));
        if (p->link_layer != "Ethernet")
          bad.push_back(fmt::format("link layer {} (RoCE needs Ethernet)",
                                    p->link_layer.empty() ? "unknown" : p->link_layer));
        if (bad.empty())
          r.add("rdma.port", subject, Verdict::pass,
                fmt::format("{}, {}, {}", p->state, p->phys_state, p->link_layer));
        else
          r.add("rdma.port", subject, Verdict::fail,
                fmt::format("{} port 1: {}; needs 4: ACTIVE, 5: LinkUp, Ethernet", h->name,
                            join(bad, ", ")),
                p->link_layer != "Ethernet" && !p->link_layer.empty()
                    ? "set the port to Ethernet (mlxconfig ... LINK_TYPE_P1=2) and reboot"
                    : fmt::format("check the cable and the peer; `ip link set {} up`",
                                  netdev.empty() ? "<netdev>" : netdev));
      }
    }
    if (r.filter.enabled("rdma.netdev") && !netdev.empty()) {
      if (std::find(h->netdevs.begin(), h->netdevs.end(), netdev) == h->netdevs.end()) {
        std::string actual = h->netdevs.empty() ? "no netdev" : join(h->netdevs, ", ");
        r.add("rdma.netdev", h->name, Verdict::fail,
              fmt::format("{} maps to {}, not the configured {}", h->name, actual, netdev),
              netdev_fix(r, hcas));
      } else {
        auto v4 = facts.ipv4_of(netdev);
        if (v4.empty())
          r.add("rdma.netdev", h->name, Verdict::fail,
                fmt::format("{} -> {}, but {} has no IPv4 address", h->name, netdev, netdev),
                fmt::format("assign the fabric address to {} and make it persistent", netdev));
        else
          r.add("rdma.netdev", h->name, Verdict::pass,
                fmt::format("{} -> {} ({})", h->name, netdev, join(v4, ", ")));
      }
    }
  }
  if (r.filter.enabled("rdma.netdev")) {
    // Two configured HCAs on one netdev: one link driven through two devices; no order of
    // NODE<i>_NETDEVS can describe it.
    std::map<std::string, std::vector<std::string>> by_netdev;
    for (const auto& h : hcas)
      if (h)
        for (const auto& d : h->netdevs) by_netdev[d].push_back(h->name);
    for (const auto& [d, names] : by_netdev)
      if (names.size() > 1)
        r.add("rdma.netdev", "shared " + d, Verdict::fail,
              fmt::format("{} {} map to netdev {}: two HCAs on one link, and {} cannot list {} "
                          "twice",
                          join(names, " and "), names.size() == 2 ? "both" : "all", d,
                          r.key("NETDEVS"), d),
              shared_netdev_fix(r, hcas, names));
  }
  if (r.filter.enabled("rdma.netdev") && !n.netdevs.empty()) {
    std::string holder = facts.netdev_of(n.fabric_ip);
    if (std::find(n.netdevs.begin(), n.netdevs.end(), holder) == n.netdevs.end()) {
      // What the first fabric netdev holds instead: an address of its own (then the cluster
      // file names the wrong one), another node's (a cloned image: give it its own), or
      // nothing (then the address moves there, off the LAN port if it is there).
      const std::string& fab = n.netdevs[0];
      std::string own, theirs, owner;
      for (const auto& a : facts.addrs) {
        if (a.ifname != fab || a.family != "inet" || ipv4_link_local(a.address)) continue;
        std::string o = fabric_owner(r.cfg, n, a.address);
        if (!o.empty() && theirs.empty()) {
          theirs = a.address;
          owner = o;
        } else if (o.empty() && own.empty()) {
          own = a.address;
        }
      }
      std::string fix;
      if (!theirs.empty()) {
        int p = prefix_of(facts, fab, theirs);
        fix = fmt::format(
            "{} holds {}, node {}'s fabric address: give this node its own: {} "
            "(and in its netplan file)",
            fab, theirs, owner,
            ip_addr_move(theirs, p, fab, holder.empty() ? n.fabric_ip : "", p, fab));
        if (!holder.empty())
          fix += fmt::format(", then move {} here: {}", n.fabric_ip,
                             ip_addr_move(n.fabric_ip, prefix_of(facts, holder, n.fabric_ip),
                                          holder, n.fabric_ip, p, fab));
      } else if (!own.empty()) {
        fix = fmt::format("set {}={} (the address {} holds{})", r.key("FABRIC_IP"), own, fab,
                          holder.empty() ? "" : fmt::format("; {} is {}'s", n.fabric_ip, holder));
      } else if (!holder.empty()) {
        int p = prefix_of(facts, holder, n.fabric_ip);
        fix = fmt::format(
            "move the fabric address off {} to the fabric port: {} (and in the "
            "netplan file)",
            holder, ip_addr_move(n.fabric_ip, p, holder, n.fabric_ip, p, fab));
      } else {
        fix = fmt::format("assign it: {} (and in the netplan file), or correct {}",
                          ip_addr_move("", 0, "", n.fabric_ip, 24, fab), r.key("FABRIC_IP"));
      }
      r.add("rdma.netdev", "fabric ip", Verdict::fail,
            fmt::format("{} {} is not on {} ({})", r.key("FABRIC_IP"), n.fabric_ip,
                        join(n.netdevs, " or "),
                        holder.empty() ? "no interface holds it" : "it is on " + holder),
            fix);
    }
  }
}

void check_gid(NodeRun& r, const NodeFacts& facts, const std::vector<std::optional<Hca>>& hcas) {
  const auto& n = r.node;
  if (n.hcas.empty()) return;
  std::vector<KnownAddress> known;
  for (const auto& o : r.cfg.nodes)
    if (o.index != n.index && !o.fabric_ip.empty())
      known.push_back({o.fabric_ip, o.name, false, "", ""});
  std::vector<std::pair<std::string, int>> resolved;
  std::vector<std::pair<size_t, int>> found;  // (twin, index of its own RoCE v2 address)
  std::vector<std::pair<size_t, GidResolution>> results;
  bool want = r.filter.enabled("rdma.gid");
  for (size_t i = 0; i < n.hcas.size(); ++i) {
    const auto& h = hcas[i];
    LinkFacts& link = r.rep.links[i];
    if (!h) {
      if (want)
        r.add("rdma.gid", n.hcas[i] + ":1", Verdict::fail,
              fmt::format("{}: no such device, so no GID", n.hcas[i]), "see rdma.devices");
      continue;
    }
    // The GID table follows the HCA's own netdev: when that is not the configured one
    // (rdma.netdev says so), resolve against the netdev the HCA really has.
    std::string netdev = link.netdev;
    if (!netdev.empty() && h->netdevs.size() == 1 && h->netdevs[0] != netdev)
      netdev = h->netdevs[0];
    std::string ip = n.fabric_ip;
    if (!netdev.empty() && facts.netdev_of(n.fabric_ip) != netdev) {
      // The other twin carries its own address: the one in the fabric's subnet.
      auto mine = twin_address(r.cfg, n, facts, netdev, i ? r.rep.links[0].ipv4 : std::string());
      if (!mine.empty()) {
        ip = mine;
      } else {
        // Only another node's address here (a cloned image): its GID is that node's, never
        // this one's. net.addr names the pair and the move.
        std::string theirs, owner;
        for (const auto& a : facts.addrs)
          if (a.ifname == netdev && a.family == "inet" &&
              !(owner = fabric_owner(r.cfg, n, a.address)).empty()) {
            theirs = a.address;
            break;
          }
        if (!theirs.empty()) {
          link.gid_index.reset();
          if (want)
            r.add("rdma.gid", n.hcas[i] + ":1", Verdict::fail,
                  fmt::format("{} holds only {}, node {}'s fabric address: its GID is not this "
                              "node's to use [other_node]",
                              netdev, theirs, owner),
                  i == 0 ? "give this node its own address: " +
                               ip_addr_move(theirs, prefix_of(facts, netdev, theirs), netdev,
                                            n.fabric_ip, prefix_of(facts, netdev, theirs), netdev)
                         : "see the net.addr row");
          continue;
        }
      }
    }
    // This node's addresses on its other netdevs: a GID holding one of them is a crossed
    // port or a swapped address, not another node's.
    auto mine = known;
    for (const auto& a : facts.addrs) {
      if (a.family != "inet" || a.address == ip || a.ifname == netdev ||
          std::find(h->netdevs.begin(), h->netdevs.end(), a.ifname) != h->netdevs.end())
        continue;
      std::string hca;
      for (size_t j = 0; j < n.netdevs.size() && j < n.hcas.size(); ++j)
        if (n.netdevs[j] == a.ifname) hca = n.hcas[j];
      mine.insert(mine.begin(), KnownAddress{a.address, n.name, true, a.ifname, hca});
    }
    auto res = resolve_roce_gid(*h, 1, ip, n.gid_index, mine, r.key("GID_INDEX"));
    link.gid_index = res.usable();
    if (res.usable()) resolved.emplace_back(h->name, *res.usable());
    if (res.index) found.emplace_back(i, *res.index);
    results.emplace_back(i, std::move(res));
  }
  // One NODE<i>_GID_INDEX serves every twin: "set it to 5" is a fix only when every twin has
  // its address at 5; else the fix is the layout, or one twin alone.
  bool one_index = std::all_of(found.begin(), found.end(),
                               [&](const auto& f) { return f.second == found[0].second; }) &&
                   found.size() == n.hcas.size();
  auto one_twin = [&](size_t i, int idx) {
    std::string nd = i < n.netdevs.size() ? n.netdevs[i] : "";
    return fmt::format("set {}={}{} and {}={}", r.key("HCAS"), n.hcas[i],
                       nd.empty() ? "" : fmt::format(" and {}={}", r.key("NETDEVS"), nd),
                       r.key("GID_INDEX"), idx);
  };
  std::string layouts;
  for (const auto& [i, idx] : found)
    layouts += fmt::format("{}{} at {}", layouts.empty() ? "" : ", ", n.hcas[i], idx);
  for (auto& [i, res] : results) {
    if (!want) continue;
    std::string fix = res.fix;
    if (!res.ok() && res.index && !one_index && n.hcas.size() > 1)
      fix = fmt::format(
          "the twins hold their RoCE v2 addresses at different indexes ({}) and a single {} "
          "must serve both: give both twins the same address layout so the tables line up, or use "
          "this "
          "twin alone: {}",
          layouts, r.key("GID_INDEX"), one_twin(i, *res.index));
    r.add("rdma.gid", n.hcas[i] + ":1", res.ok() ? Verdict::pass : Verdict::fail,
          fmt::format("{}{}", res.message,
                      res.ok() ? "" : fmt::format(" [{}]", gid_fault_name(res.fault))),
          fix);
  }
  if (want && resolved.size() > 1) {
    bool same = std::all_of(resolved.begin(), resolved.end(),
                            [&](const auto& p) { return p.second == resolved[0].second; });
    if (!same) {
      std::vector<std::string> parts;
      for (const auto& [hca, idx] : resolved) parts.push_back(fmt::format("{} at {}", hca, idx));
      r.add("rdma.gid", "twins", Verdict::fail,
            fmt::format("RoCE v2 GIDs differ between HCAs ({}); NCCL_IB_GID_INDEX is one value "
                        "per process",
                        join(parts, ", ")),
            fmt::format("give both twins the same address layout (an IPv4 each, the same IPv6 "
                        "addresses) so the tables line up, or use one twin: {}",
                        one_twin(0, resolved[0].second)));
    }
  }
}

// A twin left out halves the fabric (98 vs 161 Gb/s measured with one twin vs both). Only a
// twin with a netdev of its own can be added (one that shares a configured HCA's netdev would
// make NODE<i>_NETDEVS list it twice, which the config check refuses), and "add it" is the
// fix only when its RoCE v2 address sits at the configured twins' GID index.
void check_idle_twins(NodeRun& r, const NodeFacts& facts,
                      const std::vector<std::optional<Hca>>& hcas) {
  const auto& n = r.node;
  if (!r.filter.enabled("rdma.devices") || n.hcas.empty()) return;
  std::vector<std::string> used;
  for (const auto& h : hcas)
    if (h) used.insert(used.end(), h->netdevs.begin(), h->netdevs.end());
  std::optional<int> index;
  for (const auto& l : r.rep.links)
    if (l.gid_index) index = l.gid_index;
  std::vector<std::string> idle, idle_netdevs, misaligned;
  for (const auto& name : list_hcas(r.root)) {
    if (std::find(n.hcas.begin(), n.hcas.end(), name) != n.hcas.end()) continue;
    auto h = read_hca(r.root, name);
    const RdmaPort* p = h ? h->port(1) : nullptr;
    if (!p || p->state_code != 4 || p->link_layer != "Ethernet" || h->netdevs.size() != 1 ||
        std::find(used.begin(), used.end(), h->netdevs[0]) != used.end())
      continue;
    auto v4 = facts.ipv4_of(h->netdevs[0]);
    if (v4.empty()) continue;  // no address: NCCL could not use it either
    auto res = resolve_roce_gid(*h, 1, v4[0], std::nullopt,
                                std::vector<std::pair<std::string, std::string>>{}, "");
    if (!res.index) continue;
    if (index && *res.index != *index) {
      misaligned.push_back(fmt::format("{} (RoCE v2 at GID index {}, the configured twins' at {})",
                                       name, *res.index, *index));
      continue;
    }
    idle.push_back(name);
    idle_netdevs.push_back(h->netdevs[0]);
  }
  if (!idle.empty() && n.hcas.size() == n.netdevs.size()) {
    auto hcas_v = n.hcas, nd_v = n.netdevs;
    hcas_v.insert(hcas_v.end(), idle.begin(), idle.end());
    nd_v.insert(nd_v.end(), idle_netdevs.begin(), idle_netdevs.end());
    r.add("rdma.devices", "twins", Verdict::warn,
          fmt::format("{} {} ACTIVE but not in {}: NCCL uses only the configured HCAs",
                      join(idle, ", "), idle.size() == 1 ? "is" : "are", r.key("HCAS")),
          fmt::format("set {}={} and {}={} to use both twins", r.key("HCAS"), join(hcas_v, ","),
                      r.key("NETDEVS"), join(nd_v, ",")));
  } else if (!misaligned.empty()) {
    r.add("rdma.devices", "twins", Verdict::warn,
          fmt::format("{} {} ACTIVE but not in {}: NCCL uses only the configured HCAs",
                      join(misaligned, ", "), misaligned.size() == 1 ? "is" : "are", r.key("HCAS")),
          "to use both twins, first give them the same address layout (an IPv4 each, the same "
          "IPv6 addresses) so their GID tables line up, then add the twin to " +
              r.key("HCAS") + " and " + r.key("NETDEVS"));
  }
}

void check_links(NodeRun& r, const NodeFacts& facts, bool gb10) {
  const auto& n = r.node;
  if (!r.filter.enabled("net.link")) return;
  if (n.netdevs.empty()) {
    r.add("net.link", "", Verdict::skip,
          fmt::format("no fabric netdevs configured ({})", r.key("NETDEVS")));
    return;
  }
  int64_t floor_gbps = 0;
  const auto& lsm = r.cfg.get("LINK_SPEED_MIN");
  if (lsm == "auto" || lsm.empty())
    floor_gbps = gb10 ? 200 : 0;
  else
    floor_gbps = parse_i64(lsm).value_or(0);
  int64_t mtu_min = r.cfg.get_int("MTU_MIN");
  for (size_t i = 0; i < n.netdevs.size(); ++i) {
    auto d = read_netdev(r.root, n.netdevs[i]);
    auto& link = r.rep.links[i];
    link.operstate = d.operstate;
    link.mtu = d.mtu.value_or(0);
    link.speed_mbps = d.speed_mbps.value_or(0);
    if (!d.exists) {
      r.add("net.link", d.name, Verdict::fail,
            fmt::format("no netdev {} under /sys/class/net", d.name),
            fmt::format("fix {}", r.key("NETDEVS")));
      continue;
    }
    (void)facts;
    std::string desc =
        fmt::format("{} {}, {}, MTU {}", d.name, d.operstate.empty() ? "?" : d.operstate,
                    d.speed_mbps ? fmt::format("{} Gb/s", *d.speed_mbps / 1000) : "speed unknown",
                    d.mtu ? std::to_string(*d.mtu) : "?");
    if (d.operstate != "up") {
      r.add("net.link", d.name, Verdict::fail,
            fmt::format("{}: operstate {}, not up", desc, d.operstate),
            fmt::format("check the cable; `ip link set {} up`", d.name));
    } else if (floor_gbps > 0 && (!d.speed_mbps || *d.speed_mbps < floor_gbps * 1000)) {
      r.add("net.link", d.name, d.speed_mbps ? Verdict::fail : Verdict::warn,
            fmt::format("{}: below LINK_SPEED_MIN {} Gb/s", desc, floor_gbps),
            "reseat the cable or check the peer's port speed (`ethtool " + d.name + "`)");
    } else if (d.mtu && *d.mtu < mtu_min) {
      r.add("net.link", d.name, Verdict::warn, fmt::format("{}: MTU under {}", desc, mtu_min),
            fmt::format("`ip link set dev {} mtu {}` on every node (and persist it)", d.name,
                        mtu_min));
    } else {
      r.add("net.link", d.name, Verdict::pass, desc);
    }
  }
}

// Two twins in one IPv4 subnet: two routes to it, and ARP answers for either address from
// whichever port the kernel likes (arp_ignore=0, arp_announce=0), so traffic meant for one
// twin arrives on the other. Safe enough only with arp_ignore>=1 and arp_announce=2 on both.
void check_subnets(NodeRun& r, const NodeFacts& facts) {
  if (!r.filter.enabled("net.subnet")) return;
  const auto& links = r.rep.links;
  if (links.size() < 2) return;
  auto sysctl = [&](const std::string& dev, const char* key) {
    auto v = r.root.read_line(fmt::format("/proc/sys/net/ipv4/conf/{}/{}", dev, key));
    auto all = r.root.read_line(fmt::format("/proc/sys/net/ipv4/conf/all/{}", key));
    int64_t a = v ? parse_i64(*v).value_or(0) : 0, b = all ? parse_i64(*all).value_or(0) : 0;
    return std::max(a, b);
  };
  bool any = false;
  for (size_t j = 1; j < links.size(); ++j) {
    for (size_t i = 0; i < j; ++i) {
      const auto &a = links[i], &b = links[j];
      if (a.ipv4.empty() || b.ipv4.empty() || a.netdev == b.netdev) continue;
      int pa = prefix_of(facts, a.netdev, a.ipv4), pb = prefix_of(facts, b.netdev, b.ipv4);
      int p = std::min(pa, pb);
      if (!ipv4_same_subnet(a.ipv4, b.ipv4, p)) continue;
      any = true;
      // The subnet of its own for twin j: the next block of twin 0's size that no address of
      // this node is in, with twin 0's host number.
      auto base = parse_ipv4(links[0].ipv4);
      std::string to;
      if (base && pa > 0 && pa < 31) {
        uint32_t block = uint32_t{1} << (32 - pa), mask = ~(block - 1);
        for (uint32_t k = static_cast<uint32_t>(j); k < 256 && to.empty(); ++k) {
          uint32_t v = ((*base & mask) + k * block) | (*base & ~mask);
          std::string cand = format_ipv4(v);
          bool clash = false;
          for (const auto& x : facts.addrs)
            if (x.family == "inet" &&
                ipv4_same_subnet(x.address, cand, std::min(pa, std::max(1, x.prefix))))
              clash = true;
          if (!clash) to = cand;
        }
      }
      bool safe = true;
      std::vector<std::string> have;
      for (const auto* d : {&a.netdev, &b.netdev}) {
        int64_t ig = sysctl(*d, "arp_ignore"), an = sysctl(*d, "arp_announce");
        have.push_back(fmt::format("{}: arp_ignore={} arp_announce={}", *d, ig, an));
        safe = safe && ig >= 1 && an >= 2;
      }
      std::string fix = fmt::format(
          "one subnet per twin, as the example cluster file two-sparks.env has them "
          "(10.10.2.0/24 on the first, 10.10.3.0/24 on the second): on {}: {} (and in its "
          "netplan file); the same on every node, each keeping its host number",
          r.node.name,
          to.empty() ? fmt::format("move {} to a subnet of its own", b.ipv4)
                     : ip_addr_move(b.ipv4, pb, b.netdev, to, pa, b.netdev));
      if (safe)
        r.add("net.subnet", b.netdev, Verdict::warn,
              fmt::format("{} ({}) and {} ({}) are in one subnet (/{}); the sysctls that keep "
                          "ARP on the right port are set ({}), but both routes lead to one "
                          "subnet and the kernel sends through the first",
                          a.netdev, a.ipv4, b.netdev, b.ipv4, p, join(have, "; ")),
              fix);
      else
        r.add("net.subnet", b.netdev, Verdict::fail,
              fmt::format("{} ({}) and {} ({}) are in one subnet (/{}): two routes, and ARP "
                          "answers for either address from the wrong port ({}; safe needs "
                          "arp_ignore=1 and arp_announce=2 on both)",
                          a.netdev, a.ipv4, b.netdev, b.ipv4, p, join(have, "; ")),
              fix);
    }
  }
  if (!any) {
    std::vector<std::string> nets;
    for (const auto& l : links)
      if (!l.ipv4.empty())
        nets.push_back(
            fmt::format("{} {}/{}", l.netdev, l.ipv4, prefix_of(facts, l.netdev, l.ipv4)));
    r.add("net.subnet", "", Verdict::pass, "each twin in a subnet of its own: " + join(nets, ", "));
  }
}

// Who holds the page cache, and what each fix frees: the model's files (`sparkctl evict`,
// no root), the other files' clean cache (drop_caches, root), shared memory (neither); and
// memory reserved as huge pages, which only vm.nr_hugepages gives back.
struct CacheSplit {
  uint64_t model = 0;  // the model's files, resident (mincore)
  uint64_t other = 0;  // other files' cache that drop_caches can free
  uint64_t shmem = 0;  // tmpfs and shared memory: counted in Cached, freed by neither
  uint64_t dirty = 0;
  uint64_t huge = 0;       // reserved by the hugetlb pool (HugePages_Total x Hugepagesize)
  uint64_t huge_free = 0;  // of it, pages no process has mapped (HugePages_Free)
  uint64_t huge_pages = 0, huge_size = 0;
};

CacheSplit split_cache(const MemInfo& m, const NodeFacts& facts) {
  CacheSplit c;
  uint64_t cached = m.get("Cached") + m.get("Buffers");
  c.shmem = std::min(m.get("Shmem"), cached);
  c.model = std::min(facts.residency ? facts.residency->resident_bytes : 0, cached - c.shmem);
  c.other = cached - c.shmem - c.model;
  c.dirty = m.get("Dirty");
  c.huge_pages = m.get("HugePages_Total");
  c.huge_size = m.get("Hugepagesize");
  c.huge = std::max(m.get("Hugetlb"), c.huge_pages * c.huge_size);
  c.huge_free = std::min(c.huge, m.get("HugePages_Free") * c.huge_size);
  return c;
}

// Huge pages worth naming: a reservation of 1 GiB or more.
bool huge_reserved(const CacheSplit& c) {
  return c.huge >= kGiB;
}

std::string huge_desc(const CacheSplit& c) {
  return fmt::format("{} reserved as huge pages (HugePages_Total {} x {}, {} of it unused)",
                     format_size(c.huge), c.huge_pages, format_size(c.huge_size),
                     format_size(c.huge_free));
}

std::string huge_fix(const CacheSplit& c) {
  return fmt::format(
      "release the {} of huge pages no process uses: `sudo sysctl -w vm.nr_hugepages=0` (and "
      "remove vm.nr_hugepages from /etc/sysctl.conf, /etc/sysctl.d/ and the kernel command "
      "line's hugepages=, so a reboot does not reserve them again)",
      format_size(c.huge_free));
}

// The fix that clears `shortfall`: each step in the order it should be taken, until the
// memory it frees covers the shortfall, and what is left when even all of them do not.
std::string mem_fix(uint64_t shortfall, const CacheSplit& c, bool uma) {
  std::vector<std::string> steps;
  uint64_t freed = 0;
  if (c.huge_free >= kGiB && freed < shortfall) {
    steps.push_back(huge_fix(c));
    freed += c.huge_free;
  }
  if (c.model >= kGiB / 4 && freed < shortfall) {
    steps.push_back(fmt::format(
        "run `sparkctl evict` ({} of page cache is the model's files; no "
        "root needed{})",
        format_size(c.model), uma ? "; on unified memory it counts against the GPU" : ""));
    freed += c.model;
  }
  if (c.other >= kGiB / 4 && freed < shortfall) {
    steps.push_back(fmt::format(
        "{} the page cache of other files ({}) as root: `sudo sh -c 'sync; echo 1 > "
        "/proc/sys/vm/drop_caches'` (needs root; `sync` first writes back the {} dirty)",
        steps.empty() ? "drop" : "then drop", format_size(c.other), format_size(c.dirty)));
    freed += c.other;
  }
  if (freed < shortfall) {
    uint64_t huge_used = c.huge - c.huge_free;
    std::string left = fmt::format(
        "{} more is held by processes{}{}", format_size(shortfall - freed),
        huge_used >= kGiB
            ? fmt::format(" (of them {} in huge pages a process has mapped: `grep -l huge "
                          "/proc/*/numa_maps`)",
                          format_size(huge_used))
            : "",
        c.shmem >= kGiB ? fmt::format(" or shared memory ({} in tmpfs "
                                      "or /dev/shm, which drop_caches "
                                      "cannot free)",
                                      format_size(c.shmem))
                        : "");
    steps.push_back(fmt::format("{}: stop what uses it (`ps aux --sort=-rss | head`){}", left,
                                c.shmem >= kGiB ? " or remove files from /dev/shm" : ""));
  }
  return join(steps, "; ");
}

// `need`: what the plan puts on this node's GPUs (nullopt: no plan).
void check_mem_now(NodeRun& r, const NodeFacts& facts, const Result<MemInfo>& mi, bool uma,
                   std::optional<uint64_t> need) {
  const auto& cfg = r.cfg;
  if (!mi) {
    r.add("mem", "", Verdict::fail, mi.error().message,
          r.root.live() ? "is /proc mounted?"
                        : "the capture has no readable proc/meminfo: recapture the node with "
                          "`sparkctl capture-node`");
    return;
  }
  uint64_t avail = mi->get("MemAvailable"), free = mi->get("MemFree");
  CacheSplit c = split_cache(*mi, facts);
  std::string desc = fmt::format(
      "MemAvailable {}, MemFree {}, page cache {} ({} the model's files, {} other files{}), "
      "Dirty {}",
      format_size(avail), format_size(free), format_size(c.model + c.other + c.shmem),
      format_size(c.model), format_size(c.other),
      c.shmem ? fmt::format(", {} shared memory", format_size(c.shmem)) : "", format_size(c.dirty));
  if (huge_reserved(c)) desc += "; " + huge_desc(c);
  uint64_t free_min = cfg.get_size("MEM_FREE_MIN"), avail_min = cfg.get_size("MEM_AVAILABLE_MIN");
  std::vector<std::string> low;
  uint64_t shortfall = 0;
  if (avail < avail_min) {
    low.push_back(fmt::format("MemAvailable {} < MEM_AVAILABLE_MIN {}", format_size(avail),
                              format_size(avail_min)));
    shortfall = avail_min - avail;
  }
  if (free < free_min) {
    low.push_back(
        fmt::format("MemFree {} < MEM_FREE_MIN {}", format_size(free), format_size(free_min)));
    shortfall = std::max(shortfall, free_min - free);
  }
  // On unified memory the GPU allocates from MemFree: the page cache is not the GPU's until
  // the kernel reclaims it, and engines that size their pools from free memory see MemFree.
  std::string uma_note =
      uma ? fmt::format("; on unified memory the GPU sees MemFree {} (not MemAvailable {})",
                        format_size(free), format_size(avail))
          : "";
  uint64_t reclaimable = c.model + c.other;
  if (!low.empty()) {
    r.add("mem", "", Verdict::fail,
          fmt::format("{}; short by {}; {}{}", join(low, "; "), format_size(shortfall), desc,
                      uma_note),
          mem_fix(shortfall, c, uma));
  } else if (uma && need && c.dirty > kGiB && free < *need) {
    // Loading must then take the memory from the page cache while gigabytes of it wait for
    // writeback: on unified memory the node stalls (and the watchdog may take it) at load.
    // `sync` alone turns dirty pages into clean cache, which is still not free.
    r.add("mem", "", Verdict::fail,
          fmt::format("{} not yet written back, and MemFree {} < the {} the plan puts on this "
                      "node: loading would reclaim page cache under writeback and freeze the "
                      "node; {}{}",
                      format_size(c.dirty), format_size(free), format_size(*need), desc, uma_note),
          "run `sync`, then " + mem_fix(*need - free, c, uma));
  } else if (c.dirty > kGiB) {
    r.add("mem", "", Verdict::warn,
          fmt::format("{} not yet written back; {}", format_size(c.dirty), desc),
          "run `sync` before starting");
  } else if (uma && reclaimable > kUmaCacheWarn) {
    r.add("mem", "", Verdict::warn,
          fmt::format("{} of page cache holds memory the GPU cannot use until it is reclaimed; "
                      "{}{}",
                      format_size(reclaimable), desc, uma_note),
          mem_fix(reclaimable, c, uma));
  } else {
    r.add("mem", "", Verdict::pass, desc + (uma ? " (unified memory)" : ""));
  }
}

void check_mem(NodeRun& r, const NodeFacts& facts, const Result<MemInfo>& mi, const ModelFiles& mf,
               bool gb10, bool uma, const std::optional<GpuReport>& gpu) {
  const auto& cfg = r.cfg;
  // The plan first: on unified memory `mem` holds MemFree to what it puts on this node.
  std::optional<CheckResult> plan_row;
  std::optional<uint64_t> need;
  std::optional<plan::WeightEstimate> estimate;  // no weight files: config.json's shapes
  auto plan_add = [&](Verdict v, std::string msg, std::string fix = {}) {
    plan_row = CheckResult{r.node.name, "mem.plan", "", v, std::move(msg), std::move(fix)};
  };
  if (!mf.config_ok) {
    plan_add(Verdict::skip, fmt::format("no model config.json ({}): see model.files", mf.dir));
  } else if (auto input = plan_input(mf, &cfg, "", &estimate); !input) {
    plan_add(Verdict::fail, input.error().message,
             "check the model's config.json and the plan keys (KV_LAYOUT, CONTEXT_SPLIT, "
             "MEM_WORKSPACE, MEM_MTP, MEM_VISION)");
  } else if (mi) {
    plan::PlanInput in = std::move(*input);
    in.gpus_per_node = static_cast<int>(r.node.gpus.size());
    // Unified memory (GB10): what the kernel can give; a discrete GPU: its own memory.
    uint64_t cap = mi->get("MemAvailable") / std::max<uint64_t>(1, r.node.gpus.size());
    if (!gb10 && gpu && gpu->has_gpu()) {
      uint64_t smallest = 0;
      for (int o : r.node.gpus)
        for (const auto& d : gpu->devices)
          if (d.index == o && (smallest == 0 || d.total_memory < smallest))
            smallest = d.total_memory;
      if (smallest) cap = smallest;
    }
    in.capacity_per_rank = cap;
    int nodes = static_cast<int>(cfg.nodes.size());
    // Every node is assumed to have as many GPUs as this one for the per-rank share.
    plan::PlanRow row = plan::plan_row(in, nodes);
    need = row.need_per_rank * std::max<uint64_t>(1, r.node.gpus.size());
    std::string fixed =
        row.fixed_per_rank ? fmt::format(" + fixed {}", format_size(row.fixed_per_rank)) : "";
    std::string desc = fmt::format(
        "per rank ({} KV): weights {} + KV {} ({} tokens x {} slots{}){} + reserve {} = {}; "
        "this node has {}",
        plan::kv_layout_name(in.record.layout), format_size(row.weights_per_rank),
        format_size(row.kv_per_rank), in.context, in.slots,
        row.state_per_rank ? fmt::format(", {} of it fixed state", format_size(row.state_per_rank))
                           : "",
        fixed, format_size(row.reserve), format_size(row.need_per_rank),
        format_size(row.capacity_per_rank));
    CacheSplit c = split_cache(*mi, facts);
    std::string huge = huge_reserved(c) && c.huge_free >= kGiB
                           ? fmt::format("; {} of this node's memory is reserved as huge pages: {}",
                                         format_size(c.huge), huge_fix(c))
                           : "";
    const bool estimated = estimate && !row.weights_from_engine;
    if (estimated)
      desc += fmt::format(" (weights ESTIMATED from config.json: {})", estimate->basis);
    if (row.fits && estimated)
      plan_add(
          Verdict::warn,
          fmt::format("{}; up to {} tokens would fit if the estimate holds", desc, row.max_context),
          fmt::format("stage the weights (`sparkctl stage-weights --to {}`) and rerun: "
                      "only counted weights can be said to fit",
                      r.node.name));
    else if (row.fits)
      plan_add(Verdict::pass, fmt::format("{}; up to {} tokens fit", desc, row.max_context));
    else
      plan_add(Verdict::fail, desc,
               row.max_context > 0
                   ? fmt::format("set CONTEXT_LEN={} (the largest that fits) or fewer SLOTS, or "
                                 "free memory{}",
                                 row.max_context, huge)
                   : "the weights share alone does not fit: add nodes or free memory (`sparkctl "
                     "evict`)" +
                         huge);
  }
  if (r.filter.enabled("mem")) check_mem_now(r, facts, mi, uma, need);
  if (r.filter.enabled("mem.plan") && plan_row) r.rep.checks.push_back(*plan_row);
}

void check_sys(NodeRun& r, const NodeFacts& facts, const Result<MemInfo>& mi) {
  if (!r.filter.enabled("sys")) return;
  bool rdma = !r.node.hcas.empty();
  if (facts.memlock_soft == kUnlimited) {
    r.add("sys", "memlock", Verdict::pass, "ulimit -l unlimited");
  } else {
    r.add("sys", "memlock", rdma ? Verdict::fail : Verdict::warn,
          fmt::format("ulimit -l is {} KiB for {}, not unlimited: large RDMA registrations fail",
                      facts.memlock_soft / 1024,
                      facts.user.empty() ? "the serving user" : facts.user),
          "set `* - memlock unlimited` in /etc/security/limits.d/ (LimitMEMLOCK=infinity for "
          "systemd units; --ulimit memlock=-1 for containers)");
  }
  uint64_t swap = mi ? mi->get("SwapTotal") : 0;
  r.add("sys", "swap", Verdict::pass,
        swap ? fmt::format("swap {} (SwapFree {})", format_size(swap),
                           format_size(mi->get("SwapFree")))
             : "no swap");
  auto thp = r.root.read_line("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string mode = "unknown";
  if (thp) {
    auto lb = thp->find('['), rb = thp->find(']');
    if (lb != std::string::npos && rb != std::string::npos && rb > lb)
      mode = thp->substr(lb + 1, rb - lb - 1);
  }
  r.add("sys", "thp", Verdict::pass, "transparent huge pages: " + mode);
}

void check_known_bad(NodeRun& r, const NodeFacts& facts, const std::optional<GpuReport>& gpu,
                     const std::vector<std::optional<Hca>>& hcas) {
  if (!r.filter.enabled("sw.known_bad")) return;
  auto list = load_known_bad(r.cfg.get("KNOWN_BAD_FILE"));
  if (!list) {
    r.add("sw.known_bad", "", Verdict::fail, list.error().message,
          "fix or unset KNOWN_BAD_FILE (the format is in sparkctl-preflight(1))");
    return;
  }
  SoftwareVersions sw;
  sw.kernel = facts.kernel_release;
  sw.cmdline = r.root.read_line("/proc/cmdline").value_or("");
  sw.driver = gpu ? gpu->kernel_module_version : "";
  sw.nccl = nccl_version_text(facts.nccl.version);
  sw.rdma = !r.node.hcas.empty();
  for (const auto& h : hcas)
    if (h) sw.firmware.emplace_back(h->name, h->fw_ver);
  for (auto& c : known_bad_checks(*list, sw, r.node.name)) r.rep.checks.push_back(std::move(c));
}

void check_reads(NodeRun& r) {
  if (!r.filter.enabled("sys.read")) return;
  auto problems = r.root.problems();
  if (problems.empty()) {
    r.add("sys.read", "", Verdict::pass,
          "every file probed was a regular file, under the size cap and answered in time");
    return;
  }
  for (const auto& p : problems)
    r.add("sys.read", p.path, Verdict::fail, fmt::format("{}: {}", r.root.path(p.path), p.what),
          r.root.live() ? "find what replaced the file (`ls -l`, `stat`); a wedged sysfs "
                          "attribute points at its driver (`dmesg`)"
                        : "recapture the node with `sparkctl capture-node` (a capture holds "
                          "only regular files and directories)");
}

void check_disk(NodeRun& r, const NodeFacts& facts, const ModelFiles& mf) {
  if (!r.filter.enabled("disk")) return;
  if (!facts.model_fs || !facts.model_fs->error.empty() || facts.model_fs->total == 0) {
    r.add("disk", "", Verdict::skip,
          facts.model_fs
              ? fmt::format("statvfs {}: {}", facts.model_fs->path, facts.model_fs->error)
              : "no model path configured (MODEL_PATH)");
    return;
  }
  const auto& fs = *facts.model_fs;
  uint64_t used = fs.total - fs.free;
  uint64_t usable = used + fs.avail;
  uint64_t missing = 0;
  for (const auto& f : mf.files) {
    uint64_t want = f.expected.value_or(0);
    uint64_t have = f.size.value_or(0);
    if (want > have) missing += want - have;
  }
  if (!mf.has_manifest && mf.weight_bytes) {
    uint64_t have = 0;
    for (const auto& f : mf.files) have += f.size.value_or(0);
    if (mf.weight_bytes > have) missing = std::max(missing, mf.weight_bytes - have);
  }
  auto pct = [&](uint64_t u) {
    return usable ? static_cast<int>((u * 100 + usable - 1) / usable) : 100;
  };
  int now = pct(used), after = pct(used + missing);
  int64_t max = r.cfg.get_int("DISK_MAX_USE");
  std::string desc = fmt::format(
      "{}: {}% used ({} of {}, {} free){}", fs.path, now, format_size(used), format_size(usable),
      format_size(fs.avail),
      missing ? fmt::format("; {}% after staging {} more", after, format_size(missing)) : "");
  if (missing > fs.avail)
    r.add("disk", fs.path, Verdict::fail, desc + ": the model does not fit",
          "free space or put MODEL_PATH on a larger filesystem");
  else if (after > max)
    r.add("disk", fs.path, Verdict::fail, fmt::format("{}: over DISK_MAX_USE {}%", desc, max),
          "free space (kubelet starts deleting images at 85%), or put MODEL_PATH on a larger "
          "filesystem");
  else
    r.add("disk", fs.path, Verdict::pass, desc);
}

std::string first_words(const std::string& cmdline) {
  return cmdline.size() > 120 ? cmdline.substr(0, 117) + "..." : cmdline;
}

void check_ports(NodeRun& r, const NodeFacts& facts) {
  if (!r.filter.enabled("port.free")) return;
  if (r.node.index != 0) {
    r.add("port.free", "", Verdict::skip, "only rank 0's node binds the API and rendezvous ports");
    return;
  }
  for (const auto& p : facts.ports) {
    std::string what = fmt::format("{}:{}", p.address, p.port);
    std::string name = std::to_string(p.port) == r.cfg.get("API_PORT") ? "API_PORT" : "RDZV_PORT";
    if (p.free)
      r.add("port.free", what, Verdict::pass, fmt::format("{} {} can be bound", name, what));
    else if (!p.holder_ring.empty() && p.holder_ring == r.cfg.get("RING_NAME"))
      // The ring runs: its own sparkd listens there, which is what start will do again.
      r.add("port.free", what, Verdict::pass,
            fmt::format("{} {} is held by this ring's own sparkd (pid {}): the ring runs; "
                        "`sparkctl stop` frees it",
                        name, what, p.holder_pid));
    else
      r.add(
          "port.free", what, Verdict::fail,
          fmt::format("{} {} cannot be bound: {}{}", name, what, p.error,
                      p.holder_pid ? fmt::format(" (held by pid {}: {})", p.holder_pid,
                                                 first_words(p.holder_cmdline))
                                   : std::string()),
          p.error.find("in use") != std::string::npos
              ? fmt::format("stop what holds it (`ss -ltnp 'sport = :{}'`) or set {}", p.port, name)
              : fmt::format("the address must be on this node; check {}",
                            name == "API_PORT" ? "API_BIND" : r.key("FABRIC_IP")));
  }
}

// A library the dynamic loader could not find for sparkd, and where it comes from on
// Debian/Ubuntu (DGX OS is Ubuntu with NVIDIA's repositories). "" when the error is another.
std::string missing_library_fix(const std::string& error, std::string* lib) {
  static const std::string marker = "error while loading shared libraries: ";
  auto at = error.find(marker);
  if (at == std::string::npos) return "";
  auto start = at + marker.size();
  auto end = error.find(':', start);
  *lib = std::string(trim(error.substr(start, end == std::string::npos ? end : end - start)));
  struct Pkg {
    const char* prefix;
    const char* where;
  };
  static const Pkg known[] = {
      {"libnccl.so",
       "libnccl2 (`sudo apt install libnccl2`; on DGX OS it comes from NVIDIA's "
       "CUDA repository, which DGX OS has configured; elsewhere add "
       "https://developer.download.nvidia.com/compute/cuda/repos/ first)"},
      {"libibverbs.so", "libibverbs1 (`sudo apt install libibverbs1 ibverbs-providers`)"},
      {"librdmacm.so", "librdmacm1 (`sudo apt install librdmacm1`)"},
      {"libmlx5.so", "ibverbs-providers (`sudo apt install ibverbs-providers`)"},
      {"libnuma.so", "libnuma1 (`sudo apt install libnuma1`)"},
      {"libgomp.so", "libgomp1 (`sudo apt install libgomp1`)"},
      {"libstdc++.so",
       "libstdc++6 (`sudo apt install libstdc++6`; a newer one than the "
       "release has needs the sparkctl package built for this release)"},
      {"libgcc_s.so", "libgcc-s1 (`sudo apt install libgcc-s1`)"},
      {"libssl.so", "libssl3 (`sudo apt install libssl3`)"},
      {"libcrypto.so", "libssl3 (`sudo apt install libssl3`)"},
      {"libz.so", "zlib1g (`sudo apt install zlib1g`)"},
      {"libcuda.so",
       "the NVIDIA driver (`sudo apt install nvidia-driver-580` or the DGX OS "
       "driver package; libcuda.so.1 comes with the driver, not the toolkit)"},
      {"libcudart.so",
       "cuda-cudart (`sudo apt install cuda-cudart-13-0` from NVIDIA's CUDA "
       "repository)"},
      {"libcublas",
       "libcublas (`sudo apt install libcublas-13-0` from NVIDIA's CUDA "
       "repository)"},
  };
  for (const auto& k : known)
    if (starts_with(*lib, k.prefix))
      return fmt::format(
          "sparkd needs {}: install the package that provides it, {}; then rerun "
          "preflight",
          *lib, k.where);
  return fmt::format(
      "sparkd needs {}: find the package that provides it with `apt-file search "
      "{}` (`sudo apt install apt-file && sudo apt-file update` first) and "
      "install it",
      *lib, *lib);
}

// The sparkd this node will run: found, starts, and is this sparkctl's version (sw.parity
// then holds every node's to the head's).
void check_sparkd(NodeRun& r, const NodeFacts& facts) {
  if (!r.filter.enabled("sw.sparkd")) return;
  // A tree captured before sparkd was recorded says nothing about it.
  if (!r.root.live() && facts.sparkd_bin.empty() && facts.sparkd_tried.empty()) return;
  const std::string want = std::string("sparkd ") + kVersion;
  const std::string fix = fmt::format(
      "install sparkctl {} on {} (the .deb, or `cmake --install` to the head's prefix), or "
      "set SPARKD_BIN to the sparkd to run",
      kVersion, r.node.name);
  if (facts.sparkd_bin.empty())
    r.add("sw.sparkd", "", Verdict::fail,
          "no sparkd found" + (facts.sparkd_tried.empty()
                                   ? std::string()
                                   : " (looked at " + facts.sparkd_tried + ")"),
          fix);
  else if (std::string lib, lib_fix = missing_library_fix(facts.sparkd_error, &lib);
           !lib_fix.empty())
    r.add("sw.sparkd", facts.sparkd_bin, Verdict::fail,
          fmt::format("{} cannot be started: the library {} is missing ({})", facts.sparkd_bin, lib,
                      facts.sparkd_error),
          lib_fix);
  else if (!facts.sparkd_error.empty())
    r.add("sw.sparkd", facts.sparkd_bin, Verdict::fail,
          fmt::format("{} cannot be started: {}", facts.sparkd_bin, facts.sparkd_error), fix);
  else if (facts.sparkd_version != want)
    r.add("sw.sparkd", facts.sparkd_bin, Verdict::fail,
          fmt::format("{} is '{}', this sparkctl is {}", facts.sparkd_bin, facts.sparkd_version,
                      kVersion),
          fix);
  else
    r.add("sw.sparkd", facts.sparkd_bin, Verdict::pass,
          fmt::format("{} starts: {}", facts.sparkd_bin, facts.sparkd_version));
}

void check_model(NodeRun& r, const ModelFiles& mf) {
  if (!r.filter.enabled("model.files")) return;
  if (mf.dir.empty()) {
    r.add("model.files", "", Verdict::skip, "no MODEL_PATH configured");
    return;
  }
  // stage-weights copies the head's model directory to the other nodes: the head's own copy
  // (and a one-node ring's) comes from the checkpoint's source.
  const bool head = r.cfg.nodes.empty() || r.cfg.nodes.front().name == r.node.name;
  std::string fix =
      head ? fmt::format(
                 "put the checkpoint there: download it (`hf download ORG/NAME "
                 "--local-dir {}`) or copy it, or set {} to where it is; "
                 "stage-weights then copies it from this node to the others",
                 mf.dir,
                 r.node.model_path == r.cfg.get("MODEL_PATH") ? "MODEL_PATH" : r.key("MODEL_PATH"))
           : fmt::format("run `sparkctl stage-weights --to {}`", r.node.name);
  if (!mf.dir_exists) {
    r.add("model.files", mf.dir, Verdict::fail, fmt::format("{} does not exist", mf.dir), fix);
    return;
  }
  std::vector<std::string> problems;
  if (!mf.config_error.empty()) problems.push_back(mf.config_error);
  if (!mf.index_error.empty()) problems.push_back(mf.index_error);
  if (!mf.manifest_error.empty()) problems.push_back(mf.manifest_error);
  int missing = 0, wrong = 0, shards = 0;
  uint64_t total = 0;
  for (const auto& f : mf.files) {
    if (ends_with(f.name, ".safetensors")) ++shards;
    total += f.size.value_or(0);
    if (!f.size) {
      if (f.name == "config.json" && !mf.config_error.empty()) continue;  // said above
      if (++missing <= 3) problems.push_back(fmt::format("{} is missing", f.name));
    } else if (f.expected && *f.expected != *f.size) {
      if (++wrong <= 3)
        problems.push_back(
            fmt::format("{} is {} bytes, the manifest says {}", f.name, *f.size, *f.expected));
    }
  }
  if (missing > 3) problems.push_back(fmt::format("{} more missing", missing - 3));
  if (wrong > 3) problems.push_back(fmt::format("{} more of the wrong size", wrong - 3));
  if (!problems.empty())
    r.add("model.files", mf.dir, Verdict::fail, fmt::format("{}: {}", mf.dir, join(problems, "; ")),
          fix);
  else
    r.add(
        "model.files", mf.dir, Verdict::pass,
        fmt::format("config.json, {} and {} shard(s), {}{}",
                    mf.index_name.empty() ? "no index" : mf.index_name, shards, format_size(total),
                    mf.has_manifest ? ", sizes match the manifest" : " (no manifest)"));
}

// Whether the configured engine can serve the model (env/engine_fit.h): the native engine's
// own config reader and shard plan, the shards' tensor types, the tokenizer on rank 0's node.
void check_engine(NodeRun& r, const ModelFiles& mf) {
  if (!r.filter.enabled("model.engine")) return;
  if (mf.dir.empty()) {
    r.add("model.engine", "", Verdict::skip, "no MODEL_PATH configured");
    return;
  }
  EngineFitOptions o;
  o.world = r.cfg.world_size();
  o.needs_tokenizer = r.cfg.nodes.empty() || r.cfg.nodes.front().name == r.node.name;
  auto f = engine_fit(mf, &r.cfg, o);
  if (!f.checked) {
    r.add("model.engine", mf.dir, Verdict::skip, f.summary);
  } else if (!f.ok()) {
    r.add("model.engine", mf.dir, Verdict::fail,
          fmt::format("ENGINE={} cannot serve {}: {}", f.engine, mf.dir, join(f.problems, "; ")),
          join(f.fixes, "; "));
  } else if (!f.warnings.empty()) {
    r.add("model.engine", mf.dir, Verdict::warn,
          fmt::format("{}; {}", f.summary, join(f.warnings, "; ")), join(f.fixes, "; "));
  } else {
    r.add("model.engine", mf.dir, Verdict::pass, f.summary);
  }
}

void check_gpu(NodeRun& r, const std::optional<GpuReport>& gpu, const std::string& gpu_error) {
  if (!r.filter.enabled("gpu")) return;
  if (!gpu) {
    r.add(
        "gpu", "", Verdict::skip,
        gpu_error.empty() ? "no GPU facts in this capture" : "GPU facts unreadable: " + gpu_error);
    return;
  }
  if (!gpu->has_gpu()) {
    r.add("gpu", "", Verdict::warn,
          fmt::format("no GPU: {}", gpu->driver_reason.empty() ? "the driver lists no device"
                                                               : gpu->driver_reason),
          "install the NVIDIA driver (or this node runs the CPU path only)");
    return;
  }
  std::string driver = fmt::format(
      "driver {} (CUDA {})", gpu->kernel_module_version.empty() ? "?" : gpu->kernel_module_version,
      cuda_version_text(gpu->driver_api_version));
  for (int ordinal : r.node.gpus) {
    const GpuDevice* d = nullptr;
    for (const auto& x : gpu->devices)
      if (x.index == ordinal) d = &x;
    std::string subject = fmt::format("gpu{}", ordinal);
    if (!d) {
      r.add("gpu", subject, Verdict::fail,
            fmt::format("GPU {} does not exist ({} device(s))", ordinal, gpu->devices.size()),
            fmt::format("fix {}", r.key("GPUS")));
      continue;
    }
    std::string desc = fmt::format("{}: sm_{}{}, {}, {} KiB shared memory per block (opt-in), {}",
                                   d->name, d->cc_major, d->cc_minor, format_size(d->total_memory),
                                   d->max_smem_per_block_optin / 1024, driver);
    auto covered = cuda_archs_cover(kCudaArchitectures, d->cc_major, d->cc_minor);
    if (d->cc_major > 0 && d->cc_major < 8)
      r.add("gpu", subject, Verdict::fail,
            fmt::format("{}; sm_{}{} is older than sm_80, the oldest GPU sparkctl's CUDA "
                        "kernels run on (this build has kernels for {})",
                        desc, d->cc_major, d->cc_minor,
                        *kCudaArchitectures ? kCudaArchitectures : "none"),
            fmt::format("set DEVICE=cpu to run the ring on the CPU, or take {} out of the ring",
                        r.node.name));
    else if (covered && !*covered)
      r.add("gpu", subject, Verdict::fail,
            fmt::format("{}; this build has CUDA kernels for {} only (CMAKE_CUDA_ARCHITECTURES), "
                        "none that sm_{}{} runs: the engine would stop at its first kernel",
                        desc, kCudaArchitectures, d->cc_major, d->cc_minor),
            fmt::format("install a sparkctl built for this GPU as well (configure with "
                        "-DCMAKE_CUDA_ARCHITECTURES=\"{};{}{}\") on every node, set "
                        "DEVICE=cpu, or take {} out of the ring",
                        kCudaArchitectures, d->cc_major, d->cc_minor, r.node.name));
    else if (!d->errors.empty())
      r.add("gpu", subject, Verdict::warn, fmt::format("{}; {}", desc, join(d->errors, "; ")));
    else
      r.add("gpu", subject, Verdict::pass, desc);
  }
  if (!gpu->holders.empty()) {
    std::vector<std::string> who;
    for (const auto& h : gpu->holders) who.push_back(fmt::format("pid {} ({})", h.pid, h.comm));
    r.add("gpu", "holders", Verdict::fail, fmt::format("the GPU is held by {}", join(who, ", ")),
          "stop them (`sparkctl stop`, or kill the listed pids) before starting the ring");
  }
}

}  // namespace

NodeReport run_node_checks(const RingConfig& cfg, int node_index, const Sysroot& root,
                           const CheckFilter& filter, bool verbose) {
  NodeReport rep;
  const NodeConfig& node = cfg.nodes.at(static_cast<size_t>(node_index));
  rep.node = node.name;
  rep.index = node.index;
  NodeRun r{cfg, node, root, filter, rep};

  FactsRequest req;
  req.model_path = node.model_path;
  req.sparkd_bin = cfg.get("SPARKD_BIN");
  if (root.live()) {
    // The sparkd that start will run here, found as the launch finds it (SPARKD_BIN, else
    // this sparkctl's install, the standard prefixes, PATH).
    std::error_code ec;
    auto self = std::filesystem::canonical("/proc/self/exe", ec);
    req.sparkd_bin = spark::node_sparkd(req.sparkd_bin, !req.sparkd_bin.empty(),
                                        ec ? std::string() : self.string(), &req.sparkd_tried);
  }
  if (node.index == 0) {
    req.ports.emplace_back(cfg.get("API_BIND"), static_cast<int>(cfg.get_int("API_PORT")));
    req.ports.emplace_back(node.fabric_ip, static_cast<int>(cfg.get_int("RDZV_PORT")));
  }
  req.gpu_load = filter.enabled("gpu.throttle");
  req.gpus = node.gpus;
  auto facts_r = node_facts(root, req);
  if (!facts_r) {
    r.add("sys", "facts", Verdict::fail, facts_r.error().message,
          "capture the node with `sparkctl capture-node`");
    check_reads(r);
    return rep;
  }
  const NodeFacts& facts = *facts_r;
  rep.hostname = facts.hostname;
  rep.clock_ms = facts.clock_ms;
  std::optional<GpuReport> gpu;
  std::string gpu_error;
  if (facts.gpu.is_object()) {
    auto g = gpu_report_from_json(facts.gpu);
    if (g)
      gpu = *g;
    else
      gpu_error = g.error().message;
  }
  if (gpu && !gpu->devices.empty()) rep.gpu_name = gpu->devices[0].name;
  bool gb10 = rep.gpu_name.find("GB10") != std::string::npos || is_gb10(root);

  size_t nlinks = std::max(node.hcas.size(), node.netdevs.size());
  rep.links.resize(nlinks);
  for (size_t i = 0; i < nlinks; ++i) {
    if (i < node.hcas.size()) rep.links[i].hca = node.hcas[i];
    if (i < node.netdevs.size()) {
      rep.links[i].netdev = node.netdevs[i];
      rep.links[i].ipv4 =
          twin_address(cfg, node, facts, node.netdevs[i], i ? rep.links[0].ipv4 : std::string());
    }
  }
  for (const auto& a : facts.addrs)
    if (a.family == "inet" && !starts_with(a.address, "127."))
      rep.addrs.push_back({a.ifname, a.address, a.prefix});
  if (gpu && !gpu->devices.empty())
    rep.gpu_cc = fmt::format("{}.{}", gpu->devices[0].cc_major, gpu->devices[0].cc_minor);

  std::vector<std::optional<Hca>> hcas;
  check_rdma(r, facts, hcas);
  check_gid(r, facts, hcas);
  check_idle_twins(r, facts, hcas);
  check_links(r, facts, gb10);
  check_subnets(r, facts);
  auto mi_text = root.read("/proc/meminfo");
  Result<MemInfo> mi = mi_text ? parse_meminfo(*mi_text)
                               : Result<MemInfo>(make_error(Errc::io, "cannot read /proc/meminfo"));
  auto mf = node.model_path.empty() ? ModelFiles{} : read_model_files(root, node.model_path);
  bool uma = gb10;
  if (gpu)
    for (const auto& d : gpu->devices) uma = uma || d.integrated;
  check_mem(r, facts, mi, mf, gb10, uma, gpu);
  check_sys(r, facts, mi);
  check_disk(r, facts, mf);
  check_gpu(r, gpu, gpu_error);
  if (filter.enabled("gpu.throttle"))
    for (auto& row : throttle_checks(node.name, facts.gpu_throttle))
      r.add("gpu.throttle", row.subject, row.verdict, row.message, row.fix);
  check_ports(r, facts);
  check_sparkd(r, facts);
  check_model(r, mf);
  check_engine(r, mf);
  check_known_bad(r, facts, gpu, hcas);
  apply_wrong_pin(r, facts, hcas);
  check_reads(r);  // last: every probe above has read what it reads

  // Report order is the catalog's, whatever order the probes ran in.
  auto order = [](const std::string& id) {
    const auto& cat = check_catalog();
    for (size_t i = 0; i < cat.size(); ++i)
      if (id == cat[i].id) return i;
    return cat.size();
  };
  std::stable_sort(
      rep.checks.begin(), rep.checks.end(),
      [&](const CheckResult& a, const CheckResult& b) { return order(a.id) < order(b.id); });

  rep.identity["sparkctl_version"] = kVersion;
  rep.identity["sparkd_version"] = facts.sparkd_version;
  rep.identity["nccl_path"] = facts.nccl.path;
  rep.identity["nccl_version"] = nccl_version_text(facts.nccl.version);
  rep.identity["nvidia_driver"] = gpu ? gpu->kernel_module_version : "";
  rep.identity["cuda_driver"] = gpu ? cuda_version_text(gpu->driver_api_version) : "";
  rep.identity["config_digest"] = cfg.digest();
  rep.identity["manifest_digest"] = mf.manifest_digest;

  if (verbose) {
    json raw;
    raw["facts"] = facts_to_json(facts);
    for (const auto& h : hcas)
      if (h) raw["gid_tables"][h->name] = format_gid_table(*h);
    if (mi)
      for (const auto& [k, v] : mi->fields) raw["meminfo"][k] = v;
    rep.raw = raw;
  }
  return rep;
}

}  // namespace spark::env
