// NVML through dlopen (env/nvml.h) and preflight's gpu.throttle (env/gpu_throttle.h), with
// the fault-injection libnvidia-ml (tests/fault/fault_inject_libnvidia_ml.cc) answering like
// an H200, like a GB10 (several fields not supported) and throttling; the load is a stand-in
// process here (the real one, `sparkd gpu-load`, needs a GPU: scripts/gpu-run.sh).
#include "env/gpu_throttle.h"

#include <doctest/doctest.h>
#include <stdlib.h>

#include <filesystem>

#include "env/nvml.h"
#include "env/preflight.h"

using namespace spark;
using namespace spark::env;

namespace {
// Where CMake built it, else next to this test binary (the staged copy on the GPU machine).
std::string fault_lib() {
  std::string built = SPARK_BINARY_DIR "/tests/libfault_inject_libnvidia_ml.so";
  if (std::filesystem::exists(built)) return built;
  return (std::filesystem::read_symlink("/proc/self/exe").parent_path() /
          "libfault_inject_libnvidia_ml.so")
      .string();
}
const std::string kLib = fault_lib();

// The fake's answers are chosen per call: FAULT_NVML_MODE.
struct Mode {
  explicit Mode(const char* m) { ::setenv("FAULT_NVML_MODE", m, 1); }
  ~Mode() { ::unsetenv("FAULT_NVML_MODE"); }
};

ThrottleOptions with_load() {
  ThrottleOptions o;
  o.nvml_library = kLib;
  o.load_ms = 300;
  // A stand-in load that runs for a while and reports like sparkd gpu-load.
  o.load_argv = {"/bin/sh", "-c", "sleep 0.4; echo '{\"iterations\": 8}'", "load"};
  return o;
}

CheckResult only_row(const nlohmann::json& fact) {
  auto rows = throttle_checks("spark-a", fact);
  REQUIRE(rows.size() == 1);
  CHECK(rows[0].id == "gpu.throttle");
  return rows[0];
}
}  // namespace

TEST_CASE("nvml: every field of an H200; GB10's unsupported fields stay unknown with a reason") {
  {
    Mode m("h200");
    auto r = read_nvml(-1, kLib);
    REQUIRE(r.loaded);
    CHECK(r.driver_version == "580.95.05");
    REQUIRE(r.gpus.size() == 1);
    const auto& g = r.gpus[0];
    CHECK(g.name == "NVIDIA H200");
    CHECK(g.sm_clock_mhz == 1980);
    CHECK(g.mem_clock_mhz == 3201);
    CHECK(g.power_mw == 650000);
    CHECK(g.power_limit_mw == 700000);
    CHECK(g.mem_total == int64_t{150} << 30);
    CHECK(g.throttle_reasons == 0);
    CHECK(g.na.empty());
  }
  {
    Mode m("gb10");
    auto r = read_nvml(0, kLib);
    REQUIRE(r.gpus.size() == 1);
    const auto& g = r.gpus[0];
    CHECK(g.name == "NVIDIA GB10");
    CHECK(g.sm_clock_mhz == 2418);
    CHECK(g.power_mw == 42000);
    CHECK(g.mem_clock_mhz == -1);
    CHECK(g.mem_total == -1);
    CHECK(g.power_limit_mw == -1);
    CHECK(g.na.at("memory") == "not supported");
    CHECK(g.na.at("mem_clock") == "not supported");
    CHECK(g.na.at("power_limit") == "not supported");
    CHECK(g.na.count("sm_clock") == 0);
  }
  {
    Mode m("lost");
    auto r = read_nvml(-1, kLib);
    REQUIRE(r.gpus.size() == 1);
    CHECK(r.gpus[0].na.at("device").find("GPU is lost") != std::string::npos);
  }
  auto none = read_nvml(-1, "libnvidia-ml-absent.so.1");
  CHECK_FALSE(none.loaded);
  CHECK(none.reason.find("NVML not available") != std::string::npos);
  CHECK(throttle_names(0x4 | 0x80) == "sw_power_cap,hw_power_brake");
  CHECK(throttle_names(0) == "none");
}

