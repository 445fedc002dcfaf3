// The per-lane arithmetic of the grouped expert FFN (expert_ffn.cu): dequantising 16-byte loads
// of container rows in registers and accumulating one lane's share of a row's dot products.
// Written once for both compilers: under nvcc these are device functions; a host compiler gets
// the same code as plain C++ (loads, byte permute and bit casts emulated), so that
// tests/gpu/expert_ffn_lanes_test.cpp can check every lane's indexing and dequantisation on a
// machine without a GPU by running the 32 lanes of a warp one after another.
#pragma once

#include <cuda_runtime_api.h>  // uint4, float4
#include <vector_functions.h>  // make_uint4

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cuda/expert_ffn.cuh"

#ifdef __CUDACC__
#define COLIBRI_LANE __device__ __forceinline__
#define COLIBRI_UNROLL _Pragma("unroll")
#else
#define COLIBRI_LANE inline
#define COLIBRI_UNROLL
#endif

namespace colibri::cuda::lanes {

constexpr int kWarpSize = 32;

#ifdef __CUDACC__
template <class V>
__device__ __forceinline__ V lane_load(const V* p) {
  return __ldg(p);
}
__device__ __forceinline__ uint32_t lane_byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  return __byte_perm(x, y, s);
}
__device__ __forceinline__ float lane_bits_to_float(uint32_t bits) {
  return __uint_as_float(bits);
}
#else
template <class V>
inline V lane_load(const V* p) {
  return *p;
}
// PTX prmt in its default mode: result byte n is byte (s >> 4n) & 7 of the pair {y:x}.
inline uint32_t lane_byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t pair = (uint64_t(y) << 32) | x;
  uint32_t out = 0;
  for (int n = 0; n < 4; ++n)
    out |= uint32_t((pair >> (8 * ((s >> (4 * n)) & 7))) & 0xFF) << (8 * n);
  return out;
}
inline float lane_bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
#endif

// Byte j of v (a value below 256) as an exact float minus `bias`: 0x4B000000 | b is the float
// 2^23 + b, so one byte permute and one subtraction dequantise it.
COLIBRI_LANE float byte_to_float(uint32_t v, int j, float bias) {
  return lane_bits_to_float(lane_byte_perm(v, 0x4B000000u, 0x7440u | unsigned(j))) - bias;
}
constexpr float kInt4Bias = 8388608.0f + 8.0f;    // stored nibble q + 8
constexpr float kInt8Bias = 8388608.0f + 128.0f;  // stored byte q, read as (q ^ 0x80) = q + 128

// acc[t] += 8 weights w[0..7] · x_t[0..7], x_t at float4 index i4 of slot t's input row.
template <int T>
COLIBRI_LANE void dot8(const float (&w)[8], const float4* const (&x4)[T], int64_t i4,
                       float (&acc)[T]) {
  COLIBRI_UNROLL
  for (int t = 0; t < T; ++t) {
    const float4 a = x4[t][i4], b = x4[t][i4 + 1];
    float s = acc[t];
    s = fmaf(a.x, w[0], s);
    s = fmaf(a.y, w[1], s);
    s = fmaf(a.z, w[2], s);
    s = fmaf(a.w, w[3], s);
    s = fmaf(b.x, w[4], s);
    s = fmaf(b.y, w[5], s);
    s = fmaf(b.z, w[6], s);
    s = fmaf(b.w, w[7], s);
    acc[t] = s;
  }
}

// acc[t] += the sum of x_t's 8 values at float4 index i4 (the inputs dot8 multiplies).
template <int T>
COLIBRI_LANE void sum8(const float4* const (&x4)[T], int64_t i4, float (&acc)[T]) {
  COLIBRI_UNROLL
  for (int t = 0; t < T; ++t) {
    const float4 a = x4[t][i4], b = x4[t][i4 + 1];
    acc[t] += ((a.x + a.y) + (a.z + a.w)) + ((b.x + b.y) + (b.z + b.w));
  }
}

