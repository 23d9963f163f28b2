#pragma once
// Memory arithmetic per rank: the rank's share of the weights, its KV pool for the
// configured context and slots, and the reserve, against what the node has. Plan context
// from memory, never the reverse: an engine refuses a context whose KV cache does not
// fit only after minutes of loading.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/hf/config.h"

namespace spark::env {

/// The parts of a Hugging Face config.json that size the KV cache.
struct ModelShape {
  std::string arch;  // architectures[0] or model_type
  int layers = 0;    // num_hidden_layers
  int kv_heads = 0;  // num_key_value_heads (GQA), = num_attention_heads when absent
  int head_dim = 0;  // head_dim, else hidden_size / num_attention_heads
  bool mla = false;  // kv_lora_rank present (DeepSeek-style latent attention)
  int kv_lora_rank = 0;
  int qk_rope_head_dim = 0;
  int dtype_bytes = 2;  // torch_dtype
};

/// The shape from what core/hf read of config.json (which takes text_config when the model
/// nests one).
Result<ModelShape> model_shape(const hf::Config& config);
/// The same from parsed config.json.
Result<ModelShape> model_shape(const nlohmann::json& config);
/// Bytes per element of a KV_DTYPE value ("auto" = the model's dtype).
int kv_dtype_bytes(const std::string& kv_dtype, const ModelShape& s);
/// KV bytes per token for the whole model (all layers, all heads).
uint64_t kv_bytes_per_token(const ModelShape& s, int kv_bytes);
/// KV bytes per token on one of `ranks` ranks: GQA splits KV heads across ranks (a head is
/// never split: with fewer heads than ranks each rank holds one); MLA splits layers.
uint64_t kv_bytes_per_token_per_rank(const ModelShape& s, int kv_bytes, int ranks);

/// One row of the plan.
struct PlanRow {
  int nodes = 0;
  int ranks = 0;
  uint64_t weights_per_rank = 0;
  uint64_t kv_per_token_per_rank = 0;
  uint64_t kv_per_rank = 0;  // for context × slots
  uint64_t reserve = 0;
  uint64_t need_per_rank = 0;
  uint64_t capacity_per_rank = 0;  // 0: unknown
  bool fits = false;
  int64_t max_context = 0;  // largest context per slot that fits (0: none; -1 unknown)
};

struct PlanInput {
  ModelShape shape;
  uint64_t weight_bytes = 0;
  int kv_bytes = 2;
  int64_t context = 0;
  int slots = 1;
  uint64_t reserve = 0;
  int gpus_per_node = 1;
  uint64_t capacity_per_rank = 0;  // 0: unknown
};

/// The arithmetic for one ring size.
PlanRow plan_row(const PlanInput& in, int nodes);
/// Rows for 1..max_nodes nodes.
std::vector<PlanRow> plan_table(const PlanInput& in, int max_nodes = 4);

}  // namespace spark::env
