#include "support/sshd.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <poll.h>
#include <pwd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <thread>

#include "core/strings.h"
#include "support/netns.h"

namespace spark::test {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr const char* kSshd = "/usr/sbin/sshd";

Status keygen(const std::string& path, const std::string& comment) {
  ::unlink(path.c_str());
  ::unlink((path + ".pub").c_str());
  ProcessSpec s;
  s.argv = {"ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", path};
  s.timeout = 30s;
  auto r = run_process(s);
  if (!r) return r.error();
  if (!r->success())
    return make_error(Errc::io, fmt::format("sshd fixture: ssh-keygen {} failed ({}): {}", path,
                                            r->describe(), r->err));
  return {};
}

// A port on `host` that nobody listens on right now (the kernel picks it).
Result<int> free_port(const std::string& host) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return make_error(Errc::resource, "socket() failed");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  ::inet_pton(AF_INET, host.c_str(), &a.sin_addr);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(fd);
    return make_error(Errc::network, fmt::format("sshd fixture: cannot bind {}:0", host));
  }
  ::close(fd);
  return static_cast<int>(ntohs(a.sin_port));
}

// True when host:port answers with an SSH banner within `limit`.
bool answers_ssh(const std::string& host, int port, std::chrono::milliseconds limit) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, host.c_str(), &a.sin_addr);
  bool ok = false;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 || errno == EINPROGRESS) {
    pollfd pf{fd, POLLOUT, 0};
    int err = 0;
    socklen_t el = sizeof err;
    if (::poll(&pf, 1, static_cast<int>(limit.count())) == 1 &&
        ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) == 0 && err == 0) {
      pf = {fd, POLLIN, 0};
      char buf[64] = {};
      if (::poll(&pf, 1, static_cast<int>(limit.count())) == 1 &&
          ::recv(fd, buf, sizeof buf - 1, 0) > 0)
        ok = starts_with(buf, "SSH-2.0-");
    }
  }
  ::close(fd);
  return ok;
}

std::string first_two_fields(const std::string& pub) {
  auto parts = split_list(pub, ' ');
  if (parts.size() < 2) return std::string(trim(pub));
  return parts[0] + " " + parts[1];
}

}  // namespace

std::string sshd_unavailable_reason() {
  if (::access(kSshd, X_OK) != 0) return "OpenSSH server not installed (/usr/sbin/sshd missing)";
  auto r = run_shell("command -v ssh-keygen", 10s);
  if (!r || !r->success()) return "ssh-keygen not installed";
  if (::getpwuid(::geteuid()) == nullptr) return "the current uid has no passwd entry";
  return {};
}

Result<std::unique_ptr<Sshd>> Sshd::start(const SshdOptions& opts) {
  if (auto why = sshd_unavailable_reason(); !why.empty())
    return make_error(Errc::precondition, "sshd fixture: " + why);
  std::unique_ptr<Sshd> d(new Sshd());
  d->opts_ = opts;
  const passwd* pw = ::getpwuid(::geteuid());
  d->user_ = pw->pw_name;
  // Privilege separation directory; sshd refuses to start without it.
  ::mkdir("/run/sshd", 0755);

  d->host_key_ = d->dir_ / "ssh_host_ed25519_key";
  SPARK_TRY(keygen(d->host_key_, "spark-test-host"));
  if (opts.identity.empty()) {
    d->identity_ = d->dir_ / "id_ed25519";
    SPARK_TRY(keygen(d->identity_, "spark-test-user"));
  } else {
    d->identity_ = opts.identity;
  }
  auto pub = read_file(d->identity_ + ".pub");
  if (!pub)
    return make_error(Errc::not_found,
                      fmt::format("sshd fixture: public key {}.pub not found", d->identity_));
  d->dir_.write("authorized_keys", *pub);

  bool pick_port = opts.port == 0;
  for (int attempt = 0; attempt < 3; ++attempt) {
    if (pick_port) {
      if (!opts.netns.empty()) {
        d->opts_.port = 22;
      } else {
        auto p = free_port(opts.host);
        if (!p) return p.error();
        d->opts_.port = *p;
      }
    }
    d->known_hosts_ = d->dir_.write("known_hosts", d->known_hosts_line() + "\n");
    Status st = d->launch();
    if (st.ok()) return d;
    // Someone took the port between our probe and sshd's bind: pick another.
    if (!pick_port || d->log().find("Address already in use") == std::string::npos)
      return st.error();
  }
  return make_error(Errc::network, "sshd fixture: no free port after 3 attempts");
}