// 32 int4 weights (one 16-byte load, columns 32c .. 32c + 31) against T inputs; the sum of
// x * (q - 8) is scaled once per load (the 32 columns share one scale: group_size % 32 == 0).
// kZero (zero points): the 32 columns share one offset too, and offset * (the sum of their x) is
// added, which summed over a group's chunks is the CPU's offset * (the group's sum of x).
template <int T, bool kZero = false>
COLIBRI_LANE void int4_chunk(uint4 q, float scale, int64_t c, const float4* const (&x4)[T],
                             float (&acc)[T], float offset = 0.0f) {
  float part[T], x_sum[T];
  COLIBRI_UNROLL
  for (int t = 0; t < T; ++t) part[t] = x_sum[t] = 0.0f;
  const uint32_t words[4] = {q.x, q.y, q.z, q.w};
  COLIBRI_UNROLL
  for (int k = 0; k < 4; ++k) {
    const uint32_t lo = words[k] & 0x0F0F0F0Fu, hi = (words[k] >> 4) & 0x0F0F0F0Fu;
    float w[8];
    COLIBRI_UNROLL
    for (int j = 0; j < 4; ++j) {
      w[2 * j] = byte_to_float(lo, j, kInt4Bias);  // element 2j: low nibble of byte j
      w[2 * j + 1] = byte_to_float(hi, j, kInt4Bias);
    }
    dot8<T>(w, x4, c * 8 + 2 * k, part);
    if constexpr (kZero) sum8<T>(x4, c * 8 + 2 * k, x_sum);
  }
  COLIBRI_UNROLL
  for (int t = 0; t < T; ++t) {
    acc[t] = fmaf(part[t], scale, acc[t]);
    if constexpr (kZero) acc[t] = fmaf(x_sum[t], offset, acc[t]);
  }
}

// 16 int8 weights (columns 16c .. 16c + 15), unscaled: the row scale is applied at the end.
template <int T>
COLIBRI_LANE void int8_chunk(uint4 q, int64_t c, const float4* const (&x4)[T], float (&acc)[T]) {
  const uint32_t words[4] = {q.x ^ 0x80808080u, q.y ^ 0x80808080u, q.z ^ 0x80808080u,
                             q.w ^ 0x80808080u};
  COLIBRI_UNROLL
  for (int k = 0; k < 2; ++k) {
    float w[8];
    COLIBRI_UNROLL
    for (int j = 0; j < 4; ++j) {
      w[j] = byte_to_float(words[2 * k], j, kInt8Bias);
      w[4 + j] = byte_to_float(words[2 * k + 1], j, kInt8Bias);
    }
    dot8<T>(w, x4, c * 4 + 2 * k, acc);
  }
}

// 8 BF16 values (one 16-byte load, element 2j in the low half of word j) widened to fp32.
COLIBRI_LANE void bf16x8_to_float(uint4 q, float (&w)[8]) {
  const uint32_t words[4] = {q.x, q.y, q.z, q.w};
  COLIBRI_UNROLL
  for (int j = 0; j < 4; ++j) {
    w[2 * j] = lane_bits_to_float(words[j] << 16);
    w[2 * j + 1] = lane_bits_to_float(words[j] & 0xFFFF0000u);
  }
}

// NVFP4: an E2M1 code (the low 4 bits of `code`; higher bits ignored) exactly, its magnitude
// bits placed in an fp32's exponent and mantissa fields (e2m1 * 2^-126, a subnormal for 0.5)
// times 2^126.
COLIBRI_LANE float e2m1_value(uint32_t code) {
  return lane_bits_to_float(((code & 7u) << 22) | ((code & 8u) << 28)) * 0x1p126f;
}
// An E4M3 byte (not a NaN) exactly, the same way (as kernels/cpu/vec_detail.h's e4m3_value).
COLIBRI_LANE float e4m3_value(uint32_t byte) {
  return lane_bits_to_float(((byte & 0x7Fu) << 20) | ((byte & 0x80u) << 24)) * 0x1p120f;
}
// NVFP4 weight (row r, column i) as the CPU dequantizes it: (e2m1 * e4m3, exact) * global.
COLIBRI_LANE float nvfp4_weight(const DeviceMatrix& w, int64_t r, int64_t i) {
  const uint8_t b = static_cast<const uint8_t*>(w.data)[r * (w.cols / 2) + i / 2];
  const float scale = e4m3_value(w.e4m3_scales[r * (w.cols / 16) + i / 16]);
  return e2m1_value((i & 1) ? b >> 4 : b) * scale * w.global;
}

