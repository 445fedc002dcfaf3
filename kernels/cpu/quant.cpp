#include "cpu/quant.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/quant_detail.h"

namespace colibri::kernels {

namespace {

constexpr int kValidGroupSizes[] = {16, 32, 48, 64, 96, 128, 192, 256};

bool is_int4(QuantFormat f) {
  return f != QuantFormat::kInt8Row;
}

const char* format_name(QuantFormat f) {
  switch (f) {
    case QuantFormat::kInt4Row:
      return "int4-row";
    case QuantFormat::kInt4Grouped:
      return "int4-grouped";
    case QuantFormat::kInt8Row:
      return "int8-row";
  }
  return "unknown";
}

int64_t n_groups(int64_t cols, int64_t group_size) {
  return (cols + group_size - 1) / group_size;
}

// ---- activation layout (see quant_detail.h) --------------------------------------------------

// The activation layout a kernel reads (quant_detail.h): `block` inputs per block (0: natural
// order), `per_lane` consecutive inputs per 32-bit lane; or BF16 pairs in blocks of 64.
struct Layout {
  int block = 0, per_lane = 1;
  bool bf16_pairs = false;
  bool operator==(const Layout&) const = default;
};

constexpr Layout kBf16Pairs = {64, 1, true};

bool cpu_has_avx512bf16() {
#if COLIBRI_QUANT_X86
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// COLIBRI_BF16_PAIRS=0 turns them off (benchmarks compare both).
bool bf16_pairs_allowed = detail::allowed_by_env("COLIBRI_BF16_PAIRS");

Layout activation_layout(QuantIsa isa, const QuantMatrixView& w, int64_t n) {
  if (isa == QuantIsa::kScalar || !is_int4(w.format)) return {};
  if (isa == QuantIsa::kAvx2) return {16, 2};
  if (n == 1 && bf16_pairs_enabled() &&
      (w.format == QuantFormat::kInt4Row || w.group_size % 64 == 0))
    return kBf16Pairs;
  const int gs = w.format == QuantFormat::kInt4Row ? 128 : w.group_size;
  if (gs % 128 == 0 || (n == 1 && 128 % gs == 0)) return {128, 8};
  if (gs % 64 == 0) return {64, 4};
  if (gs % 32 == 0) return {32, 2};
  return {16, 2};
}

// Where input i of a row lives in the layout (BF16 pairs: the natural order, converted after).
int64_t permuted_index(int64_t i, int64_t cols, Layout layout) {
  if (layout.block == 0 || layout.bf16_pairs || i >= cols / layout.block * layout.block) return i;
  const int64_t j = i % layout.block;
  return i - j + (j % layout.per_lane) * (layout.block / layout.per_lane) + j / layout.per_lane;
}

// xp [n, cols] = x [n, cols] in `layout`.
void permute_activations(const float* x, int64_t n, int64_t cols, Layout layout, float* xp) {
  if (layout.bf16_pairs) {
#if COLIBRI_QUANT_X86
    for (int64_t t = 0; t < n; ++t)
      detail::bf16_pairs_avx512bf16(x + t * cols, cols, xp + t * cols);
#endif
    return;
  }
  const int block = layout.block, p = layout.per_lane, lanes = block / p;
  const int64_t full = cols / block * block;
  for (int64_t t = 0; t < n; ++t) {
    const float* src = x + t * cols;
    float* dst = xp + t * cols;
    for (int64_t k = 0; k < full; k += block)
      for (int lane = 0; lane < lanes; ++lane)
        for (int m = 0; m < p; ++m) dst[k + m * lanes + lane] = src[k + lane * p + m];
    std::memcpy(dst + full, src + full, size_t(cols - full) * sizeof(float));
  }
}

// Per calling thread, grown on demand and never shrunk: no allocation once warm.
struct Scratch {
  std::vector<float> x_gate, x_up, gate, up, hidden;
};
thread_local Scratch scratch;

// count floats of v from a 64-byte boundary: the kernels' activation loads then never straddle
// cache lines (BF16 pairs read 4 vectors of activations per 32 weight bytes: 22 GB/s unaligned
// against 27 aligned on one core).
float* grown(std::vector<float>& v, int64_t count) {
  constexpr int64_t kAlignFloats = 16;
  if (int64_t(v.size()) < count + kAlignFloats) v.resize(size_t(count + kAlignFloats));
  const uintptr_t at = reinterpret_cast<uintptr_t>(v.data());
  return reinterpret_cast<float*>((at + 63) & ~uintptr_t(63));
}

// x in `layout`: permuted into `buffer`, or x itself for the natural order.
const float* laid_out(const float* x, int64_t n, int64_t cols, Layout layout,
                      std::vector<float>& buffer) {
  if (layout.block == 0) return x;
  float* xp = grown(buffer, n * cols);
  permute_activations(x, n, cols, layout, xp);
  return xp;
}

// ---- scalar reference ------------------------------------------------------------------------

// Sum over i in [i0, i1) of (q_i - 8) * x[i] (i0 even: groups start at multiples of an even
// group size). 16 partial sums, one per input of a 16-input step, so that the compiler can keep
// them in vector registers without reassociating anything.
float int4_dot(const uint8_t* row, const float* x, int64_t i0, int64_t i1) {
  float partial[16] = {};
  int64_t i = i0;
  for (; i + 16 <= i1; i += 16)
    for (int k = 0; k < 8; ++k) {
      const uint8_t b = row[(i >> 1) + k];
      partial[2 * k] += float(int(b & 15) - 8) * x[i + 2 * k];
      partial[2 * k + 1] += float(int(b >> 4) - 8) * x[i + 2 * k + 1];
    }
  float sum = 0.0f;
  for (; i < i1; ++i) sum += float(int((i & 1) ? row[i >> 1] >> 4 : row[i >> 1] & 15) - 8) * x[i];
  for (int k = 0; k < 16; ++k) sum += partial[k];
  return sum;
}

float int8_dot(const int8_t* row, const float* x, int64_t cols) {
  float partial[16] = {};
  int64_t i = 0;
  for (; i + 16 <= cols; i += 16)
    for (int k = 0; k < 16; ++k) partial[k] += float(row[i + k]) * x[i + k];
  float sum = 0.0f;
  for (; i < cols; ++i) sum += float(row[i]) * x[i];
  for (int k = 0; k < 16; ++k) sum += partial[k];
  return sum;
}

void rows_scalar(const QuantMatrixView& w, const float* x, int64_t n, float* y, int64_t y_stride,
                 int64_t row_begin, int64_t row_end) {
  const int64_t rb = row_bytes(w.format, w.cols);
  for (int64_t o = row_begin; o < row_end; ++o) {
    const uint8_t* row = w.data + o * rb;
    for (int64_t t = 0; t < n; ++t) {
      const float* xt = x + t * w.cols;
      float sum = 0.0f;
      switch (w.format) {
        case QuantFormat::kInt4Row:
          sum = w.scales[o] * int4_dot(row, xt, 0, w.cols);
          break;
        case QuantFormat::kInt8Row:
          sum = w.scales[o] * int8_dot(reinterpret_cast<const int8_t*>(row), xt, w.cols);
          break;
        case QuantFormat::kInt4Grouped: {
          const int64_t ng = n_groups(w.cols, w.group_size);
          for (int64_t g = 0; g < ng; ++g) {
            const int64_t i0 = g * w.group_size, i1 = std::min(w.cols, i0 + w.group_size);
            sum += w.scales[o * ng + g] * int4_dot(row, xt, i0, i1);
          }
          break;
        }
      }
      y[t * y_stride + o] = sum;
    }
  }
}

// ---- dispatch --------------------------------------------------------------------------------

bool cpu_has(QuantIsa isa) {
#if COLIBRI_QUANT_X86
  switch (isa) {
    case QuantIsa::kScalar:
      return true;
    case QuantIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case QuantIsa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
  }
  return false;
#else
  return isa == QuantIsa::kScalar;
#endif
}

detail::RowsKernel rows_kernel(QuantIsa isa, Layout layout) {
#if COLIBRI_QUANT_X86
  if (layout.bf16_pairs) return detail::rows_avx512bf16;
  if (isa == QuantIsa::kAvx512) return detail::rows_avx512;
  if (isa == QuantIsa::kAvx2) return detail::rows_avx2;
#endif
  return rows_scalar;
}

void require_available(QuantIsa isa) {
  if (!quant_isa_available(isa))
    throw std::invalid_argument(std::string("quant kernels: ISA ") + quant_isa_name(isa) +
                                " is not available on this CPU or in this build");
}

}  // namespace

detail::ZeroPointSums::ZeroPointSums(const QuantMatrixView& gate, const QuantMatrixView& up,
                                     const QuantMatrixView& down, const float* x, int64_t n)
    : x_groups(gate.offsets || up.offsets ? offset_groups(gate.offsets ? gate : up) : 0),
      h_groups(down.offsets ? offset_groups(down) : 0) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < size_t(n * (x_groups + h_groups)))
    buffer.resize(size_t(n * (x_groups + h_groups)));
  x_sums = buffer.data();
  h_sums = buffer.data() + n * x_groups;
  if (gate.offsets && up.offsets && (gate.format != up.format || gate.group_size != up.group_size))
    throw std::invalid_argument("quant_expert_ffn: gate and up zero points differ in groups");
  if (x_groups) group_sums(x, n, gate.cols, gate.offsets ? gate.group_size : up.group_size, x_sums);
}

