// The tensor-core tile of the grouped expert FFN (expert_ffn.cu, batches of 8+ slots per
// expert): one warp computes D[16 weight rows, 8 slots] = W[r0 .. r0 + 15, :] · x_slot with
// mma.sync.m16n8k16 (BF16 inputs, fp32 accumulation), for int4 weights (per row, or per group of
// a multiple of 64 columns) whose rows are a multiple of 64 columns.
//   - Weights: each nibble q becomes the BF16 integer q - 8 (exact); the scale of each 64-column
//     chunk is applied to that chunk's fp32 partial sums, as the CUDA-core path does per 32.
//   - Zero points (int4 offsets): each chunk adds offset * (the chunk's sum of the fp32 x) to its
//     rows, as the CUDA-core path does per 32 columns. A lane sums its slot's 16 columns; the 4
//     lanes of a slot add theirs (xor shuffles 1, 2), and each lane takes the sums of its
//     accumulators' slots 2t, 2t + 1 from lanes 8t and 8t + 4 (chunk_x_sums).
//   - Activations: each fp32 x is split into BF16 hi + lo (hi = x rounded, lo = x - hi rounded),
//     two mma per k-step, so x is carried to within 2^-18 |x| (the products are exact in fp32).
//   - Columns are permuted within each 64-column chunk so that a lane reads its 16 weight bytes
//     as one 8-byte load per row and its activations as float4s: lane (g = lane / 4, t = lane % 4)
//     holds physical columns 16t .. 16t + 15; k-step j takes 4 of them, 16t + 4j .. 16t + 4j + 3,
//     as the fragment's k = 2t, 2t + 1 (a0/a1, b0) and 2t + 8, 2t + 9 (a2/a3, b1). The same
//     permutation on both operands leaves every dot product unchanged.
// Fragment layouts are PTX's for mma.m16n8k16 with .bf16 (row-major A, column-major B):
//   a0: (row g, k 2t..2t+1)  a1: (row g+8, k 2t..)  a2: (row g, k 2t+8..)  a3: (row g+8, k 2t+8..)
//   b0: (k 2t..2t+1, col g)  b1: (k 2t+8.., col g)
//   c0, c1: (row g, cols 2t, 2t+1)  c2, c3: (row g+8, cols 2t, 2t+1)
// A host compiler gets the same lane code plus an emulated mma over the 32 lanes' fragments
// (mma_m16n8k16_warp), so that tests/gpu/expert_ffn_mma_test.cpp checks the indexing, the
// dequantisation and the split on a machine without a GPU.
#pragma once

#include "cuda/expert_ffn_lanes.cuh"

