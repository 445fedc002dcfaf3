// UTF-8 helpers for the tokenizer: validation that splits text into valid runs and stray bytes,
// lossy decoding as Rust's String::from_utf8_lossy does it, NFC, and GPT-2's byte <-> printable
// character map used by byte-level BPE vocabularies.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace colibri::tok {

// Length in bytes of the well-formed UTF-8 sequence starting at text[pos], or 0 when the bytes
// there are not one (stray continuation byte, overlong form, surrogate, above U+10FFFF, cut off).
size_t utf8_sequence_length(std::string_view text, size_t pos);

// Length in bytes of the longest well-formed prefix of text.
size_t utf8_valid_prefix(std::string_view text);

// Length of the ill-formed run at the start of text: bytes up to the next position where a
// well-formed sequence starts (at least 1 when text is not empty and starts ill-formed).
size_t utf8_invalid_prefix(std::string_view text);

// Appends bytes to out, replacing every maximal ill-formed subpart with U+FFFD (the Unicode
// "substitution of maximal subparts" practice, which Rust and Python follow).
void append_utf8_lossy(std::string_view bytes, std::string& out);

// Decodes the code point of a well-formed sequence of the given length.
char32_t utf8_decode(const char* p, size_t length);

// Canonical composition (NFC) of well-formed UTF-8 text.
std::string nfc(std::string_view text);

// GPT-2's reversible map from the 256 byte values to printable code points (U+0021..U+0143):
// printable Latin-1 bytes map to themselves, the other 68 to U+0100 and up.
struct ByteLevelAlphabet {
  std::array<char32_t, 256> byte_to_char{};

  ByteLevelAlphabet();
  // The byte a code point stands for, or -1 when it is not in the alphabet.
  int char_to_byte(char32_t c) const { return c < 0x144 ? char_to_byte_[c] : -1; }

 private:
  std::array<int16_t, 0x144> char_to_byte_{};
};

const ByteLevelAlphabet& byte_level_alphabet();

// Maps a vocabulary entry written in the byte-level alphabet back to raw bytes. Returns false
// (and leaves out unspecified) when an entry contains a character outside the alphabet.
bool byte_level_to_bytes(std::string_view token, std::string& out);

}  // namespace colibri::tok
