#pragma once
// Known-bad versions: kernels, NVIDIA drivers, NCCL builds and HCA firmware known to break
// rings, from a data file (env/known_bad.json, built into the binary; KNOWN_BAD_FILE adds
// entries), checked on every node by preflight's sw.known_bad.
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "env/preflight.h"

namespace spark::env {

/// One entry of the list (the format is described in env/known_bad.json's "about").
struct KnownBadEntry {
  std::string id;
  std::string component;       // "kernel", "driver", "nccl", "firmware"
  std::string versions;        // ">=7.0", ">=2.19,<2.19.4", "*"
  std::string unless_cmdline;  // a /proc/cmdline word that defuses the entry ("" = none)
  bool needs_rdma = false;
  Verdict verdict = Verdict::fail;
  std::string symptom, fix;
  std::vector<std::string> sources;
};

/// The list and where it came from (for messages).
struct KnownBadList {
  std::vector<KnownBadEntry> entries;
  std::string origin;  // "built-in", a file path
};

/// Parses the JSON list; errors name the origin, the entry and the field.
Result<KnownBadList> parse_known_bad(const std::string& text, const std::string& origin);
/// The list built into this binary (env/known_bad.json at build time).
const KnownBadList& builtin_known_bad();
/// The built-in list plus the entries of `extra_file` ("" = none), read on this host.
Result<KnownBadList> load_known_bad(const std::string& extra_file);

/// The leading dotted numbers of a version ("6.11.0-1016-nvidia" -> {6, 11, 0}); nullopt
/// when it does not start with a number.
std::optional<std::vector<long>> version_numbers(const std::string& v);
/// Whether `version` satisfies `range` (comparisons joined by ','); errors on a bad range.
Result<bool> version_matches(const std::string& version, const std::string& range);

/// What a node runs, as sw.known_bad compares it.
struct SoftwareVersions {
  std::string kernel;                                         // uname release
  std::string cmdline;                                        // /proc/cmdline
  std::string driver;                                         // NVIDIA kernel module
  std::string nccl;                                           // "2.23.4"
  std::vector<std::pair<std::string, std::string>> firmware;  // (hca, fw_ver)
  bool rdma = false;                                          // the node has HCAs configured
};

/// sw.known_bad rows for one node: a row per component (and per HCA for firmware), FAIL or
/// WARN naming the entry, its symptom, fix and source; PASS when nothing matches; SKIP when
/// the version is unknown.
std::vector<CheckResult> known_bad_checks(const KnownBadList& list, const SoftwareVersions& sw,
                                          const std::string& node);

}  // namespace spark::env
