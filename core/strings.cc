#include "core/strings.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <vector>

namespace spark {

std::string_view trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && (s[b] == ' ' || s[b] == '\t' || s[b] == '\r' || s[b] == '\n')) ++b;
  while (e > b && (s[e - 1] == ' ' || s[e - 1] == '\t' || s[e - 1] == '\r' || s[e - 1] == '\n'))
    --e;
  return s.substr(b, e - b);
}

std::vector<std::string> split_list(std::string_view s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t pos = s.find(sep, start);
    if (pos == std::string_view::npos) pos = s.size();
    auto piece = trim(s.substr(start, pos - start));
    if (!piece.empty()) out.emplace_back(piece);
    start = pos + 1;
  }
  return out;
}

std::string join(const std::vector<std::string>& parts, std::string_view sep) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i) out += sep;
    out += parts[i];
  }
  return out;
}

bool starts_with(std::string_view s, std::string_view p) {
  return s.substr(0, p.size()) == p;
}
bool ends_with(std::string_view s, std::string_view p) {
  return s.size() >= p.size() && s.substr(s.size() - p.size()) == p;
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string did_you_mean(std::string_view word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  for (const auto& c : candidates) {
    size_t d = edit_distance(word, c);
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  size_t limit = std::max<size_t>(2, word.size() / 3);
  return best_d <= limit ? best : std::string();
}

std::optional<uint64_t> parse_u64(std::string_view s) {
  if (s.empty() || s.size() > 20) return std::nullopt;
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    uint64_t d = static_cast<uint64_t>(c - '0');
    if (v > (std::numeric_limits<uint64_t>::max() - d) / 10) return std::nullopt;
    v = v * 10 + d;
  }
  return v;
}

std::optional<int64_t> parse_i64(std::string_view s) {
  bool neg = !s.empty() && s[0] == '-';
  auto u = parse_u64(neg ? s.substr(1) : s);
  if (!u) return std::nullopt;
  if (*u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return std::nullopt;
  return neg ? -static_cast<int64_t>(*u) : static_cast<int64_t>(*u);
}

namespace {
struct Unit {
  const char* name;
  double factor;
};
constexpr Unit kSizeUnits[] = {
    {"B", 1.0},
    {"KiB", 1024.0},
    {"MiB", 1048576.0},
    {"GiB", 1073741824.0},
    {"TiB", 1099511627776.0},
    {"KB", 1e3},
    {"MB", 1e6},
    {"GB", 1e9},
    {"TB", 1e12},
};

// Splits "1.5GiB" into number "1.5" and unit "GiB"; the number is digits with at most one dot.
bool split_number_unit(std::string_view s, std::string_view* num, std::string_view* unit) {
  size_t i = 0;
  bool dot = false;
  while (i < s.size() && ((s[i] >= '0' && s[i] <= '9') || (s[i] == '.' && !dot))) {
    if (s[i] == '.') dot = true;
    ++i;
  }
  *num = s.substr(0, i);
  *unit = s.substr(i);
  return !num->empty() && num->front() != '.' && num->back() != '.';
}

// The value of a number split by split_number_unit (digits, at most one dot), locale-free.
// nullopt when it does not fit a double.
std::optional<double> number_value(std::string_view num) {
  double v = 0;
  auto [end, ec] = std::from_chars(num.data(), num.data() + num.size(), v);
  if (ec != std::errc() || end != num.data() + num.size() || !std::isfinite(v)) return std::nullopt;
  return v;
}

// Scales a parsed number to a count of the base unit. A fraction needs a unit larger than
// the base one (1.5GiB, 1.5s are fine; 1.5B, 1.5 bytes and 0.5ms are refused); the result is
// rounded to the nearest whole base unit. nullopt with *why set when refused.
std::optional<uint64_t> scale_whole(std::string_view s, std::string_view num, double v,
                                    double factor, std::string_view base, std::string* why) {
  if (factor == 1 && num.find('.') != std::string_view::npos) {
    if (why) *why = fmt::format("'{}' is not a whole number of {}", s, base);
    return std::nullopt;
  }
  double x = v * factor;
  if (!std::isfinite(x) || x >= 1.8e19) {
    if (why) *why = fmt::format("'{}' is too large", s);
    return std::nullopt;
  }
  return static_cast<uint64_t>(std::llround(x));
}
}  // namespace

std::optional<uint64_t> parse_size(std::string_view s, std::string* why) {
  std::string_view num, unit;
  if (!split_number_unit(s, &num, &unit)) {
    if (why) *why = fmt::format("'{}' is not a size (examples: 110GiB, 512MiB, 4096)", s);
    return std::nullopt;
  }
  double factor = 0;
  if (unit.empty()) {
    factor = 1;
  } else {
    for (const auto& u : kSizeUnits)
      if (unit == u.name) factor = u.factor;
  }
  if (factor == 0) {
    if (why)
      *why = fmt::format(
          "'{}': unknown size unit '{}' (use B, KiB, MiB, GiB, TiB or KB, MB, GB, TB)", s, unit);
    return std::nullopt;
  }
  auto v = number_value(num);
  if (!v) {
    if (why) *why = fmt::format("'{}' is too large", s);
    return std::nullopt;
  }
  return scale_whole(s, num, *v, factor, "bytes", why);
}

std::string format_size(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  if (u == 0) return fmt::format("{} B", bytes);
  return fmt::format("{:.2f} {}", v, units[u]);
}

std::optional<uint64_t> parse_duration_ms(std::string_view s, std::string* why) {
  std::string_view num, unit;
  if (!split_number_unit(s, &num, &unit)) {
    if (why) *why = fmt::format("'{}' is not a duration (examples: 30s, 5m, 2h, 250ms)", s);
    return std::nullopt;
  }
  double factor = 0;
  if (unit.empty() || unit == "s")
    factor = 1000;
  else if (unit == "ms")
    factor = 1;
  else if (unit == "m" || unit == "min")
    factor = 60000;
  else if (unit == "h")
    factor = 3600000;
  else if (unit == "d")
    factor = 86400000;
  if (factor == 0) {
    if (why) *why = fmt::format("'{}': unknown duration unit '{}' (use ms, s, m, h, d)", s, unit);
    return std::nullopt;
  }
  auto v = number_value(num);
  if (!v) {
    if (why) *why = fmt::format("'{}' is too large", s);
    return std::nullopt;
  }
  return scale_whole(s, num, *v, factor, "milliseconds", why);
}

std::optional<uint32_t> parse_ipv4(std::string_view s) {
  uint32_t out = 0;
  int parts = 0;
  size_t i = 0;
  while (parts < 4) {
    size_t start = i;
    while (i < s.size() && s[i] >= '0' && s[i] <= '9') ++i;
    size_t len = i - start;
    if (len == 0 || len > 3) return std::nullopt;
    if (len > 1 && s[start] == '0') return std::nullopt;  // no octal-looking octets
    auto v = parse_u64(s.substr(start, len));
    if (!v || *v > 255) return std::nullopt;
    out = (out << 8) | static_cast<uint32_t>(*v);
    ++parts;
    if (parts < 4) {
      if (i >= s.size() || s[i] != '.') return std::nullopt;
      ++i;
    }
  }
  if (i != s.size()) return std::nullopt;
  return out;
}

std::string format_ipv4(uint32_t ip) {
  return fmt::format("{}.{}.{}.{}", ip >> 24, (ip >> 16) & 255, (ip >> 8) & 255, ip & 255);
}

std::optional<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return std::nullopt;
  return ss.str();
}

std::optional<std::pair<unsigned, unsigned>> non_root_owner(const std::string& path) {
  struct stat st {};
  if (::geteuid() != 0 || ::stat(path.c_str(), &st) != 0 || st.st_uid == 0) return std::nullopt;
  return std::pair<unsigned, unsigned>{st.st_uid, st.st_gid};
}

void adopt_dir_owner(const std::string& path) {
  const std::string parent = std::filesystem::path(path).parent_path().string();
  if (auto o = non_root_owner(parent.empty() ? "." : parent))
    if (::lchown(path.c_str(), o->first, o->second) != 0) {
      // Best effort: a path left root's still works for root; only the owner's later
      // writes to it would fail, and they report that themselves.
    }
}

std::error_code make_dirs(const std::string& dir) {
  std::error_code ec;
  std::vector<std::filesystem::path> missing;
  for (std::filesystem::path p = dir; !p.empty() && !std::filesystem::exists(p, ec);
       p = p.parent_path()) {
    missing.push_back(p);
    if (p == p.parent_path()) break;
  }
  std::filesystem::create_directories(dir, ec);
  if (ec) return ec;
  for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
    // 0750 or tighter whatever the umask (a ring's state is no one else's to read).
    struct stat st {};
    if (::stat(it->c_str(), &st) == 0) (void)::chmod(it->c_str(), st.st_mode & 0750);
    adopt_dir_owner(it->string());
  }
  return {};
}