void detail::ZeroPointSums::add_gate_up(const QuantMatrixView& gate, const QuantMatrixView& up,
                                        int64_t n, float* gate_out, float* up_out, int64_t begin,
                                        int64_t end) const {
  if (gate.offsets) add_offsets(gate, x_sums, n, gate_out, gate.rows, begin, end);
  if (up.offsets) add_offsets(up, x_sums, n, up_out, up.rows, begin, end);
}

void detail::ZeroPointSums::sum_hidden(const QuantMatrixView& down, const float* h,
                                       int64_t n) const {
  group_sums(h, n, down.cols, down.group_size, h_sums);
}

void detail::ZeroPointSums::add_down(const QuantMatrixView& down, int64_t n, float* y,
                                     int64_t begin, int64_t end) const {
  if (down.offsets) add_offsets(down, h_sums, n, y, down.rows, begin, end);
}

void detail::check_ffn_shapes(const QuantMatrixView& gate, const QuantMatrixView& up,
                              const QuantMatrixView& down) {
  const int64_t inter = gate.rows, hidden = gate.cols;
  if (up.rows != inter || up.cols != hidden || down.rows != hidden || down.cols != inter)
    throw std::invalid_argument(
        "quant_expert_ffn: expected gate, up [inter, hidden] and down [hidden, inter]; got gate " +
        std::to_string(gate.rows) + "x" + std::to_string(gate.cols) + ", up " +
        std::to_string(up.rows) + "x" + std::to_string(up.cols) + ", down " +
        std::to_string(down.rows) + "x" + std::to_string(down.cols));
}

