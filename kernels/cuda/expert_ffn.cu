#include "cuda/expert_ffn.cuh"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "cpu/quant.h"
#include "cuda/check.h"

namespace colibri::cuda {
namespace {

constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = 8;
constexpr int kThreadsPerBlock = kWarpSize * kWarpsPerBlock;
constexpr int kMaxSlotsPerPass = 8;  // slots whose dot products share one pass over a weight row

__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

// Byte j of v (a value below 256) as an exact float minus `bias`: 0x4B000000 | b is the float
// 2^23 + b, so one byte permute and one subtraction dequantise it.
__device__ __forceinline__ float byte_to_float(uint32_t v, int j, float bias) {
  return __int_as_float(int(__byte_perm(v, 0x4B000000u, 0x7440u | unsigned(j)))) - bias;
}
constexpr float kInt4Bias = 8388608.0f + 8.0f;    // stored nibble q + 8
constexpr float kInt8Bias = 8388608.0f + 128.0f;  // stored byte q, read as (q ^ 0x80) = q + 128

// acc[t] += 8 weights w[0..7] · x_t[0..7], x_t at float4 index i4 of slot t's input row.
template <int T>
__device__ __forceinline__ void dot8(const float (&w)[8], const float4* const (&x4)[T], int64_t i4,
                                     float (&acc)[T]) {
#pragma unroll
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

// 32 int4 weights (one 16-byte load, columns 32c .. 32c + 31) against T inputs; the sum of
// x * (q - 8) is scaled once per load (the 32 columns share one scale: group_size % 32 == 0).
template <int T>
__device__ __forceinline__ void int4_chunk(uint4 q, float scale, int64_t c,
                                           const float4* const (&x4)[T], float (&acc)[T]) {
  float part[T];
#pragma unroll
  for (int t = 0; t < T; ++t) part[t] = 0.0f;
  const uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t lo = words[k] & 0x0F0F0F0Fu, hi = (words[k] >> 4) & 0x0F0F0F0Fu;
    float w[8];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      w[2 * j] = byte_to_float(lo, j, kInt4Bias);  // element 2j: low nibble of byte j
      w[2 * j + 1] = byte_to_float(hi, j, kInt4Bias);
    }
    dot8<T>(w, x4, c * 8 + 2 * k, part);
  }
#pragma unroll
  for (int t = 0; t < T; ++t) acc[t] = fmaf(part[t], scale, acc[t]);
}

// 16 int8 weights (columns 16c .. 16c + 15), unscaled: the row scale is applied at the end.
template <int T>
__device__ __forceinline__ void int8_chunk(uint4 q, int64_t c, const float4* const (&x4)[T],
                                           float (&acc)[T]) {
  const uint32_t words[4] = {q.x ^ 0x80808080u, q.y ^ 0x80808080u, q.z ^ 0x80808080u,
                             q.w ^ 0x80808080u};
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    float w[8];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      w[j] = byte_to_float(words[2 * k], j, kInt8Bias);
      w[4 + j] = byte_to_float(words[2 * k + 1], j, kInt8Bias);
    }
    dot8<T>(w, x4, c * 4 + 2 * k, acc);
  }
}

__device__ __forceinline__ bool is_wide_int4(const DeviceMatrix& w) {
  return w.wide && (w.format == WeightFormat::kInt4Row || w.format == WeightFormat::kInt4Grouped);
}

// The scale of 32-column chunk c of a wide int4 row whose scales start at `scales`.
__device__ __forceinline__ float chunk_scale(const DeviceMatrix& w, const float* scales,
                                             int64_t c) {
  return __ldg(scales + (w.format == WeightFormat::kInt4Grouped ? c / (w.group_size / 32) : 0));
}

// The first scale of row r: ceil(cols / group_size) per row, the last group possibly short.
__device__ __forceinline__ const float* row_scales(const DeviceMatrix& w, int64_t r) {
  return w.scales + (w.format == WeightFormat::kInt4Grouped
                         ? r * ((w.cols + w.group_size - 1) / w.group_size)
                         : r);
}

