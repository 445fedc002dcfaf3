// What the CUDA coordinator uploads, prepared on the host (coordinator/gpu_staging.h): the block
// table of a batch gives every key position the slot KvManager gives it, weights in every stored
// form convert to the BF16 of their values, and NVFP4 ones stay as stored. Runs without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "common/buffer.h"
#include "common/dtype.h"
#include "common/error.h"
#include "coordinator/gpu_staging.h"
#include "cpu/linear.h"
#include "cpu/quant.h"

namespace colibri {
namespace {

TEST(PackBlockTable, EveryKeyPositionMapsToTheKvManagersSlot) {
  ModelConfig config;
  config.num_layers = 1;
  config.kv_lora_rank = 4;
  config.qk_rope_head_dim = 2;
  config.max_position_embeddings = 1024;
  config.layer_is_moe = {false};
  KvManager kv(config, 256, 3, 4);
  const int a = kv.open(), b = kv.open(), c = kv.open();
  // Interleaved growth, so that each sequence's blocks are scattered over the pool.
  for (int len = 3; len <= 30; len += 3) {
    kv.reserve(a, len);
    kv.reserve(b, std::min(len, 11));
    kv.reserve(c, std::min(len + 1, 26));
  }
  Batch batch;
  for (int p = 20; p < 30; ++p) batch.add(a, 0, p, p == 29);  // a prefill chunk
  batch.add(b, 0, 10, true);                                  // a decode row
  for (int p = 0; p < 26; ++p) batch.add(c, 0, p, false);     // a whole prompt
  const BlockTable table = pack_block_table(batch, kv);
  EXPECT_EQ(table.block_tokens, 4);
  EXPECT_EQ(table.max_keys, 30);
  EXPECT_EQ(table.max_blocks, std::max({kv.blocks(a), kv.blocks(b), kv.blocks(c)}));
  ASSERT_EQ(table.blocks.size(), 3u * size_t(table.max_blocks));
  ASSERT_EQ(table.row_seq.size(), size_t(batch.size()));
  for (int t = 0; t < batch.size(); ++t) {
    const BatchRow& row = batch.rows[size_t(t)];
    EXPECT_EQ(table.row_pos[size_t(t)], row.pos);
    EXPECT_EQ(table.row_slot[size_t(t)], kv.slot(row.seq, row.pos));
    const int* blocks = &table.blocks[size_t(table.row_seq[size_t(t)]) * table.max_blocks];
    for (int p = 0; p <= row.pos; ++p)
      ASSERT_EQ(blocks[p / 4] * 4 + p % 4, kv.slot(row.seq, p)) << "row " << t << " key " << p;
  }
  EXPECT_EQ(table.row_seq.front(), 0);
  EXPECT_EQ(table.row_seq[10], 1);
  EXPECT_EQ(table.row_seq.back(), 2);
  // Table rows shorter than the longest are padded with -1.
  EXPECT_EQ(table.blocks[size_t(table.max_blocks) + size_t(kv.blocks(b))], -1);
}

std::vector<float> random_values(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

TEST(MatrixToBf16, Fp32AndBf16) {
  Matrix w;
  w.rows = 3;
  w.cols = 5;
  w.data = random_values(15, 1);
  const std::vector<uint16_t> bf16 = matrix_to_bf16(w);
  ASSERT_EQ(bf16.size(), 15u);
  for (size_t i = 0; i < 15; ++i) EXPECT_EQ(bf16[i], f32_to_bf16(w.data[i]));
  Matrix stored;
  stored.rows = 3;
  stored.cols = 5;
  stored.bf16 = bf16;
  EXPECT_EQ(matrix_to_bf16(stored), bf16);
}

TEST(MatrixToBf16, Fp8WithBlockScales) {
  Matrix w;
  w.rows = 4;
  w.cols = 6;
  w.fp8.block_rows = 2;
  w.fp8.block_cols = 4;
  w.fp8.bits.resize(24);
  for (size_t i = 0; i < 24; ++i) w.fp8.bits[i] = uint8_t((i * 37 + 5) & 0x7e);  // no NaN
  w.fp8.scales = {0.5f, 2.0f, 0.25f, 3.0f};  // [2 block rows, 2 block cols]
  const std::vector<uint16_t> bf16 = matrix_to_bf16(w);
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 6; ++j) {
      const float value = fp8_e4m3_to_f32(w.fp8.bits[size_t(i * 6 + j)]) *
                          w.fp8.scales[size_t((i / 2) * 2 + j / 4)];
      EXPECT_EQ(bf16[size_t(i * 6 + j)], f32_to_bf16(value)) << i << "," << j;
    }
}

TEST(MatrixToBf16, ContainerInt8AndInt4) {
  for (const kernels::QuantFormat format :
       {kernels::QuantFormat::kInt8Row, kernels::QuantFormat::kInt4Row}) {
    const int64_t rows = 3, cols = 64;
    const std::vector<float> values = random_values(size_t(rows * cols), 2);
    Matrix w;
    w.rows = rows;
    w.cols = cols;
    w.quant.format = format;
    w.quant.rows = rows;
    w.quant.cols = cols;
    w.quant.data.resize(size_t(rows * kernels::row_bytes(format, cols)));
    w.quant.scales.resize(size_t(kernels::scale_count(format, rows, cols, 0)));
    kernels::quantize(format, 0, values.data(), rows, cols, w.quant.data.data(),
                      w.quant.scales.data());
    std::vector<float> dequantized(values.size());
    kernels::dequantize(w.quant.view(), dequantized.data());
    const std::vector<uint16_t> bf16 = matrix_to_bf16(w);
    for (size_t i = 0; i < values.size(); ++i) EXPECT_EQ(bf16[i], f32_to_bf16(dequantized[i]));
  }
}

TEST(KeepsFp32OnDevice, OnlyFp32ValuesThatAreNotBf16) {
  Matrix w;
  w.rows = 2;
  w.cols = 8;
  w.data = random_values(16, 3);
  EXPECT_TRUE(keeps_fp32_on_device(w));  // random fp32: not BF16 values
  for (float& v : w.data) v = bf16_to_f32(f32_to_bf16(v));
  EXPECT_FALSE(keeps_fp32_on_device(w));  // a BF16 checkpoint loaded in fp32
  w.data[5] = std::nextafter(w.data[5], 10.0f);
  EXPECT_TRUE(keeps_fp32_on_device(w));  // one value off the BF16 grid
  Matrix stored;
  stored.rows = 2;
  stored.cols = 8;
  stored.bf16.assign(16, f32_to_bf16(1.5f));
  EXPECT_FALSE(keeps_fp32_on_device(stored));
}

TEST(MatrixToBf16, EmptyIsAnError) {
  EXPECT_THROW(matrix_to_bf16(Matrix{}), Error);
}

// NVFP4 goes to the device as stored (codes and block scales), unless widened (the embedding
// table, kv_b_proj), then as the BF16 of its dequantized values; every other weight BF16, or
// fp32 when its values are not BF16 values.
TEST(DeviceWeightForm, Nvfp4AsStoredUnlessWidened) {
  const int64_t rows = 4, cols = 48;
  const std::vector<float> values = random_values(size_t(rows * cols), 4);
  Matrix w;
  w.rows = rows;
  w.cols = cols;
  w.nvfp4.codes.resize(size_t(rows * cols / 2));
  w.nvfp4.scales.resize(size_t(rows * cols / 16));
  w.nvfp4.global = kernels::quantize_nvfp4(values.data(), rows, cols, w.nvfp4.codes.data(),
                                           w.nvfp4.scales.data());
  ASSERT_EQ(w.format(), WeightFormat::kNvfp4);
  EXPECT_EQ(device_weight_form(w), DeviceWeightForm::kNvfp4);
  EXPECT_EQ(device_weight_bytes(w), uint64_t(rows * cols / 2 + rows * cols / 16));
  EXPECT_EQ(device_weight_form(w, true), DeviceWeightForm::kBf16);
  EXPECT_EQ(device_weight_bytes(w, true), uint64_t(2 * rows * cols));
  // Widened, the BF16 of the CPU's dequantization.
  std::vector<float> dequantized(values.size());
  kernels::dequantize_nvfp4(
      {w.nvfp4.codes.data(), w.nvfp4.scales.data(), w.nvfp4.global, rows, cols},
      dequantized.data());
  const std::vector<uint16_t> bf16 = matrix_to_bf16(w);
  for (size_t i = 0; i < values.size(); ++i) EXPECT_EQ(bf16[i], f32_to_bf16(dequantized[i]));

  Matrix f32;
  f32.rows = 2;
  f32.cols = 8;
  f32.data = random_values(16, 5);
  EXPECT_EQ(device_weight_form(f32), DeviceWeightForm::kF32);
  EXPECT_EQ(device_weight_bytes(f32), 64u);
  for (float& v : f32.data) v = bf16_to_f32(f32_to_bf16(v));
  EXPECT_EQ(device_weight_form(f32), DeviceWeightForm::kBf16);
  EXPECT_EQ(device_weight_bytes(f32), 32u);
  EXPECT_EQ(device_weight_bytes(Matrix{}), 0u);
}

}  // namespace
}  // namespace colibri
