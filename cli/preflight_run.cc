// The head side of preflight: ask every node for its report at once, merge, then the
// cross-node probes (pings, bandwidth).
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <iostream>
#include <iterator>
#include <map>
#include <sstream>

#include "cli/cmd_preflight.h"
#include "cli/node_exec.h"
#include "core/process.h"
#include "core/strings.h"
#include "env/bwtest.h"
#include "env/facts.h"

namespace spark::cli {

using env::NodeOutcome;
using env::NodeReport;
using nlohmann::json;

std::string config_wire_text(const RingConfig& cfg) {
  std::string out = "# the head's resolved cluster file (sparkctl preflight)\n";
  for (const auto& [k, s] : cfg.settings) {
    if (s.value.empty()) continue;
    std::string q;
    for (char c : s.value) {
      switch (c) {
        case '"':
          q += "\\\"";
          break;
        case '\\':
          q += "\\\\";
          break;
        case '\n':
          q += "\\n";
          break;
        case '\t':
          q += "\\t";
          break;
        case '$':
          q += "\\$";
          break;
        default:
          q += c;
      }
    }
    out += fmt::format("{}=\"{}\"\n", k, q);
  }
  return out;
}

Result<int> this_node(const RingConfig& cfg, int requested) {
  if (requested >= 0) {
    if (requested >= static_cast<int>(cfg.nodes.size()))
      return make_error(Errc::usage, fmt::format("--node {}: the ring has nodes 0-{}", requested,
                                                 cfg.nodes.size() - 1));
    return requested;
  }
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  for (const auto& n : cfg.nodes)
    if (n.name == host || n.ssh_host == host) return n.index;
  int local = -1, count = 0;
  for (const auto& n : cfg.nodes)
    if (n.local) {
      local = n.index;
      ++count;
    }
  if (count == 1) return local;
  return make_error(Errc::usage, fmt::format("cannot tell which node this is (hostname {}): pass "
                                             "--node N",
                                             host));
}

namespace {

std::string filter_args(const env::CheckFilter& f) {
  std::string s;
  if (!f.only.empty()) s += " --only " + shell_quote(join(f.only, ","));
  if (!f.skip.empty()) s += " --skip " + shell_quote(join(f.skip, ","));
  return s;
}

std::string tail_of(const std::string& s, size_t n = 300) {
  auto t = std::string(trim(s));
  return t.size() > n ? "..." + t.substr(t.size() - n) : t;
}

}  // namespace

std::vector<NodeOutcome> collect_node_reports(const RingConfig& cfg, const PreflightRun& opt,
                                              const std::vector<int>& nodes) {
  std::vector<NodeOutcome> outcomes(nodes.size());
  std::vector<int> remote;
  std::vector<size_t> remote_slot;
  std::vector<std::string> commands;
  std::string wire = config_wire_text(cfg);
  for (size_t k = 0; k < nodes.size(); ++k) {
    const auto& n = cfg.nodes.at(static_cast<size_t>(nodes[k]));
    outcomes[k].node = n.name;
    outcomes[k].index = n.index;
    if (n.local) continue;
    remote.push_back(n.index);
    remote_slot.push_back(k);
    commands.push_back(fmt::format("{} --config - preflight --local --node {} --json{}{}",
                                   shell_quote(opt.sparkctl_bin), n.index, filter_args(opt.filter),
                                   opt.verbose ? " -v" : ""));
  }
  // The local node runs in this process while the others answer over SSH.
  std::vector<std::future<void>> local;
  for (size_t k = 0; k < nodes.size(); ++k) {
    const auto& n = cfg.nodes.at(static_cast<size_t>(nodes[k]));
    if (!n.local) continue;
    local.push_back(std::async(std::launch::async, [&, k, idx = n.index] {
      auto t0 = std::chrono::steady_clock::now();
      outcomes[k].sent_ms = env::now_ms();
      outcomes[k].report =
          env::run_node_checks(cfg, idx, env::Sysroot("/"), opt.filter, opt.verbose);
      outcomes[k].recv_ms = env::now_ms();
      outcomes[k].seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }));
  }
  int64_t sent = env::now_ms();
  auto results = run_on_nodes(cfg, jobs_on(remote, commands, wire), opt.timeout);
  int64_t recv = env::now_ms();
  for (size_t r = 0; r < results.size(); ++r) {
    auto& o = outcomes[remote_slot[r]];
    const auto* res = &results[r];
    o.sent_ms = sent;
    o.recv_ms = recv;
    if (!res->ok()) {
      o.error = *res->error;
      continue;
    }
    o.seconds = res->seconds;
    json j = json::parse(res->out, nullptr, false);
    if (j.is_object() && j.contains("error")) {
      o.error = make_error(Errc::remote, fmt::format("{}: sparkctl preflight --local: {}", o.node,
                                                     j["error"].value("message", "failed")));
      continue;
    }
    auto rep = j.is_discarded() ? Result<NodeReport>(make_error(Errc::remote, "no JSON"))
                                : env::report_from_json(j);
    if (!rep) {
      o.error = make_error(
          Errc::remote,
          fmt::format("{}: `{}` exited {} without a node report{}{} (is sparkctl installed there? "
                      "SPARKCTL_BIN)",
                      o.node, opt.sparkctl_bin, res->exit_status, res->err.empty() ? "" : ": ",
                      tail_of(res->err)));
      continue;
    }
    rep->node = o.node;
    o.report = std::move(*rep);
  }
  for (auto& f : local) f.get();
  return outcomes;
}

namespace {

// net.path: every node pings every peer on every twin, in parallel on each node.
std::vector<env::CheckResult> run_pings(const RingConfig& cfg, const PreflightRun& /*opt*/,
                                        const std::vector<NodeReport>& reports) {
  auto plans = env::plan_pings(reports);
  std::map<int, std::vector<size_t>> by_node;
  for (size_t i = 0; i < plans.size(); ++i) by_node[plans[i].node_index].push_back(i);
  std::vector<int> nodes;
  std::vector<std::string> commands;
  for (const auto& [node, idx] : by_node) {
    std::string script;
    for (size_t i : idx)
      script += fmt::format(
          "(out=$({} 2>&1); rc=$?; echo \"@@{} $rc $(printf '%s' \"$out\" | tail -n 1)\") & ",
          plans[i].command, i);
    script += "wait";
    nodes.push_back(node);
    commands.push_back(script);
  }
  auto results = run_on_nodes(cfg, jobs_on(nodes, commands), std::chrono::milliseconds(10000));
  std::vector<env::PingResult> pings;
  for (auto& p : plans) pings.push_back(p.probe);
  std::vector<bool> seen(plans.size(), false);
  for (size_t r = 0; r < results.size(); ++r) {
    const auto* res = &results[r];
    if (!res->ok()) {
      for (size_t i : by_node[nodes[r]]) {
        pings[i].detail = res->error->message;
        seen[i] = true;
      }
      continue;
    }
    std::istringstream in(res->out);
    std::string line;
    while (std::getline(in, line)) {
      if (!starts_with(line, "@@")) continue;
      auto parts = split_list(line.substr(2), ' ');
      if (parts.size() < 2) continue;
      auto i = parse_u64(parts[0]);
      if (!i || *i >= plans.size()) continue;
      seen[*i] = true;
      pings[*i].ok = parts[1] == "0";
      auto sp = line.find(' ', line.find(' ') + 1);
      pings[*i].detail = sp == std::string::npos ? "" : line.substr(sp + 1);
      if (!pings[*i].ok && pings[*i].detail.empty()) pings[*i].detail = "no reply";
    }
  }
  for (size_t i = 0; i < pings.size(); ++i)
    if (!seen[i]) pings[i].detail = "no result from the node";
  return env::path_checks(pings);
}

// net.bandwidth: node k sends to node k+1 on every twin while receiving from k-1, all at once.
std::vector<env::CheckResult> run_bandwidth(const RingConfig& cfg, const PreflightRun& opt,
                                            const std::vector<NodeReport>& reports) {
  std::vector<env::BandwidthResult> runs;
  if (reports.size() < 2) return {};
  int base_port = static_cast<int>(cfg.get_int("RDZV_PORT")) + 10;
  std::vector<int> nodes;
  std::vector<std::string> commands;
  std::vector<std::vector<size_t>> run_of(reports.size());
  for (size_t k = 0; k < reports.size(); ++k) {
    const auto& me = reports[k];
    const auto& next = reports[(k + 1) % reports.size()];
    const auto& prev = reports[(k + reports.size() - 1) % reports.size()];
    std::string args;
    for (size_t t = 0; t < me.links.size(); ++t) {
      int port = base_port + static_cast<int>(t);
      if (t < prev.links.size() && !prev.links[t].ipv4.empty() && !me.links[t].ipv4.empty() &&
          (reports.size() > 2 || k == 1))
        args += " --bw-listen " + shell_quote(fmt::format("{}:{}", me.links[t].ipv4, port));
      if (t < next.links.size() && !next.links[t].ipv4.empty() && !me.links[t].ipv4.empty() &&
          (reports.size() > 2 || k == 0)) {
        args += " --bw-send " +
                shell_quote(fmt::format("{}>{}:{}", me.links[t].ipv4, next.links[t].ipv4, port));
        env::BandwidthResult b;
        b.from_node = me.node;
        b.to_node = next.node;
        b.netdev = me.links[t].netdev;
        b.line_rate_mbps = std::min(me.links[t].speed_mbps, next.links[t].speed_mbps);
        b.error = "no result from the node";
        run_of[k].push_back(runs.size());
        runs.push_back(b);
      }
    }
    if (args.empty()) continue;
    nodes.push_back(me.index);
    commands.push_back(fmt::format("{} preflight --bw-seconds {}{} --json",
                                   shell_quote(opt.sparkctl_bin), opt.bw_seconds, args));
  }
  auto results =
      run_on_nodes(cfg, jobs_on(nodes, commands),
                   std::chrono::milliseconds(static_cast<int>(opt.bw_seconds * 1000) + 20000));
  for (size_t r = 0; r < results.size(); ++r) {
    size_t k = 0;
    for (size_t i = 0; i < reports.size(); ++i)
      if (reports[i].index == nodes[r]) k = i;
    const auto* res = &results[r];
    json j = res->ok() ? json::parse(res->out, nullptr, false) : json();
    auto& mine = run_of[k];
    for (size_t s = 0; s < mine.size(); ++s) {
      auto& b = runs[mine[s]];
      if (!res->ok()) {
        b.error = res->error->message;
      } else if (!j.is_object() || !j.contains("sent") || s >= j["sent"].size()) {
        b.error =
            fmt::format("{}: bandwidth test gave no result ({})", b.from_node, tail_of(res->err));
      } else {
        b.error = j["sent"][s].value("error", "");
        b.gbps = j["sent"][s].value("gbps", 0.0);
      }
    }
  }
  return env::bandwidth_checks(runs);
}

}  // namespace

env::RingReport run_ring_preflight(const RingConfig& cfg, const PreflightRun& opt) {
  auto t0 = std::chrono::steady_clock::now();
  std::vector<int> all;
  for (const auto& n : cfg.nodes) all.push_back(n.index);
  auto outcomes = collect_node_reports(cfg, opt, all);
  auto rep = env::merge_reports(cfg, outcomes, opt.filter);
  if (opt.filter.enabled("net.path") && rep.nodes.size() > 1)
    env::add_checks(&rep, run_pings(cfg, opt, rep.nodes));
  if (opt.bandwidth && opt.filter.enabled("net.bandwidth") && rep.nodes.size() > 1)
    env::add_checks(&rep, run_bandwidth(cfg, opt, rep.nodes));
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rep;
}

}  // namespace spark::cli
