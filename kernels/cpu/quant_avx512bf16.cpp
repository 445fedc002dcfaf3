// The int4 kernel for one activation row on CPUs with AVX512_BF16 (compiled with -mavx512bf16;
// called only after CPUID). Each full block of 64 inputs is one 32-byte load: the bytes widen to
// 16-bit lanes, and one vpermw per nibble (low, then high after a shift) reads the nibble's
// BF16 value q - 8 from a table. vdpbf16ps multiplies them with the row's BF16 pairs (the
// activation layout of quant_detail.h: x = hi + lo, two BF16 each) and sums pairs into fp32
// lanes; the block's 16 lane sums are scaled by its group scale into one of four running sums.
// Per 32 weight bytes that is 10 instructions where the fp32 kernel needs 19, which is what
// limits it at one row (it reads at ~0.73 of the memory bandwidth on one core, this one ~0.85).
#include <immintrin.h>

#include <cstdint>

#include "cpu/quant_detail.h"

// GCC 12 warns inside the intrinsic headers (their _mm512_undefined_* operands, GCC PR 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace colibri::kernels::detail {
namespace {

constexpr int64_t kBlock = 64;
// Software prefetch this far ahead in a weight row, as in quant_avx512.cpp.
constexpr int64_t kPrefetchBytes = 4096;

float nibble_value(const uint8_t* row, int64_t i) {
  const uint8_t b = row[i >> 1];
  return float(int((i & 1) ? (b >> 4) : (b & 15)) - 8);
}

// BF16 bits of q - 8 for the low 4 bits of each index (vpermw reads 5 index bits: the table
// repeats).
__m512i nibble_table() {
  alignas(64) static constexpr uint16_t kValues[16] = {
      0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,  // -8 .. -1
      0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,  // 0 .. 7
  };
  const __m256i half = _mm256_load_si256(reinterpret_cast<const __m256i*>(kValues));
  return _mm512_inserti64x4(_mm512_castsi256_si512(half), half, 1);
}

// PerGroup: blocks per scale group (1, 2 or 4 for groups of 64, 128, 256; 3 for 192), or 0 for
// the per-row format (scale 1 here, the row scale applied by the caller). Compile-time, so that
// the block's scale index is a shift: a division or a branch per block costs more than its math.
template <int PerGroup>
[[gnu::flatten]] float int4_row(const uint8_t* row, const float* scales, int64_t cols,
                                const uint16_t* xb, const float* x_tail) {
  const __m512i table = nibble_table();
  __m512 total[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
  const int64_t blocks = cols / kBlock;
  const auto block = [&]<int u>(int64_t b) {
    const uint8_t* bytes = row + b * (kBlock / 2);
    if constexpr (u % 2 == 0)
      _mm_prefetch(reinterpret_cast<const char*>(bytes + kPrefetchBytes), _MM_HINT_T0);
    const __m512i wide =
        _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)));
    const __m512bh even = (__m512bh)_mm512_permutexvar_epi16(wide, table);
    const __m512bh odd = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(wide, 4), table);
    const uint16_t* xs = xb + b * 2 * kBlock;
    const auto pairs = [&](int k) { return (__m512bh)_mm512_loadu_si512(xs + 32 * k); };
    __m512 d = _mm512_dpbf16_ps(_mm512_setzero_ps(), even, pairs(0));
    d = _mm512_dpbf16_ps(d, odd, pairs(1));
    d = _mm512_dpbf16_ps(d, even, pairs(2));
    d = _mm512_dpbf16_ps(d, odd, pairs(3));
    if constexpr (PerGroup == 0)
      total[u] = _mm512_add_ps(d, total[u]);
    else
      total[u] = _mm512_fmadd_ps(d, _mm512_set1_ps(scales[b / PerGroup]), total[u]);
  };
  int64_t b = 0;
  for (; b + 4 <= blocks; b += 4) {
    block.template operator()<0>(b);
    block.template operator()<1>(b + 1);
    block.template operator()<2>(b + 2);
    block.template operator()<3>(b + 3);
  }
  for (; b < blocks; ++b) block.template operator()<0>(b);
  float tail = 0.0f;  // inputs after the last full block, natural order
  for (int64_t k = blocks * kBlock; k < cols; ++k)
    tail += nibble_value(row, k) * (PerGroup ? scales[k / (PerGroup * kBlock)] : 1.0f) * x_tail[k];
  const __m512 sum =
      _mm512_add_ps(_mm512_add_ps(total[0], total[1]), _mm512_add_ps(total[2], total[3]));
  return _mm512_reduce_add_ps(sum) + tail;
}

