// sparkctl rollback: start the last engine set that reached READY (cli/engine_pin.h).
#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <ostream>

#include "cli/args.h"
#include "cli/cmd_preflight.h"
#include "cli/engine_pin.h"
#include "cli/node_exec.h"
#include "cli/ring_ops.h"
#include "cli/ring_state.h"
#include "core/strings.h"

namespace spark::cli {

int cmd_rollback(Context& ctx, const std::vector<std::string>& args) {
  po::options_description desc("rollback options");
  desc.add_options()("skip-preflight", "start without the preflight checks (warns loudly)")(
      "no-wait", "return once every rank is launched; do not wait for READY")(
      "lock-wait", po::value<std::string>()->default_value("30s"),
      "how long to wait for the ring lock held by another start/stop/watch");
  po::variables_map vm;
  if (auto rc =
          parse_args(ctx, "rollback", "rollback [--skip-preflight] [--no-wait] [--lock-wait D]",
                     desc, args, vm))
    return *rc;
  auto cfg = ctx.load_config();
  if (!cfg) return ctx.fail(cfg.error());
  std::string state = head_state_dir(*cfg);
  auto last = read_engine_set(state, "last-good");
  if (!last)
    return ctx.fail(make_error(
        Errc::not_found,
        fmt::format("no last good engine set in {}/engine/last-good.json: rollback needs a start "
                    "that reached READY first",
                    state)));
  auto lay = ring_layout(*cfg, ctx.argv0);
  // What the nodes hold now, to refuse a rollback that would not start the same bits.
  auto now =
      collect_engine_set(*cfg, sparkctl_on(*cfg, ctx), config_wire_text(*cfg), lay.node_timeout);
  auto back = rollback_config(*last, now);
  if (!back) return ctx.fail(back.error());
  StartOptions opt;
  opt.skip_preflight = vm.count("skip-preflight") > 0;
  opt.wait_ready = vm.count("no-wait") == 0;
  std::string why;
  auto lw = parse_duration_ms(vm["lock-wait"].as<std::string>(), &why);
  if (!lw) return ctx.fail(make_error(Errc::usage, "--lock-wait: " + why));
  opt.lock_wait_ms = static_cast<int64_t>(*lw);
  opt.by = "rollback";
  if (!ctx.opts.json)
    *ctx.out << fmt::format("rollback to the last good set of {}: {}\n  ENGINE_EXEC={}\n",
                            last->at_ms, describe_set(*last), back->get("ENGINE_EXEC"));
  StopReport stopped;
  auto rep = restart_ring(*back, ring_layout(*back, ctx.argv0), opt, &stopped);
  int rc = rep.error ? exit_code(rep.error->code) : 0;
  if (ctx.opts.json) {
    auto j = to_json(rep);
    j["rolled_back_to"] = {{"at_ms", last->at_ms},
                           {"set", describe_set(*last)},
                           {"engine_exec", back->get("ENGINE_EXEC")}};
    *ctx.out << j.dump(2) << "\n";
    return rc;
  }
  for (const auto& s : rep.steps)
    *ctx.out << fmt::format("{:<10} {:<4} {:>6.1f} s  {}\n", s.name, s.ok ? "ok" : "FAIL",
                            s.seconds, s.detail);
  if (rep.error) {
    *ctx.err << "sparkctl: rollback failed; the ring was torn down: " << rep.error->message << "\n";
    return rc;
  }
  if (rep.ready)
    *ctx.out << fmt::format("READY: the last good set runs again, endpoint {}\n", rep.endpoint);
  return rc;
}

}  // namespace spark::cli
