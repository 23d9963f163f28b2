#pragma once
// Base64 (RFC 4648, padded), through OpenSSL's encoder: binary payloads inside JSON replies
// (a node's capture archive in its diagnostics bundle).
#include <optional>
#include <string>
#include <string_view>

namespace spark {

/// Standard padded base64 of bytes.
std::string base64_encode(std::string_view bytes);
/// The bytes of standard base64 text; nullopt when it is not base64.
std::optional<std::string> base64_decode(std::string_view text);

}  // namespace spark
