// A Hugging Face tokenizer.json for byte-level BPE models (GLM-5.x, DeepSeek-V3, Qwen3 style),
// giving the ids the `tokenizers` library gives for encode(text, add_special_tokens=False).
//
// Supported: model BPE (vocab; merges as "a b" strings or [a, b] pairs; ignore_merges; unk_token,
// fuse_unk), added_tokens (special or not; single_word, lstrip, rstrip, normalized), normalizer
// null / NFC / Sequence of NFC, pre_tokenizer Sequence of Split (Regex or String, every behavior,
// invert), Digits and a final ByteLevel (add_prefix_space, use_regex), decoder ByteLevel or a
// Sequence of it. post_processor is read past: encode never adds BOS/EOS, the chat template
// does. Anything else is refused at load with an Error naming the JSON path.
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace colibri {

class Tokenizer {
 public:
  // Reads and validates a tokenizer.json; throws colibri::Error naming the file and field.
  static Tokenizer load(const std::filesystem::path& path);
  // The same from the file's text; `origin` names it in errors.
  static Tokenizer from_json_text(std::string_view json_text, const std::string& origin);

  // Token ids of text. With parse_special, added tokens marked special are recognised in the
  // text ("<|user|>" becomes one id); without, they are encoded as plain text. Non-special added
  // tokens are always recognised. Bytes that are not well-formed UTF-8 are encoded as byte tokens
  // on their own (the tokenizers library cannot be given such input).
  std::vector<int> encode(std::string_view text, bool parse_special = true) const;

  // Text of ids, as the tokenizers library decodes: ill-formed UTF-8 across the ids becomes
  // U+FFFD, ids not in the vocabulary are skipped, special tokens too when skip_special.
  std::string decode(std::span<const int> ids, bool skip_special = false) const;
  // The raw bytes of ids, without U+FFFD replacement: for streaming, where a character may be
  // split across calls.
  std::string decode_bytes(std::span<const int> ids, bool skip_special = false) const;

  // Id of a vocabulary entry (in its tokenizer.json spelling, e.g. "Ġthe") or added token.
  std::optional<int> token_to_id(std::string_view token) const;
  // The tokenizer.json spelling of id; throws colibri::Error for an id not in the vocabulary.
  std::string id_to_token(int id) const;
  // One past the largest id of the model vocabulary and the added tokens.
  size_t vocab_size() const;
  // Whether id is an added token marked special.
  bool is_special(int id) const;

  // Whether text is normalized (NFC) before the pre-tokenizer.
  bool normalizes() const;

 private:
  struct Impl;
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;  // immutable; the piece cache inside is thread-safe
};

}  // namespace colibri
