#include <cmath>

#include "kernels/rmsnorm.h"

namespace spark::kernels {

void rmsnorm_ref(const float* x, const float* w, float* y, size_t rows, size_t dim, float eps) {
  for (size_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    double ss = 0;
    for (size_t i = 0; i < dim; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    double inv = 1.0 / std::sqrt(ss / static_cast<double>(dim) + eps);
    for (size_t i = 0; i < dim; ++i) yr[i] = static_cast<float>(xr[i] * inv * w[i]);
  }
}

}  // namespace spark::kernels
