#pragma once
// The plan's inputs as a ring has them: the model directory (config.json for the shape, the
// files for the weights) and the cluster file's settings (KV_DTYPE, KV_LAYOUT, EXPERT_PARALLEL,
// CONTEXT_SPLIT, CONTEXT_LEN, SLOTS, MEM_RESERVE and the stated fixed costs). The
// arithmetic itself is core/model_plan.h, shared with the engine.
#include <optional>
#include <string>

#include "core/config.h"
#include "core/model_plan.h"
#include "core/weight_estimate.h"
#include "env/model_files.h"

namespace spark::env {

/// A ring setting's value: the cluster file's when there is one, else the key's default.
std::string ring_setting(const RingConfig* cfg, const std::string& key);

/// The KV layout a ring plans for: KV_LAYOUT, where "auto" is ours with ENGINE=native and
/// vLLM's with ENGINE=exec.
plan::KvLayout kv_layout_of(const std::string& kv_layout, const std::string& engine);

/// The plan input from the model directory and the settings (`cfg` may be null: defaults).
/// Capacity and GPUs per node are left for the caller. Errors name the model's config.json.
/// Without weight files (only config.json) the weights are estimated from config.json, at
/// `weights_dtype` when given (see plan::estimate_weights), and the estimate is returned in
/// `estimate` (left empty when the files were counted): a plan from it never "fits".
Result<plan::PlanInput> plan_input(const ModelFiles& mf, const RingConfig* cfg,
                                   const std::string& weights_dtype = "",
                                   std::optional<plan::WeightEstimate>* estimate = nullptr);

}  // namespace spark::env
