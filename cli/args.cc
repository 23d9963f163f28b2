#include "cli/args.h"

#include <fmt/format.h>

#include <ostream>

namespace spark::cli {

std::optional<int> parse_args(Context& ctx, const char* name, const char* synopsis,
                              po::options_description& desc, const std::vector<std::string>& args,
                              po::variables_map& vm,
                              const po::positional_options_description* positional) {
  desc.add_options()("help,h", "show this help");
  try {
    po::command_line_parser p(args);
    p.options(desc);
    if (positional) p.positional(*positional);
    po::store(p.run(), vm);
    if (vm.count("help")) {
      *ctx.out << "usage: sparkctl " << synopsis << "\n\n" << desc << "\n";
      return 0;
    }
    po::notify(vm);
  } catch (const po::error& e) {
    return ctx.fail(make_error(Errc::usage, fmt::format("{}: {} (see sparkctl {} --help)", name,
                                                        e.what(), name)));
  }
  return std::nullopt;
}

}  // namespace spark::cli
