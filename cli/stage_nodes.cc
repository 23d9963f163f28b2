#include "cli/stage_nodes.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <thread>

#include "core/process.h"
#include "core/remote.h"
#include "core/strings.h"

namespace spark::cli {

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'')
      out += "'\\''";
    else
      out += c;
  }
  return out + "'";
}

Result<LocalRun> run_local(const std::string& command, const std::string& input,
                           std::chrono::milliseconds timeout, const std::string& who) {
  auto r = run_shell(command, timeout, input);
  if (!r) return r.error();
  if (r->timed_out)
    return make_error(Errc::timeout, fmt::format("{}: `{}` did not finish within {} s", who,
                                                 command, timeout.count() / 1000));
  if (!r->err.empty()) std::fputs(r->err.c_str(), stderr);
  return LocalRun{r->exit_status, r->out};
}

std::string sparkctl_on(const RingConfig& cfg, const Context& ctx) {
  if (!cfg.get("SPARKCTL_BIN").empty()) return cfg.get("SPARKCTL_BIN");
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n > 0) return std::string(buf, static_cast<size_t>(n));
  return ctx.argv0;
}

std::vector<Result<LocalRun>> run_on_nodes(const RingConfig& cfg, const std::vector<NodeJob>& jobs,
                                           std::chrono::milliseconds timeout) {
  std::vector<Result<LocalRun>> out(jobs.size(),
                                    Result<LocalRun>(make_error(Errc::internal, "not run")));
  std::vector<std::thread> th;
  for (size_t i = 0; i < jobs.size(); ++i)
    th.emplace_back([&, i] {
      const auto& j = jobs[i];
      auto runner = make_runner(cfg, *j.node);
      auto r = runner->run(j.command, timeout, j.input);
      if (!r) {
        out[i] = r.error();
        return;
      }
      if (r->timed_out) {
        out[i] =
            make_error(Errc::timeout, fmt::format("{}: `{}` did not finish within {} s",
                                                  j.node->name, j.command, timeout.count() / 1000));
        return;
      }
      // The node's stderr carries its own "sparkctl: ..." lines: pass them on, named.
      for (const auto& line : split_list(r->err, '\n'))
        std::fprintf(stderr, "%s: %s\n", j.node->name.c_str(), line.c_str());
      out[i] = LocalRun{r->exit_status, r->out};
    });
  for (auto& t : th) t.join();
  return out;
}

}  // namespace spark::cli
