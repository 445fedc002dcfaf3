// The transformers goldens of the embedded model (tools/make_embedded_goldens.py), read from
// tests/data/embedded/ and shared by the single-process, MPI and CLI tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/npy.h"

namespace colibri::embedded {

inline const std::filesystem::path kModelDir = COLIBRI_EMBEDDED_MODEL;
inline const std::filesystem::path kDataDir = std::filesystem::path(COLIBRI_TEST_DATA) / "embedded";

// Bounds of the acceptance: per-logit error of a window, relative perplexity error of the score.
constexpr float kMaxLogitError = 1e-3f;
constexpr double kMaxPerplexityRelError = 5e-3;

inline nlohmann::json read_json(const std::filesystem::path& path) {
  std::ifstream file(path);
  if (!file) fail("{}: cannot open", path.string());
  return nlohmann::json::parse(file);
}

inline std::string read_text(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) fail("{}: cannot open", path.string());
  std::ostringstream text;
  text << file.rdbuf();
  return text.str();
}

struct Window {
  std::string start;     // "Book chapter:verse" of the first full verse
  std::vector<int> ids;  // [T]
  NpyArray logits;       // [T, vocab]
};

inline std::vector<Window> read_windows() {
  const nlohmann::json meta = read_json(kDataDir / "windows.json");
  std::vector<Window> windows;
  for (const auto& w : meta.at("windows"))
    windows.push_back({w.at("start").get<std::string>(), w.at("ids").get<std::vector<int>>(),
                       read_npy_f32(kDataDir / w.at("file").get<std::string>())});
  return windows;
}

struct LogitComparison {
  float max_abs_error = 0;
  int argmax_mismatches = 0;
  int first_mismatch = -1;  // position of the first differing argmax
};

// Compares actual [rows, vocab] with golden [rows, vocab] row by row.
inline LogitComparison compare_logits(std::span<const float> actual, const NpyArray& golden) {
  const size_t vocab = size_t(golden.shape.at(1));
  LogitComparison result;
  for (size_t row = 0; (row + 1) * vocab <= std::min(actual.size(), golden.data.size()); ++row) {
    const float* got = &actual[row * vocab];
    const float* want = &golden.data[row * vocab];
    for (size_t v = 0; v < vocab; ++v)
      result.max_abs_error = std::max(result.max_abs_error, std::abs(got[v] - want[v]));
    if (std::max_element(got, got + vocab) - got != std::max_element(want, want + vocab) - want) {
      if (result.argmax_mismatches++ == 0) result.first_mismatch = int(row);
    }
  }
  return result;
}

}  // namespace colibri::embedded
