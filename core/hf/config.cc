#include "core/hf/config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>

#include "core/strings.h"

namespace spark::hf {
namespace {

using nlohmann::json;

Error cfg_error(const std::string& where, const std::string& what) {
  return make_error(Errc::config, fmt::format("{}: {}", where, what));
}

// Integers in config.json are counts and ids: non-negative and far below 2^30.
Status get_int(const json& j, const char* key, std::optional<int>* out, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status::Ok();
  if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() > (1ll << 30))
    return cfg_error(where, fmt::format("\"{}\" must be a non-negative integer", key));
  *out = it->get<int>();
  return Status::Ok();
}

Status get_double(const json& j, const char* key, double* out, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status::Ok();
  if (!it->is_number()) return cfg_error(where, fmt::format("\"{}\" must be a number", key));
  *out = it->get<double>();
  return Status::Ok();
}

Status get_double(const json& j, const char* key, std::optional<double>* out,
                  const std::string& where) {
  double v = 0;
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status::Ok();
  SPARK_TRY(get_double(j, key, &v, where));
  *out = v;
  return Status::Ok();
}

Status get_bool(const json& j, const char* key, bool* out, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return Status::Ok();
  if (!it->is_boolean()) return cfg_error(where, fmt::format("\"{}\" must be true or false", key));
  *out = it->get<bool>();
  return Status::Ok();
}

void get_string(const json& j, const char* key, std::string* out) {
  auto it = j.find(key);
  if (it != j.end() && it->is_string()) *out = it->get<std::string>();
}

}  // namespace

double rope_attention_factor(const RopeScaling& s) {
  if (s.type != "yarn") return 1.0;
  if (s.attention_factor) return *s.attention_factor;
  auto mscale = [&](double m) { return s.factor <= 1 ? 1.0 : 0.1 * m * std::log(s.factor) + 1.0; };
  if (s.mscale && s.mscale_all_dim && *s.mscale != 0 && *s.mscale_all_dim != 0)
    return mscale(*s.mscale) / mscale(*s.mscale_all_dim);
  return mscale(1.0);
}

namespace {

// transformers 5 writes rope_parameters {rope_type, rope_theta, ...}; older files have
// rope_theta at the top and an optional rope_scaling {type|rope_type, factor, ...}.
Status parse_rope(const json& j, Config* c, const std::string& where) {
  SPARK_TRY(get_double(j, "rope_theta", &c->rope_theta, where));
  const json* rs = nullptr;
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    auto it = j.find(key);
    if (it != j.end() && it->is_object()) {
      rs = &*it;
      break;
    }
  }
  if (!rs) return Status::Ok();
  SPARK_TRY(get_double(*rs, "rope_theta", &c->rope_theta, where));
  RopeScaling r;
  for (const char* key : {"rope_type", "type"}) {
    auto it = rs->find(key);
    if (it != rs->end() && it->is_string()) {
      r.type = it->get<std::string>();
      break;
    }
  }
  SPARK_TRY(get_double(*rs, "factor", &r.factor, where));
  SPARK_TRY(get_double(*rs, "low_freq_factor", &r.low_freq_factor, where));
  SPARK_TRY(get_double(*rs, "high_freq_factor", &r.high_freq_factor, where));
  SPARK_TRY(get_double(*rs, "original_max_position_embeddings", &r.original_max_position, where));
  SPARK_TRY(get_double(*rs, "beta_fast", &r.beta_fast, where));
  SPARK_TRY(get_double(*rs, "beta_slow", &r.beta_slow, where));
  SPARK_TRY(get_bool(*rs, "truncate", &r.truncate, where));
  SPARK_TRY(get_double(*rs, "attention_factor", &r.attention_factor, where));
  SPARK_TRY(get_double(*rs, "mscale", &r.mscale, where));
  SPARK_TRY(get_double(*rs, "mscale_all_dim", &r.mscale_all_dim, where));
  c->rope_scaling = r;
  return Status::Ok();
}

}  // namespace

void add_eos_ids(const json& v, std::vector<int>* out) {
  auto add = [&](int id) {
    if (std::find(out->begin(), out->end(), id) == out->end()) out->push_back(id);
  };
  if (v.is_number_integer()) add(v.get<int>());
  if (v.is_array())
    for (const auto& e : v)
      if (e.is_number_integer()) add(e.get<int>());
}

