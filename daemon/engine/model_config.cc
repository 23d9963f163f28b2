#include "daemon/engine/model_config.h"

#include <fmt/format.h>

#include <cmath>

#include "core/strings.h"
#include "daemon/engine/family.h"

namespace spark::engine {
namespace {

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
  if (r.type != "default" && r.type != "linear" && r.type != "llama3" && r.type != "yarn")
    return make_error(
        Errc::unsupported,
        fmt::format("{}: rope scaling type \"{}\" is not supported (supported: default, "
                    "linear, llama3, yarn)",
                    where, r.type));
  if (r.type == "yarn" && !(r.original_max_position > 0 && r.beta_fast > 0 && r.beta_slow > 0))
    return cfg_error(where,
                     "yarn rope scaling needs positive original_max_position_embeddings, "
                     "beta_fast and beta_slow");
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
  if (c.rotary_dim < 2 || c.rotary_dim > c.head_dim || c.rotary_dim % 2 != 0)
    return cfg_error(where, fmt::format("the rotary dimension {} must be even and within "
                                        "head_dim {}",
                                        c.rotary_dim, c.head_dim));
  const auto& m = c.moe;
  if (m.experts > 0) {
    if (m.experts > 4096 || m.top_k < 1 || m.top_k > m.experts || m.top_k > 64)
      return cfg_error(where, fmt::format("{} experts with {} per token: the experts must be 1 "
                                          "to 4096 and the experts per token 1 to min(64, "
                                          "experts)",
                                          m.experts, m.top_k));
    if (m.expert_inter < 1 || m.expert_inter > (1 << 19) || m.shared_inter < 0 ||
        m.shared_inter > (1 << 19))
      return cfg_error(where, fmt::format("expert intermediate size {} (shared {}) must be 1 to "
                                          "{}",
                                          m.expert_inter, m.shared_inter, 1 << 19));
    if (m.n_group < 1 || m.experts % m.n_group != 0 || m.topk_group < 1 || m.topk_group > m.n_group)
      return cfg_error(where, fmt::format("n_group {} must divide the {} experts and topk_group "
                                          "{} must be 1 to n_group",
                                          m.n_group, m.experts, m.topk_group));
    if (m.n_group > 1 && m.experts / m.n_group < 2)
      return cfg_error(where, fmt::format("n_group {}: each group needs at least 2 of the {} "
                                          "experts (a group's score is its top-2 sum)",
                                          m.n_group, m.experts));
    if (m.n_group > 1 && m.top_k > m.topk_group * (m.experts / m.n_group))
      return cfg_error(where, fmt::format("{} experts per token cannot come from {} groups of {}",
                                          m.top_k, m.topk_group, m.experts / m.n_group));
    if (!std::isfinite(m.routed_scaling) || m.routed_scaling <= 0 || m.routed_scaling > 1e6)
      return cfg_error(where, fmt::format("routed_scaling_factor {} must be positive and finite",
                                          m.routed_scaling));
  }
  return Status::Ok();
}

}  // namespace

