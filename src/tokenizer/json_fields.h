// Field access for tokenizer.json with errors that name the JSON path ("model.merges[3]").
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "common/error.h"

namespace colibri::tok {

inline const nlohmann::json& required_field(const nlohmann::json& object, const char* key,
                                            const std::string& where) {
  if (!object.is_object()) fail("{}: expected an object", where);
  const auto it = object.find(key);
  if (it == object.end()) fail("{}.{}: missing", where, key);
  return *it;
}

inline std::string required_string(const nlohmann::json& object, const char* key,
                                   const std::string& where) {
  const nlohmann::json& value = required_field(object, key, where);
  if (!value.is_string()) fail("{}.{}: expected a string, got {}", where, key, value.type_name());
  return value.get<std::string>();
}

// A missing key or null gives `fallback`.
inline bool optional_bool(const nlohmann::json& object, const char* key, const std::string& where,
                          bool fallback) {
  const auto it = object.find(key);
  if (it == object.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) fail("{}.{}: expected true or false, got {}", where, key, it->type_name());
  return it->get<bool>();
}

}  // namespace colibri::tok
