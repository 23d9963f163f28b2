#pragma once
// The native backend's reading of the cluster file for our engine: the engine itself knows
// nothing of the cluster file, only of its EngineOptions.
#include "core/config.h"
#include "core/error.h"
#include "daemon/engine/engine.h"

namespace spark::daemon {

/// Engine options from the cluster file: SLOTS -> slots, CONTEXT_LEN -> max_context, a KV
/// cache of SLOTS full contexts (on a GPU at most what is free after the weights less
/// MEM_RESERVE), KV_DTYPE auto | bf16 | fp8 | fp32 (fp16: Errc::unsupported).
Result<engine::EngineOptions> engine_options_from(const RingConfig& cfg);

}  // namespace spark::daemon
