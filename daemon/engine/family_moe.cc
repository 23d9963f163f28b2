// The mixture-of-experts families: Qwen3-MoE, Mixtral, GLM-4.5/4.6 (Glm4Moe) and MiniMax-M2
// over grouped-query attention, DeepSeek-V3 over latent attention (family_mla.cc). Each layer's MLP
// is either dense (Qwen3-MoE's mlp_only_layers and decoder_sparse_step, GLM's
// first_k_dense_replace) or a routed block: a router (softmax or sigmoid scores; a correction bias
// for the choice only; group-limited top-k; renormalisation; a scaling factor), the top-k experts'
// gated SiLU MLPs weighted by the router, and shared experts added for every token (GLM).
#include <fmt/format.h>

#include <algorithm>

#include "core/model_plan.h"
#include "daemon/engine/family.h"

namespace spark::engine {
namespace {

using cfgjson::get_bool;
using cfgjson::get_double;
using cfgjson::get_int;
using cfgjson::get_int_list;
using cfgjson::get_string;
using cfgjson::unsupported;

}  // namespace

MoeNames moe_tensor_names(Family f) {
  switch (f) {
    case Family::mixtral:
      return {"block_sparse_moe", "", "w1", "w3", "w2", ""};
    case Family::minimax_m2:
      return {"block_sparse_moe", "e_score_correction_bias", "w1", "w3", "w2", ""};
    case Family::glm4_moe:
    case Family::deepseek_v3:
      return {"mlp",           "gate.e_score_correction_bias", "gate_proj", "up_proj", "down_proj",
              "shared_experts"};
    default:
      return {"mlp", "", "gate_proj", "up_proj", "down_proj", ""};
  }
}

namespace {

// The partial rotary factor, from the top level or the rope parameters (transformers 5), or
// MiniMax's rotary_dim.
Status rotary_dim_of(const nlohmann::json& j, ModelConfig* c, const std::string& where) {
  double factor = 1.0;
  auto f = get_double(j, "partial_rotary_factor", 1.0, where);
  if (!f) return f.error();
  factor = *f;
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    auto it = j.find(key);
    if (it != j.end() && it->is_object() && it->contains("partial_rotary_factor")) {
      auto g = get_double(*it, "partial_rotary_factor", 1.0, where);
      if (!g) return g.error();
      factor = *g;
    }
  }
  if (!(factor > 0 && factor <= 1))
    return make_error(Errc::config,
                      fmt::format("{}: partial_rotary_factor {} must be in (0, 1]", where, factor));
  c->rotary_dim = static_cast<int>(c->head_dim * factor);  // as transformers truncates it
  auto rd = get_int(j, "rotary_dim", 0, where);
  if (!rd) return rd.error();
  if (*rd > 0) {
    if (j.contains("partial_rotary_factor") && *rd != c->rotary_dim)
      return make_error(Errc::config,
                        fmt::format("{}: rotary_dim {} disagrees with partial_rotary_factor {} of "
                                    "head_dim {}",
                                    where, *rd, factor, c->head_dim));
    c->rotary_dim = *rd;
  }
  if (c->rotary_dim < 2 || c->rotary_dim % 2 != 0)
    return make_error(Errc::config, fmt::format("{}: the rotary dimension {} (head_dim {} x {}) "
                                                "must be even and at least 2",
                                                where, c->rotary_dim, c->head_dim, factor));
  return Status::Ok();
}

// Layer types other than full attention, and a sliding window where the family never uses
// one, change the arithmetic: refused by name.
Status full_attention_only(const nlohmann::json& j, const std::string& where) {
  auto it = j.find("layer_types");
  if (it != j.end() && it->is_array())
    for (const auto& t : *it)
      if (!t.is_string() || t.get<std::string>() != "full_attention")
        return unsupported(where, "layer_types", t,
                           "this family runs full attention in every layer");
  return Status::Ok();
}

Status parse_qwen3_moe(const nlohmann::json& j, const hf::Config& h, ModelConfig* c,
                       const std::string& where) {
  auto& m = c->moe;
  auto E = get_int(j, "num_experts", 0, where);
  auto k = get_int(j, "num_experts_per_tok", 0, where);
  auto I = get_int(j, "moe_intermediate_size", 0, where);
  auto norm = get_bool(j, "norm_topk_prob", false, where);
  auto step = get_int(j, "decoder_sparse_step", 1, where);
  auto only = get_int_list(j, "mlp_only_layers", where);
  auto shared = get_int(j, "shared_expert_intermediate_size", 0, where);
  for (const Status& s : {E.status(), k.status(), I.status(), norm.status(), step.status(),
                          only.status(), shared.status()})
    SPARK_TRY(s);
  if (*shared > 0)
    return unsupported(where, "shared_expert_intermediate_size", *shared,
                       "Qwen3-MoE has no shared expert");
  if (h.use_sliding_window)
    return unsupported(where, "use_sliding_window", true, "Qwen3-MoE runs full attention");
  if (*step < 1)
    return make_error(Errc::config, fmt::format("{}: decoder_sparse_step must be >= 1", where));
  m.experts = *E;
  m.top_k = *k;
  m.expert_inter = *I;
  m.norm_topk = *norm;
  m.score = RouterScore::softmax;
  m.layer_moe.assign(static_cast<size_t>(c->num_layers), 0);
  for (int l = 0; l < c->num_layers; ++l) {
    const bool dense = std::find(only->begin(), only->end(), l) != only->end();
    m.layer_moe[static_cast<size_t>(l)] = !dense && m.experts > 0 && (l + 1) % *step == 0;
  }
  for (int l : *only)
    if (l >= c->num_layers)
      return make_error(Errc::config, fmt::format("{}: mlp_only_layers names layer {} of {}", where,
                                                  l, c->num_layers));
  c->qkv_bias = c->o_bias = h.attention_bias;
  c->qk_norm = QkNorm::per_head;
  return Status::Ok();
}

Status parse_mixtral(const nlohmann::json& j, const hf::Config& h, ModelConfig* c,
                     const std::string& where) {
  auto& m = c->moe;
  auto E = get_int(j, "num_local_experts", 0, where);
  auto k = get_int(j, "num_experts_per_tok", 0, where);
  SPARK_TRY(E.status());
  SPARK_TRY(k.status());
  m.experts = *E;
  m.top_k = *k;
  m.expert_inter = c->intermediate_size;
  m.norm_topk = true;  // softmax over the chosen logits
  m.score = RouterScore::softmax;
  m.layer_moe.assign(static_cast<size_t>(c->num_layers), 1);
  c->sliding_window = h.sliding_window.value_or(0);
  return Status::Ok();
}

Status parse_glm4_moe(const nlohmann::json& j, const hf::Config& h, ModelConfig* c,
                      const std::string& where) {
  SPARK_TRY(parse_grouped_moe(j, c, where, "GLM-4.5"));
  auto qk = get_bool(j, "use_qk_norm", false, where);
  SPARK_TRY(qk.status());
  c->qkv_bias = h.attention_bias;
  c->o_bias = false;
  c->qk_norm = *qk ? QkNorm::per_head : QkNorm::none;
  return rotary_dim_of(j, c, where);
}

Status parse_minimax_m2(const nlohmann::json& j, const hf::Config& h, ModelConfig* c,
                        const std::string& where) {
  (void)h;
  auto& m = c->moe;
  auto E = get_int(j, "num_local_experts", 0, where);
  auto k = get_int(j, "num_experts_per_tok", 0, where);
  auto scoring = get_string(j, "scoring_func", where);
  auto qk = get_bool(j, "use_qk_norm", true, where);
  auto qk_type = get_string(j, "qk_norm_type", where);
  auto bias = get_bool(j, "use_routing_bias", true, where);
  auto shared = get_int(j, "shared_intermediate_size", 0, where);
  auto scale = get_double(j, "routed_scaling_factor", 1.0, where);
  auto attn = get_int_list(j, "attn_type_list", where);
  auto mtp = get_int(j, "num_mtp_modules", 0, where);
  auto use_mtp = get_bool(j, "use_mtp", false, where);
  for (const Status& s :
       {E.status(), k.status(), scoring.status(), qk.status(), qk_type.status(), bias.status(),
        shared.status(), scale.status(), attn.status(), mtp.status(), use_mtp.status()})
    SPARK_TRY(s);
  if (!scoring->empty() && *scoring != "sigmoid")
    return unsupported(where, "scoring_func", *scoring, "MiniMax-M2 scores experts with a sigmoid");
  if (!*qk) return unsupported(where, "use_qk_norm", false, "MiniMax-M2 normalises q and k");
  if (!qk_type->empty() && *qk_type != "per_layer")
    return unsupported(where, "qk_norm_type", *qk_type,
                       "MiniMax-M2 normalises all heads of q and of k together (per_layer)");
  if (!*bias)
    return unsupported(where, "use_routing_bias", false,
                       "the MiniMax-M2 router adds its correction bias");
  if (*shared > 0)
    return unsupported(where, "shared_intermediate_size", *shared,
                       "MiniMax-M2 has no shared expert");
  if (*scale != 1.0)
    return unsupported(where, "routed_scaling_factor", *scale,
                       "MiniMax-M2's router does not scale its weights");
  for (int t : *attn)
    if (t != 1)
      return unsupported(where, "attn_type_list", t,
                         "only full softmax attention (1) in every layer");
  m.experts = *E;
  m.top_k = *k;
  m.expert_inter = c->intermediate_size;
  m.score = RouterScore::sigmoid;
  m.correction_bias = true;
  m.norm_topk = true;
  m.mtp_layers = *use_mtp ? *mtp : 0;
  m.layer_moe.assign(static_cast<size_t>(c->num_layers), 1);
  c->qk_norm = QkNorm::per_layer;
  return rotary_dim_of(j, c, where);
}

}  // namespace

