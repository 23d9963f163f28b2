#include "core/envfile.h"

#include <fmt/format.h>

#include "core/strings.h"

namespace spark {
namespace {

bool is_key_start(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '_';
}
bool is_key_char(char c) {
  return is_key_start(c) || (c >= '0' && c <= '9');
}

Error syntax(std::string_view file, int line, size_t col, std::string_view what) {
  return make_error(Errc::config, fmt::format("{}:{}:{}: {}", file, line, col + 1, what));
}

}  // namespace

Result<std::vector<EnvEntry>> parse_env_text(std::string_view text, std::string_view file) {
  std::vector<EnvEntry> out;
  int lineno = 0;
  size_t pos = 0;
  if (starts_with(text, "\xEF\xBB\xBF")) pos = 3;  // a UTF-8 byte order mark from an editor
  while (pos <= text.size()) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string_view::npos) eol = text.size();
    std::string_view raw = text.substr(pos, eol - pos);
    pos = eol + 1;
    ++lineno;
    if (!raw.empty() && raw.back() == '\r') raw.remove_suffix(1);
    size_t i = 0;
    auto skip_ws = [&] {
      while (i < raw.size() && (raw[i] == ' ' || raw[i] == '\t')) ++i;
    };
    skip_ws();
    if (i == raw.size() || raw[i] == '#') {
      if (eol == text.size()) break;
      continue;
    }
    if (raw.substr(i, 7) == "export " || raw.substr(i, 7) == "export\t") {
      i += 7;
      skip_ws();
    }
    if (i >= raw.size() || !is_key_start(raw[i]))
      return syntax(file, lineno, i, "expected KEY=VALUE (a key starts with a letter or '_')");
    size_t kstart = i;
    while (i < raw.size() && is_key_char(raw[i])) ++i;
    std::string key(raw.substr(kstart, i - kstart));
    if (i < raw.size() && (raw[i] == ' ' || raw[i] == '\t')) {
      size_t j = i;
      while (j < raw.size() && (raw[j] == ' ' || raw[j] == '\t')) ++j;
      if (j < raw.size() && raw[j] == '=')
        return syntax(file, lineno, i, fmt::format("no spaces allowed around '=' after {}", key));
    }
    if (i >= raw.size() || raw[i] != '=')
      return syntax(file, lineno, i, fmt::format("expected '=' after key {}", key));
    ++i;
    std::string value;
    if (i < raw.size() && raw[i] == '\'') {
      size_t close = raw.find('\'', i + 1);
      if (close == std::string_view::npos)
        return syntax(file, lineno, i,
                      fmt::format("unterminated single quote in value of {}", key));
      value = std::string(raw.substr(i + 1, close - i - 1));
      i = close + 1;
    } else if (i < raw.size() && raw[i] == '"') {
      size_t j = i + 1;
      bool closed = false;
      for (; j < raw.size(); ++j) {
        char c = raw[j];
        if (c == '"') {
          closed = true;
          break;
        }
        if (c == '\\' && j + 1 < raw.size()) {
          char n = raw[++j];
          switch (n) {
            case 'n':
              value += '\n';
              break;
            case 't':
              value += '\t';
              break;
            case '"':
              value += '"';
              break;
            case '\\':
              value += '\\';
              break;
            case '$':
              value += '$';
              break;
            default:
              return syntax(file, lineno, j - 1,
                            fmt::format("unknown escape '\\{}' in value of {}", n, key));
          }
          continue;
        }
        value += c;
      }
      if (!closed)
        return syntax(file, lineno, i,
                      fmt::format("unterminated double quote in value of {}", key));
      i = j + 1;
    } else {
      size_t vstart = i;
      while (i < raw.size()) {
        if (raw[i] == '#' && i > vstart && (raw[i - 1] == ' ' || raw[i - 1] == '\t')) break;
        if (raw[i] == '"' || raw[i] == '\'')
          return syntax(
              file, lineno, i,
              fmt::format("quote inside an unquoted value of {}; quote the whole value", key));
        ++i;
      }
      value = std::string(trim(raw.substr(vstart, i - vstart)));
      i = raw.size();
    }
    skip_ws();
    if (i < raw.size() && raw[i] != '#')
      return syntax(file, lineno, i, fmt::format("unexpected text after the value of {}", key));
    out.push_back(EnvEntry{std::move(key), std::move(value), std::string(file), lineno});
    if (eol == text.size()) break;
  }
  return out;
}

Result<std::vector<EnvEntry>> parse_env_file(const std::string& path) {
  auto text = read_file(path);
  if (!text)
    return make_error(Errc::not_found, fmt::format("{}: cannot read the cluster file", path));
  return parse_env_text(*text, path);
}

}  // namespace spark
