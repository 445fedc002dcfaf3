// colibri::cuda::expert_ffn_grouped (through ExpertGroupBuffers) against its CPU oracle:
// kernels::quant_expert_ffn (container formats) or linear_f32 + silu_mul (fp32 experts) per
// expert, then each row's weighted sum over its experts in ascending order, as run_expert_pairs
// does. Table: format x shape x rows x experts x top-k. BF16 experts against kernels::linear_bf16,
// NVFP4 ones against fp32 on kernels::dequantize_nvfp4, int4 with zero points (an asymmetric
// checkpoint's offsets) against fp32 on kernels::dequantize.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cpu/elementwise.h"
#include "cpu/linear.h"
#include "cpu/quant.h"
#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/expert_group.h"

namespace {

using colibri::cuda::DeviceExpert;
using colibri::cuda::DeviceMatrix;
using colibri::cuda::WeightFormat;
namespace kernels = colibri::kernels;

struct Case {
  WeightFormat format;
  int group_size;  // kInt4Grouped only
  int64_t hidden, inter;
  int n_rows, n_experts, top_k;
  bool zero_points = false;  // int4: fp32 offsets -zp * s per (row, group), zp in [-8, 7]
};

std::ostream& operator<<(std::ostream& os, const Case& c) {
  std::string f = colibri::cuda::weight_format_name(c.format);
  std::replace(f.begin(), f.end(), '-', '_');
  os << f;
  if (c.format == WeightFormat::kInt4Grouped) os << "_g" << c.group_size;
  return os << "_h" << c.hidden << "_i" << c.inter << "_rows" << c.n_rows << "_e" << c.n_experts
            << "_top" << c.top_k << (c.zero_points ? "_zp" : "");
}

kernels::QuantFormat quant_format(WeightFormat f) {
  switch (f) {
    case WeightFormat::kInt4Row:
      return kernels::QuantFormat::kInt4Row;
    case WeightFormat::kInt4Grouped:
      return kernels::QuantFormat::kInt4Grouped;
    default:
      return kernels::QuantFormat::kInt8Row;
  }
}

// One matrix on the host (the values the CPU reads: fp32, or the container bytes and scales
// plus their exact dequantisation) and on the device.
struct Matrix {
  int64_t rows = 0, cols = 0;
  std::vector<float> values;   // [rows, cols]: what the matrix stands for (dequantised)
  // [rows, cols]: |value|, or with zero points |(q - 8) s| + |offset|, the two terms the kernels
  // sum apart (their sum may cancel): what bounds the rounding.
  std::vector<float> magnitudes;
  std::vector<uint8_t> data;   // container bytes (int formats)
  std::vector<uint16_t> bf16;  // kBF16: the bits (values are exactly these)
  std::vector<float> scales;
  std::vector<float> offsets;  // int4 zero points, laid out as the scales
  std::vector<uint8_t> e4m3;   // kNvfp4: the scale bytes
  void* d_data = nullptr;
  void* d_e4m3 = nullptr;
  float* d_scales = nullptr;
  float* d_offsets = nullptr;
  DeviceMatrix device;

