#include "daemon/engine/model_config.h"

#include <fmt/format.h>

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

// A field the engine cannot run without: present and positive.
Status required(const std::optional<int>& v, const char* key, int* out, const std::string& where) {
  if (!v) return cfg_error(where, fmt::format("\"{}\" is missing", key));
  if (*v == 0) return cfg_error(where, fmt::format("\"{}\" must be positive", key));
  *out = *v;
  return Status::Ok();
}

Status check_rope(const hf::RopeScaling& r, const std::string& where) {
  if (r.type != "default" && r.type != "linear" && r.type != "llama3")
    return make_error(
        Errc::unsupported,
        fmt::format("{}: rope scaling type \"{}\" is not supported (supported: default, "
                    "linear, llama3)",
                    where, r.type));
  if (r.type != "default" && r.factor <= 0)
    return cfg_error(where, "rope scaling factor must be positive");
  if (r.type == "llama3" && !(r.low_freq_factor < r.high_freq_factor))
    return cfg_error(where, "llama3 rope scaling needs low_freq_factor < high_freq_factor");
  return Status::Ok();
}

// Sizes far beyond any published checkpoint are a damaged or hostile config.json: refusing
// them here keeps an absurd value from reaching an allocation (vocab 1e9 aborted sparkd
// with std::bad_alloc; head_dim 1e9 held 2 GB for half a minute).
struct Bound {
  const char* key;
  int ModelConfig::*field;
  int lo, hi;
};
constexpr Bound kBounds[] = {
    {"vocab_size", &ModelConfig::vocab_size, 1, 1 << 22},
    {"hidden_size", &ModelConfig::hidden_size, 2, 1 << 16},
    {"intermediate_size", &ModelConfig::intermediate_size, 1, 1 << 19},
    {"num_hidden_layers", &ModelConfig::num_layers, 1, 1024},
    {"num_attention_heads", &ModelConfig::num_heads, 1, 1024},
    {"num_key_value_heads", &ModelConfig::num_kv_heads, 1, 1024},
    {"head_dim", &ModelConfig::head_dim, 2, 1024},
    {"max_position_embeddings", &ModelConfig::max_position, 1, 1 << 24},
};

Status check_bounds(const ModelConfig& c, const std::string& where) {
  for (const auto& b : kBounds) {
    int v = c.*b.field;
    if (v < b.lo || v > b.hi)
      return cfg_error(where, fmt::format("\"{}\" is {}; it must be {} to {} (a damaged "
                                          "config.json?)",
                                          b.key, v, b.lo, b.hi));
  }
  if (!(c.rms_eps > 0 && c.rms_eps < 1))
    return cfg_error(where,
                     fmt::format("\"rms_norm_eps\" is {}; it must be > 0 and < 1", c.rms_eps));
  if (!(c.rope_theta > 0 && c.rope_theta < 1e12))
    return cfg_error(where,
                     fmt::format("\"rope_theta\" is {}; it must be > 0 and < 1e12", c.rope_theta));
  if (c.bos_token_id >= c.vocab_size)
    return cfg_error(where, fmt::format("\"bos_token_id\" {} is outside the vocabulary of {}",
                                        c.bos_token_id, c.vocab_size));
  return Status::Ok();
}

}  // namespace

std::string supported_architectures() {
  std::vector<std::string> names;
  for (const auto& a : kArchs) names.emplace_back(a.name);
  return join(names, ", ");
}

Result<ModelConfig> model_config_from(const hf::Config& h, const std::string& where) {
  ModelConfig c;
  if (h.architectures.empty())
    return cfg_error(where, fmt::format("\"architectures\" is missing; supported: {}",
                                        supported_architectures()));
  c.architecture = h.architectures[0];
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
  SPARK_TRY(required(h.vocab_size, "vocab_size", &c.vocab_size, where));
  SPARK_TRY(required(h.hidden_size, "hidden_size", &c.hidden_size, where));
  SPARK_TRY(required(h.intermediate_size, "intermediate_size", &c.intermediate_size, where));
  SPARK_TRY(required(h.num_hidden_layers, "num_hidden_layers", &c.num_layers, where));
  SPARK_TRY(required(h.num_attention_heads, "num_attention_heads", &c.num_heads, where));
  c.num_kv_heads = h.num_key_value_heads.value_or(c.num_heads);
  if (c.num_kv_heads == 0 || c.num_heads % c.num_kv_heads != 0)
    return cfg_error(
        where, fmt::format("num_attention_heads {} is not a multiple of num_key_value_heads {}",
                           c.num_heads, c.num_kv_heads));
  c.head_dim = h.head_dim.value_or(c.hidden_size / c.num_heads);
  if (c.head_dim == 0 || c.head_dim % 2 != 0)
    return cfg_error(where, fmt::format("head_dim {} must be even and positive", c.head_dim));
  c.max_position = h.max_position_embeddings.value_or(4096);
  c.rms_eps = h.rms_norm_eps.value_or(c.rms_eps);
  c.rope_theta = h.rope_theta.value_or(c.rope_theta);
  if (h.rope_scaling) {
    SPARK_TRY(check_rope(*h.rope_scaling, where));
    c.rope = *h.rope_scaling;
  }
  if (!h.hidden_act.empty() && h.hidden_act != "silu")
    return make_error(
        Errc::unsupported,
        fmt::format("{}: hidden_act \"{}\" is not supported (only silu)", where, h.hidden_act));
  c.tie_word_embeddings = h.tie_word_embeddings;
  c.mlp_bias = h.mlp_bias;
  switch (c.family) {
    case Family::llama:
      c.qkv_bias = c.o_bias = h.attention_bias;
      break;
    case Family::qwen2:
      c.qkv_bias = true;  // Qwen2 always has q/k/v bias, never o_proj bias
      break;
    case Family::qwen3:
      c.qkv_bias = h.attention_bias;
      c.o_bias = h.attention_bias;
      c.qk_norm = true;
      break;
    case Family::mistral:
      break;
  }
  if ((c.family == Family::qwen2 || c.family == Family::qwen3) && h.use_sliding_window)
    return make_error(
        Errc::unsupported,
        fmt::format("{}: use_sliding_window=true is not supported for {}", where, c.architecture));
  if (c.family == Family::mistral) c.sliding_window = h.sliding_window.value_or(0);
  c.bos_token_id = h.bos_token_id.value_or(-1);
  c.eos_token_ids = h.eos_token_ids;
  c.torch_dtype = h.dtype;
  SPARK_TRY(check_bounds(c, where));
  return c;
}

Result<ModelConfig> parse_model_config(const std::string& text, const std::string& where) {
  auto h = hf::parse_config_text(text, where);
  if (!h) return h.error();
  return model_config_from(*h, where);
}

Result<ModelConfig> load_model_config(const std::string& dir) {
  auto h = hf::load_config(dir);
  if (!h) return h.error();
  return model_config_from(*h, dir + "/config.json");
}

}  // namespace spark::engine
