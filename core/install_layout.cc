#include "core/install_layout.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include "core/strings.h"

namespace spark {

std::vector<std::string> sparkd_candidates(const std::string& self_exe) {
  namespace fs = std::filesystem;
  fs::path dir = fs::path(self_exe).parent_path();
  return {(dir.parent_path() / "sbin" / "sparkd").string(), (dir / "sparkd").string(),
          (dir.parent_path() / "daemon" / "sparkd").string()};
}

std::string locate_sparkd(const std::string& self_exe) {
  for (const auto& c : sparkd_candidates(self_exe)) {
    std::error_code ec;
    if (std::filesystem::is_regular_file(c, ec) && ::access(c.c_str(), X_OK) == 0) return c;
  }
  return "";
}

namespace {
bool executable(const std::string& p) {
  std::error_code ec;
  return std::filesystem::is_regular_file(p, ec) && ::access(p.c_str(), X_OK) == 0;
}
std::string on_path(const std::string& name, const std::string& path) {
  for (const auto& dir : split_list(path, ':'))
    if (!dir.empty() && executable(dir + "/" + name)) return dir + "/" + name;
  return "";
}
}  // namespace

std::string node_sparkd(const std::string& preferred, bool explicit_bin,
                        const std::string& self_exe, std::string* tried) {
  const char* env_path = std::getenv("PATH");
  std::string path = env_path ? env_path : "";
  std::vector<std::string> seen;
  auto try_one = [&](const std::string& c) {
    if (c.empty()) return std::string();
    seen.push_back(c);
    if (c.find('/') == std::string::npos) return on_path(c, path);
    return executable(c) ? c : std::string();
  };
  std::string found = try_one(preferred);
  if (found.empty() && !explicit_bin) {
    // cron's PATH and a non-root SSH session lack the sbin directories.
    std::vector<std::string> more = {locate_sparkd(self_exe), "/usr/sbin/sparkd",
                                     "/usr/local/sbin/sparkd"};
    for (const auto& c : more)
      if (found.empty()) found = try_one(c);
    if (found.empty()) {
      seen.push_back("sparkd on PATH");
      found = on_path("sparkd", path + ":/usr/local/sbin:/usr/sbin:/sbin");
    }
  }
  if (tried) *tried = join(seen, ", ");
  return found;
}

}  // namespace spark
