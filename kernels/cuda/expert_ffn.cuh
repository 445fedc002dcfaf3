// Grouped routed-expert FFN on a CUDA device: every (row, expert) pair of one request in three
// launches, whatever the number of experts:
//   1. gate/up: h[slot] = silu(gate · x[row]) * (up · x[row]) for every slot (a pair, grouped by
//      expert), both projections of one output row computed by the same warp;
//   2. down:    y[slot] = down · h[slot];
//   3. combine: out[row] = sum of weight * y[slot] over the row's slots in ascending expert order,
//      starting from 0, each step rounded as `out += weight * y` (no fused multiply-add), which
//      is the order and rounding of the CPU's run_expert_pairs.
// fp32 activations and fp32 accumulation. Weights stay in colibri's container layout
// (kernels/cpu/quant.h: int4 per row or per group, int8 per row, f32 scales; int4 optionally with
// zero points, fp32 offsets per (row, group), each adding offset * (the group's sum of the
// inputs) to the symmetric product as the CPU does: on gate and up before the activation, on down
// after), dense BF16 (the
// checkpoint's bits, widened in registers as kernels::linear_bf16 does), dense fp32, or NVFP4 as
// stored (kernels/cpu/linear.h, Nvfp4Weights: E2M1 codes two a byte, an E4M3 scale a 16 columns,
// the fp32 second-level scale; widened in registers, each 16 columns' sum of x * e2m1 scaled once
// by e4m3 * global).
// Each warp computes one output row for up to 8 slots at a time, dequantising 16-byte loads of
// the packed row in registers; the CPU oracle is kernels::quant_expert_ffn / mlp_forward
// (tests/gpu/expert_ffn_cuda_test.cpp). When an expert of the request has 8 or more slots and
// `tensor_cores` is set, the projections run on tensor cores instead (cuda/expert_ffn_mma.cuh:
// int4 tiles dequantised to BF16 in registers, activations split into BF16 hi + lo, mma.sync
// with fp32 accumulation, zero points added per 64 columns; other formats run the per-row path
// in the same launch).
// Includable from plain C++.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace colibri::cuda {

enum class WeightFormat : int32_t {
  kInt4Row = 0,
  kInt4Grouped = 1,
  kInt8Row = 2,
  kF32 = 3,
  kBF16 = 4,
  kNvfp4 = 5
};

const char* weight_format_name(WeightFormat format);

// W [rows, cols] in device memory. Build it with device_matrix(), which checks it.
struct DeviceMatrix {
  WeightFormat format = WeightFormat::kF32;
  int32_t group_size = 0;  // kInt4Grouped: one of kernels::is_valid_group_size; else 0
  int64_t rows = 0, cols = 0;
  const void* data = nullptr;  // int formats: [rows, row_bytes] packed; kF32: float, kBF16: uint16
                               // [rows, cols]
  const float* scales = nullptr;  // int formats: [rows] or [rows, ceil(cols / group_size)]
  int32_t wide = 0;               // set by device_matrix(): rows can be read in 16-byte loads
  // int4 zero points (an asymmetric checkpoint's, kernels/cpu/quant.h): fp32 offsets laid out as
  // the scales, [rows] or [rows, ceil(cols / group_size)], W = (q - 8) * s + offset; or null.
  const float* offsets = nullptr;
  // kNvfp4 (data: the codes [rows, cols / 2]): the E4M3 scale bytes [rows, cols / 16] and the
  // second-level scale.
  const uint8_t* e4m3_scales = nullptr;
  float global = 0.0f;
};

// Checks the description (format, group size, non-null pointers, shape; offsets for int4 only)
// and decides whether the 16-byte path applies (int4: cols % 32 == 0 and group_size % 32 == 0;
// int8: cols % 16 == 0; bf16: cols % 8 == 0; f32: cols % 4 == 0; data 16-byte aligned). Throws
// std::invalid_argument naming `what`.
DeviceMatrix device_matrix(WeightFormat format, int group_size, int64_t rows, int64_t cols,
                           const void* data, const float* scales, const char* what,
                           const float* offsets = nullptr);

