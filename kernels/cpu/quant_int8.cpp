// int8-activation kernels (quant.h): quantization of the activations, the scalar reference,
// selection and the OpenMP drivers. The per-ISA row kernels are in quant_int8_avx2.cpp and
// quant_int8_avx512.cpp.
#include <omp.h>

#if defined(__linux__) && (defined(__x86_64__) || defined(_M_X64))
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/quant.h"
#include "cpu/quant_detail.h"
#include "cpu/quant_int8_detail.h"

namespace colibri::kernels {

using detail::Int8Layout;
using detail::Int8Rows;
using detail::kInt8Block;
using detail::kInt8TileRows;

namespace {

Int8Layout layout_for(const QuantMatrixView& w) {
  return w.format == QuantFormat::kInt8Row ? Int8Layout::kForInt8 : Int8Layout::kForInt4;
}

// Growable buffers for one set of quantized rows.
struct Int8Buffers {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> sum;

  // Sizes the buffers for n rows and returns the view (filled by quantize_block).
  Int8Rows prepare(Int8Layout layout, int64_t n, int64_t cols) {
    const int64_t blocks = (cols + kInt8Block - 1) / kInt8Block;
    if (int64_t(q.size()) < n * blocks * kInt8Block) q.resize(size_t(n * blocks * kInt8Block));
    if (int64_t(scale.size()) < n * blocks) scale.resize(size_t(n * blocks));
    if (int64_t(sum.size()) < n * blocks) sum.resize(size_t(n * blocks));
    return {layout, n, cols, blocks, q.data(), scale.data(), sum.data()};
  }
};

// Quantizes block k of one row x [cols] into q[j], j < 64 (0 past cols); returns the scale.
float quantize_values(const float* x, int64_t cols, int64_t k, int q[kInt8Block]) {
  const int64_t i0 = k * kInt8Block, i1 = std::min(cols, i0 + kInt8Block);
  float amax = 0.0f;
  bool nan = false;
  for (int64_t i = i0; i < i1; ++i) {
    amax = std::max(amax, std::fabs(x[i]));
    nan |= std::isnan(x[i]);
  }
  std::fill(q, q + kInt8Block, 0);
  if (nan || !std::isfinite(amax)) return std::numeric_limits<float>::quiet_NaN();
  const float inv = 127.0f / amax;
  if (!(inv <= std::numeric_limits<float>::max())) return 0.0f;  // zero, or below ~3.7e-37
  for (int64_t i = i0; i < i1; ++i)
    q[i - i0] = int(std::clamp(std::rint(x[i] * inv), -127.0f, 127.0f));
  return amax / 127.0f;
}

// Quantizes block k of row t of x [n, cols] into rows (whose buffers are writable).
void quantize_block(detail::QuantizeBlockFn quantize, const float* x, const Int8Rows& rows,
                    int64_t t, int64_t k) {
  // Each input's byte within the block, by layout (int8_position), worked out once.
  static const auto positions = [] {
    std::array<std::array<uint8_t, kInt8Block>, 2> p{};
    for (int64_t j = 0; j < kInt8Block; ++j) {
      p[0][size_t(j)] = uint8_t(detail::int8_position(Int8Layout::kForInt4, j));
      p[1][size_t(j)] = uint8_t(detail::int8_position(Int8Layout::kForInt8, j));
    }
    return p;
  }();
  const uint8_t* position = positions[rows.layout == Int8Layout::kForInt4 ? 0 : 1].data();
  const int64_t at = t * rows.blocks + k;
  int qb[kInt8Block];
  const_cast<float*>(rows.scale)[at] = quantize(x + t * rows.cols, rows.cols, k, qb);
  int8_t* q = const_cast<int8_t*>(rows.q) + at * kInt8Block;
  int32_t sum = 0;
  for (int64_t j = 0; j < kInt8Block; ++j) {
    q[position[j]] = int8_t(qb[j]);
    sum += qb[j];
  }
  const_cast<int32_t*>(rows.sum)[at] = sum;
}

Int8Rows quantize_rows(detail::QuantizeBlockFn quantize, const float* x, int64_t n, int64_t cols,
                       Int8Layout layout, Int8Buffers& buffers) {
  const Int8Rows rows = buffers.prepare(layout, n, cols);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t k = 0; k < rows.blocks; ++k) quantize_block(quantize, x, rows, t, k);
  return rows;
}

int weight_value(const QuantMatrixView& w, const uint8_t* row, int64_t i) {
  if (w.format == QuantFormat::kInt8Row) return int(int8_t(row[i]));
  return int((i & 1) ? row[i >> 1] >> 4 : row[i >> 1] & 15) - 8;
}

// The reference: the operations of quant_int8_detail.h, one output at a time.
void int8_rows_scalar(const QuantMatrixView& w, const Int8Rows& x, float* y, int64_t y_stride,
                      int64_t row_begin, int64_t row_end) {
  const int64_t rb = row_bytes(w.format, w.cols);
  const bool grouped = w.format == QuantFormat::kInt4Grouped;
  const int64_t ng = grouped ? (w.cols + w.group_size - 1) / w.group_size : 1;
  for (int64_t o = row_begin; o < row_end; ++o) {
    const uint8_t* row = w.data + o * rb;
    for (int64_t t = 0; t < x.n; ++t) {
      float acc = 0.0f;
      for (int64_t k = 0; k < x.blocks; ++k) {
        const int64_t i0 = k * kInt8Block, i1 = std::min(w.cols, i0 + kInt8Block);
        const int8_t* q = x.q + (t * x.blocks + k) * kInt8Block;
        int32_t dot = 0;
        for (int64_t i = i0; i < i1; ++i)
          dot += weight_value(w, row, i) * q[detail::int8_position(x.layout, i - i0)];
        const float s_w = grouped ? w.scales[o * ng + i0 / w.group_size] : 1.0f;
        acc = std::fma(float(dot), s_w * x.scale[t * x.blocks + k], acc);
      }
      y[t * y_stride + o] = grouped ? acc : acc * w.scales[o];
    }
  }
}

bool cpu_has_vnni() {
#if COLIBRI_QUANT_X86
  return __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

bool cpu_has_avx_vnni() {
#if COLIBRI_QUANT_X86
  return __builtin_cpu_supports("avxvnni");
#else
  return false;
#endif
}

std::atomic<bool> g_vnni_allowed{detail::allowed_by_env("COLIBRI_VNNI")};
std::atomic<bool> g_amx_allowed{detail::allowed_by_env("COLIBRI_AMX")};

// CPUID leaf 7: AMX-TILE (EDX bit 24) and AMX-INT8 (bit 25); the OS enables the tile state in
// XCR0 (bits 17, 18); then Linux grants it to this process on request (XFEATURE_XTILEDATA = 18).
bool amx_usable() {
#if COLIBRI_QUANT_X86 && defined(__linux__)
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25)))
    return false;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE
  unsigned xcr0_lo, xcr0_hi;
  __asm__("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  if ((xcr0_lo & (3u << 17)) != (3u << 17)) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

detail::QuantizeBlockFn quantize_kernel(QuantIsa isa) {
#if COLIBRI_QUANT_X86
  if (isa == QuantIsa::kAvx512) return detail::quantize_block_avx512;
  if (isa == QuantIsa::kAvx2) return detail::quantize_block_avx2;
#endif
  return quantize_values;
}

// The int8 kernel for matrices in `layout` on `isa`: on AVX-512 VNNI the 16-row kernel for kRows
// and the tile kernel (two tiles a zmm) for kTiles, which reads them as they are; with AVX-VNNI
// (and no AVX-512 VNNI) the 8-row kernel with vpdpbusd on ymm; else with pmaddubsw.
detail::Int8RowsKernel int8_kernel(QuantIsa isa, QuantLayout layout) {
#if COLIBRI_QUANT_X86
  const bool vnni = vnni_enabled();
  if (isa == QuantIsa::kAvx512 && vnni && cpu_has_vnni())
    return layout == QuantLayout::kTiles ? detail::int8_tiles_vnni : detail::int8_rows_avx512vnni;
  if (isa == QuantIsa::kAvx512 || isa == QuantIsa::kAvx2)
    return vnni && cpu_has_avx_vnni() ? detail::int8_rows_avxvnni : detail::int8_rows_avx2;
#endif
  return int8_rows_scalar;
}

// Whether kernel reads kTiles matrices as they are.
bool reads_tiles(detail::Int8RowsKernel kernel) {
#if COLIBRI_QUANT_X86
  return kernel == detail::int8_rows_avx2 || kernel == detail::int8_rows_avxvnni ||
         kernel == detail::int8_tiles_vnni;
#else
  return false;
#endif
}

// The kernel for w on isa on rows [row_begin, row_end) of w: AMX for many rows where enabled;
// else a kTiles matrix that kernel does not read natively one tile at a time through
// tile_as_rows.
void run_int8(QuantIsa isa, const QuantMatrixView& w, const Int8Rows& x, float* y, int64_t y_stride,
              int64_t row_begin, int64_t row_end) {
#if COLIBRI_QUANT_X86
  if (int8_activations_amx(isa, x.n))
    return detail::int8_rows_amx(w, x, y, y_stride, row_begin, row_end);
#endif
  const detail::Int8RowsKernel kernel = int8_kernel(isa, w.layout);
  if (w.layout == QuantLayout::kRows || reads_tiles(kernel))
    return kernel(w, x, y, y_stride, row_begin, row_end);
  for (int64_t o0 = row_begin; o0 < std::min(row_end, w.rows); o0 += kTileRows)
    kernel(detail::tile_as_rows(w, o0), x, y + o0, y_stride, 0, kTileRows);
}

void require(QuantIsa isa, const QuantMatrixView& w) {
  check_view(w);
  if (!quant_isa_available(isa))
    throw std::invalid_argument(std::string("quant kernels: ISA ") + quant_isa_name(isa) +
                                " is not available on this CPU or in this build");
  if (!int8_activations_supported(w))
    throw std::invalid_argument("int8 activations: group size " + std::to_string(w.group_size) +
                                " is not a multiple of 64");
}

// Per calling thread, grown on demand: no allocation once warm.
struct Scratch {
  Int8Buffers x_gate, x_up, hidden;
  std::vector<float> gate, up, h;
};
thread_local Scratch scratch;

float* grown(std::vector<float>& v, int64_t count) {
  if (int64_t(v.size()) < count) v.resize(size_t(count));
  return v.data();
}

std::atomic<int> g_activations{-1};

}  // namespace

