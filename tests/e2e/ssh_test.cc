// core/remote against a real OpenSSH server (tests/support/sshd.h) on loopback and inside
// network namespaces.
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <thread>

#include "core/config.h"
#include "core/process.h"
#include "core/remote.h"
#include "core/strings.h"
#include "support/netns.h"
#include "support/sshd.h"
#include "support/tempdir.h"

using namespace spark;
using namespace spark::test;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

#define SKIP_WITHOUT_SSHD()                                   \
  if (auto why_ = sshd_unavailable_reason(); !why_.empty()) { \
    MESSAGE("SKIP: " << why_);                                \
    return;                                                   \
  }

std::unique_ptr<Sshd> start_sshd(const SshdOptions& opts = {}) {
  auto d = Sshd::start(opts);
  REQUIRE_MESSAGE(d.ok(), d.error().message);
  return std::move(*d);
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

size_t count_of(const std::string& s, const std::string& part) {
  size_t n = 0;
  for (size_t at = s.find(part); at != std::string::npos; at = s.find(part, at + 1)) ++n;
  return n;
}

// True when no process has `pattern` in its command line (pgrep -f), polled up to `limit`.
bool no_process_matches(const std::string& pattern, std::chrono::milliseconds limit) {
  auto end = Clock::now() + limit;
  for (;;) {
    ProcessSpec pgrep;  // no shell: its command line would match the pattern too
    pgrep.argv = {"pgrep", "-f", pattern};
    auto r = run_process(pgrep);
    if (r.ok() && r->exit_status == 1) return true;
    if (Clock::now() > end) return false;
    std::this_thread::sleep_for(50ms);
  }
}

}  // namespace

TEST_CASE("ssh: a command's stdout, stderr and exit status come back") {
  SKIP_WITHOUT_SSHD();
  auto d = start_sshd();
  auto runner = make_ssh_runner(d->target("n1"));
  CHECK_FALSE(runner->is_local());
  CHECK(runner->node() == "n1");

  auto r = runner->run("echo hello; echo oops >&2; printf '%s' \"$USER\"", 10s);
  REQUIRE_MESSAGE(r.ok(), r.error().message);
  CHECK(r->exit_status == 0);
  CHECK(r->out == "hello\n" + d->user());
  CHECK(r->err == "oops\n");
  CHECK_FALSE(r->timed_out);

  auto bad = runner->run("echo partial; exit 7", 10s);
  REQUIRE(bad.ok());  // a non-zero exit is a result, not an error
  CHECK(bad->exit_status == 7);
  CHECK(bad->out == "partial\n");

  // Killed by a signal: no exit code, as with the local runner.
  auto killed = runner->run("kill -9 $$", 10s);
  REQUIRE(killed.ok());
  CHECK(killed->exit_status == -1);

  // Quoting survives the remote shell and the wrapper.
  auto q = runner->run("printf '%s|' \"it's\" '$HOME' \"a  b\"", 10s);
  REQUIRE(q.ok());
  CHECK(q->out == "it's|$HOME|a  b|");

  // One session serves every call.
  CHECK(count_of(d->log(), "Accepted publickey") == 1);
}

TEST_CASE("ssh: stdin round-trips and large output on both streams does not deadlock") {
  SKIP_WITHOUT_SSHD();
  auto d = start_sshd();
  auto runner = make_ssh_runner(d->target());
  std::string input;
  for (int i = 0; i < 200000; ++i) input += std::to_string(i * 7919) + "\n";  // ~1.3 MiB
  auto r = runner->run("cat", 30s, input);
  REQUIRE_MESSAGE(r.ok(), r.error().message);
  CHECK(r->exit_status == 0);
  CHECK(r->out.size() == input.size());
  CHECK(r->out == input);

  auto wc = runner->run("wc -c", 30s, input);
  REQUIRE(wc.ok());
  CHECK(std::string(trim(wc->out)) == std::to_string(input.size()));

  auto big = runner->run(
      "head -c 2000000 /dev/zero | tr '\\0' e >&2; head -c 1500000 /dev/zero | tr '\\0' o", 30s);
  REQUIRE_MESSAGE(big.ok(), big.error().message);
  CHECK(big->exit_status == 0);
  CHECK(big->err.size() == 2000000);
  CHECK(big->out.size() == 1500000);
}

