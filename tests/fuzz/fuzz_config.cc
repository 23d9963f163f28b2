// libFuzzer target for the cluster file: the .env parser, the config loader with an
// environment override, and the strict value parsers it uses. Input layout: the file text,
// optionally followed by a NUL byte and KEY=VALUE lines that become the environment.
// Besides "no crash, no leak, no UB" it checks invariants the rest of sparkctl relies on.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "core/config.h"
#include "core/envfile.h"
#include "core/strings.h"

namespace {

void require(bool ok) {
  if (!ok) std::abort();  // an invariant broke: libFuzzer reports it with the input
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view input(reinterpret_cast<const char*>(data), size);
  std::string_view text = input;
  spark::Environment env;
  if (auto nul = input.find('\0'); nul != std::string_view::npos) {
    text = input.substr(0, nul);
    for (const auto& line : spark::split_list(input.substr(nul + 1), '\n')) {
      auto eq = line.find('=');
      if (eq != std::string::npos) env.vars[line.substr(0, eq)] = line.substr(eq + 1);
    }
  }

  auto entries = spark::parse_env_text(text, "fuzz.env");
  if (entries) {
    int last_line = 0;
    for (const auto& e : *entries) {
      require(!e.key.empty());
      require(e.line > last_line);  // one assignment per line, in order
      last_line = e.line;
    }
  } else {
    require(entries.error().code == spark::Errc::config);
    require(spark::starts_with(entries.error().message, "fuzz.env:"));
  }

  std::vector<spark::Diagnostic> diags;
  auto cfg = spark::load_config_text(text, "fuzz.env", env, &diags);
  if (cfg) {
    require(!cfg->nodes.empty());
    require(cfg->world_size() >= 1);
    require(cfg->digest().size() == 32);
    for (size_t i = 0; i < cfg->nodes.size(); ++i) {
      require(cfg->nodes[i].index == static_cast<int>(i));
      require(spark::parse_ipv4(cfg->nodes[i].fabric_ip).has_value());
    }
    for (const auto& d : diags) require(!d.error);
  } else {
    require(cfg.error().code == spark::Errc::config);
  }

  // The strict value parsers on the raw text.
  std::string why;
  (void)spark::parse_size(text, &why);
  (void)spark::parse_duration_ms(text, &why);
  if (auto ip = spark::parse_ipv4(text)) require(spark::format_ipv4(*ip) == text);
  return 0;
}
