#include "env/plan.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/strings.h"
#include "daemon/engine/device.h"
#include "daemon/engine/model_config.h"
#include "daemon/engine/shard_plan.h"

namespace spark::env {

std::string ring_setting(const RingConfig* cfg, const std::string& key) {
  if (cfg) return cfg->get(key);
  for (const auto& k : ring_keys())
    if (key == k.name) return k.default_value ? k.default_value : "";
  return "";
}

plan::KvLayout kv_layout_of(const std::string& kv_layout, const std::string& engine) {
  if (kv_layout == "vllm") return plan::KvLayout::vllm;
  if (kv_layout == "native") return plan::KvLayout::native;
  return engine == "exec" ? plan::KvLayout::vllm : plan::KvLayout::native;
}

Result<plan::PlanInput> plan_input(const ModelFiles& mf, const RingConfig* cfg,
                                   const std::string& weights_dtype,
                                   std::optional<plan::WeightEstimate>* estimate) {
  const std::string where = mf.dir + "/config.json";
  auto shape = plan::model_shape(mf.config, where);
  if (!shape) return shape.error();
  auto get = [&](const char* k) { return ring_setting(cfg, k); };
  auto size = [&](const char* k) -> Result<uint64_t> {
    std::string why;
    auto v = parse_size(get(k), &why);
    if (!v) return make_error(Errc::config, fmt::format("{}: {}", k, why));
    return *v;
  };
  auto integer = [&](const char* k) -> Result<int64_t> {
    auto v = parse_i64(get(k));
    if (!v) return make_error(Errc::config, fmt::format("{}={} is not an integer", k, get(k)));
    return *v;
  };
  plan::PlanInput in;
  in.shape = std::move(*shape);
  in.weights.total = mf.weight_bytes;
  in.weights.experts = mf.tensor_sizes ? mf.expert_bytes : 0;
  in.weights.per_tensor = mf.tensor_sizes;
  if (mf.weight_bytes == 0) {
    // Sized before the download: nothing counted, so the shapes in config.json say it.
    auto est = plan::estimate_weights(mf.config.raw, where, weights_dtype);
    if (!est && est.error().code == Errc::usage) return est.error();
    // A config too sparse to estimate from still plans the KV, with weights not counted
    // (0 B, and never "fits").
    plan::WeightEstimate e =
        est ? *est : plan::WeightEstimate{0, 0, 0, "not estimated: " + est.error().message};
    in.weights.total = e.total;
    in.weights.experts = e.experts;
    in.weights.per_tensor = false;
    if (estimate) *estimate = e;
  }
  in.record.layout = kv_layout_of(get("KV_LAYOUT"), get("ENGINE"));
  in.record.dtype = get("KV_DTYPE");
  // Our engine's weights per rank are its own shard plan's, as a GPU holds them (bf16
  // matrices and vectors, fp32 where the plan says so; an FP8 checkpoint's projections at
  // a byte a weight plus their block scales; MXFP4 experts at half a byte plus a scale byte
  // per 32): the plan, preflight and the engine then agree to the byte. A model the engine
  // refuses keeps the estimate from the files.
  if (get("ENGINE") != "exec") {
    auto mc = engine::model_config_from(mf.config, where);
    if (mc) {
      in.engine_weights = [c = std::move(*mc), where](
                              int ranks, plan::MoeSplit split) -> std::optional<uint64_t> {
        uint64_t most = 0;
        for (int r = 0; r < ranks; ++r) {
          engine::PlanOptions o;
          o.rank = r;
          o.world = ranks;
          o.placement = split;
          auto p = engine::make_shard_plan(c, o, where);
          if (!p) return std::nullopt;
          most = std::max(most, p->held_bytes(2, 2, /*fp8_kept=*/true, /*mxfp4_kept=*/true));
        }
        return most;
      };
    } else {
      in.engine_weights_why = mc.error().message;
    }
  }
  auto moe = plan::parse_moe_split(get("EXPERT_PARALLEL"));
  if (!moe) return moe.error();
  in.moe = *moe;
  auto split = integer("CONTEXT_SPLIT");
  if (!split) return split.error();
  in.context_split = static_cast<int>(std::max<int64_t>(1, *split));
  auto ctx = integer("CONTEXT_LEN");
  if (!ctx) return ctx.error();
  in.context = *ctx;
  auto slots = integer("SLOTS");
  if (!slots) return slots.error();
  in.slots = static_cast<int>(std::max<int64_t>(1, *slots));
  auto chunk = integer("PREFILL_CHUNK");
  if (!chunk) return chunk.error();
  in.record.step_tokens =
      static_cast<int>(std::clamp<int64_t>(std::max(*chunk, *slots), 1, 1 << 20));
  for (auto [key, out] :
       {std::pair{"MEM_RESERVE", &in.reserve}, std::pair{"MEM_WORKSPACE", &in.workspace},
        std::pair{"MEM_MTP", &in.mtp}, std::pair{"MEM_VISION", &in.vision},
        std::pair{"KV_OVERHEAD", &in.kv_overhead}}) {
    auto v = size(key);
    if (!v) return v.error();
    *out = *v;
  }
  return in;
}

}  // namespace spark::env
