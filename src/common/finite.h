// NaN/Inf checks for weights at load and activations or logits at run time.
#pragma once

#include <cstddef>
#include <optional>
#include <span>
#include <string_view>

namespace colibri {

// Index of the first NaN or ±Inf in `values`, if any. One pass over the bits (exponent all ones),
// vectorised: a few GB/s per core, so cheap next to reading the same bytes from disk.
std::optional<size_t> find_non_finite(std::span<const float> values);

// Throws an Error "<what>: <value> at index <i> (N of M values are not finite)" when `values`
// holds a NaN or ±Inf. `what` names the tensor (file and name) or the activation (layer, rank).
void check_finite(std::span<const float> values, std::string_view what);

}  // namespace colibri
