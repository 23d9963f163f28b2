#include "env/gpu_throttle.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <future>
#include <thread>

#include "core/process.h"
#include "core/strings.h"
#include "env/nvml.h"
#include "env/preflight.h"

namespace spark::env {

using nlohmann::json;

namespace {

struct Peak {
  int sm = -1, sm_max = -1, power = -1, limit = -1, temp = -1;
  uint64_t reasons = 0;
  bool reasons_known = false;
  int samples = 0;
  std::string name;
  std::map<std::string, std::string> na;
};

void take(Peak& p, const NvmlGpu& g) {
  p.name = g.name;
  p.sm = std::max(p.sm, g.sm_clock_mhz);
  p.sm_max = std::max(p.sm_max, g.sm_clock_max_mhz);
  p.power = std::max(p.power, g.power_mw);
  p.limit = std::max(p.limit, g.power_limit_mw);
  p.temp = std::max(p.temp, g.temp_c);
  if (g.throttle_reasons != ~uint64_t{0}) {
    p.reasons |= g.throttle_reasons & ~throttle::kGpuIdle;
    p.reasons_known = true;
  }
  p.na = g.na;
  ++p.samples;
}

std::string mhz(int v) {
  return v < 0 ? "n/a" : fmt::format("{} MHz", v);
}
std::string watts(int mw) {
  return mw < 0 ? "n/a" : fmt::format("{:.1f} W", mw / 1000.0);
}

}  // namespace

json measure_gpu_throttle(const ThrottleOptions& opt) {
  auto first = read_nvml(-1, opt.nvml_library);
  if (!first.loaded) return {{"skipped", "no GPU: " + first.reason}};
  if (first.gpus.empty()) return {{"skipped", "no GPU: NVML lists no device"}};
  std::vector<int> gpus = opt.gpus;
  if (gpus.empty())
    for (const auto& g : first.gpus) gpus.push_back(g.index);
  std::map<int, Peak> peak;
  std::map<int, std::future<Result<ProcessResult>>> loads;
  for (int g : gpus) {
    peak[g];
    if (opt.load_argv.empty()) continue;
    ProcessSpec ps;
    ps.argv = opt.load_argv;
    ps.argv.insert(ps.argv.end(),
                   {"--gpu", std::to_string(g), "--ms", std::to_string(opt.load_ms)});
    ps.timeout = std::chrono::milliseconds(opt.load_ms + 60000);  // CUDA start-up included
    loads[g] = std::async(std::launch::async, [ps] { return run_process(ps); });
  }
  // Sample while any load runs (at least once without loads).
  auto sample = [&] {
    auto r = read_nvml(-1, opt.nvml_library);
    for (const auto& g : r.gpus)
      if (peak.count(g.index)) take(peak[g.index], g);
  };
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(opt.load_ms + 60000);
  do {
    sample();
    bool running = false;
    for (auto& [g, f] : loads)
      running = running || f.wait_for(std::chrono::milliseconds(0)) != std::future_status::ready;
    if (!running) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  } while (std::chrono::steady_clock::now() < deadline);
  json out = json::array();
  for (int g : gpus) {
    const Peak& p = peak[g];
    json e{{"index", g},
           {"name", p.name},
           {"sm_clock_max_mhz", p.sm_max},
           {"sm_clock_peak_mhz", p.sm},
           {"power_peak_mw", p.power},
           {"power_limit_mw", p.limit},
           {"temp_max_c", p.temp},
           {"reasons", p.reasons_known ? json(p.reasons) : json(nullptr)},
           {"samples", p.samples},
           {"na", p.na}};
    if (p.samples == 0) e["load_error"] = fmt::format("NVML has no GPU {}", g);
    if (loads.count(g)) {
      auto r = loads[g].get();
      if (!r)
        e["load_error"] = r.error().message;
      else if (!r->success())
        e["load_error"] = fmt::format("the load exited {}: {}", r->exit_status,
                                      std::string(trim(r->out + " " + r->err)).substr(0, 300));
      else
        e["load"] = std::string(trim(r->out)).substr(0, 300);
    } else {
      e["load_error"] = "not loaded here: NVML's view as the GPU runs now";
    }
    out.push_back(e);
  }
  return {{"gpus", out}, {"load_ms", opt.load_ms}};
}

namespace {
std::vector<CheckResult> throttle_rows(const std::string& node, const json& fact) {
  std::vector<CheckResult> rows;
  const char* kId = "gpu.throttle";
  // A capture made before the check existed has no fact: no row (not a finding).
  if (fact.is_null() || !fact.is_object()) return rows;
  if (fact.contains("skipped")) {
    rows.push_back({node, kId, "", Verdict::skip, fact.value("skipped", ""), ""});
    return rows;
  }
  for (const auto& g : fact.value("gpus", json::array())) {
    if (!g.is_object()) continue;
    int idx = g.value("index", 0);
    std::string subject = fmt::format("gpu{}", idx);
    std::string name = g.value("name", "");
    bool gb10 = name.find("GB10") != std::string::npos;
    int sm = g.value("sm_clock_peak_mhz", -1), sm_max = g.value("sm_clock_max_mhz", -1);
    int power = g.value("power_peak_mw", -1), limit = g.value("power_limit_mw", -1);
    uint64_t reasons = g["reasons"].is_number() ? g["reasons"].get<uint64_t>() : 0;
    uint64_t slow = reasons & throttle::kSlowdown;
    // The driver raises the software power cap while it manages boost, also when the SM
    // clock holds its maximum (an H200 under a GEMM load: 1980 of 1980 MHz at 457 of 700 W):
    // that is no slowdown. Named only; a hardware reason or a lower clock still warns.
    std::string held_note;
    if (slow && (slow & ~throttle::kSwPowerCap) == 0 && sm >= 0 && sm_max > 0 &&
        sm * 100 >= sm_max * 95) {
      held_note = fmt::format("; NVML flagged {}, but the SM clock held", throttle_names(slow));
      slow = 0;
    }
    bool loaded = !g.contains("load_error");
    std::string figures =
        fmt::format("SM {} of {}, power {} (limit {}), {} C", mhz(sm), mhz(sm_max), watts(power),
                    watts(limit), g.value("temp_max_c", -1));
    std::vector<std::string> na;
    json na_obj = g.value("na", json::object());
    for (auto it = na_obj.begin(); it != na_obj.end(); ++it)
      na.push_back(it.key() + " " + it.value().get<std::string>());
    std::string na_text = na.empty() ? "" : "; NVML n/a: " + join(na, ", ");
    std::string fix =
        gb10 ? "check the power supply (the adapter that came with the unit, its cable and "
               "outlet: the GB10's power-delivery cap shows only here), then lock the clocks "
               "with `sudo nvidia-smi -lgc 0,2000` (known to clear the hidden slow state); "
               "reboot if it stays"
             : "check the power supply and cooling (fans, airflow, inlet temperature), lift a "
               "clock cap with `sudo nvidia-smi -rgc` or set one that holds with `sudo "
               "nvidia-smi -lgc 0,MAX`, and check `nvidia-smi -q -d PERFORMANCE`";
    std::string who = fmt::format("GPU {}{}", idx, name.empty() ? "" : " (" + name + ")");
    if (slow) {
      rows.push_back({node, kId, subject, Verdict::warn,
                      fmt::format("{} throttled{}: {}; {}{}", who, loaded ? " under load" : "",
                                  throttle_names(slow), figures, na_text),
                      fix});
    } else if (!loaded) {
      rows.push_back({node, kId, subject, Verdict::skip,
                      fmt::format("{}: no load could run ({}); idle: {}{}", who,
                                  g.value("load_error", ""), figures, na_text),
                      ""});
    } else if (sm >= 0 && sm_max > 0 && sm * 100 < sm_max * 85) {
      rows.push_back({node, kId, subject, Verdict::warn,
                      fmt::format("{} reached only {} of {} under load (no reason given: a "
                                  "hidden slow state or a clock cap); {}{}",
                                  who, mhz(sm), mhz(sm_max), figures, na_text),
                      fix});
    } else {
      rows.push_back({node, kId, subject, Verdict::pass,
                      fmt::format("{} under load: {}{}{}", who, figures, held_note, na_text), ""});
    }
  }
  return rows;
}

}  // namespace

std::vector<CheckResult> throttle_checks(const std::string& node, const json& fact) {
  // A capture is input like any other: a mistyped fact is a finding, not a crash.
  try {
    return throttle_rows(node, fact);
  } catch (const json::exception& e) {
    return {{node, "gpu.throttle", "", Verdict::warn,
             fmt::format("the gpu_throttle fact is unreadable: {}", e.what()),
             "capture the node again with `sparkctl capture-node`"}};
  }
}

}  // namespace spark::env