// Lane `lane`'s share of W[r, :] · x_t for t < T; a warp_sum of acc[t] gives the dot product.
template <int T>
__device__ __forceinline__ void row_dot(const DeviceMatrix& w, int64_t r,
                                        const float* const (&xs)[T], int lane, float (&acc)[T]) {
#pragma unroll
  for (int t = 0; t < T; ++t) acc[t] = 0.0f;
  const int64_t cols = w.cols;
  if (w.wide) {
    const float4* x4[T];
#pragma unroll
    for (int t = 0; t < T; ++t) x4[t] = reinterpret_cast<const float4*>(xs[t]);
    switch (w.format) {
      case WeightFormat::kInt4Row:
      case WeightFormat::kInt4Grouped: {
        const uint4* row =
            reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(w.data) + r * (cols / 2));
        const int64_t chunks = cols / 32;
        const float* scales = row_scales(w, r);
        // Two loads in flight per lane before the arithmetic.
        for (int64_t c = lane; c < chunks; c += 2 * kWarpSize) {
          const int64_t c1 = c + kWarpSize;
          const bool second = c1 < chunks;
          const uint4 q0 = __ldg(row + c);
          const uint4 q1 = second ? __ldg(row + c1) : make_uint4(0, 0, 0, 0);
          int4_chunk<T>(q0, chunk_scale(w, scales, c), c, x4, acc);
          if (second) int4_chunk<T>(q1, chunk_scale(w, scales, c1), c1, x4, acc);
        }
        return;
      }
      case WeightFormat::kInt8Row: {
        const uint4* row =
            reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(w.data) + r * cols);
        const int64_t chunks = cols / 16;
        for (int64_t c = lane; c < chunks; c += 2 * kWarpSize) {
          const bool second = c + kWarpSize < chunks;
          const uint4 q0 = __ldg(row + c);
          const uint4 q1 = second ? __ldg(row + c + kWarpSize) : make_uint4(0, 0, 0, 0);
          int8_chunk<T>(q0, c, x4, acc);
          if (second) int8_chunk<T>(q1, c + kWarpSize, x4, acc);
        }
        const float s = __ldg(w.scales + r);
#pragma unroll
        for (int t = 0; t < T; ++t) acc[t] *= s;
        return;
      }
      case WeightFormat::kF32: {
        const float4* row =
            reinterpret_cast<const float4*>(static_cast<const float*>(w.data) + r * cols);
        for (int64_t c = lane; c < cols / 4; c += kWarpSize) {
          const float4 wv = __ldg(row + c);
#pragma unroll
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
    }
    return;
  }
  // Any shape: one element per lane and step, each weight dequantised as the CPU does,
  // (q - 8) * s or q * s.
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
        const float s = w.format == WeightFormat::kInt4Grouped
                            ? w.scales[r * n_groups + i / w.group_size]
                            : w.scales[r];
        wv = float(q) * s;
        break;
      }
      case WeightFormat::kInt8Row:
        wv = float(int8_t(bytes[r * cols + i])) * w.scales[r];
        break;
      default:
        wv = static_cast<const float*>(w.data)[r * cols + i];
        break;
    }
#pragma unroll
    for (int t = 0; t < T; ++t) acc[t] = fmaf(xs[t][i], wv, acc[t]);
  }
}

// Row r of two wide int4 matrices of the same width (gate and up) against the same inputs, with
// four 16-byte loads in flight per lane: the same sums as two row_dot calls.
template <int T>
__device__ __forceinline__ void int4_row_dot2(const DeviceMatrix& a, const DeviceMatrix& b,
                                              int64_t r, const float* const (&xs)[T], int lane,
                                              float (&acc_a)[T], float (&acc_b)[T]) {
#pragma unroll
  for (int t = 0; t < T; ++t) acc_a[t] = acc_b[t] = 0.0f;
  const float4* x4[T];
#pragma unroll
  for (int t = 0; t < T; ++t) x4[t] = reinterpret_cast<const float4*>(xs[t]);
  const int64_t cols = a.cols, chunks = cols / 32;
  const uint4* row_a =
      reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(a.data) + r * (cols / 2));
  const uint4* row_b =
      reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(b.data) + r * (cols / 2));
  const float* scales_a = row_scales(a, r);
  const float* scales_b = row_scales(b, r);
  for (int64_t c = lane; c < chunks; c += 2 * kWarpSize) {
    const int64_t c1 = c + kWarpSize;
    const bool second = c1 < chunks;
    const uint4 a0 = __ldg(row_a + c), b0 = __ldg(row_b + c);
    const uint4 a1 = second ? __ldg(row_a + c1) : make_uint4(0, 0, 0, 0);
    const uint4 b1 = second ? __ldg(row_b + c1) : make_uint4(0, 0, 0, 0);
    int4_chunk<T>(a0, chunk_scale(a, scales_a, c), c, x4, acc_a);
    int4_chunk<T>(b0, chunk_scale(b, scales_b, c), c, x4, acc_b);
    if (second) {
      int4_chunk<T>(a1, chunk_scale(a, scales_a, c1), c1, x4, acc_a);
      int4_chunk<T>(b1, chunk_scale(b, scales_b, c1), c1, x4, acc_b);
    }
  }
}

