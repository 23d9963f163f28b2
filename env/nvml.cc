#include "env/nvml.h"

#include <dlfcn.h>
#include <fmt/format.h>

#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>

namespace spark::env {

namespace {

// NVML's ABI, declared here (no NVML headers are needed to build).
using nvmlReturn_t = int;
using nvmlDevice_t = void*;
constexpr nvmlReturn_t kSuccess = 0;
constexpr nvmlReturn_t kNotSupported = 3;
constexpr nvmlReturn_t kNoPermission = 4;
constexpr nvmlReturn_t kGpuIsLost = 15;
constexpr unsigned kClockSm = 1, kClockMem = 2;
constexpr unsigned kTempGpu = 0;
struct nvmlMemory_t {
  unsigned long long total, free, used;
};

struct Api {
  void* lib = nullptr;
  std::string path, reason;
  bool initialized = false;
  nvmlReturn_t (*init)() = nullptr;
  const char* (*error_string)(nvmlReturn_t) = nullptr;
  nvmlReturn_t (*count)(unsigned*) = nullptr;
  nvmlReturn_t (*handle)(unsigned, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*name)(nvmlDevice_t, char*, unsigned) = nullptr;
  nvmlReturn_t (*clock)(nvmlDevice_t, unsigned, unsigned*) = nullptr;
  nvmlReturn_t (*max_clock)(nvmlDevice_t, unsigned, unsigned*) = nullptr;
  nvmlReturn_t (*power)(nvmlDevice_t, unsigned*) = nullptr;
  nvmlReturn_t (*power_limit)(nvmlDevice_t, unsigned*) = nullptr;
  nvmlReturn_t (*temp)(nvmlDevice_t, unsigned, unsigned*) = nullptr;
  nvmlReturn_t (*reasons)(nvmlDevice_t, unsigned long long*) = nullptr;
  nvmlReturn_t (*memory)(nvmlDevice_t, nvmlMemory_t*) = nullptr;
  nvmlReturn_t (*driver)(char*, unsigned) = nullptr;
};

template <class F>
void sym(void* lib, F* f, const char* a, const char* b = nullptr) {
  void* p = ::dlsym(lib, a);
  if (!p && b) p = ::dlsym(lib, b);
  *f = reinterpret_cast<F>(p);
}

std::mutex g_mu;
std::map<std::string, Api> g_apis;

Api& api_for(const std::string& library) {
  auto it = g_apis.find(library);
  if (it != g_apis.end()) return it->second;
  Api& a = g_apis[library];
  a.lib = ::dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!a.lib) {
    const char* e = ::dlerror();
    a.reason = fmt::format(
        "NVML not available ({}): no GPU driver on this node, or a "
        "container without the driver's libraries",
        e ? std::string(e) : library + ": dlopen failed");
    return a;
  }
  a.path = library;
  sym(a.lib, &a.init, "nvmlInit_v2", "nvmlInit");
  sym(a.lib, &a.error_string, "nvmlErrorString");
  sym(a.lib, &a.count, "nvmlDeviceGetCount_v2", "nvmlDeviceGetCount");
  sym(a.lib, &a.handle, "nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetHandleByIndex");
  sym(a.lib, &a.name, "nvmlDeviceGetName");
  sym(a.lib, &a.clock, "nvmlDeviceGetClockInfo");
  sym(a.lib, &a.max_clock, "nvmlDeviceGetMaxClockInfo");
  sym(a.lib, &a.power, "nvmlDeviceGetPowerUsage");
  sym(a.lib, &a.power_limit, "nvmlDeviceGetEnforcedPowerLimit");
  sym(a.lib, &a.temp, "nvmlDeviceGetTemperature");
  sym(a.lib, &a.reasons, "nvmlDeviceGetCurrentClocksEventReasons",
      "nvmlDeviceGetCurrentClocksThrottleReasons");
  sym(a.lib, &a.memory, "nvmlDeviceGetMemoryInfo");
  sym(a.lib, &a.driver, "nvmlSystemGetDriverVersion");
  if (!a.init || !a.count || !a.handle) {
    a.reason = library + " lacks nvmlInit/nvmlDeviceGetCount/nvmlDeviceGetHandleByIndex";
    return a;
  }
  nvmlReturn_t rc = a.init();
  if (rc != kSuccess) {
    a.reason =
        fmt::format("nvmlInit failed: {} ({})", a.error_string ? a.error_string(rc) : "?", rc);
    return a;
  }
  a.initialized = true;
  return a;
}

std::string why(const Api& a, nvmlReturn_t rc) {
  if (rc == kNotSupported) return "not supported";
  if (rc == kNoPermission) return "no permission";
  if (rc == kGpuIsLost) return "GPU is lost (fell off the bus: reboot the node)";
  return fmt::format("{} ({})", a.error_string ? a.error_string(rc) : "error", rc);
}

}  // namespace

