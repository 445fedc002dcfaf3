// The per-lane code of the block-scaled FP4 tensor-core product (nvfp4_mma.cu), written once for
// nvcc and a host compiler, so that tests/unit/nvfp4_mma_lanes_test.cpp checks it on a machine
// without a GPU: the activation quantizer's rounding against kernels::quantize_nvfp4, and the
// fragment loaders through an emulated mma against the dequantized product.
//
// The instruction (sm_120a / sm_120f only):
//   mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X
//       .f32.e2m1.e2m1.f32.ue4m3  d, a, b, c, scale_a, {byte_a, thread_a}, scale_b, {byte_b, ...}
//   D[m][n] = C[m][n] + sum over k < 64 of A[m][k] * B[k][n] * SA[m][k / 16] * SB[n][k / 16]
// with A, B E2M1 codes and SA, SB E4M3 bytes (one per 16 k: NVFP4's blocks). The layout facts
// this file relies on (PTX ISA, "Matrix fragments for mma.m16n8k64" with 4-bit types and
// "warp-level block scaling"; the same as CUTLASS's SM120 block-scaled atoms and llama.cpp's
// native Blackwell FP4 path), for lane = 4 * g + t (g = lane / 4, t = lane % 4):
//   A (row-major, 4 x b32, eight codes a register, the smaller k in the lower nibble):
//     a0: row g, k 8t .. 8t + 7      a1: row g + 8, k 8t ..
//     a2: row g, k 32 + 8t ..        a3: row g + 8, k 32 + 8t ..
//   B (column-major, 2 x b32):  b0: column g, k 8t .. 8t + 7    b1: column g, k 32 + 8t ..
//   C, D (4 x f32):  c0, c1: row g, columns 2t, 2t + 1    c2, c3: row g + 8, columns 2t, 2t + 1
//   scale_a (b32, byte j = the scale of k 16j .. 16j + 15) with selectors {0, 0}: read from the
//     lanes with t = 0 (row g) and t = 1 (row g + 8); scale_b: from the lanes with t = 0
//     (column g). The other lanes' scale registers are ignored; ours fill them the same way.
// So an NVFP4 row as stored (column 2j in the low nibble of byte j; kernels/cpu/linear.h) is
// already in the fragments' order: a register is 4 consecutive code bytes, 8 columns.
#pragma once

#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define COLIBRI_FP4_LANE __host__ __device__ __forceinline__
#else
#define COLIBRI_FP4_LANE inline
#endif

