#include "model/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace colibri {
namespace {

double yarn_mscale(double scale, double mscale) {
  return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

}  // namespace

Rope::Rope(const RopeConfig& config, int dim) : dim_(dim) {
  const int half = dim / 2;
  inv_freq_.resize(static_cast<size_t>(half));
  // transformers: base ** (arange(0, dim, 2).float() / dim) in float32.
  std::vector<float> pos_freq(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i)
    pos_freq[size_t(i)] = std::pow(float(config.theta), float(2 * i) / float(dim));
  if (!config.yarn) {
    for (int i = 0; i < half; ++i) inv_freq_[size_t(i)] = 1.0f / pos_freq[size_t(i)];
    return;
  }
  const double factor = config.factor;
  if (config.attention_factor) {
    attention_factor_ = float(*config.attention_factor);
  } else if (config.mscale != 0 && config.mscale_all_dim != 0) {
    attention_factor_ =
        float(yarn_mscale(factor, config.mscale) / yarn_mscale(factor, config.mscale_all_dim));
  } else {
    attention_factor_ = float(yarn_mscale(factor, 1.0));
  }
  const auto correction_dim = [&](double rotations) {
    return dim *
           std::log(config.original_max_position_embeddings / (rotations * 2 * std::numbers::pi)) /
           (2 * std::log(config.theta));
  };
  double low = correction_dim(config.beta_fast);
  double high = correction_dim(config.beta_slow);
  if (config.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, double(dim - 1));
  if (low == high) high += 0.001;
  for (int i = 0; i < half; ++i) {
    const float ramp = std::clamp(float((float(i) - low) / (high - low)), 0.0f, 1.0f);
    const float extrapolation = 1.0f - ramp;
    const float interpolation_freq = 1.0f / (float(factor) * pos_freq[size_t(i)]);
    const float extrapolation_freq = 1.0f / pos_freq[size_t(i)];
    inv_freq_[size_t(i)] =
        interpolation_freq * (1.0f - extrapolation) + extrapolation_freq * extrapolation;
  }
}

void Rope::apply(float* x, int pos, bool interleave) const {
  const int half = dim_ / 2;
  for (int i = 0; i < half; ++i) {
    const float angle = float(pos) * inv_freq_[size_t(i)];
    const float cos = std::cos(angle) * attention_factor_;
    const float sin = std::sin(angle) * attention_factor_;
    float& a = interleave ? x[2 * i] : x[i];
    float& b = interleave ? x[2 * i + 1] : x[i + half];
    const float a0 = a, b0 = b;
    a = a0 * cos - b0 * sin;
    b = b0 * cos + a0 * sin;
  }
}

}  // namespace colibri
