#pragma once
// The fabric self-test's device part: after the rendezvous and before READY every rank runs
// a short all-reduce and all-gather sweep over NCCL (8 KB to 256 MB by default) on device
// buffers filled by a kernel with seeded values (kernels/fabric_check.h), checks every
// result on the device (#wrong, as nccl-tests counts it), times each size with CUDA events,
// then reads NCCL's debug file and judges (env/fabric_report.h).
#include <chrono>

#include "core/error.h"
#include "env/fabric_report.h"

namespace spark::engine {

class NcclCollective;

using env::fabric_bandwidth;
using env::fabric_bus_factor;
using env::fabric_expect_from_env;
using env::fabric_iters;
using env::fabric_report_from_json;
using env::fabric_sizes;
using env::FabricExpect;
using env::FabricPoint;
using env::FabricReport;
using env::judge_fabric;
using env::NcclTransportFacts;
using env::parse_nccl_debug;
using env::render_fabric_table;
using env::to_json;

struct FabricOptions {
  size_t min_bytes = 8 << 10;
  size_t max_bytes = 256 << 20;
  uint64_t seed = 0x5eed;
  int warmup = 2;
  std::chrono::milliseconds timeout{30000};  // each wait
};

/// Runs the sweep on the current device over `comm` (every rank at the same time), then
/// parses `debug_file` (NCCL_DEBUG_FILE; "" skips the transport part) and judges.
Result<FabricReport> run_fabric_test(NcclCollective& comm, const FabricOptions& opts,
                                     const FabricExpect& expect, const std::string& debug_file);

}  // namespace spark::engine
