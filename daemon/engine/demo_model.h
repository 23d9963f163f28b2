#pragma once
// The embedded demo checkpoint: a small Qwen2ForCausalLM (or, asked for, a small model of
// another architecture the engine runs: a mixture of experts such as Qwen3MoeForCausalLM)
// with deterministic random weights (the same bytes on every machine) plus the project's
// byte-level BPE tokenizer (daemon/engine/demo/) and its ChatML chat template, so a machine
// without a GPU can start a ring and answer a chat request. Its weights are random: it
// produces fluent-looking nonsense.
#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"

namespace spark::engine {

struct DemoModelReport {
  std::string dir;
  std::string architecture;
  uint64_t parameters = 0;
  uint64_t bytes = 0;      // total size of the files written
  bool tokenizer = false;  // tokenizer.json + tokenizer_config.json written
  std::vector<std::string> files;
  std::string note;  // e.g. why there is no tokenizer
};

/// Writes the demo checkpoint into `dir`. A non-empty `dir` that is not an earlier demo is
/// refused unless `force`. Files are written to a sibling temporary directory that is then
/// renamed into place, so `dir` never holds a half-written checkpoint.
/// `architecture` ("" = Qwen2ForCausalLM) names one of supported_architectures().
/// `weights`: "" or "bf16" (the default), or "fp8" (every projection F8_E4M3 with 128x128
/// block scales, as published FP8 checkpoints are).
Result<DemoModelReport> write_demo_model(const std::string& dir, bool force,
                                         const std::string& architecture = "",
                                         const std::string& weights = "");

}  // namespace spark::engine
