#include "env/net.h"

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

}  // namespace spark::env
