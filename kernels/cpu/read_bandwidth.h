// The machine's read-bandwidth limit: a pure streaming read, against which the kernels' rates
// are quoted (bench/quant_bench) and the plan's constants measured (colibri-node calibrate).
#pragma once

#include <cstddef>
#include <cstdint>

namespace colibri::kernels {

// Sum of p[0, bytes) as 64-bit integers, bytes rounded down to a multiple of 512, with 8
// independent vector accumulators per thread (no dependency chain: a scalar reduction would
// measure the adder) on `threads` OpenMP threads, statically split. Any alignment of p.
uint64_t read_sum(const uint8_t* p, size_t bytes, int threads);

}  // namespace colibri::kernels
