#pragma once
// The node behind a seam: every probe reads /sys, /proc and /dev through a Sysroot, so a
// captured tree (tests/fixtures/preflight/<scenario>/, or a `sparkctl capture-node` archive)
// drives the same code as the live node. A Sysroot can record every path it was asked for;
// capture-node copies exactly those.
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace spark::env {

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
  /// Whole file, or nullopt when missing or unreadable (sysfs returns EINVAL for some
  /// attributes of a down link: that is "unknown", not an error).
  std::optional<std::string> read(std::string_view abs) const;
  /// First line of a file, trimmed.
  std::optional<std::string> read_line(std::string_view abs) const;
  /// Sorted names in a directory (following symlinks); empty when missing.
  std::vector<std::string> list(std::string_view abs) const;
  /// True when the path exists (following symlinks).
  bool exists(std::string_view abs) const;
  /// Size of a regular file (nullopt when missing); recorded as "sized" for capture-node,
  /// which recreates such files sparse, so sizes replay without copying the data.
  std::optional<uint64_t> file_size(std::string_view abs) const;
  /// Starts recording every path read or listed (for capture-node).
  void record(bool on);
  /// Paths read (files) and listed (directories), node-absolute.
  std::set<std::string> recorded_files() const;
  std::set<std::string> recorded_dirs() const;
  std::set<std::string> recorded_sized() const;

 private:
  enum class Kind { file, dir, sized };
  void note(std::string_view abs, Kind k) const;
  std::string root_;  // "" for live
  struct Recorder {
    std::mutex mu;
    bool on = false;
    std::set<std::string> files, dirs, sized;
  };
  std::shared_ptr<Recorder> rec_;
};

}  // namespace spark::env
