// The node checks of preflight: everything one node can find out about itself.
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>

#include "core/strings.h"
#include "env/facts.h"
#include "env/gpu.h"
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

bool is_gb10(const Sysroot& root) {
  auto product = root.read_line("/sys/class/dmi/id/product_name").value_or("");
  return product.find("DGX Spark") != std::string::npos ||
         product.find("GB10") != std::string::npos;
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
    // A twin left out halves the fabric (98 vs 161 Gb/s measured with one twin vs both).
    std::vector<std::string> idle;
    for (const auto& name : present) {
      if (std::find(n.hcas.begin(), n.hcas.end(), name) != n.hcas.end()) continue;
      auto h = read_hca(r.root, name);
      const RdmaPort* p = h ? h->port(1) : nullptr;
      if (p && p->state_code == 4 && p->link_layer == "Ethernet") idle.push_back(name);
    }
    if (!idle.empty())
      r.add("rdma.devices", "twins", Verdict::warn,
            fmt::format("{} {} ACTIVE but not in {}: NCCL uses only the configured HCAs",
                        join(idle, ", "), idle.size() == 1 ? "is" : "are", r.key("HCAS")),
            fmt::format("add {} to {} (and its netdev to {}) to use both twins", join(idle, ","),
                        r.key("HCAS"), r.key("NETDEVS")));
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
              fmt::format("list {} in the order of {} ({} -> {})", r.key("NETDEVS"), r.key("HCAS"),
                          h->name, actual));
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
  if (r.filter.enabled("rdma.netdev") && !n.netdevs.empty()) {
    std::string holder = facts.netdev_of(n.fabric_ip);
    if (std::find(n.netdevs.begin(), n.netdevs.end(), holder) == n.netdevs.end())
      r.add("rdma.netdev", "fabric ip", Verdict::fail,
            fmt::format("{} {} is not on {} ({})", r.key("FABRIC_IP"), n.fabric_ip,
                        join(n.netdevs, " or "),
                        holder.empty() ? "no interface holds it" : "it is on " + holder),
            fmt::format("assign {} to {}, or correct {}", n.fabric_ip, n.netdevs[0],
                        r.key("FABRIC_IP")));
  }
}

void check_gid(NodeRun& r, const NodeFacts& facts, const std::vector<std::optional<Hca>>& hcas) {
  const auto& n = r.node;
  if (n.hcas.empty()) return;
  std::vector<std::pair<std::string, std::string>> others;
  for (const auto& o : r.cfg.nodes)
    if (o.index != n.index && !o.fabric_ip.empty()) others.emplace_back(o.name, o.fabric_ip);
  std::vector<std::pair<std::string, int>> resolved;
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
    std::string ip = n.fabric_ip;
    if (!link.netdev.empty() && facts.netdev_of(n.fabric_ip) != link.netdev) {
      auto v4 = facts.ipv4_of(link.netdev);
      if (!v4.empty()) ip = v4[0];  // the other twin carries its own address
    }
    auto res = resolve_roce_gid(*h, 1, ip, n.gid_index, others, r.key("GID_INDEX"));
    link.gid_index = res.usable();
    if (res.usable()) resolved.emplace_back(h->name, *res.usable());
    if (want)
      r.add("rdma.gid", h->name + ":1", res.ok() ? Verdict::pass : Verdict::fail,
            fmt::format("{}{}", res.message,
                        res.ok() ? "" : fmt::format(" [{}]", gid_fault_name(res.fault))),
            res.fix);
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
            "give both twins the same address layout (an IPv4 each, the same IPv6 addresses) so "
            "the tables line up, or configure one twin");
    }
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

