#include "kernels/bias.h"

namespace spark::kernels {

void bias_add_ref(float* x, const float* bias, size_t rows, size_t dim, DType store) {
  for (size_t r = 0; r < rows; ++r)
    for (size_t i = 0; i < dim; ++i) x[r * dim + i] = round_to(store, x[r * dim + i] + bias[i]);
}

}  // namespace spark::kernels