  Matrix(const Case& c, int64_t r, int64_t k, std::mt19937& rng, const char* what)
      : rows(r), cols(k) {
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    values.resize(size_t(rows * cols));
    for (float& v : values) v = uniform(rng) / std::sqrt(float(cols));
    int group = 0;
    if (c.format == WeightFormat::kBF16) {
      bf16.resize(values.size());
      for (size_t i = 0; i < values.size(); ++i) {
        uint32_t bits;
        std::memcpy(&bits, &values[i], 4);
        bf16[i] = uint16_t(bits >> 16);
        bits &= 0xFFFF0000u;
        std::memcpy(&values[i], &bits, 4);
      }
      CHECK_CUDA(cudaMalloc(&d_data, bf16.size() * 2));
      CHECK_CUDA(cudaMemcpy(d_data, bf16.data(), bf16.size() * 2, cudaMemcpyHostToDevice));
    } else if (c.format == WeightFormat::kNvfp4) {
      // The ModelOpt recipe; values become the CPU's dequantization (the oracle's weights).
      data.resize(size_t(rows * cols / 2));
      e4m3.resize(size_t(rows * cols / 16));
      const float global =
          kernels::quantize_nvfp4(values.data(), rows, cols, data.data(), e4m3.data());
      kernels::dequantize_nvfp4({data.data(), e4m3.data(), global, rows, cols}, values.data());
      magnitudes = values;
      CHECK_CUDA(cudaMalloc(&d_data, data.size()));
      CHECK_CUDA(cudaMemcpy(d_data, data.data(), data.size(), cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaMalloc(&d_e4m3, e4m3.size()));
      CHECK_CUDA(cudaMemcpy(d_e4m3, e4m3.data(), e4m3.size(), cudaMemcpyHostToDevice));
      device =
          colibri::cuda::device_matrix_nvfp4(rows, cols, static_cast<const uint8_t*>(d_data),
                                             static_cast<const uint8_t*>(d_e4m3), global, what);
      return;
    } else if (c.format != WeightFormat::kF32) {
      const kernels::QuantFormat qf = quant_format(c.format);
      group = c.format == WeightFormat::kInt4Grouped ? c.group_size : 0;
      data.resize(size_t(kernels::packed_bytes(qf, rows, cols)));
      scales.resize(size_t(kernels::scale_count(qf, rows, cols, group)));
      kernels::quantize(qf, group, values.data(), rows, cols, data.data(), scales.data());
      kernels::dequantize(view(c), values.data());
      magnitudes = values;
      if (c.zero_points) {
        std::uniform_int_distribution<int> zp(-8, 7);
        offsets.resize(scales.size());
        for (size_t i = 0; i < offsets.size(); ++i) offsets[i] = float(-zp(rng)) * scales[i];
        kernels::dequantize(view(c), values.data());
        const int64_t groups = kernels::offset_groups(view(c));
        for (int64_t o = 0; o < rows; ++o)
          for (int64_t i = 0; i < cols; ++i) {
            float& m = magnitudes[size_t(o * cols + i)];
            m = std::fabs(m) + std::fabs(offsets[size_t(o * groups + (group ? i / group : 0))]);
          }
        CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&d_offsets), offsets.size() * 4));
        CHECK_CUDA(
            cudaMemcpy(d_offsets, offsets.data(), offsets.size() * 4, cudaMemcpyHostToDevice));
      }
      CHECK_CUDA(cudaMalloc(&d_data, data.size()));
      CHECK_CUDA(cudaMemcpy(d_data, data.data(), data.size(), cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&d_scales), scales.size() * 4));
      CHECK_CUDA(cudaMemcpy(d_scales, scales.data(), scales.size() * 4, cudaMemcpyHostToDevice));
    } else {
      CHECK_CUDA(cudaMalloc(&d_data, values.size() * 4));
      CHECK_CUDA(cudaMemcpy(d_data, values.data(), values.size() * 4, cudaMemcpyHostToDevice));
    }
    if (magnitudes.empty()) magnitudes = values;
    device = colibri::cuda::device_matrix(c.format, group, rows, cols, d_data, d_scales, what,
                                          d_offsets);
  }
  ~Matrix() {
    cudaFree(d_e4m3);
    cudaFree(d_data);
    cudaFree(d_scales);
    cudaFree(d_offsets);
  }
  Matrix(const Matrix&) = delete;
  Matrix& operator=(const Matrix&) = delete;

  kernels::QuantMatrixView view(const Case& c) const {
    kernels::QuantMatrixView v{quant_format(c.format),
                               rows,
                               cols,
                               c.format == WeightFormat::kInt4Grouped ? c.group_size : 0,
                               data.data(),
                               scales.data()};
    v.offsets = offsets.empty() ? nullptr : offsets.data();
    return v;
  }
};

struct Expert {
  Matrix gate, up, down;
  Expert(const Case& c, std::mt19937& rng)
      : gate(c, c.inter, c.hidden, rng, "gate"),
        up(c, c.inter, c.hidden, rng, "up"),
        down(c, c.hidden, c.inter, rng, "down") {}
};

