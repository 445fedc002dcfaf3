#include "tokenizer/added_vocabulary.h"

#include "tokenizer/unicode.h"

namespace colibri::tok {

namespace {

// Start of the last character of text (well-formed UTF-8, not empty).
size_t last_char_start(std::string_view text) {
  size_t pos = text.size() - 1;
  while (pos > 0 && (uint8_t(text[pos]) & 0xC0) == 0x80) --pos;
  return pos;
}

size_t first_char_length(std::string_view text) {
  const size_t n = utf8_sequence_length(text, 0);
  return n == 0 ? 1 : n;
}

}  // namespace

void AddedVocabulary::Trie::insert(std::string_view key, int token) {
  int node = 0;
  for (const char c : key) {
    const auto byte = static_cast<unsigned char>(c);
    int child = -1;
    for (const auto& [b, index] : nodes[size_t(node)].children)
      if (b == byte) child = index;
    if (child < 0) {
      child = int(nodes.size());
      nodes[size_t(node)].children.emplace_back(byte, child);
      nodes.emplace_back();
    }
    node = child;
  }
  nodes[size_t(node)].token = token;
  first_bytes.set(static_cast<unsigned char>(key[0]));
}

std::pair<int, size_t> AddedVocabulary::Trie::longest_at(std::string_view text, size_t pos) const {
  std::pair<int, size_t> best{-1, 0};
  int node = 0;
  for (size_t i = pos; i < text.size(); ++i) {
    const auto byte = static_cast<unsigned char>(text[i]);
    int child = -1;
    for (const auto& [b, index] : nodes[size_t(node)].children)
      if (b == byte) child = index;
    if (child < 0) break;
    node = child;
    if (nodes[size_t(node)].token >= 0) best = {nodes[size_t(node)].token, i + 1 - pos};
  }
  return best;
}

AddedVocabulary::AddedVocabulary(std::vector<AddedToken> tokens,
                                 const std::function<std::string(std::string_view)>& normalize)
    : tokens_(std::move(tokens)),
      word_char_("[\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\p{Join_Control}]", "added_tokens (\\w)"),
      white_space_("\\p{White_Space}", "added_tokens (\\s)") {
  for (size_t i = 0; i < tokens_.size(); ++i) {
    const AddedToken& token = tokens_[i];
    if (token.content.empty()) continue;  // never matches, as in the tokenizers library
    if (token.normalized) {
      const std::string key = normalize(token.content);
      if (!key.empty()) normalized_.insert(key, int(i));
    } else {
      raw_.insert(token.content, int(i));
    }
  }
}

bool AddedVocabulary::ends_with_word(std::string_view text) const {
  return !text.empty() && word_char_.matches_at_start(text.substr(last_char_start(text)));
}

bool AddedVocabulary::starts_with_word(std::string_view text) const {
  return !text.empty() && word_char_.matches_at_start(text.substr(0, first_char_length(text)));
}

size_t AddedVocabulary::whitespace_start_at_end(std::string_view text) const {
  size_t end = text.size();
  while (end > 0) {
    const size_t start = last_char_start(text.substr(0, end));
    if (!white_space_.matches_at_start(text.substr(start, end - start))) break;
    end = start;
  }
  return end;
}

size_t AddedVocabulary::whitespace_length_at_start(std::string_view text) const {
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t n = first_char_length(text.substr(pos));
    if (!white_space_.matches_at_start(text.substr(pos, n))) break;
    pos += n;
  }
  return pos;
}

// Follows AddedVocabulary::find_matches of the tokenizers library: matches come from one
// left-to-right, non-overlapping leftmost-longest scan; a match refused by single_word or
// parse_special still consumes its bytes, and rstrip does not move the scan.
void AddedVocabulary::split(std::string_view text, bool normalized_set, bool parse_special,
                            std::vector<Segment>& out) const {
  const Trie& trie = normalized_set ? normalized_ : raw_;
  size_t segment_start = 0;  // end of the previous emitted match
  size_t pos = 0;
  while (pos < text.size()) {
    if (!trie.first_bytes.test(static_cast<unsigned char>(text[pos]))) {
      ++pos;
      continue;
    }
    const auto [index, length] = trie.longest_at(text, pos);
    if (index < 0) {
      ++pos;
      continue;
    }
    const AddedToken& token = tokens_[size_t(index)];
    size_t start = pos;
    size_t stop = pos + length;
    pos = stop;
    if (token.special && !parse_special) continue;
    if (token.single_word) {
      const bool space_before = start == 0 || !ends_with_word(text.substr(0, start));
      const bool space_after = stop == text.size() || !starts_with_word(text.substr(stop));
      if (!space_before || !space_after) continue;
    }
    if (token.lstrip)
      start = std::max(whitespace_start_at_end(text.substr(0, start)), segment_start);
    if (token.rstrip) stop += whitespace_length_at_start(text.substr(stop));
    if (segment_start < start) out.push_back({{segment_start, start}, -1});
    out.push_back({{start, stop}, token.id});
    segment_start = stop;
  }
  if (segment_start < text.size()) out.push_back({{segment_start, text.size()}, -1});
}

}  // namespace colibri::tok
