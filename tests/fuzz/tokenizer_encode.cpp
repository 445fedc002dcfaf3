// Fuzz target: text given to Tokenizer::encode with the embedded model's tokenizer (byte-level
// BPE, no normalizer, special added tokens without lstrip/rstrip), so that encoding must be
// lossless: decode_bytes(encode(text)) == text for any bytes, ill-formed UTF-8 included. The
// first byte chooses parse_special.
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_target.h"
#include "tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const colibri::Tokenizer tokenizer =
      colibri::Tokenizer::load(COLIBRI_SOURCE_DIR "/models/glm5-tiny-kjv/tokenizer.json");
  if (size == 0) return 0;
  const bool parse_special = data[0] & 1;
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  return colibri::fuzz::run_one([&] {
    const std::vector<int> ids = tokenizer.encode(text, parse_special);
    for (const int id : ids)
      fuzz_require(id >= 0 && size_t(id) < tokenizer.vocab_size(), "id inside the vocabulary");
    fuzz_require(tokenizer.decode_bytes(ids) == text, "decode_bytes(encode(text)) == text");
    if (!parse_special)
      for (const int id : ids) fuzz_require(!tokenizer.is_special(id), "no special ids");
  });
}
