// Hardware tier, RDMA: the GID resolution on a live node's HCAs against what ibv_devinfo -v
// shows, and a live preflight --local with those HCAs configured. Prints "SKIP: <reason>"
// and returns on a machine without RDMA devices.
#include "env/rdma.h"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <iostream>

#include "core/process.h"
#include "core/strings.h"
#include "env/facts.h"
#include "env/preflight.h"

using namespace spark;
using namespace spark::env;

namespace {

// Every (HCA, its netdev, that netdev's IPv4) on this node with an Ethernet port 1.
struct LiveLink {
  Hca hca;
  std::string netdev, ipv4;
};

std::vector<LiveLink> live_links(std::string* why) {
  Sysroot root("/");
  auto names = list_hcas(root);
  if (names.empty()) {
    *why = "no RDMA device under /sys/class/infiniband";
    return {};
  }
  auto facts = collect_live_facts(root, {});
  std::vector<LiveLink> out;
  for (const auto& n : names) {
    auto h = read_hca(root, n);
    if (!h || h->netdevs.empty() || !h->port(1) || h->port(1)->link_layer != "Ethernet") continue;
    auto v4 = facts.ipv4_of(h->netdevs[0]);
    if (v4.empty()) continue;
    out.push_back({*h, h->netdevs[0], v4[0]});
  }
  if (out.empty()) *why = "no RoCE HCA whose netdev has an IPv4 address";
  return out;
}

}  // namespace

TEST_CASE("hw: resolve_roce_gid finds the RoCE v2 GID that ibv_devinfo shows for the address") {
  std::string why;
  auto links = live_links(&why);
  if (links.empty()) {
    MESSAGE("SKIP: " << why);
    std::cout << "SKIP: " << why << "\n";
    return;
  }
  for (const auto& l : links) {
    auto r = resolve_roce_gid(l.hca, 1, l.ipv4, std::nullopt, std::vector<KnownAddress>{},
                              "NODE0_GID_INDEX");
    std::cout << "# " << format_gid_table(l.hca) << "# " << r.message << "\n";
    REQUIRE_MESSAGE(r.ok(), r.message);
    auto dev = run_process(
        ProcessSpec{{"ibv_devinfo", "-v", "-d", l.hca.name}, {}, {}, {}, std::chrono::seconds(20)});
    if (!dev || !dev->success()) {
      MESSAGE("ibv_devinfo not usable here; resolution checked against sysfs only");
      continue;
    }
    // ibv_devinfo prints "GID[  3]:		::ffff:10.10.2.1, RoCE v2".
    bool seen = false;
    for (const auto& line : split_list(dev->out, '\n'))
      if (line.find(fmt::format("GID[{:3}]:", *r.index)) != std::string::npos)
        seen = line.find("::ffff:" + l.ipv4) != std::string::npos &&
               line.find("RoCE v2") != std::string::npos;
    CHECK_MESSAGE(
        seen, "ibv_devinfo does not show ::ffff:" << l.ipv4 << " RoCE v2 at index " << *r.index);
  }
}

TEST_CASE("hw: a live preflight --local with this node's HCAs resolves every GID") {
  std::string why;
  auto links = live_links(&why);
  if (links.empty()) {
    MESSAGE("SKIP: " << why);
    std::cout << "SKIP: " << why << "\n";
    return;
  }
  std::vector<std::string> hcas, netdevs;
  for (const auto& l : links) {
    hcas.push_back(l.hca.name);
    netdevs.push_back(l.netdev);
  }
  auto cfg = load_config_text(
      fmt::format("NODE0_SSH=local\nNODE0_FABRIC_IP={}\nNODE0_HCAS={}\nNODE0_NETDEVS={}\n",
                  links[0].ipv4, join(hcas, ","), join(netdevs, ",")),
      "hw.env", Environment{}, nullptr);
  REQUIRE_MESSAGE(cfg.ok(), cfg.error().message);
  CheckFilter only;
  only.only = {"rdma"};
  auto rep = run_node_checks(*cfg, 0, Sysroot("/"), only, true);
  RingReport r;
  add_checks(&r, rep.checks);
  r.nodes.push_back(rep);
  std::cout << format_report_table(r, true);
  for (size_t i = 0; i < links.size(); ++i) CHECK(rep.links[i].gid_index.has_value());
}
