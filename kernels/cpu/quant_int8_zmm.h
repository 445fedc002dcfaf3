// Pieces the two AVX-512 VNNI int8-activation files share (quant_int8_avx512.cpp for the rows
// layout, quant_int8_tiles_vnni.cpp for kTiles), both compiled with the same flags. Internal
// linkage (anonymous namespace), as in quant_int8_tile8.h.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace colibri::kernels::detail {
namespace {

// Activations p[0..3] as one 32-bit word in every lane: the operand of vpdpbusd against 4 bytes of
// each weight row.
inline __m512i broadcast_word(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

}  // namespace
}  // namespace colibri::kernels::detail
