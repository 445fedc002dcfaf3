#include "rank/expert_slot.h"

#include <cstring>

#include "common/error.h"

namespace colibri {
namespace {

uint64_t padded(uint64_t bytes) {
  return (bytes + kSlotAlign - 1) / kSlotAlign * kSlotAlign;
}

// The host bytes of one matrix of an expert: `quant` (a container's) when set, else `dense`.
struct HostMatrix {
  WeightFormat format;
  int group_size;
  int64_t rows, cols;
  const void* data;
  uint64_t data_bytes;
  const void* scales;
  uint64_t scale_bytes;
  const float* offsets;
  uint64_t offset_bytes;
  const QuantMatrix* quant;  // set for a container matrix (copied back to rows when in tiles)
};

HostMatrix host_matrix(const Matrix& dense, const QuantMatrix& quant) {
  const QuantMatrix& q = quant.empty() ? dense.quant : quant;
  const WeightFormat format = q.empty() ? dense.format() : weight_format(q.format);
  if (format == WeightFormat::kFp8Block)
    fail(
        "{} routed experts have no CUDA kernel yet: convert the checkpoint to a container "
        "(colibri-convert) or run the experts on the CPU",
        weight_format_name(format));
  if (!q.empty()) {
    // Zero points are int4's (QuantMatrix); the kernels add them for int4 alone.
    if (q.has_zero_points() && q.format == kernels::QuantFormat::kInt8Row)
      fail(
          "{} routed experts with zero points (compressed-tensors INT4, symmetric false) have no "
          "CUDA kernel: convert the checkpoint (colibri-convert requantizes them symmetric) or run "
          "the experts on the CPU",
          weight_format_name(format));
    return {format,
            q.group_size,
            q.rows,
            q.cols,
            q.data.data(),
            q.data.size(),
            q.scales.data(),
            4 * q.scales.size(),
            q.offsets.data(),
            4 * q.offsets.size(),
            &q};
  }
  if (format == WeightFormat::kNvfp4)
    return {format,
            0,
            dense.rows,
            dense.cols,
            dense.nvfp4.codes.data(),
            dense.nvfp4.codes.size(),
            dense.nvfp4.scales.data(),
            dense.nvfp4.scales.size(),
            nullptr,
            0,
            nullptr};
  const void* data = format == WeightFormat::kBF16 ? static_cast<const void*>(dense.bf16.data())
                                                   : dense.data.data();
  const uint64_t bytes =
      format == WeightFormat::kBF16 ? 2 * dense.bf16.size() : 4 * dense.data.size();
  return {format, 0, dense.rows, dense.cols, data, bytes, nullptr, 0, nullptr, 0, nullptr};
}

std::array<HostMatrix, 3> host_matrices(const MlpWeights& w) {
  return {host_matrix(w.gate, w.quant.gate), host_matrix(w.up, w.quant.up),
          host_matrix(w.down, w.quant.down)};
}

}  // namespace

ExpertSlotLayout expert_slot_layout(const MlpWeights& expert) {
  const auto host = host_matrices(expert);
  ExpertSlotLayout layout;
  uint64_t at = 0;
  for (size_t m = 0; m < 3; ++m) {
    const HostMatrix& h = host[m];
    SlotMatrix& s = layout.matrices[m];
    s.format = h.format;
    s.group_size = h.group_size;
    s.rows = h.rows;
    s.cols = h.cols;
    s.data_at = at;
    s.data_bytes = h.data_bytes;
    at += padded(h.data_bytes);
    s.scales_at = at;
    s.scale_bytes = h.scale_bytes;
    at += padded(h.scale_bytes);
    s.offsets_at = at;
    s.offset_bytes = h.offset_bytes;
    at += padded(h.offset_bytes);
  }
  layout.bytes = at;
  return layout;
}

void pack_expert_slot(const ExpertSlotLayout& layout, const MlpWeights& expert, int layer,
                      int expert_id, std::byte* slot) {
  const auto host = host_matrices(expert);
  for (size_t m = 0; m < 3; ++m) {
    const HostMatrix& h = host[m];
    const SlotMatrix& l = layout.matrices[m];
    if (h.rows != l.rows || h.cols != l.cols)
      fail("layer {} expert {} {}: shape {}x{}, expected {}x{}", layer, expert_id,
           kExpertMatrixNames[m], h.rows, h.cols, l.rows, l.cols);
    if (h.format != l.format || h.group_size != l.group_size || h.data_bytes != l.data_bytes ||
        h.scale_bytes != l.scale_bytes || h.offset_bytes != l.offset_bytes)
      fail(
          "layer {} expert {} {}: stored as {} (group {}{}), unlike the first owned expert ({}, "
          "group {}{}); a rank's experts share one format",
          layer, expert_id, kExpertMatrixNames[m], weight_format_name(h.format), h.group_size,
          h.offset_bytes ? ", zero points" : "", weight_format_name(l.format), l.group_size,
          l.has_zero_points() ? ", zero points" : "");
    if (h.quant != nullptr && h.quant->layout != kernels::QuantLayout::kRows) {
      kernels::relayout(h.quant->view(), kernels::QuantLayout::kRows,
                        reinterpret_cast<uint8_t*>(slot + l.data_at),
                        reinterpret_cast<float*>(slot + l.scales_at));
    } else {
      std::memcpy(slot + l.data_at, h.data, h.data_bytes);
      if (h.scale_bytes) std::memcpy(slot + l.scales_at, h.scales, h.scale_bytes);
    }
    // Zero points are in row order whatever the layout of the bytes and scales.
    if (h.offset_bytes) std::memcpy(slot + l.offsets_at, h.offsets, h.offset_bytes);
  }
}

}  // namespace colibri
