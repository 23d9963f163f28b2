#pragma once
// Small string helpers shared by the parsers and the command line.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace spark {

/// Removes leading and trailing ASCII whitespace.
std::string_view trim(std::string_view s);
/// Splits on `sep`, trimming each piece and dropping empty pieces.
std::vector<std::string> split_list(std::string_view s, char sep = ',');
/// Joins with `sep`.
std::string join(const std::vector<std::string>& parts, std::string_view sep);
bool starts_with(std::string_view s, std::string_view prefix);
bool ends_with(std::string_view s, std::string_view suffix);
/// Levenshtein distance (for "did you mean").
size_t edit_distance(std::string_view a, std::string_view b);
/// The closest candidate within a small distance, or empty.
std::string did_you_mean(std::string_view word, const std::vector<std::string>& candidates);
/// Strict unsigned decimal integer: digits only, no sign, no spaces, no overflow.
std::optional<uint64_t> parse_u64(std::string_view s);
/// Strict signed decimal integer.
std::optional<int64_t> parse_i64(std::string_view s);
/// Parses a size: "123" bytes, or a number with a unit B, KiB, MiB, GiB, TiB (powers of
/// 1024) or KB, MB, GB, TB (powers of 1000). No space, no sign. A fraction needs a unit
/// above bytes ("1.5GiB" ok, "1.5B" refused); rounded to whole bytes. Error text in *why.
std::optional<uint64_t> parse_size(std::string_view s, std::string* why);
/// Formats bytes as "1.50 GiB".
std::string format_size(uint64_t bytes);
/// Parses a duration: "30s", "5m", "2h", "1d", "250ms", or plain seconds ("1.5m" ok, "0.5ms"
/// refused). Result in milliseconds.
std::optional<uint64_t> parse_duration_ms(std::string_view s, std::string* why);
/// Parses dotted-quad IPv4 into host-order value.
std::optional<uint32_t> parse_ipv4(std::string_view s);
/// Formats a host-order IPv4.
std::string format_ipv4(uint32_t ip);
/// Reads a whole file; nullopt if it cannot be read.
std::optional<std::string> read_file(const std::string& path);
/// Writes a file atomically: to PATH.tmp.PID, fsync, rename. Never leaves a partial PATH.
bool write_file_atomic(const std::string& path, std::string_view data, std::string* why,
                       unsigned mode = 0644);
/// When this process runs as root and `path` belongs to another user: that user's uid and
/// gid. Nullopt otherwise (not root, root's own, or no such path).
std::optional<std::pair<unsigned, unsigned>> non_root_owner(const std::string& path);
/// When this process runs as root and the directory holding `path` belongs to another
/// user, gives `path` that directory's owner and group (best effort, errors ignored), so
/// that what root's watch timer writes into the state of a ring a user started stays that
/// user's to rewrite. Nothing otherwise. Only for a ring's own state: it hands the file
/// to whoever owns the directory.
void adopt_dir_owner(const std::string& path);
/// Creates `dir` and any missing parents (as std::filesystem::create_directories), each
/// new directory of mode 0750 or tighter (whatever the umask) and adopting its parent's
/// owner as adopt_dir_owner says. Empty on success.
std::error_code make_dirs(const std::string& dir);
/// Hex of bytes.
std::string to_hex(const void* data, size_t n);
/// Offset of the first byte that is not part of well-formed UTF-8 (overlong forms,
/// surrogates and code points past U+10FFFF included), or npos when all of `s` is UTF-8.
size_t utf8_invalid_at(std::string_view s);

}  // namespace spark
