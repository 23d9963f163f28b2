#pragma once
// capture-node: run the probes on the live node with a recording Sysroot, then copy exactly
// what they read (files as they are, directories, model shards as sparse files of the right
// size) plus facts.json into a tree that `--sysroot` replays.
#include <string>

#include "core/config.h"
#include "core/error.h"

namespace spark::env {

/// What a capture holds.
struct CaptureSummary {
  int files = 0, dirs = 0, sized = 0;
};

/// Captures node `node_index` of `cfg` (or, with cfg == nullptr, every HCA and netdev the node
/// has) from `live_root` ("/" on a real node) into the directory `out_dir`. `gpu_load`: run
/// gpu.throttle's load (false where the GPUs may be serving: the bundle).
Result<CaptureSummary> capture_node_tree(const RingConfig* cfg, int node_index,
                                         const std::string& live_root, const std::string& out_dir,
                                         bool gpu_load = true);

}  // namespace spark::env
