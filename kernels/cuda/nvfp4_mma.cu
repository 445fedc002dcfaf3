#include "cuda/nvfp4_mma.cuh"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include <unistd.h>

#include "cuda/check.h"
#include "cuda/nvfp4_mma_lanes.cuh"

// The block-scaled FP4 MMA is in code built for sm_120a/sm_121a (arch-specific) or sm_120f
// (the 12.x family, CUDA 12.9+); every other target of this file gets the probe's "no".
#if defined(__CUDA_ARCH_FEAT_SM120_ALL) || defined(__CUDA_ARCH_FEAT_SM121_ALL) || \
    (defined(__CUDA_ARCH_FAMILY_SPECIFIC__) && __CUDA_ARCH_FAMILY_SPECIFIC__ == 1200)
#define COLIBRI_FP4_MMA_CODE 1
#else
#define COLIBRI_FP4_MMA_CODE 0
#endif

namespace colibri::cuda {
namespace {

using fp4::Fp4Rows;
constexpr int kWarpsPerBlock = 4;   // each a 16-row tile of W
constexpr int kSubtiles = 4;        // 8-column tiles of x per warp and pass: 32 rows of x
constexpr int kQuantThreads = 256;  // one thread a 16-column block

__global__ void probe_kernel(int* has_mma) {
  *has_mma = COLIBRI_FP4_MMA_CODE;
}

__global__ void amax_kernel(const float* __restrict__ x, int64_t count,
                            uint32_t* __restrict__ amax_bits) {
  float m = 0.0f;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x)
    m = fmaxf(m, fabsf(x[i]));
  for (int offset = 16; offset > 0; offset /= 2)
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  // Non-negative floats order as their bits do.
  if (threadIdx.x % 32 == 0) atomicMax(amax_bits, __float_as_uint(m));
}

__global__ void quantize_kernel(const float* __restrict__ x, int64_t blocks, int64_t cols,
                                const uint32_t* __restrict__ amax_bits, uint8_t* __restrict__ codes,
                                uint8_t* __restrict__ scales, float* __restrict__ global_out) {
  const float global = fp4::global_scale(__uint_as_float(*amax_bits));
  const int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b == 0) *global_out = global;
  if (b >= blocks) return;
  // Block b: row b / (cols / 16), columns 16 (b % (cols / 16)) ..; rows are contiguous, so the
  // block's 16 inputs, 8 code bytes and scale lie at 16b, 8b and b.
  float in[fp4::kBlock];
  const float4* src = reinterpret_cast<const float4*>(x + b * fp4::kBlock);
  for (int q = 0; q < 4; ++q) {
    const float4 v = src[q];
    in[4 * q] = v.x;
    in[4 * q + 1] = v.y;
    in[4 * q + 2] = v.z;
    in[4 * q + 3] = v.w;
  }
  alignas(8) uint8_t out[8];
  scales[b] = uint8_t(fp4::quantize_block(in, global, out));
  uint2 packed;
  memcpy(&packed, out, 8);
  *reinterpret_cast<uint2*>(codes + b * 8) = packed;
  (void)cols;
}

#if COLIBRI_FP4_MMA_CODE
__device__ __forceinline__ void mma_fp4(float (&d)[4], const uint32_t (&a)[4],
                                        const uint32_t (&b)[2], uint32_t scale_a,
                                        uint32_t scale_b) {
  // Selectors {byte 0, thread 0}: each lane's register carries its rows' four scales
  // (cuda/nvfp4_mma_lanes.cuh).
  asm volatile(
      "mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X"
      ".f32.e2m1.e2m1.f32.ue4m3 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3}, "
      "%10, {0, 0}, %11, {0, 0};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(scale_a),
        "r"(scale_b));
}
#endif

