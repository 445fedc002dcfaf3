// The block sums with AVX2 (compiled with -mavx2; called only after CPUID): a block's 16 lanes
// in two registers.
#include <immintrin.h>

#include "transport/checksum.h"

namespace colibri::wire::detail {

void sum_blocks_avx2(uint32_t* a, uint32_t* b, const std::byte* data, size_t blocks) {
  auto* va = reinterpret_cast<__m256i*>(a);
  auto* vb = reinterpret_cast<__m256i*>(b);
  __m256i a0 = _mm256_loadu_si256(va), a1 = _mm256_loadu_si256(va + 1);
  __m256i b0 = _mm256_loadu_si256(vb), b1 = _mm256_loadu_si256(vb + 1);
  // Unrolled: the loop's own instructions bound it otherwise (AVX2, 1.5 MB: 49 -> 70 GB/s).
#pragma GCC unroll 4
  for (size_t k = 0; k < blocks; ++k, data += kBlockBytes) {
    const auto* w = reinterpret_cast<const __m256i*>(data);
    a0 = _mm256_add_epi32(a0, _mm256_loadu_si256(w));
    a1 = _mm256_add_epi32(a1, _mm256_loadu_si256(w + 1));
    b0 = _mm256_add_epi32(b0, a0);
    b1 = _mm256_add_epi32(b1, a1);
  }
  _mm256_storeu_si256(va, a0);
  _mm256_storeu_si256(va + 1, a1);
  _mm256_storeu_si256(vb, b0);
  _mm256_storeu_si256(vb + 1, b1);
}

}  // namespace colibri::wire::detail
