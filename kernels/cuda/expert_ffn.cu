#include "cuda/expert_ffn.cuh"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "cpu/quant.h"
#include "cuda/check.h"
#include "cuda/expert_ffn_lanes.cuh"
#include "cuda/expert_ffn_mma.cuh"
#include "cuda/nvfp4_mma.cuh"

namespace colibri::cuda {
namespace {

using namespace lanes;
constexpr int kWarpsPerBlock = 8;
constexpr int kThreadsPerBlock = kWarpSize * kWarpsPerBlock;
constexpr int kMaxSlotsPerPass = 8;  // slots whose dot products share one pass over a weight row
constexpr int kMmaMinSlots = 8;      // the tensor-core path from this many slots of one expert

__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
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
  if (e.gate.data == nullptr) return;  // skipped: computed elsewhere or in another phase
  const int begin = g.expert_begin[blockIdx.y], end = g.expert_begin[blockIdx.y + 1];
  for (int s0 = begin; s0 < end; s0 += T) {
    const float* xs[T];
    slot_inputs<T>(g.x, g.slot_row, g.hidden, s0, end, xs);
    float acc_gate[T], acc_up[T];
    const bool pair = is_wide_int4(e.gate) && is_wide_int4(e.up) && e.gate.cols == e.up.cols;
    if (pair && e.gate.offsets && e.up.offsets) {
      int4_row_dot2<T, true>(e.gate, e.up, r, xs, lane, acc_gate, acc_up);
    } else if (pair && !e.gate.offsets && !e.up.offsets) {
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
  if (e.gate.data == nullptr) return;
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

// Tensor-core variants (cuda/expert_ffn_mma.cuh), for experts with 8+ slots: warp w of block b
// computes output rows 16 (8b + w) .. + 15 for 8 slots at a time. Matrices the tile path does not
// take (not int4, or widths / groups not multiples of 64) run the per-row path on the same rows.
constexpr int kTileRowsPerBlock = mma::kTileRows * kWarpsPerBlock;

__global__ void __launch_bounds__(kThreadsPerBlock) gate_up_mma_kernel(ExpertGroup g) {
  const int lane = int(threadIdx.x) % kWarpSize;
  const int64_t r0 =
      int64_t(blockIdx.x) * kTileRowsPerBlock + int64_t(threadIdx.x / kWarpSize) * mma::kTileRows;
  if (r0 >= g.inter) return;  // whole warps only
  const DeviceExpert& e = g.experts[blockIdx.y];
  if (e.gate.data == nullptr) return;
  const int begin = g.expert_begin[blockIdx.y], end = g.expert_begin[blockIdx.y + 1];
  const bool tiles = mma::kDeviceHasMma && mma::tile_ok(e.gate) && mma::tile_ok(e.up);
  for (int s0 = begin; s0 < end; s0 += mma::kTileSlots) {
    const float* xs[mma::kTileSlots];
    slot_inputs<mma::kTileSlots>(g.x, g.slot_row, g.hidden, s0, end, xs);
    if (tiles) {
      float gate[4], up[4];
      mma::int4_tile(e.gate, r0, xs, lane, gate);
      mma::int4_tile(e.up, r0, xs, lane, up);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        int row, slot;
        mma::acc_position(lane, i, row, slot);
        if (r0 + row < g.inter && s0 + slot < end)
          g.h[int64_t(s0 + slot) * g.inter + r0 + row] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
      }
      continue;
    }
    for (int64_t r = r0; r < r0 + mma::kTileRows && r < g.inter; ++r) {
      float acc_gate[mma::kTileSlots], acc_up[mma::kTileSlots];
      row_dot<mma::kTileSlots>(e.gate, r, xs, lane, acc_gate);
      row_dot<mma::kTileSlots>(e.up, r, xs, lane, acc_up);
#pragma unroll
      for (int t = 0; t < mma::kTileSlots; ++t) {
        const float gate = warp_sum(acc_gate[t]), up = warp_sum(acc_up[t]);
        if (lane == 0 && s0 + t < end)
          g.h[int64_t(s0 + t) * g.inter + r] = gate / (1.0f + expf(-gate)) * up;
      }
    }
  }
}

__global__ void __launch_bounds__(kThreadsPerBlock) down_mma_kernel(ExpertGroup g) {
  const int lane = int(threadIdx.x) % kWarpSize;
  const int64_t r0 =
      int64_t(blockIdx.x) * kTileRowsPerBlock + int64_t(threadIdx.x / kWarpSize) * mma::kTileRows;
  if (r0 >= g.hidden) return;
  const DeviceExpert& e = g.experts[blockIdx.y];
  if (e.gate.data == nullptr) return;
  const int begin = g.expert_begin[blockIdx.y], end = g.expert_begin[blockIdx.y + 1];
  const bool tiles = mma::kDeviceHasMma && mma::tile_ok(e.down);
  for (int s0 = begin; s0 < end; s0 += mma::kTileSlots) {
    const float* hs[mma::kTileSlots];
    slot_inputs<mma::kTileSlots>(g.h, nullptr, g.inter, s0, end, hs);
    if (tiles) {
      float y[4];
      mma::int4_tile(e.down, r0, hs, lane, y);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        int row, slot;
        mma::acc_position(lane, i, row, slot);
        if (r0 + row < g.hidden && s0 + slot < end)
          g.y_slots[int64_t(s0 + slot) * g.hidden + r0 + row] = y[i];
      }
      continue;
    }
    for (int64_t r = r0; r < r0 + mma::kTileRows && r < g.hidden; ++r) {
      float acc[mma::kTileSlots];
      row_dot<mma::kTileSlots>(e.down, r, hs, lane, acc);
#pragma unroll
      for (int t = 0; t < mma::kTileSlots; ++t) {
        const float y = warp_sum(acc[t]);
        if (lane == 0 && s0 + t < end) g.y_slots[int64_t(s0 + t) * g.hidden + r] = y;
      }
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

// grid ceil(rows / 8): warp w of block b computes y[t, 8b + w] for every t < n, T at a time.
template <int T>
__global__ void __launch_bounds__(kThreadsPerBlock)
    matrix_linear_kernel(DeviceMatrix w, const float* x, int64_t n, float* y) {
  const int lane = int(threadIdx.x) % kWarpSize;
  const int64_t r = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  if (r >= w.rows) return;  // whole warps only
  for (int64_t t0 = 0; t0 < n; t0 += T) {
    const float* xs[T];
    slot_inputs<T>(x, nullptr, w.cols, int(t0), int(n), xs);
    float acc[T];
    row_dot<T>(w, r, xs, lane, acc);
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const float sum = warp_sum(acc[t]);
      if (lane == 0 && t0 + t < n) y[(t0 + t) * w.rows + r] = sum;
    }
  }
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
    case WeightFormat::kBF16:
      return "bf16";
    case WeightFormat::kNvfp4:
      return "nvfp4";
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
    case WeightFormat::kBF16:
      return rows * cols * 2;
    case WeightFormat::kNvfp4:
      return rows * (cols / 2);
  }
  return 0;
}

int64_t device_matrix_offset_count(WeightFormat format, int64_t rows, int64_t cols,
                                   int group_size) {
  const bool int4 = format == WeightFormat::kInt4Row || format == WeightFormat::kInt4Grouped;
  return int4 ? device_matrix_scale_count(format, rows, cols, group_size) : 0;
}

int64_t device_matrix_scale_count(WeightFormat format, int64_t rows, int64_t cols, int group_size) {
  switch (format) {
    case WeightFormat::kInt4Grouped:
      return group_size > 0 ? rows * ((cols + group_size - 1) / group_size) : 0;
    case WeightFormat::kInt4Row:
    case WeightFormat::kInt8Row:
      return rows;
    case WeightFormat::kF32:
    case WeightFormat::kBF16:
    case WeightFormat::kNvfp4:
      return 0;
  }
  return 0;
}

DeviceMatrix device_matrix(WeightFormat format, int group_size, int64_t rows, int64_t cols,
                           const void* data, const float* scales, const char* what,
                           const float* offsets) {
  const auto fail = [&](const std::string& why) {
    throw std::invalid_argument(std::string(what) + " (" + weight_format_name(format) + ", " +
                                std::to_string(rows) + "x" + std::to_string(cols) + "): " + why);
  };
  if (rows <= 0 || cols <= 0) fail("empty or negative shape");
  if (format == WeightFormat::kInt4Grouped && !kernels::is_valid_group_size(group_size))
    fail("group size " + std::to_string(group_size) + " is not one of the container's");
  if (format != WeightFormat::kInt4Grouped && group_size != 0) fail("per-row formats take group 0");
  if (!data) fail("null data");
  const bool dense = format == WeightFormat::kF32 || format == WeightFormat::kBF16;
  if (!dense && !scales) fail("null scales");
  if (format == WeightFormat::kNvfp4) fail("NVFP4 matrices are described by device_matrix_nvfp4");
  if (format < WeightFormat::kInt4Row || format > WeightFormat::kBF16) fail("unknown format");
  if (offsets && format != WeightFormat::kInt4Row && format != WeightFormat::kInt4Grouped)
    fail("zero-point offsets are for int4 only");
  DeviceMatrix m;
  m.format = format;
  m.group_size = group_size;
  m.rows = rows;
  m.cols = cols;
  m.data = data;
  m.scales = scales;
  m.offsets = offsets;
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
    case WeightFormat::kBF16:
      wide = wide && cols % 8 == 0;
      break;
    case WeightFormat::kNvfp4:
      break;
  }
  m.wide = wide ? 1 : 0;
  return m;
}

DeviceMatrix device_matrix_nvfp4(int64_t rows, int64_t cols, const uint8_t* codes,
                                 const uint8_t* e4m3_scales, float global, const char* what) {
  const auto fail = [&](const std::string& why) {
    throw std::invalid_argument(std::string(what) + " (nvfp4, " + std::to_string(rows) + "x" +
                                std::to_string(cols) + "): " + why);
  };
  if (rows <= 0 || cols <= 0 || cols % 16 != 0) fail("empty shape, or cols not a multiple of 16");
  if (!codes || !e4m3_scales) fail("null codes or scales");
  DeviceMatrix m;
  m.format = WeightFormat::kNvfp4;
  m.rows = rows;
  m.cols = cols;
  m.data = codes;
  m.e4m3_scales = e4m3_scales;
  m.global = global;
  m.wide = cols % 32 == 0 && aligned16(codes) ? 1 : 0;
  return m;
}

void expert_ffn_grouped_no_combine(const ExpertGroup& g, cudaStream_t stream) {
  check_group(g);
  if (g.n_experts == 0 || g.n_slots == 0) return;
  // The wide paths read input rows as float4 (their widths are then multiples of 4).
  if (!aligned16(g.x) || !aligned16(g.h))
    throw std::invalid_argument("expert_ffn_grouped: x and h must be 16-byte aligned");
  const int m = g.max_slots_per_expert;
  if (g.fp4_mma && m >= kNvfp4MmaMinRows && nvfp4_mma_selected())
    return nvfp4_mma_expert_projections(g, stream);  // COLIBRI_FP4_MMA=1 on a 12.x device
  if (m >= kMmaMinSlots && g.tensor_cores) {
    const dim3 gate_grid(unsigned((g.inter + kTileRowsPerBlock - 1) / kTileRowsPerBlock),
                         unsigned(g.n_experts));
    gate_up_mma_kernel<<<gate_grid, kThreadsPerBlock, 0, stream>>>(g);
    CHECK_CUDA_LAUNCH();
    const dim3 down_grid(unsigned((g.hidden + kTileRowsPerBlock - 1) / kTileRowsPerBlock),
                         unsigned(g.n_experts));
    down_mma_kernel<<<down_grid, kThreadsPerBlock, 0, stream>>>(g);
    CHECK_CUDA_LAUNCH();
  } else if (m <= 1)
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
  expert_ffn_combine(g, stream);
}

void expert_ffn_combine(const ExpertGroup& g, cudaStream_t stream) {
  check_group(g);
  if (g.n_rows == 0) return;
  const int64_t n = int64_t(g.n_rows) * g.hidden;
  constexpr int kCombineThreads = 256;
  combine_kernel<<<unsigned((n + kCombineThreads - 1) / kCombineThreads), kCombineThreads, 0,
                   stream>>>(g);
  CHECK_CUDA_LAUNCH();
}

void matrix_linear(const DeviceMatrix& w, const float* x, int64_t n, float* y,
                   cudaStream_t stream) {
  if (n <= 0 || w.rows <= 0) return;
  if (n > (int64_t(1) << 30)) throw std::invalid_argument("matrix_linear: too many rows of x");
  if (!aligned16(x)) throw std::invalid_argument("matrix_linear: x must be 16-byte aligned");
  if (n >= kNvfp4MmaMinRows && nvfp4_mma_fits(w) && nvfp4_mma_selected())
    return nvfp4_mma_linear(w, x, n, y, stream);  // COLIBRI_FP4_MMA=1 on a 12.x device
  const unsigned blocks = unsigned((w.rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  if (n == 1)
    matrix_linear_kernel<1><<<blocks, kThreadsPerBlock, 0, stream>>>(w, x, n, y);
  else if (n <= 4)
    matrix_linear_kernel<4><<<blocks, kThreadsPerBlock, 0, stream>>>(w, x, n, y);
  else
    matrix_linear_kernel<kMaxSlotsPerPass><<<blocks, kThreadsPerBlock, 0, stream>>>(w, x, n, y);
  CHECK_CUDA_LAUNCH();
}

}  // namespace colibri::cuda
