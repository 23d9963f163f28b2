#pragma once
// `sparkctl preflight --fabric`: the fabric self-test that sparkd runs before READY, run on
// every node of the ring before any engine starts (native or exec), with each rank's own
// environment (the NCCL_* pins `sparkctl env --rank N` prints). Every rank runs
// `sparkd fabric-rank` at once (sparkctl links neither NCCL nor CUDA; sparkd is on every
// node); rank 0 serves their store on RDZV_PORT. The head reads the JSON reports.
#include <string>
#include <vector>

#include "cli/cli.h"
#include "cli/cmd_preflight.h"
#include "env/fabric_report.h"

namespace spark::cli {

struct FabricPreflight {
  std::vector<env::FabricReport> ranks;  // in rank order
  std::vector<std::string> errors;       // ranks that did not report ("rank 1 (b): ...")
  double seconds = 0;
  bool passed() const;
};

/// Runs the test on every rank; an unreachable node or a rank that failed to run is in
/// errors, a rank whose test failed has failures in its report.
FabricPreflight run_fabric_preflight(const RingConfig& cfg, const PreflightRun& run);
/// One table per rank (nccl-tests style) and a verdict line.
std::string render_fabric_preflight(const FabricPreflight& f);
nlohmann::json fabric_preflight_to_json(const FabricPreflight& f);

}  // namespace spark::cli
