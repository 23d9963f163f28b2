#include "cli/node_exec.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <memory>

#include "cli/cli.h"
#include "core/remote.h"
#include "core/strings.h"

namespace spark::cli {

std::vector<NodeRun> run_on_nodes(const RingConfig& cfg, const std::vector<NodeJob>& jobs,
                                  std::chrono::milliseconds timeout) {
  std::vector<NodeRun> out(jobs.size());
  std::vector<std::unique_ptr<Runner>> owned;
  std::vector<Runner*> runners;
  std::vector<std::string> commands, inputs;
  for (size_t k = 0; k < jobs.size(); ++k) {
    const auto& node = cfg.nodes.at(static_cast<size_t>(jobs[k].node));
    out[k].index = node.index;
    out[k].node = node.name;
    owned.push_back(make_runner(cfg, node));
    runners.push_back(owned.back().get());
    commands.push_back(jobs[k].command);
    inputs.push_back(jobs[k].input);
  }
  if (jobs.empty()) return out;
  auto results = fan_out(runners, commands, timeout, inputs);
  for (size_t k = 0; k < jobs.size(); ++k) {
    auto& r = out[k];
    if (k >= results.size()) {
      r.error = make_error(Errc::internal, fmt::format("{}: no result", r.node));
      continue;
    }
    const auto& res = results[k].result;
    if (!res) {
      r.error = res.error();
      continue;
    }
    r.exit_status = res->exit_status;
    r.out = res->out;
    r.err = res->err;
    r.seconds = res->seconds;
    if (res->timed_out)
      r.error = make_error(Errc::timeout, fmt::format("{}: `{}` did not finish within {} s", r.node,
                                                      jobs[k].command, timeout.count() / 1000));
  }
  return out;
}

std::vector<NodeJob> jobs_on(const std::vector<int>& nodes,
                             const std::vector<std::string>& commands, const std::string& input) {
  std::vector<NodeJob> jobs;
  for (size_t k = 0; k < nodes.size(); ++k)
    jobs.push_back(NodeJob{nodes[k], commands.size() == 1 ? commands[0] : commands.at(k), input});
  return jobs;
}

void forward_stderr(const NodeRun& run) {
  for (const auto& line : split_list(run.err, '\n'))
    std::fprintf(stderr, "%s: %s\n", run.node.c_str(), line.c_str());
}

std::string sparkctl_on(const RingConfig& cfg, const Context& ctx) {
  if (!cfg.get("SPARKCTL_BIN").empty()) return cfg.get("SPARKCTL_BIN");
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n > 0) return std::string(buf, static_cast<size_t>(n));
  return ctx.argv0;
}

}  // namespace spark::cli
