#pragma once
// A real OpenSSH server for tests: /usr/sbin/sshd -D -e -f <generated config> on a loopback
// port (or inside a network namespace), with a generated host key, a generated user key
// pair in authorized_keys, and a known_hosts file for the client. It runs as the current
// user (root is fine: PermitRootLogin prohibit-password, StrictModes no). Everything lives
// in one temporary directory that goes away with the object; the server is stopped first.
// sshd gets SIGTERM when the thread that started it exits (so a crashed test leaves no
// server behind): start() and restart() it from a thread that outlives its use.
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/process.h"
#include "core/remote.h"
#include "support/tempdir.h"

namespace spark::test {

/// Where and how the server runs.
struct SshdOptions {
  std::string host = "127.0.0.1";  // listen address (and the address clients use)
  int port = 0;                    // 0: a free port (22 inside a namespace)
  std::string netns{};             // run inside this network namespace (see netns.h)
  std::string identity{};          // authorize this existing private key; empty: generate one
  std::vector<std::string> extra_config{};  // more sshd_config lines
};

/// Why a real sshd cannot run here ("" when it can); tests print "SKIP: <reason>".
std::string sshd_unavailable_reason();

/// A running sshd; see the file comment.
class Sshd {
 public:
  /// Generates keys and config, starts sshd and waits (bounded, 10 s) until it answers with
  /// an SSH banner. The error carries sshd's log.
  static Result<std::unique_ptr<Sshd>> start(const SshdOptions& opts = {});
  ~Sshd();
  Sshd(const Sshd&) = delete;
  Sshd& operator=(const Sshd&) = delete;

  const std::string& host() const { return opts_.host; }
  int port() const { return opts_.port; }
  /// The login user (the current user).
  const std::string& user() const { return user_; }
  /// Private key file authorized to log in.
  const std::string& identity() const { return identity_; }
  /// known_hosts file holding this server's host key (as the client should see it).
  const std::string& known_hosts() const { return known_hosts_; }
  /// The fixture's directory (config, keys, log).
  const std::string& dir() const { return dir_.path(); }
  /// The known_hosts line for the current host key ("[127.0.0.1]:2222 ssh-ed25519 AAAA...").
  std::string known_hosts_line() const;
  /// sshd's log so far.
  std::string log() const;
  /// An SshTarget that reaches this server with the fixture's identity and known_hosts.
  SshTarget target(const std::string& node = "sshd") const;

  /// A new key pair that is NOT in authorized_keys; returns the private key path.
  Result<std::string> make_wrong_identity();
  /// Generates a new host key and restarts sshd on the same address; known_hosts() keeps
  /// the old key, so clients see a changed host key.
  Status change_host_key();
  /// Adds a public key line to authorized_keys (takes effect for the next login).
  Status authorize(const std::string& public_key_line);
  /// True while the server process runs.
  bool running();
  /// Stops the server (SIGTERM, then SIGKILL). Idempotent; restart() starts it again.
  void stop();
  /// Starts it again on the same address with the current keys.
  Status restart();

 private:
  Sshd() = default;
  Status launch();
  Status wait_ready();
  SshdOptions opts_;
  TempDir dir_{"spark-sshd"};
  std::string user_;
  std::string identity_;
  std::string host_key_;
  std::string known_hosts_;
  std::string config_;
  std::string log_path_;
  ChildProcess proc_;
  int wrong_keys_ = 0;
};

}  // namespace spark::test