// y [n, hidden] on the CPU oracle.
void cpu_expert(const Case& c, const Expert& e, const float* x, int n, float* y) {
  if (c.format == WeightFormat::kBF16) {
    std::vector<float> g(size_t(n * c.inter)), u(g.size());
    kernels::linear_bf16(x, n, e.gate.bf16.data(), c.inter, c.hidden, g.data());
    kernels::linear_bf16(x, n, e.up.bf16.data(), c.inter, c.hidden, u.data());
    kernels::silu_mul(g.data(), u.data(), int64_t(g.size()));
    kernels::linear_bf16(g.data(), n, e.down.bf16.data(), c.hidden, c.inter, y);
    return;
  }
  // Zero points: the oracle is fp32 on the dequantised weights (kernels::dequantize).
  if (c.format != WeightFormat::kF32 && c.format != WeightFormat::kNvfp4 && !c.zero_points) {
    kernels::quant_expert_ffn(e.gate.view(c), e.up.view(c), e.down.view(c), x, n, y);
    return;
  }
  std::vector<float> g(size_t(n * c.inter)), u(g.size());
  kernels::linear_f32(x, n, e.gate.values.data(), c.inter, c.hidden, g.data());
  kernels::linear_f32(x, n, e.up.values.data(), c.inter, c.hidden, u.data());
  kernels::silu_mul(g.data(), u.data(), int64_t(g.size()));
  kernels::linear_f32(g.data(), n, e.down.values.data(), c.hidden, c.inter, y);
}

class ExpertFfnCuda : public testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    std::string why_none;
    if (colibri::cuda::device_count(&why_none) == 0) GTEST_SKIP() << "no CUDA device: " << why_none;
  }
};

