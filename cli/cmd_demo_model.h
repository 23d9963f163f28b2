#pragma once
// sparkctl demo-model DIR: writes the embedded demo checkpoint (random weights).
#include <string>
#include <vector>

#include "cli/cli.h"

namespace spark::cli {

int cmd_demo_model(Context& ctx, const std::vector<std::string>& args);

}  // namespace spark::cli