TEST_CASE(
    "gpu.throttle: H200 and GB10 at full clock pass; throttled and slow ones warn with the fix") {
  {
    Mode m("h200");
    auto row = only_row(measure_gpu_throttle(with_load()));
    CHECK(row.verdict == Verdict::pass);
    CHECK(row.message.find("SM 1980 MHz of 1980 MHz, power 650.0 W (limit 700.0 W)") !=
          std::string::npos);
  }
  {
    Mode m("gb10");
    auto row = only_row(measure_gpu_throttle(with_load()));
    CHECK(row.verdict == Verdict::pass);
    CHECK(row.message.find("limit n/a") != std::string::npos);
    CHECK(row.message.find("NVML n/a: ") != std::string::npos);
  }
  {
    Mode m("gb10-throttled");
    auto fact = measure_gpu_throttle(with_load());
    auto row = only_row(fact);
    CHECK(row.verdict == Verdict::warn);
    CHECK(row.message.find("throttled under load: sw_power_cap") != std::string::npos);
    CHECK(row.message.find("SM 1100 MHz of 2418 MHz, power 30.0 W") != std::string::npos);
    CHECK(row.fix.find("nvidia-smi -lgc 0,2000") != std::string::npos);
    CHECK(row.fix.find("power supply") != std::string::npos);
    // The fact replays: a captured node gives the same row.
    auto again = only_row(nlohmann::json::parse(fact.dump()));
    CHECK(again.message == row.message);
  }
  {
    Mode m("h200-throttled");
    auto row = only_row(measure_gpu_throttle(with_load()));
    CHECK(row.verdict == Verdict::warn);
    CHECK(row.message.find("hw_slowdown,hw_power_brake") != std::string::npos);
    CHECK(row.fix.find("cooling") != std::string::npos);
  }
  {
    Mode m("gb10-slow");  // no reason given: the clock against the maximum says it
    auto row = only_row(measure_gpu_throttle(with_load()));
    CHECK(row.verdict == Verdict::warn);
    CHECK(row.message.find("reached only 1200 MHz of 2418 MHz") != std::string::npos);
  }
  {
    Mode m("h200");
    auto o = with_load();
    o.load_argv = {"/bin/sh", "-c", "echo 'this sparkd was built without CUDA'; exit 12", "load"};
    auto row = only_row(measure_gpu_throttle(o));
    CHECK(row.verdict == Verdict::skip);
    CHECK(row.message.find("no load could run (the load exited 12: this sparkd was built "
                           "without CUDA") != std::string::npos);
  }
  {
    ThrottleOptions o;
    o.nvml_library = "libnvidia-ml-absent.so.1";
    auto row = only_row(measure_gpu_throttle(o));
    CHECK(row.verdict == Verdict::skip);
    CHECK(row.message.find("no GPU: NVML not available") != std::string::npos);
  }
  {
    // An H200 as measured under a GEMM load: the software power cap flagged while the SM
    // clock held its maximum is not a slowdown; the same flag with a lower clock is.
    auto fact = nlohmann::json::parse(R"({"gpus": [{"index": 0, "name": "NVIDIA H200",
        "sm_clock_peak_mhz": 1980, "sm_clock_max_mhz": 1980, "power_peak_mw": 457400,
        "power_limit_mw": 700000, "temp_max_c": 50, "reasons": 4, "load": "ok"}]})");
    auto held = only_row(fact);
    CHECK(held.verdict == Verdict::pass);
    CHECK(held.message.find("NVML flagged sw_power_cap, but the SM clock held") !=
          std::string::npos);
    fact["gpus"][0]["sm_clock_peak_mhz"] = 1500;
    auto slowed = only_row(fact);
    CHECK(slowed.verdict == Verdict::warn);
    CHECK(slowed.message.find("throttled under load: sw_power_cap") != std::string::npos);
    fact["gpus"][0]["sm_clock_peak_mhz"] = 1980;
    fact["gpus"][0]["reasons"] = 4 | 8;  // with a hardware slowdown: warns at any clock
    CHECK(only_row(fact).verdict == Verdict::warn);
  }
  CHECK(throttle_checks("spark-a", nullptr).empty());  // a capture from before the check
  auto junk = throttle_checks("spark-a", nlohmann::json::parse(R"({"gpus": [3, {"index": "x"}]})"));
  REQUIRE(junk.size() == 1);
  CHECK(junk[0].message.find("the gpu_throttle fact is unreadable") != std::string::npos);
}
