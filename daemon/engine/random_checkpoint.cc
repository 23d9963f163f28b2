#include "daemon/engine/random_checkpoint.h"

#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/strings.h"

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

const char* arch_name(Family f) {
  switch (f) {
    case Family::llama:
      return "LlamaForCausalLM";
    case Family::qwen2:
      return "Qwen2ForCausalLM";
    case Family::qwen3:
      return "Qwen3ForCausalLM";
    case Family::mistral:
      return "MistralForCausalLM";
  }
  return "?";
}

const char* model_type(Family f) {
  switch (f) {
    case Family::llama:
      return "llama";
    case Family::qwen2:
      return "qwen2";
    case Family::qwen3:
      return "qwen3";
    case Family::mistral:
      return "mistral";
  }
  return "?";
}

struct Named {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> data;
};

}  // namespace

ModelConfig small_config(Family family, int vocab_size, int hidden, int layers) {
  ModelConfig c;
  c.family = family;
  c.architecture = arch_name(family);
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
  if (family == Family::qwen2) c.qkv_bias = true;
  if (family == Family::qwen3) c.qk_norm = true;
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
    if (c.qk_norm) {
      add(p + "self_attn.q_norm.weight", {hd}, 0.2f, 1.0f);
      add(p + "self_attn.k_norm.weight", {hd}, 0.2f, 1.0f);
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
      {"model_type", model_type(c.family)},
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
  if (c.family == Family::qwen3) cj["attention_bias"] = c.qkv_bias;
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
