// libFuzzer target for what a node sends the head and what a capture holds: node reports
// (preflight --local --json, read by the head), facts.json, sysfs GID strings, meminfo, the
// known-bad versions list and its version ranges, and the escaping of sysfs text that is not
// UTF-8. Besides "no crash, no leak, no UB": whatever parses must survive a JSON round trip,
// a parsed GID must format back to the same 16 bytes, and escaped text must be valid UTF-8
// (JSON output throws on anything else).
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>

#include "env/facts.h"
#include "env/known_bad.h"
#include "env/meminfo.h"
#include "env/preflight.h"
#include "env/rdma.h"
#include "env/sysroot.h"

namespace {
void require(bool ok) {
  if (!ok) std::abort();
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string input(reinterpret_cast<const char*>(data), size);
  std::array<uint8_t, 16> g{};
  if (spark::env::parse_gid(input, &g)) {
    spark::env::GidEntry e;
    e.bytes = g;
    std::array<uint8_t, 16> again{};
    std::string raw;
    for (size_t i = 0; i < 16; i += 2) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "%s%02x%02x", i ? ":" : "", g[i], g[i + 1]);
      raw += buf;
    }
    require(spark::env::parse_gid(raw, &again) && again == g);
    (void)e.text();
  }
  (void)spark::env::parse_meminfo(input);
  // Escaped sysfs text renders as JSON (dump throws on invalid UTF-8 with the strict handler).
  std::string esc = spark::env::escape_invalid_utf8(input);
  (void)nlohmann::json(esc).dump();
  require(spark::env::escape_invalid_utf8(esc) == esc);
  // "VERSION\nRANGE": a known-bad comparison on arbitrary text.
  if (auto nl = input.find('\n'); nl != std::string::npos)
    (void)spark::env::version_matches(input.substr(0, nl), input.substr(nl + 1));
  if (auto kb = spark::env::parse_known_bad(input, "fuzz"); kb.ok())
    for (const auto& e : kb->entries) require(spark::env::version_matches("1.0", e.versions).ok());
  auto j = nlohmann::json::parse(input, nullptr, false);
  if (j.is_discarded()) return 0;
  if (auto r = spark::env::report_from_json(j); r.ok()) {
    auto back = spark::env::report_from_json(spark::env::report_to_json(*r));
    require(back.ok() && back->checks.size() == r->checks.size() &&
            back->links.size() == r->links.size());
  }
  if (auto f = spark::env::facts_from_json(j); f.ok()) {
    auto back = spark::env::facts_from_json(spark::env::facts_to_json(*f));
    require(back.ok() && back->addrs.size() == f->addrs.size());
  }
  return 0;
}
