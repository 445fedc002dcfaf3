// Quantized weight matrices in colibri's int4/int8 container, and the CPU kernels that read
// them in place: y = x · W^T with fp32 activations and fp32 accumulation.
//
// Container (read unchanged from the converter's safetensors; W has `rows` outputs, `cols` inputs):
//   int4 (kInt4Row, kInt4Grouped): symmetric, the stored nibble is q + 8 (q in [-8, 7]); element
//     2j sits in the low nibble of byte j of its row, element 2j+1 in the high nibble; a row takes
//     ceil(cols / 2) bytes, so for odd cols the last high nibble is padding (written as 8, never
//     read). W[o, i] = (q - 8) * s.
//   int8 (kInt8Row): one int8 per element, a row takes cols bytes. W[o, i] = q * s.
//   scales (f32): per row, [rows]; or per group of `group_size` consecutive inputs,
//     [rows, ceil(cols / group_size)] with s[o * n_groups + g]; the last group may be short.
//   Quantisation: s = max(amax / qmax, 1e-8), qmax 7 (int4) or 127 (int8), amax over the row or
//     group; q = clip(rint(w / s), -8, 7) (int4) or clip(rint(w / s), -127, 127) (int8).
//   Zero points (int4 only, optional): fp32 offsets [rows, ceil(cols / group_size)] (one a row for
//     kInt4Row), always in row order, and W[o, i] = (q - 8) * s + offset[o, i / group_size]. An
//     asymmetric checkpoint's W = (q - zp) * s is held as its nibbles and offset = -zp * s.
//
// Kernels: runtime dispatch AVX-512 -> AVX2 -> scalar (CPUID); the environment variable
// COLIBRI_ISA=scalar|avx2|avx512 caps the choice (for tests and benchmarks). Each output row is
// computed by one OpenMP thread (static schedule over rows) and each weight byte is read once per
// call, whatever the batch n, so results do not depend on the thread count.
#pragma once

#include <cstdint>

