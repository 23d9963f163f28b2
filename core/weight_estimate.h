#pragma once
// The weights of a model estimated from config.json alone, for sizing a ring before the
// download: every tensor's shape the config implies (embeddings, attention of each kind,
// dense and expert MLPs, routers, multi-token-prediction layers, the output head), at the
// bytes the checkpoint's quantization_config implies, or at a dtype the user names.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "core/error.h"

namespace spark::plan {

struct WeightEstimate {
  uint64_t total = 0;    // every tensor
  uint64_t experts = 0;  // the routed experts' tensors
  uint64_t params = 0;   // parameters, all tensors
  std::string basis;     // how the bytes were chosen, for people ("fp8 (quantization_config)")
};

/// Bytes per parameter of a --weights-dtype value: bf16, fp16, fp32, fp8, int8, fp4 (MXFP4 /
/// NVFP4 with their block scales), int4 (groups of 128 with fp16 scales). nullopt when
/// unknown.
std::optional<double> weights_dtype_bytes(const std::string& dtype);

/// The estimate from a parsed config.json (the nested text_config when the top level has no
/// num_hidden_layers). `dtype` (a weights_dtype_bytes value, "" = the config's own
/// quantization_config / torch_dtype) overrides the bytes of the matrices. Errc::config
/// naming `where` when the config lacks what the shapes need.
Result<WeightEstimate> estimate_weights(const nlohmann::json& config, const std::string& where,
                                        const std::string& dtype = "");

}  // namespace spark::plan