// grid (ceil(w.rows / 64), ceil(n / 32)): warp w of block (bx, by) computes rows
// 64 bx + 16 w .. + 15 of W against rows 32 by .. + 31 of x, the A fragments of each chunk of 64
// columns loaded once for the four 8-row tiles of x. Operands straight from global memory
// (L1/L2): a first version, correct before fast.
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    mma_kernel(Fp4Rows w, Fp4Rows x, float w_global, const float* __restrict__ x_global,
               float* __restrict__ y) {
#if COLIBRI_FP4_MMA_CODE
  const int lane = int(threadIdx.x) % 32;
  const int64_t r0 = (int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32) * fp4::kTileRows;
  const int64_t n0 = int64_t(blockIdx.y) * kSubtiles * fp4::kTileCols;
  if (r0 >= w.rows) return;  // whole warps: the mma needs all 32 lanes
  float acc[kSubtiles][4] = {};
  for (int64_t k0 = 0; k0 < w.cols; k0 += fp4::kChunk) {
    uint32_t a[4], scale_a;
    fp4::load_a(w, r0, k0, lane, a, scale_a);
#pragma unroll
    for (int s = 0; s < kSubtiles; ++s) {
      if (n0 + s * fp4::kTileCols >= x.rows) break;  // uniform across the warp
      uint32_t b[2], scale_b;
      fp4::load_b(x, n0 + s * fp4::kTileCols, k0, lane, b, scale_b);
      mma_fp4(acc[s], a, b, scale_a, scale_b);
    }
  }
  const float alpha = w_global * *x_global;
#pragma unroll
  for (int s = 0; s < kSubtiles; ++s)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t r = r0 + fp4::acc_row(lane, i);
      const int64_t t = n0 + s * fp4::kTileCols + fp4::acc_col(lane, i);
      if (r < w.rows && t < x.rows) y[t * w.rows + r] = acc[s][i] * alpha;
    }
#else
  // Never launched: the host checks nvfp4_mma_supported() first.
  (void)w, (void)x, (void)w_global, (void)x_global, (void)y;
  __trap();
#endif
}

// Codes, scales and global of x [n, cols] from the amax already in *amax_bits.
void launch_quantize(const float* x, int64_t n, int64_t cols, uint8_t* codes, uint8_t* scales,
                     float* global, const uint32_t* amax_bits, cudaStream_t stream) {
  const int64_t blocks = n * cols / fp4::kBlock;
  const int64_t grid = std::max<int64_t>((blocks + kQuantThreads - 1) / kQuantThreads, 1);
  quantize_kernel<<<unsigned(grid), kQuantThreads, 0, stream>>>(x, blocks, cols, amax_bits, codes,
                                                                scales, global);
  CHECK_CUDA_LAUNCH();
}

__host__ __device__ Fp4Rows rows_of(const DeviceMatrix& m) {
  return {static_cast<const uint8_t*>(m.data), m.e4m3_scales, m.rows, m.cols};
}

