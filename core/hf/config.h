#pragma once
// config.json of a Hugging Face checkpoint, read once for everyone who needs it: the planner
// (env/plan.cc), preflight (env/model_files.cc) and the engine's validated ModelConfig
// (daemon/engine/model_config.cc). This is the file as written: every field it knows is
// type- and range-checked here (a wrong type is an error naming the file and the key); which
// fields are required, and which values are supported, is each user's decision.
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"

namespace spark::hf {

/// RoPE frequency scaling (rope_scaling / rope_parameters): what the engine validates and
/// the RoPE kernel (kernels/rope.h) computes its frequencies from.
struct RopeScaling {
  std::string type = "default";  // rope_type | type: default, linear, llama3, ... as written
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  double original_max_position = 8192;  // original_max_position_embeddings
  // YaRN (gpt-oss, DeepSeek-V3): the correction range's rotations, whether its ends are
  // rounded outward, and the attention scaling (absent: from factor and mscale).
  double beta_fast = 32, beta_slow = 1;
  bool truncate = true;
  std::optional<double> attention_factor, mscale, mscale_all_dim;
};

/// YaRN's attention scaling (transformers multiplies cos and sin by it, so every q.k of fully
/// rotated heads by its square): attention_factor, else from factor and mscale; 1 for the
/// other types.
double rope_attention_factor(const RopeScaling& r);

/// The fields of config.json that the project reads. Integers are absent when the key is
/// absent or null. For a multimodal checkpoint whose top level has no num_hidden_layers, the
/// model fields come from its "text_config".
struct Config {
  std::vector<std::string> architectures;  // "architectures"; may be empty
  std::string model_type;
  std::optional<int> vocab_size, hidden_size, intermediate_size, num_hidden_layers,
      num_attention_heads, num_key_value_heads, head_dim, max_position_embeddings, kv_lora_rank,
      qk_rope_head_dim, sliding_window, bos_token_id;
  std::optional<double> rms_norm_eps;
  std::optional<double> rope_theta;         // top level, or inside rope_parameters
  std::optional<RopeScaling> rope_scaling;  // rope_parameters, else rope_scaling
  std::string hidden_act;                   // "" when absent
  bool tie_word_embeddings = false;
  bool attention_bias = false;
  bool mlp_bias = false;
  bool use_sliding_window = false;
  std::vector<int> eos_token_ids;  // eos_token_id (one id or a list), without duplicates
  std::string dtype;               // dtype, else torch_dtype ("bfloat16", ...); "" when absent
  // The whole file as parsed: the memory planner (core/model_plan.h) reads its per-layer
  // fields (layer_types, the indexer's and linear attention's dimensions, experts) from it,
  // type-checking each, so that it sees the same file the engine and preflight see.
  nlohmann::json raw;
};

/// Reads a parsed config.json; `where` names the file in messages (Errc::config).
Result<Config> parse_config(const nlohmann::json& j, const std::string& where);
/// Parses config.json text ("not a JSON object" is Errc::config too).
Result<Config> parse_config_text(const std::string& text, const std::string& where);
/// Reads DIR/config.json (Errc::not_found when it cannot be read) and adds the eos ids of
/// DIR/generation_config.json when that file is present.
Result<Config> load_config(const std::string& dir);

/// Appends the ids of an eos_token_id value (one integer or a list) that `out` lacks.
void add_eos_ids(const nlohmann::json& v, std::vector<int>* out);

}  // namespace spark::hf