// Error bound, per output element, from a double-precision pass over the same dequantised
// weights. Each dot product of k terms summed in fp32, in any order, is within k·u·Σ|terms| of
// the exact value (u = 2^-24); the CPU and GPU orders each sum at most `terms(k)` in sequence.
// The gate/up errors propagate through a = silu(g)·up with |silu'| < 1.1, then through down;
// the combine adds each row's top-k products in the same order on both sides (2·k·u of each
// product for the two roundings of the sums that differ in their inputs). A factor 2 covers
// the scale applied per 32 columns on the GPU (one more rounding per term) and exp's ulps.
TEST_P(ExpertFfnCuda, MatchesCpuOracleWithinRoundingBound) {
  const Case c = GetParam();
  std::mt19937 rng(7 + unsigned(c.hidden * 31 + c.inter * 7 + c.n_rows));
  std::vector<std::unique_ptr<Expert>> experts;
  for (int e = 0; e < c.n_experts; ++e) experts.push_back(std::make_unique<Expert>(c, rng));

  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> x(size_t(c.n_rows * c.hidden));
  for (float& v : x) v = uniform(rng);
  // Routing: each row takes top_k distinct experts (row 1 none, when there are 3+ rows), with
  // ids spread out (expert e has id 3e + 1) so that ids are not slot positions.
  std::vector<colibri::cuda::ExpertPair> pairs;
  std::vector<int> ids(size_t(c.n_experts));
  std::iota(ids.begin(), ids.end(), 0);
  for (int r = 0; r < c.n_rows; ++r) {
    if (r == 1 && c.n_rows >= 3) continue;
    std::shuffle(ids.begin(), ids.end(), rng);
    for (int k = 0; k < c.top_k; ++k)
      pairs.push_back({r, 3 * ids[size_t(k)] + 1, 0.05f + 0.9f * std::fabs(uniform(rng))});
  }

  // CPU: per expert, its rows gathered, the FFN, then out += w * y in ascending expert order.
  std::vector<float> expected(x.size(), 0.0f), bound(x.size(), 0.0f);
  std::vector<std::vector<float>> y_cpu(size_t(c.n_rows * c.n_experts));  // [row * E + e]
  for (int e = 0; e < c.n_experts; ++e) {
    std::vector<int> rows;
    for (const auto& p : pairs)
      if (p.expert == 3 * e + 1) rows.push_back(p.row);
    if (rows.empty()) continue;
    std::vector<float> xin(rows.size() * size_t(c.hidden)), y(xin.size());
    for (size_t i = 0; i < rows.size(); ++i)
      std::copy_n(&x[size_t(rows[i] * c.hidden)], c.hidden, &xin[i * size_t(c.hidden)]);
    cpu_expert(c, *experts[size_t(e)], xin.data(), int(rows.size()), y.data());
    for (size_t i = 0; i < rows.size(); ++i)
      y_cpu[size_t(rows[i] * c.n_experts + e)].assign(&y[i * size_t(c.hidden)],
                                                      &y[(i + 1) * size_t(c.hidden)]);
  }
  const double u = std::ldexp(1.0, -24);
  // The tensor-core path (int4 experts with 8+ slots) carries activations to 2^-18 relative (BF16
  // hi + lo) and sums each k-step of 16 and each chunk's 8 mma in fp32: 128 more units of u.
  const bool tensor_cores =
      (c.format == WeightFormat::kInt4Grouped || c.format == WeightFormat::kInt4Row) &&
      colibri::cuda::index_pairs(c.n_rows, pairs).max_slots_per_expert >= 8;
  // Zero points: each offset's product with its x sum, and that sum's own roundings (the CPU
  // sums a group in sequence, the GPU 32 or 64 columns then the chunks): 2 + 64 more.
  const auto terms = [&](int64_t k) {
    return double(k / 8 + 16) + double(k / 32 + 32 + 5) + (tensor_cores ? 128.0 : 0.0) +
           (c.zero_points ? 66.0 : 0.0);
  };
  for (int r = 0; r < c.n_rows; ++r) {
    for (int e = 0; e < c.n_experts; ++e) {
      const auto it = std::find_if(pairs.begin(), pairs.end(), [&](const auto& p) {
        return p.row == r && p.expert == 3 * e + 1;
      });
      if (it == pairs.end()) continue;
      const Expert& ex = *experts[size_t(e)];
      const float* xr = &x[size_t(r * c.hidden)];
      std::vector<double> a(size_t(c.inter)), da(size_t(c.inter));
      for (int64_t i = 0; i < c.inter; ++i) {
        double g = 0, up = 0, g_abs = 0, up_abs = 0;
        for (int64_t k = 0; k < c.hidden; ++k) {
          g += double(ex.gate.values[size_t(i * c.hidden + k)]) * xr[k];
          up += double(ex.up.values[size_t(i * c.hidden + k)]) * xr[k];
          g_abs += std::fabs(double(ex.gate.magnitudes[size_t(i * c.hidden + k)]) * xr[k]);
          up_abs += std::fabs(double(ex.up.magnitudes[size_t(i * c.hidden + k)]) * xr[k]);
        }
        const double silu = g / (1 + std::exp(-g));
        a[size_t(i)] = silu * up;
        const double dg = 2 * terms(c.hidden) * u * g_abs, dup = 2 * terms(c.hidden) * u * up_abs;
        da[size_t(i)] = 1.1 * std::fabs(up) * dg + std::fabs(silu) * dup + 1.1 * dg * dup +
                        8 * u * std::fabs(a[size_t(i)]);
      }
      for (int64_t j = 0; j < c.hidden; ++j) {
        double prop = 0, y_abs = 0;
        for (int64_t i = 0; i < c.inter; ++i) {
          const double d = ex.down.values[size_t(j * c.inter + i)];
          prop += std::fabs(d) * da[size_t(i)];
          y_abs += std::fabs(double(ex.down.magnitudes[size_t(j * c.inter + i)]) * a[size_t(i)]);
        }
        bound[size_t(r * c.hidden + j)] += it->weight * (prop + 2 * terms(c.inter) * u * y_abs) +
                                           2 * c.top_k * u * it->weight * y_abs;
      }
    }
  }
  for (int r = 0; r < c.n_rows; ++r)
    for (int e = 0; e < c.n_experts; ++e) {
      const auto& y = y_cpu[size_t(r * c.n_experts + e)];
      if (y.empty()) continue;
      const auto it = std::find_if(pairs.begin(), pairs.end(), [&](const auto& p) {
        return p.row == r && p.expert == 3 * e + 1;
      });
      for (int64_t j = 0; j < c.hidden; ++j)
        expected[size_t(r * c.hidden + j)] += it->weight * y[size_t(j)];
    }

  // GPU.
  const colibri::cuda::ExpertGroupIndex index = colibri::cuda::index_pairs(c.n_rows, pairs);
  std::vector<DeviceExpert> dev;
  for (int32_t id : index.experts) {
    const Expert& ex = *experts[size_t((id - 1) / 3)];
    dev.push_back({ex.gate.device, ex.up.device, ex.down.device});
  }
  std::vector<float> got(x.size(), std::nanf(""));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  {
    colibri::cuda::ExpertGroupBuffers buffers;
    // Poison the workspace and output so that an element never written cannot pass.
    buffers.run(index, dev, x.data(), c.hidden, c.inter, got.data(), stream);
    CHECK_CUDA(cudaStreamSynchronize(stream));
    const colibri::cuda::ExpertGroup& g = buffers.group();
    CHECK_CUDA(cudaMemsetAsync(g.out, 0xff, x.size() * 4, stream));
    CHECK_CUDA(cudaMemsetAsync(g.h, 0xff, size_t(g.n_slots * g.inter) * 4, stream));
    CHECK_CUDA(cudaMemsetAsync(g.y_slots, 0xff, size_t(g.n_slots * g.hidden) * 4, stream));
    std::fill(got.begin(), got.end(), std::nanf(""));
    buffers.run(index, dev, x.data(), c.hidden, c.inter, got.data(), stream);
    CHECK_CUDA(cudaStreamSynchronize(stream));
  }
  // The CUDA-core path for every batch (the tensor cores off) within the same bound.
  std::vector<float> cuda_cores(x.size(), std::nanf(""));
  {
    colibri::cuda::ExpertGroupBuffers buffers;
    buffers.set_tensor_cores(false);
    buffers.run(index, dev, x.data(), c.hidden, c.inter, cuda_cores.data(), stream);
    CHECK_CUDA(cudaStreamSynchronize(stream));
  }
  // The same request as the CUDA backend runs a VRAM-tier miss: expert positions 0, 3, .. in
  // phase 0, 1, 4, .. in phase 1, and 2, 5, .. computed on the host (the oracle's y rows).
  std::vector<float> phased(x.size(), std::nanf(""));
  {
    const size_t n = index.experts.size();
    std::vector<DeviceExpert> phases(2 * n);
    std::vector<int32_t> host;
    for (size_t i = 0; i < n; ++i) {
      if (i % 3 == 2)
        host.push_back(int32_t(i));
      else
        phases[(i % 3) * n + i] = dev[i];
    }
    colibri::cuda::ExpertGroupBuffers buffers;
    buffers.stage(index, phases, 2, x.data(), c.hidden, c.inter, stream);
    const colibri::cuda::ExpertGroup& g = buffers.group();
    CHECK_CUDA(cudaMemsetAsync(g.y_slots, 0xff, size_t(g.n_slots * g.hidden) * 4, stream));
    buffers.project(0, stream);
    buffers.project(1, stream);
    for (int32_t i : host) {
      const int e = (index.experts[size_t(i)] - 1) / 3;
      for (int32_t s = index.expert_begin[size_t(i)]; s < index.expert_begin[size_t(i) + 1]; ++s)
        std::copy_n(y_cpu[size_t(index.slot_row[size_t(s)] * c.n_experts + e)].data(), c.hidden,
                    buffers.host_y() + size_t(s) * size_t(c.hidden));
    }
    buffers.finish(host, phased.data(), stream);
    CHECK_CUDA(cudaStreamSynchronize(stream));
    EXPECT_THROW(buffers.project(2, stream), std::invalid_argument);
  }
  CHECK_CUDA(cudaStreamDestroy(stream));

  double max_ratio = 0, sum_abs = 0;
  for (int r = 0; r < c.n_rows; ++r)
    for (int64_t j = 0; j < c.hidden; ++j) {
      const size_t i = size_t(r * c.hidden + j);
      ASSERT_TRUE(std::isfinite(got[i])) << "out[" << r << ", " << j << "] not written";
      ASSERT_TRUE(std::isfinite(phased[i])) << "phased out[" << r << ", " << j << "] not written";
      ASSERT_LE(std::fabs(double(cuda_cores[i]) - expected[i]), bound[i])
          << "CUDA cores out[" << r << ", " << j << "]: gpu " << cuda_cores[i] << " cpu "
          << expected[i];
      ASSERT_LE(std::fabs(double(phased[i]) - expected[i]), bound[i])
          << "phased out[" << r << ", " << j << "]: gpu " << phased[i] << " cpu " << expected[i];
      const double err = std::fabs(double(got[i]) - expected[i]);
      ASSERT_LE(err, bound[i]) << "out[" << r << ", " << j << "]: gpu " << got[i] << " cpu "
                               << expected[i];
      if (bound[i] > 0) max_ratio = std::max(max_ratio, err / bound[i]);
      sum_abs += std::fabs(got[i]);
      if (r == 1 && c.n_rows >= 3) {
        ASSERT_EQ(got[i], 0.0f) << "a row without experts";
      }
    }
  EXPECT_GT(sum_abs, 0.0) << "all-zero output: the comparison proved nothing";
  RecordProperty("max_error_over_bound", std::to_string(max_ratio));
}