bool write_file_atomic(const std::string& path, std::string_view data, std::string* why,
                       unsigned mode) {
  std::string tmp = fmt::format("{}.tmp.{}", path, ::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
  if (fd < 0) {
    if (why) *why = fmt::format("cannot create {}: {}", tmp, std::strerror(errno));
    return false;
  }
  size_t off = 0;
  while (off < data.size()) {
    ssize_t n = ::write(fd, data.data() + off, data.size() - off);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (why) *why = fmt::format("cannot write {}: {}", tmp, std::strerror(errno));
      ::close(fd);
      ::unlink(tmp.c_str());
      return false;
    }
    off += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    if (why) *why = fmt::format("cannot flush {}: {}", tmp, std::strerror(errno));
    ::unlink(tmp.c_str());
    return false;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    if (why) *why = fmt::format("cannot rename {} to {}: {}", tmp, path, std::strerror(errno));
    ::unlink(tmp.c_str());
    return false;
  }
  return true;
}

std::string to_hex(const void* data, size_t n) {
  static const char* d = "0123456789abcdef";
  std::string out(n * 2, '0');
  auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    out[2 * i] = d[p[i] >> 4];
    out[2 * i + 1] = d[p[i] & 15];
  }
  return out;
}

size_t utf8_invalid_at(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    unsigned c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len = 0;
    unsigned lo = 0x80, hi = 0xbf;  // the allowed range of the second byte
    if (c >= 0xc2 && c <= 0xdf) {
      len = 2;
    } else if (c >= 0xe0 && c <= 0xef) {
      len = 3;
      if (c == 0xe0) lo = 0xa0;  // overlong
      if (c == 0xed) hi = 0x9f;  // UTF-16 surrogates
    } else if (c >= 0xf0 && c <= 0xf4) {
      len = 4;
      if (c == 0xf0) lo = 0x90;  // overlong
      if (c == 0xf4) hi = 0x8f;  // past U+10FFFF
    } else {
      return i;
    }
    if (i + len > n) return i;
    if (p[i + 1] < lo || p[i + 1] > hi) return i;
    for (size_t k = 2; k < len; ++k)
      if (p[i + k] < 0x80 || p[i + k] > 0xbf) return i;
    i += len;
  }
  return std::string_view::npos;
}

}  // namespace spark
