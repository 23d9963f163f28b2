#include "env/nccl_env.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <vector>

#include "core/strings.h"

extern char** environ;

namespace spark::env {

std::string nccl_environment_summary() {
  std::vector<std::string> v;
  for (char** e = environ; e && *e; ++e)
    if (std::string_view(*e).rfind("NCCL_", 0) == 0) v.emplace_back(*e);
  std::sort(v.begin(), v.end());
  return join(v, " ");
}

AppliedNcclEnv apply_nccl_debug_env(const std::string& log_dir, int rank) {
  AppliedNcclEnv a;
  if (!std::getenv("NCCL_NVLS_ENABLE")) setenv("NCCL_NVLS_ENABLE", "0", 1);
  if (!std::getenv("NCCL_DEBUG")) {
    setenv("NCCL_DEBUG", "INFO", 1);
    if (!std::getenv("NCCL_DEBUG_SUBSYS")) setenv("NCCL_DEBUG_SUBSYS", "INIT,NET", 1);
  }
  if (const char* f = std::getenv("NCCL_DEBUG_FILE"); f && *f) {
    // NCCL expands %h and %p; the file of this process is then only known by that rule.
    std::string s = f;
    if (s.find('%') == std::string::npos) a.debug_file = s;
  } else {
    a.debug_file = fmt::format("{}/nccl.rank{}.log", log_dir.empty() ? "." : log_dir, rank);
    setenv("NCCL_DEBUG_FILE", a.debug_file.c_str(), 1);
  }
  if (!a.debug_file.empty()) std::ofstream(a.debug_file, std::ios::trunc);  // this run only
  a.summary = nccl_environment_summary();
  return a;
}

Result<double> fabric_min_busbw(const RingConfig& cfg) {
  const std::string v = cfg.get("FABRIC_MIN_BUSBW");
  if (v.empty()) return 0.0;
  char* end = nullptr;
  double d = std::strtod(v.c_str(), &end);
  if (end == v.c_str() || *end != '\0' || !(d >= 0))
    return make_error(Errc::config,
                      fmt::format("FABRIC_MIN_BUSBW={} is not a bus bandwidth in GB/s (a number "
                                  ">= 0, e.g. 20)",
                                  v));
  return d;
}

}  // namespace spark::env
