#include "core/redact.h"

#include <algorithm>
#include <cctype>
#include <regex>

#include "core/config.h"
#include "core/strings.h"

namespace spark {

namespace {

std::string upper(std::string_view s) {
  std::string u(s);
  for (auto& c : u) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return u;
}

std::vector<std::string> words_of(std::string_view name) {
  std::vector<std::string> w;
  std::string cur;
  for (char c : name) {
    if (c == '_' || c == '-' || c == '.') {
      if (!cur.empty()) w.push_back(upper(cur));
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (!cur.empty()) w.push_back(upper(cur));
  return w;
}

// A value ends at whitespace or a quote; trailing punctuation of a sentence is not part of it.
const char* kValue = R"(([^\s'"`;&|<>\\]+))";

// std::regex is slow but these texts are small (log tails); built once.
const std::vector<std::regex>& patterns() {
  static const std::vector<std::regex> p = [] {
    std::vector<std::regex> v;
    auto icase = std::regex::ECMAScript | std::regex::icase;
    // NAME=VALUE / NAME: VALUE where NAME is any identifier; the name is checked afterwards.
    v.emplace_back(std::string(R"(([A-Za-z_][A-Za-z0-9_.-]*)\s*[=:]\s*['"]?)") + kValue, icase);
    // --api-key X, --api-key=X, --hf-token X, --password X, -p? no: only long options.
    v.emplace_back(std::string(R"(--([A-Za-z0-9-]+)[= ]['"]?)") + kValue, icase);
    // Authorization: Bearer X / Basic X, or a bare Bearer X.
    v.emplace_back(std::string(R"(\b(?:bearer|basic)\s+)") + kValue, icase);
    // scheme://user:PASSWORD@host
    v.emplace_back(R"([A-Za-z][A-Za-z0-9+.-]*://[^\s:/@]+:([^\s/@]+)@)", icase);
    // Token shapes issued by common services.
    v.emplace_back(R"(\b((?:hf|ghp|gho|ghs|ghu|glpat)[_-][A-Za-z0-9_-]{16,}))");
    v.emplace_back(R"(\b(sk-[A-Za-z0-9_-]{16,}))");
    v.emplace_back(R"(\b(xox[abposr]-[A-Za-z0-9-]{10,}))");
    return v;
  }();
  return p;
}

}  // namespace

bool is_secret_name(std::string_view name) {
  // A key of the cluster file that takes a choice, a number, a size or a duration is a
  // setting, whatever words it holds (METRICS_AUTH says which auth /metrics needs).
  for (const auto& k : ring_keys())
    if (name == k.name && k.type != KeyType::string) return false;
  auto w = words_of(name);
  if (w.empty()) return false;
  static const char* kFileish[] = {"FILE", "PATH", "DIR", "FILES", "LEN", "LENGTH", "TOKENS"};
  for (const char* f : kFileish)
    if (w.back() == f) return false;
  static const char* kSecret[] = {"KEY",    "APIKEY", "TOKEN",      "SECRET",     "PASSWORD",
                                  "PASSWD", "PASS",   "PASSPHRASE", "CREDENTIAL", "CREDENTIALS",
                                  "AUTH",   "BEARER", "PWD"};
  for (const auto& word : w)
    for (const char* s : kSecret)
      if (word == s) return true;
  // OPENAIAPIKEY, HFTOKEN: a secret word at the end of one long word.
  return ends_with(w.back(), "APIKEY") || ends_with(w.back(), "TOKEN") ||
         ends_with(w.back(), "SECRET") || ends_with(w.back(), "PASSWORD");
}

std::vector<std::string> find_secrets(std::string_view text) {
  std::vector<std::string> out;
  std::string s(text);
  const auto& p = patterns();
  auto add = [&](std::string v) {
    while (!v.empty() && (v.back() == '.' || v.back() == ',' || v.back() == ')')) v.pop_back();
    if (v.size() >= 6 && v.find(kRedacted) == std::string::npos &&
        std::find(out.begin(), out.end(), v) == out.end())
      out.push_back(std::move(v));
  };
  for (size_t k = 0; k < p.size(); ++k) {
    for (std::sregex_iterator it(s.begin(), s.end(), p[k]), end; it != end; ++it) {
      const auto& m = *it;
      if (k <= 1) {  // a name and its value: only when the name is a secret's
        if (is_secret_name(m[1].str())) add(m[2].str());
      } else {
        add(m[1].str());
      }
    }
  }
  return out;
}

std::string redact(std::string_view text, const std::vector<std::string>& known) {
  auto secrets = find_secrets(text);
  for (const auto& k : known)
    if (k.size() >= 4) secrets.push_back(k);
  // Longest first, so a secret that contains another is replaced whole.
  std::sort(secrets.begin(), secrets.end(),
            [](const std::string& a, const std::string& b) { return a.size() > b.size(); });
  std::string s(text);
  for (const auto& sec : secrets) {
    if (sec.empty()) continue;
    for (size_t at = s.find(sec); at != std::string::npos; at = s.find(sec, at + kRedacted.size()))
      s.replace(at, sec.size(), kRedacted);
  }
  return s;
}

}  // namespace spark
