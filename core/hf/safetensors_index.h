#pragma once
// model.safetensors.index.json of a sharded Hugging Face checkpoint, read once for preflight
// (env/model_files.cc: which shards must exist, the total size) and the engine
// (daemon/engine/checkpoint.cc: which file holds each tensor).
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"

namespace spark::hf {

/// The index's file name inside a model directory.
inline constexpr const char* kSafetensorsIndexName = "model.safetensors.index.json";

struct SafetensorsIndex {
  std::map<std::string, std::string> weight_map;  // tensor name -> shard file name
  std::vector<std::string> files;                 // the shard names, each once, sorted
  std::optional<uint64_t> total_size;             // metadata.total_size (bytes of tensors)
};

/// Parses the index text; `where` names the file. Errc::integrity when it is not a JSON
/// object with a "weight_map" object, or when a shard name is not a plain file name (a
/// path, "..", empty: the index must not point outside the model directory).
Result<SafetensorsIndex> parse_safetensors_index(const std::string& text, const std::string& where);

}  // namespace spark::hf