template <int PerGroup>
void int4_rows(const QuantMatrixView& w, const float* xp, float* y, int64_t row_begin,
               int64_t row_end) {
  const int64_t rb = (w.cols + 1) / 2;
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(xp);
  if constexpr (PerGroup == 0) {
    for (int64_t o = row_begin; o < row_end; ++o)
      y[o] = w.scales[o] * int4_row<0>(w.data + o * rb, nullptr, w.cols, xb, xp);
  } else {
    const int64_t ng = (w.cols + w.group_size - 1) / w.group_size;
    for (int64_t o = row_begin; o < row_end; ++o)
      y[o] = int4_row<PerGroup>(w.data + o * rb, w.scales + o * ng, w.cols, xb, xp);
  }
}

}  // namespace

void bf16_pairs_avx512bf16(const float* x, int64_t cols, float* xp) {
  alignas(64) static constexpr uint16_t kEven[32] = {0,  2,  4,  6,  8,  10, 12, 14, 16, 18, 20,
                                                     22, 24, 26, 28, 30, 32, 34, 36, 38, 40, 42,
                                                     44, 46, 48, 50, 52, 54, 56, 58, 60, 62};
  const __m512i even = _mm512_load_si512(kEven);
  const __m512i odd = _mm512_add_epi16(even, _mm512_set1_epi16(1));
  const auto widen = [](__m256i bf16) {  // 16 BF16 values as fp32
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16));
  };
  const int64_t full = cols / kBlock * kBlock;
  for (int64_t k = 0; k < full; k += kBlock) {
    __m512 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm512_loadu_ps(x + k + 16 * i);
    __m512i hi[2], lo[2];  // inputs 0..31 and 32..63, in order
    for (int h = 0; h < 2; ++h) {
      hi[h] = (__m512i)_mm512_cvtne2ps_pbh(v[2 * h + 1], v[2 * h]);
      const __m512 r0 = _mm512_sub_ps(v[2 * h], widen(_mm512_castsi512_si256(hi[h])));
      const __m512 r1 = _mm512_sub_ps(v[2 * h + 1], widen(_mm512_extracti64x4_epi64(hi[h], 1)));
      lo[h] = (__m512i)_mm512_cvtne2ps_pbh(r1, r0);
    }
    __m512i* out = reinterpret_cast<__m512i*>(xp + k);
    _mm512_storeu_si512(out + 0, _mm512_permutex2var_epi16(hi[0], even, hi[1]));
    _mm512_storeu_si512(out + 1, _mm512_permutex2var_epi16(hi[0], odd, hi[1]));
    _mm512_storeu_si512(out + 2, _mm512_permutex2var_epi16(lo[0], even, lo[1]));
    _mm512_storeu_si512(out + 3, _mm512_permutex2var_epi16(lo[0], odd, lo[1]));
  }
  if (xp != x)
    for (int64_t i = full; i < cols; ++i) xp[i] = x[i];
}

void rows_avx512bf16(const QuantMatrixView& w, const float* xp, int64_t n, float* y,
                     int64_t y_stride, int64_t row_begin, int64_t row_end) {
  (void)n;
  (void)y_stride;  // one activation row
  if (w.format == QuantFormat::kInt4Row) return int4_rows<0>(w, xp, y, row_begin, row_end);
  switch (w.group_size) {
    case 64:
      return int4_rows<1>(w, xp, y, row_begin, row_end);
    case 128:
      return int4_rows<2>(w, xp, y, row_begin, row_end);
    case 192:
      return int4_rows<3>(w, xp, y, row_begin, row_end);
    default:  // 256, the last multiple of 64 the container allows
      return int4_rows<4>(w, xp, y, row_begin, row_end);
  }
}

}  // namespace colibri::kernels::detail
