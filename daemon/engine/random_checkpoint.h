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
};

/// A small config of `family` for tests and the demo (GQA 4/2 heads).
ModelConfig small_config(Family family, int vocab_size = 512, int hidden = 64, int layers = 2);

/// Writes the checkpoint into `dir` (created if needed). Same spec and seed, same bytes.
Status write_random_checkpoint(const std::string& dir, const RandomCheckpointSpec& spec);

}  // namespace spark::engine