int64_t detail::int8_position(Int8Layout layout, int64_t j) {
  if (layout == Int8Layout::kForInt4) return j / 8 * 8 + (j % 2) * 4 + (j % 8) / 2;
  return j;
}

// ---- selection -------------------------------------------------------------------------------

const char* quant_activations_name(QuantActivations a) {
  switch (a) {
    case QuantActivations::kF32:
      return "f32";
    case QuantActivations::kInt8:
      return "int8";
    case QuantActivations::kMixed:
      return "mixed";
  }
  return "?";
}

QuantActivations quant_activations_resolve(const char* name) {
  if (name == nullptr || *name == '\0' || std::strcmp(name, "int8") == 0)
    return QuantActivations::kInt8;
  if (std::strcmp(name, "f32") == 0) return QuantActivations::kF32;
  if (std::strcmp(name, "mixed") == 0) return QuantActivations::kMixed;
  throw std::invalid_argument(std::string("activations '") + name +
                              "': expected f32, int8 or mixed");
}

QuantActivations quant_activations_selected() {
  int a = g_activations.load(std::memory_order_relaxed);
  if (a < 0) {
    a = int(quant_activations_resolve(std::getenv("COLIBRI_ACTIVATIONS")));
    g_activations.store(a, std::memory_order_relaxed);
  }
  return QuantActivations(a);
}