Result<Config> parse_config(const json& top, const std::string& where) {
  if (!top.is_object()) return cfg_error(where, "not a JSON object");
  Config c;
  if (auto it = top.find("architectures"); it != top.end() && !it->is_null()) {
    if (!it->is_array()) return cfg_error(where, "\"architectures\" must be a list of names");
    for (const auto& a : *it)
      if (a.is_string()) c.architectures.push_back(a.get<std::string>());
  }
  // A multimodal checkpoint keeps its language model's fields in text_config.
  auto tc = top.find("text_config");
  const json& j =
      tc != top.end() && tc->is_object() && !top.contains("num_hidden_layers") ? *tc : top;
  get_string(top, "model_type", &c.model_type);
  get_string(j, "model_type", &c.model_type);
  SPARK_TRY(get_int(j, "vocab_size", &c.vocab_size, where));
  SPARK_TRY(get_int(j, "hidden_size", &c.hidden_size, where));
  SPARK_TRY(get_int(j, "intermediate_size", &c.intermediate_size, where));
  SPARK_TRY(get_int(j, "num_hidden_layers", &c.num_hidden_layers, where));
  SPARK_TRY(get_int(j, "num_attention_heads", &c.num_attention_heads, where));
  SPARK_TRY(get_int(j, "num_key_value_heads", &c.num_key_value_heads, where));
  SPARK_TRY(get_int(j, "head_dim", &c.head_dim, where));
  SPARK_TRY(get_int(j, "max_position_embeddings", &c.max_position_embeddings, where));
  SPARK_TRY(get_int(j, "kv_lora_rank", &c.kv_lora_rank, where));
  SPARK_TRY(get_int(j, "qk_rope_head_dim", &c.qk_rope_head_dim, where));
  SPARK_TRY(get_int(j, "sliding_window", &c.sliding_window, where));
  SPARK_TRY(get_int(j, "bos_token_id", &c.bos_token_id, where));
  SPARK_TRY(get_double(j, "rms_norm_eps", &c.rms_norm_eps, where));
  SPARK_TRY(parse_rope(j, &c, where));
  get_string(j, "hidden_act", &c.hidden_act);
  SPARK_TRY(get_bool(j, "tie_word_embeddings", &c.tie_word_embeddings, where));
  SPARK_TRY(get_bool(j, "attention_bias", &c.attention_bias, where));
  SPARK_TRY(get_bool(j, "mlp_bias", &c.mlp_bias, where));
  SPARK_TRY(get_bool(j, "use_sliding_window", &c.use_sliding_window, where));
  if (auto it = j.find("eos_token_id"); it != j.end()) add_eos_ids(*it, &c.eos_token_ids);
  for (const json* level : {&top, &j}) {
    get_string(*level, "torch_dtype", &c.dtype);
    get_string(*level, "dtype", &c.dtype);
  }
  c.raw = top;
  return c;
}

Result<Config> parse_config_text(const std::string& text, const std::string& where) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    // Where, and for Python's non-JSON floats (json.dumps writes NaN and Infinity) what.
    size_t at = std::min(e.byte > 0 ? e.byte - 1 : 0, text.size());
    size_t line = 1 + static_cast<size_t>(std::count(text.begin(), text.begin() + at, '\n'));
    size_t bol = text.rfind('\n', at == 0 ? 0 : at - 1);
    size_t col = at - (bol == std::string::npos || at == 0 ? 0 : bol + 1) + 1;
    size_t tok = at;
    while (tok > 0 && std::isalpha(static_cast<unsigned char>(text[tok - 1]))) --tok;
    if (tok < text.size() && text[tok] == '-') ++tok;
    for (const char* lit : {"NaN", "Infinity"})
      if (text.compare(tok, std::strlen(lit), lit) == 0)
        return cfg_error(where, fmt::format("line {}, column {}: {} is not JSON (Python's json "
                                            "writes it for a float that is not finite); "
                                            "write a number or null there",
                                            line, col, lit));
    return cfg_error(where, fmt::format("line {}, column {}: not valid JSON", line, col));
  } catch (const json::exception& e) {
    // A number too large for any JSON number type (out_of_range 406), and the like.
    return cfg_error(where, fmt::format("not usable JSON: {}", e.what()));
  }
  if (!j.is_object()) return cfg_error(where, "not a JSON object");
  return parse_config(j, where);
}

Result<Config> load_config(const std::string& dir) {
  const std::string path = dir + "/config.json";
  auto text = read_file(path);
  if (!text)
    return make_error(
        Errc::not_found,
        fmt::format("{}: cannot read — is {} a Hugging Face model directory?", path, dir));
  auto c = parse_config_text(*text, path);
  if (!c) return c;
  if (auto gen = read_file(dir + "/generation_config.json")) {
    auto j = json::parse(*gen, nullptr, false);
    if (!j.is_discarded() && j.is_object())
      if (auto it = j.find("eos_token_id"); it != j.end()) add_eos_ids(*it, &c->eos_token_ids);
  }
  return c;
}

}  // namespace spark::hf
