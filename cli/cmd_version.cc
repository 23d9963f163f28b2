// sparkctl version
#include <nlohmann/json.hpp>
#include <ostream>

#include "cli/cli.h"
#include "spark/version.h"

namespace spark::cli {

int cmd_version(Context& ctx, const std::vector<std::string>& /*args*/) {
  if (ctx.opts.json) {
    *ctx.out << nlohmann::json{{"sparkctl", kVersion}}.dump(2) << "\n";
  } else {
    *ctx.out << "sparkctl " << kVersion << "\n";
  }
  return 0;
}

}  // namespace spark::cli
