// AVX2 kernels (compiled with -mavx2 -mfma; called only after CPUID).
//
// int4: a block of 8 bytes (16 inputs) is zero-extended to 8 int32 lanes; the low nibbles
// (even inputs) and the high nibbles (odd inputs) each take a mask or shift, a subtract of 8 and a
// convert. The activations are permuted to match (quant_detail.h, block 16). Each output row is
// read once; a tile of up to 4 batch rows shares each unpacked block. Inputs after the last full
// block are done in scalar code.
#include <immintrin.h>

#include <cstdint>

#include "cpu/batch_tiles.h"
#include "cpu/quant_detail.h"

namespace colibri::kernels::detail {
namespace {

constexpr int kMaxTile = 4;  // batch rows sharing one unpacked block (16 ymm registers)
constexpr int64_t kPrefetchBytes = 2048;  // software prefetch distance (see quant_avx512.cpp)

int64_t min64(int64_t a, int64_t b) {
  return a < b ? a : b;
}

float nibble_value(const uint8_t* row, int64_t i) {
  const uint8_t b = row[i >> 1];
  return float(int((i & 1) ? (b >> 4) : (b & 15)) - 8);
}

inline float reduce_add(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 16 inputs from 8 bytes: lo = (q - 8) of the even inputs, hi = of the odd inputs.
inline void unpack16(const uint8_t* bytes, __m256& lo, __m256& hi) {
  const __m256i raw =
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  const __m256i eight = _mm256_set1_epi32(8);
  lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(raw, _mm256_set1_epi32(15)), eight));
  hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(raw, 4), eight));
}

// d[t] = partial sums of W[i0:i1] · xp_t[i0:i1] over full blocks of 16.
template <int T>
inline void int4_span(const uint8_t* row, const float* xp, int64_t cols, int64_t i0, int64_t i1,
                      __m256 (&d)[T]) {
  for (int t = 0; t < T; ++t) d[t] = _mm256_setzero_ps();
  for (int64_t i = i0; i < i1; i += 16) {
    if ((i / 2) % 64 == 0)
      _mm_prefetch(reinterpret_cast<const char*>(row + i / 2 + kPrefetchBytes), _MM_HINT_T0);
    __m256 lo, hi;
    unpack16(row + i / 2, lo, hi);
    for (int t = 0; t < T; ++t) {
      d[t] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xp + t * cols + i), d[t]);
      d[t] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xp + t * cols + i + 8), d[t]);
    }
  }
}

// One int4 output row for T batch rows (see quant_avx512.cpp's int4_row).
template <int T>
void int4_row(const uint8_t* row, const float* gscale, float row_scale, int64_t cols, int64_t span,
              const float* xp, float* y, int64_t y_stride) {
  const int64_t full = cols / 16 * 16;
  const int64_t ng = (cols + span - 1) / span;
  constexpr int R = T == 1 ? 4 : 1;  // independent running sums at n = 1
  __m256 total[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) total[r][t] = _mm256_setzero_ps();

  const auto group = [&](int64_t g, __m256(&acc)[T]) {
    const int64_t i0 = g * span;
    __m256 d[T];
    int4_span<T>(row, xp, cols, i0, min64(min64(cols, i0 + span), full), d);
    const __m256 s = _mm256_set1_ps(gscale ? gscale[g] : 1.0f);
    for (int t = 0; t < T; ++t) acc[t] = _mm256_fmadd_ps(d[t], s, acc[t]);
  };
  int64_t g = 0;
  for (; g + R <= ng; g += R) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) group(g + r, total[r]);
  }
  for (; g < ng; ++g) group(g, total[0]);

  const float tail_scale = gscale ? gscale[ng - 1] : 1.0f;
  for (int t = 0; t < T; ++t) {
    __m256 sum = total[0][t];
    for (int r = 1; r < R; ++r) sum = _mm256_add_ps(sum, total[r][t]);
    float tail = 0.0f;
    for (int64_t i = full; i < cols; ++i) tail += nibble_value(row, i) * xp[t * cols + i];
    y[t * y_stride] = row_scale * (reduce_add(sum) + tail_scale * tail);
  }
}

template <int T>
void int8_row(const int8_t* row, float scale, int64_t cols, const float* x, float* y,
              int64_t y_stride) {
  constexpr int R = T == 1 ? 4 : 1;
  const int64_t full = cols / 8 * 8;
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  const auto block = [&](int64_t i, __m256(&a)[T]) {
    if (i % 64 == 0)
      _mm_prefetch(reinterpret_cast<const char*>(row + i + kPrefetchBytes), _MM_HINT_T0);
    const __m256 wv = _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i))));
    for (int t = 0; t < T; ++t) a[t] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + t * cols + i), a[t]);
  };
  int64_t i = 0;
  for (; i + 8 * R <= full; i += 8 * R) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) block(i + 8 * r, acc[r]);
  }
  for (; i < full; i += 8) block(i, acc[0]);
  for (int t = 0; t < T; ++t) {
    __m256 sum = acc[0][t];
    for (int r = 1; r < R; ++r) sum = _mm256_add_ps(sum, acc[r][t]);
    float tail = 0.0f;
    for (int64_t k = full; k < cols; ++k) tail += float(row[k]) * x[t * cols + k];
    y[t * y_stride] = scale * (reduce_add(sum) + tail);
  }
}

}  // namespace

void rows_avx2(const QuantMatrixView& w, const float* xp, int64_t n, float* y, int64_t y_stride,
               int64_t row_begin, int64_t row_end) {
  if (w.format == QuantFormat::kInt8Row) {
    for (int64_t o = row_begin; o < row_end; ++o) {
      const int8_t* row = reinterpret_cast<const int8_t*>(w.data) + o * w.cols;
      for_tiles<kMaxTile>(n, [&]<int T>(int64_t t0) {
        int8_row<T>(row, w.scales[o], w.cols, xp + t0 * w.cols, y + t0 * y_stride + o, y_stride);
      });
    }
    return;
  }
  const int64_t rb = (w.cols + 1) / 2;
  const bool grouped = w.format == QuantFormat::kInt4Grouped;
  const int64_t span = grouped ? w.group_size : kRowFormatChunk;
  const int64_t ng = (w.cols + span - 1) / span;
  for (int64_t o = row_begin; o < row_end; ++o) {
    const uint8_t* row = w.data + o * rb;
    const float* gscale = grouped ? w.scales + o * ng : nullptr;
    const float row_scale = grouped ? 1.0f : w.scales[o];
    for_tiles<kMaxTile>(n, [&]<int T>(int64_t t0) {
      int4_row<T>(row, gscale, row_scale, w.cols, span, xp + t0 * w.cols, y + t0 * y_stride + o,
                  y_stride);
    });
  }
}

}  // namespace colibri::kernels::detail
