#pragma once
// The native backend's reading of the cluster file for our engine: the engine itself knows
// nothing of the cluster file, only of its EngineOptions.
#include "core/config.h"
#include "core/error.h"
#include "daemon/engine/engine.h"

namespace spark::daemon {

/// Engine options from the cluster file: SLOTS -> slots, CONTEXT_LEN -> max_context, a KV
/// cache of SLOTS full contexts. KV_DTYPE must be auto or fp32 on the CPU path
/// (Errc::unsupported otherwise).
Result<engine::EngineOptions> engine_options_from(const RingConfig& cfg);

}  // namespace spark::daemon