bool detail::allowed_by_env(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr || std::strcmp(value, "0") != 0;
}

void detail::static_range(int64_t total, int nth, int tid, int64_t& begin, int64_t& end,
                          int64_t unit) {
  const int64_t units = (total + unit - 1) / unit;
  const int64_t chunk = units / nth, rem = units % nth;
  begin = std::min(total, unit * (tid * chunk + std::min<int64_t>(tid, rem)));
  end = std::min(total, begin + unit * (chunk + (tid < rem ? 1 : 0)));
}

// ---- container -------------------------------------------------------------------------------

bool is_valid_group_size(int group_size) {
  return std::find(std::begin(kValidGroupSizes), std::end(kValidGroupSizes), group_size) !=
         std::end(kValidGroupSizes);
}

int64_t row_bytes(QuantFormat format, int64_t cols) {
  return is_int4(format) ? (cols + 1) / 2 : cols;
}

int64_t packed_bytes(QuantFormat format, int64_t rows, int64_t cols) {
  return rows * row_bytes(format, cols);
}

int64_t scale_count(QuantFormat format, int64_t rows, int64_t cols, int group_size) {
  return format == QuantFormat::kInt4Grouped ? rows * n_groups(cols, group_size) : rows;
}

void check_view(const QuantMatrixView& w) {
  const auto fail = [&](const std::string& why) {
    throw std::invalid_argument(std::string("quantized matrix (") + format_name(w.format) + ", " +
                                std::to_string(w.rows) + "x" + std::to_string(w.cols) + ", group " +
                                std::to_string(w.group_size) + "): " + why);
  };
  if (w.format != QuantFormat::kInt4Row && w.format != QuantFormat::kInt4Grouped &&
      w.format != QuantFormat::kInt8Row)
    fail("unknown format");
  if (w.rows < 0 || w.cols < 0) fail("negative shape");
  if (w.format == QuantFormat::kInt4Grouped && !is_valid_group_size(w.group_size))
    fail("group size must be one of 16, 32, 48, 64, 96, 128, 192, 256");
  if (w.format != QuantFormat::kInt4Grouped && w.group_size != 0)
    fail("per-row formats take group size 0");
  if (w.rows > 0 && w.cols > 0 && (w.data == nullptr || w.scales == nullptr))
    fail("null data or scales");
  if (w.offsets != nullptr && !is_int4(w.format)) fail("zero-point offsets are for int4 only");
  if (w.layout != QuantLayout::kRows && w.layout != QuantLayout::kTiles) fail("unknown layout");
  if (w.layout == QuantLayout::kTiles && !tiles_supported(w.format, w.rows, w.cols, w.group_size))
    fail(
        "tiles need rows a multiple of 8, cols a multiple of 64 and groups a multiple of 64 "
        "inputs");
}

