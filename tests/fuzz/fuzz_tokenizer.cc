// libFuzzer target for the tokenizer.json loader and what a loaded tokenizer does with
// hostile text and ids. Input layout: tokenizer.json text, optionally followed by a NUL byte
// and text that is encoded (its bytes also serve as ids to decode). Besides "no crash, no
// leak, no UB" it checks: decode output is valid UTF-8, streaming decode equals decode.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "daemon/tokenizer/tokenizer.h"
#include "daemon/tokenizer/utf8.h"

namespace {
void require(bool ok) {
  if (!ok) std::abort();
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view input(reinterpret_cast<const char*>(data), size);
  std::string_view json = input, text = "Hello, wörld! 👋🏽 <|im_end|>\n\n  x";
  if (auto nul = input.find('\0'); nul != std::string_view::npos) {
    json = input.substr(0, nul);
    text = input.substr(nul + 1);
  }
  auto tok = spark::tok::Tokenizer::from_json(json, "fuzz");
  if (!tok.ok()) {
    require(!tok.error().message.empty());
    return 0;
  }
  auto ids = tok->encode(text, true);
  require(ids.size() <= 4 * text.size() + 64);
  std::string dec = tok->decode(ids, false);
  require(spark::tok::utf8_valid(dec));
  // Arbitrary ids, including out-of-range ones, decode without harm.
  std::vector<spark::tok::TokenId> raw;
  for (size_t i = 0; i + 1 < text.size() && raw.size() < 256; i += 2)
    raw.push_back(static_cast<spark::tok::TokenId>(static_cast<uint8_t>(text[i]) << 8 |
                                                   static_cast<uint8_t>(text[i + 1])) -
                  100);
  std::string all = tok->decode(raw, false);
  require(spark::tok::utf8_valid(all));
  spark::tok::StreamDecoder sd(*tok, false);
  std::string streamed;
  for (auto id : raw) {
    std::string piece = sd.push(id);
    require(spark::tok::utf8_valid(piece));
    streamed += piece;
  }
  streamed += sd.finish();
  require(streamed == all);
  return 0;
}
