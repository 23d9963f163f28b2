#pragma once
// sparkctl bench: the benchmark and correctness gates (cli/bench.h), and bench compare.
#include <string>
#include <vector>

#include "cli/cli.h"

namespace spark::cli {

/// `bench [OPTIONS]` and `bench compare RESULT...`; see sparkctl-bench(1).
int cmd_bench(Context& ctx, const std::vector<std::string>& args);

}  // namespace spark::cli
