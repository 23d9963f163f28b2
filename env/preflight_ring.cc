// The cross-node half of preflight (pure functions over node reports), the catalog of check
// IDs, and the report renderers.
#include <fmt/format.h>

#include <algorithm>
#include <set>
#include <sstream>

#include "core/strings.h"
#include "env/gpu.h"
#include "env/net.h"
#include "env/preflight.h"
#include "spark/version.h"

namespace spark::env {

using nlohmann::json;

const char* verdict_name(Verdict v) {
  switch (v) {
    case Verdict::pass:
      return "PASS";
    case Verdict::warn:
      return "WARN";
    case Verdict::fail:
      return "FAIL";
    case Verdict::skip:
      return "SKIP";
  }
  return "SKIP";
}

std::optional<Verdict> parse_verdict(const std::string& s) {
  for (auto v : {Verdict::pass, Verdict::warn, Verdict::fail, Verdict::skip})
    if (s == verdict_name(v)) return v;
  return std::nullopt;
}

const std::vector<CheckInfo>& check_catalog() {
  static const std::vector<CheckInfo> c = {
      {"ssh.reach", "each node answers over SSH with a known host key", true},
      {"rdma.devices", "configured HCAs exist; /dev/infiniband/uverbs* usable", false},
      {"rdma.port", "port ACTIVE, LinkUp, link layer Ethernet", false},
      {"rdma.netdev", "each HCA maps to its configured netdev, which holds an IPv4", false},
      {"rdma.gid", "RoCE v2 GID of the fabric address resolved (and the configured index right)",
       false},
      {"net.link", "operstate up, speed floor, MTU, the same MTU on every node", false},
      {"net.addr", "no IPv4 address held by two nodes (a cloned disk image, a copied netplan file)",
       true},
      {"net.subnet",
       "each twin in an IPv4 subnet of its own (or the ARP sysctls that make a shared one safe)",
       false},
      {"net.path", "don't-fragment ping of MTU-28 bytes to every peer on every twin", true},
      {"net.bandwidth", "TCP throughput per twin against line rate (--bandwidth)", true},
      {"mem",
       "MemAvailable, MemFree, Dirty; page cache (the model's, other files) on unified "
       "memory",
       false},
      {"mem.plan", "weights share + KV pool + reserve per rank fits", false},
      {"sys", "memlock, swap, transparent huge pages", false},
      {"sys.read", "every probed file read safely: regular, under the size cap and deadline",
       false},
      {"disk", "model filesystem use after staging under DISK_MAX_USE", false},
      {"gpu", "driver, device, memory, no other process on the GPU", false},
      {"gpu.parity", "the same GPU model and compute capability on every node", true},
      {"gpu.throttle", "SM clock, power and throttle reasons (NVML) under a short load on each GPU",
       false},
      {"sw.known_bad", "kernel, driver, NCCL, firmware against the known-bad list (kho=off)",
       false},
      {"sw.sparkd", "the sparkd start runs here is found, starts, and is this sparkctl's version",
       false},
      {"sw.parity", "sparkctl, NCCL, driver, config and manifest identical on every node", true},
      {"port.free", "API and rendezvous ports can be bound", false},
      {"model.files", "config.json, index and every shard present, sizes as the manifest", false},
      {"model.engine",
       "the configured engine can serve the model: architecture, weight types, tokenizer, "
       "CONTEXT_LEN",
       false},
      {"clock", "clock skew between nodes under 1 s", true},
  };
  return c;
}

namespace {
bool matches(const std::string& pattern, const std::string& id) {
  return pattern == id || starts_with(id, pattern + ".");
}
}  // namespace

bool CheckFilter::enabled(const std::string& id) const {
  if (!only.empty() &&
      std::none_of(only.begin(), only.end(), [&](const auto& p) { return matches(p, id); }))
    return false;
  return std::none_of(skip.begin(), skip.end(), [&](const auto& p) { return matches(p, id); });
}

Status validate_check_ids(const std::vector<std::string>& ids) {
  std::vector<std::string> known;
  for (const auto& c : check_catalog()) known.emplace_back(c.id);
  for (const auto& id : ids) {
    bool ok =
        std::any_of(known.begin(), known.end(), [&](const auto& k) { return matches(id, k); });
    if (!ok) {
      auto hint = did_you_mean(id, known);
      return make_error(Errc::usage,
                        fmt::format("unknown check '{}'{}; known: {}", id,
                                    hint.empty() ? "" : fmt::format(" (did you mean {}?)", hint),
                                    join(known, ", ")));
    }
  }
  return Status::Ok();
}

// ---- JSON ----

namespace {
json check_json(const CheckResult& c) {
  return {{"node", c.node},       {"id", c.id},
          {"subject", c.subject}, {"verdict", verdict_name(c.verdict)},
          {"message", c.message}, {"fix", c.fix}};
}
Result<CheckResult> check_from(const json& j) {
  CheckResult c;
  c.node = j.value("node", "");
  c.id = j.value("id", "");
  c.subject = j.value("subject", "");
  auto v = parse_verdict(j.value("verdict", ""));
  if (!v) return make_error(Errc::io, fmt::format("check {}: bad verdict", c.id));
  c.verdict = *v;
  c.message = j.value("message", "");
  c.fix = j.value("fix", "");
  return c;
}
}  // namespace

json report_to_json(const NodeReport& r) {
  json j;
  j["schema"] = 1;
  j["node"] = r.node;
  j["index"] = r.index;
  j["hostname"] = r.hostname;
  j["clock_ms"] = r.clock_ms;
  j["gpu_name"] = r.gpu_name;
  j["gpu_cc"] = r.gpu_cc;
  j["addrs"] = json::array();
  for (const auto& a : r.addrs)
    j["addrs"].push_back({{"netdev", a.netdev}, {"address", a.address}, {"prefix", a.prefix}});
  j["identity"] = r.identity;
  j["checks"] = json::array();
  for (const auto& c : r.checks) j["checks"].push_back(check_json(c));
  j["links"] = json::array();
  for (const auto& l : r.links)
    j["links"].push_back({{"hca", l.hca},
                          {"netdev", l.netdev},
                          {"ipv4", l.ipv4},
                          {"mtu", l.mtu},
                          {"operstate", l.operstate},
                          {"speed_mbps", l.speed_mbps},
                          {"gid_index", l.gid_index ? json(*l.gid_index) : json()},
                          {"port_state", l.port_state}});
  if (!r.raw.is_null()) j["raw"] = r.raw;
  return j;
}

Result<NodeReport> report_from_json(const json& j) {
  try {
    if (!j.is_object() || j.value("schema", 0) != 1)
      return make_error(Errc::io, "not a preflight node report (schema 1)");
    NodeReport r;
    r.node = j.at("node").get<std::string>();
    r.index = j.value("index", 0);
    r.hostname = j.value("hostname", "");
    r.clock_ms = j.value("clock_ms", int64_t{0});
    r.gpu_name = j.value("gpu_name", "");
    r.gpu_cc = j.value("gpu_cc", "");
    for (const auto& a : j.value("addrs", json::array()))
      r.addrs.push_back({a.value("netdev", ""), a.value("address", ""), a.value("prefix", 0)});
    if (j.contains("identity"))
      r.identity = j["identity"].get<std::map<std::string, std::string>>();
    for (const auto& c : j.value("checks", json::array())) {
      auto cr = check_from(c);
      if (!cr) return cr.error();
      r.checks.push_back(*cr);
    }
    for (const auto& l : j.value("links", json::array())) {
      LinkFacts f;
      f.hca = l.value("hca", "");
      f.netdev = l.value("netdev", "");
      f.ipv4 = l.value("ipv4", "");
      f.mtu = l.value("mtu", 0);
      f.operstate = l.value("operstate", "");
      f.speed_mbps = l.value("speed_mbps", int64_t{0});
      if (l.contains("gid_index") && l["gid_index"].is_number_integer())
        f.gid_index = l["gid_index"].get<int>();
      f.port_state = l.value("port_state", "");
      r.links.push_back(f);
    }
    if (j.contains("raw")) r.raw = j["raw"];
    return r;
  } catch (const json::exception& e) {
    return make_error(Errc::io, fmt::format("node report: {}", e.what()));
  }
}

// ---- merge and cross-node checks ----

int RingReport::exit_code() const {
  auto n = [&](const char* k) {
    auto it = counts.find(k);
    return it == counts.end() ? 0 : it->second;
  };
  if (n("FAIL")) return 1;
  if (n("WARN")) return kExitWarnings;
  return 0;
}

void add_checks(RingReport* r, const std::vector<CheckResult>& more) {
  r->checks.insert(r->checks.end(), more.begin(), more.end());
  r->counts.clear();
  for (const auto& c : r->checks) r->counts[verdict_name(c.verdict)]++;
}

namespace {

const char* kParityFields[] = {"sparkctl_version", "sparkd_version", "nccl_path",
                               "nccl_version",     "nvidia_driver",  "cuda_driver",
                               "config_digest",    "manifest_digest"};

std::string show(const std::string& v) {
  return v.empty() ? "(none)" : v;
}

std::vector<CheckResult> parity_checks(const std::vector<const NodeReport*>& reps) {
  std::vector<CheckResult> out;
  if (reps.size() < 2) return out;
  const NodeReport& ref = *reps[0];
  for (size_t i = 1; i < reps.size(); ++i) {
    const NodeReport& n = *reps[i];
    std::vector<std::string> diffs;
    for (const char* f : kParityFields) {
      auto a = ref.identity.count(f) ? ref.identity.at(f) : "";
      auto b = n.identity.count(f) ? n.identity.at(f) : "";
      if (a != b)
        diffs.push_back(fmt::format("{} {} here, {} on {}", f, show(b), show(a), ref.node));
    }
    if (diffs.empty())
      out.push_back(
          {n.node, "sw.parity", "", Verdict::pass,
           fmt::format(
               "identical to {} (sparkctl {}, NCCL {}, config {})", ref.node,
               show(n.identity.count("sparkctl_version") ? n.identity.at("sparkctl_version") : ""),
               show(n.identity.count("nccl_version") ? n.identity.at("nccl_version") : ""),
               show(n.identity.count("config_digest") ? n.identity.at("config_digest").substr(0, 12)
                                                      : "")),
           ""});
    else
      out.push_back(
          {n.node, "sw.parity", "", Verdict::fail, join(diffs, "; "),
           fmt::format("install the same sparkctl, NCCL (same path: pip and system libnccl of "
                       "one version hang together), driver, cluster file and model on every "
                       "node as on {}",
                       ref.node)});
  }
  return out;
}

std::vector<CheckResult> mtu_parity(const std::vector<const NodeReport*>& reps) {
  std::vector<CheckResult> out;
  size_t twins = 0;
  for (const auto* r : reps) twins = std::max(twins, r->links.size());
  for (size_t t = 0; t < twins; ++t) {
    std::map<int, std::vector<std::string>> by_mtu;
    for (const auto* r : reps)
      if (t < r->links.size() && r->links[t].mtu > 0)
        by_mtu[r->links[t].mtu].push_back(fmt::format("{}:{}", r->node, r->links[t].netdev));
    if (by_mtu.size() <= 1) continue;
    std::vector<std::string> parts;
    for (const auto& [mtu, nodes] : by_mtu)
      parts.push_back(fmt::format("{} on {}", mtu, join(nodes, ", ")));
    out.push_back(
        {"ring", "net.link", fmt::format("twin {}", t), Verdict::fail,
         fmt::format("MTU differs between nodes: {}", join(parts, "; ")),
         fmt::format(
             "set the same MTU (9000) on every node: `ip link set dev <netdev> mtu 9000`")});
  }
  return out;
}

// The address a node that must give one up takes instead: in the same subnet, with its own
// fabric address's host number when that is free in the ring, else the first free one.
std::string free_address(const RingConfig& cfg, const std::vector<const NodeReport*>& reps,
                         const NodeReport& n, const std::string& addr, int prefix) {
  auto a = parse_ipv4(addr);
  if (!a || prefix <= 0 || prefix >= 31) return "";
  uint32_t mask = ~uint32_t{0} << (32 - prefix);
  auto taken = [&](uint32_t v) {
    std::string t = format_ipv4(v);
    for (const auto* r : reps)
      for (const auto& x : r->addrs)
        if (x.address == t) return true;
    for (const auto& node : cfg.nodes)
      if (node.fabric_ip == t) return true;
    return false;
  };
  std::string own;
  for (const auto& node : cfg.nodes)
    if (node.index == n.index) own = node.fabric_ip;
  if (auto f = parse_ipv4(own)) {
    uint32_t v = (*a & mask) | (*f & ~mask);
    if (v == *f && ipv4_same_subnet(own, addr, prefix) && own != addr) return own;
    if ((v & ~mask) != 0 && (v & ~mask) != ~mask && !taken(v)) return format_ipv4(v);
  }
  for (uint32_t h = 1; h < (~mask); ++h)
    if (!taken((*a & mask) | h)) return format_ipv4((*a & mask) | h);
  return "";
}

// net.addr: an address two nodes hold. The node whose configured fabric address it is keeps
// it (else the lower index); every other holder gets a row with the move to an address of
// its own. `distrust` collects (node, netdev) whose GID must not be used.
std::vector<CheckResult> addr_checks(const RingConfig& cfg,
                                     const std::vector<const NodeReport*>& reps,
                                     std::set<std::pair<std::string, std::string>>* distrust) {
  std::vector<CheckResult> out;
  std::map<std::string, std::vector<std::pair<const NodeReport*, const AddrFact*>>> by_addr;
  for (const auto* r : reps)
    for (const auto& a : r->addrs)
      if (!ipv4_link_local(a.address)) by_addr[a.address].emplace_back(r, &a);
  std::set<std::string> flagged;
  for (const auto& [addr, holders] : by_addr) {
    std::set<std::string> nodes;
    for (const auto& h : holders) nodes.insert(h.first->node);
    if (nodes.size() < 2) continue;
    const NodeReport* keeper = nullptr;
    const AddrFact* kept = nullptr;
    for (const auto& h : holders)
      for (const auto& node : cfg.nodes)
        if (node.index == h.first->index && node.fabric_ip == addr && !keeper) {
          keeper = h.first;
          kept = h.second;
        }
    if (!keeper) {
      for (const auto& h : holders)
        if (!keeper || h.first->index < keeper->index) {
          keeper = h.first;
          kept = h.second;
        }
    }
    for (const auto& [r, a] : holders) {
      if (r == keeper) continue;
      flagged.insert(r->node);
      distrust->emplace(r->node, a->netdev);
      std::string to = free_address(cfg, reps, *r, addr, a->prefix);
      out.push_back(
          {r->node, "net.addr", addr, Verdict::fail,
           fmt::format("{} is on {}:{} and on {}:{}: two nodes answer for one address (a cloned "
                       "disk image or a copied netplan file), so ARP, NCCL and the GID of {} "
                       "reach either",
                       addr, r->node, a->netdev, keeper->node, kept->netdev, addr),
           to.empty()
               ? fmt::format("give {} an address of its own on {} instead of {} (and in its "
                             "netplan file)",
                             r->node, a->netdev, addr)
               : fmt::format("on {}: {} (and in its netplan file), so {} keeps {}", r->node,
                             ip_addr_move(addr, a->prefix, a->netdev, to, a->prefix, a->netdev),
                             keeper->node, addr)});
    }
  }
  for (const auto* r : reps)
    if (!flagged.count(r->node) && !r->addrs.empty())
      out.push_back({r->node, "net.addr", "", Verdict::pass,
                     "no address of this node is held by another node", ""});
  return out;
}

// gpu.parity: every node's GPU against the most common one (the head's on a tie).
std::vector<CheckResult> gpu_parity(const std::vector<const NodeReport*>& reps) {
  std::vector<CheckResult> out;
  std::map<std::pair<std::string, std::string>, int> count;
  for (const auto* r : reps)
    if (!r->gpu_cc.empty()) count[{r->gpu_name, r->gpu_cc}]++;
  if (count.size() < 1) return out;
  std::pair<std::string, std::string> ref;
  int best = 0;
  for (const auto* r : reps) {
    if (r->gpu_cc.empty()) continue;
    int c = count[{r->gpu_name, r->gpu_cc}];
    if (c > best) {
      best = c;
      ref = {r->gpu_name, r->gpu_cc};
    }
  }
  std::vector<std::string> with_ref;
  for (const auto* r : reps)
    if (!r->gpu_cc.empty() && std::make_pair(r->gpu_name, r->gpu_cc) == ref)
      with_ref.push_back(r->node);
  auto sm = [](const std::string& cc) {
    std::string t = cc;
    t.erase(std::remove(t.begin(), t.end(), '.'), t.end());
    return "sm_" + t;
  };
  for (const auto* r : reps) {
    if (r->gpu_cc.empty()) continue;
    if (std::make_pair(r->gpu_name, r->gpu_cc) == ref) {
      out.push_back({r->node, "gpu.parity", "", Verdict::pass,
                     fmt::format("{} ({}) like {}", r->gpu_name, sm(r->gpu_cc),
                                 count.size() == 1 ? "every node" : join(with_ref, ", ")),
                     ""});
      continue;
    }
    std::string archs = *kCudaArchitectures ? kCudaArchitectures : "none (a CPU-only build)";
    out.push_back(
        {r->node, "gpu.parity", "", Verdict::fail,
         fmt::format("{}'s GPU is {} ({}), {} {} {} ({}): one ring runs one kernel build and one "
                     "shard plan on every rank; this build has CUDA kernels for {}",
                     r->node, r->gpu_name, sm(r->gpu_cc), join(with_ref, ", "),
                     with_ref.size() == 1 ? "has" : "have", ref.first + "", sm(ref.second), archs),
         fmt::format("run the ring on nodes with the same GPU ({}, {}): take {} out of the "
                     "cluster file or put the same GPU in it",
                     ref.first, sm(ref.second), r->node)});
  }
  return out;
}
}  // namespace

RingReport merge_reports(const RingConfig& cfg, const std::vector<NodeOutcome>& outcomes,
                         const CheckFilter& filter) {
  RingReport rep;
  std::vector<CheckResult> checks;
  std::vector<const NodeReport*> reps;
  const NodeOutcome* head = nullptr;
  for (const auto& o : outcomes) {
    if (filter.enabled("ssh.reach")) {
      if (o.error) {
        std::string fix =
            o.error->code == Errc::auth
                ? "verify the host key and add it to known_hosts (`ssh-keyscan HOST`), "
                  "or fix SSH_IDENTITY / SSH_USER"
            : o.error->code == Errc::timeout
                ? "is the node up and sshd running? check NODE<i>_SSH and SSH_TIMEOUT"
                : "check NODE<i>_SSH, SSH_PORT and that sparkctl is installed on the node "
                  "(SPARKCTL_BIN)";
        checks.push_back({o.node, "ssh.reach", "", Verdict::fail, o.error->message, fix});
      } else {
        checks.push_back({o.node, "ssh.reach", "", Verdict::pass,
                          fmt::format("answered in {:.0f} ms", o.seconds * 1000), ""});
      }
    }
    if (o.report) {
      for (const auto& c : o.report->checks) checks.push_back(c);
      reps.push_back(&*o.report);
      if (o.index == 0) head = &o;
    }
  }
  if (filter.enabled("sw.parity")) {
    auto p = parity_checks(reps);
    checks.insert(checks.end(), p.begin(), p.end());
  }
  if (filter.enabled("net.link")) {
    auto m = mtu_parity(reps);
    checks.insert(checks.end(), m.begin(), m.end());
  }
  // A twin whose address another node holds resolves that node's GID as well: never used,
  // whether net.addr is shown or not.
  std::set<std::pair<std::string, std::string>> distrust;
  {
    auto a = addr_checks(cfg, reps, &distrust);
    if (filter.enabled("net.addr")) checks.insert(checks.end(), a.begin(), a.end());
  }
  if (filter.enabled("gpu.parity") && reps.size() > 1) {
    auto g = gpu_parity(reps);
    checks.insert(checks.end(), g.begin(), g.end());
  }
  if (filter.enabled("clock") && reps.size() > 1) {
    // The node sampled its clock between sent_ms and recv_ms of the head's clock; outside
    // that window the difference is skew (a lower bound, so never a false alarm).
    int64_t head_offset = 0;
    if (head && head->sent_ms)
      head_offset = head->report->clock_ms < head->sent_ms ? head->report->clock_ms - head->sent_ms
                    : head->report->clock_ms > head->recv_ms
                        ? head->report->clock_ms - head->recv_ms
                        : 0;
    for (const auto& o : outcomes) {
      if (!o.report || o.index == 0 || !o.sent_ms) continue;
      int64_t c = o.report->clock_ms;
      int64_t skew = c < o.sent_ms ? c - o.sent_ms : c > o.recv_ms ? c - o.recv_ms : 0;
      skew -= head_offset;
      if (std::llabs(skew) > 1000)
        checks.push_back(
            {o.node, "clock", "", Verdict::warn,
             fmt::format("clock is {:+.1f} s off the head's", static_cast<double>(skew) / 1000.0),
             "run NTP on every node (chrony or systemd-timesyncd): logs and timeouts "
             "compare times"});
      else
        checks.push_back({o.node, "clock", "", Verdict::pass,
                          fmt::format("within {} ms of the head",
                                      std::max<int64_t>(std::llabs(skew), o.recv_ms - o.sent_ms)),
                          ""});
    }
  }
  for (const auto& o : outcomes)
    if (o.report) {
      rep.nodes.push_back(*o.report);
      for (auto& l : rep.nodes.back().links)
        if (distrust.count({o.report->node, l.netdev})) l.gid_index.reset();
    }
  for (const auto& place : cfg.ranks()) {
    RankSummary s;
    s.rank = place.rank;
    s.gpu = place.gpu;
    s.node = cfg.nodes[static_cast<size_t>(place.node)].name;
    for (const auto& n : rep.nodes)
      if (n.index == place.node)
        for (const auto& l : n.links)
          if (!l.hca.empty()) s.gid_index.emplace_back(l.hca, l.gid_index);
    rep.ranks.push_back(std::move(s));
  }
  add_checks(&rep, checks);
  return rep;
}

RingReport replay_ring(const RingConfig& cfg, const std::vector<std::string>& roots,
                       const CheckFilter& filter, bool verbose) {
  std::vector<NodeOutcome> outcomes;
  for (size_t i = 0; i < cfg.nodes.size(); ++i) {
    NodeOutcome o;
    o.node = cfg.nodes[i].name;
    o.index = cfg.nodes[i].index;
    if (i < roots.size())
      o.report = run_node_checks(cfg, static_cast<int>(i), Sysroot(roots[i]), filter, verbose);
    else
      o.error = make_error(Errc::not_found, fmt::format("no captured tree for {}", o.node));
    outcomes.push_back(std::move(o));
  }
  CheckFilter f = filter;
  f.skip.push_back("ssh.reach");  // nothing was reached
  return merge_reports(cfg, outcomes, f);
}

std::vector<PingPlan> plan_pings(const std::vector<NodeReport>& reports) {
  std::vector<PingPlan> out;
  for (const auto& a : reports)
    for (const auto& b : reports) {
      if (a.node == b.node) continue;
      for (size_t t = 0; t < a.links.size() && t < b.links.size(); ++t) {
        const auto& la = a.links[t];
        const auto& lb = b.links[t];
        if (la.ipv4.empty() || lb.ipv4.empty()) continue;
        PingPlan p;
        p.node_index = a.index;
        p.probe.from_node = a.node;
        p.probe.to_node = b.node;
        p.probe.netdev = la.netdev;
        p.probe.from_addr = la.ipv4;
        p.probe.to_addr = lb.ipv4;
        p.probe.payload = std::max(0, (la.mtu > 0 ? la.mtu : 1500) - 28);
        p.command = fmt::format("ping -n -q -M do -c 1 -W 1 -s {} -I {} {}", p.probe.payload,
                                la.ipv4, lb.ipv4);
        out.push_back(p);
      }
    }
  return out;
}

std::vector<CheckResult> path_checks(const std::vector<PingResult>& pings) {
  std::vector<CheckResult> out;
  for (const auto& p : pings) {
    std::string subject = fmt::format("{}->{}", p.netdev, p.to_node);
    if (p.ok)
      out.push_back({p.from_node, "net.path", subject, Verdict::pass,
                     fmt::format("{} -> {} ({}): {} bytes with don't-fragment", p.from_addr,
                                 p.to_addr, p.to_node, p.payload),
                     ""});
    else
      out.push_back({p.from_node, "net.path", subject, Verdict::fail,
                     fmt::format("{} -> {} ({}): {} bytes with don't-fragment failed: {}",
                                 p.from_addr, p.to_addr, p.to_node, p.payload, p.detail),
                     fmt::format("check the cable and that the MTU is {} on both ends and anything "
                                 "between",
                                 p.payload + 28)});
  }
  return out;
}

std::vector<CheckResult> bandwidth_checks(const std::vector<BandwidthResult>& runs) {
  std::vector<CheckResult> out;
  for (const auto& b : runs) {
    std::string subject = fmt::format("{}->{}", b.netdev, b.to_node);
    if (!b.error.empty()) {
      out.push_back({b.from_node, "net.bandwidth", subject, Verdict::fail, b.error,
                     "check the fabric address and that the port is not firewalled"});
      continue;
    }
    double line = static_cast<double>(b.line_rate_mbps) / 1000.0;
    std::string desc =
        line > 0
            ? fmt::format("{:.1f} Gb/s of {:.0f} Gb/s line rate to {}", b.gbps, line, b.to_node)
            : fmt::format("{:.1f} Gb/s to {} (line rate unknown)", b.gbps, b.to_node);
    Verdict v = Verdict::pass;
    if (line > 0 && b.gbps < line / 10)
      v = Verdict::fail;
    else if (line > 0 && b.gbps < line / 2)
      v = Verdict::warn;
    out.push_back({b.from_node, "net.bandwidth", subject, v, desc,
                   v == Verdict::pass
                       ? ""
                       : "a link far under its rate: reseat the cable, check `ethtool` "
                         "speed/duplex and the peer port"});
  }
  return out;
}

// ---- rendering ----

namespace {
// What a node sent, safe for a terminal: bytes that are not UTF-8 and control bytes (an
// escape sequence, a carriage return, a newline inside a value) as \xNN, as JSON escapes them.
std::string term_safe(std::string_view s) {
  std::string v = escape_invalid_utf8(s), out;
  out.reserve(v.size());
  for (char ch : v) {
    auto c = static_cast<unsigned char>(ch);
    if (c < 0x20 || c == 0x7f)
      out += fmt::format("\\x{:02X}", c);
    else
      out += ch;
  }
  return out;
}
}  // namespace

std::string format_report_table(const RingReport& r, bool verbose) {
  std::ostringstream o;
  size_t wn = 4, wc = 5, ws = 7;
  std::vector<CheckResult> rows;
  for (const auto& c : r.checks)
    rows.push_back({term_safe(c.node), term_safe(c.id), term_safe(c.subject), c.verdict,
                    term_safe(c.message), term_safe(c.fix)});
  for (const auto& c : rows) {
    wn = std::max(wn, c.node.size());
    wc = std::max(wc, c.id.size());
    ws = std::max(ws, c.subject.size());
  }
  o << fmt::format("{:<{}}  {:<{}}  {:<{}}  {:<4}  {}\n", "NODE", wn, "CHECK", wc, "SUBJECT", ws,
                   "VERDICT", "MESSAGE / FIX");
  for (const auto& c : rows) {
    o << fmt::format("{:<{}}  {:<{}}  {:<{}}  {:<7}  {}\n", c.node, wn, c.id, wc, c.subject, ws,
                     verdict_name(c.verdict), c.message);
    if (!c.fix.empty()) o << fmt::format("{:<{}}fix: {}\n", "", wn + wc + ws + 15, c.fix);
  }
  auto n = [&](const char* k) {
    auto it = r.counts.find(k);
    return it == r.counts.end() ? 0 : it->second;
  };
  std::vector<std::string> places;
  for (const auto& rk : r.ranks) {
    std::string gids;
    for (const auto& [hca, idx] : rk.gid_index)
      gids += fmt::format(" {}:{}", hca, idx ? std::to_string(*idx) : "none");
    places.push_back(fmt::format("{}={}/gpu{}{}", rk.rank, term_safe(rk.node), rk.gpu,
                                 gids.empty() ? "" : " gid" + gids));
  }
  if (!places.empty()) o << "# ranks: " << join(places, ", ") << "\n";
  o << fmt::format("# {} PASS, {} WARN, {} FAIL, {} SKIP on {} node(s) in {:.2f} s\n", n("PASS"),
                   n("WARN"), n("FAIL"), n("SKIP"), r.nodes.size(), r.seconds);
  if (verbose) {
    for (const auto& node : r.nodes) {
      if (node.raw.is_null()) continue;
      o << fmt::format("\n# raw facts of {} ({})\n", term_safe(node.node),
                       term_safe(node.hostname));
      if (node.raw.contains("gid_tables"))
        for (const auto& [hca, table] : node.raw["gid_tables"].items()) {
          // Line by line: the table's own newlines stay, a node's control bytes do not.
          std::string_view t = table.get_ref<const std::string&>();
          while (!t.empty()) {
            auto nl = t.find('\n');
            o << term_safe(t.substr(0, nl)) << "\n";
            t = nl == std::string_view::npos ? std::string_view() : t.substr(nl + 1);
          }
        }
      if (node.raw.contains("meminfo"))
        for (const auto& [k, v] : node.raw["meminfo"].items())
          if (k == "MemTotal" || k == "MemFree" || k == "MemAvailable" || k == "Cached" ||
              k == "Dirty" || k == "SwapTotal" || k == "SwapFree")
            o << fmt::format("  {:<13} {}\n", k + ":", format_size(v.get<uint64_t>()));
    }
  }
  return o.str();
}

json ring_report_to_json(const RingReport& r, bool verbose) {
  json j;
  j["schema"] = 1;
  j["ok"] = r.exit_code() == 0;
  j["exit_code"] = r.exit_code();
  j["seconds"] = r.seconds;
  j["counts"] = {{"PASS", 0}, {"WARN", 0}, {"FAIL", 0}, {"SKIP", 0}};
  for (const auto& [k, v] : r.counts) j["counts"][k] = v;
  j["checks"] = json::array();
  for (const auto& c : r.checks) j["checks"].push_back(check_json(c));
  j["ranks"] = json::array();
  for (const auto& rk : r.ranks) {
    json g = json::object();
    for (const auto& [hca, idx] : rk.gid_index) g[hca] = idx ? json(*idx) : json();
    j["ranks"].push_back({{"rank", rk.rank}, {"node", rk.node}, {"gpu", rk.gpu}, {"gid_index", g}});
  }
  j["nodes"] = json::array();
  for (const auto& n : r.nodes) {
    json jn = report_to_json(n);
    jn.erase("checks");
    if (!verbose) jn.erase("raw");
    j["nodes"].push_back(jn);
  }
  return j;
}

}  // namespace spark::env
