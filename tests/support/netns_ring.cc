#include "support/netns_ring.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <thread>

#include "core/http_client.h"
#include "core/strings.h"

namespace spark::test {

using namespace std::chrono_literals;
using nlohmann::json;

bool pid_alive(int pid) {
  if (pid <= 0) return false;
  auto st = read_file(fmt::format("/proc/{}/stat", pid));
  if (!st) return false;
  auto p = st->rfind(')');
  return p != std::string::npos && p + 2 < st->size() && (*st)[p + 2] != 'Z';
}

std::string CtlRun::all() const {
  // The reason first: a failed check's log keeps only its first lines.
  std::string why;
  if (j.is_object() && j.contains("error") && j["error"].is_object())
    why = j["error"].value("message", "");
  return fmt::format("rc {}{}{}\nstderr:\n{}\nstdout:\n{}", rc, why.empty() ? "" : ": ", why, err,
                     out);
}

std::string NetnsRing::node_name(int rank) {
  return fmt::format("node{}", rank);
}

Result<std::unique_ptr<NetnsRing>> NetnsRing::create(const NetnsRingOptions& opts) {
  if (opts.ranks < 2 || opts.ranks > 4)
    return make_error(Errc::usage, fmt::format("netns ring fixture: ranks={} (2..4)", opts.ranks));
  if (opts.sparkctl_bin.empty() || opts.sparkd_bin.empty() || opts.fault_server_bin.empty())
    return make_error(Errc::usage, "netns ring fixture: sparkctl, sparkd and fault server needed");
  std::unique_ptr<NetnsRing> r(new NetnsRing());
  r->opts_ = opts;
  // Host 0 is the head; hosts 1..ranks carry the ranks. More than two hosts: a bridge.
  auto net = NetNs::create({.hosts = opts.ranks + 1, .links = 1, .mtu = 1500});
  if (!net) return net.error();
  r->net_ = std::move(*net);
  std::string known;
  for (int k = 0; k < opts.ranks; ++k) {
    SshdOptions so{.host = r->net_->ip(k + 1), .netns = r->rank_ns(k)};
    if (k > 0) so.identity = r->sshd_[0]->identity();
    auto s = Sshd::start(so);
    if (!s)
      return make_error(s.error().code,
                        fmt::format("netns ring fixture: rank {}: {}", k, s.error().message));
    known += (*s)->known_hosts_line() + "\n";
    r->sshd_.push_back(std::move(*s));
  }
  std::string known_hosts = r->dir_.write("known_hosts", known);

  const std::string& dir = r->dir_.path();
  std::string cfg = fmt::format(
      "RING_NAME=nsring\nMODEL=demo\nENGINE=exec\n"
      "ENGINE_EXEC='m=healthy; a=0s; if [ -f {dir}/once-$SPARK_RANK ]; then "
      "read m a < {dir}/once-$SPARK_RANK; rm -f {dir}/once-$SPARK_RANK; fi; "
      "exec {fault} --port {eport} --mode $m --after $a --watch-pid $SPARKD_PID'\n"
      "ENGINE_HEALTH_URL=http://127.0.0.1:{eport}/health\n"
      "ENGINE_API_URL=http://127.0.0.1:{eport}\nPROBE_EXPECT=Paris\n"
      "API_PORT={api}\nRDZV_PORT={rdzv}\nSTATE_DIR={dir}/state\n"
      "SPARKD_BIN={sparkd}\nSPARKCTL_BIN={sparkctl}\n"
      "SSH_IDENTITY={id}\nSSH_KNOWN_HOSTS={kh}\nSSH_TIMEOUT=5s\nMTU_MIN=1500\n"
      "HEARTBEAT_INTERVAL=200ms\nHEARTBEAT_TIMEOUT=1500ms\nSTALL_TIMEOUT=2s\nJOIN_TIMEOUT=15s\n"
      "SHUTDOWN_GRACE=2s\nSTOP_GRACE=6s\nREADY_TIMEOUT=30s\nMEM_FREE_MIN=1MiB\nMEM_WAIT=2s\n"
      "WATCH_GRACE=0s\nWATCH_FAILURES=3\nWATCH_BACKOFF=0s\nSTART_CHECKS=ssh.reach,port.free\n"
      "WATCH_ALERT_CMD='echo \"$SPARK_EVENT $SPARK_REASON\" >> {dir}/alerts'\n",
      fmt::arg("dir", dir), fmt::arg("fault", opts.fault_server_bin),
      fmt::arg("eport", kEnginePort), fmt::arg("api", kApiPort), fmt::arg("rdzv", kRdzvPort),
      fmt::arg("sparkd", opts.sparkd_bin), fmt::arg("sparkctl", opts.sparkctl_bin),
      fmt::arg("id", r->sshd_[0]->identity()), fmt::arg("kh", known_hosts));
  for (int k = 0; k < opts.ranks; ++k)
    cfg += fmt::format(
        "NODE{k}_NAME={name}\nNODE{k}_SSH={user}@{ip}:22\nNODE{k}_FABRIC_IP={ip}\n"
        "NODE{k}_NETDEVS={dev}\n",
        fmt::arg("k", k), fmt::arg("name", node_name(k)),
        fmt::arg("user", r->sshd_[static_cast<size_t>(k)]->user()),
        fmt::arg("ip", r->net_->ip(k + 1)), fmt::arg("dev", r->net_->ifname(0)));
  for (const auto& l : opts.extra_config) cfg += l + "\n";
  r->config_ = r->dir_.write("ring.env", cfg);
  return r;
}

NetnsRing::~NetnsRing() {
  // The sshds stop first (SIGTERM, bounded), then the namespaces go: deleting them SIGKILLs
  // whatever a failed test left inside (sparkd, engines, a sparkctl in the head).
  sshd_.clear();
  net_.reset();
}

std::string NetnsRing::state(const std::string& file) const {
  return dir_ / ("state/" + file);
}

std::vector<std::string> NetnsRing::sparkctl_argv(const std::vector<std::string>& args) const {
  std::vector<std::string> argv = {"/usr/bin/env",     "ip",       "netns", "exec", head_ns(),
                                   opts_.sparkctl_bin, "--config", config_};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

CtlRun run_ctl(const ProcessSpec& spec) {
  CtlRun o;
  auto r = run_process(spec);
  if (!r) {
    o.err = r.error().message;
    return o;
  }
  o.rc = r->timed_out ? -2 : r->exit_status;
  o.out = r->out;
  o.err = r->err;
  o.j = json::parse(o.out, nullptr, false);
  return o;
}

CtlRun NetnsRing::ctl(const std::vector<std::string>& args,
                      std::chrono::milliseconds timeout) const {
  ProcessSpec spec;
  spec.argv = sparkctl_argv(args);
  spec.env = env;
  spec.timeout = timeout;
  return run_ctl(spec);
}

CtlRun NetnsRing::ctl_json(std::vector<std::string> args, std::chrono::milliseconds timeout) const {
  args.insert(args.begin(), "--json");
  return ctl(args, timeout);
}

void NetnsRing::fault_once(int rank, const std::string& mode, const std::string& after) const {
  dir_.write(fmt::format("once-{}", rank), mode + " " + after + "\n");
}

std::optional<json> NetnsRing::health() const {
  std::optional<json> out;
  (void)run_in_netns(rank_ns(0), [&] {
    HttpCall c;
    c.port = static_cast<uint16_t>(kApiPort);
    c.target = "/health";
    c.timeout = 1000ms;
    auto r = http_call(c);
    if (r.ok()) {
      json j = json::parse(r->body, nullptr, false);
      if (j.is_object()) out = std::move(j);
    }
  });
  return out;
}

bool NetnsRing::wait_health(const std::function<bool(const json&)>& pred,
                            std::chrono::milliseconds limit) const {
  auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (auto h = health(); h && pred(*h)) return true;
    std::this_thread::sleep_for(100ms);
  }
  return false;
}

namespace {

// The pids inside namespace `ns` (ip netns pids).
std::vector<int> netns_pids(const std::string& ns) {
  ProcessSpec s;
  s.argv = {"ip", "netns", "pids", ns};
  s.timeout = 10s;
  std::vector<int> out;
  auto r = run_process(s);
  if (!r || !r->success()) return out;
  for (const auto& p : split_list(r->out, '\n'))
    if (auto v = parse_i64(p)) out.push_back(static_cast<int>(*v));
  return out;
}

// The file name of the program pid runs ("" when it is gone).
std::string exe_name(int pid) {
  std::error_code ec;
  auto p = std::filesystem::read_symlink(fmt::format("/proc/{}/exe", pid), ec);
  return ec ? std::string() : p.filename().string();
}

std::string cmdline(int pid) {
  std::string c = read_file(fmt::format("/proc/{}/cmdline", pid)).value_or("");
  std::replace(c.begin(), c.end(), '\0', ' ');
  return std::string(trim(c));
}

}  // namespace

std::vector<int> NetnsRing::sparkd_pids(int rank) const {
  std::string sparkd = std::filesystem::path(opts_.sparkd_bin).filename().string();
  std::vector<int> out;
  for (int pid : netns_pids(rank_ns(rank)))
    if (pid_alive(pid) && exe_name(pid) == sparkd) out.push_back(pid);
  return out;
}

std::vector<std::string> NetnsRing::leftovers() const {
  std::string sparkd = std::filesystem::path(opts_.sparkd_bin).filename().string();
  std::string fault = std::filesystem::path(opts_.fault_server_bin).filename().string();
  std::vector<std::string> left;
  for (int k = 0; k < opts_.ranks; ++k) {
    const std::string& ns = rank_ns(k);
    for (int pid : netns_pids(ns)) {
      if (!pid_alive(pid)) continue;
      std::string exe = exe_name(pid);
      if (exe == sparkd || exe == fault)
        left.push_back(
            fmt::format("rank {} (ns {}): {} pid {}: {}", k, ns, exe, pid, cmdline(pid)));
    }
    // Nobody listens on the ring's ports any more (API, rendezvous, engine).
    auto ss = exec_in_netns(ns, "ss -Hltn", 10s);
    if (!ss || !ss->success()) {
      left.push_back(fmt::format("rank {} (ns {}): cannot list listeners: {}", k, ns,
                                 ss ? ss->err : ss.error().message));
      continue;
    }
    for (const auto& line : split_list(ss->out, '\n'))
      for (int port : {kApiPort, kRdzvPort, kEnginePort})
        if (line.find(fmt::format(":{} ", port)) != std::string::npos)
          left.push_back(
              fmt::format("rank {} (ns {}): listener {}", k, ns, std::string(trim(line))));
  }
  return left;
}

std::string NetnsRing::logs() const {
  std::string s;
  for (int k = 0; k < opts_.ranks; ++k)
    s += fmt::format("--- rank {} log\n{}{}", k,
                     read_file(state(fmt::format("logs/sparkd-{}.log", k))).value_or(""),
                     read_file(state(fmt::format("logs/sparkd-{}.out", k))).value_or(""));
  return s;
}

std::string NetnsRing::alerts() const {
  return read_file(dir_ / "alerts").value_or("");
}

json NetnsRing::watch_record() const {
  return json::parse(read_file(state("watch.json")).value_or("{}"), nullptr, false);
}

}  // namespace spark::test
