#pragma once
// GPT-2's reversible byte <-> printable code point mapping used by byte-level BPE: every
// byte maps to one visible character (' ' -> 'Ġ', '\n' -> 'Ċ'), so vocabularies can be
// stored as JSON text.
#include <string>
#include <string_view>

namespace spark::tok {

/// The code point byte b is written as.
char32_t byte_to_char(unsigned char b);
/// The byte code point cp stands for, or -1 when cp is not in the byte alphabet.
int char_to_byte(char32_t cp);
/// Maps every byte of `text` to its byte-level character (UTF-8 out).
std::string bytes_to_byte_level(std::string_view text);
/// Inverse of bytes_to_byte_level for a token: when every character is in the byte
/// alphabet, the bytes it stands for; otherwise the token's own UTF-8 bytes (what
/// Hugging Face's ByteLevel decoder does for added tokens such as "<|im_end|>" that
/// contain characters outside it).
std::string byte_level_to_bytes(std::string_view token);

}  // namespace spark::tok