ParamCount count_params(const ModelConfig& c) {
  const uint64_t H = static_cast<uint64_t>(c.hidden_size), V = static_cast<uint64_t>(c.vocab_size);
  const uint64_t qw = static_cast<uint64_t>(c.num_heads) * static_cast<uint64_t>(c.head_dim);
  const uint64_t kw = static_cast<uint64_t>(c.num_kv_heads) * static_cast<uint64_t>(c.head_dim);
  ParamCount p;
  p.total = V * H * (c.tie_word_embeddings ? 1 : 2) + H;
  uint64_t attn = H * qw + 2 * H * kw + qw * H + 2 * H;  // q, k, v, o, the two norms
  if (c.qkv_bias) attn += qw + 2 * kw;
  if (c.o_bias) attn += H;
  if (c.qk_norm == QkNorm::per_head) attn += 2 * static_cast<uint64_t>(c.head_dim);
  if (c.qk_norm == QkNorm::per_layer) attn += qw + kw;
  if (c.is_mla()) {
    const auto& m = c.mla;
    const uint64_t NH = static_cast<uint64_t>(c.num_heads),
                   qr = static_cast<uint64_t>(m.q_lora_rank),
                   kr = static_cast<uint64_t>(m.kv_lora_rank);
    const uint64_t qk = static_cast<uint64_t>(m.qk_head_dim());
    attn = 2 * H;                                                       // the two norms
    attn += qr > 0 ? H * qr + qr + qr * NH * qk : H * NH * qk;          // q (LoRA or direct)
    attn += H * static_cast<uint64_t>(m.cache_width()) + kr;            // kv_a and its norm
    attn += kr * NH * static_cast<uint64_t>(m.qk_nope + m.v_head_dim);  // kv_b
    attn += NH * static_cast<uint64_t>(m.v_head_dim) * H;               // o
  }
  p.active = p.total;
  const auto& m = c.moe;
  for (int l = 0; l < c.num_layers; ++l) {
    uint64_t all = attn, used = attn;
    if (m.is_moe(l)) {
      const uint64_t expert = 3 * H * static_cast<uint64_t>(m.expert_inter);
      const uint64_t fixed = static_cast<uint64_t>(m.experts) * H +
                             3 * H * static_cast<uint64_t>(m.shared_inter) +
                             (m.correction_bias ? static_cast<uint64_t>(m.experts) : 0);
      all += fixed + static_cast<uint64_t>(m.experts) * expert;
      used += fixed + static_cast<uint64_t>(m.top_k) * expert;
    } else {
      const uint64_t mlp = 3 * H * static_cast<uint64_t>(c.intermediate_size);
      all += mlp;
      used += mlp;
    }
    p.total += all;
    p.active += used;
  }
  return p;
}

double mla_softmax_mscale_sq(const hf::RopeScaling& r) {
  if (r.type != "yarn" || !r.mscale_all_dim || *r.mscale_all_dim == 0 || r.factor <= 1) return 1.0;
  const double m = 0.1 * *r.mscale_all_dim * std::log(r.factor) + 1.0;
  return m * m;
}

int MoeConfig::moe_layers() const {
  int n = 0;
  for (auto b : layer_moe) n += b ? 1 : 0;
  return n;
}

std::string supported_architectures() {
  std::vector<std::string> names;
  for (const auto& f : family_table()) names.emplace_back(f.architecture);
  return join(names, ", ");
}

const char* architecture_name(Family f) {
  for (const auto& e : family_table())
    if (e.family == f) return e.architecture;
  return "?";
}

const char* model_type_name(Family f) {
  for (const auto& e : family_table())
    if (e.family == f) return e.model_type;
  return "?";
}

