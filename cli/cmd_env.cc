// sparkctl env --rank N: the engine environment of one rank, from the resolved node facts.
#include <fmt/format.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <ostream>

#include "cli/args.h"
#include "cli/cmd_preflight.h"
#include "env/rank_env.h"

namespace spark::cli {

int cmd_env(Context& ctx, const std::vector<std::string>& args) {
  po::options_description desc("env options");
  desc.add_options()("rank", po::value<int>(), "the rank (0 = the head's first GPU)")(
      "sysroot", po::value<std::string>(), "resolve from a captured tree of the rank's node")(
      "export", "print `export NAME='value'` lines for a shell");
  po::positional_options_description pos;
  pos.add("rank", 1);
  po::variables_map vm;
  if (auto rc =
          parse_args(ctx, "env", "env --rank N [--sysroot DIR] [--export]", desc, args, vm, &pos))
    return *rc;
  if (!vm.count("rank")) return ctx.fail(make_error(Errc::usage, "env: --rank N is required"));
  auto cfg = ctx.load_config();
  if (!cfg) return ctx.fail(cfg.error());
  int rank = vm["rank"].as<int>();
  auto ranks = cfg->ranks();
  if (rank < 0 || rank >= static_cast<int>(ranks.size()))
    return ctx.fail(
        make_error(Errc::usage, fmt::format("rank {} does not exist: the ring has ranks 0-{}", rank,
                                            static_cast<int>(ranks.size()) - 1)));
  int node = ranks[static_cast<size_t>(rank)].node;
  env::CheckFilter filter;
  filter.only = {"rdma", "net.link", "gpu"};
  std::optional<env::NodeReport> report;
  if (vm.count("sysroot")) {
    if (auto s = check_sysroot_dir(vm["sysroot"].as<std::string>()); !s.ok())
      return ctx.fail(s.error());
    report = env::run_node_checks(*cfg, node, env::Sysroot(vm["sysroot"].as<std::string>()), filter,
                                  false);
  } else {
    PreflightRun run;
    run.filter = filter;
    run.sparkctl_bin = cfg->get("SPARKCTL_BIN").empty() ? "sparkctl" : cfg->get("SPARKCTL_BIN");
    if (cfg->get("SPARKCTL_BIN").empty()) {
      std::error_code ec;
      auto p = std::filesystem::canonical("/proc/self/exe", ec);
      if (!ec) run.sparkctl_bin = p.string();
    }
    auto outcomes = collect_node_reports(*cfg, run, {node});
    if (outcomes[0].error) return ctx.fail(*outcomes[0].error);
    report = outcomes[0].report;
  }
  auto e = env::render_rank_env(*cfg, rank, *report);
  if (!e) return ctx.fail(e.error());
  if (ctx.opts.json) {
    nlohmann::json j = {{"rank", e->rank}, {"node", e->node}, {"env", nlohmann::json::object()}};
    for (const auto& [k, v] : e->vars) j["env"][k] = v;
    *ctx.out << j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  } else if (vm.count("export")) {
    *ctx.out << e->to_shell();
  } else {
    for (const auto& [k, v] : e->vars) *ctx.out << k << "=" << v << "\n";
  }
  return 0;
}

}  // namespace spark::cli
