// sparkctl plan: the memory arithmetic per rank for 1-4 nodes, from the model's config.json.
#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <ostream>

#include "cli/args.h"
#include "cli/cmd_preflight.h"
#include "core/strings.h"
#include "env/meminfo.h"
#include "env/model_files.h"
#include "env/plan.h"

namespace spark::cli {

int cmd_plan(Context& ctx, const std::vector<std::string>& args) {
  po::options_description desc("plan options");
  desc.add_options()("model", po::value<std::string>(), "model directory (default MODEL_PATH)")(
      "capacity", po::value<std::string>(),
      "memory per rank (default: this node's MemAvailable / its GPUs)")(
      "context", po::value<int64_t>(), "context length per slot (default CONTEXT_LEN)")(
      "slots", po::value<int>(), "serving slots (default SLOTS)")(
      "kv-dtype", po::value<std::string>(), "auto|bf16|fp16|fp8|fp32 (default KV_DTYPE)")(
      "nodes", po::value<int>()->default_value(4), "rows for 1..N nodes");
  po::variables_map vm;
  if (auto rc =
          parse_args(ctx, "plan", "plan [--model DIR] [--capacity SIZE] [--context N] [--slots N]",
                     desc, args, vm))
    return *rc;
  auto cfg = ctx.load_config();
  if (!cfg && !vm.count("model")) return ctx.fail(cfg.error());
  auto setting = [&](const char* key, const char* dflt) {
    return cfg ? cfg->get(key) : std::string(dflt);
  };
  std::string model = vm.count("model") ? vm["model"].as<std::string>() : setting("MODEL_PATH", "");
  if (model.empty())
    return ctx.fail(make_error(Errc::usage, "plan: no model: pass --model DIR or set MODEL_PATH"));
  auto mf = env::read_model_files(env::Sysroot("/"), model);
  if (!mf.config_ok)
    return ctx.fail(make_error(Errc::not_found, fmt::format("{}: {}", model, mf.config_error)));
  auto shape = env::model_shape(mf.config);
  if (!shape) return ctx.fail(make_error(shape.error().code, model + "/" + shape.error().message));

  env::PlanInput in;
  in.shape = *shape;
  in.weight_bytes = mf.weight_bytes;
  in.kv_bytes = env::kv_dtype_bytes(
      vm.count("kv-dtype") ? vm["kv-dtype"].as<std::string>() : setting("KV_DTYPE", "auto"),
      *shape);
  in.context = vm.count("context") ? vm["context"].as<int64_t>()
                                   : parse_i64(setting("CONTEXT_LEN", "4096")).value_or(4096);
  in.slots = vm.count("slots") ? vm["slots"].as<int>()
                               : static_cast<int>(parse_i64(setting("SLOTS", "4")).value_or(4));
  in.reserve = parse_size(setting("MEM_RESERVE", "4GiB"), nullptr).value_or(0);
  in.gpus_per_node = cfg ? static_cast<int>(cfg->nodes[0].gpus.size()) : 1;
  std::string cap_src;
  if (vm.count("capacity")) {
    std::string why;
    auto c = parse_size(vm["capacity"].as<std::string>(), &why);
    if (!c) return ctx.fail(make_error(Errc::usage, "--capacity: " + why));
    in.capacity_per_rank = *c;
    cap_src = "--capacity";
  } else if (auto mi = env::read_meminfo("/"); mi) {
    in.capacity_per_rank =
        mi->get("MemAvailable") / static_cast<uint64_t>(std::max(1, in.gpus_per_node));
    cap_src = "this node's MemAvailable";
  }
  auto rows = env::plan_table(in, std::clamp(vm["nodes"].as<int>(), 1, 16));

  if (ctx.opts.json) {
    nlohmann::json j;
    j["model"] = {{"path", model},
                  {"arch", shape->arch},
                  {"layers", shape->layers},
                  {"kv_heads", shape->kv_heads},
                  {"head_dim", shape->head_dim},
                  {"mla", shape->mla},
                  {"kv_lora_rank", shape->kv_lora_rank},
                  {"qk_rope_head_dim", shape->qk_rope_head_dim},
                  {"weight_bytes", in.weight_bytes},
                  {"kv_bytes_per_element", in.kv_bytes},
                  {"kv_bytes_per_token", env::kv_bytes_per_token(*shape, in.kv_bytes)}};
    j["context"] = in.context;
    j["slots"] = in.slots;
    j["reserve"] = in.reserve;
    j["capacity_per_rank"] = in.capacity_per_rank;
    j["capacity_source"] = cap_src;
    for (const auto& r : rows)
      j["rows"].push_back({{"nodes", r.nodes},
                           {"ranks", r.ranks},
                           {"weights_per_rank", r.weights_per_rank},
                           {"kv_per_token_per_rank", r.kv_per_token_per_rank},
                           {"kv_per_rank", r.kv_per_rank},
                           {"reserve", r.reserve},
                           {"need_per_rank", r.need_per_rank},
                           {"capacity_per_rank", r.capacity_per_rank},
                           {"fits", r.fits},
                           {"max_context", r.max_context}});
    *ctx.out << j.dump(2) << "\n";
    return 0;
  }
  auto& o = *ctx.out;
  o << fmt::format(
      "# model {} ({}): {} layers, {}; weights {}\n", model, shape->arch, shape->layers,
      shape->mla ? fmt::format("MLA kv_lora_rank {} + qk_rope_head_dim {}", shape->kv_lora_rank,
                               shape->qk_rope_head_dim)
                 : fmt::format("GQA {} KV heads x head_dim {}", shape->kv_heads, shape->head_dim),
      format_size(in.weight_bytes));
  o << fmt::format(
      "# KV {} byte(s)/element = {} per token for the whole model; context {} x {} slots; "
      "reserve {}; capacity per rank {} ({})\n",
      in.kv_bytes, format_size(env::kv_bytes_per_token(*shape, in.kv_bytes)), in.context, in.slots,
      format_size(in.reserve), in.capacity_per_rank ? format_size(in.capacity_per_rank) : "unknown",
      cap_src.empty() ? "none" : cap_src);
  o << fmt::format("{:>5} {:>5} {:>14} {:>14} {:>14} {:>12} {:>14} {:>14} {:>5} {:>12}\n", "NODES",
                   "RANKS", "WEIGHTS/RANK", "KV/TOKEN/RANK", "KV/RANK", "RESERVE", "NEED/RANK",
                   "HAVE/RANK", "FITS", "MAX_CONTEXT");
  for (const auto& r : rows)
    o << fmt::format("{:>5} {:>5} {:>14} {:>14} {:>14} {:>12} {:>14} {:>14} {:>5} {:>12}\n",
                     r.nodes, r.ranks, format_size(r.weights_per_rank),
                     fmt::format("{} B", r.kv_per_token_per_rank), format_size(r.kv_per_rank),
                     format_size(r.reserve), format_size(r.need_per_rank),
                     r.capacity_per_rank ? format_size(r.capacity_per_rank) : "?",
                     r.capacity_per_rank ? (r.fits ? "yes" : "NO") : "?",
                     r.max_context < 0 ? std::string("?") : std::to_string(r.max_context));
  return 0;
}

}  // namespace spark::cli
