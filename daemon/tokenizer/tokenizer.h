#pragma once
// A Hugging Face tokenizer.json BPE tokenizer (byte-level, or SentencePiece-style with byte
// fallback): encode/decode give exactly what the `tokenizers` library gives
// (tests/daemon/tokenizer_reference_test.cc checks it against references the library produced).
// Pipeline: added/special tokens are cut out of the text, the rest is normalized, pre-tokenized,
// BPE-merged, and the post-processor adds BOS/EOS when asked. Decoding maps byte-level characters
// back to bytes.
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "daemon/tokenizer/bpe.h"

namespace spark::tok {

struct AddedToken;

/// A loaded tokenizer; cheap to copy (shared, immutable state), const methods thread-safe.
class Tokenizer {
 public:
  /// Parses tokenizer.json text. `origin` (a path) prefixes error messages.
  static Result<Tokenizer> from_json(std::string_view json, std::string_view origin);
  /// Reads and parses a tokenizer.json file.
  static Result<Tokenizer> from_file(const std::string& path);

  /// Token ids of `text`. Invalid UTF-8 is first replaced by U+FFFD. With
  /// add_special_tokens the post-processor's template (e.g. BOS) is applied.
  std::vector<TokenId> encode(std::string_view text, bool add_special_tokens) const;
  /// Text of `ids`; ids outside the vocabulary are skipped, invalid UTF-8 becomes U+FFFD.
  std::string decode(std::span<const TokenId> ids, bool skip_special_tokens) const;

  /// Id of a token string (added tokens first, then the model vocabulary).
  std::optional<TokenId> token_to_id(std::string_view token) const;
  /// Token string of an id (as stored in tokenizer.json).
  std::optional<std::string> id_to_token(TokenId id) const;
  /// One more than the largest id (model or added).
  size_t vocab_size() const;
  /// True for added tokens marked special.
  bool is_special(TokenId id) const;
  /// All added tokens, as loaded.
  const std::vector<AddedToken>& added_tokens() const;
  /// The bytes `id` contributes when decoded (empty for unknown ids); streaming uses it.
  std::string_view token_bytes(TokenId id) const;
  /// True when decoding is a plain concatenation of token_bytes (ByteLevel decoder).
  bool byte_level_decoder() const;

  /// Marks every spelling of a special token in `text` (client-supplied message content)
  /// so that encode() reads it as plain text instead of that token: "<|im_start|>" typed
  /// by a user must not open a turn. The mark is U+FDD0, a noncharacter reserved for
  /// internal use; one already in `text` becomes U+FFFD. encode() removes the marks.
  std::string escape_special(std::string_view text) const;

  struct Impl;

 private:
  std::shared_ptr<const Impl> impl_;
};

/// The mark escape_special() puts after the first byte of a special token's spelling.
inline constexpr std::string_view kLiteralMark = "\xEF\xB7\x90";  // U+FDD0

/// Incremental detokenizer for streaming: push() returns the new text, never a broken
/// UTF-8 sequence (incomplete bytes are held until they complete). With the ByteLevel
/// decoder the concatenation of all push() results and finish() equals Tokenizer::decode
/// of all ids; with other decoders it follows Hugging Face's DecodeStream (a sliding window).
class StreamDecoder {
 public:
  StreamDecoder(const Tokenizer& tok, bool skip_special_tokens);
  /// Adds one id; returns the text that became final.
  std::string push(TokenId id);
  /// Flushes held bytes (an incomplete sequence becomes U+FFFD).
  std::string finish();

 private:
  const Tokenizer* tok_;
  bool skip_special_;
  std::string pending_;  // bytes not yet emitted (ByteLevel decoders)
  // Other decoders (Hugging Face DecodeStream): a window of ids and its decoded text.
  std::vector<TokenId> ids_;
  std::string prefix_;
  size_t prefix_index_ = 0;
};

}  // namespace spark::tok
