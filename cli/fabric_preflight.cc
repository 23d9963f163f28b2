#include "cli/fabric_preflight.h"

#include <fmt/format.h>

#include <chrono>
#include <thread>

#include "cli/node_exec.h"
#include "cli/ring_ops.h"
#include "core/process.h"
#include "core/strings.h"
#include "env/rank_env.h"

namespace spark::cli {

using nlohmann::json;

bool FabricPreflight::passed() const {
  if (!errors.empty() || ranks.empty()) return false;
  for (const auto& r : ranks)
    if (!r.passed()) return false;
  return true;
}

FabricPreflight run_fabric_preflight(const RingConfig& cfg, const PreflightRun& run) {
  FabricPreflight f;
  const auto t0 = std::chrono::steady_clock::now();
  auto since = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  // The pins come from the same facts start uses: the RDMA checks of every node.
  PreflightRun facts = run;
  facts.filter.only = {"rdma"};
  facts.filter.skip.clear();
  std::vector<int> all;
  for (const auto& n : cfg.nodes) all.push_back(n.index);
  std::vector<env::NodeReport> reports;
  for (auto& o : collect_node_reports(cfg, facts, all)) {
    if (o.error) f.errors.push_back(fmt::format("{}: {}", o.node, o.error->message));
    if (o.report) reports.push_back(std::move(*o.report));
  }
  if (!f.errors.empty()) {
    f.seconds = since();
    return f;
  }
  const auto ranks = cfg.ranks();
  const std::string store_host =
      cfg.nodes.front().fabric_ip.empty() ? "127.0.0.1" : cfg.nodes.front().fabric_ip;
  const std::string port = cfg.get("RDZV_PORT");
  std::vector<int> nodes;
  std::vector<std::string> cmds;
  for (const auto& p : ranks) {
    env::NodeReport rep;
    rep.index = p.node;
    rep.node = cfg.nodes.at(static_cast<size_t>(p.node)).name;
    for (const auto& r : reports)
      if (r.index == p.node) rep = r;
    auto e = env::render_rank_env(cfg, p.rank, rep);
    if (!e) {
      f.errors.push_back(fmt::format("rank {}: {}", p.rank, e.error().message));
      continue;
    }
    const NodeConfig& node = cfg.nodes.at(static_cast<size_t>(p.node));
    std::string c = "env";
    for (const auto& [k, v] : e->vars) c += " " + shell_quote(k + "=" + v);
    c += fmt::format(
        " {} fabric-rank --rank {} --world {} --store {} --bind {} --node {} --min-busbw {} "
        "--timeout {}",
        shell_quote(ring_layout(cfg, run.sparkctl_bin).sparkd_bin), p.rank, ranks.size(),
        shell_quote(store_host + ":" + port),
        shell_quote(node.fabric_ip.empty() ? "127.0.0.1" : node.fabric_ip), shell_quote(node.name),
        shell_quote(cfg.get("FABRIC_MIN_BUSBW").empty() ? "0" : cfg.get("FABRIC_MIN_BUSBW")),
        shell_quote(std::to_string(run.timeout.count()) + "ms"));
    nodes.push_back(p.node);
    cmds.push_back(c);
  }
  if (!f.errors.empty()) {
    f.seconds = since();
    return f;
  }
  // The sweep itself takes seconds; NCCL's first connect (and the join) bound the rest.
  auto results = exec_on_nodes(cfg, nodes, cmds, "", run.timeout + std::chrono::seconds(120));
  for (size_t k = 0; k < results.size(); ++k) {
    const auto& r = results[k];
    const std::string who = fmt::format("rank {} ({})", ranks[k].rank, r.node);
    if (!r.result) {
      f.errors.push_back(fmt::format("{}: {}", who, r.result.error().message));
      continue;
    }
    json j = json::parse(r.result->out, nullptr, false);
    if (j.is_object() && j.contains("error") && j["error"].is_object()) {
      f.errors.push_back(
          fmt::format("{}: {}", who, j["error"].value("message", std::string("failed"))));
      continue;
    }
    auto rep = j.is_object() ? env::fabric_report_from_json(j)
                             : Result<env::FabricReport>(Error{Errc::remote, ""});
    if (!rep) {
      const std::string both = r.result->err + r.result->out;
      const std::string tail(trim(both).substr(0, 400));
      f.errors.push_back(fmt::format("{}: fabric-rank printed no report (exit {}): {}", who,
                                     r.result->exit_status, tail));
      continue;
    }
    f.ranks.push_back(std::move(*rep));
  }
  f.seconds = since();
  return f;
}

std::string render_fabric_preflight(const FabricPreflight& f) {
  std::string out = env::render_fabric_table(f.ranks);
  for (const auto& e : f.errors) out += "# ERROR " + e + "\n";
  out += fmt::format("# fabric {} ({} rank(s), {:.1f} s)\n", f.passed() ? "PASSED" : "FAILED",
                     f.ranks.size(), f.seconds);
  return out;
}

json fabric_preflight_to_json(const FabricPreflight& f) {
  json ranks = json::array();
  for (const auto& r : f.ranks) ranks.push_back(env::to_json(r));
  return {{"passed", f.passed()}, {"seconds", f.seconds}, {"ranks", ranks}, {"errors", f.errors}};
}

}  // namespace spark::cli
