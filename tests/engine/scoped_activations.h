// The activations of the quantized products (kernels/cpu/quant.h), set for a scope and restored.
#pragma once

#include "cpu/quant.h"

namespace colibri::testing {

class ScopedActivations {
 public:
  explicit ScopedActivations(kernels::QuantActivations a)
      : saved_(kernels::quant_activations_selected()) {
    kernels::set_quant_activations(a);
  }
  ~ScopedActivations() { kernels::set_quant_activations(saved_); }
  ScopedActivations(const ScopedActivations&) = delete;
  ScopedActivations& operator=(const ScopedActivations&) = delete;

 private:
  kernels::QuantActivations saved_;
};

}  // namespace colibri::testing
