// The API's context pre-check on the tokenizer fixture: text that cannot fit is refused
// after counting about the context's worth of it, never the whole text.
#include "daemon/api_routes.h"

#include <doctest/doctest.h>

using namespace spark;
using namespace spark::daemon;

namespace {
const tok::Tokenizer& fixture() {
  static const tok::Tokenizer t = *tok::Tokenizer::from_file(
      std::string(SPARK_SOURCE_DIR) + "/tests/fixtures/tokenizer/tokenizer.json");
  return t;
}
}  // namespace

TEST_CASE("exceeds_context: huge text is refused after counting about the context's worth") {
  const auto& t = fixture();
  const std::string spaces(4u << 20, ' ');
  int64_t counted = 0;
  CHECK(exceeds_context(t, {spaces}, 1024, &counted));
  CHECK(counted > 1024);
  // Counting stopped within one 4 KiB piece of the limit (a piece is at most 4096 tokens).
  CHECK(counted < 1024 + 4096);
  const std::string words = [] {
    std::string s;
    for (int i = 0; i < 20000; ++i) s += "word ";
    return s;
  }();
  CHECK(exceeds_context(t, {"short", words}, 1024, &counted));
  // Text that fits is never refused: the lower bound stays under the exact count.
  const std::string mid = words.substr(0, 3000);
  size_t exact = t.encode(mid, false).size();
  CHECK_FALSE(exceeds_context(t, {mid}, static_cast<int>(exact), &counted));
  CHECK(counted <= static_cast<int64_t>(exact));
  CHECK_FALSE(exceeds_context(t, {"hello", "world"}, 1024, &counted));
}