bool tiles_supported(QuantFormat format, int64_t rows, int64_t cols, int group_size) {
  return rows % kTileRows == 0 && cols % 64 == 0 &&
         (format != QuantFormat::kInt4Grouped || group_size % 64 == 0);
}

int64_t detail::byte_at(const QuantMatrixView& w, int64_t rb, int64_t o, int64_t b) {
  if (w.layout == QuantLayout::kRows) return o * rb + b;
  return o / kTileRows * kTileRows * rb + b / 32 * 256 + b % 32 / 4 * 32 + o % kTileRows * 4 +
         b % 4;
}

int64_t detail::scale_at(const QuantMatrixView& w, int64_t ng, int64_t o, int64_t g) {
  if (w.format != QuantFormat::kInt4Grouped) return o;
  if (w.layout == QuantLayout::kRows) return o * ng + g;
  return (o / kTileRows * ng + g) * kTileRows + o % kTileRows;
}

void relayout(const QuantMatrixView& w, QuantLayout layout, uint8_t* data, float* scales) {
  check_view(w);
  const QuantMatrixView to{w.format, w.rows, w.cols, w.group_size, data, scales, layout};
  check_view(to);
  const int64_t rb = row_bytes(w.format, w.cols);
  const int64_t ng = w.format == QuantFormat::kInt4Grouped ? n_groups(w.cols, w.group_size) : 1;
  if (w.layout == layout || rb % 4 != 0) {  // kTiles has rb % 32 == 0, so both are kRows here
    std::memcpy(data, w.data, size_t(packed_bytes(w.format, w.rows, w.cols)));
    std::memcpy(scales, w.scales,
                size_t(scale_count(w.format, w.rows, w.cols, w.group_size)) * sizeof(float));
    return;
  }
  // Tile by tile (the same span in either layout), word by word: byte_at and scale_at unrolled.
  const bool to_tiles = layout == QuantLayout::kTiles;
  const bool grouped = w.format == QuantFormat::kInt4Grouped;
  for (int64_t o0 = 0; o0 < w.rows; o0 += kTileRows) {
    const uint8_t* src = w.data + o0 * rb;
    uint8_t* dst = data + o0 * rb;
    for (int64_t c = 0; c < rb / 32; ++c)
      for (int64_t j = 0; j < 8; ++j)
        for (int64_t r = 0; r < kTileRows; ++r) {
          const int64_t at_rows = r * rb + c * 32 + j * 4, at_tiles = c * 256 + j * 32 + r * 4;
          std::memcpy(dst + (to_tiles ? at_tiles : at_rows), src + (to_tiles ? at_rows : at_tiles),
                      4);
        }
    if (!grouped) continue;
    const float* s_src = w.scales + o0 * ng;
    float* s_dst = scales + o0 * ng;
    for (int64_t g = 0; g < ng; ++g)
      for (int64_t r = 0; r < kTileRows; ++r) {
        const int64_t at_rows = r * ng + g, at_tiles = g * kTileRows + r;
        s_dst[to_tiles ? at_tiles : at_rows] = s_src[to_tiles ? at_rows : at_tiles];
      }
  }
  if (!grouped) std::memcpy(scales, w.scales, size_t(w.rows) * sizeof(float));
}

