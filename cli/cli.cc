#include "cli/cli.h"

#include <fmt/format.h>
#include <unistd.h>

#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "core/log.h"
#include "core/strings.h"
#include "spark/version.h"

namespace spark::cli {

Result<RingConfig> Context::load_config(std::vector<Diagnostic>* diags) const {
  std::vector<Diagnostic> local;
  auto& d = diags ? *diags : local;
  Result<RingConfig> cfg = make_error(Errc::internal, "not loaded");
  if (opts.config_path == "-") {
    // The head's resolved cluster file on stdin (config_wire_text): this node's environment
    // must not change it, so the ranks' config digests stay the head's.
    config_text.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
    cfg = load_config_text(config_text, "<stdin>", Environment{}, &d);
  } else {
    cfg = spark::load_config(opts.config_path, env, &d);
  }
  if (!diags && opts.config_path != "-") {  // the head printed the wire text's warnings
    for (const auto& w : d)
      if (!w.error) *err << fmt::format("sparkctl: warning: {}: {}\n", w.where, w.message);
  }
  return cfg;
}

int Context::fail(const Error& e) const {
  if (opts.json) {
    nlohmann::json j = {{"error", {{"code", std::string(errc_name(e.code))},
                                   {"exit_code", exit_code(e.code)},
                                   {"message", e.message}}}};
    // Messages can quote bytes read from a node: invalid UTF-8 must not lose the error.
    *out << j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  } else {
    *err << "sparkctl: " << e.message << "\n";
  }
  return exit_code(e.code);
}

namespace {

const Command* find_command(const std::string& name) {
  for (const auto& c : commands())
    if (name == c.name) return &c;
  return nullptr;
}

std::vector<std::string> command_names() {
  std::vector<std::string> names;
  for (const auto& c : commands()) names.emplace_back(c.name);
  return names;
}

void print_usage(std::ostream& out) {
  out << "usage: sparkctl [--config FILE] [--json] [-v] [--version] COMMAND [ARGS...]\n\n"
         "Bring up and keep up one model served across a ring of GPU nodes.\n\nCommands:\n";
  for (const auto& c : commands()) out << fmt::format("  {:<15} {}\n", c.name, c.summary);
  out << "\nRun 'sparkctl help COMMAND' or 'sparkctl COMMAND --help' for one command.\n"
         "Exit codes and the cluster file: man sparkctl, man sparkctl.env.\n";
}

}  // namespace

int cmd_help(Context& ctx, const std::vector<std::string>& args) {
  if (args.empty()) {
    print_usage(*ctx.out);
    return 0;
  }
  const Command* c = find_command(args[0]);
  if (!c) {
    auto hint = did_you_mean(args[0], command_names());
    return ctx.fail(make_error(Errc::usage,
                               fmt::format("unknown command '{}'{}", args[0],
                                           hint.empty() ? "" : fmt::format("; did you mean '{}'?", hint))));
  }
  return c->run(ctx, {"--help"});
}

int run(int argc, const char* const* argv, std::ostream& out, std::ostream& err,
        const Environment& env) {
  Context ctx;
  ctx.env = env;
  ctx.out = &out;
  ctx.err = &err;
  ctx.argv0 = argc > 0 ? argv[0] : "sparkctl";
  if (auto it = env.vars.find("SPARK_CONFIG"); it != env.vars.end() && !it->second.empty())
    ctx.opts.config_path = it->second;
  else
    ctx.opts.config_path = "sparkctl.env";

  int i = 1;
  for (; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--json") {
      ctx.opts.json = true;
    } else if (a == "-v" || a == "--verbose") {
      ++ctx.opts.verbose;
    } else if (a == "-vv") {
      ctx.opts.verbose += 2;
    } else if (a == "--version") {
      return cmd_version(ctx, {"--short"});
    } else if (a == "-h" || a == "--help") {
      print_usage(out);
      return 0;
    } else if (a == "--config" || a == "-c") {
      if (i + 1 >= argc) return ctx.fail(make_error(Errc::usage, "--config needs a FILE"));
      ctx.opts.config_path = argv[++i];
    } else if (starts_with(a, "--config=")) {
      ctx.opts.config_path = a.substr(9);
    } else if (starts_with(a, "-")) {
      return ctx.fail(make_error(Errc::usage,
                                 fmt::format("unknown global option '{}' (see sparkctl --help)", a)));
    } else {
      break;
    }
  }
  if (ctx.opts.verbose >= 2) log::set_level(log::Level::debug);
  if (i >= argc) {
    print_usage(err);
    return exit_code(Errc::usage);
  }
  std::string name = argv[i];
  std::vector<std::string> args(argv + i + 1, argv + argc);
  // Global flags are also accepted after the command name.
  std::vector<std::string> rest;
  for (size_t k = 0; k < args.size(); ++k) {
    if (args[k] == "--json") ctx.opts.json = true;
    else if (args[k] == "-v" || args[k] == "--verbose") ++ctx.opts.verbose;
    else if ((args[k] == "--config" || args[k] == "-c") && k + 1 < args.size()) ctx.opts.config_path = args[++k];
    else if (starts_with(args[k], "--config=")) ctx.opts.config_path = args[k].substr(9);
    else rest.push_back(args[k]);
  }
  const Command* c = find_command(name);
  if (!c) {
    auto hint = did_you_mean(name, command_names());
    return ctx.fail(make_error(
        Errc::usage, fmt::format("unknown command '{}'{}; 'sparkctl help' lists them", name,
                                 hint.empty() ? "" : fmt::format(" (did you mean '{}'?)", hint))));
  }
  try {
    return c->run(ctx, rest);
  } catch (const std::exception& e) {
    return ctx.fail(make_error(Errc::internal, fmt::format("{}: {}", name, e.what())));
  }
}

}  // namespace spark::cli
