// The loop over the activation rows of a batch that every per-ISA kernel file runs: a kernel
// computes up to MaxTile rows of activations per pass over the weights, the tile's row count a
// template argument (its accumulators live in registers).
//
// Included only by the per-ISA files, each compiled with its own flags: everything here has
// internal linkage (anonymous namespace), so no copy built for one ISA is linked into another
// (quant_detail.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>

namespace colibri::kernels::detail {
namespace {

// f.template operator()<T>(t0) for the tiles of n rows: T = MaxTile rows from t0 = 0, MaxTile,
// ..., the last tile the rows left.
template <int MaxTile, typename F>
void for_tiles(int64_t n, F&& f) {
  for (int64_t t0 = 0; t0 < n; t0 += MaxTile) {
    const int64_t rows = std::min<int64_t>(MaxTile, n - t0);
    [&]<int... I>(std::integer_sequence<int, I...>) {
      (void)((rows == I + 1 && (f.template operator()<I + 1>(t0), true)) || ...);
    }
    (std::make_integer_sequence<int, MaxTile>());
  }
}

}  // namespace
}  // namespace colibri::kernels::detail
