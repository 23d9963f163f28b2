#pragma once
// The node behind a seam: every probe reads /sys, /proc and /dev through a Sysroot, so a
// captured tree (tests/fixtures/preflight/<scenario>/, or a `sparkctl capture-node` archive)
// drives the same code as the live node. A Sysroot can record every path it was asked for;
// capture-node copies exactly those.
//
// No file can break a probe: a read opens only regular files (sysfs attributes and /proc
// files are regular), never blocks on a FIFO or a device (the type is checked before open,
// the open is O_NONBLOCK and fstat checks again), stops at a size cap (a /proc/meminfo that
// is /dev/zero, a grown file) and runs under a deadline (a sysfs attribute of a wedged
// driver). Reads that were refused for such a reason, and symlink loops, are kept as
// problems that preflight reports with their paths.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace spark::env {

/// The most a probe reads of a sysfs or /proc file (they are one page; meminfo ~1.5 KiB).
inline constexpr size_t kSysfsReadCap = 64 * 1024;
/// The most a probe reads of a JSON file in a tree (facts.json, model index, manifest).
inline constexpr size_t kJsonReadCap = 64 * 1024 * 1024;
/// How long one read may take before it is abandoned.
inline constexpr std::chrono::milliseconds kReadTimeout{2000};

/// Reads a whole file at a host path, safely: only a regular file, at most `cap` bytes
/// (a larger one is an error, not a truncated read), within `timeout`. Errors: not_found
/// (ENOENT), io (ELOOP, not a regular file, over the cap, other errno; the message names
/// the path and the reason), timeout.
Result<std::string> read_file_bounded(const std::string& host_path, size_t cap,
                                      std::chrono::milliseconds timeout = kReadTimeout);

/// Runs `fn` on its own thread and waits at most `timeout` for it: a call that blocks in
/// the kernel is abandoned (its thread finishes or stays blocked on its own), not waited on.
Result<std::string> call_with_deadline(std::function<Result<std::string>()> fn,
                                       std::chrono::milliseconds timeout);

/// Replaces every byte sequence that is not valid UTF-8 with "\xNN" escapes, so text read
/// from a node always renders (JSON output would otherwise throw).
std::string escape_invalid_utf8(std::string_view s);

/// A path a probe could not read safely, and why ("symlink loop (ELOOP)", ...).
struct ReadProblem {
  std::string path;  // node-absolute ("/proc/meminfo")
  std::string what;
};

class Sysroot {
 public:
  /// "/" (or empty) is the live node; anything else is a captured tree.
  explicit Sysroot(std::string root = "/");
  /// True for the live node (facts come from syscalls, not facts.json).
  bool live() const { return root_.empty(); }
  /// The root as given ("/" for the live node).
  std::string root() const { return root_.empty() ? "/" : root_; }
  /// Host path of an absolute node path ("/sys/class/net" -> "<root>/sys/class/net").
  std::string path(std::string_view abs) const;
  /// Whole file (at most `cap` bytes), or nullopt when missing or unreadable (sysfs returns
  /// EINVAL for some attributes of a down link: that is "unknown", not an error). Reads
  /// refused for safety are also kept as problems().
  std::optional<std::string> read(std::string_view abs, size_t cap = kSysfsReadCap) const;
  /// First line of a file, trimmed, invalid UTF-8 escaped.
  std::optional<std::string> read_line(std::string_view abs) const;
  /// Sorted names in a directory (following symlinks); empty when missing.
  std::vector<std::string> list(std::string_view abs) const;
  /// True when the path exists (following symlinks); a symlink loop is a problem, not a path.
  bool exists(std::string_view abs) const;
  /// Size of a regular file (nullopt when missing); recorded as "sized" for capture-node,
  /// which recreates such files sparse, so sizes replay without copying the data.
  std::optional<uint64_t> file_size(std::string_view abs) const;
  /// Every read refused for safety so far (loops, FIFOs, devices, oversize, timeouts).
  std::vector<ReadProblem> problems() const;
  /// The problem recorded for one path, if any.
  std::optional<std::string> problem(std::string_view abs) const;
  /// Per-read deadline (tests shorten it).
  void set_read_timeout(std::chrono::milliseconds t) { timeout_ = t; }
  /// Starts recording every path read or listed (for capture-node).
  void record(bool on);
  /// Paths read (files) and listed (directories), node-absolute.
  std::set<std::string> recorded_files() const;
  std::set<std::string> recorded_dirs() const;
  std::set<std::string> recorded_sized() const;

 private:
  enum class Kind { file, dir, sized };
  void note(std::string_view abs, Kind k) const;
  void add_problem(std::string_view abs, std::string what) const;
  std::string root_;  // "" for live
  std::chrono::milliseconds timeout_ = kReadTimeout;
  struct Recorder {
    std::mutex mu;
    bool on = false;
    std::set<std::string> files, dirs, sized;
    std::vector<ReadProblem> problems;
    int timeouts = 0;  // after a few, reads stop waiting (a wedged driver answers nothing)
  };
  std::shared_ptr<Recorder> rec_;
};

}  // namespace spark::env
