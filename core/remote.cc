#include "core/remote.h"

#include <fmt/format.h>
#include <libssh/libssh.h>
#include <poll.h>
#include <pthread.h>
#include <pwd.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <mutex>
#include <random>
#include <thread>

#include "core/log.h"
#include "core/process.h"
#include "core/strings.h"

namespace spark {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

int64_t ms_left(Clock::time_point deadline) {
  return std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The remote command's exit status, or -1 when sshd sent none (the command died of a
// signal, or the session timed out first). libssh 0.11 (Debian 13, Ubuntu 24.10+) replaced
// ssh_channel_get_exit_status with ssh_channel_get_exit_state and deprecated the old call.
int channel_exit_status(ssh_channel ch) {
#if LIBSSH_VERSION_INT >= SSH_VERSION_INT(0, 11, 0)
  uint32_t code = 0;
  char* signal = nullptr;
  int core_dumped = 0;
  if (ssh_channel_get_exit_state(ch, &code, &signal, &core_dumped) != SSH_OK) return -1;
  if (signal != nullptr) {
    ssh_string_free_char(signal);
    return -1;
  }
  return static_cast<int>(code);
#else
  return ssh_channel_get_exit_status(ch);
#endif
}

// A command as shown in messages: one line, at most 80 characters.
std::string short_command(const std::string& command) {
  std::string s = command;
  std::replace(s.begin(), s.end(), '\n', ' ');
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

std::string expand_home(const std::string& path) {
  if (path == "~" || starts_with(path, "~/")) {
    const char* home = ::getenv("HOME");
    if (home && *home) return std::string(home) + path.substr(1);
  }
  return path;
}

std::string current_user() {
  if (const passwd* pw = ::getpwuid(::geteuid())) return pw->pw_name;
  return "root";
}

// ---- local

class LocalRunner final : public Runner {
 public:
  explicit LocalRunner(std::string node) : node_(std::move(node)) {}

  Result<CommandResult> run(const std::string& command, milliseconds timeout,
                            const std::string& input) override {
    auto r = run_shell(command, timeout, input);
    if (!r) return make_error(r.error().code, fmt::format("node {}: {}", node_, r.error().message));
    if (r->timed_out)
      return make_error(Errc::timeout,
                        fmt::format("node {} (local): `{}` did not finish within {:.1f} s; its "
                                    "process group was killed",
                                    node_, short_command(command), timeout.count() / 1000.0));
    CommandResult c;
    c.exit_status = r->exit_status;
    c.out = std::move(r->out);
    c.err = std::move(r->err);
    c.seconds = r->seconds;
    return c;
  }
  const std::string& node() const override { return node_; }
  bool is_local() const override { return true; }

 private:
  std::string node_;
};

// ---- ssh

// Blocks SIGPIPE in this thread while libssh writes to a socket the peer may have closed
// (EPIPE instead of death), and swallows a SIGPIPE that arrived meanwhile.
class SigpipeGuard {
 public:
  SigpipeGuard() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    ::pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
  }
  ~SigpipeGuard() {
    if (!sigismember(&old_, SIGPIPE)) {
      timespec zero{};
      while (::sigtimedwait(&pipe_, nullptr, &zero) == SIGPIPE) {
      }
    }
    ::pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  SigpipeGuard(const SigpipeGuard&) = delete;
  SigpipeGuard& operator=(const SigpipeGuard&) = delete;

 private:
  sigset_t pipe_, old_;
};

// Output kept per stream; the rest is read and dropped (as run_process does).
constexpr size_t kOutputLimit = size_t{64} << 20;

void init_libssh() {
  static std::once_flag once;
  std::call_once(once, [] { ssh_init(); });
}

class SshRunner final : public Runner {
 public:
  explicit SshRunner(SshTarget t) : t_(std::move(t)) {
    if (t_.user.empty()) t_.user = current_user();
    t_.identity = expand_home(t_.identity);
    known_hosts_ =
        t_.known_hosts.empty() ? expand_home("~/.ssh/known_hosts") : expand_home(t_.known_hosts);
    where_ = fmt::format("node {} ({}:{})", t_.node, t_.host, t_.port);
  }
  ~SshRunner() override { drop(); }

  Result<CommandResult> run(const std::string& command, milliseconds timeout,
                            const std::string& input) override;
  const std::string& node() const override { return t_.node; }
  bool is_local() const override { return false; }

 private:
  Status connect(Clock::time_point deadline);
  Status verify_host_key();
  Status authenticate();
  Result<CommandResult> exec(const std::string& command, Clock::time_point t0,
                             Clock::time_point deadline, milliseconds timeout,
                             const std::string& input, bool* started);
  void start_detached(const std::string& killer, const std::string& command);
  void set_session_timeout(int64_t ms);
  void drop();
  Error ssh_failure(const char* what);
  std::string user_at_host() const {
    return t_.port == 22 ? fmt::format("{}@{}", t_.user, t_.host)
                         : fmt::format("{}@{} -p {}", t_.user, t_.host, t_.port);
  }
  std::string known_hosts_name() const {
    return t_.port == 22 ? t_.host : fmt::format("[{}]:{}", t_.host, t_.port);
  }

  SshTarget t_;
  std::string known_hosts_;
  std::string where_;
  ssh_session s_ = nullptr;
};

void SshRunner::drop() {
  if (!s_) return;
  if (ssh_is_connected(s_)) ssh_disconnect(s_);
  ssh_free(s_);
  s_ = nullptr;
}

void SshRunner::set_session_timeout(int64_t ms) {
  ms = std::max<int64_t>(ms, 1);
  long sec = static_cast<long>(ms / 1000);
  long usec = static_cast<long>((ms % 1000) * 1000);
  ssh_options_set(s_, SSH_OPTIONS_TIMEOUT, &sec);
  ssh_options_set(s_, SSH_OPTIONS_TIMEOUT_USEC, &usec);
}

Error SshRunner::ssh_failure(const char* what) {
  std::string msg = s_ ? ssh_get_error(s_) : "no session";
  std::string lower = msg;
  std::transform(lower.begin(), lower.end(), lower.begin(), ::tolower);
  Errc code = Errc::network;
  if (lower.find("timeout") != std::string::npos || lower.find("timed out") != std::string::npos)
    code = Errc::timeout;
  std::string hint;
  if (lower.find("refused") != std::string::npos)
    hint = fmt::format("; is sshd running there and listening on port {}?", t_.port);
  else if (lower.find("resolve") != std::string::npos)
    hint = "; check the host name in NODE<i>_SSH";
  return make_error(code, fmt::format("{}: {}: {}{}", where_, what, msg, hint));
}

Status SshRunner::connect(Clock::time_point deadline) {
  init_libssh();
  s_ = ssh_new();
  if (!s_) return make_error(Errc::resource, where_ + ": ssh_new failed");
  // Host first so ~/.ssh/config "Host" blocks match; then our explicit settings win.
  ssh_options_set(s_, SSH_OPTIONS_HOST, t_.host.c_str());
  ssh_options_parse_config(s_, nullptr);
  unsigned int port = static_cast<unsigned int>(t_.port);
  ssh_options_set(s_, SSH_OPTIONS_PORT, &port);
  ssh_options_set(s_, SSH_OPTIONS_USER, t_.user.c_str());
  ssh_options_set(s_, SSH_OPTIONS_KNOWNHOSTS, known_hosts_.c_str());
  int no = 0;
  ssh_options_set(s_, SSH_OPTIONS_PROCESS_CONFIG, &no);  // parsed above already
  const int64_t left = ms_left(deadline);
  const bool by_deadline = left < t_.connect_timeout.count();
  set_session_timeout(std::min<int64_t>(t_.connect_timeout.count(), left));
  if (ssh_connect(s_) != SSH_OK) {
    Error e = ssh_failure("cannot connect");
    if (e.code == Errc::timeout)  // which bound ended the wait
      e.message += by_deadline ? fmt::format(" (the call's deadline: {:.1f} s left)", left / 1000.0)
                               : fmt::format(" (the connect timeout, SSH_TIMEOUT: {:.1f} s)",
                                             t_.connect_timeout.count() / 1000.0);
    drop();
    return e;
  }
  if (Status st = verify_host_key(); !st.ok()) {
    drop();
    return st;
  }
  if (Status st = authenticate(); !st.ok()) {
    drop();
    return st;
  }
  log::debug("ssh", "{}: connected as {}", where_, t_.user);
  return {};
}

Status SshRunner::verify_host_key() {
  std::string offered = "an unreadable key";
  ssh_key key = nullptr;
  if (ssh_get_server_publickey(s_, &key) == SSH_OK) {
    unsigned char* hash = nullptr;
    size_t hlen = 0;
    if (ssh_get_publickey_hash(key, SSH_PUBLICKEY_HASH_SHA256, &hash, &hlen) == SSH_OK) {
      char* fp = ssh_get_fingerprint_hash(SSH_PUBLICKEY_HASH_SHA256, hash, hlen);
      offered = fmt::format("{} key {}", ssh_key_type_to_char(ssh_key_type(key)), fp ? fp : "?");
      ssh_string_free_char(fp);
      ssh_clean_pubkey_hash(&hash);
    }
    ssh_key_free(key);
  }
  std::string scan = fmt::format("ssh-keyscan -p {} {} >> {}", t_.port, t_.host, known_hosts_);
  switch (ssh_session_is_known_server(s_)) {
    case SSH_KNOWN_HOSTS_OK:
      return {};
    case SSH_KNOWN_HOSTS_NOT_FOUND:
    case SSH_KNOWN_HOSTS_UNKNOWN:
      return make_error(Errc::auth,
                        fmt::format("{}: host key not in {} (the server offers {}); verify it "
                                    "(on the node: ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub) "
                                    "and run: {}",
                                    where_, known_hosts_, offered, scan));
    case SSH_KNOWN_HOSTS_CHANGED:
    case SSH_KNOWN_HOSTS_OTHER:
      return make_error(
          Errc::auth,
          fmt::format("{}: HOST KEY CHANGED: the server offers {}, but {} records a different "
                      "key for {}. This can be an attack (someone intercepting the connection) "
                      "or a reinstalled node; refusing to connect. If the change is expected, "
                      "run: ssh-keygen -f {} -R '{}' && {}",
                      where_, offered, known_hosts_, known_hosts_name(), known_hosts_,
                      known_hosts_name(), scan));
    case SSH_KNOWN_HOSTS_ERROR:
    default:
      return make_error(Errc::auth, fmt::format("{}: cannot check the host key against {}: {}",
                                                where_, known_hosts_, ssh_get_error(s_)));
  }
}

Status SshRunner::authenticate() {
  // Learn the methods; a server may (rarely) accept "none".
  int rc = ssh_userauth_none(s_, nullptr);
  if (rc == SSH_AUTH_SUCCESS) return {};
  if (rc == SSH_AUTH_ERROR) return ssh_failure("authentication failed");
  std::string tried;
  if (!t_.identity.empty()) {
    ssh_key priv = nullptr;
    rc = ssh_pki_import_privkey_file(t_.identity.c_str(), nullptr, nullptr, nullptr, &priv);
    if (rc == SSH_EOF)
      return make_error(Errc::not_found,
                        fmt::format("{}: identity file {} does not exist or cannot be read (check "
                                    "SSH_IDENTITY)",
                                    where_, t_.identity));
    if (rc != SSH_OK)
      return make_error(Errc::auth,
                        fmt::format("{}: cannot load private key {} (passphrase-protected? load "
                                    "it into ssh-agent with ssh-add and leave SSH_IDENTITY empty)",
                                    where_, t_.identity));
    rc = ssh_userauth_publickey(s_, nullptr, priv);
    ssh_key_free(priv);
    tried = "the key " + t_.identity;
  } else {
    // The agent first, then ~/.ssh/id_* (ssh_userauth_publickey_auto does both in order).
    rc = ssh_userauth_publickey_auto(s_, nullptr, nullptr);
    tried = "the agent's keys and ~/.ssh/id_*";
  }
  if (rc == SSH_AUTH_SUCCESS) return {};
  if (rc == SSH_AUTH_ERROR) return ssh_failure("authentication failed");
  std::string pub = t_.identity.empty() ? "~/.ssh/id_ed25519.pub" : t_.identity + ".pub";
  return make_error(Errc::auth, fmt::format("{}: {} refused {} (publickey); add {} to ~{}/.ssh/"
                                            "authorized_keys on {}, e.g. ssh-copy-id -i {} {}",
                                            where_, fmt::format("{}@{}", t_.user, t_.host), tried,
                                            pub, t_.user, t_.host, pub, user_at_host()));
}

// How a remote command is stopped at its deadline, in three layers:
//  1. the command runs as `sh -c CMD sparkctl-call-<token>` (the token tags the process
//     tree); at the deadline a second channel runs kill_remote_command(), which sends
//     SIGTERM to the process group led by the tagged process (sshd makes every session its
//     own session and group);
//  2. a "signal" channel request (sshd honours it for non-root logins only);
//  3. coreutils timeout (when present) around the command, a little after the deadline, for
//     when the connection itself is lost.
std::string wrap_remote(const std::string& command, milliseconds budget, const std::string& token) {
  int64_t secs = (budget.count() + 999) / 1000 + 2;
  std::string q = shell_quote(command);
  return fmt::format(
      "if command -v timeout >/dev/null 2>&1; then exec timeout -k 5 {} /bin/sh -c {} "
      "sparkctl-call-{}; else exec /bin/sh -c {} sparkctl-call-{}; fi",
      secs, q, token, q, token);
}

std::string kill_remote_command(const std::string& token) {
  // The bracket keeps this command's own command line from matching the pattern.
  return fmt::format(
      "for p in $(pgrep -f 'sparkctl-call-[{}]{}'); do kill -TERM -$p $p; done 2>/dev/null; "
      "exit 0",
      token.substr(0, 1), token.substr(1));
}

std::string new_token() {
  static std::mutex mu;
  static std::mt19937_64 rng{std::random_device{}()};
  std::lock_guard<std::mutex> lock(mu);
  return fmt::format("{:016x}", rng());
}

Result<CommandResult> SshRunner::exec(const std::string& command, Clock::time_point t0,
                                      Clock::time_point deadline, milliseconds timeout,
                                      const std::string& input, bool* started) {
  set_session_timeout(ms_left(deadline));
  ssh_channel ch = ssh_channel_new(s_);
  if (!ch) return ssh_failure("cannot create a channel");
  struct ChannelGuard {
    ssh_channel c;
    ~ChannelGuard() {
      if (ssh_channel_is_open(c)) ssh_channel_close(c);
      ssh_channel_free(c);
    }
  } guard{ch};
  if (ssh_channel_open_session(ch) != SSH_OK) return ssh_failure("cannot open a session channel");
  *started = true;  // from here on the command may run: never retry it
  std::string token = new_token();
  std::string remote = wrap_remote(command, timeout, token);
  if (ssh_channel_request_exec(ch, remote.c_str()) != SSH_OK)
    return ssh_failure("cannot start the command");

  CommandResult r;
  size_t in_off = 0;
  bool eof_sent = false;
  char buf[65536];
  int fd = ssh_get_fd(s_);
  auto timed_out = [&]() -> Error {
    // Stop the remote command: SIGTERM to its process group via sshd, then close (briefly:
    // the link itself may be what is stuck).
    set_session_timeout(1000);
    ssh_channel_request_send_signal(ch, "TERM");
    ssh_channel_close(ch);
    start_detached(kill_remote_command(token), command);
    r.timed_out = true;
    std::string err_tail(trim(r.err));
    if (err_tail.size() > 200) err_tail = "..." + err_tail.substr(err_tail.size() - 200);
    return make_error(Errc::timeout,
                      fmt::format("{}: `{}` did not finish within {:.1f} s; sent SIGTERM to it "
                                  "and closed the channel{}",
                                  where_, short_command(command), timeout.count() / 1000.0,
                                  err_tail.empty() ? "" : " (stderr so far: " + err_tail + ")"));
  };

  for (;;) {
    if (ms_left(deadline) <= 0) return timed_out();
    if (!eof_sent) {
      if (in_off < input.size()) {
        uint32_t window = ssh_channel_window_size(ch);
        size_t n = std::min<size_t>({input.size() - in_off, window, 32768});
        if (n > 0) {
          int w = ssh_channel_write(ch, input.data() + in_off, static_cast<uint32_t>(n));
          if (w == SSH_ERROR) return ssh_failure("writing stdin failed");
          in_off += static_cast<size_t>(std::max(w, 0));
        }
      }
      if (in_off == input.size()) {
        ssh_channel_send_eof(ch);
        eof_sent = true;
      }
    }
    bool got = false, eof[2] = {false, false};
    for (int stream = 0; stream < 2; ++stream) {
      std::string& dst = stream ? r.err : r.out;
      for (;;) {
        int n = ssh_channel_read_nonblocking(ch, buf, sizeof buf, stream);
        if (n > 0) {
          if (dst.size() < kOutputLimit)
            dst.append(buf, std::min(static_cast<size_t>(n), kOutputLimit - dst.size()));
          got = true;
          continue;
        }
        if (n == SSH_ERROR) return ssh_failure("reading the command's output failed");
        if (n == SSH_EOF || ssh_channel_is_eof(ch)) eof[stream] = true;
        break;
      }
    }
    if (eof[0] && eof[1]) break;
    if (got) continue;
    // Nothing to do: wait for the socket (output, or a window adjust for stdin), briefly, so
    // packets libssh already buffered are never left waiting long.
    int wait_ms = static_cast<int>(std::clamp<int64_t>(ms_left(deadline), 0, 50));
    pollfd pf{fd, POLLIN, 0};
    ::poll(&pf, 1, wait_ms);
  }
  // Output is complete; the exit status follows. Wait for it within the deadline.
  int64_t left = ms_left(deadline);
  if (left <= 0) return timed_out();
  set_session_timeout(left);
  int status = channel_exit_status(ch);
  if (status == -1 && !ssh_channel_is_closed(ch) && ms_left(deadline) <= 0) return timed_out();
  r.exit_status = status;
  r.seconds = seconds_since(t0);
  return r;
}

// Starts `killer` on a new channel and leaves it running: once sshd acknowledged the exec
// request the command runs by itself (it writes nothing, so closing the channel does not
// disturb it). Bounded by one second of session timeout per step.
void SshRunner::start_detached(const std::string& killer, const std::string& command) {
  set_session_timeout(1000);
  ssh_channel ch = ssh_channel_new(s_);
  bool ok = ch && ssh_channel_open_session(ch) == SSH_OK &&
            ssh_channel_request_exec(ch, killer.c_str()) == SSH_OK;
  if (!ok)
    log::warn("ssh", "{}: could not stop `{}`: {}", where_, short_command(command),
              ssh_get_error(s_));
  if (ch) {
    if (ssh_channel_is_open(ch)) ssh_channel_close(ch);
    ssh_channel_free(ch);
  }
}

Result<CommandResult> SshRunner::run(const std::string& command, milliseconds timeout,
                                     const std::string& input) {
  auto t0 = Clock::now();
  auto deadline = t0 + timeout;
  SigpipeGuard no_sigpipe;
  for (int attempt = 0; attempt < 2; ++attempt) {
    bool fresh = false;
    if (s_ && !ssh_is_connected(s_)) drop();
    if (!s_) {
      SPARK_TRY(connect(deadline));
      fresh = true;
    }
    bool started = false;
    auto r = exec(command, t0, deadline, timeout, input, &started);
    if (r.ok()) return r;
    // A timeout or a broken connection leaves the session in doubt: start afresh next time.
    drop();
    // A reused session may have died since its last use (node rebooted, sshd restarted):
    // reconnect once, unless the time is up or the command may already have run.
    if (fresh || started || ms_left(deadline) <= 0) return r;
    log::debug("ssh", "{}: reused session failed ({}); reconnecting", where_, r.error().message);
  }
  return make_error(Errc::internal, where_ + ": unreachable");
}

}  // namespace

std::unique_ptr<Runner> make_local_runner(std::string node_name) {
  return std::make_unique<LocalRunner>(std::move(node_name));
}

std::unique_ptr<Runner> make_ssh_runner(SshTarget target) {
  return std::make_unique<SshRunner>(std::move(target));
}

SshTarget ssh_target(const RingConfig& cfg, const NodeConfig& node) {
  SshTarget t;
  t.node = node.name;
  t.host = node.ssh_host;
  t.port = node.ssh_port;
  t.user = node.ssh_user.empty() ? cfg.get("SSH_USER") : node.ssh_user;
  t.identity = expand_home(cfg.get("SSH_IDENTITY"));
  t.known_hosts = expand_home(cfg.get("SSH_KNOWN_HOSTS"));
  if (!cfg.get("SSH_TIMEOUT").empty())
    t.connect_timeout = milliseconds(static_cast<int64_t>(cfg.get_duration_ms("SSH_TIMEOUT")));
  return t;
}

std::unique_ptr<Runner> make_runner(const RingConfig& cfg, const NodeConfig& node) {
  if (node.local) return make_local_runner(node.name);
  return make_ssh_runner(ssh_target(cfg, node));
}

std::vector<NodeResult> fan_out(const std::vector<Runner*>& runners,
                                const std::vector<std::string>& commands,
                                std::chrono::milliseconds timeout,
                                const std::vector<std::string>& inputs) {
  std::vector<NodeResult> results(runners.size());
  std::vector<std::thread> threads;
  threads.reserve(runners.size());
  for (size_t i = 0; i < runners.size(); ++i) {
    results[i].node = runners[i] ? runners[i]->node() : fmt::format("#{}", i);
    if (!runners[i]) {
      results[i].result = make_error(Errc::internal, fmt::format("fan_out: runner {} is null", i));
      continue;
    }
    if (commands.size() != 1 && commands.size() != runners.size()) {
      results[i].result = make_error(
          Errc::internal,
          fmt::format("fan_out: {} commands for {} nodes", commands.size(), runners.size()));
      continue;
    }
    if (inputs.size() > 1 && inputs.size() != runners.size()) {
      results[i].result = make_error(Errc::internal, fmt::format("fan_out: {} inputs for {} nodes",
                                                                 inputs.size(), runners.size()));
      continue;
    }
    const std::string& cmd = commands.size() == 1 ? commands[0] : commands[i];
    static const std::string kNoInput;
    const std::string& in = inputs.empty() ? kNoInput : inputs.size() == 1 ? inputs[0] : inputs[i];
    threads.emplace_back([&results, &runners, &cmd, &in, i, timeout] {
      results[i].result = runners[i]->run(cmd, timeout, in);
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

}  // namespace spark
