#include <cmath>

#include "kernels/swiglu.h"

namespace spark::kernels {

void swiglu_ref(const float* gate, const float* up, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

}  // namespace spark::kernels
