// Fuzz target: the text of a tokenizer.json, loaded with Tokenizer::from_json_text (what
// Tokenizer::load does with the file). An accepted tokenizer must encode and decode a fixed text
// mixing ASCII, digits, whitespace runs, added-token look-alikes, non-ASCII and ill-formed UTF-8,
// giving only ids of its vocabulary.
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_target.h"
#include "tokenizer/tokenizer.h"

namespace {

constexpr std::string_view kSample =
    "Hello, world! 12345 it's 3.14\r\n\n   \t<|user|> [gMASK]<sop> caf\xc3\xa9 e\xcc\x81 "
    "\xe4\xb8\xad\xe6\x96\x87 \xf0\x9f\x98\x80 \xff\xfe\x80 end  ";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  return colibri::fuzz::run_one([&] {
    const colibri::Tokenizer tokenizer = colibri::Tokenizer::from_json_text(text, "tokenizer.json");
    for (const bool parse_special : {true, false}) {
      const std::vector<int> ids = tokenizer.encode(kSample, parse_special);
      for (const int id : ids) {
        fuzz_require(id >= 0 && size_t(id) < tokenizer.vocab_size(), "id inside the vocabulary");
        fuzz_require(tokenizer.token_to_id(tokenizer.id_to_token(id)).has_value(),
                     "every id has a token");
      }
      (void)tokenizer.decode(ids, /*skip_special=*/!parse_special);
    }
  });
}