namespace {

// Per calling thread: one tile copied back to rows (tile_as_rows).
struct TileScratch {
  std::vector<uint8_t> data;
  std::vector<float> scales;
};
thread_local TileScratch tile_scratch;

}  // namespace

QuantMatrixView detail::tile_as_rows(const QuantMatrixView& w, int64_t o0) {
  const int64_t rb = row_bytes(w.format, w.cols);
  const int64_t per_row =
      w.format == QuantFormat::kInt4Grouped ? n_groups(w.cols, w.group_size) : 1;
  const QuantMatrixView tile{w.format,           kTileRows,        w.cols,
                             w.group_size,       w.data + o0 * rb, w.scales + o0 * per_row,
                             QuantLayout::kTiles};
  TileScratch& s = tile_scratch;
  if (int64_t(s.data.size()) < kTileRows * rb) s.data.resize(size_t(kTileRows * rb));
  if (int64_t(s.scales.size()) < kTileRows * per_row) s.scales.resize(size_t(kTileRows * per_row));
  relayout(tile, QuantLayout::kRows, s.data.data(), s.scales.data());
  return {w.format, kTileRows, w.cols, w.group_size, s.data.data(), s.scales.data()};
}

void detail::run_rows(RowsKernel kernel, const QuantMatrixView& w, const float* xp, int64_t n,
                      float* y, int64_t y_stride, int64_t row_begin, int64_t row_end) {
  if (w.layout == QuantLayout::kRows) return kernel(w, xp, n, y, y_stride, row_begin, row_end);
  for (int64_t o0 = row_begin; o0 < row_end; o0 += kTileRows)
    kernel(tile_as_rows(w, o0), xp, n, y + o0, y_stride, 0, kTileRows);
}

int64_t detail::row_unit(const QuantMatrixView& w) {
  return w.layout == QuantLayout::kTiles ? kTileRows : kRowAlignment;
}

void quantize(QuantFormat format, int group_size, const float* w, int64_t rows, int64_t cols,
              uint8_t* data, float* scales) {
  if (format != QuantFormat::kInt4Grouped) group_size = 0;
  check_view({format, rows, cols, group_size, data, scales});
  const float qmax = is_int4(format) ? 7.0f : 127.0f;
  const float qmin = is_int4(format) ? -8.0f : -127.0f;
  const int64_t span = group_size > 0 ? group_size : std::max<int64_t>(cols, 1);
  const int64_t ng = n_groups(cols, span);
  const int64_t rb = row_bytes(format, cols);
  for (int64_t o = 0; o < rows; ++o) {
    const float* src = w + o * cols;
    uint8_t* dst = data + o * rb;
    if (is_int4(format)) std::memset(dst, 0x88, size_t(rb));  // pad nibble: 8, the code of 0
    for (int64_t g = 0; g < ng; ++g) {
      const int64_t i0 = g * span, i1 = std::min(cols, i0 + span);
      float amax = 0.0f;
      for (int64_t i = i0; i < i1; ++i) {
        if (!std::isfinite(src[i]))
          throw std::invalid_argument("quantize: non-finite weight at row " + std::to_string(o) +
                                      ", column " + std::to_string(i));
        amax = std::max(amax, std::fabs(src[i]));
      }
      const float s = std::max(amax / qmax, 1e-8f);
      scales[group_size > 0 ? o * ng + g : o] = s;
      for (int64_t i = i0; i < i1; ++i) {
        const int q = int(std::clamp(std::rint(src[i] / s), qmin, qmax));
        if (!is_int4(format)) {
          dst[i] = uint8_t(int8_t(q));
        } else if (i % 2 == 0) {
          dst[i / 2] = uint8_t((dst[i / 2] & 0xF0) | (q + 8));
        } else {
          dst[i / 2] = uint8_t((dst[i / 2] & 0x0F) | ((q + 8) << 4));
        }
      }
    }
    if (cols == 0 && group_size == 0) scales[o] = 1e-8f;
  }
}

