#pragma once
// config.json of a Hugging Face decoder-only checkpoint, reduced to what the engine runs: the
// validated, derived view of what core/hf/config.h reads. Each architecture belongs to a
// family whose own file (daemon/engine/family_*.cc) reads the fields only it has; this file
// holds what every family shares and the table of architectures.
#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/hf/config.h"
#include "daemon/engine/weight_format.h"

namespace spark::engine {

/// The architectures the engine implements, one per `architectures` entry.
enum class Family {
  llama,
  qwen2,
  qwen3,
  mistral,
  qwen3_moe,
  mixtral,
  glm4_moe,
  minimax_m2,
  gpt_oss,
  deepseek_v3
};

/// The layer recipe an architecture runs (one file each: family_dense.cc, family_moe.cc).
enum class RecipeKind { dense, moe };

/// How q and k are normalised before RoPE: not at all, per head (Qwen3, GLM-4.5's
/// use_qk_norm), or over the whole projection of all heads (MiniMax-M2's per-layer norm).
enum class QkNorm : uint8_t { none, per_head, per_layer };

/// How a router turns its logits into expert scores.
enum class RouterScore : uint8_t { softmax, sigmoid };

/// A mixture-of-experts model's routing and expert shapes (experts == 0: a dense model).
struct MoeConfig {
  int experts = 0;       // routed experts per MoE layer
  int top_k = 0;         // experts per token
  int expert_inter = 0;  // one routed expert's intermediate size
  int shared_inter = 0;  // the shared experts' intermediate size (0: none)
  RouterScore score = RouterScore::softmax;
  bool norm_topk = false;        // the top-k weights renormalised to sum to 1
  bool correction_bias = false;  // e_score_correction_bias added for the choice only
  int n_group = 1;               // groups of experts (group-limited top-k)
  int topk_group = 1;            // groups a token's experts may come from
  double routed_scaling = 1.0;   // routed_scaling_factor on the top-k weights
  int expert_block = 1;  // the weight format's block along the intermediate dimension (1: none)
  std::vector<uint8_t> layer_moe;  // per layer: 1 = MoE block, 0 = dense MLP
  int mtp_layers = 0;              // multi-token-prediction layers in the files (never loaded)
  // gpt-oss: the router's logits carry a bias; experts carry biases, hold gate and up
  // interleaved and use the clamped activation (swiglu_limit > 0).
  bool router_bias = false;
  bool expert_bias = false;
  bool interleaved = false;
  float swiglu_limit = 0.f, swiglu_alpha = 0.f;
  bool is_moe(int layer) const {
    return layer >= 0 && static_cast<size_t>(layer) < layer_moe.size() &&
           layer_moe[static_cast<size_t>(layer)] != 0;
  }
  int moe_layers() const;
};

/// Multi-head latent attention (DeepSeek-V3): queries through a low-rank pair (q_a_proj,
/// q_a_layernorm, q_b_proj) or q_proj; per token one latent (kv_a_proj_with_mqa's first
/// kv_lora_rank outputs, RMS-normalised) and one RoPE key of qk_rope_head_dim shared by every
/// head, which kv_b_proj expands into each head's key (nope part) and value. kv_lora_rank 0:
/// not MLA.
struct MlaConfig {
  int q_lora_rank = 0;  // 0: q_proj straight from the hidden state
  int kv_lora_rank = 0;
  int qk_nope = 0, qk_rope = 0, v_head_dim = 0;
  /// RoPE over the interleaved pairs (2i, 2i + 1) of q_pe and k_pe (DeepSeek's layout,
  /// transformers' rope_interleave); false: over the halves (i, i + rope / 2).
  bool rope_interleave = true;
  int qk_head_dim() const { return qk_nope + qk_rope; }
  /// Values one token keeps per layer in the cache: the latent and the rotated RoPE key.
  int cache_width() const { return kv_lora_rank + qk_rope; }
};

struct ModelConfig {
  std::string architecture;  // e.g. "LlamaForCausalLM"
  Family family = Family::llama;
  RecipeKind recipe = RecipeKind::dense;
  int vocab_size = 0;
  int hidden_size = 0;
  int intermediate_size = 0;  // the dense MLP's (dense layers of an MoE model too)
  int num_layers = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int rotary_dim = 0;  // the first rotary_dim dims of each head are rotated (= head_dim)
  int max_position = 0;
  double rms_eps = 1e-6;
  double rope_theta = 10000.0;
  hf::RopeScaling rope;  // type is one of default, linear, llama3
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // q/k/v projections carry a bias (Qwen2; Llama attention_bias)
  bool o_bias = false;    // o_proj carries a bias (Llama attention_bias)
  bool mlp_bias = false;  // gate/up/down carry a bias (Llama mlp_bias)
  QkNorm qk_norm = QkNorm::none;
  int sliding_window = 0;  // 0: full attention (Mistral's, Mixtral's sliding_window otherwise)
  /// Per layer, where layers differ (gpt-oss's layer_types): its window, 0 full attention.
  std::vector<int> layer_window;
  int window_of(int layer) const {
    return layer >= 0 && static_cast<size_t>(layer) < layer_window.size()
               ? layer_window[static_cast<size_t>(layer)]
               : sliding_window;
  }
  bool attn_sinks = false;  // a learned sink logit per head joins each softmax (gpt-oss)
  MoeConfig moe;
  MlaConfig mla;  // DeepSeek-V3 (head_dim is then qk_nope + qk_rope, rotary_dim qk_rope)
  int bos_token_id = -1;
  std::vector<int> eos_token_ids;
  std::string torch_dtype;  // as written in config.json ("bfloat16", ...), informational
  WeightFormat weights;     // quantization_config: plain or FP8 block-scaled matrices
  bool is_moe() const { return moe.experts > 0; }
  bool is_mla() const { return mla.kv_lora_rank > 0; }
};

/// The factor on latent attention's softmax scale qk_head_dim^-0.5, as transformers'
/// DeepseekV3Attention sets it: YaRN's mscale(factor, mscale_all_dim) squared where
/// rope_scaling is yarn with a non-zero mscale_all_dim, else 1.
double mla_softmax_mscale_sq(const hf::RopeScaling& r);

/// Parameters of the whole model (all ranks together, embedding and lm_head included, the
/// multi-token-prediction layers not), and those one token's forward pass multiplies (the
/// chosen experts and the shared experts of each MoE layer, every other weight).
struct ParamCount {
  uint64_t total = 0, active = 0;
};
ParamCount count_params(const ModelConfig& c);

/// The architectures we run, for messages: "LlamaForCausalLM, Qwen2ForCausalLM, ...".
std::string supported_architectures();
/// The `architectures` name of a family ("Qwen3MoeForCausalLM").
const char* architecture_name(Family f);
/// Its `model_type` ("qwen3_moe").
const char* model_type_name(Family f);

/// Parses config.json text; `where` names the file in messages. Anything outside the
/// supported set is Errc::unsupported naming what and the supported list; a field that
/// changes the arithmetic and that the engine does not implement is refused naming the field
/// and its value.
Result<ModelConfig> parse_model_config(const std::string& json_text, const std::string& where);
/// The same from what core/hf read.
Result<ModelConfig> model_config_from(const hf::Config& hf, const std::string& where);

/// Reads DIR/config.json (and eos ids from DIR/generation_config.json when present).
Result<ModelConfig> load_model_config(const std::string& dir);

// ---- helpers for the family files' own fields (config.json as parsed) -------------------
namespace cfgjson {
/// The object the model's fields live in (text_config for a multimodal checkpoint).
const nlohmann::json& model_object(const hf::Config& h);
/// An integer field >= 0 (absent or null: `def`); a wrong type is Errc::config naming it.
Result<int> get_int(const nlohmann::json& j, const char* key, int def, const std::string& where);
Result<double> get_double(const nlohmann::json& j, const char* key, double def,
                          const std::string& where);
Result<bool> get_bool(const nlohmann::json& j, const char* key, bool def, const std::string& where);
/// A string field ("" when absent or null; a wrong type is Errc::config).
Result<std::string> get_string(const nlohmann::json& j, const char* key, const std::string& where);
/// A list of integers (absent or null: empty).
Result<std::vector<int>> get_int_list(const nlohmann::json& j, const char* key,
                                      const std::string& where);
/// Errc::unsupported "{where}: {key} = {value} is not supported ({why})".
Error unsupported(const std::string& where, const std::string& key, const nlohmann::json& value,
                  const std::string& why);
}  // namespace cfgjson

}  // namespace spark::engine
