#include "cpu/read_bandwidth.h"

#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace colibri::kernels {
namespace {

#if defined(__x86_64__)
__attribute__((target("avx512f"))) uint64_t read_sum_avx512(const uint8_t* p, size_t lines,
                                                            int threads) {
  uint64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    __m512i acc[8];
    for (auto& a : acc) a = _mm512_setzero_si512();
#pragma omp for schedule(static)
    for (size_t i = 0; i < lines; ++i)
      for (int k = 0; k < 8; ++k)
        acc[k] = _mm512_add_epi64(acc[k], _mm512_loadu_si512(p + i * 512 + size_t(k) * 64));
    for (int k = 1; k < 8; ++k) acc[0] = _mm512_add_epi64(acc[0], acc[k]);
    alignas(64) uint64_t lanes[8];
    _mm512_store_si512(lanes, acc[0]);
    for (uint64_t v : lanes) total += v;
  }
  return total;
}

__attribute__((target("avx2"))) uint64_t read_sum_avx2(const uint8_t* p, size_t lines,
                                                       int threads) {
  uint64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    __m256i acc[16];
    for (auto& a : acc) a = _mm256_setzero_si256();
#pragma omp for schedule(static)
    for (size_t i = 0; i < lines; ++i)
      for (int k = 0; k < 16; ++k)
        acc[k] = _mm256_add_epi64(
            acc[k],
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i * 512 + size_t(k) * 32)));
    for (int k = 1; k < 16; ++k) acc[0] = _mm256_add_epi64(acc[0], acc[k]);
    alignas(32) uint64_t lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc[0]);
    total += lanes[0] + lanes[1] + lanes[2] + lanes[3];
  }
  return total;
}
#endif

uint64_t read_sum_portable(const uint8_t* p, size_t lines, int threads) {
  uint64_t total = 0;
#pragma omp parallel for num_threads(threads) reduction(+ : total) schedule(static)
  for (size_t i = 0; i < lines; ++i) {
    uint64_t words[64];
    std::memcpy(words, p + i * 512, 512);
    for (uint64_t w : words) total += w;
  }
  return total;
}

}  // namespace

uint64_t read_sum(const uint8_t* p, size_t bytes, int threads) {
  const size_t lines = bytes / 512;
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f")) return read_sum_avx512(p, lines, threads);
  if (__builtin_cpu_supports("avx2")) return read_sum_avx2(p, lines, threads);
#endif
  return read_sum_portable(p, lines, threads);
}

}  // namespace colibri::kernels
