// sparkctl plan: the memory arithmetic per rank for 1-4 nodes, from the model's config.json
// and files, layer type by layer type (core/model_plan.h).
#include <fmt/format.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <ostream>

#include "cli/args.h"
#include "cli/cmd_preflight.h"
#include "core/strings.h"
#include "env/engine_fit.h"
#include "env/meminfo.h"
#include "env/model_files.h"
#include "env/plan.h"

namespace spark::cli {

namespace {

nlohmann::json part_json(const plan::KvPart& p, int64_t context) {
  return {{"layer_type", plan::layer_kind_name(p.kind)},
          {"layers", p.layers},
          {"part", p.part},
          {"record", p.record},
          {"bytes_per_state", p.bytes_per_state},
          {"tokens_per_state", p.tokens_per_state},
          {"window", p.window},
          {"bytes_per_slot", p.bytes_per_slot},
          {"bytes_per_sequence", p.bytes_for(context)}};
}

std::string per_token_text(const plan::KvPart& p) {
  if (p.bytes_per_state == 0) return "-";
  if (p.tokens_per_state == 1) return fmt::format("{} B", p.bytes_per_state);
  return fmt::format("{} B/{}", p.bytes_per_state, p.tokens_per_state);
}

}  // namespace

int cmd_plan(Context& ctx, const std::vector<std::string>& args) {
  po::options_description desc("plan options");
  desc.add_options()("model", po::value<std::string>(), "model directory (default MODEL_PATH)")(
      "capacity", po::value<std::string>(),
      "memory per rank (default: this node's MemAvailable / its GPUs)")(
      "context", po::value<int64_t>(), "context length per slot (default CONTEXT_LEN)")(
      "slots", po::value<int>(), "serving slots (default SLOTS)")(
      "kv-dtype", po::value<std::string>(), "auto|bf16|fp16|fp8|fp32 (default KV_DTYPE)")(
      "kv-layout", po::value<std::string>(), "native|vllm: whose KV records (default KV_LAYOUT)")(
      "expert-parallel", po::value<std::string>(), "auto|tp|ep (default EXPERT_PARALLEL)")(
      "context-split", po::value<int>(),
      "ranks splitting each sequence's tokens (default CONTEXT_SPLIT)")(
      "workspace", po::value<std::string>(),
      "activation and graph workspace per rank (default MEM_WORKSPACE)")(
      "mtp", po::value<std::string>(), "multi-token-prediction layer per rank (default MEM_MTP)")(
      "vision", po::value<std::string>(), "vision tower per rank (default MEM_VISION)")(
      "kv-overhead", po::value<std::string>(),
      "KV the engine charges per rank beyond the records (default KV_OVERHEAD)")(
      "weights-dtype", po::value<std::string>(),
      "bf16|fp16|fp32|fp8|int8|fp4|int4: the matrices' bytes when the weights are estimated "
      "from config.json (no weight files yet)")("nodes", po::value<int>()->default_value(4),
                                                "rows for 1..N nodes");
  po::variables_map vm;
  if (auto rc = parse_args(ctx, "plan",
                           "plan [--model DIR] [--capacity SIZE] [--context N] [--slots N] "
                           "[--kv-dtype T] [--kv-layout L] [--expert-parallel S] ...",
                           desc, args, vm))
    return *rc;
  auto cfg = ctx.load_config();
  if (!cfg && !vm.count("model")) return ctx.fail(cfg.error());
  const RingConfig* rc = cfg ? &*cfg : nullptr;
  std::string model =
      vm.count("model") ? vm["model"].as<std::string>() : env::ring_setting(rc, "MODEL_PATH");
  if (model.empty())
    return ctx.fail(make_error(Errc::usage, "plan: no model: pass --model DIR or set MODEL_PATH"));
  auto mf = env::read_model_files(env::Sysroot("/"), model);
  if (!mf.config_ok) {
    // A config.json that is there but wrong is a config error, not a missing file.
    std::error_code ec;
    bool there = std::filesystem::is_regular_file(model + "/config.json", ec);
    return ctx.fail(make_error(there ? Errc::config : Errc::not_found,
                               fmt::format("{}: {}", model, mf.config_error)));
  }
  std::string weights_dtype =
      vm.count("weights-dtype") ? vm["weights-dtype"].as<std::string>() : "";
  if (!weights_dtype.empty() && !plan::weights_dtype_bytes(weights_dtype))
    return ctx.fail(make_error(Errc::usage, fmt::format("--weights-dtype {}: use bf16, fp16, fp32, "
                                                        "fp8, int8, fp4 or int4",
                                                        weights_dtype)));
  std::optional<plan::WeightEstimate> estimate;
  auto input = env::plan_input(mf, rc, weights_dtype, &estimate);
  if (!input) return ctx.fail(input.error());
  plan::PlanInput in = std::move(*input);

  auto size_opt = [&](const char* opt, uint64_t* out) -> std::optional<int> {
    if (!vm.count(opt)) return std::nullopt;
    std::string why;
    auto v = parse_size(vm[opt].as<std::string>(), &why);
    if (!v) return ctx.fail(make_error(Errc::usage, fmt::format("--{}: {}", opt, why)));
    *out = *v;
    return std::nullopt;
  };
  if (vm.count("kv-dtype")) {
    std::string t = vm["kv-dtype"].as<std::string>();
    if (t != "auto" && t != "bf16" && t != "fp16" && t != "fp8" && t != "fp32")
      return ctx.fail(make_error(Errc::usage, "--kv-dtype " + t + ": use auto|bf16|fp16|fp8|fp32"));
    in.record.dtype = t;
  }
  if (vm.count("kv-layout")) {
    std::string l = vm["kv-layout"].as<std::string>();
    if (l != "native" && l != "vllm")
      return ctx.fail(make_error(Errc::usage, "--kv-layout " + l + ": use native|vllm"));
    in.record.layout = env::kv_layout_of(l, "");
  }
  if (vm.count("expert-parallel")) {
    std::string m = vm["expert-parallel"].as<std::string>();
    auto s = plan::parse_moe_split(m);
    if (!s) return ctx.fail(make_error(Errc::usage, "--expert-parallel " + m + ": use auto|tp|ep"));
    in.moe = *s;
  }
  if (vm.count("context-split")) {
    if (vm["context-split"].as<int>() < 1)
      return ctx.fail(make_error(Errc::usage, "--context-split must be at least 1"));
    in.context_split = vm["context-split"].as<int>();
  }
  if (vm.count("context")) in.context = vm["context"].as<int64_t>();
  if (vm.count("slots")) {
    in.slots = std::max(1, vm["slots"].as<int>());
    in.record.step_tokens = std::max(in.record.step_tokens, in.slots);
  }
  if (auto r = size_opt("workspace", &in.workspace)) return *r;
  if (auto r = size_opt("mtp", &in.mtp)) return *r;
  if (auto r = size_opt("vision", &in.vision)) return *r;
  if (auto r = size_opt("kv-overhead", &in.kv_overhead)) return *r;
  in.gpus_per_node = rc ? static_cast<int>(rc->nodes[0].gpus.size()) : 1;
  std::string cap_src;
  if (vm.count("capacity")) {
    if (auto r = size_opt("capacity", &in.capacity_per_rank)) return *r;
    cap_src = "--capacity";
  } else if (auto mi = env::read_meminfo("/"); mi) {
    in.capacity_per_rank =
        mi->get("MemAvailable") / static_cast<uint64_t>(std::max(1, in.gpus_per_node));
    cap_src = "this node's MemAvailable";
  }
  // Whether the configured engine can serve the model at all, said before the arithmetic.
  env::EngineFitOptions fo;
  fo.world = rc ? rc->world_size() : 1;
  if (vm.count("context")) fo.context = in.context;
  const env::EngineFit fit = env::engine_fit(mf, rc, fo);
  auto rows = plan::plan_table(in, std::clamp(vm["nodes"].as<int>(), 1, 16));
  const auto& s = in.shape;
  const uint64_t per_token_1 =
      plan::kv_bytes_per_token_per_rank(s, in.record, plan::KvSpread{1, 1});
  // A row answers "fits" only for weights it counted: the files', or the engine's own shard
  // plan. An estimate from config.json answers "~yes"/"~NO", never "yes".
  auto counted = [&](const plan::PlanRow& r) {
    return r.weights_from_engine || !estimate.has_value();
  };

  if (ctx.opts.json) {
    nlohmann::json j;
    nlohmann::json types = nlohmann::json::object();
    for (auto k :
         {plan::LayerKind::full_attention, plan::LayerKind::sliding_attention, plan::LayerKind::mla,
          plan::LayerKind::sparse_mla, plan::LayerKind::linear_attention})
      if (s.count(k)) types[plan::layer_kind_name(k)] = s.count(k);
    j["model"] = {{"path", model},
                  {"arch", s.arch},
                  {"model_type", s.model_type},
                  {"layers", s.layers},
                  {"layer_types", types},
                  {"kv_heads", s.kv_heads},
                  {"head_dim", s.head_dim},
                  {"sliding_window", s.sliding_window},
                  {"kv_lora_rank", s.kv_lora_rank},
                  {"qk_rope_head_dim", s.qk_rope_head_dim},
                  {"index_head_dim", s.index_head_dim},
                  {"index_kpool", s.index_kpool},
                  {"experts", s.experts},
                  {"experts_active", s.experts_active},
                  {"weight_bytes", in.weights.total},
                  {"expert_bytes", in.weights.experts},
                  {"weights_per_tensor", in.weights.per_tensor},
                  {"weights_estimated", estimate.has_value()},
                  {"weights_basis", (estimate ? estimate->basis : std::string())},
                  {"kv_bytes_per_token", per_token_1}};
    if (!in.engine_weights_why.empty()) j["engine_refuses"] = in.engine_weights_why;
    j["engine"] = {{"engine", fit.engine},   {"checked", fit.checked},   {"ok", fit.ok()},
                   {"summary", fit.summary}, {"problems", fit.problems}, {"warnings", fit.warnings},
                   {"fixes", fit.fixes}};
    j["kv_layout"] = plan::kv_layout_name(in.record.layout);
    j["kv_dtype"] = in.record.dtype;
    j["expert_parallel"] = plan::moe_split_name(in.moe);
    j["context_split"] = in.context_split;
    j["context"] = in.context;
    j["slots"] = in.slots;
    j["reserve"] = in.reserve;
    j["fixed"] = {{"workspace", in.workspace}, {"mtp", in.mtp}, {"vision", in.vision}};
    j["kv_overhead"] = in.kv_overhead;
    j["capacity_per_rank"] = in.capacity_per_rank;
    j["capacity_source"] = cap_src;
    for (const auto& r : rows) {
      nlohmann::json parts = nlohmann::json::array();
      for (const auto& p : r.parts) parts.push_back(part_json(p, in.context));
      j["rows"].push_back({{"nodes", r.nodes},
                           {"ranks", r.ranks},
                           {"expert_parallel", plan::moe_split_name(r.moe)},
                           {"weights_per_rank", r.weights_per_rank},
                           {"weights_from", r.weights_from_engine  ? "engine"
                                            : estimate.has_value() ? "estimate"
                                                                   : "files"},
                           {"kv_per_token_per_rank", r.kv_per_token_per_rank},
                           {"state_per_rank", r.state_per_rank},
                           {"kv_per_rank", r.kv_per_rank},
                           {"fixed_per_rank", r.fixed_per_rank},
                           {"reserve", r.reserve},
                           {"need_per_rank", r.need_per_rank},
                           {"capacity_per_rank", r.capacity_per_rank},
                           {"fits", counted(r) ? nlohmann::json(r.fits) : nlohmann::json()},
                           {"fits_if_estimate_holds", r.fits},
                           {"max_context", r.max_context},
                           {"layers", parts}});
    }
    *ctx.out << j.dump(2) << "\n";
    return 0;
  }
  auto& o = *ctx.out;
  std::vector<std::string> types;
  for (auto k :
       {plan::LayerKind::full_attention, plan::LayerKind::sliding_attention, plan::LayerKind::mla,
        plan::LayerKind::sparse_mla, plan::LayerKind::linear_attention})
    if (s.count(k)) types.push_back(fmt::format("{} {}", s.count(k), plan::layer_kind_name(k)));
  o << fmt::format(
      "# model {} ({}): {} layers ({}); weights {}{}{}\n", model, s.arch, s.layers,
      join(types, ", "), estimate.has_value() ? "~" : "", format_size(in.weights.total),
      s.experts
          ? fmt::format(", {} of it {} routed experts (EXPERT_PARALLEL={})",
                        format_size(in.weights.experts), s.experts, plan::moe_split_name(in.moe))
          : "");
  if (estimate.has_value())
    o << fmt::format(
        "# weights: an ESTIMATE from config.json ({}): no weight files are in {}; "
        "FITS says ~yes/~NO until they are\n",
        (estimate ? estimate->basis : std::string()), model);
  const std::string from = estimate ? "the estimate from config.json" : "estimated from the files";
  o << (in.engine_weights
            ? "# weights per rank: the native engine's shard plan, as a GPU holds them "
              "(matrices as stored: bf16, or FP8 and MXFP4 with their scales)\n"
        : in.engine_weights_why.empty()
            ? fmt::format("# weights per rank: {} (ENGINE=exec)\n", from)
            : fmt::format("# weights per rank: {}; the native engine refuses this model: {}\n",
                          from, in.engine_weights_why));
  if (!fit.ok()) {
    o << fmt::format("# ENGINE={} CANNOT SERVE THIS MODEL: {}\n# fix: {}\n", fit.engine,
                     join(fit.problems, "; "), join(fit.fixes, "; "));
    *ctx.err << fmt::format(
        "sparkctl: warning: ENGINE={} cannot serve {}: {} (preflight's model.engine fails)\n",
        fit.engine, model, join(fit.problems, "; "));
  } else if (!fit.warnings.empty()) {
    o << fmt::format("# warning: {}\n# fix: {}\n", join(fit.warnings, "; "), join(fit.fixes, "; "));
  } else if (fit.checked) {
    o << fmt::format("# engine: {}\n", fit.summary);
  }
  if (s.count(plan::LayerKind::full_attention) || s.count(plan::LayerKind::sliding_attention))
    o << fmt::format("# attention: GQA {} KV heads x head_dim {}\n", s.kv_heads, s.head_dim);
  if (s.kv_lora_rank)
    o << fmt::format("# latent attention: MLA kv_lora_rank {} + qk_rope_head_dim {}\n",
                     s.kv_lora_rank, s.qk_rope_head_dim);
  o << fmt::format(
      "# KV layout {} ({}); {} per token for the whole model on one rank; context {} x {} "
      "slots; reserve {}; fixed {}{}; capacity per rank {} ({})\n",
      plan::kv_layout_name(in.record.layout), in.record.dtype, format_size(per_token_1), in.context,
      in.slots, format_size(in.reserve), format_size(in.workspace + in.mtp + in.vision),
      in.kv_overhead ? fmt::format("; KV overhead {}", format_size(in.kv_overhead)) : "",
      in.capacity_per_rank ? format_size(in.capacity_per_rank) : "unknown",
      cap_src.empty() ? "none" : cap_src);
  o << fmt::format(
      "{:>5} {:>5} {:>7} {:>14} {:>14} {:>14} {:>14} {:>12} {:>14} {:>14} {:>5} {:>12}\n", "NODES",
      "RANKS", "EXPERTS", "WEIGHTS/RANK", "KV/TOKEN/RANK", "STATE/RANK", "KV/RANK", "RESERVE",
      "NEED/RANK", "HAVE/RANK", "FITS", "MAX_CONTEXT");
  for (const auto& r : rows)
    o << fmt::format(
        "{:>5} {:>5} {:>7} {:>14} {:>14} {:>14} {:>14} {:>12} {:>14} {:>14} {:>5} {:>12}\n",
        r.nodes, r.ranks, s.experts ? plan::moe_split_name(r.moe) : "-",
        format_size(r.weights_per_rank), fmt::format("{} B", r.kv_per_token_per_rank),
        format_size(r.state_per_rank), format_size(r.kv_per_rank), format_size(r.reserve),
        format_size(r.need_per_rank), r.capacity_per_rank ? format_size(r.capacity_per_rank) : "?",
        !r.capacity_per_rank ? "?"
        : counted(r)         ? (r.fits ? "yes" : "NO")
                             : (r.fits ? "~yes" : "~NO"),
        r.max_context < 0 ? std::string("?")
                          : (counted(r) ? "" : "~") + std::to_string(r.max_context));
  o << "# per layer type, per rank\n";
  o << fmt::format("{:>5} {:<26} {:>6} {:<13} {:>11} {:>8} {:>11} {:>14}  {}\n", "RANKS",
                   "LAYER_TYPE", "LAYERS", "PART", "PER_TOKEN", "WINDOW", "PER_SLOT",
                   "PER_SEQUENCE", "RECORD");
  for (const auto& r : rows)
    for (const auto& p : r.parts)
      o << fmt::format("{:>5} {:<26} {:>6} {:<13} {:>11} {:>8} {:>11} {:>14}  {}\n", r.ranks,
                       plan::layer_kind_name(p.kind), p.layers, p.part, per_token_text(p),
                       p.window ? std::to_string(p.window) : "-",
                       p.bytes_per_slot ? fmt::format("{} B", p.bytes_per_slot) : "-",
                       format_size(p.bytes_for(in.context)), p.record);
  return 0;
}

}  // namespace spark::cli
