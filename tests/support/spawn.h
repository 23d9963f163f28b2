#pragma once
// A child process for end-to-end tests: real binaries started with argv and extra
// environment, output to a file, waited for with a deadline, killed (whole process group)
// when the test ends, even on failure.
#include <sys/types.h>

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace spark::test {

class Child {
 public:
  /// Starts argv[0] with argv; `env` entries are added to (or replace in) this process's
  /// environment; stdout+stderr go to `output_file` (appended). The child leads its own
  /// process group.
  Child(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
        const std::string& output_file);
  ~Child();
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  pid_t pid() const { return pid_; }
  /// Sends a signal to the child.
  void signal(int sig) const;
  /// Waits for exit up to `timeout`; the raw wait status, or nullopt if still running.
  std::optional<int> wait_for(std::chrono::milliseconds timeout);
  /// True while the child has not been reaped.
  bool running();

 private:
  pid_t pid_ = -1;
  std::optional<int> status_;
};

/// A fixture program (e.g. spark_fault_server): where CMake built it, else next to the running
/// test binary (a staged copy, as on the GPU machine); "" when neither exists.
std::string find_fixture_binary(const std::string& built_path);

/// A TCP port on 127.0.0.1 that was free a moment ago, never one this process was given before.
int free_port();
/// Runs argv to completion (deadline); returns {wait status, stdout+stderr}.
std::pair<int, std::string> run_capture(const std::vector<std::string>& argv,
                                        const std::map<std::string, std::string>& env,
                                        std::chrono::milliseconds timeout);

}  // namespace spark::test
