#include "cli/node_exec.h"

#include <fmt/format.h>

#include <thread>

#include "core/process.h"

namespace spark::cli {

// Until the SSH runner lands (core/remote.cc, branch ssh) remote nodes report that; local
// nodes run through core/process.
std::vector<NodeResult> exec_on_nodes(const RingConfig& cfg, const std::vector<int>& nodes,
                                      const std::vector<std::string>& commands,
                                      const std::string& input, std::chrono::milliseconds timeout) {
  std::vector<NodeResult> out(nodes.size());
  std::vector<std::thread> threads;
  for (size_t k = 0; k < nodes.size(); ++k) {
    const NodeConfig& n = cfg.nodes.at(static_cast<size_t>(nodes[k]));
    out[k].node = n.name;
    if (!n.local) {
      out[k].result = make_error(Errc::unsupported,
                                 fmt::format("{}: the SSH runner is not built in this sparkctl", n.name));
      continue;
    }
    threads.emplace_back([&, k] {
      auto r = run_shell(commands.size() == 1 ? commands[0] : commands[k], timeout, input);
      if (!r) {
        out[k].result = r.error();
        return;
      }
      CommandResult c;
      c.exit_status = r->exit_status;
      c.out = std::move(r->out);
      c.err = std::move(r->err);
      c.timed_out = r->timed_out;
      c.seconds = r->seconds;
      if (c.timed_out)
        out[k].result = make_error(Errc::timeout, fmt::format("{}: no answer within {} ms", out[k].node,
                                                              timeout.count()));
      else
        out[k].result = c;
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

}  // namespace spark::cli
