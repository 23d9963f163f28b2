#include "support/netns.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sched.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <filesystem>
#include <thread>

#include "core/strings.h"

namespace spark::test {
namespace {

using namespace std::chrono_literals;

constexpr const char* kNetnsDir = "/run/netns";

// Runs `ip [-n ns] -batch -` with the given commands (one per line; the batch syntax takes
// no global options, hence one batch per namespace).
Status ip_batch(const std::string& ns, const std::string& batch, const std::string& what) {
  if (batch.empty()) return {};
  ProcessSpec s;
  s.argv = {"ip"};
  if (!ns.empty()) s.argv.insert(s.argv.end(), {"-n", ns});
  s.argv.insert(s.argv.end(), {"-batch", "-"});
  s.input = batch;
  s.timeout = 30s;
  auto r = run_process(s);
  if (!r) return r.error();
  if (!r->success())
    return make_error(Errc::precondition, fmt::format("netns fixture: {} failed ({}): {}", what,
                                                      r->describe(), std::string(trim(r->err))));
  return {};
}

Status ip_cmd(const std::vector<std::string>& args) {
  ProcessSpec s;
  s.argv = {"ip"};
  s.argv.insert(s.argv.end(), args.begin(), args.end());
  s.timeout = 30s;
  auto r = run_process(s);
  if (!r) return r.error();
  if (!r->success())
    return make_error(Errc::precondition,
                      fmt::format("netns fixture: `{}` failed ({}): {}", shell_join(s.argv),
                                  r->describe(), std::string(trim(r->err))));
  return {};
}

// Kills every process inside `ns`, then deletes it.
void remove_netns(const std::string& ns) {
  ProcessSpec pids;
  pids.argv = {"ip", "netns", "pids", ns};
  pids.timeout = 10s;
  for (int round = 0; round < 3; ++round) {
    auto r = run_process(pids);
    if (!r || !r->success()) break;
    auto list = split_list(r->out, '\n');
    if (list.empty()) break;
    for (const auto& p : list)
      if (auto pid = parse_i64(p); pid && *pid > 1) ::kill(static_cast<pid_t>(*pid), SIGKILL);
    std::this_thread::sleep_for(20ms);
  }
  (void)ip_cmd({"netns", "delete", ns});
}

std::atomic<int> g_seq{0};

}  // namespace

std::string netns_unavailable_reason() {
  if (::geteuid() != 0) return "network namespaces need root (this test runs as a normal user)";
  auto r = run_shell("command -v ip", 10s);
  if (!r || !r->success()) return "iproute2 `ip` is not installed";
  std::string probe = fmt::format("spkprobe{}-{}", ::getpid(), g_seq++);
  auto add = run_shell("ip netns add " + probe, 10s);
  if (!add || !add->success())
    return "cannot create a network namespace: " +
           (add ? std::string(trim(add->err)) : add.error().message);
  // Creating one is not enough where the tests then fail (a chroot: `ip netns exec` mounts
  // /sys, and a veth pair needs the host's netlink): run in it and link to it as the
  // tests do, and skip with what failed.
  std::string veth = fmt::format("spkpv{}", g_seq++);
  std::string why;
  for (const auto& [what, cmd] :
       {std::pair<std::string, std::string>{
            "cannot run a command in a network namespace",
            fmt::format("ip netns exec {} ip link set lo up", probe)},
        {"cannot link a network namespace with a veth pair",
         fmt::format("ip link add {}a type veth peer name {}b netns {}", veth, veth, probe)}}) {
    auto ran = run_shell(cmd, 10s);
    if (!ran || !ran->success()) {
      why = fmt::format(
          "{} (`{}`): {}", what, cmd,
          ran ? std::string(trim(ran->err.empty() ? ran->out : ran->err)) : ran.error().message);
      break;
    }
  }
  (void)run_shell(fmt::format("ip link delete {}a 2>/dev/null", veth), 10s);
  remove_netns(probe);
  return why;
}

Status run_in_netns(const std::string& ns, const std::function<void()>& fn) {
  std::string path = std::string(kNetnsDir) + "/" + ns;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return make_error(Errc::not_found, fmt::format("network namespace {} not found ({}: {})", ns,
                                                   path, std::strerror(errno)));
  Status st;
  std::thread t([&] {
    if (::setns(fd, CLONE_NEWNET) != 0) {
      st = make_error(Errc::precondition,
                      fmt::format("setns into {}: {}", ns, std::strerror(errno)));
      return;
    }
    fn();
  });
  t.join();
  ::close(fd);
  return st;
}

Result<ProcessResult> exec_in_netns(const std::string& ns, const std::string& command,
                                    std::chrono::milliseconds timeout) {
  ProcessSpec s;
  s.argv = {"ip", "netns", "exec", ns, "/bin/sh", "-c", command};
  s.timeout = timeout;
  return run_process(s);
}

int sweep_stale_netns() {
  int removed = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(kNetnsDir, ec)) {
    std::string name = e.path().filename().string();
    std::string_view rest = name;
    if (starts_with(rest, "spkprobe"))
      rest.remove_prefix(8);
    else if (starts_with(rest, "spk"))
      rest.remove_prefix(3);
    else
      continue;
    auto dash = rest.find('-');
    if (dash == std::string_view::npos) continue;
    auto pid = parse_i64(rest.substr(0, dash));
    if (!pid) continue;
    if (::kill(static_cast<pid_t>(*pid), 0) == 0 || errno != ESRCH) continue;  // still alive
    remove_netns(name);
    ++removed;
  }
  return removed;
}

