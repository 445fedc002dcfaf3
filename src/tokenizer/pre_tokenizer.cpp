#include "tokenizer/pre_tokenizer.h"

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "tokenizer/json_fields.h"

namespace colibri::tok {

using nlohmann::json;

namespace {

// The split pattern of the ByteLevel pre-tokenizer when use_regex is true (GPT-2's).
constexpr std::string_view kGpt2Pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

}  // namespace

void PreTokenizer::parse(const json& value, const std::string& where,
                         std::vector<std::pair<const json*, std::string>>& flat) {
  const std::string type = required_string(value, "type", where);
  if (type == "Sequence") {
    const json& list = required_field(value, "pretokenizers", where);
    if (!list.is_array()) fail("{}.pretokenizers: expected an array", where);
    for (size_t i = 0; i < list.size(); ++i)
      parse(list[i], fmt::format("{}.pretokenizers[{}]", where, i), flat);
    return;
  }
  if (type != "Split" && type != "Digits" && type != "ByteLevel")
    fail(
        "{}.type: pre-tokenizer \"{}\" is not supported (supported: Sequence, Split, Digits, "
        "ByteLevel)",
        where, type);
  flat.emplace_back(&value, where);
}

PreTokenizer::Behavior PreTokenizer::parse_behavior(const json& value, const std::string& where) {
  const std::string name = required_string(value, "behavior", where);
  if (name == "Removed") return Behavior::Removed;
  if (name == "Isolated") return Behavior::Isolated;
  if (name == "MergedWithPrevious") return Behavior::MergedWithPrevious;
  if (name == "MergedWithNext") return Behavior::MergedWithNext;
  if (name == "Contiguous") return Behavior::Contiguous;
  fail("{}.behavior: unknown split behavior \"{}\"", where, name);
}

PreTokenizer PreTokenizer::from_json(const json& value) {
  const std::string root = "pre_tokenizer";
  if (value.is_null())
    fail("{}: null; a byte-level BPE tokenizer needs a ByteLevel pre-tokenizer", root);
  if (!value.is_object()) fail("{}: expected an object", root);
  std::vector<std::pair<const json*, std::string>> flat;
  parse(value, root, flat);

  PreTokenizer result;
  bool have_byte_level = false;
  for (size_t i = 0; i < flat.size(); ++i) {
    const json& step_json = *flat[i].first;
    const std::string& where = flat[i].second;
    const std::string type = required_string(step_json, "type", where);
    if (type == "ByteLevel") {
      if (i + 1 != flat.size())
        fail("{}: ByteLevel must be the last pre-tokenizer (others after it are not supported)",
             where);
      have_byte_level = true;
      result.add_prefix_space_ = optional_bool(step_json, "add_prefix_space", where, true);
      if (optional_bool(step_json, "use_regex", where, true))
        result.byte_level_regex_ =
            std::make_shared<const Regex>(kGpt2Pattern, where + ".use_regex");
      continue;
    }
    Step step;
    if (type == "Digits") {
      // The library tests each character with Rust's char::is_numeric: categories Nd, Nl, No.
      step.kind = Kind::RegexSplit;
      step.regex = std::make_shared<const Regex>("\\p{N}", where);
      step.behavior = optional_bool(step_json, "individual_digits", where, false)
                          ? Behavior::Isolated
                          : Behavior::Contiguous;
    } else {  // Split
      const json& pattern = required_field(step_json, "pattern", where);
      if (!pattern.is_object() || pattern.size() != 1)
        fail("{}.pattern: expected {{\"Regex\": ...}} or {{\"String\": ...}}", where);
      if (pattern.contains("Regex")) {
        step.kind = Kind::RegexSplit;
        step.regex = std::make_shared<const Regex>(
            required_string(pattern, "Regex", where + ".pattern"), where + ".pattern.Regex");
      } else if (pattern.contains("String")) {
        step.kind = Kind::LiteralSplit;
        step.literal = required_string(pattern, "String", where + ".pattern");
      } else {
        fail("{}.pattern: expected {{\"Regex\": ...}} or {{\"String\": ...}}", where);
      }
      step.behavior = parse_behavior(step_json, where);
      step.invert = optional_bool(step_json, "invert", where, false);
    }
    result.steps_.push_back(std::move(step));
  }
  if (!have_byte_level)
    fail("{}: no ByteLevel pre-tokenizer; only byte-level BPE tokenizers are supported", root);
  return result;
}

// Turns the (range, is match) list covering a piece into pieces, as the tokenizers library's
// SplitDelimiterBehavior does; ranges are relative to the piece, which starts at offset.
void PreTokenizer::apply_behavior(Behavior behavior,
                                  std::vector<std::pair<ByteRange, bool>>& flagged, size_t offset,
                                  std::vector<ByteRange>& out) {
  const auto emit = [&](ByteRange r) {
    if (r.end > r.begin) out.push_back({r.begin + offset, r.end + offset});
  };
  switch (behavior) {
    case Behavior::Removed:
      for (const auto& [r, is_match] : flagged)
        if (!is_match) emit(r);
      return;
    case Behavior::Isolated:
      for (const auto& [r, is_match] : flagged) emit(r);
      return;
    case Behavior::MergedWithPrevious: {
      std::vector<ByteRange> merged;
      bool previous_match = false;
      for (const auto& [r, is_match] : flagged) {
        if (is_match && !previous_match && !merged.empty())
          merged.back().end = r.end;
        else
          merged.push_back(r);
        previous_match = is_match;
      }
      for (const ByteRange& r : merged) emit(r);
      return;
    }
    case Behavior::MergedWithNext: {
      std::vector<ByteRange> merged;
      bool previous_match = false;
      for (auto it = flagged.rbegin(); it != flagged.rend(); ++it) {
        const auto& [r, is_match] = *it;
        if (is_match && !previous_match && !merged.empty())
          merged.back().begin = r.begin;
        else
          merged.push_back(r);
        previous_match = is_match;
      }
      for (auto it = merged.rbegin(); it != merged.rend(); ++it) emit(*it);
      return;
    }
    case Behavior::Contiguous: {
      std::vector<ByteRange> merged;
      bool previous_match = false;
      for (const auto& [r, is_match] : flagged) {
        if (is_match == previous_match && !merged.empty())
          merged.back().end = r.end;
        else
          merged.push_back(r);
        previous_match = is_match;
      }
      for (const ByteRange& r : merged) emit(r);
      return;
    }
  }
}

void PreTokenizer::apply(const Step& step, std::string_view base,
                         PreTokenizerScratch& scratch) const {
  scratch.next.clear();
  for (const ByteRange& piece : scratch.pieces) {
    const std::string_view text = base.substr(piece.begin, piece.end - piece.begin);
    auto& matches = scratch.matches;
    matches.clear();
    if (step.kind == Kind::RegexSplit) {
      step.regex->find_all(text, matches);
    } else if (!step.literal.empty()) {
      for (size_t at = text.find(step.literal); at != std::string_view::npos;
           at = text.find(step.literal, at + step.literal.size()))
        matches.push_back({at, at + step.literal.size()});
    }
    auto& flagged = scratch.flagged;
    flagged.clear();
    size_t previous = 0;
    for (const ByteRange& m : matches) {
      if (previous != m.begin) flagged.push_back({{previous, m.begin}, false});
      flagged.push_back({m, true});
      previous = m.end;
    }
    if (previous != text.size()) flagged.push_back({{previous, text.size()}, false});
    if (step.invert)
      for (auto& entry : flagged) entry.second = !entry.second;
    apply_behavior(step.behavior, flagged, piece.begin, scratch.next);
  }
  scratch.pieces.swap(scratch.next);
}

void PreTokenizer::split(std::string_view text, PreTokenizerScratch& scratch,
                         std::vector<std::string_view>& pieces) const {
  pieces.clear();
  if (text.empty()) return;
  scratch.pieces.assign(1, ByteRange{0, text.size()});
  for (const Step& step : steps_) apply(step, text, scratch);

  std::string_view base = text;
  if (add_prefix_space_) {
    // Every piece that does not start with a space gets one.
    scratch.prefixed.clear();
    for (ByteRange& piece : scratch.pieces) {
      const size_t begin = scratch.prefixed.size();
      if (text[piece.begin] != ' ') scratch.prefixed.push_back(' ');
      scratch.prefixed.append(text.substr(piece.begin, piece.end - piece.begin));
      piece = {begin, scratch.prefixed.size()};
    }
    base = scratch.prefixed;
  }
  if (byte_level_regex_) {
    Step gpt2{Kind::RegexSplit, byte_level_regex_, {}, Behavior::Isolated, false};
    apply(gpt2, base, scratch);
  }
  pieces.reserve(scratch.pieces.size());
  for (const ByteRange& piece : scratch.pieces)
    pieces.push_back(base.substr(piece.begin, piece.end - piece.begin));
}

}  // namespace colibri::tok