void set_quant_activations(QuantActivations a) {
  g_activations.store(int(a), std::memory_order_relaxed);
}

bool int8_activations_supported(const QuantMatrixView& w) {
  return w.format != QuantFormat::kInt4Grouped || w.group_size % kInt8Block == 0;
}

bool int8_activations_for(const QuantMatrixView& w) {
  switch (quant_activations_selected()) {
    case QuantActivations::kF32:
      return false;
    case QuantActivations::kInt8:
      return int8_activations_supported(w);
    case QuantActivations::kMixed:
      return w.format != QuantFormat::kInt8Row && int8_activations_supported(w);
  }
  return false;
}

bool tiles_preferred(const QuantMatrixView& w) {
#if COLIBRI_QUANT_X86
  static const bool allowed = detail::allowed_by_env("COLIBRI_TILES");
  return allowed && tiles_supported(w.format, w.rows, w.cols, w.group_size) &&
         int8_activations_for(w) &&
         reads_tiles(int8_kernel(quant_isa_selected(), QuantLayout::kTiles));
#else
  return false;
#endif
}

bool vnni_available() {
  // The CPU's features do not change: looked up once, not at every kernel call (int8_kernel).
  static const bool available = (quant_isa_available(QuantIsa::kAvx512) && cpu_has_vnni()) ||
                                (quant_isa_available(QuantIsa::kAvx2) && cpu_has_avx_vnni());
  return available;
}

