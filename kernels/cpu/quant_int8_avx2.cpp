// int8-activation kernels for AVX2 (compiled with -mavx2 -mfma; called only after CPUID), also
// used on AVX-512 CPUs without VNNI: the 8-row tile kernel of quant_int8_tile8.h with pmaddubsw,
// and the activation quantizer. The operations: quant_int8_detail.h.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "cpu/quant_int8_detail.h"
#include "cpu/quant_int8_tile8.h"

namespace colibri::kernels::detail {

float quantize_block_avx2(const float* x, int64_t cols, int64_t k, int q[kInt8Block]) {
  const int64_t i0 = k * kInt8Block, count = std::max<int64_t>(0, std::min(cols - i0, kInt8Block));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[8];
  __m256 amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  for (int c = 0; c < 8; ++c) {
    const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(count - 8 * c)), lane);
    v[c] = _mm256_maskload_ps(x + i0 + 8 * c, m);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[c], v[c], _CMP_UNORD_Q));
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[c]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float a = _mm_cvtss_f32(m4);
  for (int j = 0; j < kInt8Block; ++j) q[j] = 0;
  if (_mm256_movemask_ps(nan) != 0 || !(a <= 3.4028235e38f)) return __builtin_nanf("");
  const float inv_a = 127.0f / a;
  if (!(inv_a <= 3.4028235e38f)) return 0.0f;  // zero, or below ~3.7e-37
  const __m256 inv = _mm256_set1_ps(inv_a);
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  for (int c = 0; c < 8; ++c) {
    const __m256 r =
        _mm256_round_ps(_mm256_mul_ps(v[c], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 8 * c),
                        _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi)));
  }
  return a / 127.0f;
}

void int8_rows_avx2(const QuantMatrixView& w, const Int8Rows& x, float* y, int64_t y_stride,
                    int64_t row_begin, int64_t row_end) {
  tile8::rows<false>(w, x, y, y_stride, row_begin, row_end);
}

}  // namespace colibri::kernels::detail
