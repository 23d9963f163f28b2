#include "core/install_layout.h"

#include <unistd.h>

#include <filesystem>

#include "core/process.h"

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

std::string sparkd_shell_lookup(const std::string& preferred, bool explicit_bin) {
  std::string q = shell_quote(preferred);
  if (explicit_bin)
    return "B=" + q +
           "; [ -x \"$B\" ] || command -v \"$B\" >/dev/null 2>&1 || { echo \"@@fatal x " +
           "SPARKD_BIN $B is not an executable on this node (install sparkd there or fix " +
           "SPARKD_BIN in the cluster file)\"; exit 1; }\n";
  // The head's choice first (the same install on every node), then this node's own.
  return "B=" + q +
         "; if [ ! -x \"$B\" ]; then B=; for c in /usr/sbin/sparkd /usr/local/sbin/sparkd; do "
         "[ -x \"$c\" ] && { B=$c; break; }; done; [ -n \"$B\" ] || B=$(PATH=\"$PATH:/usr/local/"
         "sbin:/usr/sbin:/sbin\" command -v sparkd 2>/dev/null) || B=; fi; [ -n \"$B\" ] || { echo "
         "\"@@fatal x sparkd not found on this node (tried " +
         q +
         ", /usr/sbin/sparkd, /usr/local/sbin/sparkd, PATH): install the sparkctl package there "
         "or set SPARKD_BIN in the cluster file\"; exit 1; }\n";
}

}  // namespace spark
