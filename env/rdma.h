#pragma once
// RDMA devices as the kernel shows them under /sys/class/infiniband, and the RoCE v2 GID
// resolution NCCL depends on (NCCL_IB_GID_INDEX). The right index differs per
// node and HCA and moves after a reboot; an all-zero entry kills the rank a minute in.
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "env/sysroot.h"

namespace spark::env {

/// One GID table entry: /sys/class/infiniband/<hca>/ports/<p>/gids/<i> and gid_attrs.
struct GidEntry {
  int index = 0;
  std::string raw;  // as sysfs prints it: 8 colon-separated groups of 4 hex digits
  std::array<uint8_t, 16> bytes{};
  std::string type;        // "RoCE v2", "IB/RoCE v1", "" when unreadable (empty entries)
  std::string ndev;        // gid_attrs/ndevs/<i>, "" when unreadable
  bool malformed = false;  // the file holds text that is not a GID (bytes are then zero)
  std::string path;        // node path of the gids/<i> file, for messages
  bool zero() const;
  /// True for ::ffff:a.b.c.d.
  bool ipv4_mapped() const;
  /// The IPv4 of a mapped GID as dotted quad ("" otherwise).
  std::string ipv4() const;
  /// Text form as ibv_devinfo shows it ("::ffff:10.10.2.1", "fe80::...").
  std::string text() const;
  bool roce_v2() const { return type == "RoCE v2"; }
};

/// One port of an HCA.
struct RdmaPort {
  int port = 1;
  std::string state;  // "4: ACTIVE"
  int state_code = -1;
  std::string phys_state;  // "5: LinkUp"
  int phys_state_code = -1;
  std::string link_layer;      // "Ethernet" or "InfiniBand"
  std::vector<GidEntry> gids;  // every index present, zero entries included
  const GidEntry* gid(int index) const;
};

/// One RDMA device.
struct Hca {
  std::string name;
  std::string fw_ver;                // fw_ver ("28.39.1002"), "" when unreadable
  std::vector<std::string> netdevs;  // device/net/*
  std::vector<RdmaPort> ports;
  const RdmaPort* port(int p) const;
};

/// Parses a sysfs GID ("fe80:0000:...:0201"); false when malformed.
bool parse_gid(const std::string& raw, std::array<uint8_t, 16>* out);
/// The names under /sys/class/infiniband (empty when there is none).
std::vector<std::string> list_hcas(const Sysroot& root);
/// Reads one HCA; nullopt when /sys/class/infiniband/<name> does not exist.
std::optional<Hca> read_hca(const Sysroot& root, const std::string& name);

/// What is wrong with a node's GID for one HCA port.
enum class GidFault {
  none,         // resolved (and equal to the configured index, when one is set)
  all_zero,     // the configured index holds an all-zero (or missing) entry
  roce_v1,      // the address is there only as RoCE v1 (at the configured index or anywhere)
  other_node,   // the entry holds another node's fabric address
  ipv6_only,    // only IPv6 GIDs: the netdev has no IPv4 address
  moved,        // the configured index holds another GID; ours is at a different index now
  not_found,    // no RoCE v2 GID for the fabric address at all
  other_twin,   // the entry holds the address of this node's other twin (crossed port/address)
  unparseable,  // the configured entry's file is not a GID (junk text)
};

/// Stable name of a fault ("all_zero", ...), used in JSON.
const char* gid_fault_name(GidFault f);

/// Outcome of resolve_roce_gid.
struct GidResolution {
  std::optional<int> index;       // where RoCE v2 ::ffff:<fabric ip> is (nullopt: nowhere)
  std::optional<int> configured;  // NODE<i>_GID_INDEX, nullopt = auto
  GidFault fault = GidFault::not_found;
  std::string message;  // what is wrong (or what was found)
  std::string fix;      // what to do ("" when nothing)
  bool ok() const { return fault == GidFault::none; }
  /// The index to use: the configured one when it is right, else the resolved one.
  std::optional<int> usable() const { return ok() ? index : std::nullopt; }
};

/// An IPv4 address the resolver can name when a GID holds it: another node's fabric address,
/// or one of this node's own addresses on another netdev (the other twin's).
struct KnownAddress {
  std::string ip;
  std::string node;        // the node it belongs to
  bool this_node = false;  // one of this node's addresses, on `netdev` (of `hca`, if known)
  std::string netdev, hca;
};

/// Finds the index whose GID is RoCE v2 and equals ::ffff:<fabric_ip> on `port` of `hca`;
/// when `configured` is set, verifies it and names the exact fault. `other_ips` are the
/// other nodes' fabric addresses (to say "another node's address"); `config_key` is the
/// key to name in the fix (NODE1_GID_INDEX).
GidResolution resolve_roce_gid(const Hca& hca, int port, const std::string& fabric_ip,
                               std::optional<int> configured,
                               const std::vector<std::pair<std::string, std::string>>& other_ips,
                               const std::string& config_key);
/// The same with this node's other addresses too (to say "this node's other twin").
GidResolution resolve_roce_gid(const Hca& hca, int port, const std::string& fabric_ip,
                               std::optional<int> configured,
                               const std::vector<KnownAddress>& known,
                               const std::string& config_key);

/// The GID table as `ibv_devinfo -v` would show it: non-zero entries with type and netdev.
std::string format_gid_table(const Hca& hca);

}  // namespace spark::env