// 32 NVFP4 weights (one 16-byte load, columns 32c .. 32c + 31: two blocks of 16) against T
// inputs: each block's sum of x * e2m1 scaled once by its e4m3 * global.
template <int T>
COLIBRI_LANE void nvfp4_chunk(uint4 q, float scale0, float scale1, int64_t c,
                              const float4* const (&x4)[T], float (&acc)[T]) {
  const uint32_t words[4] = {q.x, q.y, q.z, q.w};
  COLIBRI_UNROLL
  for (int half = 0; half < 2; ++half) {
    float part[T];
    COLIBRI_UNROLL
    for (int t = 0; t < T; ++t) part[t] = 0.0f;
    COLIBRI_UNROLL
    for (int k = 2 * half; k < 2 * half + 2; ++k) {
      float w[8];
      COLIBRI_UNROLL
      for (int j = 0; j < 8; ++j) w[j] = e2m1_value(words[k] >> (4 * j));  // column 8k + j
      dot8<T>(w, x4, c * 8 + 2 * k, part);
    }
    const float scale = half ? scale1 : scale0;
    COLIBRI_UNROLL
    for (int t = 0; t < T; ++t) acc[t] = fmaf(part[t], scale, acc[t]);
  }
}

COLIBRI_LANE bool is_wide_int4(const DeviceMatrix& w) {
  return w.wide && (w.format == WeightFormat::kInt4Row || w.format == WeightFormat::kInt4Grouped);
}

// The scale of 32-column chunk c of a wide int4 row whose scales start at `scales` (or its
// offset, given the row's offsets: they are laid out alike).
COLIBRI_LANE float chunk_scale(const DeviceMatrix& w, const float* scales, int64_t c) {
  return lane_load(scales + (w.format == WeightFormat::kInt4Grouped ? c / (w.group_size / 32) : 0));
}

// Where row r's scales start: ceil(cols / group_size) per row, the last group possibly short.
COLIBRI_LANE int64_t row_scale_at(const DeviceMatrix& w, int64_t r) {
  return w.format == WeightFormat::kInt4Grouped ? r * ((w.cols + w.group_size - 1) / w.group_size)
                                                : r;
}
COLIBRI_LANE const float* row_scales(const DeviceMatrix& w, int64_t r) {
  return w.scales + row_scale_at(w, r);
}
// The first zero-point offset of row r (laid out as the scales).
COLIBRI_LANE const float* row_offsets(const DeviceMatrix& w, int64_t r) {
  return w.offsets + row_scale_at(w, r);
}

// Lane `lane`'s share of row r of a wide int4 matrix (kZero: with its zero points), two loads in
// flight per lane before the arithmetic.
template <int T, bool kZero>
COLIBRI_LANE void int4_row_dot(const DeviceMatrix& w, int64_t r, const float4* const (&x4)[T],
                               int lane, float (&acc)[T]) {
  const uint4* row =
      reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(w.data) + r * (w.cols / 2));
  const int64_t chunks = w.cols / 32;
  const float* scales = row_scales(w, r);
  const float* offsets = kZero ? row_offsets(w, r) : nullptr;
  for (int64_t c = lane; c < chunks; c += 2 * kWarpSize) {
    const int64_t c1 = c + kWarpSize;
    const bool second = c1 < chunks;
    const uint4 q0 = lane_load(row + c);
    const uint4 q1 = second ? lane_load(row + c1) : make_uint4(0, 0, 0, 0);
    if constexpr (kZero) {
      int4_chunk<T, true>(q0, chunk_scale(w, scales, c), c, x4, acc, chunk_scale(w, offsets, c));
      if (second)
        int4_chunk<T, true>(q1, chunk_scale(w, scales, c1), c1, x4, acc,
                            chunk_scale(w, offsets, c1));
    } else {
      int4_chunk<T>(q0, chunk_scale(w, scales, c), c, x4, acc);
      if (second) int4_chunk<T>(q1, chunk_scale(w, scales, c1), c1, x4, acc);
    }
  }
}

