#pragma once
// The model directory as preflight sees it: config.json, the safetensors index and every
// shard it names, and the staging manifest (core/manifest.h) when there is one: the sizes
// it records and its content digest.
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/hf/config.h"
#include "env/sysroot.h"

namespace spark::env {

/// One file the model needs.
struct ModelFile {
  std::string name;
  std::optional<uint64_t> size;      // nullopt: missing
  std::optional<uint64_t> expected;  // from the manifest
};

struct ModelFiles {
  std::string dir;
  bool dir_exists = false;
  bool config_ok = false;
  std::string config_error;
  hf::Config config;       // config.json as core/hf read it (config_ok)
  std::string index_name;  // "model.safetensors.index.json" or "" (single file)
  std::string index_error;
  std::vector<ModelFile> files;  // config.json, index, shards, in that order
  bool has_manifest = false;
  std::string manifest_error;
  std::string manifest_digest;  // Manifest::digest() (content: names, sizes, hashes)
  uint64_t weight_bytes = 0;    // index metadata total_size, else the shards' sizes
  // From the shards' safetensors headers (names and byte ranges only): the bytes of the
  // routed experts' tensors, for splitting them the way the engine does.
  bool tensor_sizes = false;  // every shard's header was read
  std::string tensor_sizes_error;
  uint64_t tensor_bytes = 0;  // sum over every tensor
  uint64_t expert_bytes = 0;  // routed experts (plan::is_routed_expert_tensor)
  // Element types of the shards' tensors ("BF16", "F8_E4M3", ...): how many tensors of each
  // and the first one's name, for saying whether an engine can load them.
  struct DTypeSeen {
    uint64_t tensors = 0;
    std::string example;
  };
  std::map<std::string, DTypeSeen> tensor_dtypes;
  bool tokenizer_json = false;  // tokenizer.json is there (text requests need it)
};

/// Reads `model_path` (a node path) through the root.
ModelFiles read_model_files(const Sysroot& root, const std::string& model_path);

}  // namespace spark::env
