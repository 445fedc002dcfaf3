// A routed expert as a gpu-expert rank's VRAM slot holds it (rank/expert_slot.h), laid out and
// packed on the host: every part where the layout says, 256-byte aligned and apart; a container's
// bytes and scales in rows whatever their layout in RAM; an asymmetric int4 checkpoint's zero
// points (fp32 offsets) after each matrix's scales, in row order; and the refusals. Runs without
// a GPU (the CUDA backend's use of it is checked on one by tests/gpu/cuda_expert_backend_test).
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "cpu/quant.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/container.h"
#include "model/weights.h"
#include "rank/expert_slot.h"

namespace colibri {
namespace {

QuantMatrix random_quant(kernels::QuantFormat format, int group, int64_t rows, int64_t cols,
                         bool zero_points, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> values(size_t(rows * cols));
  for (float& v : values) v = uniform(rng);
  QuantMatrix q;
  q.format = format;
  q.rows = rows;
  q.cols = cols;
  q.group_size = group;
  q.data.resize(size_t(kernels::packed_bytes(format, rows, cols)));
  q.scales.resize(size_t(kernels::scale_count(format, rows, cols, group)));
  kernels::quantize(format, group, values.data(), rows, cols, q.data.data(), q.scales.data());
  if (zero_points) {
    std::uniform_int_distribution<int> zp(-8, 7);
    q.offsets.resize(q.scales.size());
    for (size_t i = 0; i < q.offsets.size(); ++i) q.offsets[i] = float(-zp(rng)) * q.scales[i];
  }
  return q;
}

MlpWeights quant_expert(kernels::QuantFormat format, int group, int64_t hidden, int64_t inter,
                        bool zero_points, uint32_t seed) {
  MlpWeights e;
  e.quant.gate = random_quant(format, group, inter, hidden, zero_points, seed);
  e.quant.up = random_quant(format, group, inter, hidden, zero_points, seed + 1);
  e.quant.down = random_quant(format, group, hidden, inter, zero_points, seed + 2);
  return e;
}

const QuantMatrix& quant_of(const MlpWeights& e, size_t m) {
  return m == 0 ? e.quant.gate : m == 1 ? e.quant.up : e.quant.down;
}

// Every part starts at a multiple of 256, follows the previous one, and fits the slot.
void expect_parts_apart(const ExpertSlotLayout& layout) {
  uint64_t end = 0;
  for (const SlotMatrix& s : layout.matrices) {
    for (const auto& [at, bytes] :
         {std::pair{s.data_at, s.data_bytes}, std::pair{s.scales_at, s.scale_bytes},
          std::pair{s.offsets_at, s.offset_bytes}}) {
      EXPECT_EQ(at % kSlotAlign, 0u);
      EXPECT_GE(at, end);
      end = at + bytes;
    }
  }
  EXPECT_LE(end, layout.bytes);
  EXPECT_EQ(layout.bytes % kSlotAlign, 0u);
}

TEST(ExpertSlot, ZeroPointsFollowEachMatrixsScalesInRowOrder) {
  // Kimi-K2-Thinking's groups of 32 at small odd-sized shapes (the last group of down is short).
  const int64_t hidden = 96, inter = 80;
  const MlpWeights e = quant_expert(kernels::QuantFormat::kInt4Grouped, 32, hidden, inter, true, 5);
  const ExpertSlotLayout layout = expert_slot_layout(e);
  expect_parts_apart(layout);
  for (size_t m = 0; m < 3; ++m) {
    const SlotMatrix& s = layout.matrices[m];
    const QuantMatrix& q = quant_of(e, m);
    EXPECT_EQ(s.format, WeightFormat::kInt4Grouped);
    EXPECT_EQ(s.group_size, 32);
    EXPECT_EQ(s.rows, q.rows);
    EXPECT_EQ(s.cols, q.cols);
    EXPECT_EQ(s.data_bytes, q.data.size());
    EXPECT_EQ(s.scale_bytes, 4 * q.scales.size());
    // [rows, ceil(cols / 32)] fp32, laid out as the scales.
    EXPECT_EQ(s.offset_bytes, uint64_t(4 * q.rows * ((q.cols + 31) / 32)));
    EXPECT_TRUE(s.has_zero_points());
    EXPECT_GT(s.offsets_at, s.scales_at);
  }
  std::vector<std::byte> slot(layout.bytes, std::byte{0xAB});
  pack_expert_slot(layout, e, 3, 17, slot.data());
  for (size_t m = 0; m < 3; ++m) {
    const SlotMatrix& s = layout.matrices[m];
    const QuantMatrix& q = quant_of(e, m);
    EXPECT_EQ(std::memcmp(slot.data() + s.data_at, q.data.data(), q.data.size()), 0) << m;
    EXPECT_EQ(std::memcmp(slot.data() + s.scales_at, q.scales.data(), 4 * q.scales.size()), 0) << m;
    EXPECT_EQ(std::memcmp(slot.data() + s.offsets_at, q.offsets.data(), 4 * q.offsets.size()), 0)
        << m;
  }
  // A symmetric expert's slot has no offsets part and is smaller.
  const MlpWeights symmetric =
      quant_expert(kernels::QuantFormat::kInt4Grouped, 32, hidden, inter, false, 5);
  const ExpertSlotLayout plain = expert_slot_layout(symmetric);
  for (const SlotMatrix& s : plain.matrices) EXPECT_FALSE(s.has_zero_points());
  EXPECT_LT(plain.bytes, layout.bytes);
}

TEST(ExpertSlot, PerRowZeroPointsAreOneOffsetARow) {
  const MlpWeights e = quant_expert(kernels::QuantFormat::kInt4Row, 0, 64, 45, true, 9);
  const ExpertSlotLayout layout = expert_slot_layout(e);
  expect_parts_apart(layout);
  EXPECT_EQ(layout.matrices[0].offset_bytes, 4u * 45);
  EXPECT_EQ(layout.matrices[2].offset_bytes, 4u * 64);
}

TEST(ExpertSlot, TiledContainerBytesArePackedInRows) {
  // An int8 expert whose matrices the CPU keeps in 8-row tiles: the slot holds rows, as stored.
  const MlpWeights stored = quant_expert(kernels::QuantFormat::kInt8Row, 0, 128, 64, false, 13);
  MlpWeights tiled = stored;
  for (QuantMatrix* q : {&tiled.quant.gate, &tiled.quant.up, &tiled.quant.down})
    set_layout(*q, kernels::QuantLayout::kTiles);
  ASSERT_NE(std::memcmp(tiled.quant.gate.data.data(), stored.quant.gate.data.data(),
                        stored.quant.gate.data.size()),
            0)
      << "the tiles layout is not a different order: the test proves nothing";
  const ExpertSlotLayout layout = expert_slot_layout(stored);
  std::vector<std::byte> from_rows(layout.bytes), from_tiles(layout.bytes);
  pack_expert_slot(layout, stored, 0, 0, from_rows.data());
  pack_expert_slot(layout, tiled, 0, 0, from_tiles.data());
  for (const SlotMatrix& s : layout.matrices) {
    EXPECT_EQ(
        std::memcmp(from_rows.data() + s.data_at, from_tiles.data() + s.data_at, s.data_bytes), 0);
    EXPECT_EQ(
        std::memcmp(from_rows.data() + s.scales_at, from_tiles.data() + s.scales_at, s.scale_bytes),
        0);
  }
}

TEST(ExpertSlot, DenseAndNvfp4ExpertsHaveTheirStoredParts) {
  MlpWeights bf16;
  for (Matrix* m : {&bf16.gate, &bf16.up, &bf16.down}) {
    m->rows = m == &bf16.down ? 32 : 48;
    m->cols = m == &bf16.down ? 48 : 32;
    m->bf16.assign(size_t(m->rows * m->cols), 0x3F80);
  }
  const ExpertSlotLayout dense = expert_slot_layout(bf16);
  expect_parts_apart(dense);
  for (const SlotMatrix& s : dense.matrices) {
    EXPECT_EQ(s.format, WeightFormat::kBF16);
    EXPECT_EQ(s.data_bytes, uint64_t(2 * s.rows * s.cols));
    EXPECT_EQ(s.scale_bytes, 0u);
    EXPECT_EQ(s.offset_bytes, 0u);
  }
  MlpWeights nvfp4;
  for (Matrix* m : {&nvfp4.gate, &nvfp4.up, &nvfp4.down}) {
    m->rows = 32;
    m->cols = 64;
    m->nvfp4.codes.assign(size_t(32 * 32), 0x21);
    m->nvfp4.scales.assign(size_t(32 * 4), 0x38);
    m->nvfp4.global = 0.5f;
  }
  const ExpertSlotLayout fp4 = expert_slot_layout(nvfp4);
  expect_parts_apart(fp4);
  std::vector<std::byte> slot(fp4.bytes);
  pack_expert_slot(fp4, nvfp4, 0, 0, slot.data());
  for (const SlotMatrix& s : fp4.matrices) {
    EXPECT_EQ(s.format, WeightFormat::kNvfp4);
    EXPECT_EQ(s.data_bytes, 32u * 32);
    EXPECT_EQ(s.scale_bytes, 32u * 4);
    EXPECT_EQ(s.offset_bytes, 0u);
    EXPECT_EQ(slot[s.data_at], std::byte{0x21});
    EXPECT_EQ(slot[s.scales_at + s.scale_bytes - 1], std::byte{0x38});
  }
}

TEST(ExpertSlot, ExpertsUnlikeTheFirstAndFp8AreRefusedWithTheirNames) {
  const MlpWeights with = quant_expert(kernels::QuantFormat::kInt4Grouped, 32, 64, 64, true, 1);
  const MlpWeights without = quant_expert(kernels::QuantFormat::kInt4Grouped, 32, 64, 64, false, 1);
  const ExpertSlotLayout layout = expert_slot_layout(with);
  std::vector<std::byte> slot(layout.bytes);
  try {
    pack_expert_slot(layout, without, 4, 11, slot.data());
    FAIL() << "an expert without zero points packed into a slot laid out with them";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("layer 4 expert 11 gate_proj"), std::string::npos) << what;
    EXPECT_NE(what.find("zero points"), std::string::npos) << what;
  }
  const MlpWeights other_group =
      quant_expert(kernels::QuantFormat::kInt4Grouped, 64, 64, 64, true, 1);
  EXPECT_THROW(pack_expert_slot(layout, other_group, 0, 0, slot.data()), Error);
  MlpWeights fp8;
  for (Matrix* m : {&fp8.gate, &fp8.up, &fp8.down}) {
    m->rows = m->cols = 16;
    m->fp8.block_rows = m->fp8.block_cols = 16;
    m->fp8.bits.assign(256, 0x38);
    m->fp8.scales.assign(1, 1.0f);
  }
  try {
    expert_slot_layout(fp8);
    FAIL() << "an FP8 expert laid out for the CUDA kernels";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no CUDA kernel yet"), std::string::npos) << e.what();
  }
}

// The committed asymmetric fixture (compressed-tensors W4A16, symmetric false, groups of 32) as
// the engine loads it: its routed experts' slots carry their loaded offsets.
TEST(ExpertSlot, AsymmetricCheckpointsExpertsCarryTheirOffsets) {
  const std::filesystem::path dir =
      std::filesystem::path(COLIBRI_TEST_DATA) / "parity" / "kimi_w4a16_asym" / "model";
  const ModelConfig config = load_model_config(dir);
  const Checkpoint checkpoint(dir, config.fp8_block);
  LoadOptions load;
  load.keep_stored = true;
  const ModelWeights weights = load_model_weights(config, checkpoint, load);
  const MlpWeights& expert = weights.layers.back().experts.front();
  ASSERT_TRUE(expert.quantized());
  ASSERT_TRUE(expert.quant.gate.has_zero_points());
  const ExpertSlotLayout layout = expert_slot_layout(expert);
  expect_parts_apart(layout);
  std::vector<std::byte> slot(layout.bytes);
  pack_expert_slot(layout, expert, int(weights.layers.size()) - 1, 0, slot.data());
  for (size_t m = 0; m < 3; ++m) {
    const QuantMatrix& q = quant_of(expert, m);
    const SlotMatrix& s = layout.matrices[m];
    ASSERT_EQ(s.offset_bytes, 4 * q.offsets.size());
    std::vector<float> offsets(q.offsets.size());
    std::memcpy(offsets.data(), slot.data() + s.offsets_at, s.offset_bytes);
    EXPECT_EQ(offsets, std::vector<float>(q.offsets.begin(), q.offsets.end())) << m;
    bool nonzero = false;
    for (float o : offsets) nonzero = nonzero || o != 0.0f;
    EXPECT_TRUE(nonzero) << "all-zero offsets: the fixture's zero points did not load";
  }
}

}  // namespace
}  // namespace colibri
