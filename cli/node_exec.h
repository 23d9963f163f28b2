#pragma once
// The one way the CLI runs something on the ring's nodes: one job (a /bin/sh command line and
// its stdin) per node, all at once through core/remote's runners and fan_out (locally for
// NODE<i>_SSH=local, over SSH otherwise), every job with a deadline.
#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/error.h"

namespace spark::cli {

struct Context;

/// One command for one node (by index). Secrets such as tokens travel in `input`, never on
/// the command line.
struct NodeJob {
  int node = 0;
  std::string command;  // for /bin/sh -c
  std::string input;    // stdin
};

/// What one job gave. A non-zero exit is not an error: it is in exit_status.
struct NodeRun {
  int index = 0;               // the node's index
  std::string node;            // its name
  std::optional<Error> error;  // not reached, or not finished in time (out/err keep what came)
  int exit_status = -1;
  std::string out, err;
  double seconds = 0;
  bool ok() const { return !error; }
};

/// Runs every job at once and waits for all; result i belongs to job i.
std::vector<NodeRun> run_on_nodes(const RingConfig& cfg, const std::vector<NodeJob>& jobs,
                                  std::chrono::milliseconds timeout);

/// Jobs that run commands[k] (or the only command) on nodes[k], each with `input`.
std::vector<NodeJob> jobs_on(const std::vector<int>& nodes,
                             const std::vector<std::string>& commands,
                             const std::string& input = {});

/// Passes a node's stderr on to ours, each line prefixed by the node's name (a node's own
/// "sparkctl: ..." lines are its diagnostics).
void forward_stderr(const NodeRun& run);

/// Path of sparkctl on the nodes: SPARKCTL_BIN, else the path of this binary.
std::string sparkctl_on(const RingConfig& cfg, const Context& ctx);

}  // namespace spark::cli
