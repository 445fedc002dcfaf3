// A nesting limit for JSON read from files. nlohmann::json recurses when it copies, compares or
// dumps a value (and our tokenizer.json reader recurses on nested Sequences), so a file of
// "[[[[..." would overflow the stack long after parsing succeeded: refuse it while parsing.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "common/error.h"

namespace colibri {

// Far above any config.json, tokenizer.json or safetensors header (under 10 levels).
inline constexpr int kMaxJsonDepth = 128;

// A parser callback for nlohmann::json::parse(text, json_depth_limit(source)): throws a
// colibri::Error naming `source` at the first value nested deeper than kMaxJsonDepth.
inline auto json_depth_limit(const std::string& source) {
  return [&source](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
    if (depth > kMaxJsonDepth) fail("{}: JSON nested deeper than {} levels", source, kMaxJsonDepth);
    return true;
  };
}

}  // namespace colibri