std::string throttle_names(uint64_t r) {
  if (r == ~uint64_t{0}) return "unknown";
  if (r == 0) return "none";
  static const std::pair<uint64_t, const char*> kNames[] = {
      {throttle::kGpuIdle, "gpu_idle"},
      {throttle::kApplicationsClocks, "applications_clocks"},
      {throttle::kSwPowerCap, "sw_power_cap"},
      {throttle::kHwSlowdown, "hw_slowdown"},
      {throttle::kSyncBoost, "sync_boost"},
      {throttle::kSwThermal, "sw_thermal"},
      {throttle::kHwThermal, "hw_thermal"},
      {throttle::kHwPowerBrake, "hw_power_brake"},
      {throttle::kDisplayClocks, "display_clocks"}};
  std::string s;
  uint64_t known = 0;
  for (const auto& [bit, name] : kNames) {
    known |= bit;
    if (r & bit) s += (s.empty() ? "" : ",") + std::string(name);
  }
  if (r & ~known) s += (s.empty() ? "" : ",") + fmt::format("0x{:x}", r & ~known);
  return s;
}

NvmlReport read_nvml(int index, const std::string& library) {
  std::lock_guard lk(g_mu);
  NvmlReport rep;
  Api& a = api_for(library);
  rep.library = library;
  if (!a.initialized) {
    rep.reason = a.reason;
    return rep;
  }
  rep.loaded = true;
  char buf[96] = {};
  if (a.driver && a.driver(buf, sizeof buf - 1) == kSuccess) rep.driver_version = buf;
  unsigned n = 0;
  if (nvmlReturn_t rc = a.count(&n); rc != kSuccess) {
    rep.reason = "nvmlDeviceGetCount: " + why(a, rc);
    return rep;
  }
  for (unsigned i = 0; i < n; ++i) {
    if (index >= 0 && static_cast<unsigned>(index) != i) continue;
    NvmlGpu g;
    g.index = static_cast<int>(i);
    nvmlDevice_t d = nullptr;
    if (nvmlReturn_t rc = a.handle(i, &d); rc != kSuccess) {
      g.na["device"] = why(a, rc);
      rep.gpus.push_back(std::move(g));
      continue;
    }
    // Each field on its own: N/A for one says nothing about the others.
    auto u = [&](const char* field, bool have, const std::function<nvmlReturn_t(unsigned*)>& fn,
                 int* out) {
      if (!have) {
        g.na[field] = "not in this NVML";
        return;
      }
      unsigned v = 0;
      nvmlReturn_t rc = fn(&v);
      if (rc == kSuccess)
        *out = static_cast<int>(v);
      else
        g.na[field] = why(a, rc);
    };
    char nm[96] = {};
    if (a.name && a.name(d, nm, sizeof nm - 1) == kSuccess) g.name = nm;
    u(
        "sm_clock", a.clock != nullptr, [&](unsigned* v) { return a.clock(d, kClockSm, v); },
        &g.sm_clock_mhz);
    u(
        "sm_clock_max", a.max_clock != nullptr,
        [&](unsigned* v) { return a.max_clock(d, kClockSm, v); }, &g.sm_clock_max_mhz);
    u(
        "mem_clock", a.clock != nullptr, [&](unsigned* v) { return a.clock(d, kClockMem, v); },
        &g.mem_clock_mhz);
    u(
        "power", a.power != nullptr, [&](unsigned* v) { return a.power(d, v); }, &g.power_mw);
    u(
        "power_limit", a.power_limit != nullptr, [&](unsigned* v) { return a.power_limit(d, v); },
        &g.power_limit_mw);
    u(
        "temperature", a.temp != nullptr, [&](unsigned* v) { return a.temp(d, kTempGpu, v); },
        &g.temp_c);
    if (a.reasons) {
      unsigned long long r = 0;
      if (nvmlReturn_t rc = a.reasons(d, &r); rc == kSuccess)
        g.throttle_reasons = r;
      else
        g.na["throttle_reasons"] = why(a, rc);
    } else {
      g.na["throttle_reasons"] = "not in this NVML";
    }
    if (a.memory) {
      nvmlMemory_t m{};
      if (nvmlReturn_t rc = a.memory(d, &m); rc == kSuccess) {
        g.mem_used = static_cast<int64_t>(m.used);
        g.mem_total = static_cast<int64_t>(m.total);
      } else {
        g.na["memory"] = why(a, rc);
      }
    }
    rep.gpus.push_back(std::move(g));
  }
  return rep;
}

nlohmann::json to_json(const NvmlGpu& g) {
  auto v = [](int64_t x) { return x < 0 ? nlohmann::json(nullptr) : nlohmann::json(x); };
  return {
      {"index", g.index},
      {"name", g.name},
      {"sm_clock_mhz", v(g.sm_clock_mhz)},
      {"sm_clock_max_mhz", v(g.sm_clock_max_mhz)},
      {"mem_clock_mhz", v(g.mem_clock_mhz)},
      {"power_mw", v(g.power_mw)},
      {"power_limit_mw", v(g.power_limit_mw)},
      {"temp_c", v(g.temp_c)},
      {"throttle_reasons", g.throttle_reasons == ~uint64_t{0} ? nlohmann::json(nullptr)
                                                              : nlohmann::json(g.throttle_reasons)},
      {"throttle", throttle_names(g.throttle_reasons)},
      {"mem_used", v(g.mem_used)},
      {"mem_total", v(g.mem_total)},
      {"na", g.na}};
}

nlohmann::json to_json(const NvmlReport& r) {
  nlohmann::json g = nlohmann::json::array();
  for (const auto& x : r.gpus) g.push_back(to_json(x));
  return {{"loaded", r.loaded},
          {"library", r.library},
          {"reason", r.reason},
          {"driver_version", r.driver_version},
          {"gpus", g}};
}

}  // namespace spark::env