// Formats: int4 in every group size the wide path takes (32, 64, 96, 128, 256) and two it does
// not (16, 48: the per-element path), int4 and int8 per row, fp32. Shapes: multiples of 32
// (wide; 288 and 96 end in a short group), odd or small widths (per-element path, int4 padding
// nibble), GLM-5.2's hidden width with a narrow inter. Rows: decode (1), remainders of the
// 1/2/4/8-slot passes (3, 5, 9), 16, and 33 (several 8-slot passes per expert). BF16: wide
// (widths % 8 == 0) and per-element. Every case also runs phased (two device phases and experts
// whose y rows come from the host), as the CUDA backend runs a request with VRAM misses, and
// with the tensor cores off. NVFP4 (the CPU oracle: dequantize_nvfp4, then fp32): wide (widths %
// 32 == 0) at 1, 3 and 16 rows, and per-element (80 and 48). Tensor cores (int4, 8+ slots per
// expert): GLM-like g64 at 16 rows on 8 experts, g128, row scales, and a width (200) whose down
// matrix takes the per-row path inside the tensor-core launch and whose gate/up tiles end past the
// last row.
INSTANTIATE_TEST_SUITE_P(
    Table, ExpertFfnCuda,
    testing::Values(Case{WeightFormat::kInt4Grouped, 64, 256, 128, 1, 8, 8},
                    Case{WeightFormat::kInt4Grouped, 64, 256, 128, 16, 8, 4},
                    Case{WeightFormat::kInt4Grouped, 64, 512, 192, 33, 6, 2},
                    Case{WeightFormat::kInt4Grouped, 64, 6144, 64, 3, 4, 2},
                    Case{WeightFormat::kInt4Grouped, 64, 288, 96, 3, 4, 2},
                    Case{WeightFormat::kInt4Grouped, 32, 192, 96, 5, 3, 3},
                    Case{WeightFormat::kInt4Grouped, 96, 384, 96, 9, 4, 2},
                    Case{WeightFormat::kInt4Grouped, 128, 256, 256, 2, 2, 1},
                    Case{WeightFormat::kInt4Grouped, 256, 512, 256, 4, 5, 3},
                    Case{WeightFormat::kInt4Grouped, 16, 160, 80, 3, 3, 2},
                    Case{WeightFormat::kInt4Grouped, 48, 200, 99, 5, 4, 2},
                    Case{WeightFormat::kInt4Row, 0, 256, 128, 1, 4, 4},
                    Case{WeightFormat::kInt4Row, 0, 257, 45, 8, 4, 2},
                    Case{WeightFormat::kInt8Row, 0, 256, 112, 1, 4, 2},
                    Case{WeightFormat::kInt8Row, 0, 300, 100, 16, 4, 2},
                    Case{WeightFormat::kF32, 0, 128, 96, 1, 4, 2},
                    Case{WeightFormat::kF32, 0, 66, 35, 9, 3, 2},
                    Case{WeightFormat::kInt4Grouped, 64, 1024, 512, 16, 8, 8},
                    Case{WeightFormat::kInt4Grouped, 128, 256, 192, 12, 3, 2},
                    Case{WeightFormat::kInt4Grouped, 64, 320, 200, 24, 3, 3},
                    Case{WeightFormat::kInt4Row, 0, 512, 256, 16, 4, 4},
                    Case{WeightFormat::kBF16, 0, 256, 128, 1, 8, 8},
                    Case{WeightFormat::kBF16, 0, 512, 192, 16, 6, 2},
                    Case{WeightFormat::kBF16, 0, 66, 35, 9, 3, 2},
                    Case{WeightFormat::kNvfp4, 0, 256, 128, 1, 8, 8},
                    Case{WeightFormat::kNvfp4, 0, 512, 192, 16, 6, 2},
                    Case{WeightFormat::kNvfp4, 0, 6144, 64, 3, 4, 2},
                    Case{WeightFormat::kNvfp4, 0, 80, 48, 9, 3, 2},
                    // Zero points: Kimi's groups of 32 (wide), decode and a batch; g64 and row
                    // scales on tensor cores (16 rows on 4 experts: 8+ slots each); g128 with
                    // tiles ending past the last row; groups of 48 and odd widths (the
                    // per-element path, int4 padding nibble).
                    Case{WeightFormat::kInt4Grouped, 32, 256, 96, 1, 8, 8, true},
                    Case{WeightFormat::kInt4Grouped, 32, 192, 96, 5, 3, 3, true},
                    Case{WeightFormat::kInt4Grouped, 64, 256, 128, 16, 4, 4, true},
                    Case{WeightFormat::kInt4Row, 0, 512, 256, 16, 4, 4, true},
                    Case{WeightFormat::kInt4Grouped, 128, 256, 200, 12, 3, 2, true},
                    Case{WeightFormat::kInt4Grouped, 48, 200, 99, 5, 4, 2, true},
                    Case{WeightFormat::kInt4Row, 0, 257, 45, 8, 4, 2, true}),
    [](const testing::TestParamInfo<Case>& param_info) {
      std::ostringstream name;
      name << param_info.param;
      return name.str();
    });

