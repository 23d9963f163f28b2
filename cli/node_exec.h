#pragma once
// Running one command on each of several nodes of the ring at once: locally for
// NODE<i>_SSH=local, over SSH otherwise. Every run has a deadline.
#include <chrono>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/remote.h"

namespace spark::cli {

/// Runs commands[k] on node nodes[k] (all at once), `input` on stdin; one NodeResult per
/// entry, in order. A node that cannot be reached gets an Error naming it.
std::vector<NodeResult> exec_on_nodes(const RingConfig& cfg, const std::vector<int>& nodes,
                                      const std::vector<std::string>& commands,
                                      const std::string& input, std::chrono::milliseconds timeout);

}  // namespace spark::cli
