#include "daemon/engine/weight_format.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/strings.h"
#include "kernels/dtype.h"

namespace spark::engine {

namespace {

Error unsupported_field(const std::string& where, const std::string& key,
                        const nlohmann::json& value, const std::string& why) {
  return make_error(Errc::unsupported,
                    fmt::format("{}: quantization_config.{} = {} is not supported ({})", where, key,
                                dump_json(value), why));
}

std::vector<std::string> split_dots(const std::string& s) {
  std::vector<std::string> out;
  size_t at = 0;
  while (true) {
    const size_t dot = s.find('.', at);
    out.push_back(s.substr(at, dot == std::string::npos ? std::string::npos : dot - at));
    if (dot == std::string::npos) break;
    at = dot + 1;
  }
  return out;
}

}  // namespace

float fp8_e4m3_to_float(uint8_t v) {
  return kernels::fp8_e4m3_value(v);
}

uint8_t float_to_fp8_e4m3(float f) {
  return kernels::fp8_e4m3_code(f);
}

std::string fp8_scale_name(const std::string& weight) {
  return weight + "_scale_inv";
}

float e2m1_to_float(uint8_t c) {
  static const float kValues[16] = {0.f,  0.5f,  1.f,  1.5f,  2.f,  3.f,  4.f,  6.f,
                                    -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
  return kValues[c & 0xf];
}

bool widen_mxfp4(const uint8_t* blocks, int64_t row_bytes, const uint8_t* scales,
                 int64_t row_scales, int64_t rows, int64_t col0, int64_t cols, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* b = blocks + r * row_bytes;
    const uint8_t* sc = scales + r * row_scales;
    float* o = out + r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t v = col0 + c;
      const uint8_t s = sc[v / 32];
      if (s == 0xff) return false;
      const uint8_t byte = b[v / 2];
      o[c] = std::ldexp(e2m1_to_float(v % 2 == 0 ? byte & 0xf : byte >> 4), s - 127);
    }
  }
  return true;
}

std::string WeightFormat::describe() const {
  if (mxfp4()) return "mxfp4 experts (e2m1, e8m0 scales per 32)";
  if (!fp8()) return "plain";
  return fmt::format("fp8 e4m3, {}x{} block scales{}", block_n, block_k,
                     ue8m0_scales ? " (ue8m0)" : "");
}

bool WeightFormat::is_not_converted(const std::string& tensor) const {
  const auto parts = split_dots(tensor);
  for (const auto& entry : not_converted) {
    const auto want = split_dots(entry);
    if (want.size() > parts.size()) continue;
    bool ok = true;
    for (size_t i = 0; i < want.size() && ok; ++i) ok = want[i] == "*" || want[i] == parts[i];
    if (ok) return true;
  }
  return false;
}

