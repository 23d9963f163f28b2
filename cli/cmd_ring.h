#pragma once
// sparkctl start | stop | restart | status | watch | logs: the ring's lifecycle commands
// (logic in cli/ring_ops.h), and the internal health-get that fetches rank 0's /health on
// node 0 when the head cannot reach it directly, and the internal node probe|launch|stop
// that the lifecycle commands run on every node.
#include <string>
#include <vector>

#include "cli/cli.h"

namespace spark::cli {

int cmd_start(Context& ctx, const std::vector<std::string>& args);
int cmd_stop(Context& ctx, const std::vector<std::string>& args);
int cmd_restart(Context& ctx, const std::vector<std::string>& args);
int cmd_status(Context& ctx, const std::vector<std::string>& args);
int cmd_watch(Context& ctx, const std::vector<std::string>& args);
int cmd_logs(Context& ctx, const std::vector<std::string>& args);
int cmd_health_get(Context& ctx, const std::vector<std::string>& args);
/// The typed operations the head runs on each node (cli/node_ops.h).
int cmd_node(Context& ctx, const std::vector<std::string>& args);

}  // namespace spark::cli
