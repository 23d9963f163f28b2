// libFuzzer target for the stage manifest parser: JSON that arrives from a sender over the
// network (stage-recv) or sits beside a model. Besides "no crash, no leak, no UB" it checks
// that whatever is accepted is safe to write (every name stays inside the directory) and
// consistent (chunk lists match sizes), and that serializing it parses back to the same
// digest.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "core/manifest.h"
#include "core/strings.h"

namespace {

void require(bool ok) {
  if (!ok) std::abort();  // an invariant broke: libFuzzer reports it with the input
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  auto m = spark::parse_manifest_json(text, "fuzz.json");
  if (!m) {
    require(m.error().code == spark::Errc::integrity);
    require(spark::starts_with(m.error().message, "fuzz.json: "));
    return 0;
  }
  require(m->chunk_size >= 4096 && m->chunk_size <= (1ull << 30));
  for (size_t i = 0; i < m->files.size(); ++i) {
    const auto& f = m->files[i];
    require(spark::check_manifest_path(f.path).ok());
    require(f.path[0] != '/');
    require(f.chunks.size() == m->chunk_count(f.size));
    require(f.xxh3.size() == 32);
    if (i > 0) require(m->files[i - 1].path < f.path);  // sorted, no duplicates
  }
  auto again = spark::parse_manifest_json(spark::manifest_to_json(*m), "round-trip");
  require(again.ok());
  require(again->digest() == m->digest());
  require(again->files.size() == m->files.size());
  return 0;
}
