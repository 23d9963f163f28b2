// sparkctl node probe|launch|stop: the typed operations the head runs on each node for
// start, stop and status (cli/node_ops.h), answered in JSON on stdout.
#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <ostream>

#include "cli/args.h"
#include "cli/cmd_ring.h"
#include "cli/engine_pin.h"
#include "cli/history_view.h"
#include "cli/node_ops.h"
#include "core/strings.h"

namespace spark::cli {

namespace {

// "R:KEY=VALUE" -> rank R gets KEY=VALUE.
Status add_env(const std::string& spec, RankEnv* env) {
  auto colon = spec.find(':');
  auto eq = spec.find('=');
  auto rank = colon == std::string::npos ? std::nullopt : parse_i64(spec.substr(0, colon));
  if (!rank || eq == std::string::npos || eq < colon + 2)
    return make_error(Errc::usage, fmt::format("--env {}: expected RANK:KEY=VALUE", spec));
  (*env)[static_cast<int>(*rank)].emplace_back(spec.substr(colon + 1, eq - colon - 1),
                                               spec.substr(eq + 1));
  return Status::Ok();
}

}  // namespace

int cmd_node(Context& ctx, const std::vector<std::string>& args) {
  po::options_description desc("node options");
  desc.add_options()("op", po::value<std::string>(), "probe, launch or stop")(
      "node", po::value<int>()->required(), "this node's index in the cluster file")(
      "sparkd", po::value<std::string>(), "launch: path of sparkd on this node")(
      "env", po::value<std::vector<std::string>>()->composing(),
      "launch: RANK:KEY=VALUE for that rank's sparkd (repeatable)")(
      "grace-ms", po::value<int>()->default_value(10000), "stop: SIGTERM grace before SIGKILL")(
      "since-ms", po::value<int64_t>()->default_value(0),
      "history: samples from this wall-clock time (ms since the epoch) on");
  po::positional_options_description pos;
  pos.add("op", 1);
  po::variables_map vm;
  if (auto rc = parse_args(
          ctx, "node",
          "--config - node probe|launch|stop|history|engine-set --node N [--sparkd PATH] "
          "[--env R:K=V]... [--grace-ms MS]",
          desc, args, vm, &pos))
    return *rc;
  const std::string op = vm.count("op") ? vm["op"].as<std::string>() : "";
  if (op != "probe" && op != "launch" && op != "stop" && op != "history" && op != "engine-set")
    return ctx.fail(make_error(Errc::usage, "node: give probe, launch, stop or history"));
  auto cfg = ctx.load_config();
  if (!cfg) return ctx.fail(cfg.error());
  const int node = vm["node"].as<int>();
  if (node < 0 || node >= static_cast<int>(cfg->nodes.size()))
    return ctx.fail(make_error(Errc::usage, fmt::format("--node {}: the ring has nodes 0-{}", node,
                                                        cfg->nodes.size() - 1)));
  nlohmann::json reply;
  if (op == "probe") {
    reply = to_json(probe_here(*cfg, node));
  } else if (op == "history") {
    reply = history_here(*cfg, node, vm["since-ms"].as<int64_t>());
  } else if (op == "engine-set") {
    reply = engine_set_here(*cfg, node);
  } else if (op == "launch") {
    if (!vm.count("sparkd")) return ctx.fail(make_error(Errc::usage, "node launch: give --sparkd"));
    if (ctx.opts.config_path != "-")
      return ctx.fail(make_error(Errc::usage,
                                 "node launch: the head's resolved cluster file comes on stdin "
                                 "(--config -)"));
    RankEnv env;
    if (vm.count("env"))
      for (const auto& e : vm["env"].as<std::vector<std::string>>())
        if (auto st = add_env(e, &env); !st.ok()) return ctx.fail(st.error());
    reply = to_json(launch_here(*cfg, node, ctx.config_text, vm["sparkd"].as<std::string>(), env));
  } else {
    reply = to_json(
        stop_here(*cfg, node, std::chrono::milliseconds(std::max(0, vm["grace-ms"].as<int>()))));
  }
  *ctx.out << reply.dump() << "\n";
  return 0;
}

}  // namespace spark::cli
