#pragma once
// Network devices under /sys/class/net: operstate, speed, MTU.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "env/sysroot.h"

namespace spark::env {

/// One netdev as /sys/class/net/<name> shows it.
struct NetDev {
  std::string name;
  bool exists = false;
  std::string operstate;              // "up", "down", "unknown", ...
  std::optional<int64_t> speed_mbps;  // nullopt when unreadable (down links answer EINVAL)
  std::optional<int> mtu;
};

/// Reads /sys/class/net/<name>.
NetDev read_netdev(const Sysroot& root, const std::string& name);

/// 169.254.0.0/16: an address the kernel or avahi made up, never a fabric address.
bool ipv4_link_local(std::string_view ip);
/// True when both parse and agree in the first `prefix` bits.
bool ipv4_same_subnet(std::string_view a, std::string_view b, int prefix);
/// The command that takes `from` off `from_dev` and puts `to` on `to_dev` (one of them may
/// be empty: only the other half), with the prefix each has.
std::string ip_addr_move(const std::string& from, int from_prefix, const std::string& from_dev,
                         const std::string& to, int to_prefix, const std::string& to_dev);

}  // namespace spark::env
