#include "core/log.h"

#include <fcntl.h>
#include <fmt/chrono.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <string>

namespace spark::log {
namespace {
std::atomic<Level> g_level{Level::info};
std::atomic<int> g_rank{-1};
std::mutex g_mu;
std::FILE* g_out = nullptr;  // nullptr = stderr

const char* level_name(Level l) {
  switch (l) {
    case Level::debug: return "DEBUG";
    case Level::info: return "INFO";
    case Level::warn: return "WARN";
    case Level::error: return "ERROR";
    case Level::off: return "OFF";
  }
  return "?";
}
}  // namespace

void set_level(Level l) { g_level = l; }
Level level() { return g_level; }

bool parse_level(std::string_view s, Level* out) {
  if (s == "debug") *out = Level::debug;
  else if (s == "info") *out = Level::info;
  else if (s == "warn") *out = Level::warn;
  else if (s == "error") *out = Level::error;
  else if (s == "off") *out = Level::off;
  else return false;
  return true;
}

void set_rank(int rank) { g_rank = rank; }

namespace {
std::string g_path;  // of set_file

std::FILE* open_log(const std::string& path) {
  // Created 0640 at most: the umask can only take bits away.
  int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0640);
  if (fd < 0) return nullptr;
  std::FILE* f = ::fdopen(fd, "a");
  if (!f) ::close(fd);
  return f;
}
}  // namespace

bool set_file(const std::string& path) {
  std::lock_guard lk(g_mu);
  if (g_out) std::fclose(g_out);
  g_out = nullptr;
  g_path = path;
  if (path.empty()) return true;
  g_out = open_log(path);
  return g_out != nullptr;
}

bool reopen() {
  std::lock_guard lk(g_mu);
  if (g_path.empty()) return true;
  std::FILE* f = open_log(g_path);
  if (!f) return false;
  if (g_out) std::fclose(g_out);
  g_out = f;
  return true;
}

void write(Level l, std::string_view component, std::string_view msg) {
  auto now = std::chrono::system_clock::now();
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()) % 1000;
  std::string rank = g_rank >= 0 ? fmt::format("[{}]", g_rank.load()) : std::string();
  std::string line = fmt::format("{:%Y-%m-%dT%H:%M:%S}.{:03d} {:<5} {}{}: {}\n",
                                 fmt::gmtime(std::chrono::system_clock::to_time_t(now)),
                                 static_cast<int>(ms.count()), level_name(l), component, rank, msg);
  std::lock_guard lk(g_mu);
  std::FILE* f = g_out ? g_out : stderr;
  std::fwrite(line.data(), 1, line.size(), f);
  std::fflush(f);
}

}  // namespace spark::log