Status parse_grouped_moe(const nlohmann::json& j, ModelConfig* c, const std::string& where,
                         const char* family) {
  auto& m = c->moe;
  auto E = get_int(j, "n_routed_experts", 0, where);
  if (E && *E == 0) E = get_int(j, "num_experts", 0, where);
  auto k = get_int(j, "num_experts_per_tok", 0, where);
  auto I = get_int(j, "moe_intermediate_size", 0, where);
  auto nshared = get_int(j, "n_shared_experts", 0, where);
  auto dense = get_int(j, "first_k_dense_replace", 0, where);
  auto groups = get_int(j, "n_group", 1, where);
  auto tgroups = get_int(j, "topk_group", 1, where);
  auto scale = get_double(j, "routed_scaling_factor", 1.0, where);
  auto norm = get_bool(j, "norm_topk_prob", true, where);
  auto mtp = get_int(j, "num_nextn_predict_layers", 0, where);
  auto method = get_string(j, "topk_method", where);
  auto scoring = get_string(j, "scoring_func", where);
  auto freq = get_int(j, "moe_layer_freq", 1, where);
  for (const Status& s : {E.status(), k.status(), I.status(), nshared.status(), dense.status(),
                          groups.status(), tgroups.status(), scale.status(), norm.status(),
                          mtp.status(), method.status(), scoring.status(), freq.status()})
    SPARK_TRY(s);
  if (!method->empty() && *method != "noaux_tc")
    return unsupported(
        where, "topk_method", *method,
        fmt::format("{} routes with noaux_tc (sigmoid, correction bias, groups)", family));
  if (!scoring->empty() && *scoring != "sigmoid")
    return unsupported(where, "scoring_func", *scoring,
                       fmt::format("{} scores experts with a sigmoid", family));
  if (*freq != 1)
    return unsupported(where, "moe_layer_freq", *freq,
                       "every layer after first_k_dense_replace is a mixture of experts");
  m.experts = *E;
  m.top_k = *k;
  m.expert_inter = *I;
  m.shared_inter = *I * *nshared;
  m.score = RouterScore::sigmoid;
  m.correction_bias = true;
  m.n_group = std::max(1, *groups);
  m.topk_group = std::max(1, *tgroups);
  m.routed_scaling = *scale;
  m.norm_topk = *norm;
  m.mtp_layers = *mtp;
  m.layer_moe.assign(static_cast<size_t>(c->num_layers), 0);
  for (int l = *dense; l < c->num_layers; ++l) m.layer_moe[static_cast<size_t>(l)] = 1;
  return Status::Ok();
}

