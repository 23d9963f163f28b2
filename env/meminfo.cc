#include "env/meminfo.h"

#include <fmt/format.h>

#include <sstream>

#include "core/strings.h"
#include "env/sysroot.h"

namespace spark::env {

Result<MemInfo> parse_meminfo(const std::string& text) {
  MemInfo m;
  std::istringstream in(text);
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string key = line.substr(0, colon);
    auto rest = split_list(trim(std::string_view(line).substr(colon + 1)), ' ');
    if (rest.empty()) continue;
    auto v = parse_u64(rest[0]);
    if (!v)
      return make_error(Errc::io,
                        fmt::format("meminfo line {}: '{}' is not a number", lineno, rest[0]));
    uint64_t mult = (rest.size() > 1 && rest[1] == "kB") ? 1024 : 1;
    m.fields[key] = *v * mult;
  }
  if (!m.fields.count("MemTotal")) return make_error(Errc::io, "meminfo has no MemTotal line");
  return m;
}

Result<MemInfo> read_meminfo(const std::string& root) {
  std::string path = (root == "/" ? std::string() : root) + "/proc/meminfo";
  auto text = read_file_bounded(path, kSysfsReadCap);
  if (!text) return make_error(Errc::io, fmt::format("cannot read {}", text.error().message));
  return parse_meminfo(*text);
}

}  // namespace spark::env
