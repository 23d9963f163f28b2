#pragma once
// Whether the ring's engine can serve the model in a directory, from what preflight reads
// of it (config.json, the shards' safetensors headers, the tokenizer's files), said before
// anything starts. The native engine's own config reader and shard plan decide
// (daemon/engine/model_config.h, family*.cc), so the architectures it runs are listed in
// one place. Preflight's model.engine check and `sparkctl plan` report it.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/config.h"
#include "env/model_files.h"

namespace spark::env {

struct EngineFitOptions {
  int world = 1;                   // ranks the shard plan is made for
  bool needs_tokenizer = true;     // rank 0's node: text requests need tokenizer.json
  std::optional<int64_t> context;  // instead of CONTEXT_LEN (plan --context)
};

struct EngineFit {
  bool checked = false;  // false: not this check's to say (ENGINE=exec, no config.json)
  std::string engine;    // "native" or "exec"
  std::string summary;   // what was checked, or why nothing was
  std::vector<std::string> problems;  // each one keeps the engine from serving the model
  std::vector<std::string> warnings;  // served, but not as configured
  std::vector<std::string> fixes;     // what to do, one per kind of problem or warning
  bool ok() const { return problems.empty(); }
};

/// The verdict for `mf` under the ring's settings (`cfg` may be null: the defaults).
EngineFit engine_fit(const ModelFiles& mf, const RingConfig* cfg, const EngineFitOptions& o);

}  // namespace spark::env