// NVFP4 weights as stored (kernels::Nvfp4Weights, in device memory): cols a positive multiple of
// 16; the 16-byte path when cols % 32 == 0 and the codes are 16-byte aligned. Throws
// std::invalid_argument naming `what`. device_matrix() refuses kNvfp4 (its scales are bytes).
DeviceMatrix device_matrix_nvfp4(int64_t rows, int64_t cols, const uint8_t* codes,
                                 const uint8_t* e4m3_scales, float global, const char* what);

// Bytes of W's data and scales on the device (kNvfp4: the codes; its rows * cols / 16 scale
// bytes are not floats and are not counted by device_matrix_scale_count).
int64_t device_matrix_data_bytes(WeightFormat format, int64_t rows, int64_t cols);
int64_t device_matrix_scale_count(WeightFormat format, int64_t rows, int64_t cols, int group_size);
// The number of fp32 zero-point offsets W may carry: its scale count for int4, else 0.
int64_t device_matrix_offset_count(WeightFormat format, int64_t rows, int64_t cols, int group_size);

// An expert whose gate.data is null is skipped by the projections (its slots' y rows are filled
// by the caller, e.g. computed on the CPU); the combine still reads them.
struct DeviceExpert {
  DeviceMatrix gate, up;  // [inter, hidden]
  DeviceMatrix down;      // [hidden, inter]
};

// One request's pairs. A slot is one (row, expert) pair; slots are grouped by expert. Every
// pointer except `experts_host` is device memory and stays valid until the work is done.
struct ExpertGroup {
  int n_experts = 0, n_slots = 0, n_rows = 0;
  int max_slots_per_expert = 0;  // the largest expert_begin[i + 1] - expert_begin[i]
  int tensor_cores = 1;          // 0: CUDA cores only, whatever the batch
  int fp4_mma = 0;  // 1: every expert not skipped fits cuda/nvfp4_mma.cuh (nvfp4_mma_fits)
  int64_t hidden = 0, inter = 0;
  const DeviceExpert* experts = nullptr;  // [n_experts]
  const int32_t* expert_begin = nullptr;  // [n_experts + 1]: expert i's slots
  const int32_t* slot_row = nullptr;      // [n_slots]: the row of x each slot reads
  const int32_t* row_begin = nullptr;     // [n_rows + 1]: row r's entries in row_slots
  const int32_t* row_slots = nullptr;     // [n_slots]: slots of each row, ascending expert
  const float* row_weights = nullptr;     // [n_slots]: the routing weight of row_slots[i]
  const float* x = nullptr;               // [n_rows, hidden]
  float* h = nullptr;                     // [n_slots, inter] workspace
  float* y_slots = nullptr;               // [n_slots, hidden] workspace
  float* out = nullptr;                   // [n_rows, hidden]; rows without a slot get 0
};

// Enqueues the three launches on `stream`; asynchronous. Launch errors abort via CHECK_CUDA.
void expert_ffn_grouped(const ExpertGroup& group, cudaStream_t stream);

// The first two launches alone (benchmarks, or one phase of a request whose experts arrive in
// two groups): fills h and y_slots of the experts not skipped, not out.
void expert_ffn_grouped_no_combine(const ExpertGroup& group, cudaStream_t stream);

// The third launch alone: out from y_slots and the row index.
void expert_ffn_combine(const ExpertGroup& group, cudaStream_t stream);

// y[n, w.rows] = x[n, w.cols] · W^T for a matrix of any format above (the projections' per-row
// code: one warp a row, up to 8 rows of x a pass). x, y device memory, x 16-byte aligned; y must
// not overlap x. Asynchronous on `stream`.
void matrix_linear(const DeviceMatrix& w, const float* x, int64_t n, float* y, cudaStream_t stream);

}  // namespace colibri::cuda
