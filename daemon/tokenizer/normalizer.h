#pragma once
// tokenizer.json "normalizer": the text transforms applied before pre-tokenization.
// Supported: NFC, NFD, NFKC, NFKD (ICU), Lowercase, Strip, Prepend, Replace (string or
// regex pattern), Sequence. Anything else is an Errc::unsupported error at load.
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"

namespace spark::tok {

/// One normalization step; immutable after load.
class Normalizer {
 public:
  virtual ~Normalizer() = default;
  /// Rewrites `text` (valid UTF-8) in place.
  virtual void apply(std::string& text) const = 0;
};

/// Builds the normalizer described by a tokenizer.json "normalizer" value; null JSON gives
/// a null pointer (no normalization).
Result<std::shared_ptr<const Normalizer>> make_normalizer(const nlohmann::json& j);

}  // namespace spark::tok
