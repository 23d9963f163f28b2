#pragma once
// Writes small deterministic random-weight checkpoints in Hugging Face layout (config.json,
// generation_config.json, safetensors, optional shards + index). Used by `sparkctl
// demo-model` and by the engine's tests; the weights are random, the model is not trained.
#include <cstdint>
#include <string>

#include "core/error.h"
#include "daemon/engine/model_config.h"
#include "daemon/engine/safetensors.h"

namespace spark::engine {

struct RandomCheckpointSpec {
  ModelConfig config;         // architecture and dimensions (architecture string must be set)
  DType dtype = DType::bf16;  // F32 or BF16
  uint64_t seed = 1;
  int shards = 1;  // > 1: model-0000k-of-0000n.safetensors + index
  /// FP8 as DeepSeek/Qwen publish it: every projection's weight F8_E4M3 with 128x128 block
  /// scales (`X.weight_scale_inv`, F32, each a BF16 number) and quantization_config in
  /// config.json; the embedding, norms, router and lm_head in `dtype`.
  bool fp8 = false;
  /// With fp8: write the same model unquantized instead, each projection holding exactly
  /// the values its FP8 form dequantizes to (the reference for the FP8 checkpoint).
  bool fp8_dequantized = false;
};

/// A small config of `family` for tests and the demo (GQA 4/2 heads).
ModelConfig small_config(Family family, int vocab_size = 512, int hidden = 64, int layers = 2);

/// Writes the checkpoint into `dir` (created if needed). Same spec and seed, same bytes.
Status write_random_checkpoint(const std::string& dir, const RandomCheckpointSpec& spec);

}  // namespace spark::engine
