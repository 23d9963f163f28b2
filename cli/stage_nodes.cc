#include "cli/stage_nodes.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <thread>

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
  int in[2], out[2];
  if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0)
    return make_error(Errc::io, fmt::format("pipe: {}", std::strerror(errno)));
  pid_t pid = ::fork();
  if (pid < 0) return make_error(Errc::io, fmt::format("fork: {}", std::strerror(errno)));
  if (pid == 0) {
    ::dup2(in[0], 0);
    ::dup2(out[1], 1);
    ::execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(in[0]);
  ::close(out[1]);
  // The input is small (a token, a few lines): it fits in the pipe buffer.
  ::signal(SIGPIPE, SIG_IGN);
  if (!input.empty()) (void)!::write(in[1], input.data(), input.size());
  ::close(in[1]);
  LocalRun r;
  auto deadline = std::chrono::steady_clock::now() + timeout;
  char buf[4096];
  bool timed_out = false;
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    pollfd p{out[0], POLLIN, 0};
    int n = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), INT_MAX)));
    if (n < 0 && errno == EINTR) continue;
    if (n == 0) continue;
    ssize_t k = ::read(out[0], buf, sizeof buf);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) break;
    r.out.append(buf, static_cast<size_t>(k));
  }
  ::close(out[0]);
  if (timed_out) ::kill(pid, SIGKILL);
  int st = 0;
  while (::waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  if (timed_out)
    return make_error(Errc::timeout, fmt::format("{}: `{}` did not finish within {} s", who,
                                                 command, timeout.count() / 1000));
  r.exit_status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

std::string sparkctl_on(const RingConfig& cfg, const Context& ctx) {
  if (!cfg.get("SPARKCTL_BIN").empty()) return cfg.get("SPARKCTL_BIN");
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n > 0) return std::string(buf, static_cast<size_t>(n));
  return ctx.argv0;
}

std::vector<Result<LocalRun>> run_on_nodes(const RingConfig& /*cfg*/,
                                           const std::vector<NodeJob>& jobs,
                                           std::chrono::milliseconds timeout) {
  std::vector<Result<LocalRun>> out(jobs.size(),
                                    Result<LocalRun>(make_error(Errc::internal, "not run")));
  std::vector<std::thread> th;
  for (size_t i = 0; i < jobs.size(); ++i)
    th.emplace_back([&, i] {
      const auto& j = jobs[i];
      if (j.node->local) {
        out[i] = run_local(j.command, j.input, timeout, j.node->name);
        return;
      }
      out[i] =
          make_error(Errc::unsupported, fmt::format("{}: reaching {} over SSH needs the SSH runner "
                                                    "(core/remote.cc), not in this build",
                                                    j.node->name, j.node->ssh));
    });
  for (auto& t : th) t.join();
  return out;
}

}  // namespace spark::cli
