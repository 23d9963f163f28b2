#pragma once
// NVML (libnvidia-ml.so.1), opened at run time with dlopen so that the binaries start on
// machines without the driver: per GPU, SM and memory clocks (current and maximum), power
// draw and its enforced limit, temperature, the clocks-event (throttle) reasons and memory
// use. Each query is on its own: a field the device answers N/A or "not supported" for
// (GB10 does for several: memory info on unified memory, power limits, some clocks) stays
// unknown (-1) and its reason is kept, and the other fields still come.
#include <cstdint>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

namespace spark::env {

/// NVML clocks-event reason bits (nvmlClocksEventReason*, formerly ...ThrottleReason*).
namespace throttle {
inline constexpr uint64_t kGpuIdle = 0x1;
inline constexpr uint64_t kApplicationsClocks = 0x2;
inline constexpr uint64_t kSwPowerCap = 0x4;
inline constexpr uint64_t kHwSlowdown = 0x8;
inline constexpr uint64_t kSyncBoost = 0x10;
inline constexpr uint64_t kSwThermal = 0x20;
inline constexpr uint64_t kHwThermal = 0x40;
inline constexpr uint64_t kHwPowerBrake = 0x80;
inline constexpr uint64_t kDisplayClocks = 0x100;
/// The reasons that mean the GPU runs slower than it could under load (not idle, not a
/// clock the operator set, not sync boost).
inline constexpr uint64_t kSlowdown =
    kSwPowerCap | kHwSlowdown | kSwThermal | kHwThermal | kHwPowerBrake;
}  // namespace throttle

/// "sw_power_cap,hw_slowdown" for a reason mask; "none" for 0.
std::string throttle_names(uint64_t reasons);

/// One GPU as NVML sees it now. -1: unknown; `na` says why for each unknown field.
struct NvmlGpu {
  int index = 0;
  std::string name, pci_bus_id;
  int sm_clock_mhz = -1, sm_clock_max_mhz = -1, mem_clock_mhz = -1;
  int power_mw = -1, power_limit_mw = -1, temp_c = -1;
  uint64_t throttle_reasons = ~uint64_t{0};  // ~0: unknown
  int64_t mem_used = -1, mem_total = -1;     // bytes
  std::map<std::string, std::string> na;     // field -> "not supported" / NVML's error text
};

/// What NVML gave.
struct NvmlReport {
  bool loaded = false;  // the library opened and nvmlInit succeeded
  std::string library;  // what was opened
  std::string reason;   // why not loaded
  std::string driver_version;
  std::vector<NvmlGpu> gpus;
};

/// Reads every GPU (or only `index` when >= 0). `library` is a seam for the
/// fault-injection library. Thread-safe; NVML stays initialised for the process.
NvmlReport read_nvml(int index = -1, const std::string& library = "libnvidia-ml.so.1");

nlohmann::json to_json(const NvmlGpu& g);
nlohmann::json to_json(const NvmlReport& r);

}  // namespace spark::env
