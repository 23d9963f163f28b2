#include "daemon/engine/family.h"

namespace spark::engine {

std::span<const FamilyEntry> family_table() {
  static const FamilyEntry kTable[] = {
      {"LlamaForCausalLM", "llama", Family::llama, RecipeKind::dense, parse_dense_family,
       plan_dense_family},
      {"Qwen2ForCausalLM", "qwen2", Family::qwen2, RecipeKind::dense, parse_dense_family,
       plan_dense_family},
      {"Qwen3ForCausalLM", "qwen3", Family::qwen3, RecipeKind::dense, parse_dense_family,
       plan_dense_family},
      {"MistralForCausalLM", "mistral", Family::mistral, RecipeKind::dense, parse_dense_family,
       plan_dense_family},
      {"Qwen3MoeForCausalLM", "qwen3_moe", Family::qwen3_moe, RecipeKind::moe, parse_moe_family,
       plan_moe_family},
      {"MixtralForCausalLM", "mixtral", Family::mixtral, RecipeKind::moe, parse_moe_family,
       plan_moe_family},
      {"Glm4MoeForCausalLM", "glm4_moe", Family::glm4_moe, RecipeKind::moe, parse_moe_family,
       plan_moe_family},
      {"MiniMaxM2ForCausalLM", "minimax_m2", Family::minimax_m2, RecipeKind::moe, parse_moe_family,
       plan_moe_family},
      {"GptOssForCausalLM", "gpt_oss", Family::gpt_oss, RecipeKind::moe, parse_gptoss_family,
       plan_gptoss_family},
      {"DeepseekV3ForCausalLM", "deepseek_v3", Family::deepseek_v3, RecipeKind::moe,
       parse_moe_family, plan_moe_family},
  };
  return kTable;
}

}  // namespace spark::engine
