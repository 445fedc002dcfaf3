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

// Every format the int8-activation kernels take (groups of multiples of 64, the last one short
// where 192 does not divide the columns).
inline constexpr FormatCase kInt8Formats[] = {{"int4-row", QuantFormat::kInt4Row, 0},
                                              {"int4-g64", QuantFormat::kInt4Grouped, 64},
                                              {"int4-g128", QuantFormat::kInt4Grouped, 128},
                                              {"int4-g192", QuantFormat::kInt4Grouped, 192},
                                              {"int8-row", QuantFormat::kInt8Row, 0}};

inline std::vector<QuantIsa> available_isas() {
  std::vector<QuantIsa> isas;
  for (QuantIsa isa : {QuantIsa::kScalar, QuantIsa::kAvx2, QuantIsa::kAvx512})
    if (quant_isa_available(isa)) isas.push_back(isa);
  return isas;
}

// f(isa) for every available ISA, and again with VNNI on where the int8 kernels of that ISA use
// it when enabled (set_vnni), and with AMX on where it is available (set_amx; only for batches of
// kAmxMinRows rows or more): every int8 kernel this machine can run. The switches are restored
// after; AMX is off in the other runs.
template <typename F>
void for_each_int8_kernel(F f) {
  const bool saved = vnni_enabled() || !vnni_available();  // the switch (on where there is no VNNI)
  const bool saved_amx = amx_enabled() || !amx_available();
  set_amx(false);
  for (QuantIsa isa : available_isas()) {
    set_vnni(false);
    f(isa);
    set_vnni(true);
    if (int8_activations_vnni(isa)) f(isa);
    if (isa == QuantIsa::kAvx512 && amx_available()) {
      set_amx(true);
      f(isa);
      set_amx(false);
    }
  }
  set_vnni(saved);
  set_amx(saved_amx);
}

inline std::vector<float> normal(int64_t count, uint32_t seed, float stddev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(static_cast<size_t>(count));
  for (float& e : v) e = dist(rng);
  return v;
}

}  // namespace colibri::kernels::test
