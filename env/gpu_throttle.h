#pragma once
// The measurement behind preflight's gpu.throttle: NVML (env/nvml.h) sampled every 100 ms
// while each GPU runs a short compute load (`sparkd gpu-load`, a process of its own so that
// sparkctl never links CUDA), then judged: SM clock reached against the device's maximum,
// power against its limit, and the clocks-event reasons seen under load. The measurement is
// a node fact (facts.json "gpu_throttle"), so a captured node replays the verdict.
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace spark::env {

struct CheckResult;

/// How to measure.
struct ThrottleOptions {
  std::vector<int> gpus;  // NVML indices (the node's GPUS); empty: every GPU
  int load_ms = 3000;
  /// The load command; "--gpu N --ms M" is appended. Empty: measure without a load.
  std::vector<std::string> load_argv;
  std::string nvml_library = "libnvidia-ml.so.1";
};

/// Runs the loads (all GPUs at once) and samples NVML; the fact as JSON:
/// {"skipped": why} or {"gpus": [{index, name, sm_clock_max_mhz, sm_clock_peak_mhz,
/// power_peak_mw, power_limit_mw, temp_max_c, reasons (OR under load), samples, load,
/// load_error, na}]}.
nlohmann::json measure_gpu_throttle(const ThrottleOptions& opt);

/// The gpu.throttle rows for node `node` from that fact (null: not measured, no rows).
std::vector<CheckResult> throttle_checks(const std::string& node, const nlohmann::json& fact);

}  // namespace spark::env
