// sparkctl demo-model DIR [--force] [--arch ARCHITECTURE] [--weights bf16|fp8]
#include "cli/cmd_demo_model.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <ostream>

#include "cli/args.h"
#include "core/strings.h"
#include "daemon/engine/demo_model.h"

namespace spark::cli {

int cmd_demo_model(Context& ctx, const std::vector<std::string>& args) {
  po::options_description desc("Options");
  desc.add_options()("dir", po::value<std::string>(), "directory to write the checkpoint into")(
      "force", "replace a non-empty directory that is not an earlier demo model")(
      "arch", po::value<std::string>(),
      "architecture (default Qwen2ForCausalLM; e.g. Qwen3MoeForCausalLM or glm4_moe)")(
      "weights", po::value<std::string>(),
      "bf16 (default) or fp8: projections in e4m3 with 128x128 block scales");
  po::positional_options_description pos;
  pos.add("dir", 1);
  po::variables_map vm;
  if (auto rc = parse_args(ctx, "demo-model",
                           "demo-model DIR [--force] [--arch ARCHITECTURE] [--weights bf16|fp8]",
                           desc, args, vm, &pos))
    return *rc;
  if (!vm.count("dir")) return ctx.fail(make_error(Errc::usage, "demo-model: DIR is required"));
  auto rep = engine::write_demo_model(vm["dir"].as<std::string>(), vm.count("force") > 0,
                                      vm.count("arch") ? vm["arch"].as<std::string>() : "",
                                      vm.count("weights") ? vm["weights"].as<std::string>() : "");
  if (!rep) return ctx.fail(rep.error());
  if (ctx.opts.json) {
    nlohmann::json j = {{"dir", rep->dir},
                        {"architecture", rep->architecture},
                        {"parameters", rep->parameters},
                        {"bytes", rep->bytes},
                        {"tokenizer", rep->tokenizer},
                        {"files", rep->files},
                        {"random_weights", true}};
    if (!rep->note.empty()) j["note"] = rep->note;
    *ctx.out << j.dump(2) << "\n";
    return 0;
  }
  *ctx.out << fmt::format(
      "wrote demo model {} ({}, {:.1f}M parameters, {}) — its weights are RANDOM\n", rep->dir,
      rep->architecture, static_cast<double>(rep->parameters) / 1e6, format_size(rep->bytes));
  for (const auto& f : rep->files) *ctx.out << "  " << f << "\n";
  if (!rep->note.empty()) *ctx.err << "sparkctl: note: " << rep->note << "\n";
  return 0;
}

}  // namespace spark::cli