// grid (ceil(inter / 64), n_experts, ceil(max_slots_per_expert / 32)): warp w of block (bx, e, z)
// computes gate and up rows 64 bx + 16 w .. + 15 of expert e against its slots
// begin + 32 z .. + 31, each slot's row of the quantized x; writes h and raises *h_amax_bits.
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    gate_up_kernel(ExpertGroup g, Fp4Rows xq, const float* __restrict__ x_global,
                   uint32_t* __restrict__ h_amax_bits) {
#if COLIBRI_FP4_MMA_CODE
  const int lane = int(threadIdx.x) % 32;
  const DeviceExpert& e = g.experts[blockIdx.y];
  if (e.gate.data == nullptr) return;  // skipped: computed elsewhere or in another phase
  const int begin = g.expert_begin[blockIdx.y], end = g.expert_begin[blockIdx.y + 1];
  const int s0 = begin + int(blockIdx.z) * kSubtiles * fp4::kTileCols;
  const int64_t r0 = (int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32) * fp4::kTileRows;
  if (s0 >= end || r0 >= g.inter) return;  // whole warps
  const Fp4Rows gate = rows_of(e.gate), up = rows_of(e.up);
  const int tiles = min(kSubtiles, (end - s0 + fp4::kTileCols - 1) / fp4::kTileCols);
  int64_t x_row[kSubtiles];  // this lane's B column in each tile: a slot's row, or none
#pragma unroll
  for (int s = 0; s < kSubtiles; ++s) {
    const int slot = s0 + s * fp4::kTileCols + lane / 4;
    x_row[s] = slot >= end ? xq.rows : g.slot_row ? g.slot_row[slot] : slot;
  }
  float acc_gate[kSubtiles][4] = {}, acc_up[kSubtiles][4] = {};
  for (int64_t k0 = 0; k0 < g.hidden; k0 += fp4::kChunk) {
    uint32_t a_gate[4], a_up[4], scale_gate, scale_up;
    fp4::load_a(gate, r0, k0, lane, a_gate, scale_gate);
    fp4::load_a(up, r0, k0, lane, a_up, scale_up);
#pragma unroll
    for (int s = 0; s < kSubtiles; ++s) {
      if (s >= tiles) break;  // uniform across the warp
      uint32_t b[2], scale_b;
      fp4::load_b_row(xq, x_row[s], k0, lane, b, scale_b);
      mma_fp4(acc_gate[s], a_gate, b, scale_gate, scale_b);
      mma_fp4(acc_up[s], a_up, b, scale_up, scale_b);
    }
  }
  const float alpha_gate = e.gate.global * *x_global, alpha_up = e.up.global * *x_global;
  float amax = 0.0f;
#pragma unroll
  for (int s = 0; s < kSubtiles; ++s)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t r = r0 + fp4::acc_row(lane, i);
      const int slot = s0 + s * fp4::kTileCols + fp4::acc_col(lane, i);
      if (r >= g.inter || slot >= end) continue;
      const float gv = acc_gate[s][i] * alpha_gate, uv = acc_up[s][i] * alpha_up;
      const float h = gv / (1.0f + expf(-gv)) * uv;
      g.h[int64_t(slot) * g.inter + r] = h;
      amax = fmaxf(amax, fabsf(h));
    }
  for (int offset = 16; offset > 0; offset /= 2)
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  if (lane == 0) atomicMax(h_amax_bits, __float_as_uint(amax));
#else
  (void)g, (void)xq, (void)x_global, (void)h_amax_bits;
  __trap();
#endif
}

// grid (ceil(hidden / 64), n_experts, ceil(max_slots_per_expert / 32)): y_slots[slot, r] =
// down[r, :] . h[slot, :] from the quantized h (row = slot).
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    down_kernel(ExpertGroup g, Fp4Rows hq, const float* __restrict__ h_global) {
#if COLIBRI_FP4_MMA_CODE
  const int lane = int(threadIdx.x) % 32;
  const DeviceExpert& e = g.experts[blockIdx.y];
  if (e.gate.data == nullptr) return;
  const int begin = g.expert_begin[blockIdx.y], end = g.expert_begin[blockIdx.y + 1];
  const int s0 = begin + int(blockIdx.z) * kSubtiles * fp4::kTileCols;
  const int64_t r0 = (int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32) * fp4::kTileRows;
  if (s0 >= end || r0 >= g.hidden) return;
  const Fp4Rows down = rows_of(e.down);
  const int tiles = min(kSubtiles, (end - s0 + fp4::kTileCols - 1) / fp4::kTileCols);
  float acc[kSubtiles][4] = {};
  for (int64_t k0 = 0; k0 < g.inter; k0 += fp4::kChunk) {
    uint32_t a[4], scale_a;
    fp4::load_a(down, r0, k0, lane, a, scale_a);
#pragma unroll
    for (int s = 0; s < kSubtiles; ++s) {
      if (s >= tiles) break;
      const int slot = s0 + s * fp4::kTileCols + lane / 4;
      uint32_t b[2], scale_b;
      fp4::load_b_row(hq, slot < end ? slot : hq.rows, k0, lane, b, scale_b);
      mma_fp4(acc[s], a, b, scale_a, scale_b);
    }
  }
  const float alpha = e.down.global * *h_global;
#pragma unroll
  for (int s = 0; s < kSubtiles; ++s)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t r = r0 + fp4::acc_row(lane, i);
      const int slot = s0 + s * fp4::kTileCols + fp4::acc_col(lane, i);
      if (r < g.hidden && slot < end) g.y_slots[int64_t(slot) * g.hidden + r] = acc[s][i] * alpha;
    }
