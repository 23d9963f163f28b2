#pragma once
// Per-command argument parsing on Boost.Program_options: every command gets --help and a
// usage error that names the command.
#include <boost/program_options.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cli/cli.h"

namespace spark::cli {

namespace po = boost::program_options;

/// Parses `args` for command `name`. Returns an exit code when the command must stop
/// (--help printed: 0; bad usage: usage error printed), nullopt to go on.
std::optional<int> parse_args(Context& ctx, const char* name, const char* synopsis,
                              po::options_description& desc, const std::vector<std::string>& args,
                              po::variables_map& vm,
                              const po::positional_options_description* positional = nullptr);

}  // namespace spark::cli