TEST_CASE("ssh: a deadline stops the remote command and names node and command") {
  SKIP_WITHOUT_SSHD();
  auto d = start_sshd();
  auto runner = make_ssh_runner(d->target("slow-node"));
  REQUIRE(runner->run("true", 10s).ok());  // connect first: time only the command
  std::string marker = fmt::format("sleep 30.{}", 1000 + ::getpid() % 9000);
  auto r = runner->run(marker, 1s);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code == Errc::timeout);
  CHECK(contains(r.error().message, "slow-node"));
  CHECK(contains(r.error().message, marker));
  // The command sleeps 30 s: the 1 s deadline ended it, and says so.
  CHECK(contains(r.error().message, "did not finish within 1.0 s"));
  CHECK_MESSAGE(no_process_matches(marker, 5s), "the remote `" << marker
                                                               << "` still runs; sshd log:\n"
                                                               << d->log());
  // The runner recovers: the next call reconnects.
  auto again = runner->run("echo again", 10s);
  REQUIRE_MESSAGE(again.ok(), again.error().message);
  CHECK(again->out == "again\n");
}

TEST_CASE("ssh: an unknown host key is refused with the fix") {
  SKIP_WITHOUT_SSHD();
  auto d = start_sshd();
  TempDir tmp;
  for (std::string kh : {tmp.write("empty_known_hosts", ""), tmp / "missing_known_hosts"}) {
    auto t = d->target("n-unknown");
    t.known_hosts = kh;
    auto r = make_ssh_runner(t)->run("true", 10s);
    REQUIRE_FALSE(r.ok());
    CHECK(r.error().code == Errc::auth);
    INFO(r.error().message);
    CHECK(contains(r.error().message, "node n-unknown (127.0.0.1:" + std::to_string(d->port())));
    CHECK(contains(r.error().message, "host key not in " + kh));
    CHECK(contains(r.error().message,
                   fmt::format("ssh-keyscan -p {} 127.0.0.1 >> {}", d->port(), kh)));
    CHECK(contains(r.error().message, "SHA256:"));
  }
  // Another host's entry for the same address does not count either.
  auto t = d->target();
  t.known_hosts = tmp.write("other", "[127.0.0.2]:22 " + split_list(d->known_hosts_line(), ' ')[1] +
                                         " " + split_list(d->known_hosts_line(), ' ')[2] + "\n");
  auto r = make_ssh_runner(t)->run("true", 10s);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code == Errc::auth);
  CHECK(count_of(d->log(), "Accepted publickey") == 0);  // nothing was sent to an unverified host
}

TEST_CASE("ssh: a changed host key is refused as a possible attack, and the fix works") {
  SKIP_WITHOUT_SSHD();
  auto d = start_sshd();
  REQUIRE(make_ssh_runner(d->target("n-changed"))->run("true", 10s).ok());
  REQUIRE(d->change_host_key().ok());
  // (A session opened before the change would still talk to the old, already verified
  // connection; every new connection sees the new key.)
  auto runner = make_ssh_runner(d->target("n-changed"));
  auto r = runner->run("true", 10s);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code == Errc::auth);
  std::string msg = r.error().message;
  INFO(msg);
  CHECK(contains(msg, "HOST KEY CHANGED"));
  CHECK(contains(msg, "attack"));
  CHECK(contains(msg, "node n-changed"));
  CHECK(contains(msg,
                 fmt::format("ssh-keygen -f {} -R '[127.0.0.1]:{}'", d->known_hosts(), d->port())));
  // Following the message's advice (remove the old key, scan the new one) makes it work.
  auto fix = msg.substr(msg.find("run: ") + 5);
  auto done = run_shell(fix, 30s);
  REQUIRE(done.ok());
  CHECK_MESSAGE(done->success(), fix << ": " << done->err);
  auto ok = runner->run("echo fixed", 10s);
  REQUIRE_MESSAGE(ok.ok(), ok.error().message);
  CHECK(ok->out == "fixed\n");
}