#else
  (void)g, (void)hq, (void)h_global;
  __trap();
#endif
}

bool aligned4(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 4 == 0;
}

int current_device() {
  int device = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  return device;
}

}  // namespace

bool nvfp4_mma_supported(int device) {
  static std::mutex mutex;
  static std::vector<int> known;  // per device: -1 unknown, 0 no, 1 yes
  std::lock_guard<std::mutex> lock(mutex);
  if (device < 0) return false;
  if (int(known.size()) <= device) known.resize(size_t(device) + 1, -1);
  if (known[size_t(device)] >= 0) return known[size_t(device)] == 1;
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  int has_mma = 0;
  if (prop.major == 12) {
    int previous = 0;
    CHECK_CUDA(cudaGetDevice(&previous));
    CHECK_CUDA(cudaSetDevice(device));
    int* flag = nullptr;
    CHECK_CUDA(cudaMalloc(&flag, sizeof(int)));
    probe_kernel<<<1, 1>>>(flag);
    // No code for this device in the fatbinary is an answer ("no"), not an error.
    const cudaError_t launched = cudaGetLastError();
    if (launched == cudaSuccess) {
      CHECK_CUDA(cudaMemcpy(&has_mma, flag, sizeof(int), cudaMemcpyDeviceToHost));
    } else if (launched != cudaErrorNoKernelImageForDevice) {
      CHECK_CUDA(launched);
    }
    CHECK_CUDA(cudaFree(flag));
    CHECK_CUDA(cudaSetDevice(previous));
  }
  known[size_t(device)] = has_mma ? 1 : 0;
  return has_mma == 1;
}

bool nvfp4_mma_selected() {
  static const bool on = [] {
    const char* value = std::getenv("COLIBRI_FP4_MMA");
    return value != nullptr && std::strcmp(value, "1") == 0;
  }();
  if (!on) return false;
  const int device = current_device();
  if (nvfp4_mma_supported(device)) return true;
  static std::once_flag logged;
  std::call_once(logged, [device] {
    cudaDeviceProp prop{};
    CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
    char host[256] = "?";
    gethostname(host, sizeof(host) - 1);
    std::fprintf(stderr,
                 "[pid %d@%s] COLIBRI_FP4_MMA=1: device %d (%s, compute capability %d.%d) %s; "
                 "NVFP4 products keep the FP4-widening kernels\n",
                 int(getpid()), host, device, prop.name, prop.major, prop.minor,
                 prop.major == 12 ? "does not run this binary's sm_120a/sm_120f code"
                                  : "has no block-scaled FP4 MMA (compute capability 12.x only)");
  });
  return false;
}

void quantize_nvfp4_device(const float* x, int64_t n, int64_t cols, uint8_t* codes, uint8_t* scales,
                           float* global, uint32_t* amax_bits, cudaStream_t stream) {
  if (cols <= 0 || cols % fp4::kBlock != 0)
    throw std::invalid_argument("quantize_nvfp4_device: cols " + std::to_string(cols) +
                                " is not a positive multiple of 16");
  if (n < 0) throw std::invalid_argument("quantize_nvfp4_device: negative row count");
  if (reinterpret_cast<uintptr_t>(x) % 16 != 0 || reinterpret_cast<uintptr_t>(codes) % 8 != 0)
    throw std::invalid_argument(
        "quantize_nvfp4_device: x must be 16-byte and codes 8-byte aligned");
  CHECK_CUDA(cudaMemsetAsync(amax_bits, 0, sizeof(uint32_t), stream));
  const int64_t count = n * cols;
  if (count > 0) {
    const int64_t grid = std::min<int64_t>((count + 1023) / 1024, 1024);
    amax_kernel<<<unsigned(grid), 256, 0, stream>>>(x, count, amax_bits);
    CHECK_CUDA_LAUNCH();
  }
  launch_quantize(x, n, cols, codes, scales, global, amax_bits, stream);
}