Status parse_moe_family(const hf::Config& h, ModelConfig* c, const std::string& where) {
  const auto& j = cfgjson::model_object(h);
  SPARK_TRY(full_attention_only(j, where));
  switch (c->family) {
    case Family::qwen3_moe:
      SPARK_TRY(parse_qwen3_moe(j, h, c, where));
      break;
    case Family::mixtral:
      SPARK_TRY(parse_mixtral(j, h, c, where));
      break;
    case Family::glm4_moe:
      SPARK_TRY(parse_glm4_moe(j, h, c, where));
      break;
    case Family::minimax_m2:
      SPARK_TRY(parse_minimax_m2(j, h, c, where));
      break;
    case Family::deepseek_v3:  // the grouped sigmoid MoE of GLM-4.5, latent attention
      SPARK_TRY(parse_grouped_moe(j, c, where, "DeepSeek-V3"));
      SPARK_TRY(parse_mla_attention(j, h, c, where));
      break;
    default:
      return make_error(Errc::internal, fmt::format("{}: not an MoE family", where));
  }
  if (h.mlp_bias) return unsupported(where, "mlp_bias", true, "the experts carry no bias");
  if (c->moe.experts < 1 || c->moe.top_k < 1 || c->moe.expert_inter < 1)
    return make_error(
        Errc::config,
        fmt::format("{}: {} needs its experts, experts per token and expert "
                    "intermediate size (got {}, {}, {})",
                    where, c->architecture, c->moe.experts, c->moe.top_k, c->moe.expert_inter));
  return Status::Ok();
}