namespace colibri::cuda::mma {

using lanes::kWarpSize;
constexpr int kTileRows = 16, kTileSlots = 8, kChunkCols = 64;

// The tile path applies to W: wide int4, cols % 64 == 0, per row or group_size % 64 == 0.
COLIBRI_LANE bool tile_ok(const DeviceMatrix& w) {
  return lanes::is_wide_int4(w) && w.cols % kChunkCols == 0 &&
         (w.format == WeightFormat::kInt4Row || w.group_size % kChunkCols == 0);
}

// BF16 bits of x rounded to nearest even (finite x).
COLIBRI_LANE uint32_t bf16_rne(float x) {
  uint32_t u;
#ifdef __CUDACC__
  u = __float_as_uint(x);
#else
  std::memcpy(&u, &x, 4);
#endif
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

// x as BF16 hi and lo: hi = bf16(x), lo = bf16(x - hi).
COLIBRI_LANE void split_bf16(float x, uint32_t& hi, uint32_t& lo) {
  hi = bf16_rne(x);
  lo = bf16_rne(x - lanes::lane_bits_to_float(hi << 16));
}

// Two BF16 values in one register: `low` at the smaller k.
COLIBRI_LANE uint32_t pack_bf16x2(uint32_t low, uint32_t high) {
  return (low & 0xFFFFu) | (high << 16);
}

// The byte's two nibbles (low nibble = smaller column) as BF16 (q - 8), packed.
COLIBRI_LANE uint32_t int4_byte_to_bf16x2(uint32_t byte) {
  const float lo = float(int(byte & 15u) - 8), hi = float(int((byte >> 4) & 15u) - 8);
  // Integers of magnitude <= 8 have at most 4 significant bits: truncation to BF16 is exact.
  uint32_t ulo, uhi;
#ifdef __CUDACC__
  ulo = __float_as_uint(lo);
  uhi = __float_as_uint(hi);
#else
  std::memcpy(&ulo, &lo, 4);
  std::memcpy(&uhi, &hi, 4);
#endif
  return pack_bf16x2(ulo >> 16, uhi >> 16);
}

// The scale of 64-column chunk c of row `row`.
COLIBRI_LANE float tile_scale(const DeviceMatrix& w, int64_t row, int64_t c) {
  return w.format == WeightFormat::kInt4Grouped
             ? lanes::lane_load(lanes::row_scales(w, row) + c * kChunkCols / w.group_size)
             : lanes::lane_load(w.scales + row);
}

// The offset of 64-column chunk c of row `row` (w has zero points).
COLIBRI_LANE float tile_offset(const DeviceMatrix& w, int64_t row, int64_t c) {
  return w.format == WeightFormat::kInt4Grouped
             ? lanes::lane_load(lanes::row_offsets(w, row) + c * kChunkCols / w.group_size)
             : lanes::lane_load(w.offsets + row);
}

// One lane's operands for k-step j of a chunk: A from the two rows' 8 bytes, B from its slot's
// 4 activations (hi and lo).
struct Fragments {
  uint32_t a[4];
  uint32_t b_hi[2], b_lo[2];
};

COLIBRI_LANE Fragments fragments(uint2 qa, uint2 qb, float4 xv, int j) {
  Fragments f;
  const uint32_t wa = j < 2 ? qa.x : qa.y, wb = j < 2 ? qb.x : qb.y;
  const int shift = (j & 1) * 16;  // bytes 2j and 2j + 1 of the 8
  f.a[0] = int4_byte_to_bf16x2((wa >> shift) & 0xFFu);
  f.a[1] = int4_byte_to_bf16x2((wb >> shift) & 0xFFu);
  f.a[2] = int4_byte_to_bf16x2((wa >> (shift + 8)) & 0xFFu);
  f.a[3] = int4_byte_to_bf16x2((wb >> (shift + 8)) & 0xFFu);
  uint32_t h[4], l[4];
  split_bf16(xv.x, h[0], l[0]);
  split_bf16(xv.y, h[1], l[1]);
  split_bf16(xv.z, h[2], l[2]);
  split_bf16(xv.w, h[3], l[3]);
  f.b_hi[0] = pack_bf16x2(h[0], h[1]);
  f.b_hi[1] = pack_bf16x2(h[2], h[3]);
  f.b_lo[0] = pack_bf16x2(l[0], l[1]);
  f.b_lo[1] = pack_bf16x2(l[2], l[3]);
  return f;
}

// Where lane `lane` reads: its rows (clamped to the matrix), its slot and its columns.
struct LaneTile {
  int g, t;
  int64_t row_a, row_b;  // r0 + g and r0 + g + 8, clamped to rows - 1 for loads
};

COLIBRI_LANE LaneTile lane_tile(const DeviceMatrix& w, int64_t r0, int lane) {
  LaneTile p;
  p.g = lane / 4;
  p.t = lane % 4;
  p.row_a = r0 + p.g < w.rows ? r0 + p.g : w.rows - 1;
  p.row_b = r0 + p.g + 8 < w.rows ? r0 + p.g + 8 : w.rows - 1;
  return p;
}

// The loads of chunk c: 8 weight bytes of each of the lane's rows.
COLIBRI_LANE void load_chunk(const DeviceMatrix& w, const LaneTile& p, int64_t c, uint2& qa,
                             uint2& qb) {
  const auto* base = static_cast<const uint8_t*>(w.data);
  const int64_t at = c * (kChunkCols / 2) + 8 * p.t;
  qa = lanes::lane_load(reinterpret_cast<const uint2*>(base + p.row_a * (w.cols / 2) + at));
  qb = lanes::lane_load(reinterpret_cast<const uint2*>(base + p.row_b * (w.cols / 2) + at));
}

// The activations of k-step j of chunk c for the lane's slot, whose input row is x.
COLIBRI_LANE float4 load_x(const float* x, const LaneTile& p, int64_t c, int j) {
  return lanes::lane_load(reinterpret_cast<const float4*>(x + c * kChunkCols + 16 * p.t + 4 * j));
}

// BF16 mma needs sm_80; device code built for older targets takes the per-row path instead.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
constexpr bool kDeviceHasMma = false;
#else
constexpr bool kDeviceHasMma = true;
#endif

#ifdef __CUDACC__
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // not reached: kDeviceHasMma is false there
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// The x sums of a chunk for the lane's accumulators: `own` is the sum of the lane's 16 activations
// (slot g); the 4 lanes of slot g add theirs, then the lane takes slot 2t's and 2t + 1's.
__device__ __forceinline__ void chunk_x_sums(float own, int t, float& sum0, float& sum1) {
  own += __shfl_xor_sync(0xffffffffu, own, 1);
  own += __shfl_xor_sync(0xffffffffu, own, 2);
  sum0 = __shfl_sync(0xffffffffu, own, 8 * t);
  sum1 = __shfl_sync(0xffffffffu, own, 8 * t + 4);
}

// The warp's tile: acc = this lane's c0..c3 of D[16 rows from r0, slots xs[0..7]].
__device__ __forceinline__ void int4_tile(const DeviceMatrix& w, int64_t r0,
                                          const float* const (&xs)[kTileSlots], int lane,
                                          float (&acc)[4]) {
  const LaneTile p = lane_tile(w, r0, lane);
  const float* x = xs[p.g];
  const bool zero_points = w.offsets != nullptr;  // the same for the whole warp
  acc[0] = acc[1] = acc[2] = acc[3] = 0.0f;
  const int64_t chunks = w.cols / kChunkCols;
  for (int64_t c = 0; c < chunks; ++c) {
    uint2 qa, qb;
    load_chunk(w, p, c, qa, qb);
    float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float x_sum = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float4 xv = load_x(x, p, c, j);
      x_sum += (xv.x + xv.y) + (xv.z + xv.w);
      const Fragments f = fragments(qa, qb, xv, j);
      mma_bf16(part, f.a, f.b_hi);
      mma_bf16(part, f.a, f.b_lo);
    }
    const float sa = tile_scale(w, p.row_a, c), sb = tile_scale(w, p.row_b, c);
    acc[0] = fmaf(part[0], sa, acc[0]);
    acc[1] = fmaf(part[1], sa, acc[1]);
    acc[2] = fmaf(part[2], sb, acc[2]);
    acc[3] = fmaf(part[3], sb, acc[3]);
    if (zero_points) {
      float sum0, sum1;
      chunk_x_sums(x_sum, p.t, sum0, sum1);
      const float oa = tile_offset(w, p.row_a, c), ob = tile_offset(w, p.row_b, c);
      acc[0] = fmaf(sum0, oa, acc[0]);
      acc[1] = fmaf(sum1, oa, acc[1]);
      acc[2] = fmaf(sum0, ob, acc[2]);
      acc[3] = fmaf(sum1, ob, acc[3]);
    }
  }
}
#else
// D += A · B over the 32 lanes' fragments, in the PTX layout above; fp32 sums over k in order.
inline void mma_m16n8k16_warp(float (&c)[kWarpSize][4], const uint32_t (&a)[kWarpSize][4],
                              const uint32_t (&b)[kWarpSize][2]) {
  const auto bf = [](uint32_t bits16) { return lanes::lane_bits_to_float(bits16 << 16); };
  float A[16][16], B[16][8];
  for (int lane = 0; lane < kWarpSize; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int h = 0; h < 2; ++h) {
      A[g][2 * t + h] = bf(a[lane][0] >> (16 * h));
      A[g + 8][2 * t + h] = bf(a[lane][1] >> (16 * h));
      A[g][2 * t + 8 + h] = bf(a[lane][2] >> (16 * h));
      A[g + 8][2 * t + 8 + h] = bf(a[lane][3] >> (16 * h));
      B[2 * t + h][g] = bf(b[lane][0] >> (16 * h));
      B[2 * t + 8 + h][g] = bf(b[lane][1] >> (16 * h));
    }
  }
  for (int lane = 0; lane < kWarpSize; ++lane) {
    const int g = lane / 4, t = lane % 4;
    const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    for (int i = 0; i < 4; ++i) {
      float s = c[lane][i];
      for (int k = 0; k < 16; ++k) s += A[rows[i]][k] * B[k][cols[i]];
      c[lane][i] = s;
    }
  }
}

