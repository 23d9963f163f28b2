#pragma once
// The architecture families: one file each (family_dense.cc, family_moe.cc), holding the
// config.json fields only that family has, its tensor names and its shard plan. The layer
// recipe over the device is composed from the engine's shared blocks (layer_blocks.h) by
// what the config says (ModelConfig::recipe, the MoE layer map). A new family is a new file
// and a row in family_table().
#include <span>

#include "core/error.h"
#include "core/hf/config.h"
#include "daemon/engine/model_config.h"
#include "daemon/engine/shard_plan.h"

namespace spark::engine {

struct FamilyEntry {
  const char* architecture;  // the `architectures` name
  const char* model_type;
  Family family;
  RecipeKind recipe;
  /// Reads the family's own fields of config.json into *c (the shared ones are set);
  /// refuses a field that changes the arithmetic and that the engine does not implement.
  Status (*parse)(const hf::Config& h, ModelConfig* c, const std::string& where);
  /// This rank's shard plan.
  Result<ShardPlan> (*plan)(const ModelConfig& c, const PlanOptions& o, const std::string& where);
};

/// How an MoE family names its block's tensors under model.layers.L.
struct MoeNames {
  const char* block;  // "mlp" or "block_sparse_moe"
  const char* bias;   // the correction bias under the block ("" none)
  const char* gate;   // expert projections
  const char* up;
  const char* down;
  const char* shared;  // shared experts under the block ("" none)
};
MoeNames moe_tensor_names(Family f);

/// Every architecture the engine runs.
std::span<const FamilyEntry> family_table();

// The families' functions (one file each).
Status parse_dense_family(const hf::Config& h, ModelConfig* c, const std::string& where);
Result<ShardPlan> plan_dense_family(const ModelConfig& c, const PlanOptions& o,
                                    const std::string& where);
Status parse_moe_family(const hf::Config& h, ModelConfig* c, const std::string& where);
Result<ShardPlan> plan_moe_family(const ModelConfig& c, const PlanOptions& o,
                                  const std::string& where);

/// The grouped sigmoid router's fields that GLM-4.5 and DeepSeek-V3 share (n_routed_experts,
/// n_shared_experts, first_k_dense_replace, n_group, topk_group, routed_scaling_factor,
/// norm_topk_prob, the MTP layers; noaux_tc and sigmoid only), `family` naming it in messages.
Status parse_grouped_moe(const nlohmann::json& j, ModelConfig* c, const std::string& where,
                         const char* family);
/// Latent attention's fields (family_mla.cc): q_lora_rank, kv_lora_rank, qk_nope_head_dim,
/// qk_rope_head_dim, v_head_dim, rope_interleave; refuses DeepSeek-V3.2's sparse indexer,
/// attention biases and rope types other than default and yarn, by field and value.
Status parse_mla_attention(const nlohmann::json& j, const hf::Config& h, ModelConfig* c,
                           const std::string& where);

/// Where the routed experts go (EXPERT_PARALLEL and the rule `plan` uses): sets the plan's
/// placement, its reason and the experts and width this rank holds.
Status place_experts(const ModelConfig& c, const PlanOptions& o, ShardPlan* p,
                     const std::string& where);
Status parse_gptoss_family(const hf::Config& h, ModelConfig* c, const std::string& where);
Result<ShardPlan> plan_gptoss_family(const ModelConfig& c, const PlanOptions& o,
                                     const std::string& where);

/// The plan's common start: heads, KV heads and the vocabulary split, checked against the
/// world size (Errc::config naming the numbers and the fix).
Result<ShardPlan> start_plan(const ModelConfig& c, const PlanOptions& o, const std::string& where);

}  // namespace spark::engine
