#pragma once
// A command run under /bin/sh -c as the leader of its own process group, with its output
// appended to a log file: the exec backend's engine. Stopping signals the whole group
// (SIGTERM, a grace, then SIGKILL), so `docker run` and its helpers go together.
#include <sys/types.h>

#include <chrono>
#include <functional>
#include <map>
#include <string>

#include "core/error.h"

namespace spark::daemon {

/// Starts `command` with this process's environment plus `env` (added or replaced),
/// stdout+stderr appended to `log_path`, in a new process group. Returns the pid (= pgid).
Result<pid_t> spawn_shell_group(const std::string& command,
                                const std::map<std::string, std::string>& env,
                                const std::string& log_path);

/// Signals the group: SIGTERM, waits up to `grace` for `pid` to be reaped by `reaped`
/// (a predicate the caller's reaper sets), then SIGKILL to the group. Returns true when the
/// leader exited within the grace.
bool stop_group(pid_t pgid, std::chrono::milliseconds grace, const std::function<bool()>& reaped);

/// True while any process of the group exists.
bool group_alive(pid_t pgid);

/// Describes a wait status: "exited with status 1", "killed by signal 9 (SIGKILL)".
std::string describe_wait_status(int status);

/// The last `lines` lines of a file ("" when unreadable).
std::string tail_file(const std::string& path, int lines);

/// Expands ${NAME} from `vars` (then from this process's environment; unknown names become
/// empty), {rank} to `rank` and {BASE+rank} to BASE + rank (e.g. {8100+rank}).
std::string expand_vars(const std::string& text, const std::map<std::string, std::string>& vars,
                        int rank);

}  // namespace spark::daemon
