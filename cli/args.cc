#include "cli/args.h"

#include <fmt/format.h>

#include <algorithm>
#include <ostream>

namespace spark::cli {

namespace {

// Boost's own listing shows its internals ("-h [ --help ]", "arg (=show)"); this one reads
// like a man page: "-h, --help", "--rank N (default 0)".
void print_options(std::ostream& out, const po::options_description& desc) {
  struct Row {
    std::string left, text;
  };
  std::vector<Row> rows;
  size_t width = 0;
  for (const auto& o : desc.options()) {
    std::string shortn = o->canonical_display_name(po::command_line_style::allow_dash_for_short);
    std::string longn = o->canonical_display_name(po::command_line_style::allow_long);
    std::string left = shortn != longn && shortn.size() == 2 ? shortn + ", " + longn : longn;
    std::string text = o->description();
    auto sem = o->semantic();
    if (sem && sem->max_tokens() > 0) {
      left += " " + (sem->is_composing() || sem->max_tokens() > 1 ? std::string("VALUE...")
                                                                  : std::string("VALUE"));
      // format_parameter() is "arg (=X)" when there is a default: keep X only.
      std::string f = o->format_parameter();
      auto at = f.find("(=");
      if (at != std::string::npos && f.size() > at + 3)
        text += " (default " + f.substr(at + 2, f.size() - at - 3) + ")";
    }
    width = std::max(width, left.size());
    rows.push_back({left, text});
  }
  out << "Options:\n";
  width = std::min<size_t>(width, 30);
  for (const auto& r : rows) {
    if (r.left.size() > width)
      out << "  " << r.left << "\n  " << std::string(width, ' ') << "  " << r.text << "\n";
    else
      out << "  " << r.left << std::string(width - r.left.size(), ' ') << "  " << r.text << "\n";
  }
}

}  // namespace

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
      *ctx.out << "usage: sparkctl " << synopsis << "\n\n";
      print_options(*ctx.out, desc);
      return 0;
    }
    po::notify(vm);
  } catch (const po::error& e) {
    return ctx.fail(make_error(
        Errc::usage, fmt::format("{}: {} (see sparkctl {} --help)", name, e.what(), name)));
  }
  return std::nullopt;
}

}  // namespace spark::cli
