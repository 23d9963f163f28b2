#pragma once
// Logging through fmt: one line per event, "TIME LEVEL component[rank]: message", to stderr
// or a file. Thread-safe. The level comes from --verbose / SPARK_LOG_LEVEL.
#include <fmt/format.h>

#include <string>
#include <string_view>

namespace spark::log {

enum class Level { debug = 0, info = 1, warn = 2, error = 3, off = 4 };

/// Sets the minimum level printed.
void set_level(Level l);
Level level();
/// Parses "debug|info|warn|error|off"; returns false on anything else.
bool parse_level(std::string_view s, Level* out);
/// Sets the rank shown in every line (-1: none).
void set_rank(int rank);
/// Sends log lines to this file (append; created 0640 whatever the umask) instead of
/// stderr; empty = stderr.
bool set_file(const std::string& path);
/// Opens the file of set_file again under its name (after logrotate moved it away); the
/// old one stays in use when that fails (false, errno set). True without a file.
bool reopen();

void write(Level l, std::string_view component, std::string_view msg);

template <typename... Args>
void debug(std::string_view comp, fmt::format_string<Args...> f, Args&&... a) {
  if (level() <= Level::debug) write(Level::debug, comp, fmt::format(f, std::forward<Args>(a)...));
}
template <typename... Args>
void info(std::string_view comp, fmt::format_string<Args...> f, Args&&... a) {
  if (level() <= Level::info) write(Level::info, comp, fmt::format(f, std::forward<Args>(a)...));
}
template <typename... Args>
void warn(std::string_view comp, fmt::format_string<Args...> f, Args&&... a) {
  if (level() <= Level::warn) write(Level::warn, comp, fmt::format(f, std::forward<Args>(a)...));
}
template <typename... Args>
void error(std::string_view comp, fmt::format_string<Args...> f, Args&&... a) {
  if (level() <= Level::error) write(Level::error, comp, fmt::format(f, std::forward<Args>(a)...));
}

}  // namespace spark::log
