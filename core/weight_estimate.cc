#include "core/weight_estimate.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/strings.h"

namespace spark::plan {

using nlohmann::json;

std::optional<double> weights_dtype_bytes(const std::string& d) {
  if (d == "bf16" || d == "fp16") return 2.0;
  if (d == "fp32") return 4.0;
  if (d == "fp8" || d == "int8") return 1.0;
  if (d == "fp4") return 0.5 + 1.0 / 32;    // a one-byte scale per 32 values (MXFP4)
  if (d == "int4") return 0.5 + 4.0 / 128;  // fp16 scale and zero per group of 128
  return std::nullopt;
}

namespace {

int64_t num(const json& c, const char* k, int64_t dflt = 0) {
  auto it = c.find(k);
  if (it == c.end() || !it->is_number()) return dflt;
  return it->get<int64_t>();
}

double dtype_bytes_of(const json& top, const json& c) {
  for (const json* j : {&c, &top})
    for (const char* k : {"torch_dtype", "dtype"})
      if (j->contains(k) && (*j)[k].is_string()) {
        std::string t = (*j)[k];
        if (t == "float32") return 4;
        if (t == "float16" || t == "bfloat16") return 2;
        if (t == "float8_e4m3fn") return 1;
      }
  return 2;
}

// The bytes of the quantized matrices (`matrix`) and of the routed experts (`expert`) the
// quantization_config implies; `basis` says how.
void quantization(const json& top, double dtype, double* matrix, double* expert,
                  std::string* basis) {
  *matrix = *expert = dtype;
  *basis = fmt::format("{} bytes per parameter (torch_dtype)", dtype);
  auto it = top.find("quantization_config");
  if (it == top.end() || !it->is_object()) return;
  const json& q = *it;
  std::string method = q.value("quant_method", "");
  std::transform(method.begin(), method.end(), method.begin(),
                 [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
  auto bits_of = [&](double bits, int64_t group) {
    return bits / 8 + (group > 0 ? 4.0 / static_cast<double>(group) : 0);
  };
  if (method == "fp8") {
    *matrix = *expert = 1 + 4.0 / (128 * 128);  // fp32 scale per 128x128 block
    *basis = "fp8 matrices, the rest in the model's dtype (quantization_config)";
  } else if (method == "mxfp4") {
    *expert = 0.5 + 1.0 / 32;
    *basis = "MXFP4 routed experts, the rest in the model's dtype (quantization_config)";
  } else if (method == "gptq" || method == "awq" || method == "auto-round" ||
             method == "autoround") {
    int64_t bits = num(q, "bits", 4), group = num(q, "group_size", 128);
    *matrix = *expert = bits_of(static_cast<double>(bits), group);
    *basis = fmt::format("{} {}-bit matrices in groups of {} (quantization_config)", method, bits,
                         group);
  } else if (method == "bitsandbytes") {
    bool four = q.value("load_in_4bit", false);
    *matrix = *expert = four ? bits_of(4, 64) : 1;
    *basis = fmt::format("bitsandbytes {}-bit matrices (quantization_config)", four ? 4 : 8);
  } else if (method == "compressed-tensors" || method == "modelopt") {
    int64_t bits = 0;
    std::string algo = q.value("quant_algo", "");
    if (algo.find("FP4") != std::string::npos) bits = 4;
    if (algo.find("FP8") != std::string::npos) bits = 8;
    if (q.contains("config_groups") && q["config_groups"].is_object())
      for (const auto& [name, g] : q["config_groups"].items())
        if (g.is_object() && g.contains("weights") && g["weights"].is_object())
          bits = std::max<int64_t>(bits, num(g["weights"], "num_bits", 0));
    if (bits > 0) {
      *matrix = *expert = bits_of(static_cast<double>(bits), bits == 4 ? 16 : 0);
      *basis = fmt::format("{} {}-bit matrices (quantization_config)", method, bits);
    }
  } else if (!method.empty()) {
    *basis = fmt::format("quant_method {} unknown here: counted at {} bytes per parameter", method,
                         dtype);
  }
}

}  // namespace

Result<WeightEstimate> estimate_weights(const json& top, const std::string& where,
                                        const std::string& dtype) {
  if (!top.is_object()) return make_error(Errc::config, where + ": not a JSON object");
  const bool nested = !top.contains("num_hidden_layers") && top.contains("text_config") &&
                      top["text_config"].is_object();
  const json& c = nested ? top["text_config"] : top;
  const int64_t H = num(c, "hidden_size"), L = num(c, "num_hidden_layers"),
                V = num(c, "vocab_size", num(top, "vocab_size")),
                heads = num(c, "num_attention_heads");
  std::vector<std::string> missing;
  if (H <= 0) missing.push_back("hidden_size");
  if (L <= 0) missing.push_back("num_hidden_layers");
  if (V <= 0) missing.push_back("vocab_size");
  if (heads <= 0) missing.push_back("num_attention_heads");
  if (!missing.empty())
    return make_error(Errc::config, fmt::format("{}: cannot estimate the weights without {}", where,
                                                join(missing, ", ")));
  const int64_t kv = num(c, "num_key_value_heads", heads);
  const int64_t hd = num(c, "head_dim") > 0 ? num(c, "head_dim") : H / heads;
  const int64_t I = num(c, "intermediate_size", 4 * H);

  // Attention per layer.
  int64_t attn = 0;
  const int64_t kv_lora = num(c, "kv_lora_rank");
  if (kv_lora > 0) {
    const int64_t q_lora = num(c, "q_lora_rank"), nope = num(c, "qk_nope_head_dim"),
                  rope = num(c, "qk_rope_head_dim"), v = num(c, "v_head_dim", nope);
    const int64_t qk = nope + rope;
    attn += q_lora > 0 ? H * q_lora + q_lora * heads * qk : H * heads * qk;
    attn += H * (kv_lora + rope) + kv_lora * heads * (nope + v) + heads * v * H;
    if (int64_t ih = num(c, "index_n_heads"), id = num(c, "index_head_dim"); ih > 0 && id > 0)
      attn += (q_lora > 0 ? q_lora : H) * ih * id + H * id + H * ih;  // the DSA indexer
  } else {
    attn = H * heads * hd + 2 * H * kv * hd + heads * hd * H;
  }
  // Linear-attention layers (gated delta net / KDA) where layer_types names them.
  int64_t linear_layers = 0, lin = 0;
  if (c.contains("layer_types") && c["layer_types"].is_array())
    for (const auto& t : c["layer_types"])
      if (t.is_string() && t.get<std::string>() == "linear_attention") ++linear_layers;
  if (linear_layers) {
    const int64_t kh = num(c, "linear_num_key_heads", num(c, "linear_num_heads", heads)),
                  vh = num(c, "linear_num_value_heads", kh),
                  kd = num(c, "linear_key_head_dim", num(c, "linear_head_dim", hd)),
                  vd = num(c, "linear_value_head_dim", kd);
    lin = H * (2 * kh * kd + 2 * vh * vd) + H * 2 * vh + vh * vd * H;
  }

  // MLP per layer: dense, or routed experts + shared experts + router.
  const int64_t E = num(c, "n_routed_experts", num(c, "num_local_experts", num(c, "num_experts")));
  const int64_t moe_I = num(c, "moe_intermediate_size", I);
  int64_t shared = 0;
  if (int64_t ns = num(c, "n_shared_experts"); ns > 0) shared = ns * 3 * H * moe_I;
  if (int64_t si = num(c, "shared_expert_intermediate_size"); si > 0) shared = 3 * H * si;
  const int64_t first_dense = num(c, "first_k_dense_replace"),
                step = std::max<int64_t>(1, num(c, "decoder_sparse_step", 1));
  std::vector<int64_t> mlp_only;
  if (c.contains("mlp_only_layers") && c["mlp_only_layers"].is_array())
    for (const auto& x : c["mlp_only_layers"])
      if (x.is_number_integer()) mlp_only.push_back(x.get<int64_t>());
  std::vector<bool> sparse;  // mlp_layer_types: "sparse" (experts) or "dense" per layer
  if (c.contains("mlp_layer_types") && c["mlp_layer_types"].is_array())
    for (const auto& x : c["mlp_layer_types"])
      sparse.push_back(x.is_string() && x.get<std::string>() == "sparse");
  const int64_t mtp = num(c, "num_nextn_predict_layers");

  double dtype_b = dtype_bytes_of(top, c), matrix_b = 0, expert_b = 0;
  std::string basis;
  quantization(top, dtype_b, &matrix_b, &expert_b, &basis);
  if (!dtype.empty()) {
    auto b = weights_dtype_bytes(dtype);
    if (!b)
      return make_error(Errc::usage, fmt::format("--weights-dtype {}: use bf16, fp16, fp32, "
                                                 "fp8, int8, fp4 or int4",
                                                 dtype));
    matrix_b = expert_b = *b;
    basis = fmt::format(
        "{} matrices (--weights-dtype), embeddings and norms in the model's "
        "dtype",
        dtype);
  }

  double dense_bytes = 0, expert_bytes = 0;
  uint64_t params = 0;
  auto matrices = [&](int64_t n) {
    dense_bytes += static_cast<double>(n) * matrix_b;
    params += static_cast<uint64_t>(n);
  };
  auto plain = [&](int64_t n) {
    dense_bytes += static_cast<double>(n) * dtype_b;
    params += static_cast<uint64_t>(n);
  };
  for (int64_t l = 0; l < L + mtp; ++l) {
    const bool is_linear = l < linear_layers;  // the count matters, not which layers
    matrices(is_linear ? lin : attn);
    plain(2 * H);  // the two RMSNorms
    bool moe = E > 0 && l >= first_dense && (l + 1) % step == 0 &&
               std::find(mlp_only.begin(), mlp_only.end(), l) == mlp_only.end();
    if (E > 0 && !sparse.empty())
      moe = static_cast<size_t>(l) < sparse.size() ? sparse[static_cast<size_t>(l)] : true;
    if (moe) {
      expert_bytes += static_cast<double>(E * 3 * H * moe_I) * expert_b;
      params += static_cast<uint64_t>(E * 3 * H * moe_I);
      matrices(shared);
      plain(H * E);  // the router
    } else {
      matrices(3 * H * I);
    }
    if (l >= L) matrices(2 * H * H);  // an MTP layer's projection of [embedding; hidden]
  }
  plain(V * H);  // embeddings
  if (!(c.value("tie_word_embeddings", top.value("tie_word_embeddings", false)))) plain(V * H);
  plain(H);  // the final norm

  WeightEstimate e;
  e.experts = static_cast<uint64_t>(std::llround(expert_bytes));
  e.total = static_cast<uint64_t>(std::llround(dense_bytes)) + e.experts;
  e.params = params;
  e.basis = basis;
  return e;
}

}  // namespace spark::plan
