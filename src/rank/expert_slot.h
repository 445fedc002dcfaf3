// One routed expert as a gpu-expert rank's VRAM slot holds it (rank/cuda_expert_backend.h): the
// layout of a slot and the packing of an expert's bytes into it, on the host and apart from CUDA,
// so that they are built and tested everywhere (tests/unit/expert_slot_test.cpp).
//
// A slot holds gate, up and down in that order, each as three parts, each part starting at a
// multiple of kSlotAlign bytes from the slot's start (its description points there):
//   data:    a container's packed bytes in rows (kernels::QuantLayout::kRows: a matrix held in
//            tiles is copied back to rows), BF16 bits, fp32 values, or NVFP4's E2M1 codes;
//   scales:  a container's fp32 scales in rows, or NVFP4's E4M3 block-scale bytes; none for BF16
//            and fp32;
//   offsets: an int4 matrix's zero points (compressed-tensors INT4 asymmetric), fp32
//            [rows, offset groups] in row order, laid out as its scales; none without.
// NVFP4's second-level scale is not in the slot: it travels in the kernels' description of the
// expert. Every expert of a rank shares the layout of the first one it owns.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "model/weight_format.h"
#include "model/weights.h"

namespace colibri {

inline constexpr uint64_t kSlotAlign = 256;

// One matrix of a slot: its format and shape, and where its parts lie (bytes from the slot's
// start; a part of 0 bytes is absent).
struct SlotMatrix {
  WeightFormat format = WeightFormat::kF32;
  int group_size = 0;  // kInt4Grouped; else 0
  int64_t rows = 0, cols = 0;
  uint64_t data_at = 0, data_bytes = 0;
  uint64_t scales_at = 0, scale_bytes = 0;
  uint64_t offsets_at = 0, offset_bytes = 0;
  bool has_zero_points() const { return offset_bytes > 0; }
};

struct ExpertSlotLayout {
  std::array<SlotMatrix, 3> matrices{};  // gate_proj, up_proj, down_proj
  uint64_t bytes = 0;                    // the slot: a multiple of kSlotAlign
};

inline constexpr const char* kExpertMatrixNames[3] = {"gate_proj", "up_proj", "down_proj"};

// The layout of a slot for `expert`'s formats and shapes (a container's matrices, or else its
// dense ones). An Error for a format the CUDA expert kernels do not read (FP8 blocks), naming it.
ExpertSlotLayout expert_slot_layout(const MlpWeights& expert);

// Copies `expert` into `slot` (host memory of layout.bytes) as the layout says; the padding
// between parts is left as it was. An Error naming layer, expert and matrix when the expert's
// format, group size, shape or zero points differ from the layout's.
void pack_expert_slot(const ExpertSlotLayout& layout, const MlpWeights& expert, int layer,
                      int expert_id, std::byte* slot);

}  // namespace colibri
