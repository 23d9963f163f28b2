#pragma once
// What sparkctl does to the ring's nodes to run sparkd, from the head: probe, launch and stop
// every node's ranks through the typed `sparkctl --config - node probe|launch|stop` on each
// node (cli/node_ops.h, JSON replies; locally for a local node, over SSH otherwise), all
// nodes at once with a deadline; read or follow a rank's log; fetch rank 0's /health.
#include <chrono>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cli/node_ops.h"
#include "core/config.h"
#include "core/error.h"

namespace spark::cli {

/// Where things are, for one ring.
struct RingLayout {
  std::string sparkd_bin;    // on the nodes
  std::string sparkctl_bin;  // on the nodes
  std::chrono::milliseconds node_timeout{30000};
};

/// The shell prefix that sets S and L on a node (cli/node_ops.h), for the log commands.
std::string node_dirs_prelude(const RingConfig& cfg);

/// Probes every node at once.
std::vector<NodeProbe> probe_nodes(const RingConfig& cfg, const RingLayout& lay);

/// Launches every rank on every node (rank environment in `rank_env[r]`); the config text is
/// the head's resolved cluster file. Returns one entry per rank.
std::vector<LaunchResult> launch_ranks(
    const RingConfig& cfg, const RingLayout& lay, const std::string& config_text,
    const std::vector<std::vector<std::pair<std::string, std::string>>>& rank_env);

/// SIGTERM to every rank, up to `grace`, then SIGKILL to the rank and its engine's process
/// group; then proves that no process of the ring is left on any node.
std::vector<StopResult> stop_ranks(const RingConfig& cfg, const RingLayout& lay,
                                   std::chrono::milliseconds grace);

/// The last `lines` lines of rank r's log (from its node).
Result<std::string> read_rank_log(const RingConfig& cfg, const RingLayout& lay, int rank,
                                  int lines);
/// The command that follows rank r's log (tail -F) on its node.
std::string follow_log_command(const RingConfig& cfg, int rank, int lines);

/// GET rank 0's /health: directly when node 0 is this machine, else through node 0's runner
/// (sparkctl health-get there). nullopt body + error when it does not answer.
Result<nlohmann::json> fetch_health(const RingConfig& cfg, const RingLayout& lay,
                                    std::chrono::milliseconds timeout);

/// The node index and local position of rank r.
RankPlace place_of(const RingConfig& cfg, int rank);

}  // namespace spark::cli
