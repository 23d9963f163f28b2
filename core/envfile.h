#pragma once
// The .env syntax of the cluster file: KEY=VALUE lines, '#' comments (whole line, or after
// whitespace following an unquoted value), 'single' (literal) and "double" (with \" \\ \n \t
// \$ escapes) quotes, an optional "export " prefix. No variable expansion. Errors name
// file:line and column.
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace spark {

/// One assignment as written, with where it was written.
struct EnvEntry {
  std::string key;
  std::string value;
  std::string file;
  int line = 0;
};

/// Parses .env text. `file` is used in error messages only.
Result<std::vector<EnvEntry>> parse_env_text(std::string_view text, std::string_view file);
/// Reads and parses a .env file.
Result<std::vector<EnvEntry>> parse_env_file(const std::string& path);

}  // namespace spark