TEST_CASE("ssh: a wrong user key names user, host and identity") {
  SKIP_WITHOUT_SSHD();
  auto d = start_sshd();
  auto wrong = d->make_wrong_identity();
  REQUIRE(wrong.ok());
  auto t = d->target("n-key");
  t.identity = *wrong;
  auto r = make_ssh_runner(t)->run("true", 10s);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code == Errc::auth);
  INFO(r.error().message);
  CHECK(contains(r.error().message, d->user() + "@127.0.0.1"));
  CHECK(contains(r.error().message, *wrong));
  CHECK(contains(r.error().message, "authorized_keys"));

  t.identity = d->dir() + "/no-such-key";
  auto missing = make_ssh_runner(t)->run("true", 10s);
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.error().code == Errc::not_found);
  CHECK(contains(missing.error().message, "no-such-key"));
}

TEST_CASE("ssh: without SSH_IDENTITY the agent's keys are used") {
  SKIP_WITHOUT_SSHD();
  if (::access("/usr/bin/ssh-agent", X_OK) != 0) {
    MESSAGE("SKIP: ssh-agent not installed");
    return;
  }
  auto d = start_sshd();
  TempDir tmp;
  std::string sock = tmp / "agent.sock";
  ProcessSpec agent_spec;
  agent_spec.argv = {"ssh-agent", "-D", "-a", sock};
  auto agent = ChildProcess::start(agent_spec, tmp / "agent.log");
  REQUIRE(agent.ok());
  for (int i = 0; i < 500 && ::access(sock.c_str(), F_OK) != 0; ++i)
    std::this_thread::sleep_for(10ms);
  ProcessSpec add;
  add.argv = {"ssh-add", d->identity()};
  add.env = {{"SSH_AUTH_SOCK", sock}};
  auto added = run_process(add);
  REQUIRE(added.ok());
  REQUIRE_MESSAGE(added->success(), added->err);

  // The agent is found through SSH_AUTH_SOCK, as ssh(1) finds it.
  struct AuthSock {
    std::optional<std::string> old;
    explicit AuthSock(const std::string& s) {
      if (const char* o = ::getenv("SSH_AUTH_SOCK")) old = o;
      ::setenv("SSH_AUTH_SOCK", s.c_str(), 1);
    }
    ~AuthSock() {
      if (old)
        ::setenv("SSH_AUTH_SOCK", old->c_str(), 1);
      else
        ::unsetenv("SSH_AUTH_SOCK");
    }
  } auth_sock(sock);
  auto t = d->target("n-agent");
  t.identity.clear();
  auto r = make_ssh_runner(t)->run("echo via agent", 10s);
  REQUIRE_MESSAGE(r.ok(), r.error().message);
  CHECK(r->out == "via agent\n");

  // An empty agent (and no authorized ~/.ssh/id_*) is refused, naming what was tried.
  ProcessSpec del;
  del.argv = {"ssh-add", "-D"};
  del.env = {{"SSH_AUTH_SOCK", sock}};
  REQUIRE(run_process(del).ok());
  auto refused = make_ssh_runner(t)->run("true", 10s);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.error().code == Errc::auth);
  CHECK(contains(refused.error().message, "agent"));
}

TEST_CASE("ssh: a closed port is a network error naming the node") {
  SKIP_WITHOUT_SSHD();
  auto d = start_sshd();
  auto t = d->target("n-down");
  d->stop();  // nothing listens on that port any more
  auto r = make_ssh_runner(t)->run("true", 10s);
  REQUIRE_FALSE(r.ok());
  CHECK(r.error().code == Errc::network);
  INFO(r.error().message);
  CHECK(contains(r.error().message, "n-down"));
  CHECK(contains(r.error().message, "refused"));  // refused at once, not timed out
}

TEST_CASE("ssh: a node that accepts but never speaks SSH times out within the deadline") {
  // A listening socket nobody accepts from: the kernel completes the TCP handshake, then
  // silence (a hung sshd, a wrong service on the port).
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(fd, 8) == 0);
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  SshTarget t;
  t.node = "n-silent";
  t.host = "127.0.0.1";
  t.port = ntohs(a.sin_port);
  // First the call's deadline is the tighter bound, then the connect timeout.
  for (auto [deadline, connect] : {std::pair{700ms, 5000ms}, std::pair{10000ms, 800ms}}) {
    t.connect_timeout = connect;
    auto r = make_ssh_runner(t)->run("true", deadline);
    REQUIRE_FALSE(r.ok());
    INFO(r.error().message);
    CHECK(r.error().code == Errc::timeout);
    CHECK(contains(r.error().message, "n-silent"));
    // The tighter bound ended it, and the message names it.
    CHECK(contains(r.error().message, deadline < connect
                                          ? "the call's deadline"
                                          : "the connect timeout, SSH_TIMEOUT: 0.8 s"));
  }
  ::close(fd);
}