void dequantize(const QuantMatrixView& w, float* out) {
  check_view(w);
  const int64_t rb = row_bytes(w.format, w.cols);
  const int64_t ng = w.format == QuantFormat::kInt4Grouped ? n_groups(w.cols, w.group_size) : 1;
  for (int64_t o = 0; o < w.rows; ++o) {
    for (int64_t i = 0; i < w.cols; ++i) {
      const int64_t g = w.format == QuantFormat::kInt4Grouped ? i / w.group_size : 0;
      const float s = w.scales[detail::scale_at(w, ng, o, g)];
      int q;
      if (w.format == QuantFormat::kInt8Row) {
        q = int8_t(w.data[detail::byte_at(w, rb, o, i)]);
      } else {
        const uint8_t b = w.data[detail::byte_at(w, rb, o, i >> 1)];
        q = int((i & 1) ? b >> 4 : b & 15) - 8;
      }
      out[o * w.cols + i] = float(q) * s;
      if (w.offsets) out[o * w.cols + i] += w.offsets[o * ng + g];
    }
  }
}

// ---- ISA selection ---------------------------------------------------------------------------

const char* quant_isa_name(QuantIsa isa) {
  switch (isa) {
    case QuantIsa::kScalar:
      return "scalar";
    case QuantIsa::kAvx2:
      return "avx2";
    case QuantIsa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

bool quant_isa_available(QuantIsa isa) {
  return cpu_has(isa);
}

QuantIsa quant_isa_resolve(const char* cap) {
  QuantIsa best = QuantIsa::kScalar;
  for (QuantIsa isa : {QuantIsa::kAvx2, QuantIsa::kAvx512})
    if (quant_isa_available(isa)) best = isa;
  if (cap == nullptr || *cap == '\0') return best;
  for (QuantIsa isa : {QuantIsa::kScalar, QuantIsa::kAvx2, QuantIsa::kAvx512}) {
    if (std::strcmp(cap, quant_isa_name(isa)) != 0) continue;
    require_available(isa);
    return isa;
  }
  throw std::invalid_argument(std::string("COLIBRI_ISA=") + cap +
                              ": expected scalar, avx2 or avx512");
}

QuantIsa quant_isa_selected() {
  static const QuantIsa selected = quant_isa_resolve(std::getenv("COLIBRI_ISA"));
  return selected;
}

const char* quant_isa() {
  return quant_isa_name(quant_isa_selected());
}

bool bf16_pairs_available() {
  return quant_isa_available(QuantIsa::kAvx512) && cpu_has_avx512bf16();
}

bool bf16_pairs_enabled() {
  return bf16_pairs_allowed && bf16_pairs_available();
}

void set_bf16_pairs(bool allowed) {
  bf16_pairs_allowed = allowed;
}

// ---- kernels ---------------------------------------------------------------------------------

void quant_linear(QuantIsa isa, const QuantMatrixView& w, const float* x, int64_t n, float* y) {
  check_view(w);
  require_available(isa);
  if (n <= 0 || w.rows == 0) return;
  if (w.cols == 0) {
    std::fill(y, y + n * w.rows, 0.0f);
    return;
  }
  const Layout layout = activation_layout(isa, w, n);
  const float* xp = laid_out(x, n, w.cols, layout, scratch.x_gate);
  const detail::RowsKernel kernel = rows_kernel(isa, layout);
#pragma omp parallel if (w.rows * w.cols * n >= detail::kParallelMinMacs)
  {
    int64_t begin, end;
    detail::static_range(w.rows, omp_get_num_threads(), omp_get_thread_num(), begin, end,
                         detail::row_unit(w));
    detail::run_rows(kernel, w, xp, n, y, w.rows, begin, end);
  }
  add_zero_point_terms(w, x, n, y);
}

void quant_linear(const QuantMatrixView& w, const float* x, int64_t n, float* y) {
  if (int8_activations_for(w))
    quant_linear_int8(quant_isa_selected(), w, x, n, y);
  else
    quant_linear(quant_isa_selected(), w, x, n, y);
}

void quant_linear_scalar(const QuantMatrixView& w, const float* x, int64_t n, float* y) {
  quant_linear(QuantIsa::kScalar, w, x, n, y);
}

void quant_expert_ffn(QuantIsa isa, const QuantMatrixView& gate, const QuantMatrixView& up,
                      const QuantMatrixView& down, const float* x, int64_t n, float* y) {
  check_view(gate);
  check_view(up);
  check_view(down);
  require_available(isa);
  detail::check_ffn_shapes(gate, up, down);
  const int64_t inter = gate.rows, hidden = gate.cols;
  if (n <= 0 || hidden == 0) return;
  if (inter == 0) {
    std::fill(y, y + n * hidden, 0.0f);
    return;
  }

  const Layout layout_gate = activation_layout(isa, gate, n);
  const Layout layout_up = activation_layout(isa, up, n);
  const Layout layout_down = activation_layout(isa, down, n);
  const float* x_gate = laid_out(x, n, hidden, layout_gate, scratch.x_gate);
  const float* x_up =
      layout_up == layout_gate ? x_gate : laid_out(x, n, hidden, layout_up, scratch.x_up);
  float* gate_out = grown(scratch.gate, n * inter);  // [n, inter]
  float* up_out = grown(scratch.up, n * inter);      // [n, inter]
  float* h = grown(scratch.hidden, n * inter);       // [n, inter] in down's activation layout
  // Zero points: the group sums of x and (once it is whole) of h in natural order, which up_out
  // then holds.
  const detail::ZeroPointSums sums(gate, up, down, x, n);
  const detail::RowsKernel kernel_gate = rows_kernel(isa, layout_gate);
  const detail::RowsKernel kernel_up = rows_kernel(isa, layout_up);
  const detail::RowsKernel kernel_down = rows_kernel(isa, layout_down);

#pragma omp parallel if (3 * inter * hidden * n >= detail::kParallelMinMacs)
  {
    const int nth = omp_get_num_threads(), tid = omp_get_thread_num();
    int64_t begin, end;
    detail::static_range(inter, nth, tid, begin, end,
                         std::max(detail::row_unit(gate), detail::row_unit(up)));
    detail::run_rows(kernel_gate, gate, x_gate, n, gate_out, inter, begin, end);
    detail::run_rows(kernel_up, up, x_up, n, up_out, inter, begin, end);
    sums.add_gate_up(gate, up, n, gate_out, up_out, begin, end);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t o = begin; o < end; ++o) {
        const float g = gate_out[t * inter + o];
        const float v = g / (1.0f + std::exp(-g)) * up_out[t * inter + o];
        h[t * inter + permuted_index(o, inter, layout_down)] = v;
        if (down.offsets) up_out[t * inter + o] = v;
      }
#pragma omp barrier
    if (layout_down.bf16_pairs) {
#pragma omp single
      permute_activations(h, n, inter, layout_down, h);
    }
    if (down.offsets) {
#pragma omp single
      sums.sum_hidden(down, up_out, n);
    }
    detail::static_range(hidden, nth, tid, begin, end, detail::row_unit(down));
    detail::run_rows(kernel_down, down, h, n, y, hidden, begin, end);
    sums.add_down(down, n, y, begin, end);
  }
}

void quant_expert_ffn(const QuantMatrixView& gate, const QuantMatrixView& up,
                      const QuantMatrixView& down, const float* x, int64_t n, float* y) {
  if (int8_activations_for(gate) && int8_activations_for(up) && int8_activations_for(down))
    quant_expert_ffn_int8(quant_isa_selected(), gate, up, down, x, n, y);
  else
    quant_expert_ffn(quant_isa_selected(), gate, up, down, x, n, y);
}

}  // namespace colibri::kernels
