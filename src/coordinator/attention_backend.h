// The attention seam of the engine: MLA attention with the DSA indexer over the KV blocks of
// every sequence in a batch, as CpuCompute runs it (coordinator_compute.h); the CUDA compute
// holds its own attention with the blocks in VRAM (cuda_compute.h).
#pragma once

#include "coordinator/batch.h"
#include "model/weights.h"

namespace colibri {

class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;

  // Start of a forward call: the KV blocks of every row are reserved; the indexer's key
  // selection (carried from full to shared indexer layers) starts empty.
  virtual void begin(const Batch& batch) = 0;
  // x: [n, hidden] input_layernorm output of the batch rows. Writes the rows' keys into their
  // sequences' blocks and out [n, hidden]; each row attends to its own sequence's positions
  // 0..pos only (or the indexer's choice of them).
  virtual void forward(int layer, const AttentionWeights& w, const float* x, float* out) = 0;
};

}  // namespace colibri