Status place_experts(const ModelConfig& c, const PlanOptions& o, ShardPlan* pp,
                     const std::string& where) {
  ShardPlan& p = *pp;
  const auto& m = c.moe;
  const int world = o.world, rank = o.rank;
  // Where the routed experts go: the rule `plan` uses too (core/model_plan.h).
  const bool tp_ok = plan::experts_split_evenly(m.expert_inter, world, m.expert_block);
  plan::MoeSplit place = o.placement;
  if (place == plan::MoeSplit::automatic) {
    place = tp_ok || world == 1 ? plan::MoeSplit::tensor : plan::MoeSplit::expert;
    p.placement_reason =
        world == 1 ? "one rank holds every expert"
        : tp_ok    ? fmt::format(
                         "auto: {} ranks split each expert's intermediate size {} into "
                            "equal shares{}",
                         world, m.expert_inter,
                      m.expert_block > 1 ? fmt::format(" of whole {}-blocks", m.expert_block) : "")
                : fmt::format(
                      "auto: {} ranks do not split each expert's intermediate size {} "
                      "into equal shares{}, so each rank holds whole experts",
                      world, m.expert_inter,
                      m.expert_block > 1 ? fmt::format(" of whole {}-blocks", m.expert_block) : "");
  } else {
    p.placement_reason = fmt::format("EXPERT_PARALLEL={}", plan::moe_split_name(place));
  }
  if (place == plan::MoeSplit::tensor && !tp_ok)
    return make_error(
        Errc::config,
        fmt::format("{}: EXPERT_PARALLEL=tp: {} ranks do not split the experts' "
                    "intermediate size {} into equal shares{} — use "
                    "EXPERT_PARALLEL=ep or auto",
                    where, world, m.expert_inter,
                    m.expert_block > 1 ? fmt::format(" of whole {}-blocks", m.expert_block) : ""));
  if (place == plan::MoeSplit::expert && world > m.experts)
    return make_error(Errc::config,
                      fmt::format("{}: EXPERT_PARALLEL=ep: {} ranks for {} experts leave a rank "
                                  "without any — use fewer ranks or EXPERT_PARALLEL=tp",
                                  where, world, m.experts));
  p.placement = place;
  if (place == plan::MoeSplit::tensor) {
    p.expert0 = 0;
    p.experts = m.experts;
    p.expert_inter = m.expert_inter / world;
  } else {
    const int per = (m.experts + world - 1) / world;
    p.expert0 = std::min(m.experts, rank * per);
    p.experts = std::min(per, m.experts - p.expert0);
    p.expert_inter = m.expert_inter;
  }
  return Status::Ok();
}

