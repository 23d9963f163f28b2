#include "cli/fabric_preflight.h"

#include <fmt/format.h>

#include <chrono>
#include <thread>

#include "cli/args.h"
#include "cli/node_exec.h"
#include "core/process.h"
#include "core/strings.h"
#include "daemon/engine/gloo_collective.h"
#include "daemon/engine/nccl_collective.h"
#include "daemon/engine/tcp_store.h"
#include "env/nccl_env.h"
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
        " {} fabric-rank --json --rank {} --world {} --store {} --bind {} --node {} "
        "--min-busbw {} --timeout {}",
        shell_quote(run.sparkctl_bin), p.rank, ranks.size(), shell_quote(store_host + ":" + port),
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
    auto rep = j.is_object() ? engine::fabric_report_from_json(j)
                             : Result<engine::FabricReport>(Error{Errc::remote, ""});
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
  std::string out = engine::render_fabric_table(f.ranks);
  for (const auto& e : f.errors) out += "# ERROR " + e + "\n";
  out += fmt::format("# fabric {} ({} rank(s), {:.1f} s)\n", f.passed() ? "PASSED" : "FAILED",
                     f.ranks.size(), f.seconds);
  return out;
}

json fabric_preflight_to_json(const FabricPreflight& f) {
  json ranks = json::array();
  for (const auto& r : f.ranks) ranks.push_back(engine::to_json(r));
  return {{"passed", f.passed()}, {"seconds", f.seconds}, {"ranks", ranks}, {"errors", f.errors}};
}

namespace {

Result<engine::FabricReport> fabric_rank(int rank, int world, const std::string& store,
                                         const std::string& bind, const std::string& node,
                                         double min_busbw, std::chrono::milliseconds timeout) {
  // NCCL reads its environment at its first call, which comes below.
  auto applied = env::apply_nccl_debug_env("/tmp", rank);
  auto colon = store.rfind(':');
  auto port = colon == std::string::npos ? std::nullopt : parse_i64(store.substr(colon + 1));
  if (!port) return make_error(Errc::usage, "--store: HOST:PORT expected, got " + store);
  const std::string host = store.substr(0, colon);
  std::shared_ptr<engine::Collective> ctl;
  std::unique_ptr<engine::TcpStoreClient> client;
  if (world > 1) {
    engine::GlooOptions g;
    g.rank = rank;
    g.world = world;
    g.store_host = host;
    g.store_port = static_cast<int>(*port);
    g.bind_host = bind;
    g.prefix = "fabric";
    g.timeout_ms = static_cast<int>(timeout.count());
    auto c = engine::GlooCollective::connect(g);  // rank 0 serves the store on the port
    if (!c) return c.error();
    ctl = *c;
    auto cl = engine::TcpStoreClient::connect(host, static_cast<int>(*port), timeout);
    if (!cl) return cl.error();
    client = std::move(*cl);
  } else {
    ctl = std::make_shared<engine::LocalCollective>();
  }
  engine::NcclCollective::ShareFn share;
  if (client)
    share = [&](const std::string& key, const std::string& v) -> Result<std::string> {
      if (rank == 0) {
        SPARK_TRY(client->set("fabric/" + key, v));
        return v;
      }
      SPARK_TRY(client->wait({"fabric/" + key}, timeout));
      auto got = client->try_get("fabric/" + key);
      if (!got) return got.error();
      if (!got->has_value()) return make_error(Errc::internal, "fabric: the NCCL id vanished");
      return **got;
    };
  engine::NcclOptions n;
  n.rank = rank;
  n.world = world;
  n.init_timeout = std::max(timeout, std::chrono::milliseconds(60000));
  n.op_timeout = timeout;
  auto comm = engine::NcclCollective::connect_via(n, share, ctl);
  if (!comm) return comm.error();
  engine::FabricOptions o;
  o.timeout = timeout;
  auto e = engine::fabric_expect_from_env(rank, world, node, min_busbw);
  auto r = engine::run_fabric_test(**comm, o, e, applied.debug_file);
  if (!r) return r.error();
  // The ranks leave together: nobody tears the store down under a rank still reading it.
  SPARK_TRY(ctl->barrier());
  return r;
}

}  // namespace

int cmd_fabric_rank(Context& ctx, const std::vector<std::string>& args) {
  po::options_description desc("fabric-rank options");
  desc.add_options()("rank", po::value<int>()->default_value(0), "this rank")(
      "world", po::value<int>()->default_value(1), "ranks in the ring")(
      "store", po::value<std::string>()->default_value("127.0.0.1:0"),
      "rank 0's store HOST:PORT (rank 0 serves it)")(
      "bind", po::value<std::string>()->default_value("127.0.0.1"), "this rank's fabric address")(
      "node", po::value<std::string>()->default_value(""), "this rank's node, for messages")(
      "min-busbw", po::value<double>()->default_value(0), "FABRIC_MIN_BUSBW (GB/s)")(
      "timeout", po::value<std::string>()->default_value("30s"), "deadline of every wait");
  po::variables_map vm;
  if (auto rc = parse_args(ctx, "fabric-rank", "fabric-rank --rank R --world N --store HOST:PORT",
                           desc, args, vm))
    return *rc;
  std::string why;
  auto t = parse_duration_ms(vm["timeout"].as<std::string>(), &why);
  if (!t) return ctx.fail(make_error(Errc::usage, "--timeout: " + why));
  const int rank = vm["rank"].as<int>(), world = vm["world"].as<int>();
  if (world < 1 || rank < 0 || rank >= world)
    return ctx.fail(make_error(Errc::usage, fmt::format("rank {} of {} is invalid", rank, world)));
  auto r = fabric_rank(rank, world, vm["store"].as<std::string>(), vm["bind"].as<std::string>(),
                       vm["node"].as<std::string>(), vm["min-busbw"].as<double>(),
                       std::chrono::milliseconds(*t));
  if (!r) return ctx.fail(r.error());
  if (ctx.opts.json)
    *ctx.out << engine::to_json(*r).dump() << "\n";
  else
    *ctx.out << engine::render_fabric_table({*r});
  return r->passed() ? 0 : exit_code(Errc::precondition);
}

}  // namespace spark::cli
