// sparkctl bundle [--out FILE.tar.gz]: a diagnostics archive from every node (cli/bundle.h).
#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <ostream>

#include "cli/args.h"
#include "cli/bundle.h"
#include "cli/cmd_preflight.h"
#include "cli/node_exec.h"
#include "core/strings.h"

namespace spark::cli {

int cmd_bundle(Context& ctx, const std::vector<std::string>& args) {
  po::options_description desc("bundle options");
  desc.add_options()("out,o", po::value<std::string>(),
                     "the archive to write (default sparkctl-bundle-RING-UTCSTAMP.tar.gz here)")(
      "log-lines", po::value<int>()->default_value(500), "lines of each log file to keep")(
      "timeout", po::value<std::string>()->default_value("180s"),
      "how long the nodes have to answer")("local",
                                           "(internal) this node's half, as JSON on stdout")(
      "node", po::value<int>()->default_value(-1), "with --local: which node this is");
  po::positional_options_description pos;
  pos.add("out", 1);
  po::variables_map vm;
  if (auto rc =
          parse_args(ctx, "bundle", "bundle [--out FILE.tar.gz] [--log-lines N] [--timeout D]",
                     desc, args, vm, &pos))
    return *rc;
  auto cfg = ctx.load_config();
  if (!cfg) return ctx.fail(cfg.error());
  BundleOptions opt;
  opt.log_lines = std::max(0, vm["log-lines"].as<int>());
  std::string why;
  auto t = parse_duration_ms(vm["timeout"].as<std::string>(), &why);
  if (!t) return ctx.fail(make_error(Errc::usage, "--timeout: " + why));
  opt.timeout = std::chrono::milliseconds(*t);
  if (vm.count("local")) {
    auto node = this_node(*cfg, vm["node"].as<int>());
    if (!node) return ctx.fail(node.error());
    *ctx.out << collect_node_bundle(*cfg, *node, opt)
                    .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
             << "\n";
    return 0;
  }
  if (vm.count("out")) opt.out = vm["out"].as<std::string>();
  opt.sparkctl_bin = sparkctl_on(*cfg, ctx);
  auto rep = make_bundle(*cfg, opt);
  int rc = rep.error              ? exit_code(rep.error->code)
           : !rep.missing.empty() ? exit_code(Errc::remote)
                                  : 0;
  if (ctx.opts.json) {
    *ctx.out << to_json(rep).dump(2) << "\n";
    return rc;
  }
  if (rep.error) return ctx.fail(*rep.error);
  *ctx.out << fmt::format("{}: {} of {} node(s) bundled\n", rep.archive, rep.nodes.size(),
                          cfg->nodes.size());
  for (const auto& m : rep.missing) *ctx.out << "MISSING " << m << "\n";
  for (const auto& d : rep.diff)
    if (d.differs) *ctx.out << "DIFFERS across the ring: " << d.field << " (see SUMMARY.txt)\n";
  if (!rep.missing.empty())
    *ctx.err << "sparkctl: bundle written without the node(s) named MISSING; bring them up "
                "and run it again for a whole bundle\n";
  return rc;
}

}  // namespace spark::cli
