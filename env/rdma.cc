#include "env/rdma.h"

#include <arpa/inet.h>
#include <fmt/format.h>

#include <algorithm>

#include "core/strings.h"

namespace spark::env {

bool GidEntry::zero() const {
  return std::all_of(bytes.begin(), bytes.end(), [](uint8_t b) { return b == 0; });
}

bool GidEntry::ipv4_mapped() const {
  for (int i = 0; i < 10; ++i)
    if (bytes[static_cast<size_t>(i)] != 0) return false;
  return bytes[10] == 0xff && bytes[11] == 0xff;
}

std::string GidEntry::ipv4() const {
  if (!ipv4_mapped()) return "";
  return fmt::format("{}.{}.{}.{}", bytes[12], bytes[13], bytes[14], bytes[15]);
}

std::string GidEntry::text() const {
  char buf[INET6_ADDRSTRLEN] = {};
  if (!::inet_ntop(AF_INET6, bytes.data(), buf, sizeof buf)) return raw;
  return buf;
}

const GidEntry* RdmaPort::gid(int index) const {
  for (const auto& g : gids)
    if (g.index == index) return &g;
  return nullptr;
}

const RdmaPort* Hca::port(int p) const {
  for (const auto& x : ports)
    if (x.port == p) return &x;
  return nullptr;
}

bool parse_gid(const std::string& raw, std::array<uint8_t, 16>* out) {
  auto groups = split_list(raw, ':');
  if (groups.size() != 8) return false;
  for (size_t i = 0; i < 8; ++i) {
    const auto& g = groups[i];
    if (g.size() != 4) return false;
    unsigned v = 0;
    for (char c : g) {
      v <<= 4;
      if (c >= '0' && c <= '9')
        v |= static_cast<unsigned>(c - '0');
      else if (c >= 'a' && c <= 'f')
        v |= static_cast<unsigned>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F')
        v |= static_cast<unsigned>(c - 'A' + 10);
      else
        return false;
    }
    (*out)[2 * i] = static_cast<uint8_t>(v >> 8);
    (*out)[2 * i + 1] = static_cast<uint8_t>(v & 0xff);
  }
  return true;
}

std::vector<std::string> list_hcas(const Sysroot& root) {
  return root.list("/sys/class/infiniband");
}

namespace {

// "4: ACTIVE" -> 4
int leading_code(const std::string& s) {
  auto colon = s.find(':');
  auto v = parse_i64(trim(std::string_view(s).substr(0, colon)));
  return v ? static_cast<int>(*v) : -1;
}

}  // namespace

std::optional<Hca> read_hca(const Sysroot& root, const std::string& name) {
  std::string base = "/sys/class/infiniband/" + name;
  if (!root.exists(base)) return std::nullopt;
  Hca h;
  h.name = name;
  h.netdevs = root.list(base + "/device/net");
  h.fw_ver = root.read_line(base + "/fw_ver").value_or("");
  for (const auto& p : root.list(base + "/ports")) {
    auto pn = parse_u64(p);
    if (!pn) continue;
    RdmaPort port;
    port.port = static_cast<int>(*pn);
    std::string pb = base + "/ports/" + p;
    port.state = root.read_line(pb + "/state").value_or("");
    port.state_code = leading_code(port.state);
    port.phys_state = root.read_line(pb + "/phys_state").value_or("");
    port.phys_state_code = leading_code(port.phys_state);
    port.link_layer = root.read_line(pb + "/link_layer").value_or("");
    for (const auto& gi : root.list(pb + "/gids")) {
      auto idx = parse_u64(gi);
      if (!idx) continue;
      GidEntry e;
      e.index = static_cast<int>(*idx);
      e.path = pb + "/gids/" + gi;
      auto raw = root.read_line(e.path);
      e.raw = raw.value_or("");
      if (!parse_gid(e.raw, &e.bytes)) {
        // A file that cannot be read is an empty entry. One that reads but holds no GID (junk
        // text, or nothing at all: the kernel prints zeros for an unused entry, never an
        // empty file) is data we cannot read, named as such: never an all-zero entry.
        e.bytes.fill(0);
        e.malformed = raw.has_value();
      }
      if (!e.zero()) {
        // The kernel answers EINVAL for the attributes of empty entries; only ask for real ones.
        e.type = root.read_line(pb + "/gid_attrs/types/" + gi).value_or("");
        e.ndev = root.read_line(pb + "/gid_attrs/ndevs/" + gi).value_or("");
      }
      port.gids.push_back(std::move(e));
    }
    std::sort(port.gids.begin(), port.gids.end(),
              [](const GidEntry& a, const GidEntry& b) { return a.index < b.index; });
    h.ports.push_back(std::move(port));
  }
  std::sort(h.ports.begin(), h.ports.end(),
            [](const RdmaPort& a, const RdmaPort& b) { return a.port < b.port; });
  return h;
}

const char* gid_fault_name(GidFault f) {
  switch (f) {
    case GidFault::none:
      return "none";
    case GidFault::all_zero:
      return "all_zero";
    case GidFault::roce_v1:
      return "roce_v1";
    case GidFault::other_node:
      return "other_node";
    case GidFault::ipv6_only:
      return "ipv6_only";
    case GidFault::moved:
      return "moved";
    case GidFault::not_found:
      return "not_found";
    case GidFault::other_twin:
      return "other_twin";
    case GidFault::unparseable:
      return "unparseable";
  }
  return "not_found";
}

GidResolution resolve_roce_gid(const Hca& hca, int port_no, const std::string& fabric_ip,
                               std::optional<int> configured,
                               const std::vector<std::pair<std::string, std::string>>& other_ips,
                               const std::string& config_key) {
  std::vector<KnownAddress> known;
  for (const auto& [node, ip] : other_ips) known.push_back({ip, node, false, "", ""});
  return resolve_roce_gid(hca, port_no, fabric_ip, configured, known, config_key);
}

namespace {
bool link_local(const std::string& ip) {
  return starts_with(ip, "169.254.");
}

std::string quoted_junk(const GidEntry& g) {
  if (g.raw.empty())
    return fmt::format("{} is empty, not a GID (8 groups of 4 hex digits)", g.path);
  std::string t = g.raw.size() > 60 ? g.raw.substr(0, 60) + "..." : g.raw;
  return fmt::format("{} holds '{}', not a GID (8 groups of 4 hex digits)", g.path, t);
}
}  // namespace

GidResolution resolve_roce_gid(const Hca& hca, int port_no, const std::string& fabric_ip,
                               std::optional<int> configured,
                               const std::vector<KnownAddress>& known,
                               const std::string& config_key) {
  GidResolution r;
  r.configured = configured;
  std::string want = "::ffff:" + fabric_ip;
  std::string where = fmt::format("{} port {}", hca.name, port_no);
  const RdmaPort* port = hca.port(port_no);
  if (!port) {
    r.fault = GidFault::not_found;
    r.message = fmt::format("{}: no such port", where);
    r.fix = fmt::format("check /sys/class/infiniband/{}/ports", hca.name);
    return r;
  }
  auto whose = [&](const std::string& ip) -> const KnownAddress* {
    for (const auto& k : known)
      if (k.ip == ip) return &k;
    return nullptr;
  };
  auto twin_name = [](const KnownAddress& k) {
    return k.hca.empty() ? k.netdev : fmt::format("{} ({})", k.netdev, k.hca);
  };
  const GidEntry* v1 = nullptr;
  const GidEntry* other = nullptr;
  std::string other_node;
  const GidEntry* twin = nullptr;
  const KnownAddress* twin_addr = nullptr;
  std::vector<const GidEntry*> junk;
  bool any_ipv6 = false;
  for (const auto& g : port->gids) {
    if (g.malformed) {
      junk.push_back(&g);
      continue;
    }
    if (g.zero()) continue;
    if (g.ipv4_mapped() && g.ipv4() == fabric_ip) {
      if (g.roce_v2()) {
        if (!r.index) r.index = g.index;
      } else if (!v1) {
        v1 = &g;
      }
    } else if (g.ipv4_mapped()) {
      const KnownAddress* k = whose(g.ipv4());
      if (k && k->this_node) {
        if (!twin || (g.roce_v2() && !twin->roce_v2())) {
          twin = &g;
          twin_addr = k;
        }
      } else if (k && !other) {
        other = &g;
        other_node = k->node;
      }
    } else {
      any_ipv6 = true;
    }
  }
  auto set_it = [&](int idx) { return fmt::format("set {}={} or leave it auto", config_key, idx); };
  std::string found_at = r.index ? fmt::format("RoCE v2 {} is at index {}", want, *r.index)
                                 : fmt::format("no index holds RoCE v2 {}", want);

  if (configured) {
    if (r.index && *r.index == *configured) {
      r.fault = GidFault::none;
      r.message = fmt::format("{}: GID index {} is RoCE v2 {} (configured)", where, *r.index, want);
      return r;
    }
    const GidEntry* at = port->gid(*configured);
    const KnownAddress* at_owner = at && at->ipv4_mapped() ? whose(at->ipv4()) : nullptr;
    if (at && at->malformed) {
      r.fault = GidFault::unparseable;
      r.message = fmt::format("{}: GID index {} is unparseable: {}; {}", where, *configured,
                              quoted_junk(*at), found_at);
    } else if (!at || at->zero()) {
      r.fault = GidFault::all_zero;
      r.message = fmt::format("{}: GID index {} is all-zero; {}", where, *configured, found_at);
    } else if (at->ipv4_mapped() && at->ipv4() == fabric_ip && !at->roce_v2()) {
      r.fault = GidFault::roce_v1;
      r.message =
          fmt::format("{}: GID index {} holds {} as {}, not RoCE v2; {}", where, *configured, want,
                      at->type.empty() ? "unknown type" : at->type, found_at);
    } else if (at_owner && at_owner->this_node) {
      r.fault = GidFault::other_twin;
      r.message = fmt::format(
          "{}: GID index {} holds {}, the address of this node's other twin {}, not this "
          "port's {}; {}",
          where, *configured, at->text(), twin_name(*at_owner), fabric_ip, found_at);
    } else if (at->ipv4_mapped() && at->ipv4() != fabric_ip) {
      std::string owner =
          at_owner ? fmt::format(", node {}'s fabric address", at_owner->node)
          : link_local(at->ipv4())
              ? ", a link-local address (169.254.0.0/16: avahi or the kernel made it up), "
                "never the fabric's"
              : "";
      r.fault = GidFault::other_node;
      r.message = fmt::format("{}: GID index {} holds {}{} (this node's is {}); {}", where,
                              *configured, at->text(), owner, fabric_ip, found_at);
    } else if (r.index) {
      r.fault = GidFault::moved;
      r.message = fmt::format(
          "{}: GID index {} now holds {} ({}); {} (the table moved after a "
          "reboot or an address change)",
          where, *configured, at->text(), at->type, found_at);
    } else {
      r.fault = any_ipv6 && !v1 ? GidFault::ipv6_only : GidFault::not_found;
      r.message = fmt::format("{}: GID index {} holds {} ({}); {}", where, *configured, at->text(),
                              at->type, found_at);
    }
    if (r.index) {
      r.fix = set_it(*r.index);
      return r;
    }
    // Nothing usable anywhere: fall through to explain why, keeping the fault named above
    // unless the table says more.
  } else if (r.index) {
    r.fault = GidFault::none;
    r.message = fmt::format("{}: RoCE v2 {} at GID index {} (auto)", where, want, *r.index);
    return r;
  }

  // No RoCE v2 entry for our address on this port.
  std::string ndev = hca.netdevs.empty() ? std::string("its netdev") : hca.netdevs[0];
  auto append = [&](const std::string& s) {
    r.message += r.message.empty() ? fmt::format("{}: {}", where, s) : "; " + s;
  };
  std::string v1_note =
      v1 ? fmt::format("{} is present only as {} (index {})", want, v1->type, v1->index) : "";
  if (twin) {
    // The port carries the other twin's address: a crossed cable or swapped addresses. The
    // v1 entry of our own address (if any) is a symptom of the same thing, not the cause.
    if (!configured || r.fault == GidFault::not_found || r.fault == GidFault::ipv6_only)
      r.fault = GidFault::other_twin;
    if (r.fault != GidFault::other_twin || !configured)
      append(fmt::format("{} carries {} (index {}, {}), the address of this node's other twin {}",
                         ndev, twin->text(), twin->index,
                         twin->type.empty() ? "unknown type" : twin->type, twin_name(*twin_addr)));
    if (v1) append(v1_note);
    r.fix = fmt::format(
        "each twin needs its own address: {} on {}, {} on {}. Compare `ip -br addr show dev {}` "
        "and `ip -br addr show dev {}` and move the address that is on the wrong netdev; if the "
        "addresses are right, the ports are cross-cabled: cable {} to the peer's matching port "
        "(`rdma link show` on both nodes). Then rerun preflight",
        fabric_ip, ndev, twin_addr->ip, twin_addr->netdev, ndev, twin_addr->netdev, hca.name);
  } else if (!junk.empty()) {
    // An entry the kernel wrote but we cannot read hides what it holds: name it before
    // concluding anything from the entries around it.
    if (!configured || r.fault == GidFault::not_found) r.fault = GidFault::unparseable;
    for (const auto* g : junk)
      if (!configured || g->index != *configured)
        append(fmt::format("GID index {} is unparseable: {}", g->index, quoted_junk(*g)));
    if (v1) append(v1_note);
    r.fix = fmt::format(
        "a live node's sysfs always holds GIDs: recapture the node (`sparkctl capture-node`), "
        "or check the HCA driver (`dmesg | grep mlx5`) and that {} has address {}",
        ndev, fabric_ip);
  } else if (v1) {
    if (!configured) r.fault = GidFault::roce_v1;
    if (r.fault != GidFault::roce_v1 || !configured)  // else the message already says so
      append(v1_note);
    r.fix = "enable RoCE v2 on the HCA (the default for ConnectX; check `cma_roce_mode -d " +
            hca.name + "` and the switch/peer settings), then rerun preflight";
  } else if (other) {
    if (!configured || r.fault == GidFault::not_found) r.fault = GidFault::other_node;
    append(fmt::format("{} carries {} (index {}), node {}'s fabric address, not this node's {}",
                       ndev, other->text(), other->index, other_node, fabric_ip));
    r.fix = "this node has another node's address: fix the address on " + ndev +
            " or the NODE<i>_FABRIC_IP values (swapped?)";
  } else if (any_ipv6) {
    if (!configured) r.fault = GidFault::ipv6_only;
    append(
        fmt::format("only IPv6 GIDs, no IPv4-mapped entry: {} has no IPv4 address (the fabric "
                    "address is {})",
                    ndev, fabric_ip));
    r.fix = fmt::format(
        "assign {} to {} (e.g. `ip addr add {}/24 dev {}` and make it "
        "persistent), then rerun preflight",
        fabric_ip, ndev, fabric_ip, ndev);
  } else {
    if (!configured) r.fault = GidFault::not_found;
    if (r.message.empty()) r.message = fmt::format("{}: GID table is empty", where);
    r.fix = fmt::format("bring {} up with address {}, then rerun preflight", ndev, fabric_ip);
  }
  return r;
}

std::string format_gid_table(const Hca& hca) {
  std::string out = fmt::format("hca_id: {}\n", hca.name);
  for (const auto& p : hca.ports) {
    out += fmt::format("  port: {}\n    state: {}\n    phys_state: {}\n    link_layer: {}\n",
                       p.port, p.state, p.phys_state, p.link_layer);
    for (const auto& g : p.gids) {
      if (g.zero()) continue;
      out += fmt::format("    GID[{:3}]: {}, {}{}\n", g.index, g.text(), g.type,
                         g.ndev.empty() ? "" : ", " + g.ndev);
    }
  }
  return out;
}

}  // namespace spark::env