// The warp's tile on the host: every lane's acc, as int4_tile computes them on a device (the
// shuffles of chunk_x_sums as reads of the other lanes' values).
inline void int4_tile_warp(const DeviceMatrix& w, int64_t r0, const float* const (&xs)[kTileSlots],
                           float (&acc)[kWarpSize][4]) {
  LaneTile p[kWarpSize];
  for (int lane = 0; lane < kWarpSize; ++lane) {
    p[lane] = lane_tile(w, r0, lane);
    for (int i = 0; i < 4; ++i) acc[lane][i] = 0.0f;
  }
  for (int64_t c = 0; c < w.cols / kChunkCols; ++c) {
    uint2 qa[kWarpSize], qb[kWarpSize];
    float part[kWarpSize][4] = {};
    float x_sum[kWarpSize] = {};
    for (int lane = 0; lane < kWarpSize; ++lane) load_chunk(w, p[lane], c, qa[lane], qb[lane]);
    for (int j = 0; j < 4; ++j) {
      uint32_t a[kWarpSize][4], b_hi[kWarpSize][2], b_lo[kWarpSize][2];
      for (int lane = 0; lane < kWarpSize; ++lane) {
        const float4 xv = load_x(xs[p[lane].g], p[lane], c, j);
        x_sum[lane] += (xv.x + xv.y) + (xv.z + xv.w);
        const Fragments f = fragments(qa[lane], qb[lane], xv, j);
        for (int i = 0; i < 4; ++i) a[lane][i] = f.a[i];
        for (int i = 0; i < 2; ++i) {
          b_hi[lane][i] = f.b_hi[i];
          b_lo[lane][i] = f.b_lo[i];
        }
      }
      mma_m16n8k16_warp(part, a, b_hi);
      mma_m16n8k16_warp(part, a, b_lo);
    }
    for (int lane = 0; lane < kWarpSize; ++lane) {
      const float sa = tile_scale(w, p[lane].row_a, c), sb = tile_scale(w, p[lane].row_b, c);
      acc[lane][0] = std::fma(part[lane][0], sa, acc[lane][0]);
      acc[lane][1] = std::fma(part[lane][1], sa, acc[lane][1]);
      acc[lane][2] = std::fma(part[lane][2], sb, acc[lane][2]);
      acc[lane][3] = std::fma(part[lane][3], sb, acc[lane][3]);
    }
    if (w.offsets == nullptr) continue;
    float pairs[kWarpSize], quads[kWarpSize];
    for (int lane = 0; lane < kWarpSize; ++lane) pairs[lane] = x_sum[lane] + x_sum[lane ^ 1];
    for (int lane = 0; lane < kWarpSize; ++lane) quads[lane] = pairs[lane] + pairs[lane ^ 2];
    for (int lane = 0; lane < kWarpSize; ++lane) {
      const float sum0 = quads[8 * p[lane].t], sum1 = quads[8 * p[lane].t + 4];
      const float oa = tile_offset(w, p[lane].row_a, c), ob = tile_offset(w, p[lane].row_b, c);
      acc[lane][0] = std::fma(sum0, oa, acc[lane][0]);
      acc[lane][1] = std::fma(sum1, oa, acc[lane][1]);
      acc[lane][2] = std::fma(sum0, ob, acc[lane][2]);
      acc[lane][3] = std::fma(sum1, ob, acc[lane][3]);
    }
  }
}
#endif

// Which output lane `lane`'s acc[i] is: (row offset within the tile, slot).
COLIBRI_LANE void acc_position(int lane, int i, int& row, int& slot) {
  row = lane / 4 + (i >= 2 ? 8 : 0);
  slot = 2 * (lane % 4) + (i & 1);
}

}  // namespace colibri::cuda::mma
