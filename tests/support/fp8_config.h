#pragma once
// A small FP8-shaped model for the engine's FP8 tests (CPU and CUDA).
#include "daemon/engine/random_checkpoint.h"

namespace spark::test {

/// Dense Qwen3 or Qwen3-MoE with every projection a whole number of 128-blocks at one and
/// two ranks: 4 heads and 2 KV heads of 128, intermediate 512, 8 experts of 256.
inline engine::ModelConfig fp8_config(engine::Family f) {
  auto c = engine::small_config(f, 384, 256, 2);
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 128;
  c.rotary_dim = 128;
  c.intermediate_size = 512;
  c.eos_token_ids = {};
  if (c.is_moe()) c.moe.expert_inter = 256;
  return c;
}

}  // namespace spark::test