bool vnni_enabled() {
  return g_vnni_allowed.load(std::memory_order_relaxed) && vnni_available();
}

void set_vnni(bool allowed) {
  g_vnni_allowed.store(allowed, std::memory_order_relaxed);
}

bool int8_activations_vnni(QuantIsa isa) {
  if (!quant_isa_available(isa)) return false;
  const detail::Int8RowsKernel kernel = int8_kernel(isa, QuantLayout::kRows);
#if COLIBRI_QUANT_X86
  return kernel == detail::int8_rows_avx512vnni || kernel == detail::int8_rows_avxvnni;
#else
  (void)kernel;
  return false;
#endif
}

bool amx_available() {
  static const bool available = quant_isa_available(QuantIsa::kAvx512) && amx_usable();
  return available;
}

bool amx_enabled() {
  return g_amx_allowed.load(std::memory_order_relaxed) && amx_available();
}

void set_amx(bool allowed) {
  g_amx_allowed.store(allowed, std::memory_order_relaxed);
}

bool int8_activations_amx(QuantIsa isa, int64_t n) {
  return isa == QuantIsa::kAvx512 && n >= kAmxMinRows && amx_enabled();
}

double amx_int8_peak_ops(double seconds) {
#if COLIBRI_QUANT_X86
  if (!amx_available()) return 0.0;
  constexpr double kOpsPerIteration = 4.0 * 16 * 16 * 64 * 2;
  int64_t iterations = 1 << 12;
  for (;;) {
    const auto start = std::chrono::steady_clock::now();
    if (detail::amx_int8_peak_probe(iterations) != iterations)
      throw std::logic_error("AMX peak probe: wrong tile sum");
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (s >= 0.9 * seconds || iterations > (int64_t(1) << 40))
      return kOpsPerIteration * iterations / s;
    iterations =
        int64_t(double(iterations) * std::clamp(1.1 * seconds / std::max(s, 1e-6), 1.1, 10.0));
  }
#else
  (void)seconds;
  return 0.0;
#endif
}

void quantize_activations_int8(const float* x, int64_t cols, int8_t* q, float* scales) {
  const int64_t blocks = (cols + kInt8Block - 1) / kInt8Block;
  for (int64_t k = 0; k < blocks; ++k) {
    int qb[kInt8Block];
    scales[k] = quantize_values(x, cols, k, qb);
    for (int64_t i = k * kInt8Block; i < std::min(cols, (k + 1) * kInt8Block); ++i)
      q[i] = int8_t(qb[i - k * kInt8Block]);
  }
}

