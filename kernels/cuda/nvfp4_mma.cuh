// NVFP4 x NVFP4 products on Blackwell's block-scaled FP4 tensor cores (mma.sync m16n8k64
// kind::mxf4nvf4, scale_vec::4X; cuda/nvfp4_mma_lanes.cuh has the fragment layouts). The
// activations are quantized on the device by the ModelOpt recipe (kernels::quantize_nvfp4, bit
// for bit: a per-tensor global scale from the amax, an E4M3 scale a 16 columns, E2M1 codes), then
// y = (sum over k of codes * scales, fp32 on the tensor cores) * w.global * x.global. x.global
// comes from each batch's amax, as the recipe makes a weight's; a checkpoint's static
// input_scale is not used (the CPU kernels do not use it either).
// Against the exact product of the dequantized operands the only difference is the order of the
// fp32 accumulation; against the fp32-activation path (matrix_linear) it adds the activations'
// FP4 rounding (W4A4). The instruction exists only in code built for sm_120a/sm_120f, which the
// build adds for nvfp4_mma.cu alone when nvcc has it; nvfp4_mma_supported() says whether the
// device runs that code. Compiled, never run on a GPU yet (no compute capability 12.x device
// has run it). Includable from plain C++.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/expert_ffn.cuh"

namespace colibri::cuda {

// Batches from this many rows of x take the MMA path when it is selected.
constexpr int64_t kNvfp4MmaMinRows = 16;

// Whether `device` (compute capability 12.x) runs this binary's block-scaled FP4 MMA code: a
// probe kernel from nvfp4_mma.cu reports whether the code the driver loaded for it was built
// with the instruction. Probed once per device (the first call synchronizes with it).
bool nvfp4_mma_supported(int device);

// COLIBRI_FP4_MMA=1 (read once) and nvfp4_mma_supported(the current device). When the variable
// is 1 and a device cannot, one line on stderr says why (once per process) and the answer is
// false. COLIBRI_FP4_MMA unset or 0: false, with no probe.
bool nvfp4_mma_selected();

// x [n, cols] (fp32, device) quantized as kernels::quantize_nvfp4(x, n, cols, ...) does, bit for
// bit: codes [n, cols / 2], scales [n, cols / 16], *global (device float). cols a positive
// multiple of 16; `amax_bits` one device uint32 of scratch. x finite. Asynchronous on `stream`.
void quantize_nvfp4_device(const float* x, int64_t n, int64_t cols, uint8_t* codes, uint8_t* scales,
                           float* global, uint32_t* amax_bits, cudaStream_t stream);

// Whether W can take the MMA path: kNvfp4, codes 4-byte aligned.
bool nvfp4_mma_fits(const DeviceMatrix& w);

// y [n, w.rows] = x [n, w.cols] . W^T with x already quantized (codes [n, w.cols / 2] 4-byte
// aligned, scales [n, w.cols / 16], *x_global on the device). Any cols that W allows (a multiple
// of 16: a partial last chunk of 64 is padded with zero codes). Throws std::invalid_argument when
// W does not fit and std::runtime_error when the current device does not run the MMA code.
void nvfp4_mma_product(const DeviceMatrix& w, const uint8_t* x_codes, const uint8_t* x_scales,
                       const float* x_global, int64_t n, float* y, cudaStream_t stream);

// Whether every expert of experts[0 .. count) that is not skipped (gate.data null) fits, gate,
// up and down alike, and at least one is not skipped: the grouped path's condition (host copies
// of the descriptions).
bool nvfp4_mma_fits(const DeviceExpert* experts, int64_t count);

// The grouped expert FFN's projections (expert_ffn_grouped_no_combine: h and y_slots of the
// experts not skipped) on the FP4 tensor cores, for a group whose experts fit (g.fp4_mma):
//   1. x [n_rows, hidden] quantized once (one global for the request);
//   2. gate and up of 16 rows against 8 slots at a time (each slot's row of x gathered),
//      h = silu(gate) * up rounded as the CUDA-core path rounds it; the amax of those h;
//   3. h [n_slots, inter] quantized with that amax (one global for the phase's slots);
//   4. down against the slots' quantized h.
// Stream-ordered scratch; throws std::runtime_error when the device does not run the MMA code.
void nvfp4_mma_expert_projections(const ExpertGroup& g, cudaStream_t stream);

// The two steps: quantize x (into stream-ordered scratch), then the product. Asynchronous.
void nvfp4_mma_linear(const DeviceMatrix& w, const float* x, int64_t n, float* y,
                      cudaStream_t stream);

}  // namespace colibri::cuda
