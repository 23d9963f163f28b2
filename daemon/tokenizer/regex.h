#pragma once
// PCRE2 (UTF + UCP, JIT) regular expressions with the Oniguruma flavour that Hugging Face
// tokenizer.json patterns are written for.
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/error.h"

namespace spark::tok {

/// A compiled pattern; immutable and safe to share between threads.
class Regex {
 public:
  /// Compiles an Oniguruma-style pattern (rewritten where PCRE2 differs, see
  /// onig_to_pcre2). Errors name the pattern offset.
  static Result<Regex> compile(std::string_view pattern);
  /// Every non-empty, non-overlapping match [begin, end) in valid UTF-8 `text`, left to
  /// right.
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view text) const;

 private:
  struct Code;
  std::shared_ptr<const Code> code_;
};

/// Rewrites escapes whose meaning differs between Oniguruma and PCRE2 with UCP: \w and \W
/// follow Oniguruma's word class (letters, marks, decimal digits, connectors; PCRE2 10.42
/// has letters, all numbers and '_'). \s needs nothing: PCRE2's UCP \s already includes
/// U+0085 like Oniguruma's (the reference corpus checks it).
std::string onig_to_pcre2(std::string_view pattern);

/// Escapes a literal string for use inside a pattern.
std::string regex_escape(std::string_view literal);

}  // namespace spark::tok
