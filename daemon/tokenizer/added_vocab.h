#pragma once
// Added and special tokens of a tokenizer.json ("added_tokens"): found in the text before
// pre-tokenization, leftmost-longest, with the single_word / lstrip / rstrip / normalized
// flags applied as Hugging Face applies them.
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "daemon/tokenizer/bpe.h"
#include "daemon/tokenizer/normalizer.h"

namespace spark::tok {

/// One entry of "added_tokens".
struct AddedToken {
  TokenId id = 0;
  std::string content;
  bool single_word = false, lstrip = false, rstrip = false, normalized = true, special = false;
};

/// A piece of the input: either text still to be tokenized or one added token.
struct Segment {
  std::string text;
  std::optional<TokenId> token;
  bool at_start = false;  // begins at offset 0 of the input (Metaspace "first")
};

/// Leftmost-longest multi-pattern matcher over bytes: the patterns sorted, and a match
/// narrows the range of patterns that share the text's prefix byte by byte (a trie walk
/// without the trie's nodes: memory is the patterns and one index each).
class TokenMatcher {
 public:
  /// Adds a pattern; when two are equal the first added wins. Call finish() after the last.
  void add(std::string_view pattern, size_t index);
  void finish();
  /// Longest pattern starting at text[pos]: its index and length, or {npos, 0}.
  std::pair<size_t, size_t> longest_at(std::string_view text, size_t pos) const;
  bool empty() const { return entries_.empty(); }
  bool may_start(unsigned char b) const { return first_[b]; }

 private:
  struct Entry {
    std::string pattern;
    size_t index = 0;
  };
  std::vector<Entry> entries_;  // sorted by pattern (then by order added) after finish()
  bool first_[256] = {};
};

/// More added tokens than any real tokenizer has; a tokenizer.json with more is refused.
inline constexpr size_t kMaxAddedTokens = 100000;

/// The added vocabulary; immutable after construction.
class AddedVocab {
 public:
  AddedVocab(std::vector<AddedToken> tokens, const Normalizer* normalizer);
  /// Splits `text` on added tokens (non-normalized ones on the raw text, then normalized
  /// ones on the normalized remainder, which is returned normalized). Empty pieces dropped.
  std::vector<Segment> split(std::string_view text, const Normalizer* normalizer) const;
  const std::vector<AddedToken>& tokens() const { return tokens_; }

 private:
  void split_with(std::string_view text, const TokenMatcher& m, bool at_start,
                  std::vector<Segment>& out) const;
  std::vector<AddedToken> tokens_;
  TokenMatcher raw_, normalized_;
};

}  // namespace spark::tok