bool nvfp4_mma_fits(const DeviceMatrix& w) {
  return w.format == WeightFormat::kNvfp4 && w.cols % fp4::kBlock == 0 && aligned4(w.data) &&
         w.e4m3_scales != nullptr;
}

namespace {

void require_mma(const DeviceMatrix& w, const char* what) {
  if (!nvfp4_mma_fits(w))
    throw std::invalid_argument(std::string(what) + ": W is not NVFP4 with 4-byte aligned codes");
  if (!nvfp4_mma_supported(current_device()))
    throw std::runtime_error(std::string(what) +
                             ": the current device does not run the block-scaled FP4 MMA "
                             "(compute capability 12.x with this binary's sm_120a/sm_120f code)");
}

}  // namespace

void nvfp4_mma_product(const DeviceMatrix& w, const uint8_t* x_codes, const uint8_t* x_scales,
                       const float* x_global, int64_t n, float* y, cudaStream_t stream) {
  require_mma(w, "nvfp4_mma_product");
  if (!aligned4(x_codes))
    throw std::invalid_argument("nvfp4_mma_product: x codes must be 4-byte aligned");
  if (n <= 0 || w.rows <= 0) return;
  const Fp4Rows wr = rows_of(w);
  const Fp4Rows xr{x_codes, x_scales, n, w.cols};
  const int64_t rows_per_block = int64_t(kWarpsPerBlock) * fp4::kTileRows;
  const int64_t cols_per_block = int64_t(kSubtiles) * fp4::kTileCols;
  const dim3 grid(unsigned((w.rows + rows_per_block - 1) / rows_per_block),
                  unsigned((n + cols_per_block - 1) / cols_per_block));
  if (grid.y > 65535u) throw std::invalid_argument("nvfp4_mma_product: too many rows of x");
  mma_kernel<<<grid, kWarpsPerBlock * 32, 0, stream>>>(wr, xr, w.global, x_global, y);
  CHECK_CUDA_LAUNCH();
}

void nvfp4_mma_linear(const DeviceMatrix& w, const float* x, int64_t n, float* y,
                      cudaStream_t stream) {
  require_mma(w, "nvfp4_mma_linear");
  if (n <= 0 || w.rows <= 0) return;
  const int64_t code_bytes = n * w.cols / 2, scale_bytes = n * w.cols / fp4::kBlock;
  // One stream-ordered allocation: codes, scales, then the global scale and the amax (aligned).
  const int64_t scales_at = code_bytes, tail_at = (code_bytes + scale_bytes + 15) / 16 * 16;
  uint8_t* scratch = nullptr;
  CHECK_CUDA(cudaMallocAsync(reinterpret_cast<void**>(&scratch), size_t(tail_at + 16), stream));
  float* x_global = reinterpret_cast<float*>(scratch + tail_at);
  uint32_t* amax_bits = reinterpret_cast<uint32_t*>(scratch + tail_at + 4);
  quantize_nvfp4_device(x, n, w.cols, scratch, scratch + scales_at, x_global, amax_bits, stream);
  nvfp4_mma_product(w, scratch, scratch + scales_at, x_global, n, y, stream);
  CHECK_CUDA(cudaFreeAsync(scratch, stream));
}

}  // namespace colibri::cuda

