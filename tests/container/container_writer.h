// Test helper: turns a TinyModel (tests/unit/model_writer.h) into a colibri container model —
// chosen 2-D weights replaced by `<name>` (U8 packed bytes) + `<name>.qs` (F32 scales) — and
// builds its fp32 twin, the same model with every quantized weight written back dequantized.
#pragma once

#include <bit>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "cpu/quant.h"
#include "model/container.h"
#include "model_writer.h"

namespace colibri::test {

inline Tensor f32_tensor(const std::string& name, std::vector<int64_t> shape,
                         const std::vector<float>& values) {
  Tensor t{name, "F32", std::move(shape), {}, values};
  t.bytes.resize(values.size() * 4);
  std::memcpy(t.bytes.data(), values.data(), t.bytes.size());
  return t;
}

// Values that do not sit on the int4/int8 grid, so that quantization really rounds.
inline std::vector<float> lossy_values(const std::string& name, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  const uint32_t seed = fnv1a(name);
  for (int64_t k = 0; k < n; ++k)
    v[size_t(k)] = 0.6f * std::sin(0.37f * float(k) + float(seed % 1000) * 0.01f);
  return v;
}

// Changes the model's moe_intermediate_size, rewriting every routed and shared expert tensor.
inline void set_moe_intermediate(TinyModel& m, int inter) {
  m.config["moe_intermediate_size"] = inter;
  for (Tensor& t : m.tensors) {
    if (t.name.find("mlp.experts.") == std::string::npos &&
        t.name.find("mlp.shared_experts.") == std::string::npos)
      continue;
    std::vector<int64_t> shape = t.shape;
    if (t.name.find("down_proj") != std::string::npos)
      shape[1] = inter;
    else
      shape[0] = inter;
    t = make_tensor(t.name, shape, t.dtype);
  }
}

// A U8 tensor of the given packed bytes and its F32 `.qs`, flat shapes.
inline Tensor u8_tensor(const std::string& name, std::vector<int64_t> shape,
                        const std::vector<uint8_t>& bytes) {
  return Tensor{name, "U8", std::move(shape), bytes, {}};
}

// Replaces the 2-D F32 tensor `name` of `m` by its container form with `spec` (values made
// lossy first); the twin receives the dequantized values as F32. `flat` stores the U8 tensor 1-D.
inline void quantize_in_place(TinyModel& m, TinyModel& twin, const std::string& name,
                              QuantSpec spec, bool flat = false) {
  Tensor& t = m.tensor(name);
  const int64_t rows = t.shape.at(0), cols = t.shape.at(1);
  const std::vector<float> source = lossy_values(name, rows * cols);
  const QuantMatrix q = quantize_matrix(name, spec, source.data(), rows, cols);
  std::vector<float> deq(source.size());
  kernels::dequantize(q.view(), deq.data());
  twin.tensor(name) = f32_tensor(name, {rows, cols}, deq);
  const std::vector<int64_t> shape =
      flat ? std::vector<int64_t>{int64_t(q.data.size())}
           : std::vector<int64_t>{rows, kernels::row_bytes(q.format, cols)};
  t = u8_tensor(name, shape, {q.data.begin(), q.data.end()});
  std::vector<int64_t> scale_shape = {int64_t(q.scales.size())};
  if (q.format == kernels::QuantFormat::kInt4Grouped)
    scale_shape = {rows, int64_t(q.scales.size()) / rows};
  m.tensors.push_back(
      f32_tensor(name + kQuantScaleSuffix, scale_shape, {q.scales.begin(), q.scales.end()}));
}

}  // namespace colibri::test
