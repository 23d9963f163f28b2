#include "env/engine_fit.h"

#include <fmt/format.h>

#include "core/strings.h"
#include "daemon/engine/model_config.h"
#include "daemon/engine/safetensors.h"
#include "daemon/engine/shard_plan.h"
#include "env/plan.h"

namespace spark::env {

namespace {

constexpr const char* kExecFix =
    "serve it with an engine that runs it: ENGINE=exec with ENGINE_EXEC naming that engine "
    "(vLLM, TensorFold; see the example two-sparks-exec-vllm.env and `man 5 sparkctl.env`), or "
    "point MODEL_PATH at a bf16/fp16/fp32 or FP8 checkpoint of a family the native engine runs";

}  // namespace

EngineFit engine_fit(const ModelFiles& mf, const RingConfig* cfg, const EngineFitOptions& o) {
  EngineFit f;
  auto get = [&](const char* k) { return ring_setting(cfg, k); };
  f.engine = get("ENGINE").empty() ? "native" : get("ENGINE");
  if (f.engine == "exec") {
    f.summary = "ENGINE=exec: the command in ENGINE_EXEC decides what it serves";
    return f;
  }
  if (!mf.config_ok) {
    f.summary = fmt::format("no readable config.json in {}: see model.files", mf.dir);
    return f;
  }
  f.checked = true;
  const std::string where = mf.dir + "/config.json";
  bool refused = false;
  auto mc = engine::model_config_from(mf.config, where);
  if (!mc) {
    f.problems.push_back(mc.error().message);
    refused = true;
  }

  // Weight format: every tensor type in the shards must be one the engine loads.
  for (const auto& [name, seen] : mf.tensor_dtypes) {
    auto d = engine::dtype_from_name(name);
    if (d && engine::dtype_loadable(*d)) continue;
    // FP8 projections and MXFP4 experts are read where config.json declares them.
    if (d && mc && *d == engine::DType::f8_e4m3 && mc->weights.fp8()) continue;
    if (d && mc && *d == engine::DType::u8 && mc->weights.mxfp4()) continue;
    f.problems.push_back(fmt::format("{} tensor(s) are {} (e.g. {}); the native engine loads {}",
                                     seen.tensors, name, seen.example,
                                     engine::loadable_dtype_names()));
    refused = true;
  }
  if (refused) f.fixes.push_back(kExecFix);

  if (mc) {
    // The shard plan for this ring's ranks: heads, KV heads and experts must divide.
    engine::PlanOptions po;
    po.world = std::max(1, o.world);
    if (auto s = plan::parse_moe_split(get("EXPERT_PARALLEL"))) po.placement = *s;
    if (auto p = engine::make_shard_plan(*mc, po, where); !p) {
      f.problems.push_back(p.error().message);
      f.fixes.push_back(
          "run it on a number of ranks the model divides into (NODE<i>_GPUS, nodes), or "
          "set EXPERT_PARALLEL");
    }
    // KV_DTYPE as the engine keeps it: fp16 it has no cache of; fp8 not for latent
    // attention, whose latent cache is bf16 or fp32 (the engine refuses both at start).
    const std::string kv = get("KV_DTYPE");
    if (kv == "fp16" || (kv == "fp8" && mc->is_mla())) {
      f.problems.push_back(
          kv == "fp16" ? std::string("KV_DTYPE=fp16: the native engine keeps its KV cache in "
                                     "bf16 (GPU), fp32 or fp8 (e4m3)")
                       : fmt::format("KV_DTYPE=fp8: {} keeps a latent KV cache (multi-head latent "
                                     "attention), which the native engine holds in bf16 or fp32",
                                     mc->architecture));
      f.fixes.push_back("set KV_DTYPE=auto (bf16 on a GPU, fp32 on the CPU)");
    }
    // CONTEXT_LEN against what the model was trained for.
    int64_t ctx = o.context ? *o.context : parse_i64(get("CONTEXT_LEN")).value_or(0);
    bool set = o.context.has_value() || (cfg && cfg->settings.count("CONTEXT_LEN") &&
                                         cfg->settings.at("CONTEXT_LEN").source != "default");
    if (ctx > mc->max_position) {
      std::string what =
          fmt::format("CONTEXT_LEN {}{} is above the model's max_position_embeddings {}", ctx,
                      set ? "" : " (the default)", mc->max_position);
      if (set) {
        f.problems.push_back(what);
      } else {
        f.warnings.push_back(
            what + fmt::format(": the engine serves {} tokens per request", mc->max_position));
      }
      f.fixes.push_back(fmt::format("set CONTEXT_LEN={} (or less)", mc->max_position));
    }
  }

  if (o.needs_tokenizer && !mf.tokenizer_json) {
    f.problems.push_back(fmt::format(
        "{}/tokenizer.json is missing: rank 0 needs it to serve text requests", mf.dir));
    f.fixes.push_back(
        "copy the checkpoint's tokenizer.json (and tokenizer_config.json) into the model "
        "directory: download the whole repository, not only the weights");
  }
  if (mc) {
    std::vector<std::string> types;
    for (const auto& [n, seen] : mf.tensor_dtypes) types.push_back(n);
    f.summary = fmt::format("the native engine runs {} ({}); {}", mc->architecture,
                            engine::model_type_name(mc->family),
                            types.empty() ? std::string("the shards' weight types unread")
                                          : "weights " + join(types, ", "));
  } else {
    f.summary = "the native engine refuses this model";
  }
  return f;
}

}  // namespace spark::env