namespace colibri::cuda::fp4 {

constexpr int kWarpSize = 32;
constexpr int kTileRows = 16, kTileCols = 8, kChunk = 64;  // m16n8k64
constexpr int kBlock = 16;                                 // columns per E4M3 scale

// An NVFP4 matrix [rows, cols] as stored, row-major along k: codes [rows, cols / 2] (4-byte
// aligned), E4M3 scales [rows, cols / 16]. Weights and quantized activations alike.
struct Fp4Rows {
  const uint8_t* codes = nullptr;
  const uint8_t* scales = nullptr;
  int64_t rows = 0, cols = 0;
};

COLIBRI_FP4_LANE float bits_to_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// An E4M3 byte's value (not a NaN), exactly: kernels/cpu/vec_detail.h e4m3_value.
COLIBRI_FP4_LANE float e4m3_value(uint32_t byte) {
  return bits_to_float(((byte & 0x7Fu) << 20) | ((byte & 0x80u) << 24)) * 0x1p120f;
}

// The E2M1 magnitudes by the low three bits of a code.
COLIBRI_FP4_LANE float e2m1_magnitude(uint32_t code) {
  constexpr float kValues[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  return kValues[code & 7u];
}
COLIBRI_FP4_LANE float e2m1_value(uint32_t code) {
  return (code & 8u) ? -e2m1_magnitude(code) : e2m1_magnitude(code);
}

// kernels::f32_to_e4m3 (its `nearest` over the 127 finite non-negative E4M3 values): the largest
// byte whose value is <= x, then the nearer of it and the next, ties to the even byte, with the
// differences rounded in fp32 as the CPU rounds them. Binary search finds the same byte as the
// CPU's linear one (the values ascend strictly).
COLIBRI_FP4_LANE uint32_t nearest_e4m3(float x) {
  x = x < 0.0f ? 0.0f : x;
  uint32_t lo = 0, hi = 126;  // values[lo] <= x (values[0] = 0) unless x is a NaN
  while (lo < hi) {
    const uint32_t mid = (lo + hi + 1) / 2;
    if (e4m3_value(mid) <= x)
      lo = mid;
    else
      hi = mid - 1;
  }
  if (lo == 126) return lo;
  const float below = x - e4m3_value(lo), above = e4m3_value(lo + 1) - x;
  if (below < above) return lo;
  if (above < below) return lo + 1;
  return lo % 2 == 0 ? lo : lo + 1;
}

// kernels::f32_to_e2m1: the nearest magnitude (ties to the even code), the sign bit for x < 0.
COLIBRI_FP4_LANE uint32_t nearest_e2m1(float x) {
  const float a = x < 0.0f ? -x : x;
  uint32_t i = 0;
  while (i + 1 < 8 && e2m1_magnitude(i + 1) <= a) ++i;
  uint32_t code = i;
  if (i + 1 < 8) {
    const float below = a - e2m1_magnitude(i), above = e2m1_magnitude(i + 1) - a;
    if (above < below || (!(below < above) && i % 2 == 1)) code = i + 1;
  }
  return x < 0.0f ? (code | 8u) : code;
}

// The recipe's global scale from the tensor's amax (kernels::quantize_nvfp4).
COLIBRI_FP4_LANE float global_scale(float amax) {
  return amax / (6.0f * 448.0f);
}

// One block of 16 values quantized as kernels::quantize_nvfp4 does, bit for bit: its E4M3 scale
// (returned) and 8 code bytes (column 2j in the low nibble of byte j).
COLIBRI_FP4_LANE uint32_t quantize_block(const float* block, float global, uint8_t* codes) {
  float amax = 0.0f;
  for (int k = 0; k < kBlock; ++k) {
    const float a = block[k] < 0.0f ? -block[k] : block[k];
    amax = a > amax ? a : amax;
  }
  const float exact = global > 0.0f ? amax / (6.0f * global) : 0.0f;
  const uint32_t scale = nearest_e4m3(exact == 0.0f ? 1.0f : exact);
  const float step = e4m3_value(scale) * global;
  for (int k = 0; k < kBlock; k += 2) {
    const uint32_t low = step > 0.0f ? nearest_e2m1(block[k] / step) : 0u;
    const uint32_t high = step > 0.0f ? nearest_e2m1(block[k + 1] / step) : 0u;
    codes[k / 2] = uint8_t(low | (high << 4));
  }
  return scale;
}

// Eight codes of row r at columns k .. k + 7 (k a multiple of 8) as one register; 0 past the
// matrix (rows or columns), which adds nothing to a product.
COLIBRI_FP4_LANE uint32_t load_codes(const Fp4Rows& m, int64_t r, int64_t k) {
  if (r >= m.rows || k >= m.cols) return 0u;
  const uint8_t* p = m.codes + r * (m.cols / 2) + k / 2;
#ifdef __CUDA_ARCH__
  return *reinterpret_cast<const uint32_t*>(p);  // codes 4-byte aligned, cols % 16 == 0
#else
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
#endif
}

// The four scales of row r for the chunk at k0 (byte j: columns k0 + 16j ..); 0 past the matrix.
COLIBRI_FP4_LANE uint32_t load_scales(const Fp4Rows& m, int64_t r, int64_t k0) {
  if (r >= m.rows) return 0u;
  const uint8_t* p = m.scales + r * (m.cols / kBlock) + k0 / kBlock;
  uint32_t s = 0;
  for (int j = 0; j < 4; ++j)
    if (k0 + kBlock * j < m.cols) s |= uint32_t(p[j]) << (8 * j);
  return s;
}

// Lane `lane`'s A operand for rows r0 .. r0 + 15 and the chunk at k0.
COLIBRI_FP4_LANE void load_a(const Fp4Rows& w, int64_t r0, int64_t k0, int lane, uint32_t (&a)[4],
                             uint32_t& scale_a) {
  const int g = lane / 4, t = lane % 4;
  a[0] = load_codes(w, r0 + g, k0 + 8 * t);
  a[1] = load_codes(w, r0 + g + 8, k0 + 8 * t);
  a[2] = load_codes(w, r0 + g, k0 + 32 + 8 * t);
  a[3] = load_codes(w, r0 + g + 8, k0 + 32 + 8 * t);
  scale_a = load_scales(w, r0 + g + 8 * (t % 2), k0);
}

// Lane `lane`'s B operand for the chunk at k0, its column (lane / 4) being row `row` of x (rows
// past x.rows read as zeros): the grouped expert FFN gathers each slot's row this way.
COLIBRI_FP4_LANE void load_b_row(const Fp4Rows& x, int64_t row, int64_t k0, int lane,
                                 uint32_t (&b)[2], uint32_t& scale_b) {
  const int t = lane % 4;
  b[0] = load_codes(x, row, k0 + 8 * t);
  b[1] = load_codes(x, row, k0 + 32 + 8 * t);
  scale_b = load_scales(x, row, k0);
}

// Lane `lane`'s B operand for columns (activation rows) n0 .. n0 + 7 and the chunk at k0.
COLIBRI_FP4_LANE void load_b(const Fp4Rows& x, int64_t n0, int64_t k0, int lane, uint32_t (&b)[2],
                             uint32_t& scale_b) {
  load_b_row(x, n0 + lane / 4, k0, lane, b, scale_b);
}

// Where accumulator i of lane `lane` lies in the 16 x 8 tile.
COLIBRI_FP4_LANE int acc_row(int lane, int i) {
  return lane / 4 + 8 * (i / 2);
}
COLIBRI_FP4_LANE int acc_col(int lane, int i) {
  return 2 * (lane % 4) + i % 2;
}

#ifndef __CUDACC__
// The instruction on the host, over the 32 lanes' registers, from the layout above (selectors
// {0, 0}); products in double, so it is the exact sum up to one final rounding to fp32.
inline void mma_m16n8k64_warp(const uint32_t (&a)[kWarpSize][4], const uint32_t (&b)[kWarpSize][2],
                              const uint32_t (&scale_a)[kWarpSize],
                              const uint32_t (&scale_b)[kWarpSize], float (&d)[kWarpSize][4]) {
  const auto nibble = [](uint32_t reg, int k) { return (reg >> (4 * (k % 8))) & 15u; };
  const auto byte = [](uint32_t reg, int j) { return (reg >> (8 * j)) & 255u; };
  for (int m = 0; m < kTileRows; ++m)
    for (int n = 0; n < kTileCols; ++n) {
      double sum = 0.0;
      for (int k = 0; k < kChunk; ++k) {
        const uint32_t av = nibble(a[4 * (m % 8) + (k % 32) / 8][m / 8 + 2 * (k / 32)], k);
        const uint32_t bv = nibble(b[4 * n + (k % 32) / 8][k / 32], k);
        const uint32_t sa = byte(scale_a[4 * (m % 8) + m / 8], k / kBlock);
        const uint32_t sb = byte(scale_b[4 * n], k / kBlock);
        sum += double(e2m1_value(av)) * e2m1_value(bv) * e4m3_value(sa) * e4m3_value(sb);
      }
      const int lane = 4 * (m % 8) + n / 2, i = 2 * (m / 8) + n % 2;
      d[lane][i] += float(sum);
    }
}
#endif

}  // namespace colibri::cuda::fp4
