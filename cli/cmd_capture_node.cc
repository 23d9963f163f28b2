// sparkctl capture-node OUT.tar.gz: what preflight reads on this node, replayable with
// `sparkctl preflight --local --sysroot OUT.tar.gz`.
#include <fmt/format.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <ostream>

#include "cli/args.h"
#include "cli/cmd_preflight.h"
#include "core/process.h"
#include "core/strings.h"
#include "env/capture.h"

namespace spark::cli {

int cmd_capture_node(Context& ctx, const std::vector<std::string>& args) {
  po::options_description desc("capture-node options");
  desc.add_options()("out", po::value<std::string>(), "the archive to write (.tar.gz)")(
      "node", po::value<int>()->default_value(-1), "which node of the ring this is")(
      "sysroot", po::value<std::string>()->default_value("/"), "(tests) capture from this root");
  po::positional_options_description pos;
  pos.add("out", 1);
  po::variables_map vm;
  if (auto rc = parse_args(ctx, "capture-node", "capture-node OUT.tar.gz [--node N]", desc, args,
                           vm, &pos))
    return *rc;
  if (!vm.count("out")) return ctx.fail(make_error(Errc::usage, "capture-node: give OUT.tar.gz"));
  std::string out = vm["out"].as<std::string>();
  // A node without a (valid) cluster file can still be captured: then every HCA and netdev.
  std::vector<Diagnostic> diags;
  auto cfg = ctx.load_config(&diags);
  std::optional<int> node;
  if (cfg) {
    auto n = this_node(*cfg, vm["node"].as<int>());
    if (!n) return ctx.fail(n.error());
    node = *n;
  }
  std::string tmpl = "/tmp/sparkctl-capture-XXXXXX";
  if (!::mkdtemp(tmpl.data())) return ctx.fail(make_error(Errc::io, "mkdtemp failed"));
  struct Cleanup {
    std::string dir;
    ~Cleanup() {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  } cleanup{tmpl};
  auto sum = env::capture_node_tree(cfg ? &*cfg : nullptr, node.value_or(0),
                                    vm["sysroot"].as<std::string>(), tmpl + "/tree");
  if (!sum) return ctx.fail(sum.error());
  // Write under a temporary name, rename when complete: never a half archive under OUT.
  std::string part = fmt::format("{}.part.{}", out, ::getpid());
  auto r = run_process(ProcessSpec{
      {"tar", "-czSf", part, "-C", tmpl + "/tree", "."}, {}, {}, {}, std::chrono::seconds(120)});
  if (!r || !r->success()) {
    std::filesystem::remove(part);
    return ctx.fail(make_error(
        Errc::io,
        fmt::format("{}: tar failed: {}", out, r ? std::string(trim(r->err)) : r.error().message)));
  }
  std::error_code ec;
  std::filesystem::rename(part, out, ec);
  if (ec) return ctx.fail(make_error(Errc::io, fmt::format("{}: {}", out, ec.message())));
  if (ctx.opts.json) {
    *ctx.out << nlohmann::json{{"archive", out},
                               {"files", sum->files},
                               {"dirs", sum->dirs},
                               {"sparse", sum->sized},
                               {"node", cfg ? cfg->nodes[static_cast<size_t>(*node)].name : ""}}
                    .dump(2)
             << "\n";
  } else {
    *ctx.out << fmt::format("{}: {} files, {} directories, {} sparse stand-ins, facts.json{}\n",
                            out, sum->files, sum->dirs, sum->sized,
                            cfg ? "" : " (no cluster file: every HCA and netdev)");
    *ctx.out << fmt::format(
        "replay: sparkctl --config FILE preflight --local --node {} --sysroot {}\n",
        node.value_or(0), out);
  }
  return 0;
}

}  // namespace spark::cli
