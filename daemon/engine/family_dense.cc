// The dense decoder families: Llama, Qwen2, Qwen3, Mistral. Attention with grouped-query
// heads (biases, per-head q/k norms and a sliding window as each family has them) and a
// gated SiLU MLP in every layer.
#include <fmt/format.h>

#include "daemon/engine/family.h"

namespace spark::engine {

Status parse_dense_family(const hf::Config& h, ModelConfig* c, const std::string& where) {
  c->mlp_bias = h.mlp_bias;
  switch (c->family) {
    case Family::llama:
      c->qkv_bias = c->o_bias = h.attention_bias;
      break;
    case Family::qwen2:
      c->qkv_bias = true;  // Qwen2 always has q/k/v bias, never o_proj bias
      break;
    case Family::qwen3:
      c->qkv_bias = h.attention_bias;
      c->o_bias = h.attention_bias;
      c->qk_norm = QkNorm::per_head;
      break;
    case Family::mistral:
      break;
    default:
      return make_error(Errc::internal, fmt::format("{}: not a dense family", where));
  }
  if ((c->family == Family::qwen2 || c->family == Family::qwen3) && h.use_sliding_window)
    return make_error(
        Errc::unsupported,
        fmt::format("{}: use_sliding_window=true is not supported for {}", where, c->architecture));
  if (c->family == Family::mistral) c->sliding_window = h.sliding_window.value_or(0);
  if (!h.intermediate_size)
    return make_error(Errc::config, fmt::format("{}: \"intermediate_size\" is missing", where));
  return Status::Ok();
}

Result<ShardPlan> plan_dense_family(const ModelConfig& c, const PlanOptions& o,
                                    const std::string& where) {
  auto p = start_plan(c, o, where);
  if (!p) return p;
  if (c.intermediate_size % o.world)
    return make_error(
        Errc::config,
        fmt::format("{}: tensor parallel size {} must divide intermediate_size ({}) — choose a "
                    "TP size that divides it",
                    where, o.world, c.intermediate_size));
  p->inter = c.intermediate_size / o.world;
  PlanBuilder b(&*p);
  b.embedding_and_head(c);
  for (int l = 0; l < c.num_layers; ++l) {
    b.attention(c, l);
    b.gated_mlp(fmt::format("model.layers.{}.mlp.", l), "gate_proj", "up_proj", "down_proj",
                c.hidden_size, c.intermediate_size, static_cast<int64_t>(o.rank) * p->inter,
                p->inter, l, WeightRole::w_gate_up, WeightRole::w_down, c.mlp_bias);
  }
  return p;
}

}  // namespace spark::engine
