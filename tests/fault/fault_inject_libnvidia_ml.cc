// FAULT INJECTION ONLY: a stand-in for libnvidia-ml.so.1 that answers like a given GPU, so
// env/nvml.h, the health history's GPU fields and preflight's gpu.throttle are tested on
// machines without one. FAULT_NVML_MODE (read on every call) picks what it answers:
//   h200             NVIDIA H200: every field, SM 1980 of 1980 MHz, 650 of 700 W
//   h200-throttled   the same with SM 1155 MHz and reasons hw_slowdown | hw_power_brake
//   gb10             NVIDIA GB10: memory info and memory clock not supported (unified
//                    memory), the enforced power limit not supported; SM 2418 of 2418 MHz
//   gb10-throttled   the same at SM 1100 MHz, 30 W, reasons sw_power_cap (the power-delivery
//                    cap)
//   gb10-slow        SM 1200 of 2418 MHz with no reason given (the hidden slow state)
//   lost             the device handle answers GPU_IS_LOST
//   init-fails       nvmlInit answers DRIVER_NOT_LOADED
// FAULT_NVML_GPUS: how many devices (default 1). The real library is exercised on the GPU
// machine (scripts/gpu-run.sh).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {
constexpr int kSuccess = 0, kInvalidArgument = 2, kNotSupported = 3, kDriverNotLoaded = 9,
              kGpuIsLost = 15;
std::string mode() {
  const char* m = std::getenv("FAULT_NVML_MODE");
  return m ? m : "h200";
}
bool gb10() {
  return mode().rfind("gb10", 0) == 0;
}
struct Memory {
  unsigned long long total, free, used;
};
}  // namespace

extern "C" {

int nvmlInit_v2() {
  return mode() == "init-fails" ? kDriverNotLoaded : kSuccess;
}
int nvmlShutdown() {
  return kSuccess;
}
const char* nvmlErrorString(int rc) {
  switch (rc) {
    case kNotSupported:
      return "Not Supported";
    case kDriverNotLoaded:
      return "Driver Not Loaded";
    case kGpuIsLost:
      return "GPU is lost";
    default:
      return "Unknown Error";
  }
}
int nvmlSystemGetDriverVersion(char* buf, unsigned n) {
  std::strncpy(buf, "580.95.05", n);
  return kSuccess;
}
int nvmlDeviceGetCount_v2(unsigned* n) {
  const char* g = std::getenv("FAULT_NVML_GPUS");
  *n = g ? static_cast<unsigned>(std::atoi(g)) : 1u;
  return kSuccess;
}
int nvmlDeviceGetHandleByIndex_v2(unsigned i, void** dev) {
  if (mode() == "lost") return kGpuIsLost;
  *dev = reinterpret_cast<void*>(static_cast<uintptr_t>(i + 1));
  return kSuccess;
}
int nvmlDeviceGetName(void*, char* buf, unsigned n) {
  std::strncpy(buf, gb10() ? "NVIDIA GB10" : "NVIDIA H200", n);
  return kSuccess;
}
int nvmlDeviceGetClockInfo(void*, unsigned type, unsigned* mhz) {
  std::string m = mode();
  if (type == 2) {  // memory clock
    if (gb10()) return kNotSupported;
    *mhz = 3201;
    return kSuccess;
  }
  if (type != 1) return kInvalidArgument;
  *mhz = m == "h200-throttled"   ? 1155
         : m == "gb10-throttled" ? 1100
         : m == "gb10-slow"      ? 1200
         : gb10()                ? 2418
                                 : 1980;
  return kSuccess;
}
int nvmlDeviceGetMaxClockInfo(void*, unsigned type, unsigned* mhz) {
  if (type == 2 && gb10()) return kNotSupported;
  *mhz = type == 2 ? 3201 : gb10() ? 2418 : 1980;
  return kSuccess;
}
int nvmlDeviceGetPowerUsage(void*, unsigned* mw) {
  std::string m = mode();
  *mw = m == "gb10-throttled" ? 30000 : gb10() ? 42000 : m == "h200-throttled" ? 320000 : 650000;
  return kSuccess;
}
int nvmlDeviceGetEnforcedPowerLimit(void*, unsigned* mw) {
  if (gb10()) return kNotSupported;
  *mw = 700000;
  return kSuccess;
}
int nvmlDeviceGetTemperature(void*, unsigned, unsigned* c) {
  *c = mode() == "h200-throttled" ? 88 : 55;
  return kSuccess;
}
int nvmlDeviceGetCurrentClocksEventReasons(void*, unsigned long long* r) {
  std::string m = mode();
  *r = m == "h200-throttled" ? (0x8ull | 0x80ull) : m == "gb10-throttled" ? 0x4ull : 0ull;
  return kSuccess;
}
int nvmlDeviceGetMemoryInfo(void*, Memory* mem) {
  if (gb10()) return kNotSupported;
  mem->total = 150ull << 30;
  mem->used = 100ull << 30;
  mem->free = mem->total - mem->used;
  return kSuccess;
}

}  // extern "C"
