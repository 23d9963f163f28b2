#include "daemon/tokenizer/byte_level.h"

#include <array>

#include "daemon/tokenizer/utf8.h"

namespace spark::tok {

namespace {
constexpr char32_t kMaxMapped = 0x144;  // 256 + 68 remapped bytes

struct Tables {
  std::array<char32_t, 256> to_char{};
  std::array<int, kMaxMapped> to_byte{};
  std::array<std::string, 256> utf8{};  // UTF-8 of to_char[b]
  Tables() {
    to_byte.fill(-1);
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      to_char[static_cast<size_t>(b)] = printable ? static_cast<char32_t>(b) : next++;
    }
    for (int b = 0; b < 256; ++b) {
      to_byte[to_char[static_cast<size_t>(b)]] = b;
      utf8_append(utf8[static_cast<size_t>(b)], to_char[static_cast<size_t>(b)]);
    }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}
}  // namespace

char32_t byte_to_char(unsigned char b) {
  return tables().to_char[b];
}

int char_to_byte(char32_t cp) {
  return cp < kMaxMapped ? tables().to_byte[cp] : -1;
}

std::string bytes_to_byte_level(std::string_view text) {
  const Tables& t = tables();
  std::string out;
  out.reserve(text.size() * 2);
  for (char c : text) out += t.utf8[static_cast<unsigned char>(c)];
  return out;
}

std::string byte_level_to_bytes(std::string_view token) {
  std::string out;
  out.reserve(token.size());
  for (size_t i = 0; i < token.size();) {
    char32_t cp = 0;
    i += utf8_next(token, i, &cp);
    int b = char_to_byte(cp);
    if (b < 0) return std::string(token);
    out += static_cast<char>(b);
  }
  return out;
}

}  // namespace spark::tok
