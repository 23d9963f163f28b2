#include "env/rank_env.h"

#include <fmt/format.h>

#include "core/strings.h"

namespace spark::env {

std::string RankEnv::get(const std::string& name) const {
  for (const auto& [k, v] : vars)
    if (k == name) return v;
  return "";
}

std::string RankEnv::to_shell() const {
  std::string out;
  for (const auto& [k, v] : vars) {
    std::string q;
    for (char c : v) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    out += fmt::format("export {}='{}'\n", k, q);
  }
  return out;
}

Result<RankEnv> render_rank_env(const RingConfig& cfg, int rank, const NodeReport& report) {
  auto ranks = cfg.ranks();
  if (rank < 0 || rank >= static_cast<int>(ranks.size()))
    return make_error(Errc::usage, fmt::format("rank {} does not exist: the ring has ranks 0-{}",
                                               rank, static_cast<int>(ranks.size()) - 1));
  const RankPlace& place = ranks[static_cast<size_t>(rank)];
  const NodeConfig& node = cfg.nodes[static_cast<size_t>(place.node)];
  if (report.index != node.index)
    return make_error(Errc::internal, fmt::format("rank {} runs on {}, but the facts are of {}",
                                                  rank, node.name, report.node));
  RankEnv e;
  e.rank = rank;
  e.node = node.name;
  auto set = [&](const std::string& k, const std::string& v) { e.vars.emplace_back(k, v); };
  const NodeConfig& head = cfg.nodes.front();

  set("RANK", std::to_string(rank));
  set("WORLD_SIZE", std::to_string(ranks.size()));
  set("LOCAL_RANK", std::to_string(place.local_rank));
  set("LOCAL_WORLD_SIZE", std::to_string(node.gpus.size()));
  set("MASTER_ADDR", head.fabric_ip);
  set("MASTER_PORT", cfg.get("RDZV_PORT"));
  set("CUDA_VISIBLE_DEVICES", std::to_string(place.gpu));

  // The socket interface is the netdev that holds the fabric address (NCCL cannot use
  // loopback aliases; without a pin ncclCommInitRank can hang on the wrong interface).
  std::string ifname;
  for (const auto& l : report.links)
    if (!l.netdev.empty() && l.ipv4 == node.fabric_ip) ifname = l.netdev;
  if (ifname.empty() && !node.netdevs.empty()) {
    return make_error(
        Errc::precondition,
        fmt::format("{}: FABRIC_IP {} is on none of {} — run `sparkctl preflight` "
                    "(rdma.netdev) and fix NODE{}_NETDEVS or NODE{}_FABRIC_IP",
                    node.name, node.fabric_ip, join(node.netdevs, ", "), node.index, node.index));
  }
  if (ifname.empty()) {
    if (auto ip = parse_ipv4(node.fabric_ip); ip && (*ip >> 24) == 127)
      ifname = "lo";
    else
      return make_error(Errc::config, fmt::format("{}: set NODE{}_NETDEVS to the netdev holding {}",
                                                  node.name, node.index, node.fabric_ip));
  }
  set("NCCL_SOCKET_IFNAME", "=" + ifname);
  set("GLOO_SOCKET_IFNAME", ifname);

  if (!node.hcas.empty()) {
    std::vector<std::string> hcas;
    std::optional<int> gid;
    for (size_t i = 0; i < node.hcas.size(); ++i) {
      const LinkFacts* l = i < report.links.size() ? &report.links[i] : nullptr;
      // A twin whose port is not ACTIVE still has a GID table; NCCL would pick the dead port
      // (start refuses through preflight's rdma.port; so does every rank environment).
      if (l && !l->port_state.empty() && !starts_with(l->port_state, "4")) {
        std::vector<std::string> keep_h, keep_d;
        for (size_t j = 0; j < node.hcas.size(); ++j)
          if (j != i) {
            keep_h.push_back(node.hcas[j]);
            if (j < node.netdevs.size()) keep_d.push_back(node.netdevs[j]);
          }
        std::string without =
            keep_h.empty() || keep_d.size() != keep_h.size()
                ? ""
                : fmt::format(
                      ", or use the other twin alone: set NODE{}_HCAS={} and "
                      "NODE{}_NETDEVS={}",
                      node.index, join(keep_h, ","), node.index, join(keep_d, ","));
        return make_error(
            Errc::precondition,
            fmt::format("{} {}: port 1 is {}, not 4: ACTIVE; refusing to put it in NCCL_IB_HCA "
                        "(see `sparkctl preflight --only rdma.port`). Fix the link (the cable, "
                        "the peer, `ip link set {} up`){}",
                        node.name, node.hcas[i], l->port_state,
                        l->netdev.empty() ? "<netdev>" : l->netdev, without));
      }
      if (!l || !l->gid_index)
        return make_error(Errc::precondition,
                          fmt::format("{} {}: no usable RoCE v2 GID index (run `sparkctl preflight "
                                      "--only rdma`); refusing to render NCCL_IB_GID_INDEX, which "
                                      "NCCL would read as 0",
                                      node.name, node.hcas[i]));
      if (gid && *gid != *l->gid_index)
        return make_error(Errc::precondition,
                          fmt::format("{}: {} has RoCE v2 at GID index {} but {} at {}; "
                                      "NCCL_IB_GID_INDEX is one value per process",
                                      node.name, node.hcas[0], *gid, node.hcas[i], *l->gid_index));
      gid = l->gid_index;
      hcas.push_back(node.hcas[i] + ":1");
    }
    set("NCCL_IB_DISABLE", "0");
    set("NCCL_IB_HCA", "=" + join(hcas, ","));
    set("NCCL_IB_GID_INDEX", std::to_string(*gid));
  } else {
    set("NCCL_IB_DISABLE", "1");
  }
  // NVLink multicast needs NVSwitch and, on shared hosts, can take the GPUs out of service:
  // off unless the cluster file says otherwise, and never where it cannot exist.
  const bool nvls = cfg.get_bool("NVLS_ENABLE") && node.gpus.size() > 1 &&
                    report.gpu_name.find("GB10") == std::string::npos;
  set("NCCL_NVLS_ENABLE", nvls ? "1" : "0");
  set("SPARK_NODE", node.name);
  set("SPARK_CONFIG_DIGEST", cfg.digest());
  return e;
}

}  // namespace spark::env
