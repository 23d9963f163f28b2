#include "cli/node_exec.h"

#include <fmt/format.h>

#include <memory>
#include <thread>

namespace spark::cli {

std::vector<NodeResult> exec_on_nodes(const RingConfig& cfg, const std::vector<int>& nodes,
                                      const std::vector<std::string>& commands,
                                      const std::string& input, std::chrono::milliseconds timeout) {
  if (nodes.empty()) return {};
  std::vector<std::unique_ptr<Runner>> owned;
  std::vector<Runner*> runners;
  for (int i : nodes) {
    owned.push_back(make_runner(cfg, cfg.nodes.at(static_cast<size_t>(i))));
    runners.push_back(owned.back().get());
  }
  if (input.empty()) return fan_out(runners, commands, timeout);
  // fan_out has no stdin: run each with the input on its own thread.
  std::vector<NodeResult> out(runners.size());
  std::vector<std::thread> threads;
  for (size_t k = 0; k < runners.size(); ++k)
    threads.emplace_back([&, k] {
      out[k].node = runners[k]->node();
      out[k].result =
          runners[k]->run(commands.size() == 1 ? commands[0] : commands[k], timeout, input);
    });
  for (auto& t : threads) t.join();
  return out;
}

}  // namespace spark::cli