namespace colibri::kernels {

enum class QuantFormat { kInt4Row, kInt4Grouped, kInt8Row };

// Where the bytes and scales of a matrix lie in memory (same sizes either way):
//   kRows: as in the container above.
//   kTiles: rows in tiles of kTileRows = 8, each tile one contiguous span. Within tile t (rows
//     8t..8t+7), the bytes of each row are taken 32 at a time (chunk c: bytes [32c, 32c + 32) of
//     the row) and 4 at a time within a chunk (word j): byte b of word j of chunk c of row r sits
//     at data[t * 8 * row_bytes + c * 256 + j * 32 + r * 4 + b]. Grouped scales are
//     [tile][group][row]: s[(t * n_groups + g) * 8 + r]; per-row scales stay [rows]. This is the
//     order in which the 8-row int8-activation kernels (AVX2, and VNNI on 256-bit vectors) read a
//     tile (one 32-byte load per word of 8 rows, no transpose, one stream per tile). Only for
//     matrices with tiles_supported().
enum class QuantLayout { kRows, kTiles };

inline constexpr int64_t kTileRows = 8;

// A quantized [rows, cols] matrix, not owned. group_size is 0 for the per-row formats.
struct QuantMatrixView {
  QuantFormat format;
  int64_t rows, cols;
  int group_size;
  const uint8_t* data;  // [rows, row_bytes(format, cols)]
  const float* scales;  // [scale_count(format, rows, cols, group_size)]
  QuantLayout layout = QuantLayout::kRows;
  // int4 zero points: fp32 offsets [rows, offset_groups()] in row order, or null.
  const float* offsets = nullptr;
};

inline constexpr int kDefaultGroupSize = 64;

// The group sizes the container uses (the converter's candidates); any other is refused.
bool is_valid_group_size(int group_size);

// Bytes of one packed row: ceil(cols / 2) for int4, cols for int8.
int64_t row_bytes(QuantFormat format, int64_t cols);
// Bytes of the packed matrix: rows * row_bytes.
int64_t packed_bytes(QuantFormat format, int64_t rows, int64_t cols);
// Number of f32 scales: rows (per row) or rows * ceil(cols / group_size) (grouped).
int64_t scale_count(QuantFormat format, int64_t rows, int64_t cols, int group_size);

// Throws std::invalid_argument when the view is inconsistent (shape, group size for the format,
// null pointers). Every kernel below calls it once per call.
void check_view(const QuantMatrixView& w);

// Whether a matrix of this format and shape can be held as kTiles: rows a multiple of 8, cols a
// multiple of 64, and for int4-grouped a group size that is a multiple of 64.
bool tiles_supported(QuantFormat format, int64_t rows, int64_t cols, int group_size);
// Whether the dispatching kernels read w's bytes in the kTiles order natively: tiles_supported,
// int8 activations for w (int8_activations_for), and the selected ISA's int8 kernel reads tiles
// (AVX2, or AVX-512 with or without VNNI). Every kernel accepts both layouts; the others copy
// one tile at a time back to rows, which costs a copy of the weights per call. COLIBRI_TILES=0 in
// the environment turns it off (benchmarks compare both).
bool tiles_preferred(const QuantMatrixView& w);
// Copies w (either layout) into data / scales (packed_bytes / scale_count) in `layout`. The
// destination must not overlap w. Throws std::invalid_argument when kTiles is not supported.
void relayout(const QuantMatrixView& w, QuantLayout layout, uint8_t* data, float* scales);

// Quantises w [rows, cols] (f32, row-major) into data [packed_bytes] and scales [scale_count] with
// the container's rule. group_size is ignored (pass 0) for the per-row formats.
void quantize(QuantFormat format, int group_size, const float* w, int64_t rows, int64_t cols,
              uint8_t* data, float* scales);

// out [rows, cols] = W, exactly (each element is one f32 product (q - 8) * s or q * s, plus its
// offset where w has zero points).
void dequantize(const QuantMatrixView& w, float* out);

// ---- zero points -----------------------------------------------------------------------------
//
// Every kernel below adds a matrix's zero-point terms to its symmetric product:
//   y[t, o] += sum over groups g of offset[o, g] * (sum of x[t, i] over the inputs i of group g),
// the group sums taken from the fp32 activations in either activation mode (int8 activations
// quantize x for the nibbles' product only). Each output is summed by one thread in a fixed order.

// Groups of w's offsets a row: ceil(cols / group_size), or 1 for kInt4Row.
int64_t offset_groups(const QuantMatrixView& w);
// y[n, rows] += the zero-point terms of w for x [n, cols] (nothing when w has no offsets).
void add_zero_point_terms(const QuantMatrixView& w, const float* x, int64_t n, float* y);
// The reference: each term summed input by input, offset[o, i / group_size] * x[t, i], in double.
void add_zero_point_terms_scalar(const QuantMatrixView& w, const float* x, int64_t n, float* y);

// y[n, rows] = x[n, cols] · W^T, fp32 accumulation, on the dispatched ISA (see quant_isa()).
// n = 1 is decode; small batches (n up to ~64) reuse each unpacked weight block for every row of
// x. No heap allocation once the per-thread scratch has grown to n * cols floats.
void quant_linear(const QuantMatrixView& w, const float* x, int64_t n, float* y);

// The always-built reference: same contract, plain C++, OpenMP over output rows.
void quant_linear_scalar(const QuantMatrixView& w, const float* x, int64_t n, float* y);

// Routed-expert FFN: y[n, hidden] = down(silu(gate x) * up x), with gate and up [inter, hidden]
// and down [hidden, inter]; silu(g) = g / (1 + exp(-g)). One OpenMP region: gate/up rows, then a
// barrier, then down rows. Shapes are checked (std::invalid_argument).
void quant_expert_ffn(const QuantMatrixView& gate, const QuantMatrixView& up,
                      const QuantMatrixView& down, const float* x, int64_t n, float* y);

// ---- instruction-set selection ---------------------------------------------------------------

enum class QuantIsa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// "scalar", "avx2", "avx512".
const char* quant_isa_name(QuantIsa isa);
// True when this build has the ISA's kernels and the CPU supports it (AVX-512: F, BW, VL).
bool quant_isa_available(QuantIsa isa);
// The ISA the dispatching kernels use given a COLIBRI_ISA value (nullptr or "" = no cap): the
// best available one, capped at the named one. Throws std::invalid_argument on an unknown name
// or when the named ISA is not available here (no silent fallback to something else).
QuantIsa quant_isa_resolve(const char* cap);
// The dispatched ISA, resolved once from COLIBRI_ISA at first use.
QuantIsa quant_isa_selected();
// Its name.
const char* quant_isa();

// BF16 pairs: on AVX-512 CPUs with AVX512_BF16, a product with one activation row and int4
// weights (per row, or groups that are multiples of 64) carries each activation as two BF16
// values hi + lo (within 2^-18 of it) and multiplies them with vdpbf16ps, summing in fp32: about
// half the instructions of the fp32 kernel, which bound it at one row. Available: the CPU and
// build have it; enabled: available and not turned off (set_bf16_pairs, or COLIBRI_BF16_PAIRS=0
// in the environment; tests and benchmarks compare both).
bool bf16_pairs_available();
bool bf16_pairs_enabled();
void set_bf16_pairs(bool allowed);

// The same kernels on an explicit ISA (throws std::invalid_argument when it is not available):
// for tests that compare every ISA with the reference, and for benchmarks.
void quant_linear(QuantIsa isa, const QuantMatrixView& w, const float* x, int64_t n, float* y);
void quant_expert_ffn(QuantIsa isa, const QuantMatrixView& gate, const QuantMatrixView& up,
                      const QuantMatrixView& down, const float* x, int64_t n, float* y);

// ---- int8 activations ------------------------------------------------------------------------
//
// The activations of each row are quantized to int8 in blocks of 64 inputs (scale amax / 127,
// round to nearest; quant_int8_detail.h) and multiplied with the int4/int8 weights as integers
// (vpdpbusd with AVX-512 VNNI or AVX-VNNI, else pmaddubsw): a block's dot product is exact, then
// scaled in fp32. Each row is quantized alone, so a row's result does not depend on the batch; the
// error against fp32 activations is that of rounding each input to 1/254 of its block's largest
// magnitude. Used for every batch size, decode included, by quant_linear(w, ...) and
// quant_expert_ffn(gate, ...) when selected and supported; otherwise those run fp32 activations.

// kMixed: int8 activations for int4 weights, fp32 for int8 weights.
enum class QuantActivations { kF32 = 0, kInt8 = 1, kMixed = 2 };

// "f32", "int8", "mixed".
const char* quant_activations_name(QuantActivations a);
// Parses a name as above (nullptr or "" gives the default, kInt8); throws std::invalid_argument.
QuantActivations quant_activations_resolve(const char* name);
// The precision the dispatching kernels use: COLIBRI_ACTIVATIONS at first use unless set below.
QuantActivations quant_activations_selected();
void set_quant_activations(QuantActivations a);

// True for the formats the int8 path takes: int4 and int8 per row, int4 with groups that are
// multiples of 64 (the blocks never straddle a group).
bool int8_activations_supported(const QuantMatrixView& w);
// Whether quant_linear(w, ...) and quant_expert_ffn take int8 activations for w: supported, and
// selected for its format.
bool int8_activations_for(const QuantMatrixView& w);
// VNNI: vpdpbusd, 4 products a lane in one instruction. The int8 kernels on AVX-512 use AVX-512
// VNNI where the CPU has it; on AVX2 (or AVX-512 without it), AVX-VNNI on ymm where the CPU has
// that; otherwise pmaddubsw + pmaddwd. Available: the CPU and build have one; enabled: available
// and not turned off (set_vnni, or COLIBRI_VNNI=0 in the environment; the kernel tests run both).
bool vnni_available();
bool vnni_enabled();
void set_vnni(bool allowed);
// Whether the int8 kernels on `isa` use VNNI now.
bool int8_activations_vnni(QuantIsa isa);
// AMX: tdpbssd on int8 tiles (Sapphire Rapids and later), 16 x 16 outputs by 64 inputs in one
// instruction. The int8 kernels on AVX-512 use it for products of at least kAmxMinRows rows of
// activations (a prompt chunk, a full batch; fewer stay on VNNI), every format the int8 path
// takes, either layout, bit for bit the same results. Available: the build is for x86-64 Linux, the
// CPU has AMX-TILE and AMX-INT8, and the kernel grants the tile state (arch_prctl
// ARCH_REQ_XCOMP_PERM, asked once); enabled: available and not turned off (set_amx, or
// COLIBRI_AMX=0 in the environment).
inline constexpr int64_t kAmxMinRows = 32;
bool amx_available();
bool amx_enabled();
void set_amx(bool allowed);
// Whether the int8 kernels on `isa` use AMX now for n rows of activations.
bool int8_activations_amx(QuantIsa isa, int64_t n);
// The tile-multiply peak on the calling thread, in int8 operations per second (a multiply-add is
// two): a loop of tdpbssd on resident tiles for about `seconds`. 0 where AMX is not available.
double amx_int8_peak_ops(double seconds);

// The int8-activation kernels on an explicit ISA (std::invalid_argument when the ISA is not
// available or a format is not supported).
void quant_linear_int8(QuantIsa isa, const QuantMatrixView& w, const float* x, int64_t n, float* y);
void quant_expert_ffn_int8(QuantIsa isa, const QuantMatrixView& gate, const QuantMatrixView& up,
                           const QuantMatrixView& down, const float* x, int64_t n, float* y);

// One row's quantization in natural order, for tests: q [cols], scales [ceil(cols / 64)].
void quantize_activations_int8(const float* x, int64_t cols, int8_t* q, float* scales);

}  // namespace colibri::kernels
