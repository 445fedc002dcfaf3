// NVFP4 with int8 activations (linear.h, linear_nvfp4_int8): the activations' quantization and
// layout, the scalar reference, the selection and the OpenMP driver. The operations:
// nvfp4_detail.h; the per-ISA kernels: nvfp4_avx2.cpp, nvfp4_avx512.cpp.
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/linear.h"
#include "cpu/nvfp4_detail.h"
#include "cpu/quant.h"
#include "cpu/quant_detail.h"
#include "cpu/quant_int8_detail.h"

namespace colibri::kernels {

using detail::kInt8Block;
using detail::kNvfp4Block;
using detail::kNvfp4Sums;
using detail::kNvfp4SuperStep;
using detail::Nvfp4Activations;

namespace {

void require_weights(const Nvfp4Weights& w) {
  if (w.cols <= 0 || w.cols % kNvfp4Block != 0 || w.rows < 0)
    throw std::invalid_argument("NVFP4 kernels: cols " + std::to_string(w.cols) +
                                " is not a positive multiple of 16 (or rows " +
                                std::to_string(w.rows) + " < 0)");
  if (w.rows > 0 && (!w.codes || !w.scales))
    throw std::invalid_argument("NVFP4 kernels: null codes or scales");
}

void require_isa(QuantIsa isa) {
  if (!quant_isa_available(isa))
    throw std::invalid_argument(std::string("NVFP4 kernels: ISA ") + quant_isa_name(isa) +
                                " is not available on this CPU or in this build");
}

// 2 * e2m1 by code: an integer.
constexpr int kE2m1Twice[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// An E4M3 byte (not a NaN) times 2^-8, exactly.
float e4m3_over_256(uint8_t byte) {
  const int e = (byte >> 3) & 15, m = byte & 7;
  const float magnitude =
      e == 0 ? std::ldexp(float(m), -9 - 8) : std::ldexp(float(8 + m), e - 10 - 8);
  return (byte & 0x80) ? -magnitude : magnitude;
}

// Byte offset within a super-step of column c (0 <= c < 256) of the super-step (nvfp4_detail.h).
int64_t layout_position(int64_t c) {
  const int64_t lane = c / kNvfp4Block, j = c % kNvfp4Block;
  const int64_t vector = (j >= 8 ? 2 : 0) + (j & 1);
  return vector * 64 + 4 * lane + (j % 8) / 2;
}

detail::QuantizeBlockFn quantize_kernel(QuantIsa isa) {
#if COLIBRI_QUANT_X86
  if (isa == QuantIsa::kAvx512) return detail::quantize_block_avx512;
  if (isa == QuantIsa::kAvx2) return detail::quantize_block_avx2;
#endif
  return nullptr;  // the scalar quantizer: quantize_activations_int8
}

// Growable buffers of quantized rows, per calling thread.
struct Buffers {
  std::vector<int8_t> q;
  std::vector<int32_t> bias;
  std::vector<float> scale;
  std::vector<float> block_scale;  // [blocks of 64] of one row
  std::vector<int8_t> natural;     // [cols] of one row
};
thread_local Buffers buffers;

// Quantizes x [n, cols] into the layout of nvfp4_detail.h for weights with second-level scale
// `global`.
Nvfp4Activations quantize(QuantIsa isa, const float* x, int64_t n, int64_t cols, float global) {
  Buffers& b = buffers;
  const int64_t steps = (cols + kNvfp4SuperStep - 1) / kNvfp4SuperStep;
  const int64_t padded = steps * kNvfp4SuperStep, blocks = steps * kNvfp4Sums;
  const int64_t blocks64 = (cols + kInt8Block - 1) / kInt8Block;
  // Zeros where no block writes: the padded blocks of the last super-step.
  b.q.assign(size_t(n * padded), 0);
  b.bias.assign(size_t(n * blocks), 0);
  b.scale.assign(size_t(n * blocks), 0.0f);
  b.block_scale.resize(size_t(blocks64));
  b.natural.resize(size_t(blocks64 * kInt8Block));
  const float factor = global * 128.0f;
  const detail::QuantizeBlockFn block_kernel = quantize_kernel(isa);
  for (int64_t t = 0; t < n; ++t) {
    const float* row = x + t * cols;
    if (block_kernel) {
      int q[kInt8Block];
      for (int64_t k = 0; k < blocks64; ++k) {
        b.block_scale[size_t(k)] = block_kernel(row, cols, k, q);
        for (int64_t j = 0; j < kInt8Block; ++j)
          b.natural[size_t(k * kInt8Block + j)] = int8_t(q[j]);
      }
    } else {
      quantize_activations_int8(row, cols, b.natural.data(), b.block_scale.data());
    }
    int8_t* q = b.q.data() + t * padded;
    int32_t* bias = b.bias.data() + t * blocks;
    float* scale = b.scale.data() + t * blocks;
    for (int64_t blk = 0; blk < cols / kNvfp4Block; ++blk) {
      // Block blk's 16 inputs to its lane of the super-step's four vectors (layout_position).
      const int8_t* v = b.natural.data() + blk * kNvfp4Block;
      int8_t* lane = q + blk / kNvfp4Sums * kNvfp4SuperStep + 4 * (blk % kNvfp4Sums);
      int32_t sum = 0;
      for (int k = 0; k < 4; ++k) {
        lane[k] = v[2 * k];
        lane[64 + k] = v[2 * k + 1];
        lane[128 + k] = v[8 + 2 * k];
        lane[192 + k] = v[9 + 2 * k];
        sum += v[2 * k] + v[2 * k + 1] + v[8 + 2 * k] + v[9 + 2 * k];
      }
      bias[blk] = -12 * sum;
      scale[blk] = b.block_scale[size_t(blk * kNvfp4Block / kInt8Block)] * factor;
    }
  }
  return {n, cols, steps, b.q.data(), b.bias.data(), b.scale.data()};
}

// The reference: the operations of nvfp4_detail.h from the codes and the activations in
// natural order (the layout only names where the SIMD kernels read them).
void rows_scalar(const Nvfp4Weights& w, const Nvfp4Activations& x, float* y, int64_t y_stride,
                 int64_t row_begin, int64_t row_end) {
  static const auto natural_of = [] {  // layout byte -> column within a super-step
    std::array<uint8_t, kNvfp4SuperStep> c{};
    for (int64_t i = 0; i < kNvfp4SuperStep; ++i) c[size_t(layout_position(i))] = uint8_t(i);
    return c;
  }();
  const int64_t blocks = w.cols / kNvfp4Block, padded = x.steps * kNvfp4SuperStep;
  for (int64_t o = row_begin; o < row_end; ++o) {
    const uint8_t* codes = w.codes + o * (w.cols / 2);
    const uint8_t* scales = w.scales + o * blocks;
    for (int64_t t = 0; t < x.n; ++t) {
      // Row t's q in natural order.
      int8_t q[kNvfp4SuperStep];
      const int8_t* laid = x.q + t * padded;
      float acc[kNvfp4Sums] = {};
      for (int64_t blk = 0; blk < blocks; ++blk) {
        if (blk % kNvfp4Sums == 0)
          for (int64_t i = 0; i < kNvfp4SuperStep; ++i)
            q[natural_of[size_t(i)]] = laid[blk / kNvfp4Sums * kNvfp4SuperStep + i];
        int32_t d = 0;
        for (int64_t j = 0; j < kNvfp4Block; ++j) {
          const int64_t c = blk * kNvfp4Block + j;
          const uint8_t byte = codes[c / 2];
          d += kE2m1Twice[(c & 1) ? byte >> 4 : byte & 15] * q[c % kNvfp4SuperStep];
        }
        const float m = e4m3_over_256(scales[blk]) * x.scale[t * x.steps * kNvfp4Sums + blk];
        float& a = acc[blk % kNvfp4Sums];
        a = std::fma(float(d), m, a);
      }
      for (int h = 8; h >= 1; h /= 2)
        for (int i = 0; i < h; ++i) acc[i] += acc[i + h];
      y[t * y_stride + o] = acc[0];
    }
  }
}

bool cpu_has_avx512vnni() {
#if COLIBRI_QUANT_X86
  static const bool has = __builtin_cpu_supports("avx512vnni");
  return has;
#else
  return false;
#endif
}

detail::Nvfp4Int8Kernel int8_kernel(QuantIsa isa) {
#if COLIBRI_QUANT_X86
  if (isa == QuantIsa::kAvx512 && vnni_enabled() && cpu_has_avx512vnni())
    return detail::nvfp4_int8_rows_avx512vnni;
  if (isa == QuantIsa::kAvx512 || isa == QuantIsa::kAvx2) return detail::nvfp4_int8_rows_avx2;
#endif
  return rows_scalar;
}

// Rows a thread's share is made of: results do not depend on the split, this only keeps the
// shares' edges on cache lines of y.
constexpr int64_t kRowUnit = 16;

}  // namespace

bool nvfp4_int8_vnni(QuantIsa isa) {
#if COLIBRI_QUANT_X86
  return quant_isa_available(isa) && int8_kernel(isa) == detail::nvfp4_int8_rows_avx512vnni;
#else
  (void)isa;
  return false;
#endif
}

void linear_nvfp4_int8(QuantIsa isa, const float* x, int64_t n, const Nvfp4Weights& w, float* y) {
  require_isa(isa);
  require_weights(w);
  if (n <= 0 || w.rows == 0) return;
  const Nvfp4Activations xq = quantize(isa, x, n, w.cols, w.global);
  const detail::Nvfp4Int8Kernel kernel = int8_kernel(isa);
#pragma omp parallel if (w.rows * w.cols * n >= detail::kParallelMinMacs)
  {
    int64_t begin, end;
    detail::static_range(w.rows, omp_get_num_threads(), omp_get_thread_num(), begin, end, kRowUnit);
    if (begin < end) kernel(w, xq, y, w.rows, begin, end);
  }
}

void linear_nvfp4_int8(const float* x, int64_t n, const Nvfp4Weights& w, float* y) {
  linear_nvfp4_int8(quant_isa_selected(), x, n, w, y);
}

bool nvfp4_int8_activations() {
  return quant_activations_selected() != QuantActivations::kF32;
}

void linear_nvfp4_selected(const float* x, int64_t n, const Nvfp4Weights& w, float* y) {
  if (nvfp4_int8_activations())
    linear_nvfp4_int8(x, n, w, y);
  else
    linear_nvfp4(x, n, w, y);
}

}  // namespace colibri::kernels
