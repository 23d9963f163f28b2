#pragma once
// Running commands on the ring's nodes: locally (a node that is this machine) or over SSH
// (libssh). Every call has a deadline. Host keys are verified against known_hosts; an
// unknown or changed key is an Errc::auth error naming the host and the fix.
//
// A command that passes its deadline is stopped, with its children: locally by killing its
// process group; remotely by SIGTERM to the process group of its SSH session (through a
// second channel, since sshd refuses signal requests for root logins), and, should the
// connection be lost, by coreutils `timeout` wrapped around it on the node. A call returns
// when the command exited AND its stdout/stderr closed, so a command that starts a daemon
// must detach it (as `sparkctl node launch` does with spawn_detached(); see it for the
// local side). Threads: one Runner is used by one thread at a time; fan_out gives each
// runner its own thread.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/error.h"

namespace spark {

/// What a command did.
struct CommandResult {
  int exit_status = -1;  // -1 when killed by a signal or the deadline
  std::string out;
  std::string err;
  bool timed_out = false;
  double seconds = 0;
};

/// SSH connection parameters for one node.
struct SshTarget {
  std::string node;  // node name, for messages
  std::string host;
  int port = 22;
  std::string user;         // empty: current user
  std::string identity;     // private key file; empty: agent, then ~/.ssh/id_*
  std::string known_hosts;  // empty: ~/.ssh/known_hosts
  std::chrono::milliseconds connect_timeout{10000};
};

/// Runs commands on one node.
class Runner {
 public:
  virtual ~Runner() = default;
  /// Runs `command` with /bin/sh -c, feeding `input` on stdin; fails with Errc::timeout
  /// (naming the node and command) when `timeout` passes (connecting included),
  /// Errc::network/auth when the node cannot be reached. A non-zero exit is NOT an error:
  /// it is in CommandResult::exit_status.
  virtual Result<CommandResult> run(const std::string& command, std::chrono::milliseconds timeout,
                                    const std::string& input = {}) = 0;
  /// The node's name, for messages.
  virtual const std::string& node() const = 0;
  /// True when commands run on this machine without SSH.
  virtual bool is_local() const = 0;
};

/// A runner for this machine (fork/exec of /bin/sh -c).
std::unique_ptr<Runner> make_local_runner(std::string node_name);
/// A runner over SSH (libssh). Connects lazily on first run and reuses the session.
std::unique_ptr<Runner> make_ssh_runner(SshTarget target);
/// The runner a node of the ring needs (local when NODE<i>_SSH=local).
std::unique_ptr<Runner> make_runner(const RingConfig& cfg, const NodeConfig& node);
/// SshTarget of a node from the config (SSH_USER, SSH_PORT, SSH_IDENTITY, SSH_KNOWN_HOSTS,
/// SSH_TIMEOUT applied).
SshTarget ssh_target(const RingConfig& cfg, const NodeConfig& node);

/// Per-node outcome of a fan-out.
struct NodeResult {
  std::string node;
  Result<CommandResult> result{Error{Errc::internal, "not run"}};
};

/// Runs one command per runner, all at once (one thread per node), and waits for all.
/// commands[i] goes to runners[i]; a single command goes to every runner. `inputs` is fed on
/// stdin the same way (none, one for every runner, or one per runner).
std::vector<NodeResult> fan_out(const std::vector<Runner*>& runners,
                                const std::vector<std::string>& commands,
                                std::chrono::milliseconds timeout,
                                const std::vector<std::string>& inputs = {});

}  // namespace spark
