#include "model/container.h"

#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>

#include "common/error.h"

namespace colibri {

namespace {

constexpr int kGroupCandidates[] = {16, 32, 48, 64, 96, 128, 192, 256};

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

}  // namespace

std::string quant_spec_name(QuantSpec spec) {
  switch (spec.format) {
    case kernels::QuantFormat::kInt8Row:
      return "int8-row";
    case kernels::QuantFormat::kInt4Row:
      return "int4-row";
    case kernels::QuantFormat::kInt4Grouped:
      return fmt::format("int4-g{}", spec.group_size);
  }
  return "unknown";
}

QuantResolution resolve_quant_format(int64_t n_bytes, int64_t n_scales, int64_t rows,
                                     int64_t cols) {
  QuantResolution r;
  if (rows <= 0 || cols <= 0) {
    r.error = fmt::format("expected shape [{}, {}] cannot hold a quantized matrix", rows, cols);
    return r;
  }
  const int64_t int8_bytes = rows * cols, int4_bytes = rows * ceil_div(cols, 2);
  const bool is_int8 = n_bytes == int8_bytes, is_int4 = n_bytes == int4_bytes;
  if (is_int8 && is_int4) {
    r.error = fmt::format("{} bytes for [{}, {}] fit both int8 and int4", n_bytes, rows, cols);
    return r;
  }
  if (!is_int8 && !is_int4) {
    r.error = fmt::format("{} bytes fit no format for [{}, {}] (int8: {}, int4: {})", n_bytes, rows,
                          cols, int8_bytes, int4_bytes);
    return r;
  }
  if (is_int8) {
    if (n_scales == rows) {
      r.spec = {kernels::QuantFormat::kInt8Row, 0};
    } else {
      r.error = fmt::format("{} scales for int8 [{}, {}], expected {} (one per row)", n_scales,
                            rows, cols, rows);
    }
    return r;
  }
  if (n_scales == rows) {
    r.spec = {kernels::QuantFormat::kInt4Row, 0};
    return r;
  }
  std::vector<int> fits;
  std::string expected;
  for (int gs : kGroupCandidates) {
    const int64_t groups = ceil_div(cols, gs);
    if (groups > 1 && n_scales == rows * groups) fits.push_back(gs);
    expected += fmt::format("{}{}: {}", expected.empty() ? "" : ", ", gs, rows * groups);
  }
  if (fits.size() == 1) {
    r.spec = {kernels::QuantFormat::kInt4Grouped, fits[0]};
  } else if (fits.empty()) {
    r.error =
        fmt::format("{} scales for int4 [{}, {}] fit neither per-row ({}) nor a group size ({})",
                    n_scales, rows, cols, rows, expected);
  } else {
    r.error = fmt::format("{} scales for int4 [{}, {}] are ambiguous: group sizes {} all fit",
                          n_scales, rows, cols, fmt::join(fits, ", "));
  }
  return r;
}

QuantMatrix quantize_matrix(const std::string& name, QuantSpec spec, const float* w, int64_t rows,
                            int64_t cols) {
  if (spec.format == kernels::QuantFormat::kInt4Grouped) {
    if (!kernels::is_valid_group_size(spec.group_size))
      fail("{}: group size {} is not one of the container's", name, spec.group_size);
    if (ceil_div(cols, spec.group_size) <= 1) spec = {kernels::QuantFormat::kInt4Row, 0};
  } else {
    spec.group_size = 0;
  }
  QuantMatrix q;
  q.format = spec.format;
  q.rows = rows;
  q.cols = cols;
  q.group_size = spec.group_size;
  q.data.resize(size_t(kernels::packed_bytes(spec.format, rows, cols)));
  q.scales.resize(size_t(kernels::scale_count(spec.format, rows, cols, spec.group_size)));
  try {
    kernels::quantize(spec.format, spec.group_size, w, rows, cols, q.data.data(), q.scales.data());
  } catch (const std::invalid_argument& e) {  // a non-finite weight, at its row and column
    fail("{}: {}", name, e.what());
  }
  const QuantResolution back =
      resolve_quant_format(int64_t(q.data.size()), int64_t(q.scales.size()), rows, cols);
  if (!back.ok() || back.spec.format != spec.format || back.spec.group_size != spec.group_size)
    fail("{}: {} of [{}, {}] would not be readable unambiguously ({}); choose another group size",
         name, quant_spec_name(spec), rows, cols,
         back.ok() ? quant_spec_name(back.spec) : back.error);
  return q;
}

void set_layout(QuantMatrix& q, kernels::QuantLayout layout) {
  if (q.layout == layout || q.empty()) return;
  if (!kernels::tiles_supported(q.format, q.rows, q.cols, q.group_size))
    throw std::invalid_argument(fmt::format("{}x{} {}: no tiled layout for this shape", q.rows,
                                            q.cols, quant_spec_name({q.format, q.group_size})));
  // A tile's bytes and scales span the same range in either layout: rearrange one tile at a time
  // through a copy of it, in place (~6 GB/s on one core). One thread: an expert store's loader
  // thread calls this too, where an OpenMP team of its own would compete with the compute team.
  const int64_t rb = kernels::row_bytes(q.format, q.cols);
  const int64_t per_row = int64_t(q.scales.size()) / q.rows;
  std::vector<uint8_t> data(size_t(kernels::kTileRows * rb));
  std::vector<float> scales(size_t(kernels::kTileRows * per_row));
  for (int64_t o0 = 0; o0 < q.rows; o0 += kernels::kTileRows) {
    uint8_t* tile_data = q.data.data() + o0 * rb;
    float* tile_scales = q.scales.data() + o0 * per_row;
    const kernels::QuantMatrixView tile{q.format,  kernels::kTileRows, q.cols,  q.group_size,
                                        tile_data, tile_scales,        q.layout};
    kernels::relayout(tile, layout, data.data(), scales.data());
    std::copy(data.begin(), data.end(), tile_data);
    std::copy(scales.begin(), scales.end(), tile_scales);
  }
  q.layout = layout;
}

void use_cpu_layout(QuantMatrix& q) {
  if (!q.empty() && kernels::tiles_preferred(q.view())) set_layout(q, kernels::QuantLayout::kTiles);
}

QuantMatrix quant_rows(const QuantMatrix& q, int64_t r0, int64_t r1) {
  QuantMatrix s = q;
  s.rows = r1 - r0;
  const int64_t row_bytes = kernels::row_bytes(q.format, q.cols);
  s.data.assign(q.data.begin() + r0 * row_bytes, q.data.begin() + r1 * row_bytes);
  s.scales.assign(q.scales.begin() + kernels::scale_count(q.format, r0, q.cols, q.group_size),
                  q.scales.begin() + kernels::scale_count(q.format, r1, q.cols, q.group_size));
  if (q.has_zero_points()) {
    const int64_t groups = int64_t(q.offsets.size()) / q.rows;
    s.offsets.assign(q.offsets.begin() + r0 * groups, q.offsets.begin() + r1 * groups);
  }
  return s;
}

QuantMatrix quant_cols(const QuantMatrix& q, int64_t c0, int64_t c1) {
  const bool grouped = q.format == kernels::QuantFormat::kInt4Grouped;
  if ((grouped && c0 % q.group_size != 0) || c0 % 2 != 0)
    fail("columns {}..{} of a [{}, {}] matrix do not start a group of {}", c0, c1, q.rows, q.cols,
         q.group_size);
  QuantMatrix s = q;
  s.cols = c1 - c0;
  const int64_t from = kernels::row_bytes(q.format, q.cols),
                to = kernels::row_bytes(q.format, s.cols);
  const int64_t b0 = q.format == kernels::QuantFormat::kInt8Row ? c0 : c0 / 2;
  s.data.resize(size_t(q.rows * to));
  for (int64_t r = 0; r < q.rows; ++r)
    std::copy_n(q.data.begin() + r * from + b0, to, s.data.begin() + r * to);
  if (grouped) {
    const int64_t groups = ceil_div(q.cols, q.group_size);
    const int64_t g0 = c0 / q.group_size, g1 = ceil_div(c1, q.group_size);
    s.scales.resize(size_t(q.rows * (g1 - g0)));
    for (int64_t r = 0; r < q.rows; ++r)
      std::copy_n(q.scales.begin() + r * groups + g0, g1 - g0, s.scales.begin() + r * (g1 - g0));
    if (q.has_zero_points()) {  // by groups as the scales; a per-row offset stays the row's
      s.offsets.resize(s.scales.size());
      for (int64_t r = 0; r < q.rows; ++r)
        std::copy_n(q.offsets.begin() + r * groups + g0, g1 - g0,
                    s.offsets.begin() + r * (g1 - g0));
    }
  }
  return s;
}

}  // namespace colibri