Result<WeightFormat> parse_weight_format(const nlohmann::json& raw, const std::string& where) {
  WeightFormat w;
  const nlohmann::json* q = nullptr;
  if (auto it = raw.find("quantization_config"); it != raw.end() && !it->is_null()) q = &*it;
  if (!q) {
    auto tc = raw.find("text_config");  // a multimodal checkpoint's model fields
    if (tc != raw.end() && tc->is_object())
      if (auto it = tc->find("quantization_config"); it != tc->end() && !it->is_null()) q = &*it;
  }
  if (!q) return w;
  if (!q->is_object())
    return make_error(Errc::config,
                      fmt::format("{}: \"quantization_config\" must be an object", where));
  auto str = [&](const char* key, std::string* out) -> Status {
    auto it = q->find(key);
    if (it == q->end() || it->is_null()) return Status::Ok();
    if (!it->is_string())
      return make_error(Errc::config,
                        fmt::format("{}: quantization_config.{} must be a string", where, key));
    *out = it->get<std::string>();
    return Status::Ok();
  };
  std::string method, fmt_name, scheme, scale_fmt;
  SPARK_TRY(str("quant_method", &method));
  if (method.empty())
    return make_error(Errc::config,
                      fmt::format("{}: quantization_config has no quant_method", where));
  if (method == "mxfp4") {
    for (const char* key : {"modules_to_not_convert", "ignored_layers"}) {
      auto it = q->find(key);
      if (it == q->end() || it->is_null()) continue;
      if (!it->is_array())
        return make_error(Errc::config, fmt::format("{}: quantization_config.{} must be a list "
                                                    "of module names",
                                                    where, key));
      for (const auto& m : *it)
        if (m.is_string()) w.not_converted.push_back(m.get<std::string>());
    }
    w.kind = WeightFormat::Kind::mxfp4;
    return w;
  }
  if (method != "fp8")
    return unsupported_field(
        where, "quant_method", method,
        "the engine reads bf16/fp16/fp32 weights, fp8 (e4m3, 128x128 block scales) and gpt-oss's "
        "mxfp4 experts; serve "
        "this checkpoint with ENGINE=exec and an engine that runs it");
  SPARK_TRY(str("fmt", &fmt_name));
  if (!fmt_name.empty() && fmt_name != "e4m3")
    return unsupported_field(where, "fmt", fmt_name, "only e4m3");
  SPARK_TRY(str("activation_scheme", &scheme));
  if (!scheme.empty() && scheme != "dynamic")
    return unsupported_field(where, "activation_scheme", scheme,
                             "only dynamic: static activation scales are not read");
  SPARK_TRY(str("scale_fmt", &scale_fmt));
  if (!scale_fmt.empty() && scale_fmt != "ue8m0" && scale_fmt != "float" && scale_fmt != "fp32")
    return unsupported_field(where, "scale_fmt", scale_fmt, "float or ue8m0");
  w.ue8m0_scales = scale_fmt == "ue8m0";
  auto b = q->find("weight_block_size");
  if (b == q->end() || b->is_null())
    return unsupported_field(where, "weight_block_size", nullptr,
                             "per-tensor scales; only 128x128 block scales");
  if (!b->is_array() || b->size() != 2 || !(*b)[0].is_number_integer() ||
      !(*b)[1].is_number_integer())
    return make_error(Errc::config,
                      fmt::format("{}: quantization_config.weight_block_size must be two "
                                  "integers, not {}",
                                  where, dump_json(*b)));
  w.block_n = (*b)[0].get<int>();
  w.block_k = (*b)[1].get<int>();
  if (w.block_n != 128 || w.block_k != 128)
    return unsupported_field(where, "weight_block_size", *b, "only [128, 128]");
  for (const char* key : {"modules_to_not_convert", "ignored_layers"}) {
    auto it = q->find(key);
    if (it == q->end() || it->is_null()) continue;
    if (!it->is_array())
      return make_error(Errc::config, fmt::format("{}: quantization_config.{} must be a list of "
                                                  "module names",
                                                  where, key));
    for (const auto& m : *it) {
      if (!m.is_string())
        return make_error(Errc::config, fmt::format("{}: quantization_config.{} must be a list "
                                                    "of module names",
                                                    where, key));
      w.not_converted.push_back(m.get<std::string>());
    }
  }
  w.kind = WeightFormat::Kind::fp8_block;
  return w;
}

void widen_fp8_block(const uint8_t* q, int64_t rows, int64_t cols, int64_t row0, int64_t col0,
                     const float* scales, int64_t scale_row0, int64_t scale_cols, int block_n,
                     int block_k, float* out) {
  float lut[256];
  for (int i = 0; i < 256; ++i) lut[i] = fp8_e4m3_to_float(static_cast<uint8_t>(i));
  for (int64_t r = 0; r < rows; ++r) {
    const float* srow = scales + ((row0 + r) / block_n - scale_row0) * scale_cols;
    const uint8_t* qr = q + r * cols;
    float* o = out + r * cols;
    for (int64_t c = 0; c < cols; ++c) o[c] = lut[qr[c]] * srow[(col0 + c) / block_k];
  }
}

}  // namespace spark::engine
