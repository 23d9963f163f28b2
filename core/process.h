#pragma once
// Running local processes: a command to completion with captured output and a deadline
// (run_process), a background child the caller owns (ChildProcess), and a fully detached
// daemon (spawn_detached). Every child gets its own process group so a timeout or stop()
// takes its children with it. Pipes are close-on-exec, so concurrent spawns from several
// threads do not leak each other's descriptors.
#include <spawn.h>
#include <sys/types.h>

#include <chrono>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace spark {

/// What to run and how.
struct ProcessSpec {
  std::vector<std::string> argv;  // argv[0] is searched in PATH when it has no '/'
  std::string input;              // written to stdin, then stdin is closed; empty: /dev/null
  std::map<std::string, std::string> env;    // added to (or replacing in) the inherited environment
  std::string cwd;                           // empty: inherit
  std::chrono::milliseconds timeout{60000};  // deadline for the whole run (run_process)
  std::chrono::milliseconds kill_grace{1000};  // SIGTERM to the group, then SIGKILL after this
  size_t output_limit = size_t{64} << 20;      // per stream; the rest is read and dropped
  // SIGTERM the child when the thread that started it exits (PR_SET_PDEATHSIG), so a test
  // that crashes leaves no server behind. Start it from a long-lived thread.
  bool die_with_parent = false;
  // When >= 0, the child runs as this user: its groups (from the user database, or just
  // run_as_gid when the user has no entry there), run_as_gid, then the uid, set before the
  // exec; HOME, USER and LOGNAME follow the user unless `env` sets them. Needs root unless
  // it is the caller's own uid.
  int run_as_uid = -1;
  int run_as_gid = -1;
};

/// A spec that runs `command` with /bin/sh -c.
ProcessSpec shell_spec(std::string command,
                       std::chrono::milliseconds timeout = std::chrono::milliseconds{60000});

/// What a finished (or killed) process did.
struct ProcessResult {
  int exit_status = -1;    // exit code; -1 when a signal ended it
  int term_signal = 0;     // the signal that ended it, 0 when it exited
  bool timed_out = false;  // the deadline passed and the group was killed
  bool truncated = false;  // a stream exceeded output_limit
  std::string out;
  std::string err;
  double seconds = 0;
  /// True when it exited 0 within the deadline.
  bool success() const { return exit_status == 0 && !timed_out; }
  /// "exit 3", "killed by SIGKILL", "timed out after 1.0 s (killed by SIGTERM)".
  std::string describe() const;
};

/// Runs to completion. stdout and stderr are captured concurrently (no deadlock on large
/// output). When spec.timeout passes the whole process group gets SIGTERM, then SIGKILL
/// after kill_grace; the result has timed_out set (that is not an error). Errors: the
/// program cannot be started (Errc::not_found for a missing program, Errc::io otherwise).
Result<ProcessResult> run_process(const ProcessSpec& spec);
/// run_process(shell_spec(command, timeout)) with `input` on stdin.
Result<ProcessResult> run_shell(const std::string& command, std::chrono::milliseconds timeout,
                                const std::string& input = {});

/// A background child owned by the caller: stdin /dev/null, stdout and stderr appended to a
/// log file, its own process group. The destructor stops it (stop()).
class ChildProcess {
 public:
  /// Starts spec (input, timeout and output_limit are ignored). An empty log_path sends
  /// output to /dev/null.
  static Result<ChildProcess> start(const ProcessSpec& spec, const std::string& log_path);
  ChildProcess() = default;
  ChildProcess(ChildProcess&& o) noexcept;
  ChildProcess& operator=(ChildProcess&& o) noexcept;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ~ChildProcess();

  /// The child's pid (also its process group id); 0 when none.
  pid_t pid() const { return pid_; }
  /// True while it has not exited (reaps it when it has).
  bool running();
  /// Waits up to `timeout` for it to exit by itself; true when it has.
  bool wait(std::chrono::milliseconds timeout);
  /// SIGTERM to its process group, SIGKILL after `grace`, then reaps. Idempotent.
  void stop(std::chrono::milliseconds grace = std::chrono::milliseconds{2000});
  /// Exit code once it has exited (-1 while running or when a signal ended it).
  int exit_status() const { return exit_status_; }
  /// The signal that ended it (0 when it exited or still runs).
  int term_signal() const { return term_signal_; }

 private:
  void reaped(int wstatus);
  pid_t pid_ = 0;
  int pidfd_ = -1;
  int exit_status_ = -1;
  int term_signal_ = 0;
};

/// Starts a command fully detached from the caller (double fork, setsid): it survives the
/// caller, leads its own session and process group, has no controlling terminal, stdin /dev/null, stdout and stderr appended to
/// log_path (created 0644). Returns its pid once exec succeeded. spec.input, timeout and
/// die_with_parent are ignored.
Result<pid_t> spawn_detached(const ProcessSpec& spec, const std::string& log_path);

/// Initialises posix_spawn attributes for a child that leads its own process group, with an
/// empty signal mask and default dispositions set before exec (so no inherited handler ever
/// runs in the child between spawn and exec). The caller destroys `attr`.
void init_spawn_attr_own_group(posix_spawnattr_t* attr);

/// Quotes one word for a POSIX shell: a/b-c stays as is, it's -> 'it'\''s', '' -> ''.
std::string shell_quote(std::string_view word);
/// Quotes and joins argv into one shell command line.
std::string shell_join(const std::vector<std::string>& argv);
/// "SIGTERM" for 15; "signal N" when unknown.
std::string signal_name(int sig);

}  // namespace spark
