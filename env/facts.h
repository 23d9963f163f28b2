#pragma once
// Node facts that cannot be read from files: addresses (netlink/getifaddrs), filesystem
// statistics (statvfs), uname, resource limits, the clock, whether ports can be bound,
// which model pages are in the page cache (mincore), the NCCL library (dlopen). The live
// node collects them with syscalls; a captured tree carries them as <root>/facts.json
// (schema below, documented in sparkctl-capture-node(1)), so replay needs no live node.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "env/sysroot.h"

namespace spark::env {

inline constexpr int kFactsSchema = 1;
inline constexpr uint64_t kUnlimited = UINT64_MAX;

/// One interface address.
struct IfAddr {
  std::string ifname;
  std::string family;  // "inet" or "inet6"
  std::string address;
  int prefix = 0;
};

/// statvfs of a path.
struct FsStat {
  std::string path;
  uint64_t total = 0, free = 0, avail = 0;  // bytes; avail = what a non-root user can use
  std::string error;                        // non-empty when statvfs failed
};

/// A port the ring will bind, and whether it could be bound now.
struct PortProbe {
  std::string address;
  int port = 0;
  bool free = false;
  std::string error;  // strerror of bind when not free
  /// Who listens there when it is in use and /proc lets us see it (our own processes, or
  /// any as root): pid and command line (arguments joined by spaces); 0 / "" when unknown.
  int holder_pid = 0;
  std::string holder_cmdline;
  /// RING_NAME of the cluster file that holder runs with, when it is a sparkd ("" else).
  std::string holder_ring;
};

/// How much of the model directory is in the page cache.
struct Residency {
  uint64_t total_bytes = 0;
  uint64_t resident_bytes = 0;
  int files = 0;
  std::string error;
};

/// The NCCL library the engine would load.
struct NcclLib {
  std::string path;  // "" when not found
  int version = 0;   // ncclGetVersion code (22304 = 2.23.4)
  std::string error;
};

struct NodeFacts {
  int schema = kFactsSchema;
  std::string hostname, kernel_release, machine;
  std::vector<IfAddr> addrs;
  std::optional<FsStat> model_fs;
  uint64_t memlock_soft = 0, memlock_hard = 0;  // kUnlimited for unlimited
  int64_t clock_ms = 0;                         // CLOCK_REALTIME when collected
  std::vector<PortProbe> ports;
  std::optional<Residency> residency;
  NcclLib nccl;
  std::string sparkd_version;  // first line of `SPARKD_BIN --version` ("" when it did not run)
  std::string sparkd_bin;      // the sparkd asked ("" when none was found or asked)
  std::string sparkd_error;    // why `sparkd --version` failed ("" when it ran)
  std::string sparkd_tried;    // where it was looked for, when none was found
  std::string user;
  int uid = -1;
  std::vector<std::pair<std::string, bool>> uverbs;  // /dev/infiniband/uverbs*, read+write ok
  nlohmann::json gpu;                                // the gpu probe's facts (null: none)
  nlohmann::json gpu_throttle;  // gpu.throttle's measurement (env/gpu_throttle.h; null: none)

  /// IPv4 addresses on a netdev.
  std::vector<std::string> ipv4_of(const std::string& ifname) const;
  /// The netdev holding this IPv4 ("" when none).
  std::string netdev_of(const std::string& ipv4) const;
};

/// What to collect beyond the fixed facts.
struct FactsRequest {
  std::string model_path;                          // statvfs + residency ("" to skip)
  std::vector<std::pair<std::string, int>> ports;  // (address, port) to try binding
  std::string sparkd_bin;                          // asked for --version ("" to skip)
  std::string sparkd_tried;  // where sparkd was looked for when sparkd_bin is "" (a live node)
  bool gpu_load = false;  // measure gpu.throttle: NVML under `sparkd_bin gpu-load` per GPU
  std::vector<int> gpus;  // the node's GPUS (NVML indices)
};

nlohmann::json facts_to_json(const NodeFacts& f);
Result<NodeFacts> facts_from_json(const nlohmann::json& j);
/// The live node's facts (syscalls).
NodeFacts collect_live_facts(const Sysroot& root, const FactsRequest& req);
/// Live facts for a live root, else <root>/facts.json.
Result<NodeFacts> node_facts(const Sysroot& root, const FactsRequest& req);
/// Bytes of `path`'s regular files in the page cache (mincore), per directory.
Residency page_cache_residency(const std::string& dir);
/// Realtime clock in milliseconds since the epoch.
int64_t now_ms();

}  // namespace spark::env
