#include "env/plan.h"

#include <fmt/format.h>

#include <algorithm>

namespace spark::env {

using nlohmann::json;

Result<ModelShape> model_shape(const hf::Config& c) {
  ModelShape s;
  if (!c.architectures.empty())
    s.arch = c.architectures[0];
  else
    s.arch = c.model_type;
  s.layers = c.num_hidden_layers.value_or(0);
  int heads = c.num_attention_heads.value_or(0);
  s.kv_heads = c.num_key_value_heads.value_or(0);
  if (s.kv_heads == 0) s.kv_heads = heads;
  s.head_dim = c.head_dim.value_or(0);
  if (s.head_dim == 0 && heads > 0) s.head_dim = c.hidden_size.value_or(0) / heads;
  s.kv_lora_rank = c.kv_lora_rank.value_or(0);
  s.qk_rope_head_dim = c.qk_rope_head_dim.value_or(0);
  s.mla = s.kv_lora_rank > 0;
  const std::string dt = c.dtype.empty() ? "bfloat16" : c.dtype;
  s.dtype_bytes = (dt == "float32") ? 4 : (dt.find("float8") != std::string::npos ? 1 : 2);
  if (s.layers <= 0)
    return make_error(Errc::config, "config.json: num_hidden_layers is missing or not positive");
  if (!s.mla && (s.kv_heads <= 0 || s.head_dim <= 0))
    return make_error(Errc::config,
                      "config.json: need num_key_value_heads (or num_attention_heads) "
                      "and head_dim (or hidden_size) for the KV size");
  return s;
}

Result<ModelShape> model_shape(const json& config) {
  auto c = hf::parse_config(config, "config.json");
  if (!c) return c.error();
  return model_shape(*c);
}

int kv_dtype_bytes(const std::string& kv_dtype, const ModelShape& s) {
  if (kv_dtype == "fp8") return 1;
  if (kv_dtype == "bf16" || kv_dtype == "fp16") return 2;
  if (kv_dtype == "fp32") return 4;
  return s.dtype_bytes;
}

uint64_t kv_bytes_per_token(const ModelShape& s, int kv_bytes) {
  auto b = static_cast<uint64_t>(kv_bytes) * static_cast<uint64_t>(s.layers);
  if (s.mla) return b * static_cast<uint64_t>(s.kv_lora_rank + s.qk_rope_head_dim);
  return b * 2u * static_cast<uint64_t>(s.kv_heads) * static_cast<uint64_t>(s.head_dim);
}

uint64_t kv_bytes_per_token_per_rank(const ModelShape& s, int kv_bytes, int ranks) {
  ranks = std::max(ranks, 1);
  auto b = static_cast<uint64_t>(kv_bytes);
  if (s.mla) {
    auto layers = static_cast<uint64_t>((s.layers + ranks - 1) / ranks);
    return b * layers * static_cast<uint64_t>(s.kv_lora_rank + s.qk_rope_head_dim);
  }
  auto heads = static_cast<uint64_t>(std::max(1, (s.kv_heads + ranks - 1) / ranks));
  return b * static_cast<uint64_t>(s.layers) * 2u * heads * static_cast<uint64_t>(s.head_dim);
}

PlanRow plan_row(const PlanInput& in, int nodes) {
  PlanRow r;
  r.nodes = nodes;
  r.ranks = nodes * std::max(1, in.gpus_per_node);
  auto ranks = static_cast<uint64_t>(r.ranks);
  r.weights_per_rank = (in.weight_bytes + ranks - 1) / ranks;
  r.kv_per_token_per_rank = kv_bytes_per_token_per_rank(in.shape, in.kv_bytes, r.ranks);
  r.kv_per_rank = r.kv_per_token_per_rank *
                  static_cast<uint64_t>(std::max<int64_t>(in.context, 0)) *
                  static_cast<uint64_t>(std::max(in.slots, 1));
  r.reserve = in.reserve;
  r.need_per_rank = r.weights_per_rank + r.kv_per_rank + r.reserve;
  r.capacity_per_rank = in.capacity_per_rank;
  if (in.capacity_per_rank == 0) {
    r.fits = false;
    r.max_context = -1;
    return r;
  }
  r.fits = r.need_per_rank <= in.capacity_per_rank;
  uint64_t fixed = r.weights_per_rank + r.reserve;
  uint64_t per_ctx = r.kv_per_token_per_rank * static_cast<uint64_t>(std::max(in.slots, 1));
  if (fixed >= in.capacity_per_rank || per_ctx == 0) {
    r.max_context = 0;
  } else {
    r.max_context = static_cast<int64_t>((in.capacity_per_rank - fixed) / per_ctx);
  }
  return r;
}

std::vector<PlanRow> plan_table(const PlanInput& in, int max_nodes) {
  std::vector<PlanRow> rows;
  for (int n = 1; n <= max_nodes; ++n) rows.push_back(plan_row(in, n));
  return rows;
}

}  // namespace spark::env
