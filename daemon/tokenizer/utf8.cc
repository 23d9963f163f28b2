#include "daemon/tokenizer/utf8.h"

namespace spark::tok {

namespace {
// Length of the valid prefix of the sequence starting at s[i] (how many bytes of it are
// well formed) and the full length it needs. valid == need means a complete sequence.
struct SeqCheck {
  size_t valid = 0;
  size_t need = 1;
};

SeqCheck check_seq(std::string_view s, size_t i) {
  auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) return {1, 1};
  unsigned char lo = 0x80, hi = 0xBF;
  size_t need = 0;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 2;
  } else if (b0 == 0xE0) {
    need = 3, lo = 0xA0;
  } else if ((b0 >= 0xE1 && b0 <= 0xEC) || b0 == 0xEE || b0 == 0xEF) {
    need = 3;
  } else if (b0 == 0xED) {
    need = 3, hi = 0x9F;
  } else if (b0 == 0xF0) {
    need = 4, lo = 0x90;
  } else if (b0 >= 0xF1 && b0 <= 0xF3) {
    need = 4;
  } else if (b0 == 0xF4) {
    need = 4, hi = 0x8F;
  } else {
    return {0, 1};  // never valid as a lead byte
  }
  size_t valid = 1;
  for (size_t k = 1; k < need; ++k) {
    if (i + k >= s.size()) break;
    auto b = static_cast<unsigned char>(s[i + k]);
    unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (b < l || b > h) break;
    ++valid;
  }
  return {valid, need};
}
}  // namespace

size_t utf8_seq_len(unsigned char b) {
  if (b < 0x80) return 1;
  if (b >= 0xC2 && b <= 0xDF) return 2;
  if (b >= 0xE0 && b <= 0xEF) return 3;
  if (b >= 0xF0 && b <= 0xF4) return 4;
  return 1;
}

size_t utf8_next(std::string_view s, size_t i, char32_t* cp) {
  auto b0 = static_cast<unsigned char>(s[i]);
  size_t n = utf8_seq_len(b0);
  if (i + n > s.size()) n = 1;
  char32_t c = 0;
  switch (n) {
    case 1:
      c = b0;
      break;
    case 2:
      c = (b0 & 0x1Fu) << 6 | (static_cast<unsigned char>(s[i + 1]) & 0x3Fu);
      break;
    case 3:
      c = (b0 & 0x0Fu) << 12 | (static_cast<unsigned char>(s[i + 1]) & 0x3Fu) << 6 |
          (static_cast<unsigned char>(s[i + 2]) & 0x3Fu);
      break;
    default:
      c = (b0 & 0x07u) << 18 | (static_cast<unsigned char>(s[i + 1]) & 0x3Fu) << 12 |
          (static_cast<unsigned char>(s[i + 2]) & 0x3Fu) << 6 |
          (static_cast<unsigned char>(s[i + 3]) & 0x3Fu);
  }
  *cp = c;
  return n;
}

void utf8_append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

bool utf8_valid(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    SeqCheck c = check_seq(s, i);
    if (c.valid != c.need) return false;
    i += c.need;
  }
  return true;
}

std::string utf8_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      out += s[i++];
      continue;
    }
    SeqCheck c = check_seq(s, i);
    if (c.valid == c.need) {
      out.append(s.substr(i, c.need));
      i += c.need;
    } else {
      out += "\xEF\xBF\xBD";
      i += c.valid == 0 ? 1 : c.valid;
    }
  }
  return out;
}

size_t utf8_incomplete_tail(std::string_view s) {
  size_t n = s.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    size_t i = n - back;
    auto b = static_cast<unsigned char>(s[i]);
    if (b < 0x80) return 0;
    if (b >= 0xC0) {  // a lead byte: incomplete if all its bytes so far are valid
      SeqCheck c = check_seq(s, i);
      return (c.valid == back && c.need > back) ? back : 0;
    }
  }
  return 0;
}

}  // namespace spark::tok
