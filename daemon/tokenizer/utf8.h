#pragma once
// UTF-8 helpers with the exact semantics the tokenizer needs: decoding of valid text,
// lossy conversion that matches Rust's String::from_utf8_lossy (one U+FFFD per maximal
// invalid subpart), and detection of an incomplete sequence at the end of a byte stream.
#include <cstddef>
#include <string>
#include <string_view>

namespace spark::tok {

/// Decodes the code point starting at s[i] of valid UTF-8; returns its byte length.
size_t utf8_next(std::string_view s, size_t i, char32_t* cp);
/// Appends the UTF-8 encoding of cp.
void utf8_append(std::string& out, char32_t cp);
/// Byte length of a UTF-8 sequence that starts with lead byte b (1 for invalid bytes).
size_t utf8_seq_len(unsigned char b);
/// True when `bytes` is entirely valid UTF-8.
bool utf8_valid(std::string_view bytes);
/// Replaces every maximal invalid subpart with U+FFFD (Rust from_utf8_lossy semantics).
std::string utf8_lossy(std::string_view bytes);
/// Number of trailing bytes that form a valid but incomplete UTF-8 sequence (0..3):
/// a stream decoder holds these back until the next bytes arrive.
size_t utf8_incomplete_tail(std::string_view bytes);

}  // namespace spark::tok
