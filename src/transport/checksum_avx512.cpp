// The block sums with AVX-512 (compiled with -mavx512f; called only after CPUID): a block's 16
// lanes in one register.
#include <immintrin.h>

#include "transport/checksum.h"

namespace colibri::wire::detail {

void sum_blocks_avx512(uint32_t* a, uint32_t* b, const std::byte* data, size_t blocks) {
  __m512i va = _mm512_loadu_si512(a), vb = _mm512_loadu_si512(b);
  // Unrolled as the AVX2 build, whose loop its own instructions bound otherwise (1.5 MB: 49 -> 70
  // GB/s there; not measured with AVX-512).
#pragma GCC unroll 4
  for (size_t k = 0; k < blocks; ++k, data += kBlockBytes) {
    va = _mm512_add_epi32(va, _mm512_loadu_si512(data));
    vb = _mm512_add_epi32(vb, va);
  }
  _mm512_storeu_si512(a, va);
  _mm512_storeu_si512(b, vb);
}

void copy_sum_blocks_avx512(uint32_t* a, uint32_t* b, std::byte* dst, const std::byte* src,
                            size_t blocks) {
  __m512i va = _mm512_loadu_si512(a), vb = _mm512_loadu_si512(b);
#pragma GCC unroll 4
  for (size_t k = 0; k < blocks; ++k, src += kBlockBytes, dst += kBlockBytes) {
    const __m512i w = _mm512_loadu_si512(src);
    _mm512_storeu_si512(dst, w);
    va = _mm512_add_epi32(va, w);
    vb = _mm512_add_epi32(vb, va);
  }
  _mm512_storeu_si512(a, va);
  _mm512_storeu_si512(b, vb);
}

void add_sum_blocks_avx512(uint32_t* a, uint32_t* b, float* dst, const std::byte* src,
                           size_t blocks, bool first) {
  __m512i va = _mm512_loadu_si512(a), vb = _mm512_loadu_si512(b);
  const __m512 zero = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (size_t k = 0; k < blocks; ++k, src += kBlockBytes, dst += kLanes) {
    const __m512i w = _mm512_loadu_si512(src);
    const __m512 d = first ? zero : _mm512_loadu_ps(dst);
    _mm512_storeu_ps(dst, _mm512_add_ps(d, _mm512_castsi512_ps(w)));
    va = _mm512_add_epi32(va, w);
    vb = _mm512_add_epi32(vb, va);
  }
  _mm512_storeu_si512(a, va);
  _mm512_storeu_si512(b, vb);
}

}  // namespace colibri::wire::detail
