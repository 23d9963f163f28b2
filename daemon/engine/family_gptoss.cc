// gpt-oss (GptOssForCausalLM), as transformers defines it: grouped-query attention with
// q/k/v/o biases and a learned sink logit per head that joins each softmax; layers alternating
// sliding-window and full attention (`layer_types`); YaRN RoPE; every layer a mixture of
// experts whose router has a bias (top-k over the logits, softmax over the k) and whose
// experts carry biases, hold gate and up interleaved (row 2i gate, 2i + 1 up) and use the
// clamped activation (up + 1) * g * sigmoid(1.702 g). The experts are read as OpenAI publishes
// them, in MXFP4 (`*_blocks`, `*_scales`): kept packed on a device whose expert products
// take them (Device::keeps_mxfp4), widened at load elsewhere; attention, router, embedding
// and lm_head are bf16.
#include <fmt/format.h>

#include "core/model_plan.h"
#include "daemon/engine/family.h"

namespace spark::engine {
namespace {

using cfgjson::get_double;
using cfgjson::get_int;
using cfgjson::unsupported;

constexpr float kGptOssAlpha = 1.702f;  // GptOssExperts.alpha, not in config.json

// Marks an experts destination MXFP4 (ShardDest::mxfp4): rows of `cols` values, one e8m0
// scale per 32 of them.
void mark_mxfp4(ShardDest* d, int64_t cols) {
  d->mxfp4 = true;
  d->cols = cols;
  d->scale_row_shift = 0;
  d->scale_rows = d->numel / static_cast<size_t>(cols);
  d->scale_ld = static_cast<size_t>(cols / 32);
}

}  // namespace

Status parse_gptoss_family(const hf::Config& h, ModelConfig* c, const std::string& where) {
  const auto& j = cfgjson::model_object(h);
  auto& m = c->moe;
  auto E = get_int(j, "num_local_experts", 0, where);
  auto k = get_int(j, "num_experts_per_tok", 0, where);
  if (k && *k == 0) k = get_int(j, "experts_per_token", 0, where);
  auto limit = get_double(j, "swiglu_limit", 7.0, where);
  auto window = get_int(j, "sliding_window", 0, where);
  for (const Status& s : {E.status(), k.status(), limit.status(), window.status()}) SPARK_TRY(s);
  m.experts = *E;
  m.top_k = *k;
  m.expert_inter = c->intermediate_size;
  m.score = RouterScore::softmax;
  m.norm_topk = true;  // softmax over the chosen logits
  m.router_bias = true;
  m.expert_bias = true;
  m.interleaved = true;
  m.swiglu_limit = static_cast<float>(*limit);
  m.swiglu_alpha = kGptOssAlpha;
  if (!(m.swiglu_limit > 0))
    return unsupported(where, "swiglu_limit", *limit,
                       "gpt-oss's activation needs a positive limit");
  m.layer_moe.assign(static_cast<size_t>(c->num_layers), 1);
  c->attn_sinks = true;
  const bool bias = !j.contains("attention_bias") || j["attention_bias"].is_null() ||
                    (j["attention_bias"].is_boolean() && j["attention_bias"].get<bool>());
  if (!bias) return unsupported(where, "attention_bias", false, "gpt-oss's attention has biases");
  c->qkv_bias = c->o_bias = true;
  // layer_types: absent means alternating, sliding first (GptOssConfig's default).
  c->layer_window.assign(static_cast<size_t>(c->num_layers), 0);
  auto lt = j.find("layer_types");
  const bool listed = lt != j.end() && !lt->is_null();
  if (listed && (!lt->is_array() || lt->size() != static_cast<size_t>(c->num_layers)))
    return make_error(Errc::config, fmt::format("{}: \"layer_types\" must list each of the {} "
                                                "layers",
                                                where, c->num_layers));
  for (int l = 0; l < c->num_layers; ++l) {
    std::string t = l % 2 == 0 ? "sliding_attention" : "full_attention";
    if (listed) {
      const auto& v = (*lt)[static_cast<size_t>(l)];
      if (!v.is_string()) return unsupported(where, "layer_types", v, "a layer type name");
      t = v.get<std::string>();
    }
    if (t == "sliding_attention") {
      if (*window < 1)
        return make_error(Errc::config,
                          fmt::format("{}: layer {} is sliding_attention but sliding_window is "
                                      "not set",
                                      where, l));
      c->layer_window[static_cast<size_t>(l)] = *window;
    } else if (t != "full_attention") {
      return unsupported(where, "layer_types", t, "sliding_attention or full_attention");
    }
  }
  if (m.experts < 1 || m.top_k < 1 || m.top_k > m.experts || m.expert_inter < 1)
    return make_error(Errc::config, fmt::format("{}: GptOssForCausalLM needs num_local_experts, "
                                                "num_experts_per_tok (at most the experts) and "
                                                "intermediate_size (got {}, {}, {})",
                                                where, m.experts, m.top_k, m.expert_inter));
  if (c->hidden_size % 32 || m.expert_inter % 32)
    return make_error(Errc::config,
                      fmt::format("{}: MXFP4 experts need hidden_size ({}) and intermediate_size "
                                  "({}) in whole 32-value blocks",
                                  where, c->hidden_size, m.expert_inter));
  return Status::Ok();
}

Result<ShardPlan> plan_gptoss_family(const ModelConfig& c, const PlanOptions& o,
                                     const std::string& where) {
  auto pr = start_plan(c, o, where);
  if (!pr) return pr;
  ShardPlan& p = *pr;
  SPARK_TRY(place_experts(c, o, &p, where));
  const auto& m = c.moe;
  const int64_t H = c.hidden_size, E = m.experts, I = m.expert_inter, NH = c.num_heads;
  const int64_t n = p.expert_inter;
  const int64_t i0 = p.placement == plan::MoeSplit::tensor ? o.rank * n : 0;
  PlanBuilder b(&p);
  b.embedding_and_head(c);
  for (int l = 0; l < c.num_layers; ++l) {
    b.attention(c, l);
    const std::string pre = fmt::format("model.layers.{}.", l);
    b.dest(l, WeightRole::sinks, static_cast<size_t>(p.heads), DestKind::f32);
    b.read(pre + "self_attn.sinks", {NH},
           Slice{static_cast<int64_t>(o.rank) * p.heads, p.heads, 0, -1}, l, WeightRole::sinks);
    const std::string mlp = pre + "mlp.";
    b.dest(l, WeightRole::router, static_cast<size_t>(E * H), DestKind::matrix);
    b.read(mlp + "router.weight", {E, H}, Slice{}, l, WeightRole::router);
    b.dest(l, WeightRole::router_b, static_cast<size_t>(E), DestKind::vector);
    b.read(mlp + "router.bias", {E}, Slice{}, l, WeightRole::router_b);
    const size_t held = static_cast<size_t>(p.experts);
    const size_t per_gu = static_cast<size_t>(2 * n * H), per_down = static_cast<size_t>(H * n);
    b.dest(l, WeightRole::experts_gate_up, per_gu * held, DestKind::matrix);
    mark_mxfp4(&p.dests.back(), H);
    b.dest(l, WeightRole::experts_down, per_down * held, DestKind::matrix);
    mark_mxfp4(&p.dests.back(), n);
    b.dest(l, WeightRole::experts_gate_up_b, static_cast<size_t>(2 * n) * held, DestKind::vector);
    b.read(mlp + "experts.gate_up_proj_bias", {E, 2 * I},
           Slice{p.expert0, p.experts, 2 * i0, 2 * n}, l, WeightRole::experts_gate_up_b);
    // The down bias is added once: by every rank for its own experts, by rank 0 alone when
    // the experts are split by width.
    if (p.placement == plan::MoeSplit::expert || o.rank == 0) {
      b.dest(l, WeightRole::experts_down_b, static_cast<size_t>(H) * held, DestKind::vector);
      b.read(mlp + "experts.down_proj_bias", {E, H}, Slice{p.expert0, p.experts, 0, -1}, l,
             WeightRole::experts_down_b);
    }
    for (int e = 0; e < p.experts; ++e) {
      const int64_t ge = p.expert0 + e;
      // gate/up: rows [2 i0, 2 (i0 + n)) of the interleaved [2I][H], every column.
      b.read(mlp + "experts.gate_up_proj_blocks", {E, 2 * I, H / 32, 16}, Slice{}, l,
             WeightRole::experts_gate_up, static_cast<size_t>(e) * per_gu);
      auto& gu = p.reads.back();
      gu.mxfp4 = true;
      gu.mx_expert = ge;
      gu.mx_row0 = 2 * i0;
      gu.rows = 2 * n;
      gu.mx_col0 = 0;
      gu.cols = H;
      gu.mx_cols = H;
      // down: every row of [H][I], columns [i0, i0 + n).
      b.read(mlp + "experts.down_proj_blocks", {E, H, I / 32, 16}, Slice{}, l,
             WeightRole::experts_down, static_cast<size_t>(e) * per_down);
      auto& dn = p.reads.back();
      dn.mxfp4 = true;
      dn.mx_expert = ge;
      dn.mx_row0 = 0;
      dn.rows = H;
      dn.mx_col0 = i0;
      dn.cols = n;
      dn.mx_cols = I;
    }
  }
  return pr;
}

}  // namespace spark::engine
