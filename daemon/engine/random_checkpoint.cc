#include "daemon/engine/random_checkpoint.h"

#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/strings.h"
#include "daemon/engine/family.h"

namespace spark::engine {
namespace {

// splitmix64: tiny, portable, the same on every platform (std::normal_distribution is not).
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return (static_cast<double>(next() >> 11) + 0.5) / 9007199254740992.0; }
  float normal() {
    double u1 = uniform(), u2 = uniform();
    return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(2 * M_PI * u2));
  }
};

struct Named {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> data;
};

}  // namespace

ModelConfig small_config(Family family, int vocab_size, int hidden, int layers) {
  ModelConfig c;
  c.family = family;
  c.architecture = architecture_name(family);
  c.vocab_size = vocab_size;
  c.hidden_size = hidden;
  c.intermediate_size = hidden * 2;
  c.num_layers = layers;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = hidden / 4;
  c.max_position = 512;
  c.rms_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.bos_token_id = 1;
  c.eos_token_ids = {2};
  c.rotary_dim = c.head_dim;
  if (family == Family::qwen2) c.qkv_bias = true;
  if (family == Family::qwen3 || family == Family::qwen3_moe) c.qk_norm = QkNorm::per_head;
  for (const auto& f : family_table())
    if (f.family == family) c.recipe = f.recipe;
  if (c.recipe == RecipeKind::moe) {
    auto& m = c.moe;
    m.experts = 8;
    m.top_k = 2;
    m.expert_inter = hidden / 2;
    m.layer_moe.assign(static_cast<size_t>(layers), 1);
    switch (family) {
      case Family::qwen3_moe:
        m.norm_topk = true;
        if (layers > 1) m.layer_moe[0] = 0;  // mlp_only_layers [0]
        break;
      case Family::mixtral:
        m.norm_topk = true;
        c.intermediate_size = m.expert_inter;
        break;
      case Family::glm4_moe:
        m.score = RouterScore::sigmoid;
        m.correction_bias = true;
        m.norm_topk = true;
        m.n_group = 4;
        m.topk_group = 2;
        m.routed_scaling = 1.5;
        m.shared_inter = m.expert_inter;
        if (layers > 1) m.layer_moe[0] = 0;  // first_k_dense_replace 1
        c.qkv_bias = true;
        c.rotary_dim = c.head_dim / 2;
        break;
      case Family::minimax_m2:
        m.score = RouterScore::sigmoid;
        m.correction_bias = true;
        m.norm_topk = true;
        c.intermediate_size = m.expert_inter;
        c.qk_norm = QkNorm::per_layer;
        c.rotary_dim = c.head_dim / 2;
        break;
      default:
        break;
    }
  }
  return c;
}

