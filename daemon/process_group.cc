#include "daemon/process_group.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include "core/process.h"

#include "core/strings.h"

extern char** environ;

namespace spark::daemon {

Result<pid_t> spawn_shell_group(const std::string& command,
                                const std::map<std::string, std::string>& env,
                                const std::string& log_path) {
  std::map<std::string, std::string> full;
  for (char** e = environ; *e; ++e) {
    std::string s = *e;
    auto eq = s.find('=');
    if (eq != std::string::npos) full[s.substr(0, eq)] = s.substr(eq + 1);
  }
  for (const auto& [k, v] : env) full[k] = v;
  std::vector<std::string> envs;
  for (const auto& [k, v] : full) envs.push_back(k + "=" + v);
  std::vector<char*> cenv;
  for (auto& e : envs) cenv.push_back(e.data());
  cenv.push_back(nullptr);
  int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0)
    return make_error(Errc::io, "cannot open engine log " + log_path + ": " + std::strerror(errno));
  int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  // posix_spawn, not fork: the child never runs this process's signal handlers or atfork
  // handlers (a SIGTERM that reaches the group between fork and exec would otherwise run an
  // inherited handler in a child that cannot safely take locks), and its own process group,
  // default dispositions and an empty signal mask are set before exec in one step.
  posix_spawnattr_t attr;
  init_spawn_attr_own_group(&attr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  if (devnull >= 0) posix_spawn_file_actions_adddup2(&fa, devnull, 0);
  posix_spawn_file_actions_adddup2(&fa, fd, 1);
  posix_spawn_file_actions_adddup2(&fa, fd, 2);
  std::string cmd = command;
  const char* argv[] = {"/bin/sh", "-c", cmd.c_str(), nullptr};
  pid_t pid = -1;
  int rc = ::posix_spawn(&pid, "/bin/sh", &fa, &attr, const_cast<char* const*>(argv), cenv.data());
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) {
    ::close(fd);
    if (devnull >= 0) ::close(devnull);
    return make_error(Errc::resource,
                      std::string("cannot start /bin/sh for the engine: ") + std::strerror(rc));
  }
  ::close(fd);
  if (devnull >= 0) ::close(devnull);
  return pid;
}

// A member that exited but was not reaped yet (a zombie, e.g. reparented to an init that
// reaps slowly) is gone for our purposes: only running members count.
bool group_alive(pid_t pgid) {
  if (pgid <= 0 || ::kill(-pgid, 0) != 0) return false;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/proc", ec)) {
    const std::string name = e.path().filename().string();
    if (name.empty() || !std::isdigit(static_cast<unsigned char>(name[0]))) continue;
    auto stat = read_file("/proc/" + name + "/stat");
    if (!stat) continue;
    // pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses.
    auto close = stat->rfind(')');
    if (close == std::string::npos) continue;
    auto fields = split_list(std::string_view(*stat).substr(close + 1), ' ');
    if (fields.size() < 3) continue;
    if (fields[2] == std::to_string(pgid) && fields[0] != "Z" && fields[0] != "X") return true;
  }
  return false;
}

bool stop_group(pid_t pgid, std::chrono::milliseconds grace, const std::function<bool()>& reaped) {
  if (pgid <= 0) return true;
  ::kill(-pgid, SIGTERM);
  auto deadline = std::chrono::steady_clock::now() + grace;
  bool clean = false;
  while (std::chrono::steady_clock::now() < deadline) {
    if (reaped() && !group_alive(pgid)) {
      clean = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (!clean) {
    ::kill(-pgid, SIGKILL);
    // The leader is reaped by the caller's reaper; the rest of the group by init.
    for (int i = 0; i < 150 && (!reaped() || group_alive(pgid)); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return clean;
}

std::string describe_wait_status(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    const char* name = sigabbrev_np(sig);
    return "killed by signal " + std::to_string(sig) +
           (name ? std::string(" (SIG") + name + ")" : "");
  }
  return "ended with wait status " + std::to_string(status);
}

std::string tail_file(const std::string& path, int lines) {
  std::ifstream in(path);
  if (!in) return {};
  std::deque<std::string> last;
  std::string line;
  while (std::getline(in, line)) {
    last.push_back(line);
    if (static_cast<int>(last.size()) > lines) last.pop_front();
  }
  std::string out;
  for (auto& l : last) out += (out.empty() ? "" : "\n") + l;
  return out;
}

std::string expand_vars(const std::string& text, const std::map<std::string, std::string>& vars,
                        int rank) {
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '$' && i + 1 < text.size() && text[i + 1] == '{') {
      auto end = text.find('}', i + 2);
      if (end != std::string::npos) {
        std::string name = text.substr(i + 2, end - i - 2);
        auto it = vars.find(name);
        if (it != vars.end()) {
          out += it->second;
        } else if (const char* v = std::getenv(name.c_str())) {
          out += v;
        }
        i = end;
        continue;
      }
    }
    // {BASE+rank}: a per-rank port for ranks sharing one machine.
    if (text[i] == '{') {
      size_t j = i + 1;
      while (j < text.size() && std::isdigit(static_cast<unsigned char>(text[j]))) ++j;
      if (j > i + 1 && text.compare(j, 6, "+rank}") == 0) {
        out += std::to_string(std::stoll(text.substr(i + 1, j - i - 1)) + rank);
        i = j + 5;
        continue;
      }
    }
    if (text.compare(i, 6, "{rank}") == 0) {
      out += std::to_string(rank);
      i += 5;
      continue;
    }
    out += text[i];
  }
  return out;
}

}  // namespace spark::daemon