// Input rows of slots s0 .. s0 + T - 1 of one expert (slots past `end` repeat the last one;
// their results are not written).
template <int T>
__device__ __forceinline__ void slot_inputs(const float* base, const int32_t* slot_row,
                                            int64_t stride, int s0, int end,
                                            const float* (&xs)[T]) {
#pragma unroll
  for (int t = 0; t < T; ++t) {
    const int s = min(s0 + t, end - 1);
    xs[t] = base + int64_t(slot_row ? slot_row[s] : s) * stride;
  }
}

// grid (ceil(inter / 8), n_experts): warp w of block b computes output row 8b + w of gate and up
// for every slot of expert blockIdx.y.
template <int T>
__global__ void __launch_bounds__(kThreadsPerBlock) gate_up_kernel(ExpertGroup g) {
  const int lane = int(threadIdx.x) % kWarpSize;
  const int64_t r = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  if (r >= g.inter) return;  // whole warps only
  const DeviceExpert& e = g.experts[blockIdx.y];
  const int begin = g.expert_begin[blockIdx.y], end = g.expert_begin[blockIdx.y + 1];
  for (int s0 = begin; s0 < end; s0 += T) {
    const float* xs[T];
    slot_inputs<T>(g.x, g.slot_row, g.hidden, s0, end, xs);
    float acc_gate[T], acc_up[T];
    if (is_wide_int4(e.gate) && is_wide_int4(e.up) && e.gate.cols == e.up.cols) {
      int4_row_dot2<T>(e.gate, e.up, r, xs, lane, acc_gate, acc_up);
    } else {
      row_dot<T>(e.gate, r, xs, lane, acc_gate);
      row_dot<T>(e.up, r, xs, lane, acc_up);
    }
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const float gate = warp_sum(acc_gate[t]), up = warp_sum(acc_up[t]);
      if (lane == 0 && s0 + t < end)
        g.h[int64_t(s0 + t) * g.inter + r] = gate / (1.0f + expf(-gate)) * up;
    }
  }
}

// grid (ceil(hidden / 8), n_experts): y_slots[slot, r] = down[r, :] · h[slot, :].
template <int T>
__global__ void __launch_bounds__(kThreadsPerBlock) down_kernel(ExpertGroup g) {
  const int lane = int(threadIdx.x) % kWarpSize;
  const int64_t r = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  if (r >= g.hidden) return;
  const DeviceExpert& e = g.experts[blockIdx.y];
  const int begin = g.expert_begin[blockIdx.y], end = g.expert_begin[blockIdx.y + 1];
  for (int s0 = begin; s0 < end; s0 += T) {
    const float* hs[T];
    slot_inputs<T>(g.h, nullptr, g.inter, s0, end, hs);
    float acc[T];
    row_dot<T>(e.down, r, hs, lane, acc);
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const float y = warp_sum(acc[t]);
      if (lane == 0 && s0 + t < end) g.y_slots[int64_t(s0 + t) * g.hidden + r] = y;
    }
  }
}

// One thread per output element: out[row, j] = ((0 + w0 y0) + w1 y1) + ..., experts ascending.
__global__ void combine_kernel(ExpertGroup g) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(g.n_rows) * g.hidden) return;
  const int64_t row = i / g.hidden, j = i % g.hidden;
  float acc = 0.0f;
  for (int k = g.row_begin[row]; k < g.row_begin[row + 1]; ++k)
    acc = __fadd_rn(acc,
                    __fmul_rn(g.row_weights[k], g.y_slots[int64_t(g.row_slots[k]) * g.hidden + j]));
  g.out[i] = acc;
}

template <int T>
void launch_projections(const ExpertGroup& g, cudaStream_t stream) {
  const dim3 gate_grid(unsigned((g.inter + kWarpsPerBlock - 1) / kWarpsPerBlock),
                       unsigned(g.n_experts));
  gate_up_kernel<T><<<gate_grid, kThreadsPerBlock, 0, stream>>>(g);
  CHECK_CUDA_LAUNCH();
  const dim3 down_grid(unsigned((g.hidden + kWarpsPerBlock - 1) / kWarpsPerBlock),
                       unsigned(g.n_experts));
  down_kernel<T><<<down_grid, kThreadsPerBlock, 0, stream>>>(g);
  CHECK_CUDA_LAUNCH();
}

