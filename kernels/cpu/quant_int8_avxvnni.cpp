// int8-activation kernel for AVX2 CPUs with AVX-VNNI (compiled with -mavx2 -mfma -mavxvnni;
// called only after CPUID): the 8-row tile kernel of quant_int8_tile8.h with the VEX vpdpbusd,
// which adds 4 products a lane in one instruction where AVX2 takes pmaddubsw and pmaddwd. The
// operations: quant_int8_detail.h.
#include "cpu/quant_int8_detail.h"
#include "cpu/quant_int8_tile8.h"

namespace colibri::kernels::detail {

void int8_rows_avxvnni(const QuantMatrixView& w, const Int8Rows& x, float* y, int64_t y_stride,
                       int64_t row_begin, int64_t row_end) {
  tile8::rows<true>(w, x, y, y_stride, row_begin, row_end);
}

}  // namespace colibri::kernels::detail