// Lane `lane`'s share of W[r, :] · x_t for t < T; a warp_sum of acc[t] gives the dot product.
template <int T>
COLIBRI_LANE void row_dot(const DeviceMatrix& w, int64_t r, const float* const (&xs)[T], int lane,
                          float (&acc)[T]) {
  COLIBRI_UNROLL
  for (int t = 0; t < T; ++t) acc[t] = 0.0f;
  const int64_t cols = w.cols;
  if (w.wide) {
    const float4* x4[T];
    COLIBRI_UNROLL
    for (int t = 0; t < T; ++t) x4[t] = reinterpret_cast<const float4*>(xs[t]);
    switch (w.format) {
      case WeightFormat::kInt4Row:
      case WeightFormat::kInt4Grouped:
        if (w.offsets)
          int4_row_dot<T, true>(w, r, x4, lane, acc);
        else
          int4_row_dot<T, false>(w, r, x4, lane, acc);
        return;
      case WeightFormat::kInt8Row: {
        const uint4* row =
            reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(w.data) + r * cols);
        const int64_t chunks = cols / 16;
        for (int64_t c = lane; c < chunks; c += 2 * kWarpSize) {
          const bool second = c + kWarpSize < chunks;
          const uint4 q0 = lane_load(row + c);
          const uint4 q1 = second ? lane_load(row + c + kWarpSize) : make_uint4(0, 0, 0, 0);
          int8_chunk<T>(q0, c, x4, acc);
          if (second) int8_chunk<T>(q1, c + kWarpSize, x4, acc);
        }
        const float s = lane_load(w.scales + r);
        COLIBRI_UNROLL
        for (int t = 0; t < T; ++t) acc[t] *= s;
        return;
      }
      case WeightFormat::kF32: {
        const float4* row =
            reinterpret_cast<const float4*>(static_cast<const float*>(w.data) + r * cols);
        for (int64_t c = lane; c < cols / 4; c += kWarpSize) {
          const float4 wv = lane_load(row + c);
          COLIBRI_UNROLL
          for (int t = 0; t < T; ++t) {
            const float4 a = x4[t][c];
            acc[t] = fmaf(a.x, wv.x, acc[t]);
            acc[t] = fmaf(a.y, wv.y, acc[t]);
            acc[t] = fmaf(a.z, wv.z, acc[t]);
            acc[t] = fmaf(a.w, wv.w, acc[t]);
          }
        }
        return;
      }
      case WeightFormat::kNvfp4: {
        const uint4* row =
            reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(w.data) + r * (cols / 2));
        const uint8_t* scales = w.e4m3_scales + r * (cols / 16);
        const int64_t chunks = cols / 32;
        const auto scale = [&](int64_t block) {
          return e4m3_value(lane_load(scales + block)) * w.global;
        };
        for (int64_t c = lane; c < chunks; c += 2 * kWarpSize) {
          const int64_t c1 = c + kWarpSize;
          const bool second = c1 < chunks;
          const uint4 q0 = lane_load(row + c);
          const uint4 q1 = second ? lane_load(row + c1) : make_uint4(0, 0, 0, 0);
          nvfp4_chunk<T>(q0, scale(2 * c), scale(2 * c + 1), c, x4, acc);
          if (second) nvfp4_chunk<T>(q1, scale(2 * c1), scale(2 * c1 + 1), c1, x4, acc);
        }
        return;
      }
      case WeightFormat::kBF16: {
        // 8 weights per 16-byte load: a BF16 value is the high half of its fp32 bits.
        const uint4* row =
            reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(w.data) + r * cols);
        for (int64_t c = lane; c < cols / 8; c += kWarpSize) {
          float wv[8];
          bf16x8_to_float(lane_load(row + c), wv);
          dot8<T>(wv, x4, 2 * c, acc);
        }
        return;
      }
    }
    return;
  }
  // Any shape: one element per lane and step, each weight dequantised as the CPU does,
  // (q - 8) * s (+ its offset) or q * s.
  const uint8_t* bytes = static_cast<const uint8_t*>(w.data);
  const int64_t n_groups =
      w.format == WeightFormat::kInt4Grouped ? (cols + w.group_size - 1) / w.group_size : 1;
  for (int64_t i = lane; i < cols; i += kWarpSize) {
    float wv;
    switch (w.format) {
      case WeightFormat::kInt4Row:
      case WeightFormat::kInt4Grouped: {
        const uint8_t b = bytes[r * ((cols + 1) / 2) + i / 2];
        const int q = int((i & 1) ? b >> 4 : b & 15) - 8;
        const int64_t g = w.format == WeightFormat::kInt4Grouped ? i / w.group_size : 0;
        wv = float(q) * w.scales[r * n_groups + g];
        if (w.offsets) wv += w.offsets[r * n_groups + g];
        break;
      }
      case WeightFormat::kInt8Row:
        wv = float(int8_t(bytes[r * cols + i])) * w.scales[r];
        break;
      case WeightFormat::kBF16:
        wv = lane_bits_to_float(uint32_t(static_cast<const uint16_t*>(w.data)[r * cols + i]) << 16);
        break;
      case WeightFormat::kNvfp4:
        wv = nvfp4_weight(w, r, i);
        break;
      default:
        wv = static_cast<const float*>(w.data)[r * cols + i];
        break;
    }
    COLIBRI_UNROLL
    for (int t = 0; t < T; ++t) acc[t] = fmaf(xs[t][i], wv, acc[t]);
  }
}

