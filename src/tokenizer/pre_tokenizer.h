// The "pre_tokenizer" of a byte-level tokenizer.json: Split (regex or literal), Digits and a final
// ByteLevel step, in a Sequence or alone. It cuts a text into the pieces the BPE model encodes.
#pragma once

#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/regex.h"

namespace colibri::tok {

// Buffers reused between calls, one per thread.
struct PreTokenizerScratch {
  std::string prefixed;  // pieces with the ByteLevel prefix space
  std::vector<ByteRange> pieces, next, matches;
  std::vector<std::pair<ByteRange, bool>> flagged;  // (range, is a match)
};

class PreTokenizer {
 public:
  // Parses the "pre_tokenizer" value; errors name the JSON path of the offending field.
  static PreTokenizer from_json(const nlohmann::json& value);

  // Cuts text (well-formed UTF-8) into non-empty pieces, in order. The views point into text or
  // into scratch and stay valid until scratch is used again.
  void split(std::string_view text, PreTokenizerScratch& scratch,
             std::vector<std::string_view>& pieces) const;

 private:
  enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };
  enum class Kind { RegexSplit, LiteralSplit };  // Digits is a RegexSplit on \p{N}
  struct Step {
    Kind kind;
    std::shared_ptr<const Regex> regex;  // RegexSplit
    std::string literal;                 // LiteralSplit
    Behavior behavior = Behavior::Isolated;
    bool invert = false;
  };

  static void parse(const nlohmann::json& value, const std::string& where,
                    std::vector<std::pair<const nlohmann::json*, std::string>>& flat);
  static Behavior parse_behavior(const nlohmann::json& value, const std::string& where);
  static void apply_behavior(Behavior behavior, std::vector<std::pair<ByteRange, bool>>& flagged,
                             size_t offset, std::vector<ByteRange>& out);
  void apply(const Step& step, std::string_view base, PreTokenizerScratch& scratch) const;

  std::vector<Step> steps_;  // before the ByteLevel step
  bool add_prefix_space_ = false;
  std::shared_ptr<const Regex> byte_level_regex_;  // GPT-2's pattern when use_regex
};

}  // namespace colibri::tok