Result<ShardPlan> plan_moe_family(const ModelConfig& c, const PlanOptions& o,
                                  const std::string& where) {
  auto pr = start_plan(c, o, where);
  if (!pr) return pr;
  ShardPlan& p = *pr;
  const auto& m = c.moe;
  const int world = o.world, rank = o.rank;
  const int64_t H = c.hidden_size;
  bool has_dense = false;
  for (int l = 0; l < c.num_layers; ++l) has_dense = has_dense || !m.is_moe(l);
  if (has_dense) {
    if (c.intermediate_size % world)
      return make_error(
          Errc::config,
          fmt::format("{}: tensor parallel size {} must divide intermediate_size ({}) of the "
                      "dense layers — choose a TP size that divides it",
                      where, world, c.intermediate_size));
    p.inter = c.intermediate_size / world;
  }
  SPARK_TRY(place_experts(c, o, &p, where));
  const plan::MoeSplit place = p.placement;
  // The shared experts: split like a dense MLP where the ranks divide them, else whole on
  // rank 0 (its sum is added once, before the all-reduce).
  int64_t shared0 = 0;
  if (m.shared_inter > 0) {
    if (m.shared_inter % world == 0) {
      p.shared_inter = m.shared_inter / world;
      shared0 = static_cast<int64_t>(rank) * p.shared_inter;
    } else {
      p.shared_inter = rank == 0 ? m.shared_inter : 0;
    }
  }
  const MoeNames nm = moe_tensor_names(c.family);
  PlanBuilder b(&p);
  b.embedding_and_head(c);
  for (int l = 0; l < c.num_layers; ++l) {
    if (c.is_mla())
      b.mla_attention(c, l);
    else
      b.attention(c, l);
    const std::string pre = fmt::format("model.layers.{}.", l);
    if (!m.is_moe(l)) {
      b.gated_mlp(pre + "mlp.", "gate_proj", "up_proj", "down_proj", H, c.intermediate_size,
                  static_cast<int64_t>(rank) * p.inter, p.inter, l, WeightRole::w_gate_up,
                  WeightRole::w_down, false);
      continue;
    }
    const std::string blk = pre + nm.block + ".";
    const int64_t E = m.experts, I = m.expert_inter, n = p.expert_inter;
    const int64_t i0 = place == plan::MoeSplit::tensor ? static_cast<int64_t>(rank) * n : 0;
    b.dest(l, WeightRole::router, static_cast<size_t>(E * H), DestKind::matrix);
    b.read(blk + "gate.weight", {E, H}, Slice{}, l, WeightRole::router);
    if (m.correction_bias) {
      b.dest(l, WeightRole::router_bias, static_cast<size_t>(E), DestKind::f32);
      b.read(blk + nm.bias, {E}, Slice{}, l, WeightRole::router_bias);
    }
    const size_t per_gu = static_cast<size_t>(2 * n * H), per_down = static_cast<size_t>(H * n);
    b.dest(l, WeightRole::experts_gate_up, per_gu * static_cast<size_t>(p.experts),
           DestKind::matrix);
    b.dest(l, WeightRole::experts_down, per_down * static_cast<size_t>(p.experts),
           DestKind::matrix);
    for (int e = 0; e < p.experts; ++e) {
      const std::string ex = fmt::format("{}experts.{}.", blk, p.expert0 + e);
      const size_t at = static_cast<size_t>(e);
      b.read(ex + nm.gate + ".weight", {I, H}, Slice{i0, n, 0, -1}, l, WeightRole::experts_gate_up,
             at * per_gu);
      b.read(ex + nm.up + ".weight", {I, H}, Slice{i0, n, 0, -1}, l, WeightRole::experts_gate_up,
             at * per_gu + static_cast<size_t>(n * H));
      b.read(ex + nm.down + ".weight", {H, I}, Slice{0, -1, i0, n}, l, WeightRole::experts_down,
             at * per_down);
    }
    if (p.shared_inter > 0)
      b.gated_mlp(blk + nm.shared + ".", "gate_proj", "up_proj", "down_proj", H, m.shared_inter,
                  shared0, p.shared_inter, l, WeightRole::shared_gate_up, WeightRole::shared_down,
                  false);
  }
  if (m.mtp_layers > 0)
    for (int i = 0; i < m.mtp_layers; ++i)
      p.skipped_prefixes.push_back(fmt::format("model.layers.{}.", c.num_layers + i));
  return pr;
}

}  // namespace spark::engine