// Row r of two wide int4 matrices of the same width (gate and up) against the same inputs, with
// four 16-byte loads in flight per lane: the same sums as two row_dot calls. kZero: both have
// zero points (the caller takes two row_dot calls when only one has).
template <int T, bool kZero = false>
COLIBRI_LANE void int4_row_dot2(const DeviceMatrix& a, const DeviceMatrix& b, int64_t r,
                                const float* const (&xs)[T], int lane, float (&acc_a)[T],
                                float (&acc_b)[T]) {
  COLIBRI_UNROLL
  for (int t = 0; t < T; ++t) acc_a[t] = acc_b[t] = 0.0f;
  const float4* x4[T];
  COLIBRI_UNROLL
  for (int t = 0; t < T; ++t) x4[t] = reinterpret_cast<const float4*>(xs[t]);
  const int64_t cols = a.cols, chunks = cols / 32;
  const uint4* row_a =
      reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(a.data) + r * (cols / 2));
  const uint4* row_b =
      reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(b.data) + r * (cols / 2));
  const float* scales_a = row_scales(a, r);
  const float* scales_b = row_scales(b, r);
  const float* offsets_a = kZero ? row_offsets(a, r) : nullptr;
  const float* offsets_b = kZero ? row_offsets(b, r) : nullptr;
  const auto chunk = [&](uint4 qa, uint4 qb, int64_t c) {
    if constexpr (kZero) {
      int4_chunk<T, true>(qa, chunk_scale(a, scales_a, c), c, x4, acc_a,
                          chunk_scale(a, offsets_a, c));
      int4_chunk<T, true>(qb, chunk_scale(b, scales_b, c), c, x4, acc_b,
                          chunk_scale(b, offsets_b, c));
    } else {
      int4_chunk<T>(qa, chunk_scale(a, scales_a, c), c, x4, acc_a);
      int4_chunk<T>(qb, chunk_scale(b, scales_b, c), c, x4, acc_b);
    }
  };
  for (int64_t c = lane; c < chunks; c += 2 * kWarpSize) {
    const int64_t c1 = c + kWarpSize;
    const bool second = c1 < chunks;
    const uint4 a0 = lane_load(row_a + c), b0 = lane_load(row_b + c);
    const uint4 a1 = second ? lane_load(row_a + c1) : make_uint4(0, 0, 0, 0);
    const uint4 b1 = second ? lane_load(row_b + c1) : make_uint4(0, 0, 0, 0);
    chunk(a0, b0, c);
    if (second) chunk(a1, b1, c1);
  }
}

}  // namespace colibri::cuda::lanes
