#include "daemon/engine/model_config.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/strings.h"

namespace spark::engine {
namespace {

struct Arch {
  const char* name;
  Family family;
};
constexpr Arch kArchs[] = {
    {"LlamaForCausalLM", Family::llama},
    {"Qwen2ForCausalLM", Family::qwen2},
    {"Qwen3ForCausalLM", Family::qwen3},
    {"MistralForCausalLM", Family::mistral},
};

Error cfg_error(const std::string& where, const std::string& what) {
  return make_error(Errc::config, fmt::format("{}: {}", where, what));
}

// Reads an integer field; `required` fields must be present and positive.
Status get_int(const nlohmann::json& j, const char* key, int* out, bool required,
               const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (required) return cfg_error(where, fmt::format("\"{}\" is missing", key));
    return Status::Ok();
  }
  if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() > (1ll << 30))
    return cfg_error(where, fmt::format("\"{}\" must be a non-negative integer", key));
  *out = it->get<int>();
  if (required && *out == 0) return cfg_error(where, fmt::format("\"{}\" must be positive", key));
  return Status::Ok();
}

Status get_double(const nlohmann::json& j, const char* key, double* out, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status::Ok();
  if (!it->is_number()) return cfg_error(where, fmt::format("\"{}\" must be a number", key));
  *out = it->get<double>();
  return Status::Ok();
}

void add_eos(const nlohmann::json& v, std::vector<int>* out) {
  auto add = [&](int id) {
    if (std::find(out->begin(), out->end(), id) == out->end()) out->push_back(id);
  };
  if (v.is_number_integer()) add(v.get<int>());
  if (v.is_array())
    for (const auto& e : v)
      if (e.is_number_integer()) add(e.get<int>());
}

Status parse_rope(const nlohmann::json& j, ModelConfig* c, const std::string& where) {
  // transformers 5 writes rope_parameters {rope_type, rope_theta, ...}; older files have
  // rope_theta at the top and an optional rope_scaling {type|rope_type, factor, ...}.
  SPARK_TRY(get_double(j, "rope_theta", &c->rope_theta, where));
  const nlohmann::json* rs = nullptr;
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    auto it = j.find(key);
    if (it != j.end() && it->is_object()) {
      rs = &*it;
      break;
    }
  }
  if (!rs) return Status::Ok();
  SPARK_TRY(get_double(*rs, "rope_theta", &c->rope_theta, where));
  std::string type = "default";
  for (const char* key : {"rope_type", "type"}) {
    auto it = rs->find(key);
    if (it != rs->end() && it->is_string()) {
      type = it->get<std::string>();
      break;
    }
  }
  if (type != "default" && type != "linear" && type != "llama3")
    return make_error(
        Errc::unsupported,
        fmt::format("{}: rope scaling type \"{}\" is not supported (supported: default, "
                    "linear, llama3)",
                    where, type));
  c->rope.type = type;
  SPARK_TRY(get_double(*rs, "factor", &c->rope.factor, where));
  SPARK_TRY(get_double(*rs, "low_freq_factor", &c->rope.low_freq_factor, where));
  SPARK_TRY(get_double(*rs, "high_freq_factor", &c->rope.high_freq_factor, where));
  SPARK_TRY(
      get_double(*rs, "original_max_position_embeddings", &c->rope.original_max_position, where));
  if (type != "default" && c->rope.factor <= 0)
    return cfg_error(where, "rope scaling factor must be positive");
  if (type == "llama3" && !(c->rope.low_freq_factor < c->rope.high_freq_factor))
    return cfg_error(where, "llama3 rope scaling needs low_freq_factor < high_freq_factor");
  return Status::Ok();
}

}  // namespace

std::string supported_architectures() {
  std::vector<std::string> names;
  for (const auto& a : kArchs) names.emplace_back(a.name);
  return join(names, ", ");
}