TEST_CASE("ssh: fan_out runs on every node at once and reports per node") {
  SKIP_WITHOUT_SSHD();
  std::vector<std::unique_ptr<Sshd>> servers;
  std::vector<std::unique_ptr<Runner>> owned;
  std::vector<Runner*> runners;
  for (int i = 0; i < 3; ++i) {
    servers.push_back(start_sshd());
    owned.push_back(make_ssh_runner(servers.back()->target(fmt::format("n{}", i))));
    runners.push_back(owned.back().get());
  }
  // A barrier: each command leaves a marker, then waits (at most 30 s) until it sees all
  // three. Run at once, every command gets past it; run one after another, the first
  // could never see the others' markers and gives up with status 7, however fast or slow
  // the machine.
  TempDir meet;
  const std::string cmd = fmt::format(
      "d={}; touch $d/$$; i=0; while [ $(ls $d | wc -l) -lt 3 ] && [ $i -lt 600 ]; do "
      "sleep 0.05; i=$((i+1)); done; [ $(ls $d | wc -l) -ge 3 ] || exit 7; echo $SSH_CONNECTION",
      meet.path());
  auto res = fan_out(runners, {cmd}, 60s);
  REQUIRE(res.size() == 3);
  for (int i = 0; i < 3; ++i) {
    CHECK(res[i].node == fmt::format("n{}", i));
    REQUIRE_MESSAGE(res[i].result.ok(), res[i].result.error().message);
    CHECK(res[i].result->exit_status == 0);  // it met the other two while it ran
    auto lines = split_list(res[i].result->out, '\n');
    REQUIRE(lines.size() == 1);
    // SSH_CONNECTION ends with the server's port: each node answered from its own sshd.
    CHECK(ends_with(lines[0], " " + std::to_string(servers[i]->port())));
  }

  // Per-node commands; one node failing does not spoil the others.
  auto local = make_local_runner("here");
  runners.push_back(local.get());
  servers[1]->stop();
  auto down = make_ssh_runner(servers[1]->target("n1"));
  runners[1] = down.get();
  auto mixed = fan_out(runners, {"echo 0", "echo 1", "echo 2", "echo local"}, 10s);
  REQUIRE(mixed.size() == 4);
  CHECK(mixed[0].result.ok());
  CHECK(mixed[2].result.ok());
  CHECK(mixed[2].result->out == "2\n");
  REQUIRE_FALSE(mixed[1].result.ok());  // its server is down
  CHECK(mixed[1].result.error().code == Errc::network);
  CHECK(mixed[1].node == "n1");
  REQUIRE(mixed[3].result.ok());
  CHECK(mixed[3].result->out == "local\n");

  auto wrong_count = fan_out(runners, {"a", "b"}, 1s);
  for (auto& nr : wrong_count) CHECK(nr.result.error().code == Errc::internal);
}

TEST_CASE("remote: the local runner runs here with the same contract") {
  auto r = make_local_runner("me");
  CHECK(r->is_local());
  auto ok = r->run("echo hi; exit 4", 10s);
  REQUIRE(ok.ok());
  CHECK(ok->out == "hi\n");
  CHECK(ok->exit_status == 4);
  auto in = r->run("cat", 10s, "data");
  REQUIRE(in.ok());
  CHECK(in->out == "data");
  auto slow = r->run("sleep 30", 300ms);
  REQUIRE_FALSE(slow.ok());
  CHECK(slow.error().code == Errc::timeout);
  CHECK(contains(slow.error().message, "me"));
  CHECK(contains(slow.error().message, "did not finish within 0.3 s"));  // the deadline ended it
}