// ---- kernels ---------------------------------------------------------------------------------

void quant_linear_int8(QuantIsa isa, const QuantMatrixView& w, const float* x, int64_t n,
                       float* y) {
  require(isa, w);
  if (n <= 0 || w.rows == 0) return;
  if (w.cols == 0) {
    std::fill(y, y + n * w.rows, 0.0f);
    return;
  }
  const Int8Rows xq =
      quantize_rows(quantize_kernel(isa), x, n, w.cols, layout_for(w), scratch.x_gate);
#pragma omp parallel if (w.rows * w.cols * n >= detail::kParallelMinMacs)
  {
    int64_t begin, end;
    detail::static_range(w.rows, omp_get_num_threads(), omp_get_thread_num(), begin, end,
                         kInt8TileRows);
    run_int8(isa, w, xq, y, w.rows, begin, end);
  }
  add_zero_point_terms(w, x, n, y);  // from the fp32 x
}

void quant_expert_ffn_int8(QuantIsa isa, const QuantMatrixView& gate, const QuantMatrixView& up,
                           const QuantMatrixView& down, const float* x, int64_t n, float* y) {
  require(isa, gate);
  require(isa, up);
  require(isa, down);
  detail::check_ffn_shapes(gate, up, down);
  const int64_t inter = gate.rows, hidden = gate.cols;
  if (n <= 0 || hidden == 0) return;
  if (inter == 0) {
    std::fill(y, y + n * hidden, 0.0f);
    return;
  }
  const detail::QuantizeBlockFn quantize = quantize_kernel(isa);
  const Int8Rows x_gate = quantize_rows(quantize, x, n, hidden, layout_for(gate), scratch.x_gate);
  const Int8Rows x_up = layout_for(up) == layout_for(gate)
                            ? x_gate
                            : quantize_rows(quantize, x, n, hidden, layout_for(up), scratch.x_up);
  const Int8Rows h_q = scratch.hidden.prepare(layout_for(down), n, inter);
  float* gate_out = grown(scratch.gate, n * inter);  // [n, inter]
  float* up_out = grown(scratch.up, n * inter);
  float* h = grown(scratch.h, n * inter);
  const detail::ZeroPointSums sums(gate, up, down, x, n);  // from the fp32 x and h

#pragma omp parallel if (3 * inter * hidden * n >= detail::kParallelMinMacs)
  {
    const int nth = omp_get_num_threads(), tid = omp_get_thread_num();
    int64_t begin, end;
    detail::static_range(inter, nth, tid, begin, end, kInt8TileRows);
    run_int8(isa, gate, x_gate, gate_out, inter, begin, end);
    run_int8(isa, up, x_up, up_out, inter, begin, end);
    sums.add_gate_up(gate, up, n, gate_out, up_out, begin, end);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t o = begin; o < end; ++o) {
        const float g = gate_out[t * inter + o];
        h[t * inter + o] = g / (1.0f + std::exp(-g)) * up_out[t * inter + o];
      }
#pragma omp barrier
    // Each (row, block) is quantized by one thread, whatever the thread count.
    const int64_t units = n * h_q.blocks;
    for (int64_t u = units * tid / nth; u < units * (tid + 1) / nth; ++u)
      quantize_block(quantize, h, h_q, u / h_q.blocks, u % h_q.blocks);
#pragma omp barrier
    if (down.offsets) {
#pragma omp single
      sums.sum_hidden(down, h, n);
    }
    detail::static_range(hidden, nth, tid, begin, end, kInt8TileRows);
    run_int8(isa, down, h_q, y, hidden, begin, end);
    sums.add_down(down, n, y, begin, end);
  }
}

}  // namespace colibri::kernels
