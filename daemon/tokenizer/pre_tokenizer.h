#pragma once
// tokenizer.json "pre_tokenizer": splits normalized text into words for the BPE model.
// Supported: Split (regex or string; Removed, Isolated, MergedWithPrevious,
// MergedWithNext, Contiguous; invert), ByteLevel (add_prefix_space, use_regex), Metaspace
// (replacement, prepend_scheme always/first/never, split), Digits, Sequence. Anything else is an
// Errc::unsupported error at load.
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"

namespace spark::tok {

/// One pre-tokenization step; immutable after load, safe to share between threads.
class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  /// Replaces `pieces` by their sub-pieces (empty pieces are dropped, as in Hugging Face).
  /// `at_start`: pieces[0] begins at offset 0 of the input (Metaspace's "first" scheme).
  virtual void split(std::vector<std::string>& pieces, bool at_start) const = 0;
};

/// Builds the pre-tokenizer described by a tokenizer.json "pre_tokenizer" value; null JSON
/// gives a null pointer (the whole text is one word).
Result<std::shared_ptr<const PreTokenizer>> make_pre_tokenizer(const nlohmann::json& j);

}  // namespace spark::tok
