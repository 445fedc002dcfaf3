// Host-side preparation of what the CUDA coordinator uploads (cuda_compute.h), kept apart from
// CUDA so that it is built and tested everywhere: which form each weight takes on the device
// (NVFP4 as stored, BF16 or fp32), weights as BF16, and the KV block table of a batch.
#pragma once

#include <cstdint>
#include <vector>

#include "coordinator/batch.h"
#include "coordinator/kv_manager.h"
#include "model/weights.h"

namespace colibri {

// How the CUDA coordinator holds a product weight on the device:
//   kNvfp4: an NVFP4 weight as stored, its E2M1 codes and E4M3 block scales (and the global scale
//           in its description), widened in registers by cuda::matrix_linear;
//   kF32:   fp32 values that are not all BF16 values (an fp32 checkpoint), products in fp32;
//   kBf16:  every other weight, as matrix_to_bf16 gives it (BF16 as stored; fp32 values that are
//           BF16 values, FP8 and container int8/int4 converted).
// `widen`: BF16 or fp32 whatever W is stored as, for what reads W other than through a product
// (the embedding table's rows) or per head through cuBLAS (kv_b_proj in the absorbed attention;
// the loader dequantizes an NVFP4 kv_b_proj already).
enum class DeviceWeightForm { kBf16, kF32, kNvfp4 };
DeviceWeightForm device_weight_form(const Matrix& w, bool widen = false);
// The bytes W takes on the device in that form (NVFP4: codes and block scales; 0 when empty).
uint64_t device_weight_bytes(const Matrix& w, bool widen = false);

// W as BF16 bits [rows, cols], rounded to nearest even from its value as stored: fp32, BF16
// (copied), FP8 with its block scales, NVFP4 or a container's int8/int4 (dequantized first).
// Keeping int8 rows with their scales on the GPU is future work.
std::vector<uint16_t> matrix_to_bf16(const Matrix& w);

// Whether W goes to the device in fp32: it is held in fp32 and some value is not a BF16 value (an
// fp32 checkpoint). Otherwise the device holds it as BF16 (exactly, for fp32 values that are
// BF16 values, as a BF16 checkpoint loaded in fp32 has).
bool keeps_fp32_on_device(const Matrix& w);

// The KV slots of a batch for a device: the block ids of each sequence in the batch, one table
// row per sequence ([seqs, max_blocks], -1 past its blocks), and per batch row its table row,
// position and slot. Key position p of row t is in slot
// blocks[row_seq[t] * max_blocks + p / block_tokens] * block_tokens + p % block_tokens.
struct BlockTable {
  int block_tokens = 0;
  int max_blocks = 0;
  int max_keys = 0;                             // most positions any row sees (largest pos + 1)
  std::vector<int> blocks;                      // [seqs, max_blocks]
  std::vector<int> row_seq, row_pos, row_slot;  // [n]
};

// Packs the table of `batch` (its blocks reserved in `kv`).
BlockTable pack_block_table(const Batch& batch, const KvManager& kv);

}  // namespace colibri