Result<ModelConfig> parse_model_config(const std::string& text, const std::string& where) {
  auto j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) return cfg_error(where, "not a JSON object");
  ModelConfig c;
  auto archs = j.find("architectures");
  if (archs == j.end() || !archs->is_array() || archs->empty() || !(*archs)[0].is_string())
    return cfg_error(where, fmt::format("\"architectures\" is missing; supported: {}",
                                        supported_architectures()));
  c.architecture = (*archs)[0].get<std::string>();
  bool found = false;
  for (const auto& a : kArchs)
    if (c.architecture == a.name) {
      c.family = a.family;
      found = true;
    }
  if (!found)
    return make_error(Errc::unsupported,
                      fmt::format("{}: architecture {} is not supported; supported: {}", where,
                                  c.architecture, supported_architectures()));
  SPARK_TRY(get_int(j, "vocab_size", &c.vocab_size, true, where));
  SPARK_TRY(get_int(j, "hidden_size", &c.hidden_size, true, where));
  SPARK_TRY(get_int(j, "intermediate_size", &c.intermediate_size, true, where));
  SPARK_TRY(get_int(j, "num_hidden_layers", &c.num_layers, true, where));
  SPARK_TRY(get_int(j, "num_attention_heads", &c.num_heads, true, where));
  c.num_kv_heads = c.num_heads;
  SPARK_TRY(get_int(j, "num_key_value_heads", &c.num_kv_heads, false, where));
  if (c.num_kv_heads == 0 || c.num_heads % c.num_kv_heads != 0)
    return cfg_error(
        where, fmt::format("num_attention_heads {} is not a multiple of num_key_value_heads {}",
                           c.num_heads, c.num_kv_heads));
  c.head_dim = c.hidden_size / c.num_heads;
  SPARK_TRY(get_int(j, "head_dim", &c.head_dim, false, where));
  if (c.head_dim == 0 || c.head_dim % 2 != 0)
    return cfg_error(where, fmt::format("head_dim {} must be even and positive", c.head_dim));
  c.max_position = 4096;
  SPARK_TRY(get_int(j, "max_position_embeddings", &c.max_position, false, where));
  SPARK_TRY(get_double(j, "rms_norm_eps", &c.rms_eps, where));
  SPARK_TRY(parse_rope(j, &c, where));
  if (auto it = j.find("hidden_act"); it != j.end() && it->is_string() && *it != "silu")
    return make_error(Errc::unsupported,
                      fmt::format("{}: hidden_act \"{}\" is not supported (only silu)", where,
                                  it->get<std::string>()));
  c.tie_word_embeddings = j.value("tie_word_embeddings", false);
  const bool attention_bias = j.value("attention_bias", false);
  c.mlp_bias = j.value("mlp_bias", false);
  switch (c.family) {
    case Family::llama:
      c.qkv_bias = c.o_bias = attention_bias;
      break;
    case Family::qwen2:
      c.qkv_bias = true;  // Qwen2 always has q/k/v bias, never o_proj bias
      break;
    case Family::qwen3:
      c.qkv_bias = attention_bias;
      c.o_bias = attention_bias;
      c.qk_norm = true;
      break;
    case Family::mistral:
      break;
  }
  if (c.family == Family::qwen2 || c.family == Family::qwen3) {
    if (j.value("use_sliding_window", false))
      return make_error(Errc::unsupported,
                        fmt::format("{}: use_sliding_window=true is not supported for {}", where,
                                    c.architecture));
  }
  if (c.family == Family::mistral) {
    SPARK_TRY(get_int(j, "sliding_window", &c.sliding_window, false, where));
  }
  if (c.family == Family::llama && c.mlp_bias) {
    // Supported: loaded like the other biases.
  }
  SPARK_TRY(get_int(j, "bos_token_id", &c.bos_token_id, false, where));
  if (auto it = j.find("eos_token_id"); it != j.end()) add_eos(*it, &c.eos_token_ids);
  if (auto it = j.find("torch_dtype"); it != j.end() && it->is_string()) c.torch_dtype = *it;
  if (auto it = j.find("dtype"); it != j.end() && it->is_string()) c.torch_dtype = *it;
  return c;
}

Result<ModelConfig> load_model_config(const std::string& dir) {
  const std::string path = dir + "/config.json";
  auto text = read_file(path);
  if (!text)
    return make_error(
        Errc::not_found,
        fmt::format("{}: cannot read — is {} a Hugging Face model directory?", path, dir));
  auto c = parse_model_config(*text, path);
  if (!c) return c;
  if (auto gen = read_file(dir + "/generation_config.json")) {
    auto j = nlohmann::json::parse(*gen, nullptr, false);
    if (!j.is_discarded() && j.is_object())
      if (auto it = j.find("eos_token_id"); it != j.end()) add_eos(*it, &c->eos_token_ids);
  }
  return c;
}

}  // namespace spark::engine
