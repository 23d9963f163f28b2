#pragma once
// config.json of a Hugging Face decoder-only checkpoint, reduced to what the engine runs: the
// validated, derived view of what core/hf/config.h reads.
#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/hf/config.h"

namespace spark::engine {

/// The model families the engine implements; each is one `architectures` entry.
enum class Family { llama, qwen2, qwen3, mistral };

struct ModelConfig {
  std::string architecture;  // e.g. "LlamaForCausalLM"
  Family family = Family::llama;
  int vocab_size = 0;
  int hidden_size = 0;
  int intermediate_size = 0;
  int num_layers = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int max_position = 0;
  double rms_eps = 1e-6;
  double rope_theta = 10000.0;
  hf::RopeScaling rope;  // type is one of default, linear, llama3
  bool tie_word_embeddings = false;
  bool qkv_bias = false;   // q/k/v projections carry a bias (Qwen2; Llama attention_bias)
  bool o_bias = false;     // o_proj carries a bias (Llama attention_bias)
  bool mlp_bias = false;   // gate/up/down carry a bias (Llama mlp_bias)
  bool qk_norm = false;    // per-head RMSNorm of q and k before RoPE (Qwen3)
  int sliding_window = 0;  // 0: full attention (Mistral's sliding_window otherwise)
  int bos_token_id = -1;
  std::vector<int> eos_token_ids;
  std::string torch_dtype;  // as written in config.json ("bfloat16", ...), informational
};

/// The architectures we run, for messages: "LlamaForCausalLM, Qwen2ForCausalLM, ...".
std::string supported_architectures();

/// Parses config.json text; `where` names the file in messages. Anything outside the
/// supported set is Errc::unsupported naming what and the supported list.
Result<ModelConfig> parse_model_config(const std::string& json_text, const std::string& where);
/// The same from what core/hf read.
Result<ModelConfig> model_config_from(const hf::Config& hf, const std::string& where);

/// Reads DIR/config.json (and eos ids from DIR/generation_config.json when present).
Result<ModelConfig> load_model_config(const std::string& dir);

}  // namespace spark::engine