TEST_CASE("remote: make_runner and ssh_target follow the cluster file") {
  SKIP_WITHOUT_SSHD();
  auto d = start_sshd();
  Environment env;
  std::vector<Diagnostic> diags;
  std::string text = fmt::format(
      "SSH_IDENTITY={}\nSSH_KNOWN_HOSTS={}\nSSH_TIMEOUT=3s\nSSH_USER={}\n"
      "NODE0_SSH=local\nNODE0_NAME=head\n"
      "NODE1_NAME=worker\nNODE1_SSH=127.0.0.1:{}\nNODE1_FABRIC_IP=10.254.0.2\n",
      d->identity(), d->known_hosts(), d->user(), d->port());
  auto cfg = load_config_text(text, "ring.env", env, &diags);
  REQUIRE_MESSAGE(cfg.ok(), cfg.error().message);
  auto t = ssh_target(*cfg, cfg->nodes[1]);
  CHECK(t.node == "worker");
  CHECK(t.host == "127.0.0.1");
  CHECK(t.port == d->port());
  CHECK(t.user == d->user());
  CHECK(t.identity == d->identity());
  CHECK(t.known_hosts == d->known_hosts());
  CHECK(t.connect_timeout == 3000ms);
  auto head = make_runner(*cfg, cfg->nodes[0]);
  auto worker = make_runner(*cfg, cfg->nodes[1]);
  CHECK(head->is_local());
  CHECK_FALSE(worker->is_local());
  auto res = fan_out({head.get(), worker.get()}, {"echo $SSH_CONNECTION"}, 10s);
  REQUIRE(res[0].result.ok());
  REQUIRE_MESSAGE(res[1].result.ok(), res[1].result.error().message);
  CHECK(trim(res[0].result->out).empty());  // ran here, not over SSH
  CHECK(ends_with(trim(res[1].result->out), " " + std::to_string(d->port())));
}

TEST_CASE("ssh: nodes in network namespaces are reached by their addresses") {
  SKIP_WITHOUT_SSHD();
  if (auto why = netns_unavailable_reason(); !why.empty()) {
    MESSAGE("SKIP: " << why);
    return;
  }
  auto net = NetNs::create({.hosts = 3});
  REQUIRE_MESSAGE(net.ok(), net.error().message);
  auto& n = **net;
  // Host 0 is the head (the client); hosts 1 and 2 run sshd on port 22 of their address.
  auto s1 = start_sshd({.host = n.ip(1), .netns = n.ns(1)});
  auto s2 = start_sshd({.host = n.ip(2), .netns = n.ns(2), .identity = s1->identity()});
  CHECK(s1->port() == 22);
  auto t1 = s1->target("ns-node1");
  auto t2 = s2->target("ns-node2");
  std::vector<NodeResult> res;
  REQUIRE(n.run_in(0, [&] {
             auto r1 = make_ssh_runner(t1);
             auto r2 = make_ssh_runner(t2);
             res = fan_out({r1.get(), r2.get()}, {"ip -4 -o addr show dev " + n.ifname(0)}, 20s);
           }).ok());
  REQUIRE(res.size() == 2);
  for (int i = 0; i < 2; ++i) {
    REQUIRE_MESSAGE(res[i].result.ok(), res[i].result.error().message);
    CHECK(contains(res[i].result->out, n.ip(i + 1) + "/24"));  // it ran in that namespace
  }

  // The node drops every connection (sshd and its sessions die) and comes back: the
  // runner's reused session is dead, and the next call reconnects by itself.
  std::vector<std::string> outs;
  REQUIRE(n.run_in(0, [&] {
             auto r1 = make_ssh_runner(t1);
             auto first = r1->run("echo one", 10s);
             outs.push_back(first.ok() ? first->out : first.error().message);
             auto kill = run_shell("ip netns pids " + n.ns(1) + " | xargs -r kill -9", 10s);
             outs.push_back(kill.ok() && kill->success() ? "killed" : "kill failed");
             auto back = s1->restart();
             outs.push_back(back.ok() ? "restarted" : back.message());
             auto second = r1->run("echo two", 10s);
             outs.push_back(second.ok() ? second->out : second.error().message);
           }).ok());
  REQUIRE(outs.size() == 4);
  CHECK(outs[0] == "one\n");
  CHECK(outs[1] == "killed");
  CHECK(outs[2] == "restarted");
  CHECK(outs[3] == "two\n");
}
