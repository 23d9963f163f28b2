#include "support/spawn.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "core/process.h"

extern char** environ;

namespace spark::test {

Child::Child(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
             const std::string& output_file) {
  std::map<std::string, std::string> full;
  for (char** e = environ; *e; ++e) {
    std::string s = *e;
    auto eq = s.find('=');
    if (eq != std::string::npos) full[s.substr(0, eq)] = s.substr(eq + 1);
  }
  for (auto& [k, v] : env) full[k] = v;
  std::vector<std::string> envs;
  for (auto& [k, v] : full) envs.push_back(k + "=" + v);
  std::vector<char*> cargv, cenv;
  for (auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  for (auto& e : envs) cenv.push_back(const_cast<char*>(e.c_str()));
  cenv.push_back(nullptr);
  // posix_spawn: the child never runs the test framework's signal handlers (a signal sent
  // right after start would otherwise hit a forked copy of this process before exec).
  posix_spawnattr_t attr;
  init_spawn_attr_own_group(&attr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 1, output_file.c_str(), O_WRONLY | O_CREAT | O_APPEND,
                                   0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  int rc = ::posix_spawn(&pid_, cargv[0], &fa, &attr, cargv.data(), cenv.data());
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) {
    pid_ = -1;
    throw std::runtime_error(std::string("cannot start ") + argv[0] + ": " + std::strerror(rc));
  }
}

Child::~Child() {
  if (pid_ > 0 && !status_) {
    ::kill(-pid_, SIGKILL);
    ::kill(pid_, SIGKILL);
    int st;
    ::waitpid(pid_, &st, 0);
  } else if (pid_ > 0) {
    ::kill(-pid_, SIGKILL);  // leftovers of the group
  }
}

void Child::signal(int sig) const {
  if (pid_ > 0) ::kill(pid_, sig);
}

std::optional<int> Child::wait_for(std::chrono::milliseconds timeout) {
  if (status_) return status_;
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    int st = 0;
    pid_t r = ::waitpid(pid_, &st, WNOHANG);
    if (r == pid_) {
      status_ = st;
      return status_;
    }
    if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

bool Child::running() {
  return !wait_for(std::chrono::milliseconds(0)).has_value();
}

std::string find_fixture_binary(const std::string& built_path) {
  std::error_code ec;
  if (std::filesystem::exists(built_path, ec)) return built_path;
  auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return {};
  auto beside = self.parent_path() / std::filesystem::path(built_path).filename();
  return std::filesystem::exists(beside, ec) ? beside.string() : std::string();
}

int free_port() {
  // The kernel may hand the port just released by one call to the next: a test asking for
  // two ports (API and rendezvous) could get the same one twice. Ports already handed out
  // by this process are never given again.
  static std::mutex mu;
  static std::set<int> given;
  std::lock_guard<std::mutex> lock(mu);
  int port = 0;
  for (int attempt = 0; attempt < 1000; ++attempt) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    socklen_t len = sizeof a;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    port = ntohs(a.sin_port);
    ::close(fd);
    if (given.insert(port).second) break;
  }
  return port;
}

std::pair<int, std::string> run_capture(const std::vector<std::string>& argv,
                                        const std::map<std::string, std::string>& env,
                                        std::chrono::milliseconds timeout) {
  char tmpl[] = "/tmp/spark-capture-XXXXXX";
  int fd = ::mkstemp(tmpl);
  if (fd >= 0) ::close(fd);
  int status = -1;
  {
    Child c(argv, env, tmpl);
    auto st = c.wait_for(timeout);
    status = st ? *st : -1;
  }
  std::ifstream in(tmpl);
  std::stringstream ss;
  ss << in.rdbuf();
  ::unlink(tmpl);
  return {status, ss.str()};
}

}  // namespace spark::test
