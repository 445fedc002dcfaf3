// cereal binary round trips for start-up, report and live-counter messages.
#pragma once

#include <cereal/archives/binary.hpp>
#include <sstream>
#include <string>

namespace colibri {

template <typename T>
std::string to_bytes(const T& value) {
  std::ostringstream out;
  {
    cereal::BinaryOutputArchive archive(out);
    archive(value);
  }
  return out.str();
}

template <typename T>
T from_bytes(const std::string& bytes) {
  std::istringstream in(bytes);
  cereal::BinaryInputArchive archive(in);
  T value;
  archive(value);
  return value;
}

}  // namespace colibri
