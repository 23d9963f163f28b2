#pragma once
// /proc/meminfo, read through a root directory so captured trees replay like a live node.
#include <cstdint>
#include <map>
#include <string>

#include "core/error.h"

namespace spark::env {

/// The fields of /proc/meminfo in bytes (MemTotal, MemFree, MemAvailable, Cached, Dirty, ...).
struct MemInfo {
  std::map<std::string, uint64_t> fields;
  uint64_t get(const std::string& key) const {
    auto it = fields.find(key);
    return it == fields.end() ? 0 : it->second;
  }
};

/// Parses meminfo text ("Key:   123 kB" lines).
Result<MemInfo> parse_meminfo(const std::string& text);
/// Reads <root>/proc/meminfo ("/" for the live node).
Result<MemInfo> read_meminfo(const std::string& root);

}  // namespace spark::env
