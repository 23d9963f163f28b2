#pragma once
// tokenizer.json "decoder": token strings -> text, with Hugging Face's decode_chain
// semantics. Supported: ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip, Sequence.
// (ByteLevel alone takes a faster path in Tokenizer::decode.)
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"

namespace spark::tok {

/// One decoding step over the list of token strings; immutable after load.
class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual void decode_chain(std::vector<std::string>& tokens) const = 0;
};

/// Builds the decoder of a tokenizer.json "decoder" value (null JSON: nullptr). Sets
/// *byte_level_only when it is ByteLevel (possibly inside a one-element Sequence).
Result<std::shared_ptr<const Decoder>> make_decoder(const nlohmann::json& j, bool* byte_level_only);

}  // namespace spark::tok
