#include "coordinator/gpu_staging.h"

#include <algorithm>
#include <cmath>

#include "common/buffer.h"
#include "common/dtype.h"
#include "common/error.h"
#include "cpu/linear.h"
#include "cpu/quant.h"

namespace colibri {

std::vector<uint16_t> matrix_to_bf16(const Matrix& w) {
  if (w.empty()) fail("an empty matrix has no BF16 form");
  const size_t count = size_t(w.rows) * size_t(w.cols);
  std::vector<uint16_t> out(count);
  switch (w.format()) {
    case WeightFormat::kF32:
      for (size_t i = 0; i < count; ++i) out[i] = f32_to_bf16(w.data[i]);
      break;
    case WeightFormat::kBF16:
      return w.bf16;
    case WeightFormat::kFp8Block: {
      const Fp8Matrix& f = w.fp8;
      const int64_t blocks_per_row = (w.cols + f.block_cols - 1) / f.block_cols;
      for (int64_t i = 0; i < w.rows; ++i)
        for (int64_t j = 0; j < w.cols; ++j) {
          const float scale =
              f.scales[size_t((i / f.block_rows) * blocks_per_row + j / f.block_cols)];
          out[size_t(i * w.cols + j)] =
              f32_to_bf16(fp8_e4m3_to_f32(f.bits[size_t(i * w.cols + j)]) * scale);
        }
      break;
    }
    case WeightFormat::kNvfp4: {
      std::vector<float> values(count);
      kernels::dequantize_nvfp4(
          {w.nvfp4.codes.data(), w.nvfp4.scales.data(), w.nvfp4.global, w.rows, w.cols},
          values.data());
      for (size_t i = 0; i < count; ++i) out[i] = f32_to_bf16(values[i]);
      break;
    }
    case WeightFormat::kInt8Row:
    case WeightFormat::kInt4Row:
    case WeightFormat::kInt4Grouped: {
      std::vector<float> values(count);
      kernels::dequantize(w.quant.view(), values.data());
      for (size_t i = 0; i < count; ++i) out[i] = f32_to_bf16(values[i]);
      break;
    }
  }
  return out;
}

bool keeps_fp32_on_device(const Matrix& w) {
  return std::any_of(w.data.begin(), w.data.end(),
                     [](float v) { return bf16_to_f32(f32_to_bf16(v)) != v && !std::isnan(v); });
}

DeviceWeightForm device_weight_form(const Matrix& w, bool widen) {
  if (w.format() == WeightFormat::kNvfp4 && !widen) return DeviceWeightForm::kNvfp4;
  return keeps_fp32_on_device(w) ? DeviceWeightForm::kF32 : DeviceWeightForm::kBf16;
}

uint64_t device_weight_bytes(const Matrix& w, bool widen) {
  if (w.empty()) return 0;
  const uint64_t elements = uint64_t(w.rows) * uint64_t(w.cols);
  switch (device_weight_form(w, widen)) {
    case DeviceWeightForm::kNvfp4:
      return w.nvfp4.codes.size() + w.nvfp4.scales.size();
    case DeviceWeightForm::kF32:
      return 4 * elements;
    case DeviceWeightForm::kBf16:
      return 2 * elements;
  }
  return 0;
}

BlockTable pack_block_table(const Batch& batch, const KvManager& kv) {
  BlockTable table;
  const int n = batch.size(), bt = kv.block_tokens();
  table.block_tokens = bt;
  table.row_seq.resize(size_t(n));
  table.row_pos.resize(size_t(n));
  table.row_slot.resize(size_t(n));
  std::vector<int> seqs;  // the batch's sequences in order; their rows are consecutive
  for (int t = 0; t < n; ++t) {
    const BatchRow& row = batch.rows[size_t(t)];
    if (seqs.empty() || seqs.back() != row.seq) seqs.push_back(row.seq);
    table.row_seq[size_t(t)] = int(seqs.size()) - 1;
    table.row_pos[size_t(t)] = row.pos;
    table.row_slot[size_t(t)] = kv.slot(row.seq, row.pos);
    table.max_keys = std::max(table.max_keys, row.pos + 1);
  }
  for (int seq : seqs) table.max_blocks = std::max(table.max_blocks, kv.blocks(seq));
  table.blocks.assign(seqs.size() * size_t(table.max_blocks), -1);
  for (size_t s = 0; s < seqs.size(); ++s)
    for (int b = 0; b < kv.blocks(seqs[s]); ++b)
      table.blocks[s * size_t(table.max_blocks) + size_t(b)] = kv.slot(seqs[s], b * bt) / bt;
  return table;
}

}  // namespace colibri
