#pragma once
// sparkctl bundle: one .tar.gz for a bug report, from every node of the ring at once. Each
// node answers `sparkctl --config - bundle --local --node N` with one JSON document (its
// capture as base64, preflight report, versions, log tails, kernel log tail, health
// history), already redacted there so no secret leaves the node; the head adds the
// resolved cluster file (redacted), a per-node diff of the fields that must match across
// the ring (SUMMARY.txt, the archive's first member) and names every node it could not
// reach. Layout of the archive (BASE = sparkctl-bundle-RING-UTCSTAMP):
//   BASE/SUMMARY.txt                    nodes reached or not, the diff, where things are
//   BASE/bundle.json                    the same as JSON (schema 1)
//   BASE/cluster.env                    the head's resolved cluster file, secrets redacted
//   BASE/head.json                      the head's sparkctl version and host
//   BASE/nodes/NODE/versions.json       kernel, command line, OS, driver, CUDA, NCCL, HCA
//                                       firmware, BIOS, engine command and binary digests
//   BASE/nodes/NODE/preflight.json      that node's preflight report (node checks)
//   BASE/nodes/NODE/capture.tar.gz      what preflight reads (replay: preflight --sysroot)
//   BASE/nodes/NODE/logs/*.log          tails of sparkd's and the engine's logs
//   BASE/nodes/NODE/kernel.log          tail of the kernel log, or why it is not readable
//   BASE/nodes/NODE/history.json        the node's health history (when it has one)
//   BASE/nodes/NODE/ERROR.txt           only for a node that gave nothing: why
#include <chrono>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/cli.h"
#include "core/config.h"
#include "core/error.h"

namespace spark::cli {

/// What goes into a bundle and how long the nodes have.
struct BundleOptions {
  int log_lines = 500;     // per log file
  int kernel_lines = 500;  // of the kernel log
  std::chrono::milliseconds timeout{180000};
  std::string sparkctl_bin;  // on the nodes
  std::string out;           // archive path; empty: BASE.tar.gz in the current directory
};

/// The secrets this side knows by value: values of settings named like a secret, the secrets
/// command lines in the settings spell out, and the API key in API_KEY_FILE when readable.
std::vector<std::string> known_secrets(const RingConfig& cfg);

/// The resolved cluster file as the wire text, every secret replaced by [REDACTED].
std::string redacted_config_text(const RingConfig& cfg);

/// On this machine, as node `node`: the node's half of the bundle (see the file comment).
nlohmann::json collect_node_bundle(const RingConfig& cfg, int node, const BundleOptions& opt);

/// One field that must match across the ring, per node ("" where the node did not say).
struct FieldDiff {
  std::string field;
  std::vector<std::string> values;  // one per node answered, in node order
  bool differs = false;
};
/// The fields that must match (software identity, kernel and its command line without
/// per-host tokens, OS, HCA firmware, BIOS, engine binaries), compared over the nodes'
/// bundle documents; `names` are the nodes' names, in the same order.
std::vector<FieldDiff> diff_nodes(const std::vector<nlohmann::json>& docs);

/// What the head's bundle run gave.
struct BundleReport {
  std::string archive;  // path written; empty when nothing was written
  std::vector<std::string> nodes;
  std::vector<std::string> missing;  // "node1: why" for each node that gave nothing
  std::vector<FieldDiff> diff;
  std::string engine_current, engine_last_good;  // the engine sets start recorded (engine_pin.h)
  std::optional<Error> error;                    // the archive could not be written
};

/// Asks every node at once, writes the archive (never a half archive under its name).
BundleReport make_bundle(const RingConfig& cfg, const BundleOptions& opt);

nlohmann::json to_json(const BundleReport& r);
/// The SUMMARY.txt text of a bundle.
std::string summary_text(const RingConfig& cfg, const BundleReport& r, const std::string& when);

/// sparkctl bundle (and its node half, bundle --local).
int cmd_bundle(Context& ctx, const std::vector<std::string>& args);

}  // namespace spark::cli
