#pragma once
// What sparkd adds to the NCCL environment a rank was started with (the NCCL_* that
// `sparkctl env --rank N` renders from preflight's facts): the debug output the fabric
// self-test reads (NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET, NCCL_DEBUG_FILE in the
// rank's log directory) and NCCL_NVLS_ENABLE=0 where nothing set it. Values set by hand are
// kept. NCCL reads its environment once, at its first call, so this runs before any.
#include <string>

#include "core/config.h"
#include "core/error.h"

namespace spark::env {

struct AppliedNcclEnv {
  std::string debug_file;  // where NCCL writes INIT/NET lines ("" when it cannot be known)
  std::string summary;     // every NCCL_* of the process, "NAME=value" joined by spaces
};

/// Sets the debug variables (and NCCL_NVLS_ENABLE=0) unless already set, truncates the debug
/// file of an earlier run, and returns what NCCL will see. Not thread-safe (setenv).
AppliedNcclEnv apply_nccl_debug_env(const std::string& log_dir, int rank);

/// Every NCCL_* variable of this process, sorted, as "NAME=value" joined by spaces.
std::string nccl_environment_summary();

/// FABRIC_MIN_BUSBW in GB/s (0 when unset); Errc::config naming the key and its source when
/// it is not a non-negative number.
Result<double> fabric_min_busbw(const RingConfig& cfg);

}  // namespace spark::env
