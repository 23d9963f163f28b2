// sparkctl config show | check
#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <ostream>

#include "cli/args.h"
#include "core/strings.h"

namespace spark::cli {
namespace {

int config_show(Context& ctx, bool all) {
  std::vector<Diagnostic> diags;
  auto cfg = ctx.load_config(&diags);
  if (!cfg) {
    for (const auto& d : diags)
      if (!d.error && !ctx.opts.json) *ctx.err << fmt::format("sparkctl: warning: {}: {}\n", d.where, d.message);
    return ctx.fail(cfg.error());
  }
  if (ctx.opts.json) {
    nlohmann::json j;
    j["file"] = cfg->path;
    j["digest"] = cfg->digest();
    j["world_size"] = cfg->world_size();
    for (const auto& [k, s] : cfg->settings)
      if (all || s.source != "default" || !s.value.empty())
        j["settings"][k] = {{"value", s.value}, {"source", s.source}};
    for (const auto& n : cfg->nodes) {
      nlohmann::json jn = {{"index", n.index}, {"name", n.name}, {"ssh", n.ssh},
                           {"local", n.local}, {"fabric_ip", n.fabric_ip}, {"netdevs", n.netdevs},
                           {"hcas", n.hcas}, {"model_path", n.model_path}, {"gpus", n.gpus}};
      jn["gid_index"] = n.gid_index ? nlohmann::json(*n.gid_index) : nlohmann::json("auto");
      j["nodes"].push_back(jn);
    }
    for (const auto& r : cfg->ranks())
      j["ranks"].push_back({{"rank", r.rank}, {"node", r.node}, {"local_rank", r.local_rank}, {"gpu", r.gpu}});
    for (const auto& d : diags) j["warnings"].push_back({{"where", d.where}, {"message", d.message}});
    *ctx.out << j.dump(2) << "\n";
    return 0;
  }
  for (const auto& d : diags) *ctx.err << fmt::format("sparkctl: warning: {}: {}\n", d.where, d.message);
  size_t w = 0;
  for (const auto& [k, s] : cfg->settings) w = std::max(w, k.size());
  *ctx.out << fmt::format("# cluster file {}  digest {}  {} node(s), {} rank(s)\n", cfg->path,
                          cfg->digest(), cfg->nodes.size(), cfg->world_size());
  *ctx.out << fmt::format("{:<{}}  {:<30}  {}\n", "KEY", w, "VALUE", "SOURCE");
  for (const auto& [k, s] : cfg->settings) {
    if (!all && s.source == "default" && s.value.empty()) continue;
    if (!all && s.source == "unset") continue;
    *ctx.out << fmt::format("{:<{}}  {:<30}  {}\n", k, w, s.value.empty() ? "\"\"" : s.value, s.source);
  }
  *ctx.out << "# ranks:";
  for (const auto& r : cfg->ranks())
    *ctx.out << fmt::format(" {}={}/gpu{}", r.rank, cfg->nodes[static_cast<size_t>(r.node)].name, r.gpu);
  *ctx.out << "\n";
  return 0;
}

// The API key file, checked as sparkd checks it at start, when rank 0 is this machine
// (elsewhere the file lives on that node: start checks it there).
void check_key_file(const Result<RingConfig>& cfg, std::vector<Diagnostic>* diags) {
  if (!cfg) return;
  const std::string& path = cfg->get("API_KEY_FILE");
  if (path.empty()) return;
  const auto& src = cfg->settings.at("API_KEY_FILE").source;
  if (cfg->nodes.empty() || !cfg->nodes[0].local) {
    diags->push_back({false, src,
                      fmt::format("API_KEY_FILE {} is on {}; start checks it there", path,
                                  cfg->nodes.empty() ? "rank 0" : cfg->nodes[0].name)});
    return;
  }
  if (auto key = read_api_key_file(path); !key) diags->push_back({true, src, key.error().message});
}

int config_check(Context& ctx) {
  std::vector<Diagnostic> diags;
  auto cfg = ctx.load_config(&diags);
  check_key_file(cfg, &diags);
  if (cfg && std::any_of(diags.begin(), diags.end(), [](const Diagnostic& d) { return d.error; }))
    cfg = make_error(Errc::config, "API_KEY_FILE is refused");
  if (ctx.opts.json) {
    nlohmann::json j;
    j["file"] = ctx.opts.config_path;
    j["ok"] = cfg.ok();
    j["diagnostics"] = nlohmann::json::array();
    for (const auto& d : diags)
      j["diagnostics"].push_back({{"severity", d.error ? "error" : "warning"}, {"where", d.where},
                                  {"message", d.message}});
    if (!cfg && diags.empty()) j["diagnostics"].push_back({{"severity", "error"}, {"where", ctx.opts.config_path}, {"message", cfg.error().message}});
    *ctx.out << j.dump(2) << "\n";
    return cfg ? 0 : exit_code(cfg.error().code);
  }
  for (const auto& d : diags)
    *ctx.err << fmt::format("{}: {}: {}\n", d.where, d.error ? "error" : "warning", d.message);
  if (!cfg) {
    if (diags.empty()) *ctx.err << "sparkctl: " << cfg.error().message << "\n";
    return exit_code(cfg.error().code);
  }
  *ctx.out << fmt::format("{}: OK ({} node(s), {} rank(s), digest {})\n", cfg->path,
                          cfg->nodes.size(), cfg->world_size(), cfg->digest());
  return 0;
}

}  // namespace

int cmd_config(Context& ctx, const std::vector<std::string>& args) {
  po::options_description desc("config options");
  desc.add_options()("action", po::value<std::string>()->default_value("show"), "show | check")(
      "all,a", "show: also keys left at their defaults");
  po::positional_options_description pos;
  pos.add("action", 1);
  po::variables_map vm;
  if (auto rc = parse_args(ctx, "config", "config [show [--all] | check]", desc, args, vm, &pos))
    return *rc;
  auto action = vm["action"].as<std::string>();
  if (action == "show") return config_show(ctx, vm.count("all") > 0);
  if (action == "check") return config_check(ctx);
  return ctx.fail(make_error(Errc::usage,
                             fmt::format("config: unknown action '{}' (show or check)", action)));
}

}  // namespace spark::cli
