#pragma once
// What sparkctl does on one node of the ring to run sparkd, as typed operations in this
// process: probe the node's ranks (pidfiles, processes, memory, GPU memory), launch its ranks
// detached (setsid, double fork, pidfile, log file), and stop them (SIGTERM, grace, SIGKILL,
// the engine's process group, strays found by their --config path) proving that nothing is
// left. The head runs them on every node as `sparkctl --config - node probe|launch|stop
// --node N` (the resolved cluster file on stdin) and reads their JSON replies.
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
#include <utility>
#include <vector>

#include "core/config.h"
#include "core/error.h"

namespace spark::cli {

/// S and L of the file comment, on this node.
struct NodeDirs {
  std::string state;  // S
  std::string log;    // L
};
NodeDirs node_dirs(const RingConfig& cfg);
/// S/run/sparkd-<rank>.pid
std::string pidfile_path(const NodeDirs& d, int rank);
/// The ranks the cluster file places on node `node`.
std::vector<int> ranks_of_node(const RingConfig& cfg, int node);

/// One rank's process as its node sees it.
struct RankProcess {
  int rank = 0;
  int pid = 0;         // from the pidfile; 0 none
  bool alive = false;  // the pid runs, is not a zombie, and is that rank's sparkd
  int64_t uptime_s = -1;
};

/// One node's probe.
struct NodeProbe {
  std::string node;
  int index = 0;
  std::optional<Error> error;  // unreachable, or no answer
  std::vector<RankProcess> ranks;
  int64_t mem_free = -1, mem_available = -1, mem_total = -1;  // bytes; -1 unknown
  std::vector<std::pair<int64_t, int64_t>> gpu_mem_mib;       // used, total per GPU; empty: unknown
};

/// Per-rank launch outcome.
struct LaunchResult {
  int rank = 0;
  std::string node;
  int pid = 0;
  std::string error;  // empty: launched
};

/// Per-rank stop outcome.
struct StopResult {
  int rank = 0;
  std::string node;
  int pid = 0;                    // 0: nothing was running
  std::string how = "none";       // none, sigterm, sigkill[ (engine group)]
  std::vector<std::string> left;  // what is still running (must be empty)
  std::string error;              // node unreachable
};

/// Rank environments: rank -> variables for its sparkd.
using RankEnv = std::map<int, std::vector<std::pair<std::string, std::string>>>;

/// On this machine, as node `node`: its ranks' processes, memory and GPU memory.
NodeProbe probe_here(const RingConfig& cfg, int node);
/// On this machine, as node `node`: writes `config_text` to S/run/ring-node<node>.env and
/// starts each rank that is not already running, waiting (10 s at most) until each wrote its
/// pidfile or exited. One entry per rank of the node.
std::vector<LaunchResult> launch_here(const RingConfig& cfg, int node,
                                      const std::string& config_text, const std::string& sparkd_bin,
                                      const RankEnv& env);
/// On this machine, as node `node`: SIGTERM to every rank, up to `grace`, then SIGKILL to the
/// rank and its engine's process group and to any sparkd of this node's cluster file that
/// no pidfile names; then lists what is still running. One entry per rank of the node.
std::vector<StopResult> stop_here(const RingConfig& cfg, int node, std::chrono::milliseconds grace);

nlohmann::json to_json(const NodeProbe& p);
NodeProbe probe_from_json(const nlohmann::json& j);
nlohmann::json to_json(const std::vector<LaunchResult>& v);
std::vector<LaunchResult> launches_from_json(const nlohmann::json& j);
nlohmann::json to_json(const std::vector<StopResult>& v);
std::vector<StopResult> stops_from_json(const nlohmann::json& j);

}  // namespace spark::cli
