#pragma once
// Running sparkctl's helper commands on the ring's nodes (locally for a node that is this
// machine, over SSH otherwise), all nodes at once, each with a deadline.
#include <chrono>
#include <string>
#include <vector>

#include "cli/cli.h"
#include "cli/cmd_stage.h"
#include "core/config.h"

namespace spark::cli {

/// One command for one node.
struct NodeJob {
  const NodeConfig* node = nullptr;
  std::string command;  // for /bin/sh -c
  std::string input;    // stdin (tokens travel here, never on the command line)
};

/// Runs every job at once; result i belongs to job i. A non-zero exit is not an error.
std::vector<Result<LocalRun>> run_on_nodes(const RingConfig& cfg, const std::vector<NodeJob>& jobs,
                                           std::chrono::milliseconds timeout);

/// Path of sparkctl on the nodes: SPARKCTL_BIN, else the path of this binary.
std::string sparkctl_on(const RingConfig& cfg, const Context& ctx);

}  // namespace spark::cli