void check_mem(NodeRun& r, const NodeFacts& facts, const Result<MemInfo>& mi, const ModelFiles& mf,
               bool gb10, const std::optional<GpuReport>& gpu) {
  const auto& cfg = r.cfg;
  if (r.filter.enabled("mem")) {
    if (!mi) {
      r.add("mem", "", Verdict::fail, mi.error().message, "is /proc mounted?");
    } else {
      uint64_t avail = mi->get("MemAvailable"), free = mi->get("MemFree"),
               cached = mi->get("Cached"), dirty = mi->get("Dirty");
      uint64_t model_cached = facts.residency ? facts.residency->resident_bytes : 0;
      std::string desc = fmt::format(
          "MemAvailable {}, MemFree {}, Cached {} ({} of it the model's files), Dirty {}",
          format_size(avail), format_size(free), format_size(cached), format_size(model_cached),
          format_size(dirty));
      uint64_t free_min = cfg.get_size("MEM_FREE_MIN"),
               avail_min = cfg.get_size("MEM_AVAILABLE_MIN");
      std::vector<std::string> low;
      if (avail < avail_min)
        low.push_back(fmt::format("MemAvailable {} < MEM_AVAILABLE_MIN {}", format_size(avail),
                                  format_size(avail_min)));
      if (free < free_min)
        low.push_back(
            fmt::format("MemFree {} < MEM_FREE_MIN {}", format_size(free), format_size(free_min)));
      std::string evict_fix =
          model_cached >= kGiB
              ? fmt::format(
                    "run `sparkctl evict`: {} of page cache is the model's files and can be "
                    "dropped without root{}",
                    format_size(model_cached),
                    gb10 ? " (on unified memory it counts against the GPU)" : "")
              : "stop what uses the memory, or `sync; echo 1 > /proc/sys/vm/drop_caches` as root";
      if (!low.empty())
        r.add("mem", "", Verdict::fail, fmt::format("{}; {}", join(low, "; "), desc), evict_fix);
      else if (dirty > kGiB)
        r.add("mem", "", Verdict::warn,
              fmt::format("{} not yet written back; {}", format_size(dirty), desc),
              "run `sync` before starting");
      else if (gb10 && model_cached > 8 * kGiB)
        r.add("mem", "", Verdict::warn,
              fmt::format("{} of page cache is the model's files; {}", format_size(model_cached),
                          desc),
              evict_fix);
      else
        r.add("mem", "", Verdict::pass, desc);
    }
  }
  if (r.filter.enabled("mem.plan")) {
    if (!mf.config_ok) {
      r.add("mem.plan", "", Verdict::skip,
            fmt::format("no model config.json ({}): see model.files", mf.dir));
      return;
    }
    auto input = plan_input(mf, &cfg);
    if (!input) {
      r.add("mem.plan", "", Verdict::fail, input.error().message,
            "check the model's config.json and the plan keys (KV_LAYOUT, CONTEXT_SPLIT, "
            "MEM_WORKSPACE, MEM_MTP, MEM_VISION)");
      return;
    }
    if (!mi) return;
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
    if (row.fits)
      r.add("mem.plan", "", Verdict::pass,
            fmt::format("{}; up to {} tokens fit", desc, row.max_context));
    else
      r.add("mem.plan", "", Verdict::fail, desc,
            row.max_context > 0
                ? fmt::format(
                      "set CONTEXT_LEN={} (the largest that fits) or fewer SLOTS, or free memory",
                      row.max_context)
                : "the weights share alone does not fit: add nodes or free memory (`sparkctl "
                  "evict`)");
  }
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
  auto cmdline = r.root.read_line("/proc/cmdline").value_or("");
  bool kho = false;
  for (const auto& w : split_list(cmdline, ' '))
    if (w == "kho=off") kho = true;
  if (kho)
    r.add("sys", "kho", Verdict::pass, "kho=off on the kernel command line");
  else if (rdma)
    r.add("sys", "kho", Verdict::warn,
          "kho=off is not on the kernel command line (large RDMA registrations can fail)",
          "add kho=off to GRUB_CMDLINE_LINUX, update-grub, reboot");
  else
    r.add("sys", "kho", Verdict::skip, "kho=off matters only with RDMA");
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
    else
      r.add(
          "port.free", what, Verdict::fail,
          fmt::format("{} {} cannot be bound: {}", name, what, p.error),
          p.error.find("in use") != std::string::npos
              ? fmt::format("stop what holds it (`ss -ltnp 'sport = :{}'`) or set {}", p.port, name)
              : fmt::format("the address must be on this node; check {}",
                            name == "API_PORT" ? "API_BIND" : r.key("FABRIC_IP")));
  }
}

void check_model(NodeRun& r, const ModelFiles& mf) {
  if (!r.filter.enabled("model.files")) return;
  if (mf.dir.empty()) {
    r.add("model.files", "", Verdict::skip, "no MODEL_PATH configured");
    return;
  }
  std::string fix = fmt::format("run `sparkctl stage-weights --to {}`", r.node.name);
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
    if (!d->errors.empty())
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
  if (req.sparkd_bin.empty() && root.live()) {
    // Default: beside this sparkctl.
    std::error_code ec;
    auto self = std::filesystem::canonical("/proc/self/exe", ec);
    if (!ec) req.sparkd_bin = (self.parent_path() / "sparkd").string();
    if (!std::filesystem::exists(req.sparkd_bin, ec)) req.sparkd_bin.clear();
  }
  if (node.index == 0) {
    req.ports.emplace_back(cfg.get("API_BIND"), static_cast<int>(cfg.get_int("API_PORT")));
    req.ports.emplace_back(node.fabric_ip, static_cast<int>(cfg.get_int("RDZV_PORT")));
  }
  auto facts_r = node_facts(root, req);
  if (!facts_r) {
    r.add("sys", "facts", Verdict::fail, facts_r.error().message,
          "capture the node with `sparkctl capture-node`");
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
      auto v4 = facts.ipv4_of(node.netdevs[i]);
      if (!v4.empty()) rep.links[i].ipv4 = v4[0];
    }
  }

  std::vector<std::optional<Hca>> hcas;
  check_rdma(r, facts, hcas);
  check_gid(r, facts, hcas);
  check_links(r, facts, gb10);
  auto mi_text = root.read("/proc/meminfo");
  Result<MemInfo> mi = mi_text ? parse_meminfo(*mi_text)
                               : Result<MemInfo>(make_error(Errc::io, "cannot read /proc/meminfo"));
  auto mf = node.model_path.empty() ? ModelFiles{} : read_model_files(root, node.model_path);
  check_mem(r, facts, mi, mf, gb10, gpu);
  check_sys(r, facts, mi);
  check_disk(r, facts, mf);
  check_gpu(r, gpu, gpu_error);
  check_ports(r, facts);
  check_model(r, mf);

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