Sshd::~Sshd() {
  stop();
}

std::string Sshd::known_hosts_line() const {
  std::string who = opts_.port == 22 ? opts_.host : fmt::format("[{}]:{}", opts_.host, opts_.port);
  return who + " " + first_two_fields(read_file(host_key_ + ".pub").value_or(""));
}

std::string Sshd::log() const {
  return read_file(log_path_).value_or("");
}

SshTarget Sshd::target(const std::string& node) const {
  SshTarget t;
  t.node = node;
  t.host = opts_.host;
  t.port = opts_.port;
  t.user = user_;
  t.identity = identity_;
  t.known_hosts = known_hosts_;
  t.connect_timeout = std::chrono::milliseconds(5000);
  return t;
}

Status Sshd::launch() {
  log_path_ = dir_ / "sshd.log";
  std::string cfg = fmt::format(
      "Port {}\n"
      "ListenAddress {}\n"
      "HostKey {}\n"
      "PidFile {}\n"
      "AuthorizedKeysFile {}\n"
      "PubkeyAuthentication yes\n"
      "PasswordAuthentication no\n"
      "KbdInteractiveAuthentication no\n"
      "PermitRootLogin prohibit-password\n"
      "StrictModes no\n"
      "UsePAM no\n"
      "UseDNS no\n"
      "PrintMotd no\n"
      "LogLevel VERBOSE\n"
      "MaxStartups 100\n"
      "MaxSessions 100\n",
      opts_.port, opts_.host, host_key_, dir_ / "sshd.pid", dir_ / "authorized_keys");
  for (const auto& line : opts_.extra_config) cfg += line + "\n";
  config_ = dir_.write("sshd_config", cfg);
  ProcessSpec s;
  if (!opts_.netns.empty()) s.argv = {"ip", "netns", "exec", opts_.netns};
  s.argv.insert(s.argv.end(), {kSshd, "-D", "-e", "-f", config_});
  s.die_with_parent = true;  // a crashed test leaves no sshd behind
  auto c = ChildProcess::start(s, log_path_);
  if (!c) return c.error();
  proc_ = std::move(*c);
  return wait_ready();
}

Status Sshd::wait_ready() {
  auto deadline = Clock::now() + 10s;
  auto probe = [&] {
    while (Clock::now() < deadline && proc_.running()) {
      if (answers_ssh(opts_.host, opts_.port, 500ms)) return true;
      std::this_thread::sleep_for(20ms);
    }
    return false;
  };
  bool ready = false;
  if (opts_.netns.empty()) {
    ready = probe();
  } else {
    SPARK_TRY(run_in_netns(opts_.netns, [&] { ready = probe(); }));
  }
  if (ready) return {};
  bool exited = !proc_.running();
  proc_.stop();
  return make_error(Errc::precondition,
                    fmt::format("sshd fixture: sshd on {}:{}{} {}; log:\n{}", opts_.host,
                                opts_.port, opts_.netns.empty() ? "" : " in " + opts_.netns,
                                exited ? "exited at start" : "did not answer within 10 s", log()));
}

Result<std::string> Sshd::make_wrong_identity() {
  std::string path = dir_ / fmt::format("wrong_id_{}", wrong_keys_++);
  SPARK_TRY(keygen(path, "spark-test-wrong-user"));
  return path;
}

Status Sshd::change_host_key() {
  stop();
  SPARK_TRY(keygen(host_key_, "spark-test-host-changed"));
  return launch();
}

Status Sshd::authorize(const std::string& public_key_line) {
  std::string keys = read_file(dir_ / "authorized_keys").value_or("");
  dir_.write("authorized_keys", keys + public_key_line + "\n");
  return {};
}

bool Sshd::running() {
  return proc_.running();
}

void Sshd::stop() {
  proc_.stop(std::chrono::milliseconds(2000));
}

Status Sshd::restart() {
  stop();
  return launch();
}

}  // namespace spark::test
