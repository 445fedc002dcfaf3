#include "tokenizer/unicode.h"

#include <utf8proc.h>

#include <cstdlib>
#include <memory>

#include "common/error.h"

namespace colibri::tok {

namespace {

// Allowed range of the second byte of a sequence, by lead byte (Unicode Table 3-7); the third and
// fourth bytes are always 0x80..0xBF.
struct LeadInfo {
  uint8_t length;  // 0: not a lead byte
  uint8_t second_lo;
  uint8_t second_hi;
};

LeadInfo lead_info(uint8_t b) {
  if (b < 0x80) return {1, 0, 0};
  if (b >= 0xC2 && b <= 0xDF) return {2, 0x80, 0xBF};
  if (b == 0xE0) return {3, 0xA0, 0xBF};
  if (b == 0xED) return {3, 0x80, 0x9F};
  if (b >= 0xE1 && b <= 0xEF) return {3, 0x80, 0xBF};
  if (b == 0xF0) return {4, 0x90, 0xBF};
  if (b >= 0xF1 && b <= 0xF3) return {4, 0x80, 0xBF};
  if (b == 0xF4) return {4, 0x80, 0x8F};
  return {0, 0, 0};
}

// Bytes of the sequence at pos that are consistent with a well-formed sequence (at least 1), and
// whether they complete it.
size_t maximal_subpart(std::string_view text, size_t pos, bool& complete) {
  const auto byte = [&](size_t i) { return uint8_t(text[i]); };
  const LeadInfo info = lead_info(byte(pos));
  complete = false;
  if (info.length == 0) return 1;
  if (info.length == 1) {
    complete = true;
    return 1;
  }
  size_t n = 1;
  if (pos + n >= text.size()) return n;
  if (byte(pos + n) < info.second_lo || byte(pos + n) > info.second_hi) return n;
  ++n;
  while (n < info.length) {
    if (pos + n >= text.size() || (byte(pos + n) & 0xC0) != 0x80) return n;
    ++n;
  }
  complete = true;
  return n;
}

}  // namespace

size_t utf8_sequence_length(std::string_view text, size_t pos) {
  bool complete;
  const size_t n = maximal_subpart(text, pos, complete);
  return complete ? n : 0;
}

size_t utf8_valid_prefix(std::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    if (uint8_t(text[pos]) < 0x80) {
      ++pos;
      continue;
    }
    const size_t n = utf8_sequence_length(text, pos);
    if (n == 0) break;
    pos += n;
  }
  return pos;
}

size_t utf8_invalid_prefix(std::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    bool complete;
    const size_t n = maximal_subpart(text, pos, complete);
    if (complete) break;
    pos += n;
  }
  return pos;
}

void append_utf8_lossy(std::string_view bytes, std::string& out) {
  size_t pos = 0;
  while (pos < bytes.size()) {
    const size_t valid = utf8_valid_prefix(bytes.substr(pos));
    out.append(bytes.data() + pos, valid);
    pos += valid;
    if (pos == bytes.size()) break;
    bool complete;
    pos += maximal_subpart(bytes, pos, complete);
    out.append("\xEF\xBF\xBD");
  }
}

char32_t utf8_decode(const char* p, size_t length) {
  const auto b = [&](size_t i) { return char32_t(uint8_t(p[i])); };
  switch (length) {
    case 1:
      return b(0);
    case 2:
      return ((b(0) & 0x1F) << 6) | (b(1) & 0x3F);
    case 3:
      return ((b(0) & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
    default:
      return ((b(0) & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
  }
}

std::string nfc(std::string_view text) {
  // ASCII is its own NFC; most text pieces take this path.
  bool ascii = true;
  for (char c : text) ascii = ascii && uint8_t(c) < 0x80;
  if (ascii) return std::string(text);
  utf8proc_uint8_t* composed = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()),
                                          utf8proc_ssize_t(text.size()), &composed,
                                          utf8proc_option_t(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (n < 0) fail("NFC normalization failed: {}", utf8proc_errmsg(n));
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owner(composed, &std::free);
  return std::string(reinterpret_cast<const char*>(composed), size_t(n));
}

ByteLevelAlphabet::ByteLevelAlphabet() {
  char_to_byte_.fill(-1);
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const char32_t c = printable ? char32_t(b) : next++;
    byte_to_char[b] = c;
    char_to_byte_[c] = int16_t(b);
  }
}

const ByteLevelAlphabet& byte_level_alphabet() {
  static const ByteLevelAlphabet alphabet;
  return alphabet;
}

bool byte_level_to_bytes(std::string_view token, std::string& out) {
  const ByteLevelAlphabet& alphabet = byte_level_alphabet();
  out.clear();
  size_t pos = 0;
  while (pos < token.size()) {
    const size_t n = utf8_sequence_length(token, pos);
    if (n == 0) return false;
    const int b = alphabet.char_to_byte(utf8_decode(token.data() + pos, n));
    if (b < 0) return false;
    out.push_back(char(b));
    pos += n;
  }
  return true;
}

}  // namespace colibri::tok
