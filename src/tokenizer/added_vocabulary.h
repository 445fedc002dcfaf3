// The "added_tokens" of a tokenizer.json: tokens matched in the text before the pre-tokenizer,
// leftmost-longest, with the single_word, lstrip and rstrip options, as the tokenizers library's
// AddedVocabulary does.
#pragma once

#include <bitset>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/regex.h"

namespace colibri::tok {

struct AddedToken {
  int id = -1;
  std::string content;
  bool single_word = false;  // only where it is not inside a word
  bool lstrip = false;       // takes the whitespace on its left with it
  bool rstrip = false;       // takes the whitespace on its right with it
  bool normalized = true;    // matched in the normalized text (else in the input text)
  bool special = false;  // dropped by decode(skip_special); left as text when parse_special is off
};

class AddedVocabulary {
 public:
  // normalize: the tokenizer's normalizer, applied to the content of `normalized` tokens.
  AddedVocabulary(std::vector<AddedToken> tokens,
                  const std::function<std::string(std::string_view)>& normalize);

  // A piece of the input: an added token (id >= 0) or text for the next stage (id < 0).
  struct Segment {
    ByteRange range;
    int id;
  };

  // Cuts text at the tokens of one set: those matched before normalization (normalized_set
  // false) or after. With parse_special false, special tokens are not matched.
  void split(std::string_view text, bool normalized_set, bool parse_special,
             std::vector<Segment>& out) const;

  const std::vector<AddedToken>& tokens() const { return tokens_; }

 private:
  struct Trie {
    struct Node {
      std::vector<std::pair<unsigned char, int>> children;
      int token = -1;  // index into tokens_
    };
    std::vector<Node> nodes{1};
    std::bitset<256> first_bytes;
    void insert(std::string_view key, int token);
    // Longest key starting at text[pos]: token index and length, or token -1.
    std::pair<int, size_t> longest_at(std::string_view text, size_t pos) const;
  };

  bool ends_with_word(std::string_view text) const;
  bool starts_with_word(std::string_view text) const;
  size_t whitespace_start_at_end(std::string_view text) const;
  size_t whitespace_length_at_start(std::string_view text) const;

  std::vector<AddedToken> tokens_;
  Trie raw_;
  Trie normalized_;
  // Rust regex's \w and \s, which the tokenizers library uses for these options.
  Regex word_char_;
  Regex white_space_;
};

}  // namespace colibri::tok