namespace colibri::cuda {

bool nvfp4_mma_fits(const DeviceExpert* experts, int64_t count) {
  int64_t taken = 0;
  for (int64_t i = 0; i < count; ++i) {
    const DeviceExpert& e = experts[i];
    if (e.gate.data == nullptr) continue;
    if (!nvfp4_mma_fits(e.gate) || !nvfp4_mma_fits(e.up) || !nvfp4_mma_fits(e.down)) return false;
    ++taken;
  }
  return taken > 0;
}

void nvfp4_mma_expert_projections(const ExpertGroup& g, cudaStream_t stream) {
  if (!nvfp4_mma_supported(current_device()))
    throw std::runtime_error(
        "nvfp4_mma_expert_projections: the current device does not run the block-scaled FP4 MMA "
        "(compute capability 12.x with this binary's sm_120a/sm_120f code)");
  if (g.n_experts == 0 || g.n_slots == 0) return;
  if (g.hidden % fp4::kBlock != 0 || g.inter % fp4::kBlock != 0)
    throw std::invalid_argument(
        "nvfp4_mma_expert_projections: hidden and inter must be multiples of 16");
  const auto up16 = [](int64_t bytes) { return (bytes + 15) / 16 * 16; };
  const int64_t x_cols = g.hidden, h_cols = g.inter;
  const int64_t x_codes = 0, x_scales = x_codes + up16(int64_t(g.n_rows) * x_cols / 2);
  const int64_t h_codes = x_scales + up16(int64_t(g.n_rows) * x_cols / fp4::kBlock);
  const int64_t h_scales = h_codes + up16(int64_t(g.n_slots) * h_cols / 2);
  // Then four 4-byte words: x's global and amax, h's global and amax.
  const int64_t tail = h_scales + up16(int64_t(g.n_slots) * h_cols / fp4::kBlock);
  uint8_t* scratch = nullptr;
  CHECK_CUDA(cudaMallocAsync(reinterpret_cast<void**>(&scratch), size_t(tail + 16), stream));
  float* x_global = reinterpret_cast<float*>(scratch + tail);
  uint32_t* x_amax = reinterpret_cast<uint32_t*>(scratch + tail + 4);
  float* h_global = reinterpret_cast<float*>(scratch + tail + 8);
  uint32_t* h_amax = reinterpret_cast<uint32_t*>(scratch + tail + 12);

  quantize_nvfp4_device(g.x, g.n_rows, x_cols, scratch + x_codes, scratch + x_scales, x_global,
                        x_amax, stream);
  CHECK_CUDA(cudaMemsetAsync(h_amax, 0, sizeof(uint32_t), stream));
  const unsigned slot_tiles = unsigned((g.max_slots_per_expert + kSubtiles * fp4::kTileCols - 1) /
                                       (kSubtiles * fp4::kTileCols));
  const int64_t rows_per_block = int64_t(kWarpsPerBlock) * fp4::kTileRows;
  const Fp4Rows xq{scratch + x_codes, scratch + x_scales, g.n_rows, x_cols};
  const dim3 gate_grid(unsigned((g.inter + rows_per_block - 1) / rows_per_block),
                       unsigned(g.n_experts), slot_tiles);
  gate_up_kernel<<<gate_grid, kWarpsPerBlock * 32, 0, stream>>>(g, xq, x_global, h_amax);
  CHECK_CUDA_LAUNCH();
  launch_quantize(g.h, g.n_slots, h_cols, scratch + h_codes, scratch + h_scales, h_global, h_amax,
                  stream);
  const Fp4Rows hq{scratch + h_codes, scratch + h_scales, g.n_slots, h_cols};
  const dim3 down_grid(unsigned((g.hidden + rows_per_block - 1) / rows_per_block),
                       unsigned(g.n_experts), slot_tiles);
  down_kernel<<<down_grid, kWarpsPerBlock * 32, 0, stream>>>(g, hq, h_global);
  CHECK_CUDA_LAUNCH();
  CHECK_CUDA(cudaFreeAsync(scratch, stream));
}

}  // namespace colibri::cuda
