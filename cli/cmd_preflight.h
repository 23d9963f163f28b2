#pragma once
// sparkctl preflight, env, plan, capture-node: the commands over the node probes (env/).
#include <string>
#include <vector>

#include "cli/cli.h"
#include "env/preflight.h"

namespace spark::cli {

int cmd_preflight(Context& ctx, const std::vector<std::string>& args);
int cmd_env(Context& ctx, const std::vector<std::string>& args);
int cmd_plan(Context& ctx, const std::vector<std::string>& args);
int cmd_capture_node(Context& ctx, const std::vector<std::string>& args);

/// The cluster file as sent to a node (`sparkctl --config - ...` reads it on stdin): every
/// resolved key, double-quoted, so the node resolves exactly what the head resolved.
std::string config_wire_text(const RingConfig& cfg);
/// Which node of the ring this machine is: --node, else the hostname, else the one local node.
Result<int> this_node(const RingConfig& cfg, int requested);

/// Checks a --sysroot directory: it must be a directory; a missing one or a symlink loop
/// (ELOOP) is named with the path (Errc::not_found: the input-error exit code).
Status check_sysroot_dir(const std::string& path);

/// Options of a ring-wide preflight run.
struct PreflightRun {
  env::CheckFilter filter;
  bool verbose = false;
  bool bandwidth = false;
  double bw_seconds = 2.0;
  std::string sparkctl_bin;  // on the nodes
  std::chrono::milliseconds timeout{30000};
};
/// Runs node checks on every node at once (the local node in-process, the others over SSH),
/// merges them, then the cross-node checks, the pings and (opt-in) the bandwidth test.
env::RingReport run_ring_preflight(const RingConfig& cfg, const PreflightRun& opt);
/// The node reports alone (what `env --rank` needs), index -> report or error.
std::vector<env::NodeOutcome> collect_node_reports(const RingConfig& cfg, const PreflightRun& opt,
                                                   const std::vector<int>& nodes);

}  // namespace spark::cli
