// What the quantized-kernel tests share: a format with its group size, the ISAs this machine
// has, and normally distributed inputs.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "cpu/quant.h"

namespace colibri::kernels::test {

struct FormatCase {
  const char* name;
  QuantFormat format;
  int group_size;
};

inline std::vector<QuantIsa> available_isas() {
  std::vector<QuantIsa> isas;
  for (QuantIsa isa : {QuantIsa::kScalar, QuantIsa::kAvx2, QuantIsa::kAvx512})
    if (quant_isa_available(isa)) isas.push_back(isa);
  return isas;
}

inline std::vector<float> normal(int64_t count, uint32_t seed, float stddev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(static_cast<size_t>(count));
  for (float& e : v) e = dist(rng);
  return v;
}

}  // namespace colibri::kernels::test