Status write_random_checkpoint(const std::string& dir, const RandomCheckpointSpec& spec) {
  const auto& c = spec.config;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    return make_error(Errc::io, fmt::format("{}: cannot create directory: {}", dir, ec.message()));
  Rng rng{spec.seed};
  const int64_t H = c.hidden_size, V = c.vocab_size, hd = c.head_dim, I = c.intermediate_size;
  const int64_t NH = c.num_heads, NKV = c.num_kv_heads;
  std::vector<Named> ts;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, float scale, float offset) {
    Named n{name, shape, {}};
    int64_t cnt = 1;
    for (auto d : shape) cnt *= d;
    n.data.resize(static_cast<size_t>(cnt));
    for (auto& x : n.data) x = offset + scale * rng.normal();
    ts.push_back(std::move(n));
  };
  auto lin = [&](const std::string& name, int64_t out, int64_t in) {
    add(name, {out, in}, static_cast<float>(1.0 / std::sqrt(static_cast<double>(in))), 0.0f);
  };
  add("model.embed_tokens.weight", {V, H}, 1.0f, 0.0f);
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    add(p + "input_layernorm.weight", {H}, 0.2f, 1.0f);
    add(p + "post_attention_layernorm.weight", {H}, 0.2f, 1.0f);
    lin(p + "self_attn.q_proj.weight", NH * hd, H);
    lin(p + "self_attn.k_proj.weight", NKV * hd, H);
    lin(p + "self_attn.v_proj.weight", NKV * hd, H);
    lin(p + "self_attn.o_proj.weight", H, NH * hd);
    if (c.qkv_bias) {
      add(p + "self_attn.q_proj.bias", {NH * hd}, 0.3f, 0.0f);
      add(p + "self_attn.k_proj.bias", {NKV * hd}, 0.3f, 0.0f);
      add(p + "self_attn.v_proj.bias", {NKV * hd}, 0.3f, 0.0f);
    }
    if (c.o_bias) add(p + "self_attn.o_proj.bias", {H}, 0.3f, 0.0f);
    if (c.qk_norm == QkNorm::per_head) {
      add(p + "self_attn.q_norm.weight", {hd}, 0.2f, 1.0f);
      add(p + "self_attn.k_norm.weight", {hd}, 0.2f, 1.0f);
    } else if (c.qk_norm == QkNorm::per_layer) {
      add(p + "self_attn.q_norm.weight", {NH * hd}, 0.2f, 1.0f);
      add(p + "self_attn.k_norm.weight", {NKV * hd}, 0.2f, 1.0f);
    }
    if (c.moe.is_moe(l)) {
      const auto nm = moe_tensor_names(c.family);
      const auto& m = c.moe;
      const int64_t E = m.experts, EI = m.expert_inter;
      const std::string b = p + nm.block + ".";
      lin(b + "gate.weight", E, H);
      if (m.correction_bias) add(b + nm.bias, {E}, 0.05f, 0.0f);
      for (int64_t e = 0; e < E; ++e) {
        const std::string x = fmt::format("{}experts.{}.", b, e);
        lin(x + nm.gate + ".weight", EI, H);
        lin(x + nm.up + ".weight", EI, H);
        lin(x + nm.down + ".weight", H, EI);
      }
      if (m.shared_inter > 0) {
        const std::string sh = b + nm.shared + ".";
        lin(sh + "gate_proj.weight", m.shared_inter, H);
        lin(sh + "up_proj.weight", m.shared_inter, H);
        lin(sh + "down_proj.weight", H, m.shared_inter);
      }
      continue;
    }
    lin(p + "mlp.gate_proj.weight", I, H);
    lin(p + "mlp.up_proj.weight", I, H);
    lin(p + "mlp.down_proj.weight", H, I);
    if (c.mlp_bias) {
      add(p + "mlp.gate_proj.bias", {I}, 0.3f, 0.0f);
      add(p + "mlp.up_proj.bias", {I}, 0.3f, 0.0f);
      add(p + "mlp.down_proj.bias", {H}, 0.3f, 0.0f);
    }
  }
  add("model.norm.weight", {H}, 0.2f, 1.0f);
  if (!c.tie_word_embeddings)
    add("lm_head.weight", {V, H}, static_cast<float>(2.0 / std::sqrt(static_cast<double>(H))),
        0.0f);

  // Shards: contiguous runs of tensors of about equal size.
  const int shards = std::max(1, spec.shards);
  uint64_t total = 0;
  for (const auto& t : ts) total += t.data.size() * dtype_size(spec.dtype);
  nlohmann::json weight_map = nlohmann::json::object();
  size_t next = 0;
  for (int s = 0; s < shards; ++s) {
    const std::string fname =
        shards == 1 ? "model.safetensors"
                    : fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, shards);
    std::vector<TensorToWrite> part;
    uint64_t bytes = 0;
    const uint64_t target = total * static_cast<uint64_t>(s + 1) / static_cast<uint64_t>(shards);
    uint64_t before = 0;
    for (size_t i = 0; i < next; ++i) before += ts[i].data.size() * dtype_size(spec.dtype);
    while (next < ts.size() && (part.empty() || before + bytes < target || s == shards - 1)) {
      part.push_back({ts[next].name, ts[next].shape, ts[next].data.data()});
      bytes += ts[next].data.size() * dtype_size(spec.dtype);
      weight_map[ts[next].name] = fname;
      ++next;
    }
    SPARK_TRY(write_safetensors(dir + "/" + fname, part, spec.dtype, {{"format", "pt"}}));
  }
  if (shards > 1) {
    nlohmann::json idx = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    std::string why;
    if (!write_file_atomic(dir + "/model.safetensors.index.json", idx.dump(2) + "\n", &why))
      return make_error(Errc::io, fmt::format("{}/model.safetensors.index.json: {}", dir, why));
  }

  nlohmann::json cj = {
      {"architectures", {c.architecture}},
      {"model_type", model_type_name(c.family)},
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"intermediate_size", c.intermediate_size},
      {"num_hidden_layers", c.num_layers},
      {"num_attention_heads", c.num_heads},
      {"num_key_value_heads", c.num_kv_heads},
      {"head_dim", c.head_dim},
      {"max_position_embeddings", c.max_position},
      {"rms_norm_eps", c.rms_eps},
      {"rope_theta", c.rope_theta},
      {"hidden_act", "silu"},
      {"tie_word_embeddings", c.tie_word_embeddings},
      {"bos_token_id", c.bos_token_id},
      {"eos_token_id", c.eos_token_ids.size() == 1 ? nlohmann::json(c.eos_token_ids[0])
                                                   : nlohmann::json(c.eos_token_ids)},
      {"torch_dtype", spec.dtype == DType::bf16 ? "bfloat16" : "float32"},
  };
  if (c.rope.type != "default")
    cj["rope_scaling"] = {{"rope_type", c.rope.type},
                          {"factor", c.rope.factor},
                          {"low_freq_factor", c.rope.low_freq_factor},
                          {"high_freq_factor", c.rope.high_freq_factor},
                          {"original_max_position_embeddings", c.rope.original_max_position}};
  if (c.family == Family::llama) {
    cj["attention_bias"] = c.o_bias;
    cj["mlp_bias"] = c.mlp_bias;
  }
  if (c.family == Family::qwen3 || c.family == Family::qwen3_moe) cj["attention_bias"] = c.qkv_bias;
  const auto& m = c.moe;
  const double rot = static_cast<double>(c.rotary_dim) / c.head_dim;
  switch (c.family) {
    case Family::qwen3_moe: {
      nlohmann::json only = nlohmann::json::array();
      for (int l = 0; l < c.num_layers; ++l)
        if (!m.is_moe(l)) only.push_back(l);
      cj["num_experts"] = m.experts;
      cj["num_experts_per_tok"] = m.top_k;
      cj["moe_intermediate_size"] = m.expert_inter;
      cj["norm_topk_prob"] = m.norm_topk;
      cj["decoder_sparse_step"] = 1;
      cj["mlp_only_layers"] = only;
      break;
    }
    case Family::mixtral:
      cj["num_local_experts"] = m.experts;
      cj["num_experts_per_tok"] = m.top_k;
      cj["sliding_window"] =
          c.sliding_window > 0 ? nlohmann::json(c.sliding_window) : nlohmann::json(nullptr);
      break;
    case Family::glm4_moe: {
      int dense = 0;
      while (dense < c.num_layers && !m.is_moe(dense)) ++dense;
      cj["n_routed_experts"] = m.experts;
      cj["n_shared_experts"] = m.shared_inter / std::max(1, m.expert_inter);
      cj["num_experts_per_tok"] = m.top_k;
      cj["moe_intermediate_size"] = m.expert_inter;
      cj["first_k_dense_replace"] = dense;
      cj["n_group"] = m.n_group;
      cj["topk_group"] = m.topk_group;
      cj["routed_scaling_factor"] = m.routed_scaling;
      cj["norm_topk_prob"] = m.norm_topk;
      cj["use_qk_norm"] = c.qk_norm == QkNorm::per_head;
      cj["attention_bias"] = c.qkv_bias;
      cj["partial_rotary_factor"] = rot;
      break;
    }
    case Family::minimax_m2:
      cj["num_local_experts"] = m.experts;
      cj["num_experts_per_tok"] = m.top_k;
      cj["scoring_func"] = "sigmoid";
      cj["use_qk_norm"] = true;
      cj["qk_norm_type"] = "per_layer";
      cj["use_routing_bias"] = true;
      cj["partial_rotary_factor"] = rot;
      break;
    default:
      break;
  }
  if (c.family == Family::mistral)
    cj["sliding_window"] =
        c.sliding_window > 0 ? nlohmann::json(c.sliding_window) : nlohmann::json(nullptr);
  std::string why;
  if (!write_file_atomic(dir + "/config.json", cj.dump(2) + "\n", &why))
    return make_error(Errc::io, fmt::format("{}/config.json: {}", dir, why));
  nlohmann::json gj = {{"bos_token_id", c.bos_token_id}, {"eos_token_id", cj["eos_token_id"]}};
  if (!write_file_atomic(dir + "/generation_config.json", gj.dump(2) + "\n", &why))
    return make_error(Errc::io, fmt::format("{}/generation_config.json: {}", dir, why));
  return Status::Ok();
}

}  // namespace spark::engine