// The slot index: grouped by ascending expert, rows' slots ascending, duplicates refused.
TEST(ExpertGroupIndex, GroupsPairsByExpertAndOrdersEachRow) {
  const std::vector<colibri::cuda::ExpertPair> pairs = {
      {0, 9, 0.5f}, {0, 2, 0.25f}, {1, 9, 1.0f}, {2, 4, 0.125f}, {2, 2, 2.0f}};
  const auto index = colibri::cuda::index_pairs(3, pairs);
  EXPECT_EQ(index.experts, (std::vector<int32_t>{2, 4, 9}));
  EXPECT_EQ(index.expert_begin, (std::vector<int32_t>{0, 2, 3, 5}));
  EXPECT_EQ(index.slot_row, (std::vector<int32_t>{0, 2, 2, 0, 1}));
  EXPECT_EQ(index.row_begin, (std::vector<int32_t>{0, 2, 3, 5}));
  EXPECT_EQ(index.row_slots, (std::vector<int32_t>{0, 3, 4, 1, 2}));
  EXPECT_EQ(index.row_weights, (std::vector<float>{0.25f, 0.5f, 1.0f, 2.0f, 0.125f}));
  EXPECT_EQ(index.max_slots_per_expert, 2);
  const std::vector<colibri::cuda::ExpertPair> twice = {{0, 3, 1.0f}, {0, 3, 1.0f}};
  EXPECT_THROW(colibri::cuda::index_pairs(1, twice), std::invalid_argument);
  const std::vector<colibri::cuda::ExpertPair> outside = {{2, 3, 1.0f}};
  EXPECT_THROW(colibri::cuda::index_pairs(2, outside), std::invalid_argument);
}

}  // namespace
