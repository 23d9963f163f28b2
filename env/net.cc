#include "env/net.h"

#include <fmt/format.h>

#include "core/strings.h"

namespace spark::env {

NetDev read_netdev(const Sysroot& root, const std::string& name) {
  NetDev d;
  d.name = name;
  std::string base = "/sys/class/net/" + name;
  d.exists = root.exists(base);
  if (!d.exists) return d;
  d.operstate = root.read_line(base + "/operstate").value_or("");
  if (auto s = root.read_line(base + "/speed"))
    if (auto v = parse_i64(*s); v && *v > 0) d.speed_mbps = *v;
  if (auto m = root.read_line(base + "/mtu"))
    if (auto v = parse_u64(*m)) d.mtu = static_cast<int>(*v);
  return d;
}

bool ipv4_link_local(std::string_view ip) {
  auto v = parse_ipv4(ip);
  return v && (*v >> 16) == 0xA9FE;
}

bool ipv4_same_subnet(std::string_view a, std::string_view b, int prefix) {
  auto x = parse_ipv4(a), y = parse_ipv4(b);
  if (!x || !y || prefix < 0 || prefix > 32) return false;
  uint32_t mask = prefix == 0 ? 0 : ~uint32_t{0} << (32 - prefix);
  return (*x & mask) == (*y & mask);
}

std::string ip_addr_move(const std::string& from, int from_prefix, const std::string& from_dev,
                         const std::string& to, int to_prefix, const std::string& to_dev) {
  std::vector<std::string> parts;
  if (!from.empty())
    parts.push_back(fmt::format("sudo ip addr del {}/{} dev {}", from, from_prefix, from_dev));
  if (!to.empty())
    parts.push_back(fmt::format("sudo ip addr add {}/{} dev {}", to, to_prefix, to_dev));
  return "`" + join(parts, " && ") + "`";
}

}  // namespace spark::env
