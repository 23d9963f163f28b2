#pragma once
// Network devices under /sys/class/net: operstate, speed, MTU.
#include <cstdint>
#include <optional>
#include <string>

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

}  // namespace spark::env
