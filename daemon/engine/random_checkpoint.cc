#include "daemon/engine/random_checkpoint.h"

#include <fmt/format.h>

#include <algorithm>
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
  bool projection = false;   // a linear projection's weight (FP8 in an FP8 checkpoint)
  std::vector<uint8_t> raw;  // the stored form when not floats (F8_E4M3, MXFP4's U8)
  DType raw_type = DType::f8_e4m3;
};

Named named(std::string name, std::vector<int64_t> shape, std::vector<float> data = {}) {
  Named n;
  n.name = std::move(name);
  n.shape = std::move(shape);
  n.data = std::move(data);
  return n;
}

// MXFP4 as OpenAI stores gpt-oss's experts: each block of 32 values along a row takes the
// power-of-two scale that fits its largest magnitude into e2m1's 6, each value the nearest
// e2m1 code (low nibble first). `w` ([rows][cols]) becomes the values they dequantize to.
void quantize_mxfp4(std::vector<float>* w, int64_t rows, int64_t cols, std::vector<uint8_t>* blocks,
                    std::vector<uint8_t>* scales) {
  static const float kMag[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  blocks->assign(static_cast<size_t>(rows * cols / 2), 0);
  scales->assign(static_cast<size_t>(rows * cols / 32), 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < cols / 32; ++b) {
      float* x = w->data() + r * cols + b * 32;
      float amax = 1e-30f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
      const int e = std::clamp(static_cast<int>(std::ceil(std::log2(amax / 6.0))), -127, 127);
      (*scales)[static_cast<size_t>(r * (cols / 32) + b)] = static_cast<uint8_t>(e + 127);
      const float scale = std::ldexp(1.0f, e);
      for (int i = 0; i < 32; ++i) {
        const float a = std::fabs(x[i]) / scale;
        int best = 0;
        for (int k = 1; k < 8; ++k)
          if (std::fabs(a - kMag[k]) < std::fabs(a - kMag[best])) best = k;
        const uint8_t code = static_cast<uint8_t>(best | (x[i] < 0 ? 8 : 0));
        const size_t at = static_cast<size_t>((r * cols + b * 32 + i) / 2);
        (*blocks)[at] |= i % 2 == 0 ? code : static_cast<uint8_t>(code << 4);
        x[i] = e2m1_to_float(code) * scale;
      }
    }
}

// Quantizes a [N][K] weight to e4m3 with 128x128 block scales as the FP8 checkpoints do:
// each block's scale the BF16 number nearest max|w| / 448, each value the e4m3 nearest
// w / scale. Returns the scales ([ceil(N/128)][ceil(K/128)]); `q` gets the codes and `w`
// becomes the values they dequantize to.
std::vector<float> quantize_fp8_block(std::vector<float>* w, int64_t N, int64_t K,
                                      std::vector<uint8_t>* q) {
  constexpr int64_t B = 128;
  const int64_t nb = (N + B - 1) / B, kb = (K + B - 1) / B;
  std::vector<float> scales(static_cast<size_t>(nb * kb));
  q->assign(static_cast<size_t>(N * K), 0);
  for (int64_t i = 0; i < nb; ++i)
    for (int64_t j = 0; j < kb; ++j) {
      float amax = 0.f;
      for (int64_t r = i * B; r < std::min(N, (i + 1) * B); ++r)
        for (int64_t c = j * B; c < std::min(K, (j + 1) * B); ++c)
          amax = std::max(amax, std::fabs((*w)[static_cast<size_t>(r * K + c)]));
      const float s = bf16_to_float(float_to_bf16(amax / 448.f + 1e-12f));
      scales[static_cast<size_t>(i * kb + j)] = s;
      for (int64_t r = i * B; r < std::min(N, (i + 1) * B); ++r)
        for (int64_t c = j * B; c < std::min(K, (j + 1) * B); ++c) {
          const size_t at = static_cast<size_t>(r * K + c);
          const uint8_t code = float_to_fp8_e4m3((*w)[at] / s);
          (*q)[at] = code;
          (*w)[at] = fp8_e4m3_to_float(code) * s;
        }
    }
  return scales;
}

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
      case Family::deepseek_v3: {
        // GLM-4.5's router and shared expert over latent attention: q LoRA (q_lora_rank 0
        // for q_proj), a latent of hidden / 2 and a RoPE key of 8 per token, YaRN whose
        // mscale and mscale_all_dim differ (both its factors at work).
        m.score = RouterScore::sigmoid;
        m.correction_bias = true;
        m.norm_topk = true;
        m.n_group = 4;
        m.topk_group = 2;
        m.routed_scaling = 2.5;
        m.shared_inter = m.expert_inter;
        if (layers > 1) m.layer_moe[0] = 0;  // first_k_dense_replace 1
        auto& a = c.mla;
        a.q_lora_rank = hidden / 2;
        a.kv_lora_rank = hidden / 2;
        a.qk_nope = hidden / 4;
        a.qk_rope = 8;
        a.v_head_dim = hidden / 4;
        a.rope_interleave = true;
        c.num_kv_heads = c.num_heads;
        c.head_dim = a.qk_head_dim();
        c.rotary_dim = a.qk_rope;
        c.rope.type = "yarn";
        // max_position_embeddings = factor x original (some transformers versions take
        // YaRN's factor from that ratio).
        c.rope.factor = 4;
        c.rope.original_max_position = c.max_position / 4;
        c.rope.beta_fast = 32;
        c.rope.beta_slow = 1;
        c.rope.mscale = 1.0;
        c.rope.mscale_all_dim = 0.8;
        break;
      }
      case Family::gpt_oss:
        m.norm_topk = true;
        m.expert_inter = std::max(32, hidden / 32 * 32);
        c.intermediate_size = m.expert_inter;
        m.router_bias = m.expert_bias = m.interleaved = true;
        m.swiglu_limit = 7.f;
        m.swiglu_alpha = 1.702f;
        c.qkv_bias = c.o_bias = true;
        c.attn_sinks = true;
        c.layer_window.assign(static_cast<size_t>(layers), 0);
        for (int l = 0; l < layers; l += 2) c.layer_window[static_cast<size_t>(l)] = 8;
        c.rope.type = "yarn";
        c.rope.factor = 8;
        c.rope.original_max_position = 64;
        c.rope.beta_fast = 32;
        c.rope.beta_slow = 1;
        c.rope.truncate = false;
        c.weights.kind = WeightFormat::Kind::mxfp4;
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
    Named n = named(name, shape);
    int64_t cnt = 1;
    for (auto d : shape) cnt *= d;
    n.data.resize(static_cast<size_t>(cnt));
    for (auto& x : n.data) x = offset + scale * rng.normal();
    ts.push_back(std::move(n));
  };
  auto lin = [&](const std::string& name, int64_t out, int64_t in) {
    add(name, {out, in}, static_cast<float>(1.0 / std::sqrt(static_cast<double>(in))), 0.0f);
    ts.back().projection = true;
  };
  add("model.embed_tokens.weight", {V, H}, 1.0f, 0.0f);
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    add(p + "input_layernorm.weight", {H}, 0.2f, 1.0f);
    add(p + "post_attention_layernorm.weight", {H}, 0.2f, 1.0f);
    if (c.is_mla()) {
      const auto& a = c.mla;
      const int64_t qk = a.qk_head_dim(), qr = a.q_lora_rank, kr = a.kv_lora_rank;
      if (qr > 0) {
        lin(p + "self_attn.q_a_proj.weight", qr, H);
        add(p + "self_attn.q_a_layernorm.weight", {qr}, 0.2f, 1.0f);
        lin(p + "self_attn.q_b_proj.weight", NH * qk, qr);
      } else {
        lin(p + "self_attn.q_proj.weight", NH * qk, H);
      }
      lin(p + "self_attn.kv_a_proj_with_mqa.weight", a.cache_width(), H);
      add(p + "self_attn.kv_a_layernorm.weight", {kr}, 0.2f, 1.0f);
      lin(p + "self_attn.kv_b_proj.weight", NH * (a.qk_nope + a.v_head_dim), kr);
      lin(p + "self_attn.o_proj.weight", H, NH * a.v_head_dim);
    } else {
      lin(p + "self_attn.q_proj.weight", NH * hd, H);
      lin(p + "self_attn.k_proj.weight", NKV * hd, H);
      lin(p + "self_attn.v_proj.weight", NKV * hd, H);
      lin(p + "self_attn.o_proj.weight", H, NH * hd);
    }
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
    if (c.attn_sinks) add(p + "self_attn.sinks", {NH}, 1.0f, 0.0f);
    if (c.family == Family::gpt_oss) {
      const int64_t E = c.moe.experts, EI = c.moe.expert_inter;
      const std::string b = p + "mlp.";
      lin(b + "router.weight", E, H);
      ts.back().projection = false;
      add(b + "router.bias", {E}, 0.3f, 0.0f);
      auto experts = [&](const std::string& name, int64_t rows, int64_t cols) {
        Named n = named(name, {});
        n.data.resize(static_cast<size_t>(E * rows * cols));
        const float sc = static_cast<float>(1.0 / std::sqrt(static_cast<double>(cols)));
        for (auto& x : n.data) x = sc * rng.normal();
        std::vector<uint8_t> blocks, scales;
        quantize_mxfp4(&n.data, E * rows, cols, &blocks, &scales);
        Named bl = named(name + "_blocks", {E, rows, cols / 32, 16});
        bl.raw = std::move(blocks);
        bl.raw_type = DType::u8;
        Named sl = named(name + "_scales", {E, rows, cols / 32});
        sl.raw = std::move(scales);
        sl.raw_type = DType::u8;
        ts.push_back(std::move(bl));
        ts.push_back(std::move(sl));
      };
      experts(b + "experts.gate_up_proj", 2 * EI, H);
      add(b + "experts.gate_up_proj_bias", {E, 2 * EI}, 0.3f, 0.0f);
      experts(b + "experts.down_proj", H, EI);
      add(b + "experts.down_proj_bias", {E, H}, 0.3f, 0.0f);
      continue;
    }
    if (c.moe.is_moe(l)) {
      const auto nm = moe_tensor_names(c.family);
      const auto& m = c.moe;
      const int64_t E = m.experts, EI = m.expert_inter;
      const std::string b = p + nm.block + ".";
      lin(b + "gate.weight", E, H);
      ts.back().projection = false;  // the router stays in the plain type
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

  if (spec.fp8) {
    std::vector<Named> out;
    for (auto& t : ts) {
      if (!t.projection) {
        out.push_back(std::move(t));
        continue;
      }
      std::vector<uint8_t> q;
      auto scales = quantize_fp8_block(&t.data, t.shape[0], t.shape[1], &q);
      const std::vector<int64_t> sshape = {(t.shape[0] + 127) / 128, (t.shape[1] + 127) / 128};
      if (!spec.fp8_dequantized) t.raw = std::move(q);
      const std::string name = t.name;
      out.push_back(std::move(t));
      if (!spec.fp8_dequantized) {
        Named sc = named(fp8_scale_name(name), sshape, std::move(scales));
        out.push_back(std::move(sc));
      }
    }
    ts = std::move(out);
  }
  // Scale tensors are F32 whatever the checkpoint's float type (as published FP8 ones are).
  auto bytes_of = [&](const Named& t) -> uint64_t {
    if (!t.raw.empty()) return t.raw.size();
    const bool scale = t.name.ends_with("_scale_inv");
    return t.data.size() * (scale ? 4 : dtype_size(spec.dtype));
  };

  // Shards: contiguous runs of tensors of about equal size.
  const int shards = std::max(1, spec.shards);
  uint64_t total = 0;
  for (const auto& t : ts) total += bytes_of(t);
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
    for (size_t i = 0; i < next; ++i) before += bytes_of(ts[i]);
    while (next < ts.size() && (part.empty() || before + bytes < target || s == shards - 1)) {
      TensorToWrite w{ts[next].name, ts[next].shape, ts[next].data.data()};
      if (!ts[next].raw.empty()) {
        w.raw = ts[next].raw.data();
        w.raw_dtype = ts[next].raw_type;
      } else if (spec.dtype == DType::bf16 && ts[next].name.ends_with("_scale_inv")) {
        w.raw = ts[next].data.data();  // the scales stay F32
        w.raw_dtype = DType::f32;
      }
      part.push_back(w);
      bytes += bytes_of(ts[next]);
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
  if (spec.fp8 && !spec.fp8_dequantized)
    cj["quantization_config"] = {{"quant_method", "fp8"},
                                 {"fmt", "e4m3"},
                                 {"activation_scheme", "dynamic"},
                                 {"weight_block_size", {128, 128}},
                                 {"modules_to_not_convert", {"lm_head"}}};
  if (c.rope.type == "yarn") {
    cj["rope_scaling"] = {{"rope_type", "yarn"},
                          {"factor", c.rope.factor},
                          {"beta_fast", c.rope.beta_fast},
                          {"beta_slow", c.rope.beta_slow},
                          {"truncate", c.rope.truncate},
                          {"original_max_position_embeddings", c.rope.original_max_position}};
    if (c.rope.mscale) cj["rope_scaling"]["mscale"] = *c.rope.mscale;
    if (c.rope.mscale_all_dim) cj["rope_scaling"]["mscale_all_dim"] = *c.rope.mscale_all_dim;
  } else if (c.rope.type != "default")
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
    case Family::deepseek_v3: {
      int dense = 0;
      while (dense < c.num_layers && !m.is_moe(dense)) ++dense;
      const auto& a = c.mla;
      cj["n_routed_experts"] = m.experts;
      cj["n_shared_experts"] = m.shared_inter / std::max(1, m.expert_inter);
      cj["num_experts_per_tok"] = m.top_k;
      cj["moe_intermediate_size"] = m.expert_inter;
      cj["first_k_dense_replace"] = dense;
      cj["n_group"] = m.n_group;
      cj["topk_group"] = m.topk_group;
      cj["routed_scaling_factor"] = m.routed_scaling;
      cj["norm_topk_prob"] = m.norm_topk;
      cj["topk_method"] = "noaux_tc";
      cj["scoring_func"] = "sigmoid";
      cj["moe_layer_freq"] = 1;
      cj["attention_bias"] = false;
      cj["q_lora_rank"] = a.q_lora_rank > 0 ? nlohmann::json(a.q_lora_rank) : nlohmann::json();
      cj["kv_lora_rank"] = a.kv_lora_rank;
      cj["qk_nope_head_dim"] = a.qk_nope;
      cj["qk_rope_head_dim"] = a.qk_rope;
      cj["v_head_dim"] = a.v_head_dim;
      cj["rope_interleave"] = a.rope_interleave;
      cj["head_dim"] = a.qk_rope;  // as transformers' DeepseekV3Config writes it
      break;
    }
    case Family::gpt_oss: {
      nlohmann::json types = nlohmann::json::array();
      int window = 0;
      for (int l = 0; l < c.num_layers; ++l) {
        const int w = c.window_of(l);
        types.push_back(w > 0 ? "sliding_attention" : "full_attention");
        if (w > 0) window = w;
      }
      cj["num_local_experts"] = m.experts;
      cj["num_experts_per_tok"] = m.top_k;
      cj["experts_per_token"] = m.top_k;
      cj["swiglu_limit"] = m.swiglu_limit;
      cj["sliding_window"] = window;
      cj["layer_types"] = types;
      cj["attention_bias"] = true;
      cj["quantization_config"] = {{"quant_method", "mxfp4"},
                                   {"modules_to_not_convert",
                                    {"model.layers.*.self_attn", "model.layers.*.mlp.router",
                                     "model.embed_tokens", "lm_head"}}};
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
