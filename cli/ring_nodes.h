#pragma once
// What sparkctl does to the ring's nodes to run sparkd: launch every rank detached from the
// SSH session (setsid, pidfile, log file), stop every rank (SIGTERM, grace, SIGKILL) and prove
// nothing is left, probe each node (rank processes, memory, GPU memory), read a rank's log,
// and fetch rank 0's /health. Each operation is one shell script per node run through the
// node's Runner (local or SSH), all nodes at once, with a deadline.
//
// Files on a node (S = STATE_DIR, or $HOME/.local/state/sparkctl/RING_NAME on that node;
// L = LOG_DIR, or S/logs):
//   S/run/ring-node<i>.env   the head's resolved cluster file, as sparkd reads it
//   S/run/sparkd-<r>.pid     rank r's sparkd pid (sparkd writes and removes it)
//   S/run/sparkd-<r>.pid.engine   the exec engine's process group (sparkd writes it)
//   L/sparkd-<r>.log         rank r's log (sparkd rotates it at start: .1 .. .3)
//   L/sparkd-<r>.out         what sparkd printed before its log opened
#include <chrono>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/error.h"

namespace spark::cli {

/// Where things are, for one ring.
struct RingLayout {
  std::string sparkd_bin;        // on the nodes (a node without it falls back to its own)
  bool sparkd_explicit = false;  // SPARKD_BIN named it: no fallback
  std::string sparkctl_bin;      // on the nodes
  std::chrono::milliseconds node_timeout{30000};
};

/// The shell prefix that sets S and L on a node (see the file comment).
std::string node_dirs_prelude(const RingConfig& cfg);

/// One rank's process as its node sees it.
struct RankProcess {
  int rank = 0;
  int pid = 0;         // from the pidfile; 0 none
  bool alive = false;  // the pid runs and is not a zombie
  int64_t uptime_s = -1;
};

/// One node's probe.
struct NodeProbe {
  std::string node;
  int index = 0;
  std::optional<Error> error;  // unreachable
  std::vector<RankProcess> ranks;
  int64_t mem_free = -1, mem_available = -1, mem_total = -1;  // bytes; -1 unknown
  std::vector<std::pair<int64_t, int64_t>> gpu_mem_mib;       // used, total per GPU; empty: unknown
};

/// Probes every node at once.
std::vector<NodeProbe> probe_nodes(const RingConfig& cfg, const RingLayout& lay);

/// Per-rank launch outcome.
struct LaunchResult {
  int rank = 0;
  std::string node;
  int pid = 0;
  std::string error;  // empty: launched
};
/// Launches every rank on every node (rank environment in `rank_env[r]`); the config text is
/// the head's resolved cluster file. Returns one entry per rank.
std::vector<LaunchResult> launch_ranks(
    const RingConfig& cfg, const RingLayout& lay, const std::string& config_text,
    const std::vector<std::vector<std::pair<std::string, std::string>>>& rank_env);

/// Per-rank stop outcome.
struct StopResult {
  int rank = 0;
  std::string node;
  int pid = 0;                    // 0: nothing was running
  std::string how;                // none, sigterm, sigkill
  std::vector<std::string> left;  // what is still running (must be empty)
  std::string error;              // node unreachable
};
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

/// Runs `command` on every node given (index list), `input` on stdin; outputs by node.
struct NodeRun {
  int index = 0;
  std::string node;
  std::optional<Error> error;
  int exit_status = -1;
  std::string out, err;
};
std::vector<NodeRun> run_on(const RingConfig& cfg, const std::vector<int>& nodes,
                            const std::vector<std::string>& commands, const std::string& input,
                            std::chrono::milliseconds timeout);

/// The node index and local position of rank r.
RankPlace place_of(const RingConfig& cfg, int rank);

}  // namespace spark::cli