Result<std::unique_ptr<NetNs>> NetNs::create(const NetNsOptions& opts) {
  if (opts.hosts < 2 || opts.hosts > 32)
    return make_error(Errc::usage, fmt::format("netns fixture: hosts={} (2..32)", opts.hosts));
  if (opts.links < 1 || opts.links > 4)
    return make_error(Errc::usage, fmt::format("netns fixture: links={} (1..4)", opts.links));
  if (opts.ifname.empty() || opts.ifname.size() > 12)
    return make_error(Errc::usage, "netns fixture: ifname must be 1..12 characters");
  sweep_stale_netns();
  std::unique_ptr<NetNs> n(new NetNs());
  n->opts_ = opts;
  if (opts.hosts > 2) n->opts_.bridge = true;
  n->prefix_ = fmt::format("spk{}-{}", ::getpid(), g_seq++);
  n->octet_ = ::getpid() % 250;
  if (Status st = n->build(); !st.ok()) {
    n->teardown();
    return st.error();
  }
  return n;
}

NetNs::~NetNs() {
  teardown();
}

std::string NetNs::ip(int host, int link) const {
  return fmt::format("10.{}.{}.{}", 254 - link, octet_, host + 1);
}

std::string NetNs::ifname(int link) const {
  return fmt::format("{}{}", opts_.ifname, link);
}

Status NetNs::build() {
  std::string batch;
  for (int i = 0; i < opts_.hosts; ++i) {
    ns_.push_back(fmt::format("{}-h{}", prefix_, i));
    batch += "netns add " + ns_.back() + "\n";
  }
  if (opts_.bridge) {
    switch_ns_ = prefix_ + "-sw";
    batch += "netns add " + switch_ns_ + "\n";
  }
  SPARK_TRY(ip_batch({}, batch, "creating namespaces " + prefix_ + "-*"));

  // veth pairs are created straight into their namespaces, so names only need to be unique
  // inside each namespace.
  std::string sw, veths, ports;
  for (int l = 0; l < opts_.links; ++l) {
    if (opts_.bridge) {
      sw += fmt::format("link add br{} type bridge forward_delay 0\n", l);
      sw += fmt::format("link set br{} up\n", l);
      for (int i = 0; i < opts_.hosts; ++i) {
        veths +=
            fmt::format("link add h{}l{} netns {} mtu {} type veth peer name {} netns {} mtu {}\n",
                        i, l, switch_ns_, opts_.mtu, ifname(l), ns_[i], opts_.mtu);
        ports += fmt::format("link set h{}l{} master br{} up\n", i, l, l);
      }
    } else {
      veths += fmt::format("link add {} netns {} mtu {} type veth peer name {} netns {} mtu {}\n",
                           ifname(l), ns_[0], opts_.mtu, ifname(l), ns_[1], opts_.mtu);
    }
  }
  SPARK_TRY(ip_batch(switch_ns_, sw, "creating bridges in " + switch_ns_));
  SPARK_TRY(ip_batch({}, veths, "creating veth pairs for " + prefix_ + "-*"));
  SPARK_TRY(ip_batch(switch_ns_, ports, "attaching bridge ports in " + switch_ns_));
  for (int i = 0; i < opts_.hosts; ++i) {
    batch = "link set lo up\n";
    for (int l = 0; l < opts_.links; ++l) {
      batch += fmt::format("addr add {}/{} dev {}\n", ip(i, l), prefix_len(), ifname(l));
      batch += fmt::format("link set {} up\n", ifname(l));
    }
    SPARK_TRY(ip_batch(ns_[i], batch, "configuring " + ns_[i]));
  }
  return {};
}

void NetNs::teardown() {
  for (const auto& ns : ns_) remove_netns(ns);
  if (!switch_ns_.empty()) remove_netns(switch_ns_);
  ns_.clear();
  switch_ns_.clear();
}

Status NetNs::set_mtu(int host, int link, int mtu) {
  if (host < 0 || host >= hosts() || link < 0 || link >= links())
    return make_error(Errc::usage, fmt::format("netns fixture: no host {} link {}", host, link));
  std::string what = fmt::format("setting MTU {} on host {} link {}", mtu, host, link);
  SPARK_TRY(ip_batch(ns_[host], fmt::format("link set {} mtu {}\n", ifname(link), mtu), what));
  if (opts_.bridge)
    return ip_batch(switch_ns_, fmt::format("link set h{}l{} mtu {}\n", host, link, mtu), what);
  return ip_batch(ns_[1 - host], fmt::format("link set {} mtu {}\n", ifname(link), mtu), what);
}

Result<ProcessResult> NetNs::exec_in(int host, const std::string& command,
                                     std::chrono::milliseconds timeout) const {
  return exec_in_netns(ns(host), command, timeout);
}

Status NetNs::run_in(int host, const std::function<void()>& fn) const {
  return run_in_netns(ns(host), fn);
}

}  // namespace spark::test
