#include "cli/cli.h"
#include "cli/cmd_preflight.h"

namespace spark::cli {

// The command table. Add a line here for each new command (one file per command).
const std::vector<Command>& commands() {
  static const std::vector<Command> table = {
      {"help", "Show commands, or the help of one command", cmd_help},
      {"version", "Print versions of sparkctl and what it found (CUDA driver, NCCL)", cmd_version},
      {"config", "Show the resolved cluster file (config show) or validate it (config check)",
       cmd_config},
      {"preflight", "Check every node for what breaks rings (GID, pins, memory, disk, parity)",
       cmd_preflight},
      {"env", "Print a rank's engine environment (NCCL_*, GLOO_*, CUDA_VISIBLE_DEVICES)", cmd_env},
      {"plan", "Memory per rank for 1-4 nodes from the model's config.json; largest context",
       cmd_plan},
      {"capture-node", "Capture what preflight reads on this node into a replayable .tar.gz",
       cmd_capture_node},
  };
  return table;
}

}  // namespace spark::cli
