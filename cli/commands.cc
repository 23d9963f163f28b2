#include "cli/cli.h"
#include "cli/cmd_demo_model.h"

namespace spark::cli {

// The command table. Add a line here for each new command (one file per command).
const std::vector<Command>& commands() {
  static const std::vector<Command> table = {
      {"help", "Show commands, or the help of one command", cmd_help},
      {"version", "Print versions of sparkctl and what it found (CUDA driver, NCCL)", cmd_version},
      {"config", "Show the resolved cluster file (config show) or validate it (config check)",
       cmd_config},
      {"demo-model", "Write a small demo checkpoint with random weights (runs without a GPU)", cmd_demo_model},
  };
  return table;
}

}  // namespace spark::cli