Result<ModelConfig> model_config_from(const hf::Config& h, const std::string& where) {
  ModelConfig c;
  if (h.architectures.empty())
    return cfg_error(where, fmt::format("\"architectures\" is missing; supported: {}",
                                        supported_architectures()));
  c.architecture = h.architectures[0];
  const FamilyEntry* fam = nullptr;
  for (const auto& e : family_table())
    if (c.architecture == e.architecture) fam = &e;
  if (!fam)
    return make_error(Errc::unsupported,
                      fmt::format("{}: architecture {} is not supported; supported: {}", where,
                                  c.architecture, supported_architectures()));
  c.family = fam->family;
  c.recipe = fam->recipe;
  SPARK_TRY(required(h.vocab_size, "vocab_size", &c.vocab_size, where));
  SPARK_TRY(required(h.hidden_size, "hidden_size", &c.hidden_size, where));
  SPARK_TRY(required(h.num_hidden_layers, "num_hidden_layers", &c.num_layers, where));
  SPARK_TRY(required(h.num_attention_heads, "num_attention_heads", &c.num_heads, where));
  // Dense families need intermediate_size; MoE families read theirs (some have none).
  c.intermediate_size = h.intermediate_size.value_or(0);
  c.num_kv_heads = h.num_key_value_heads.value_or(c.num_heads);
  if (c.num_kv_heads == 0 || c.num_heads % c.num_kv_heads != 0)
    return cfg_error(
        where, fmt::format("num_attention_heads {} is not a multiple of num_key_value_heads {}",
                           c.num_heads, c.num_kv_heads));
  c.head_dim = h.head_dim.value_or(c.hidden_size / c.num_heads);
  if (c.head_dim == 0 || c.head_dim % 2 != 0)
    return cfg_error(where, fmt::format("head_dim {} must be even and positive", c.head_dim));
  c.rotary_dim = c.head_dim;
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
  c.bos_token_id = h.bos_token_id.value_or(-1);
  c.eos_token_ids = h.eos_token_ids;
  c.torch_dtype = h.dtype;
  {
    auto wf = parse_weight_format(h.raw, where);
    if (!wf) return wf.error();
    c.weights = std::move(*wf);
  }
  if (c.weights.mxfp4() != (c.family == Family::gpt_oss))
    return make_error(
        Errc::unsupported,
        c.weights.mxfp4()
            ? fmt::format("{}: quantization_config.quant_method \"mxfp4\" is read for "
                          "GptOssForCausalLM only, not {}",
                          where, c.architecture)
            : fmt::format("{}: GptOssForCausalLM is read as OpenAI publishes it, experts in "
                          "MXFP4 (quantization_config.quant_method \"mxfp4\"); experts stored "
                          "unquantized are not read yet",
                          where));
  SPARK_TRY(fam->parse(h, &c, where));
  // A tensor-parallel split of FP8 experts keeps the scale blocks whole (else: expert-parallel).
  if (c.weights.fp8()) c.moe.expert_block = c.weights.block_n;
  if (c.weights.mxfp4()) c.moe.expert_block = 32;  // down's columns split by whole blocks
  // Latent attention applies YaRN's factor to its rotated part alone (on cos and sin).
  if (c.rope.type == "yarn" && c.rotary_dim != c.head_dim && !c.is_mla() &&
      hf::rope_attention_factor(c.rope) != 1.0)
    return cfgjson::unsupported(where, "rope_scaling", "yarn",
                                "YaRN's attention scaling with partial rotary");
  if (c.intermediate_size <= 0 && (c.moe.layer_moe.empty() || c.moe.moe_layers() < c.num_layers))
    return cfg_error(where, "\"intermediate_size\" is missing (the dense MLP layers need it)");
  if (c.intermediate_size <= 0) c.intermediate_size = 1;  // every layer is MoE: unused
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

namespace cfgjson {

const nlohmann::json& model_object(const hf::Config& h) {
  auto tc = h.raw.find("text_config");
  if (tc != h.raw.end() && tc->is_object() && !h.raw.contains("num_hidden_layers")) return *tc;
  return h.raw;
}

Result<int> get_int(const nlohmann::json& j, const char* key, int def, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return def;
  if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() > (1ll << 30))
    return cfg_error(where, fmt::format("\"{}\" must be a non-negative integer", key));
  return it->get<int>();
}

Result<double> get_double(const nlohmann::json& j, const char* key, double def,
                          const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return def;
  if (!it->is_number() || !std::isfinite(it->get<double>()))
    return cfg_error(where, fmt::format("\"{}\" must be a finite number", key));
  return it->get<double>();
}

Result<bool> get_bool(const nlohmann::json& j, const char* key, bool def,
                      const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return def;
  if (!it->is_boolean()) return cfg_error(where, fmt::format("\"{}\" must be true or false", key));
  return it->get<bool>();
}

Result<std::string> get_string(const nlohmann::json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::string();
  if (!it->is_string()) return cfg_error(where, fmt::format("\"{}\" must be a string", key));
  return it->get<std::string>();
}

Result<std::vector<int>> get_int_list(const nlohmann::json& j, const char* key,
                                      const std::string& where) {
  std::vector<int> out;
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return out;
  if (!it->is_array())
    return cfg_error(where, fmt::format("\"{}\" must be a list of integers", key));
  for (const auto& v : *it) {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > (1ll << 30))
      return cfg_error(where, fmt::format("\"{}\" must be a list of non-negative integers", key));
    out.push_back(v.get<int>());
  }
  return out;
}

Error unsupported(const std::string& where, const std::string& key, const nlohmann::json& value,
                  const std::string& why) {
  return make_error(Errc::unsupported, fmt::format("{}: \"{}\" = {} is not supported ({})", where,
                                                   key, value.dump(), why));
}

}  // namespace cfgjson

}  // namespace spark::engine