void check_group(const ExpertGroup& g) {
  if (g.n_experts < 0 || g.n_slots < 0 || g.n_rows < 0 || g.hidden <= 0 || g.inter <= 0)
    throw std::invalid_argument("expert_ffn_grouped: negative counts or empty shapes");
  if (g.n_experts > 65535)
    throw std::invalid_argument("expert_ffn_grouped: more than 65535 experts in one request");
  if (g.n_slots > 0 && g.max_slots_per_expert <= 0)
    throw std::invalid_argument("expert_ffn_grouped: max_slots_per_expert is not set");
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

}  // namespace

const char* weight_format_name(WeightFormat format) {
  switch (format) {
    case WeightFormat::kInt4Row:
      return "int4-row";
    case WeightFormat::kInt4Grouped:
      return "int4-grouped";
    case WeightFormat::kInt8Row:
      return "int8-row";
    case WeightFormat::kF32:
      return "f32";
  }
  return "unknown";
}

int64_t device_matrix_data_bytes(WeightFormat format, int64_t rows, int64_t cols) {
  switch (format) {
    case WeightFormat::kInt4Row:
    case WeightFormat::kInt4Grouped:
      return rows * ((cols + 1) / 2);
    case WeightFormat::kInt8Row:
      return rows * cols;
    case WeightFormat::kF32:
      return rows * cols * 4;
  }
  return 0;
}

int64_t device_matrix_scale_count(WeightFormat format, int64_t rows, int64_t cols, int group_size) {
  switch (format) {
    case WeightFormat::kInt4Grouped:
      return group_size > 0 ? rows * ((cols + group_size - 1) / group_size) : 0;
    case WeightFormat::kInt4Row:
    case WeightFormat::kInt8Row:
      return rows;
    case WeightFormat::kF32:
      return 0;
  }
  return 0;
}

DeviceMatrix device_matrix(WeightFormat format, int group_size, int64_t rows, int64_t cols,
                           const void* data, const float* scales, const char* what) {
  const auto fail = [&](const std::string& why) {
    throw std::invalid_argument(std::string(what) + " (" + weight_format_name(format) + ", " +
                                std::to_string(rows) + "x" + std::to_string(cols) + "): " + why);
  };
  if (rows <= 0 || cols <= 0) fail("empty or negative shape");
  if (format == WeightFormat::kInt4Grouped && !kernels::is_valid_group_size(group_size))
    fail("group size " + std::to_string(group_size) + " is not one of the container's");
  if (format != WeightFormat::kInt4Grouped && group_size != 0) fail("per-row formats take group 0");
  if (!data) fail("null data");
  if (format != WeightFormat::kF32 && !scales) fail("null scales");
  DeviceMatrix m;
  m.format = format;
  m.group_size = group_size;
  m.rows = rows;
  m.cols = cols;
  m.data = data;
  m.scales = scales;
  bool wide = aligned16(data);
  switch (format) {
    case WeightFormat::kInt4Row:
      wide = wide && cols % 32 == 0;
      break;
    case WeightFormat::kInt4Grouped:
      wide = wide && cols % 32 == 0 && group_size % 32 == 0;
      break;
    case WeightFormat::kInt8Row:
      wide = wide && cols % 16 == 0;
      break;
    case WeightFormat::kF32:
      wide = wide && cols % 4 == 0;
      break;
  }
  m.wide = wide ? 1 : 0;
  return m;
}

void expert_ffn_grouped_no_combine(const ExpertGroup& g, cudaStream_t stream) {
  check_group(g);
  if (g.n_experts == 0 || g.n_slots == 0) return;
  // The wide paths read input rows as float4 (their widths are then multiples of 4).
  if (!aligned16(g.x) || !aligned16(g.h))
    throw std::invalid_argument("expert_ffn_grouped: x and h must be 16-byte aligned");
  const int m = g.max_slots_per_expert;
  if (m <= 1)
    launch_projections<1>(g, stream);
  else if (m <= 2)
    launch_projections<2>(g, stream);
  else if (m <= 4)
    launch_projections<4>(g, stream);
  else
    launch_projections<kMaxSlotsPerPass>(g, stream);
}

void expert_ffn_grouped(const ExpertGroup& g, cudaStream_t stream) {
  check_group(g);
  if (g.n_rows == 0) return;
  expert_ffn_grouped_no_combine(g, stream);
  const int64_t n = int64_t(g.n_rows) * g.hidden;
  constexpr int kCombineThreads = 256;
  combine_kernel<<<unsigned((n + kCombineThreads - 1) / kCombineThreads), kCombineThreads, 0,
                   stream>>>(g);
  CHECK_CUDA_LAUNCH();
}

}  // namespace colibri::cuda
